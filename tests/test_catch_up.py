"""A step that sends no drafts does no head work; the head's catch-up waits and runs when drafting
resumes, so the drafts after a pause are the drafts without one (``vllm_eagle2.engine.catch_up``).

The engine runs in this process (``run_llm``), so a test can pause drafting at chosen steps by
wrapping the proposer's plan, and record every tree it drafted by the position of its root.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_llm
from test_engine_lossless import eagle2, greedy, token_prompts, tokens_of

from vllm_eagle2.budget.costs import COSTS_ENV
from vllm_eagle2.budget.decisions import NO_DRAFTS
from vllm_eagle2.engine import catch_up as catch_up_module
from vllm_eagle2.engine import proposer as proposer_module
from vllm_eagle2.engine.catch_up import DeferredCatchUp, WaitingStep, step_rows
from vllm_eagle2_tools.testing import build_eagle3_head, build_pair

#: Step costs under which no draft ever pays: the adaptive budget sends none.
NEVER = '{"target": [0.0, 1.0], "level": [1.0, 0.0], "overhead": 0.0}'
#: Steps (counted from the first plan) at which drafting pauses; the run takes about 30 steps.
PAUSES = (range(4, 10), range(14, 22))
MAX_TOKENS = 64


def waiting_rows(catch_up: DeferredCatchUp, req_ids: list[str], positions: list[int], counts=None) -> None:
    """One waiting step of decoding rows (or ``counts`` rows per request); row r's hidden state and
    token are r + 10 x (its step)."""
    counts = np.ones(len(req_ids), np.int64) if counts is None else np.array(counts)
    n = int(counts.sum())
    values = torch.arange(n) + 10 * len(catch_up.waiting)
    catch_up.defer(WaitingStep(req_ids, counts, np.array(positions), values.float().unsqueeze(1), values))


def test_waiting_rows_are_grouped_by_request_in_batch_order():
    catch_up = DeferredCatchUp(max_rows=64)
    waiting_rows(catch_up, ["a", "b"], [10, 20])
    waiting_rows(catch_up, ["a", "b"], [11, 21])
    rows = catch_up.take({"b": 0, "a": 1}, np.array([22, 12]))
    assert rows.batch_rows.tolist() == [0, 1] and rows.counts.tolist() == [2, 2]
    assert rows.positions.tolist() == [20, 21, 10, 11]
    assert rows.hidden.squeeze(1).tolist() == [1, 11, 0, 10] and rows.tokens.tolist() == [1, 11, 0, 10]
    assert catch_up.take({"a": 0}, np.array([12])) is None  # taken once


def test_a_prefill_waits_as_rows_of_its_prompt_before_its_decoding_rows():
    catch_up = DeferredCatchUp(max_rows=64)
    waiting_rows(catch_up, ["a", "new"], [7, 0, 1, 2], counts=[1, 3])  # "new" joins with a 3-token prompt
    waiting_rows(catch_up, ["new", "a"], [3, 8])
    rows = catch_up.take({"a": 0, "new": 1}, np.array([9, 4]))
    assert rows.counts.tolist() == [2, 4] and rows.positions.tolist() == [7, 8, 0, 1, 2, 3]
    assert rows.tokens.tolist() == [0, 11, 1, 2, 3, 10]


def test_rows_that_no_longer_end_where_the_request_resumes_are_dropped():
    catch_up = DeferredCatchUp(max_rows=64)
    waiting_rows(catch_up, ["a", "b", "c"], [10, 20, 30])
    waiting_rows(catch_up, ["a", "b", "c"], [11, 21, 31])
    # a resumes right after its rows; b came back elsewhere (preempted and recomputed); c left.
    rows = catch_up.take({"a": 0, "b": 1}, np.array([12, 5]))
    assert rows.batch_rows.tolist() == [0] and rows.positions.tolist() == [10, 11]
    assert catch_up.rows_dropped == 4


def test_a_verifying_steps_rejected_rows_are_replaced_by_the_next_steps():
    """a verified 2 drafts at 11-12 and accepted 1: its next step starts at 12, whose row replaces
    the rejected one; b verified 1 draft at 21 and accepted none."""
    catch_up = DeferredCatchUp(max_rows=64)
    waiting_rows(catch_up, ["a", "b"], [10, 11, 12, 20, 21], counts=[3, 2])
    waiting_rows(catch_up, ["a", "b"], [12, 21])
    rows = catch_up.take({"a": 0, "b": 1}, np.array([13, 22]))
    assert rows.counts.tolist() == [3, 2] and rows.positions.tolist() == [10, 11, 12, 20, 21]
    assert rows.tokens.tolist() == [0, 1, 10, 3, 11] and catch_up.rows_dropped == 0


def room(catch_up: DeferredCatchUp, rows: int, starts: list[int]) -> bool:
    """``has_room`` for a decoding step of requests a, b, c, d at ``starts``, one row each."""
    starts = np.array(starts)
    return catch_up.has_room(rows, ["a", "b", "c", "d"][: len(starts)], starts, starts + 1)


def test_the_waiting_rows_fit_one_head_pass():
    catch_up = DeferredCatchUp(max_rows=10)
    for step in range(2):
        assert room(catch_up, 4, [step] * 4)
        waiting_rows(catch_up, ["a", "b", "c", "d"], [step] * 4)
    assert not room(catch_up, 4, [2] * 4)  # 12 rows would not fit one head pass


def test_without_prefix_caching_rows_wait_until_drafting_resumes():
    catch_up = DeferredCatchUp(max_rows=1000, block_size=0, max_steps=2)
    for step in range(40):
        assert room(catch_up, 2, [step, step])
        waiting_rows(catch_up, ["a", "b"], [step, step])


def test_rows_in_full_blocks_wait_at_most_max_steps():
    """Under prefix caching a full block's head K/V may be read by a later request: its rows run
    within ``max_steps``; the rows of a request's last, partial block wait on."""
    catch_up = DeferredCatchUp(max_rows=1000, block_size=8, max_steps=2)
    for step in range(5):  # a at 0-4 and b at 10-14: their blocks (0-7, 8-15) not full yet
        assert room(catch_up, 2, [step, 10 + step])
        waiting_rows(catch_up, ["a", "b"], [step, 10 + step])
    assert not room(catch_up, 2, [5, 15])  # b's row at 15 fills block 8-15
    fresh = DeferredCatchUp(max_rows=1000, block_size=8, max_steps=2)
    waiting_rows(fresh, ["a", "b"], [0, 10])
    assert room(fresh, 2, [1, 16])  # a block is full, but its rows waited less than max_steps


def test_a_steps_rows_pair_each_token_with_the_one_after_it():
    """As the head's first pass reads them: the next scheduled token, or after a request's last
    row the token sampled there."""
    step = step_rows(
        ["a", "b"],
        query_start_loc=np.array([0, 1, 4]),
        starts=np.array([9, 0]),
        input_ids=torch.tensor([5, 6, 7, 8, 0, 0], dtype=torch.int32),
        hidden=torch.arange(6).float().unsqueeze(1),
        sampled=torch.tensor([[50], [80]], dtype=torch.int32),
    )
    assert step.counts.tolist() == [1, 3] and step.positions.tolist() == [9, 0, 1, 2]
    assert step.tokens.tolist() == [50, 7, 8, 80] and step.hidden.squeeze(1).tolist() == [0, 1, 2, 3]


def test_a_verifying_steps_rows_are_followed_by_their_samples():
    """Request a verified 2 drafts (its rows in chain order): root and drafts are followed by its
    samples, whatever it accepted; b, a 2-token prompt in the same step, by its next token and then
    its one sample."""
    step = step_rows(
        ["a", "b"],
        query_start_loc=np.array([0, 3, 5]),
        starts=np.array([10, 0]),
        input_ids=torch.tensor([5, 6, 7, 8, 9, 0], dtype=torch.int32),
        hidden=torch.arange(6).float().unsqueeze(1),
        sampled=torch.tensor([[60, 61, -1], [90, -1, -1]], dtype=torch.int32),
        drafts=np.array([2, 0]),
    )
    assert step.positions.tolist() == [10, 11, 12, 0, 1]
    assert step.tokens.tolist() == [60, 61, -1, 9, 90]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The partial target, and per head format a head that agrees with it part of the time."""
    root = tmp_path_factory.mktemp("catch_up")
    target, head = build_pair(root / "partial", "partial", seed=0)
    eagle3 = build_eagle3_head(root / "eagle3", target, kind="partial", draft_vocab_size=400)
    return target, {"eagle": head, "eagle3": eagle3}


@pytest.fixture(scope="module")
def prompts():
    return token_prompts(8, 512, seed=0)


@pytest.fixture(scope="module")
def reference(pair, prompts):
    outputs, _ = run_llm(pair[0], None, prompts, greedy(MAX_TOKENS))
    return tokens_of(outputs)


def test_a_budget_that_never_drafts_runs_no_head_pass_between_flushes(pair, prompts, reference, monkeypatch):
    monkeypatch.setenv(COSTS_ENV, NEVER)
    outputs, metrics = run_llm(
        pair[0],
        {"method": "eagle2", "model": str(pair[1]["eagle"]), "lookup": 0},
        prompts,
        greedy(MAX_TOKENS),
    )
    assert tokens_of(outputs) == reference
    stats = metrics["eagle2"]
    assert stats["drafts"] == 0
    steps = stats["catch_up_deferred_steps"]
    assert steps >= 50  # every decoding step of the 64-token run waited
    # Head passes: one per 16 waiting steps, the prefills' included.
    assert stats["head_passes"] == stats["catch_up_flushes"]
    assert stats["catch_up_flushes"] <= steps // 16 + 1


def test_rows_of_a_request_that_finishes_while_they_wait_never_run(pair, monkeypatch):
    """Four requests end after 24 tokens while their rows wait (no block of theirs fills); the
    100-token prompt's first block fills 4 tokens later and the rows run: the finished requests'
    are dropped, none of theirs ran (before, the rows ran every 16 steps)."""
    from vllm import SamplingParams

    rng = np.random.default_rng(0)
    lengths = [3, 100, 9, 33, 5, 40, 20, 60]  # the cache's blocks hold 128 tokens
    prompts = [{"prompt_token_ids": rng.integers(6, 512, n).tolist()} for n in lengths]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24 if i % 2 == 0 else 64, ignore_eos=True)
        for i in range(8)
    ]
    plain, _ = run_llm(pair[0], None, prompts, params)
    monkeypatch.setenv(COSTS_ENV, NEVER)
    outputs, metrics = run_llm(
        pair[0], {"method": "eagle2", "model": str(pair[1]["eagle"]), "lookup": 0}, prompts, params
    )
    assert tokens_of(outputs) == tokens_of(plain)
    stats = metrics["eagle2"]
    assert stats["drafts"] == 0 and stats["catch_up_flushes"] >= 1
    # Their prompts and 23 tokens each (the last sampled is never scheduled).
    assert stats["catch_up_rows_dropped"] == sum(lengths[0::2]) + 4 * 23


def drafting_record(monkeypatch, *, catch_up: str) -> dict[tuple, tuple[int, list[int]]]:
    """Run-time hooks: drafting pauses at the steps in :data:`PAUSES`; every tree drafted is recorded
    as (prompt, root position) -> (step, drafts). ``catch_up``: "waits" (eagle2's way), "every step"
    (each step runs its own catch-up pass, as before it could wait) or "dropped" (the waiting rows
    are thrown away: the head's context gets gaps)."""
    record: dict[tuple, tuple[int, list[int]]] = {}
    steps = {"n": 0}
    fit = proposer_module.fit_level_rows

    def paused_fit(plan, batch, max_rows):
        steps["n"] += 1
        return NO_DRAFTS if any(steps["n"] in r for r in PAUSES) else fit(plan, batch, max_rows)

    class RootsSeen(proposer_module.TreeExpander):
        def __init__(self, proposer, cad, root_pos, root_hidden, **kwargs):
            super().__init__(proposer, cad, root_pos, root_hidden, **kwargs)
            proposer._test_roots = root_pos.tolist()

    propose = proposer_module.Eagle2Proposer.propose

    def recorded(self, *args, **kwargs):
        self._test_roots = None
        drafts = propose(self, *args, **kwargs)
        if self._test_roots is not None:
            for rid, root, tokens in zip(self.runner.input_batch.req_ids, self._test_roots, drafts):
                prompt = tuple(self.runner.requests[rid].prompt_token_ids)  # ids differ between engines
                record[(prompt, root)] = (steps["n"], list(tokens))
        return drafts

    def dropped(self, *args):
        self.rows_dropped += self.rows
        self.waiting.clear()

    monkeypatch.setattr(proposer_module, "fit_level_rows", paused_fit)
    monkeypatch.setattr(proposer_module, "TreeExpander", RootsSeen)
    monkeypatch.setattr(proposer_module.Eagle2Proposer, "propose", recorded)
    if catch_up == "every step":
        monkeypatch.setattr(catch_up_module, "rows_may_wait", lambda *args: False)
    elif catch_up == "dropped":
        monkeypatch.setattr(DeferredCatchUp, "take", dropped)
    return record


def run_with_pauses(pair, prompts, monkeypatch, catch_up: str, head: str = "eagle"):
    record = drafting_record(monkeypatch, catch_up=catch_up)
    spec = eagle2(pair[1][head], num_speculative_tokens=12, depth=4, topk=3)
    outputs, metrics = run_llm(pair[0], spec, prompts, greedy(MAX_TOKENS))
    monkeypatch.undo()
    return tokens_of(outputs), metrics, record


@pytest.fixture(scope="module")
def caught_up_every_step(pair, prompts):
    """``get(head)``: the run with pauses whose steps each ran their own catch-up, run on first use."""
    done = {}

    def get(head: str = "eagle"):
        if head not in done:
            with pytest.MonkeyPatch.context() as mp:
                done[head] = run_with_pauses(pair, prompts, mp, "every step", head)
        return done[head]

    return get


def resumed(record) -> list[tuple]:
    """The trees drafted in the first step after each pause."""
    return [key for key, (step, drafts) in record.items() if drafts and any(step == r.stop for r in PAUSES)]


def accepted(metrics) -> list[int]:
    """Drafts accepted at each draft position (vLLM's counters)."""
    return metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]


@pytest.mark.parametrize("head", ["eagle", "eagle3"])
def test_drafts_after_a_pause_are_the_drafts_without_one(
    pair, prompts, reference, caught_up_every_step, monkeypatch, head
):
    """EAGLE-3 heads too: their waiting rows are the target's auxiliary hidden states."""
    tokens, metrics, record = run_with_pauses(pair, prompts, monkeypatch, "waits", head)
    base_tokens, base_metrics, base = caught_up_every_step(head)
    assert tokens == base_tokens == reference
    assert base_metrics["eagle2"]["catch_up_deferred_steps"] == 0
    stats = metrics["eagle2"]
    # Every step of a pause waits, its first too, which verifies the drafts sent before it: its
    # rows past the accepted ones are dropped (else the trees after the pause would differ).
    assert stats["catch_up_deferred_steps"] == sum(len(r) for r in PAUSES)
    assert stats["catch_up_flushes"] == len(PAUSES) and stats["catch_up_rows_dropped"] == 0
    assert stats["head_passes"] < base_metrics["eagle2"]["head_passes"]
    # The same trees at the same roots, those right after a pause included, so the same acceptance.
    assert len(resumed(record)) >= 8 and record == base
    assert accepted(metrics) == accepted(base_metrics) and sum(accepted(metrics)) > 0


def test_without_the_waiting_rows_the_drafts_after_a_pause_differ(
    pair, prompts, reference, caught_up_every_step, monkeypatch
):
    """The control: the same pauses with the waiting rows dropped leave the head's context with
    gaps, and its trees after a pause change (so the test above would notice a lost catch-up)."""
    tokens, metrics, record = run_with_pauses(pair, prompts, monkeypatch, "dropped")
    assert tokens == reference  # still exact: only the drafts change
    assert metrics["eagle2"]["catch_up_rows_dropped"] > 0
    base = caught_up_every_step()[2]
    after_pause = [key for key in resumed(record) if key in base]
    changed = sum(record[key][1] != base[key][1] for key in after_pause)
    assert len(after_pause) >= 8 and changed >= len(after_pause) // 2
