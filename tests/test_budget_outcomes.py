"""The adaptive budget on a scripted machine: prices by context, luck at start, measured outcomes.

A :class:`Machine` stands in for the engine: each pass costs a fixed time, a time per row and a
time per row and token of context, with noise, on the budget's own (fake) clock. Steps run as the
engine runs them: learn, target pass, plan, draft levels, drafts sent. No engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from test_budget import fake_clock  # the budget's clock, scripted

from vllm_eagle2.budget import outcomes as outcomes_module
from vllm_eagle2.budget.adaptive import AdaptiveBudget
from vllm_eagle2.budget.outcomes import PROBE_EVERY, PROBE_STEPS, Outcomes


@dataclass
class Machine:
    """Seconds of a target pass: ``fixed + per_row * rows + context * rows * held`` (``held``: the
    context per request), of a level the same at a tenth; ``drafting_extra``: what a drafting
    step costs besides (unseen by any pass: the prices cannot know it); ``noise``: the relative
    spread of every pass; ``stall``: the first ``stalled`` passes take this many times longer."""

    fixed: float = 0.020
    per_row: float = 0.0005
    context: float = 2e-6
    drafting_extra: float = 0.0
    noise: float = 0.0
    stall: float = 1.0
    stalled: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.passes = 0

    def _noisy(self, seconds: float) -> float:
        self.passes += 1
        stall = self.stall if self.passes <= self.stalled else 1.0
        return stall * seconds * (1.0 + self.noise * self.rng.uniform(-1.0, 1.0))

    def target(self, rows: int, held: float) -> float:
        return self._noisy(self.fixed + self.per_row * rows + self.context * rows * held)

    def level(self, rows: int, held: float) -> float:
        return self._noisy(0.1 * (self.fixed + self.per_row * rows + self.context * rows * held))


def calibrated(machine: Machine, top1: float = 0.6, **kw) -> AdaptiveBudget:
    """A budget of depth 4, topk 3, 12 nodes, calibrated on ``machine``, its head accepting its
    likeliest child with probability ``top1`` at every depth."""
    kw = {"depth": 4, "topk": 3, "max_nodes": 12, "chain": False, "max_batch": 16, "max_tokens": 256, **kw}
    budget = AdaptiveBudget(device=torch.device("cpu"), **kw)

    def time_target(tokens: int, context: int | None) -> tuple[float, float]:
        held = float(context or 1)
        return machine.target(tokens, held), held

    budget.calibrate(time_target, lambda rows: machine.level(rows, 1.0), long_context=2048, level_share=0.1)
    set_acceptance(budget, top1, accepted=0.0)
    return budget


def set_acceptance(budget: AdaptiveBudget, top1: float, accepted: float) -> None:
    """The device table as if the head's likeliest child were accepted with probability ``top1``
    at every depth (its other children a third as often), and the step's verification had
    accepted ``accepted`` drafts; copied to the host as the drafter copies it."""
    table, topk = budget.acceptance, budget.acceptance.topk
    p = top1 * (1 / 3) ** np.arange(topk)
    table.stats.zero_()
    table.stats[:, :topk] = 1000.0
    table.stats[:, topk : 2 * topk] = torch.tensor(1000.0 * p)
    table.accepted.fill_(accepted)
    table.copy_to_host()


def run_steps(
    budget: AdaptiveBudget,
    machine: Machine,
    now: list[float],
    steps: int,
    batch: int,
    held: float,
    top1: float = 0.6,
    realised: float | None = None,
    prefill_every: int = 0,
) -> list:
    """``steps`` decoding steps of ``batch`` requests holding ``held`` tokens of context each; the
    plan of each. Drafts are accepted at ``realised`` per drafted request (default: as the
    acceptance table says, the chain of likeliest children). Every ``prefill_every``-th step also
    prefills a new request's 100 prompt tokens (0: none)."""
    plans, sent = [], [0] * batch
    for i in range(steps):
        verifies = sum(sent) > 0
        prompt = 100 if prefill_every and i % prefill_every == 0 else 0
        tokens = batch + sum(sent) + prompt
        times = budget.learn(tokens, prompt, verifies=verifies, context=held)
        now[0] += machine.target(tokens, held)
        times.target_done()
        share = budget.plan(batch, times=times)
        plan = share.plan
        if plan.drafts:
            for rows in [batch] + [batch * plan.topk] * (plan.depth - 1):
                times.level_started(rows)
                now[0] += machine.level(rows, held)
            times.drafting_done()
            now[0] += machine.drafting_extra
        expected = sum(top1**d for d in range(1, plan.depth + 1))
        accepted = (expected if realised is None else realised) * batch if verifies else 0.0
        set_acceptance(budget, top1, accepted)
        sent = [plan.per_request] * batch if plan.drafts else [0] * batch
        times.drafts_sent(plan, sent)
        now[0] += 0.001  # the engine's own work between steps
        plans.append(plan)
    return plans


def priced_rate(budget: AdaptiveBudget, plan, batch: int, held: float) -> float:
    """The tokens per second ``budget``'s prices expect of ``plan`` (its gain as planned)."""
    from vllm_eagle2.budget.decisions import step_cost

    return batch * (1.0 + plan.gain) / step_cost(plan, batch, **budget.prices.costs(held))


def best_rate(budget: AdaptiveBudget, batch: int, held: float) -> float:
    """The rate of the plan ``budget``'s prices choose now."""
    return priced_rate(budget, budget._draft_plan(batch, budget.prices.costs(held)), batch, held)


# --- prices by context ---------------------------------------------------------------------------


def test_calibration_prices_the_context_a_pass_reads(monkeypatch):
    fake_clock(monkeypatch)
    budget = calibrated(Machine(context=2e-6))
    assert budget.prices.context == pytest.approx(2e-6, rel=0.01)
    costs = budget.prices.costs(context=1000.0)
    # a 16-row pass at 1,000 tokens of context: its rows' reads on top of the no-context price
    assert costs["target"](16) == pytest.approx(0.020 + 0.0005 * 16 + 2e-6 * 16 * 1000, rel=0.02)


def test_calibration_times_the_target_up_to_the_widest_decoding_step(monkeypatch):
    """16 requests with 12 drafts each verify 208 rows at most: no pass past the 256 knot runs,
    however large the step's token budget (prefill chunks, which no plan prices)."""
    fake_clock(monkeypatch)
    machine = Machine()
    timed: list[int] = []
    budget = AdaptiveBudget(
        depth=4, topk=3, max_nodes=12, chain=False, max_batch=16, max_tokens=8192, device=torch.device("cpu")
    )
    budget.calibrate(
        lambda tokens, context: (timed.append(tokens) or machine.target(tokens, 1.0), 1.0),
        lambda rows: machine.level(rows, 1.0),
        long_context=2048,
    )
    assert max(timed) == 256


def test_a_long_context_makes_the_same_batch_draft_less(monkeypatch):
    now = fake_clock(monkeypatch)
    machine = Machine(context=4e-6)
    short = calibrated(machine)
    long = calibrated(machine)
    short_plans = run_steps(short, machine, now, 30, batch=8, held=100.0)
    long_plans = run_steps(long, machine, now, 30, batch=8, held=4000.0)
    assert short_plans[-1].drafts
    assert long_plans[-1].per_request < short_plans[-1].per_request


def test_scripted_costs_price_context(monkeypatch):
    from vllm_eagle2.budget.costs import COSTS_ENV

    monkeypatch.setenv(COSTS_ENV, '{"target": [0.02, 0.0005], "level": [0.002, 0.0001], "context": 2e-6}')
    budget = AdaptiveBudget(
        depth=4, topk=3, max_nodes=12, chain=False, max_batch=16, max_tokens=256, device=torch.device("cpu")
    )
    assert budget.prices.costs(1000.0)["verify"](16) == pytest.approx(0.02 + 0.0005 * 16 + 2e-6 * 16 * 1000)


# --- luck at start -------------------------------------------------------------------------------


@pytest.mark.parametrize(("held", "drafts"), [(100.0, True), (1500.0, False)])
def test_a_fresh_budget_plans_what_a_warmed_one_plans(monkeypatch, held, drafts):
    """Its first plan, priced by the warmed budget, is as good as the warmed budget's own (shapes
    of equal rate may differ): drafts at a cheap context, none at a dear one."""
    now = fake_clock(monkeypatch)
    machine = Machine(context=3e-6, noise=0.1)
    first = run_steps(calibrated(machine), machine, now, 1, batch=4, held=held)[0]
    warmed = calibrated(machine)
    run_steps(warmed, machine, now, 200, batch=4, held=held)
    assert warmed._draft_plan(4, warmed.prices.costs(held)).drafts == drafts
    assert priced_rate(warmed, first, 4, held) >= 0.95 * best_rate(warmed, 4, held)


def test_a_budget_whose_first_passes_stalled_plans_within_a_few_steps_what_a_warmed_one_plans(monkeypatch):
    now = fake_clock(monkeypatch)
    warmed_machine = Machine(context=3e-6, noise=0.1)
    warmed = calibrated(warmed_machine)
    run_steps(warmed, warmed_machine, now, 200, batch=4, held=500.0)
    # The calibration and the first steps' passes 3x slower: an engine that started beside other work.
    machine = Machine(context=3e-6, noise=0.1, stall=3.0, stalled=80, seed=1)
    unlucky = calibrated(machine)
    assert machine.passes < machine.stalled  # the stall outlasts the calibration
    plans = run_steps(unlucky, machine, now, 40, batch=4, held=500.0)
    assert machine.passes > machine.stalled
    assert priced_rate(warmed, plans[-1], 4, 500.0) >= 0.97 * best_rate(warmed, 4, 500.0)


# --- measured outcomes ---------------------------------------------------------------------------


def test_drafting_that_yields_less_than_priced_is_vetoed_and_probed_rarely(monkeypatch):
    """The prices see every pass, but the drafts are accepted far less often than the table says
    (a head that does not fit the prompts): the steps that draft measure slower than plain ones."""
    now = fake_clock(monkeypatch)
    machine = Machine(noise=0.05)
    budget = calibrated(machine, top1=0.8)
    plans = run_steps(budget, machine, now, 400, batch=4, held=200.0, top1=0.8, realised=0.0)
    later = plans[200:]
    drafting = sum(p.drafts for p in later) / len(later)
    assert drafting <= PROBE_STEPS / PROBE_EVERY + 0.02, drafting
    summary = budget.summary()
    assert summary["steps_vetoed"] > 150 and summary["probes"] >= 3
    rates = summary["measured_rates"]["4"]
    assert rates["drafting"] < rates["plain"]


def test_a_fresh_band_measures_plain_decoding_as_soon_as_its_drafting(monkeypatch):
    """The same loss from the first step: plain decoding is probed once drafting has its few
    measured steps, and the veto comes within a few steps more (not after a due probe's 48)."""
    now = fake_clock(monkeypatch)
    machine = Machine(noise=0.05)
    budget = calibrated(machine, top1=0.8)
    plans = run_steps(budget, machine, now, 24, batch=4, held=200.0, top1=0.8, realised=0.0)
    assert sum(p.drafts for p in plans) <= 2 * (outcomes_module.MIN_STEPS + 1)
    assert budget.summary()["probes"] == 1 and not plans[-1].drafts


def test_prefills_between_the_steps_keep_the_outcome_check_measuring(monkeypatch):
    """A new request's prefill every other step (at batch 16 over 64 prompts: one in three) counts to
    neither arm but does not break either's run: plain decoding is measured and the loss vetoed."""
    now = fake_clock(monkeypatch)
    machine = Machine(noise=0.05)
    budget = calibrated(machine, top1=0.8)
    plans = run_steps(budget, machine, now, 400, batch=4, held=200.0, top1=0.8, realised=0.0, prefill_every=2)
    assert sum(p.drafts for p in plans[200:]) <= 200 * (PROBE_STEPS / PROBE_EVERY + 0.02)
    assert budget.summary()["steps_vetoed"] > 150


def test_drafting_that_pays_keeps_running_between_rare_plain_probes(monkeypatch):
    now = fake_clock(monkeypatch)
    machine = Machine(noise=0.05)
    budget = calibrated(machine, top1=0.8)
    plans = run_steps(budget, machine, now, 400, batch=4, held=200.0, top1=0.8)
    later = plans[200:]
    plain = sum(not p.drafts for p in later) / len(later)
    assert 0 < plain <= PROBE_STEPS / PROBE_EVERY + 0.02, plain
    summary = budget.summary()
    assert summary["steps_vetoed"] == 0
    rates = summary["measured_rates"]["4"]
    assert rates["drafting"] > rates["plain"]


def test_a_drafting_step_dearer_than_its_passes_is_vetoed(monkeypatch):
    """Something each drafting step costs that no pass shows (here 40 ms): outcomes see it."""
    now = fake_clock(monkeypatch)
    machine = Machine(noise=0.05, drafting_extra=0.040)
    budget = calibrated(machine, top1=0.6)
    budget.prices.observe_overheads = lambda *args: None  # the prices never learn it
    plans = run_steps(budget, machine, now, 300, batch=4, held=200.0)
    assert sum(p.drafts for p in plans[150:]) <= 150 * (PROBE_STEPS / PROBE_EVERY + 0.02)


def test_the_outcome_check_decides_from_its_state_alone():
    """Two ranks' checks agree whenever their states do (what :meth:`AdaptiveBudget._agree` shares)."""
    a, b = Outcomes(16), Outcomes(16)
    rng = np.random.default_rng(0)
    for _ in range(200):
        a.record(4, bool(rng.integers(2)), 4 + rng.uniform(0, 4), rng.uniform(0.02, 0.04))
        b.load_state(a.state())
        assert a.check(4) == b.check(4)
        assert np.array_equal(a.state(), b.state())


def test_a_stalled_step_counts_at_most_a_few_times_its_arm(monkeypatch):
    outcomes = Outcomes(4)
    for _ in range(outcomes_module.MIN_STEPS):
        outcomes.record(1, False, 1.0, 0.05)
    outcomes.record(1, False, 1.0, 60.0)  # the engine waited a minute for requests
    assert outcomes.rate(1, False) > 1.0 / (outcomes_module.STALL * 0.05 + 0.05)
