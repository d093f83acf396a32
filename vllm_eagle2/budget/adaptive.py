"""The adaptive tree budget of one engine: measurements in, :mod:`vllm_eagle2.budget.decisions` decisions out.

* **Prices** (:mod:`.prices`): :meth:`AdaptiveBudget.calibrate` times the target and one draft level at
  engine start; every step's passes and the rest of it then refine them. A step that verifies drafts
  is priced apart (its own ``verify`` curve and overhead): priced alike with a plain pass, drafting
  went on at a loss. On CUDA the timings are events, read when the next step starts.
* **Acceptance** (:mod:`.acceptance`): the verifier adds each step's outcome to a small device table,
  copied with the drafter's own transfer.
* **Outcomes** (:mod:`.outcomes`): the rates that drafting and plain steps really reached, per batch
  band. A plan with head drafts runs only while drafting measures at least as fast as plain
  decoding; probes keep both measured.
* **Three calls a step.** :meth:`AdaptiveBudget.learn` as the step starts, from the record of the
  step before (:class:`~vllm_eagle2.budget.timing.StepTimes`, which each step fills as it runs;
  the call returns the new step's);
  :meth:`AdaptiveBudget.plan` before drafting (host; given the step's record, it prices the target
  pass just run), which returns the step's :class:`StepBudget`:
  the plan and the prices it was chosen at, which then decide whether lookup chains go alone
  (:meth:`StepBudget.chains_alone_pay`, host) and how many drafts each request sends
  (:meth:`StepBudget.allocate`, device).

``VLLM_EAGLE2_STEP_COSTS`` (:data:`~vllm_eagle2.budget.costs.COSTS_ENV`) replaces the measured costs by
fixed linear ones, for tests and what-if runs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vllm_eagle2.budget.acceptance import AcceptanceTable
from vllm_eagle2.budget.costs import Agree, Clock, same_everywhere
from vllm_eagle2.budget.decisions import (
    NO_DRAFTS,
    DraftPlan,
    allocate_nodes,
    chains_alone_pay,
    draft_seconds,
    fit_level_rows,
    plan_draft,
    step_cost,
)
from vllm_eagle2.budget.outcomes import Outcomes
from vllm_eagle2.budget.prices import Prices, TimeTarget
from vllm_eagle2.budget.summary import StepCounters
from vllm_eagle2.budget.timing import Sent, StepTimes
from vllm_eagle2.config import Eagle2Settings
from vllm_eagle2.device import to_device

logger = logging.getLogger("vllm.eagle2")  # under vLLM's logger: its handlers and level

#: Plans are cached per batch size and recomputed after this many steps, or as soon as the
#: price of the cached plan (or of not drafting) has moved by more than ``REPLAN_DRIFT``.
REPLAN_STEPS = 16
REPLAN_DRIFT = 0.15
# Drafts per request the allocation sends, per batch size: an average at SENT_RATE per drafting step (of
# one more where it sent all planned). A step without drafts moves it SENT_RECOVERY back to the upper
# bound, so drafting is tried again within a replan or two (it once took 64 steps).
SENT_RATE = 0.2
SENT_RECOVERY = 0.05
LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class StepBudget:
    """One step's share of the budget: its draft ``plan`` (fitted to the head's rows; ``narrowed``:
    the fit cut its topk) and the prices it was chosen at (``costs``), which its two later
    decisions use too. Nothing is learnt mid-step, so every rank decides alike all through it.

    acceptance: the engine's table (the allocation's per-depth correction); max_tokens: a step's
    token budget (vLLM's ``max_num_batched_tokens``).
    """

    plan: DraftPlan
    narrowed: bool
    costs: dict[str, Any]
    acceptance: AcceptanceTable
    max_tokens: int

    def chains_alone_pay(self, reach: np.ndarray) -> bool:
        """Whether lookup chains ([B, L] ``reach``) alone beat :attr:`plan` beside them (decisions)."""
        return chains_alone_pay(self.plan, reach, **self.costs)

    def allocate(
        self,
        values: Tensor,
        depths: Tensor,
        allowed: Tensor,
        grafted: Tensor | None = None,
        head_skipped: bool = False,
    ) -> Tensor:
        """Drafts per request [B] for this step's trees (see :func:`allocate_nodes`; ``grafted``:
        [B, N] bool lookup nodes or None; ``head_skipped``: the levels went unrun, none are priced).
        Starts the acceptance table's copy to the host, which lands with the drafts' transfer."""
        batch, n = values.shape
        costs, plan = self.costs, NO_DRAFTS if head_skipped else self.plan
        j = np.arange(batch * n + 1, dtype=np.float64)
        seconds = costs["verify"](batch + j) + costs["draft_overhead"]
        # Sending no drafts after all spares the next step its verification.
        seconds[0] = step_cost(NO_DRAFTS, batch, **costs)
        seconds = seconds + draft_seconds(plan, batch, costs["level"])
        # More verified tokens never cost less: the overheads of the two kinds of step are learnt
        # apart, and priced below none, a draft that gains nothing looked worth sending.
        seconds = np.maximum.accumulate(seconds)
        step_seconds = to_device(seconds.astype(np.float32), values.device)
        counts = allocate_nodes(
            values,
            depths,
            allowed,
            self.acceptance.correction(),
            step_seconds,
            grafted,
            max_drafts=self.max_tokens - batch,
        )
        self.acceptance.copy_to_host()
        return counts


class AdaptiveBudget:
    """Prices, acceptance and per-step decisions for one eagle2 drafter.

    depth / topk / max_nodes: the user's upper bounds (``depth``, ``topk``,
    ``num_speculative_tokens``); chain: the ``chain`` tree mode (trees of width 1 only).
    Outlives steps: ``prices``, ``acceptance``, the cached plans and the drafts sent per batch
    size, ``counters``, and the record of the step under way, learnt from when the next one starts.
    """

    def __init__(
        self,
        *,
        depth: int,
        topk: int,
        max_nodes: int,
        chain: bool,
        max_batch: int,
        max_tokens: int,
        device: torch.device,
    ) -> None:
        self.depth, self.topk, self.max_nodes, self.chain = depth, topk, max_nodes, chain
        self.max_tokens = max_tokens  # a step's token budget (vLLM's max_num_batched_tokens)
        self.max_batch = max_batch
        self.prices = Prices(max_tokens, max_batch * topk)
        self.outcomes = Outcomes(max_batch)
        self.acceptance = AcceptanceTable(depth, topk, device)
        self.clock = Clock(device)
        # Under tensor parallelism every rank must decide alike (a level runs the head's collectives;
        # counts shape the masks): each step's prices are rank 0's (:meth:`plan`).
        self.agree: Agree = same_everywhere
        self.counters = StepCounters()
        self._under_way: StepTimes | None = None  # the step under way, learnt from at the next start
        self._steady: tuple[int, bool] | None = None  # (band, arm) of the last step learnt from
        self._plans: dict[int, tuple[int, DraftPlan, float, float]] = {}  # batch -> (plan no., plan, prices)
        self._plans_made = 0
        self._sent: dict[int, float] = {}  # batch -> drafts per request sent
        self._logged_at = time.monotonic()

    @classmethod
    def of(
        cls, settings: Eagle2Settings, max_batch: int, max_tokens: int, device: torch.device
    ) -> AdaptiveBudget:
        """The budget of an engine with these eagle2 ``settings``, ``max_batch`` requests and
        ``max_tokens`` tokens a step (vLLM's ``max_num_seqs`` and ``max_num_batched_tokens``)."""
        chain = settings.tree == "chain"
        return cls(
            depth=settings.depth,
            topk=1 if chain else settings.topk,
            max_nodes=settings.nodes_per_step,
            chain=chain,
            max_batch=max_batch,
            max_tokens=max_tokens,
            device=device,
        )

    @property
    def fixed(self) -> bool:
        """Fixed linear costs (``VLLM_EAGLE2_STEP_COSTS``): nothing is learnt from timings."""
        return self.prices.fixed is not None

    def calibrate(
        self,
        time_target: TimeTarget,
        time_level: Callable[[int], float],
        long_context: int = 0,
        level_share: float = 0.0,
    ) -> None:
        """Time the target and one draft level at engine start (:meth:`Prices.calibrate`), the
        target up to the widest decoding step: every request with all its drafts."""
        widest = min(self.max_tokens, self.max_batch * (1 + self.max_nodes))
        self.prices.calibrate(time_target, time_level, self.agree, long_context, level_share, widest)

    # -- learn ---------------------------------------------------------------------------------
    def learn(
        self, tokens: int, prompt_tokens: int = 0, verifies: bool = False, context: float = 0.0
    ) -> StepTimes:
        """A step starts, over ``tokens`` scheduled tokens, ``prompt_tokens`` of them prompt (prefill
        chunks), ``verifies``: drafts among them; its requests hold ``context`` tokens on average.
        Learns from the step before, now over, and returns
        the new step's record (:class:`StepTimes`), which the step fills as it runs and the next
        call learns from.

        The step before teaches its target pass, its draft levels, its overheads (up to this start)
        and what it sent; the acceptance its drafts' transfer copied is read, and the table decays
        once per step the drafter ran. On CUDA its events have passed by now (vLLM synced on its sampled
        tokens); one that has not resolves at a later start, straight into the prices.
        """
        times = StepTimes.begin(self.clock, tokens, prompt_tokens, verifies, context)
        last, self._under_way = self._under_way, times
        if last is None:
            return times
        self._measure(last)
        self.clock.resolve()
        self.acceptance.read_host_copy()
        if not self.fixed:
            self._learn_overheads(last, times.host)
            self._learn_outcome(last, times.host)
        sent = last.sent
        if sent is not None:
            self._learn_sent(sent)
            self.acceptance.decay()
            self.counters.count(sent.plan.depth, sent.plan.topk, sent.counts, sent.head_skipped)
            now = time.monotonic()
            if now - self._logged_at >= LOG_INTERVAL_S:
                self._logged_at = now
                logger.info("eagle2 adaptive budget: %s", json.dumps(self.summary()))
        return times

    def _measure(self, step: StepTimes) -> None:
        """Time ``step``'s target pass and its levels, into its record and, where they teach, the
        prices. A prompt chunk's pass is not the decoding pass the plans price (hundreds of rows,
        long attention: learnt as one, it moved the machine's speed by up to 1.6x at batch 16), and
        the root level holds the catch-up pass over the prompt tokens too: neither teaches."""
        self._measure_target(step)
        learn = not self.fixed
        for i, ((start, rows), (end, _)) in enumerate(zip(step.levels, step.levels[1:])):
            teaches = learn and not (i == 0 and step.prompt)

            def level(seconds: float, rows: int = rows, teaches: bool = teaches) -> None:
                step.draft_s += seconds
                if teaches:
                    self.prices.observe_level(rows, seconds, step.context)

            self.clock.measure(start, end, level)

    def _measure_target(self, step: StepTimes) -> None:
        """Time ``step``'s target pass, once (:meth:`_measure`)."""
        if step.target is None:
            return
        (start, end), step.target = step.target, None

        def target(seconds: float) -> None:
            step.target_s = seconds
            if not self.fixed and not step.prompt:
                self.prices.observe_target(step.tokens, seconds, verifies=step.verifies, context=step.context)

        self.clock.measure(start, end, target)

    def _learn_overheads(self, step: StepTimes, now: float) -> None:
        """Learn ``step``'s overhead and the time from its end to ``now``.

        That gap is mostly the engine's own work, but also any time it waited for requests: one
        idle minute taken as overhead priced every step of its kind at seconds, and the budget never
        ran that kind again (batch 4: 32.8 tok/s, after 30 s idle 24.8 tok/s, for good). So the
        overheads stop at the drafter's end, and the gap rises by at most ``OVERHEAD_RATE`` of
        itself per step.

        A step with prompt tokens teaches no overhead: the head's catch-up pass over them, which
        lands there in a step without drafts, is paid alike whatever the step drafts (measured at
        batch 16: the overhead of a step without drafts learnt at 30-40 ms against 6-8 ms for a
        drafting one, so not drafting looked dear). Nor does a step that sent lookup chains alone:
        it built no tree, its overhead is not the head's.
        """
        end = step.end if step.end is not None else now
        other = max(end - step.host - step.target_s - step.draft_s, 0.0)
        teaches = not step.prompt and not step.lookup_only
        self.prices.observe_overheads(
            other if teaches else None, step.verifies or step.drafted, now - end, end - step.host
        )

    def _learn_outcome(self, step: StepTimes, now: float) -> None:
        """Count ``step`` (ended at ``now``) to its arm's measured rate (:class:`Outcomes`): a step
        whose plan had head drafts (drafting) or that neither planned nor sent any (plain), after a
        step of the same arm and band. A drafting step's tokens are its requests and the drafts it
        accepted (it may have verified none: the allocation sent nothing the step before); its
        seconds run to ``now``, the next start: all that either way of decoding costs.

        A step with prompt tokens counts to neither (its pass is a prefill's) but keeps the arm
        going: at batch 16 over 64 MT-bench prompts a third of the steps prefilled a new request,
        and when such a step broke the run, plain probes of 4 steps seldom measured 3 plain steps,
        so plain decoding stayed unmeasured and drafting went on at 0.80-0.84x."""
        sent, arm = step.sent, None
        if sent is not None and sent.counts:
            if sent.plan.drafts and not sent.head_skipped:
                arm = True
            elif not step.drafted:
                arm = False
        batch = len(sent.counts) if arm is not None else 0
        accepted = self.acceptance.last_accepted if step.verifies else 0.0
        steady, self._steady = self._steady, (Outcomes.band(batch), arm) if arm is not None else None
        if arm is not None and not step.prompt and steady == self._steady and accepted is not None:
            self.outcomes.record(batch, arm, batch + accepted, now - step.host)

    def _learn_sent(self, sent: Sent) -> None:
        """The drafts per request the allocation sends, by batch size, which the plans size trees for
        (unless the head's levels went unrun)."""
        counts = sent.counts
        if not counts or sent.head_skipped:
            return
        was = self._sent.get(len(counts), float(self.max_nodes))
        if sent.plan.drafts:
            seen = sent.total / len(counts)
            if sent.total >= sent.plan.per_request * len(counts):
                seen = min(seen + 1.0, self.max_nodes)  # all sent: more might have been
            self._sent[len(counts)] = was + SENT_RATE * (seen - was)
        else:
            self._sent[len(counts)] = was + SENT_RECOVERY * (self.max_nodes - was)

    # -- plan ----------------------------------------------------------------------------------
    def plan(self, batch: int, max_rows: int | None = None, times: StepTimes | None = None) -> StepBudget:
        """This step's :class:`StepBudget` for ``batch`` requests, its plan narrowed to a draft level
        of at most ``max_rows`` rows (:func:`fit_level_rows`; None: as planned). ``times``: the
        step's record, its target pass done: on CPU the plan prices it (a CUDA event resolves at
        the next start), as a step's target pass is the freshest news of the machine's speed; its
        context prices the next step's (None: priced at no context).

        First every rank takes rank 0's learnt costs (``agree``): the plan and the step's later
        decisions then come alike on every rank, from host state that is the same everywhere and
        device state that vLLM keeps the same.
        """
        if times is not None:
            self._measure_target(times)
        self._agree()
        costs = self.prices.costs(0.0 if times is None else times.context)
        plan = self._draft_plan(batch, costs)
        if plan.drafts and not self.fixed and not self.outcomes.check(batch).draft:
            plan = NO_DRAFTS
        fitted = plan if max_rows is None else fit_level_rows(plan, batch, max_rows)
        return StepBudget(fitted, fitted is not plan, costs, self.acceptance, self.max_tokens)

    def _agree(self) -> None:
        """Take rank 0's prices and outcomes (one broadcast); no-op with one rank or fixed costs."""
        if self.fixed or self.agree is same_everywhere:
            return
        prices = self.prices.state()
        state = self.agree(np.concatenate([prices, self.outcomes.state()]))
        self.prices.load_state(state[: len(prices)])
        self.outcomes.load_state(state[len(prices) :])

    def _draft_plan(self, batch: int, costs: dict[str, Any]) -> DraftPlan:
        """The draft shape for ``batch`` requests at ``costs``.

        Cached per batch size for ``REPLAN_STEPS`` steps, unless the cost model now prices the
        cached plan, or a step without drafts, ``REPLAN_DRIFT`` away from what it did when it
        chose: a plan chosen on a price the first steps proved wrong is dropped at once.
        """
        self._plans_made += 1
        now_step = self._plans_made
        cached = self._plans.get(batch)
        if cached is not None and now_step - cached[0] < REPLAN_STEPS:
            step, plan, planned, planned_none = cached
            none = step_cost(NO_DRAFTS, batch, **costs)
            now = step_cost(plan, batch, **costs) if plan.drafts else none
            drift = max(abs(now - planned) / planned, abs(none - planned_none) / planned_none)
            if drift <= REPLAN_DRIFT:
                return plan
            self.counters.replans += 1
        plan = plan_draft(
            batch,
            max_depth=self.depth,
            max_topk=self.topk,
            max_nodes=self.max_nodes,
            acceptance=self.acceptance.model.p,
            chain_only=self.chain,
            sent=self._sent.get(batch),
            **costs,
        )
        none = step_cost(NO_DRAFTS, batch, **costs)
        seconds = step_cost(plan, batch, **costs) if plan.drafts else none
        self._plans[batch] = (now_step, plan, seconds, none)
        return plan

    def summary(self) -> dict[str, Any]:
        """Counters since start, the measured rates and probes (:meth:`Outcomes.summary`), the drafts
        sent per request by batch size, the acceptance of each depth's likeliest child and the
        prices (:meth:`Prices.summary`)."""
        return {
            **self.counters.summary(),
            **self.outcomes.summary(),
            **self.prices.summary(),
            "sent_per_request": {str(b): round(n, 2) for b, n in sorted(self._sent.items())},
            "acceptance_top1": [round(float(x), 3) for x in self.acceptance.model.p[:, 0]],
        }
