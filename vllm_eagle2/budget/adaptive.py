"""The adaptive tree budget of one engine: measurements in, :mod:`vllm_eagle2.budget.decisions` decisions out.

* **Prices** (:mod:`.prices`): :meth:`AdaptiveBudget.calibrate` times the target and one draft level at
  engine start; every step's passes and the rest of it then refine them. A step that verifies drafts
  is priced apart (its own ``verify`` curve and overhead): priced alike with a plain pass, drafting
  went on at a loss. On CUDA the timings are events, read after the step's sync.
* **Acceptance** (:mod:`.acceptance`): the verifier adds each step's outcome to a small device table,
  copied with the drafter's own transfer.
* **Decisions.** :meth:`plan` (host, before drafting), :meth:`chains_alone_pay` (host, once lookup chains are
  known) and :meth:`allocate` (device, after).

``VLLM_EAGLE2_STEP_COSTS`` (:data:`~vllm_eagle2.budget.costs.COSTS_ENV`) replaces the measured costs by
fixed linear ones, for tests and what-if runs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
    plan_draft,
    step_cost,
)
from vllm_eagle2.budget.prices import Prices
from vllm_eagle2.budget.summary import StepCounters
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


@dataclass
class StepTimes:
    """The timings of the step under way, from :meth:`AdaptiveBudget.step_started` to the next.

    host / end: its start and the drafter's end (``time.perf_counter``); mark: the clock's mark at
    its start, until the target pass is measured; tokens / prompt: its scheduled tokens, and
    whether prompt chunks are among them; target / draft: seconds of its target pass and draft
    levels, as they resolve; levels: the draft levels' (mark, rows) so far; verifies: it verifies
    the drafts of the step before; drafted: it sent drafts; lookup_only: ... lookup chains alone.
    """

    host: float | None  # None: no step yet
    mark: Any
    tokens: int
    prompt: bool
    verifies: bool
    end: float | None = None
    target: float = 0.0
    draft: float = 0.0
    levels: list[tuple[Any, int]] = field(default_factory=list)
    drafted: bool = False
    lookup_only: bool = False


class AdaptiveBudget:
    """Prices, acceptance and per-step decisions for one eagle2 drafter.

    depth / topk / max_nodes: the user's upper bounds (``depth``, ``topk``,
    ``num_speculative_tokens``); chain: the ``chain`` tree mode (trees of width 1 only).
    Outlives steps: ``prices``, ``acceptance``, the cached plans and the drafts sent per batch
    size, ``counters``. Lives for one step: ``step`` (its timings) and the prices :meth:`plan`
    froze for it.
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
        self.prices = Prices(max_tokens, max_batch * topk)
        self.acceptance = AcceptanceTable(depth, topk, device)
        self.clock = Clock(device)
        # Under tensor parallelism every rank must decide alike (a level runs the head's collectives;
        # counts shape the masks): each step's prices are rank 0's (:meth:`plan`), frozen for the step.
        self.agree: Agree = same_everywhere
        self.counters = StepCounters()
        self.step = StepTimes(host=None, mark=None, tokens=0, prompt=False, verifies=False)
        self._frozen: dict[str, Any] | None = None  # the step's prices, frozen by plan
        self._plans: dict[int, tuple[int, DraftPlan, float, float]] = {}  # batch -> (plan no., plan, prices)
        self._plans_made = 0
        self._sent: dict[int, float] = {}  # batch -> drafts per request sent
        self._logged_at = time.monotonic()

    @property
    def fixed(self) -> bool:
        """Fixed linear costs (``VLLM_EAGLE2_STEP_COSTS``): nothing is learnt from timings."""
        return self.prices.fixed is not None

    # -- timings -------------------------------------------------------------------------------
    def calibrate(self, time_target: Callable[[int], float], time_level: Callable[[int], float]) -> None:
        """Time the target and one draft level at engine start (:meth:`Prices.calibrate`)."""
        self.prices.calibrate(time_target, time_level, self.agree)

    def step_started(self, tokens: int, prompt_tokens: int = 0) -> None:
        """The runner starts a step over ``tokens`` scheduled tokens, ``prompt_tokens`` of them
        prompt (prefill chunks), the rest one per decoding request and its drafts."""
        # The last step's timings first, drafting or not: on CUDA its events have passed by now (vLLM
        # synced on its sampled tokens). Resolved only after drafting steps, a step without drafts
        # left its target pass unresolved, so its overhead learnt the whole pass (and the pending
        # events piled up).
        self.clock.resolve()
        now, last = time.perf_counter(), self.step
        if last.host is not None and not self.fixed:
            self._learn_overheads(last, now)
        self.step = StepTimes(
            host=now, mark=self.clock.mark(), tokens=tokens, prompt=prompt_tokens > 0, verifies=last.drafted
        )

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
        other = max(end - step.host - step.target - step.draft, 0.0)
        teaches = not step.prompt and not step.lookup_only
        self.prices.observe_overheads(
            other if teaches else None, step.verifies or step.drafted, now - end, end - step.host
        )

    def target_done(self) -> None:
        """The step's target pass, sampling and verification are done (the drafter starts)."""
        step = self.step
        if step.mark is None:
            return
        # A prompt chunk's pass is not the decoding pass the plans price (hundreds of rows, long
        # attention): learnt as one, it moved the machine's speed by up to 1.6x (batch 16).
        learn = not self.fixed and not step.prompt

        def sink(seconds: float) -> None:
            step.target = seconds
            if learn:
                self.prices.observe_target(step.tokens, seconds, verifies=step.verifies)

        self.clock.measure(step.mark, self.clock.mark(), sink)
        step.mark = None

    def level_started(self, rows: int) -> None:
        """A draft level over ``rows`` rows starts (the root level, then each expansion)."""
        self.step.levels.append((self.clock.mark(), rows))

    def drafting_done(self) -> None:
        """The last level ended: each level is timed from its start to the next one's."""
        step = self.step
        levels, step.levels = step.levels, []
        if not levels:
            return
        levels.append((self.clock.mark(), 0))
        for i, ((start, rows), (end, _)) in enumerate(zip(levels, levels[1:])):
            # The root level holds the catch-up pass, over the prompt tokens too: not a level's price.
            learn = not self.fixed and not (i == 0 and step.prompt)

            def sink(seconds: float, rows: int = rows, learn: bool = learn) -> None:
                step.draft += seconds
                if learn:
                    self.prices.observe_level(rows, seconds)

            self.clock.measure(start, end, sink)

    def after_sync(self) -> None:
        """The drafter's host sync completed: read the copied acceptance and pending timings."""
        self.clock.resolve()
        self.acceptance.read_host_copy()

    # -- decisions -----------------------------------------------------------------------------
    def _step_prices(self) -> dict[str, Any]:
        """The prices :meth:`plan` froze for this step (the current ones before any plan)."""
        return self._frozen if self._frozen is not None else self.prices.costs()

    def plan(self, batch: int) -> DraftPlan:
        """This step's draft shape for ``batch`` requests.

        Cached per batch size for ``REPLAN_STEPS`` steps, unless the cost model now prices the
        cached plan, or a step without drafts, ``REPLAN_DRIFT`` away from what it did when it
        chose: a plan chosen on a price the first steps proved wrong is dropped at once.

        First every rank takes rank 0's learnt costs (``agree``), and the step's prices are frozen:
        the plan, :meth:`chains_alone_pay` and :meth:`allocate` then decide alike on every rank, from
        host state that is the same everywhere and device state that vLLM keeps the same.
        """
        self.prices.agree(self.agree)
        costs = self._frozen = self.prices.costs(frozen=True)
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

    def chains_alone_pay(self, plan: DraftPlan, reach: np.ndarray) -> bool:
        """Whether lookup chains ([B, L] ``reach``) alone beat ``plan`` beside them (decisions)."""
        return chains_alone_pay(plan, reach, **self._step_prices())

    def allocate(
        self, plan: DraftPlan, values: Tensor, depths: Tensor, allowed: Tensor, grafted: Tensor | None = None
    ) -> Tensor:
        """Drafts per request [B] for this step's trees (see :func:`allocate_nodes`; ``grafted``:
        [B, N] bool lookup nodes or None)."""
        batch, n = values.shape
        costs = self._step_prices()
        j = np.arange(batch * n + 1, dtype=np.float64)
        seconds = costs["verify"](batch + j) + costs["draft_overhead"]
        # Sending no drafts after all spares the next step its verification.
        seconds[0] = step_cost(NO_DRAFTS, batch, **costs)
        seconds = seconds + draft_seconds(plan, batch, costs["level"])
        # More verified tokens never cost less: the overheads of the two kinds of step are learnt
        # apart, and priced below none, a draft that gains nothing looked worth sending.
        seconds = np.maximum.accumulate(seconds)
        step_seconds = to_device(seconds.astype(np.float32), values.device)
        return allocate_nodes(
            values,
            depths,
            allowed,
            self.acceptance.correction(),
            step_seconds,
            grafted,
            max_drafts=self.max_tokens - batch,
        )

    def count_step(self, plan: DraftPlan, counts: list[int], head_skipped: bool = False) -> None:
        """The step's drafting ended: ``plan`` and the drafts sent for each request (``head_skipped``:
        the head drafted nothing of ``plan``, lookup chains went alone)."""
        total = sum(counts)
        if counts and not head_skipped:
            sent = self._sent.get(len(counts), float(self.max_nodes))
            if plan.drafts:
                seen = total / len(counts)
                if total >= plan.per_request * len(counts):
                    seen = min(seen + 1.0, self.max_nodes)  # all sent: more might have been
                self._sent[len(counts)] = sent + SENT_RATE * (seen - sent)
            else:
                self._sent[len(counts)] = sent + SENT_RECOVERY * (self.max_nodes - sent)
        step = self.step
        step.drafted = total > 0
        step.lookup_only = total > 0 and (head_skipped or not plan.drafts)
        step.end = time.perf_counter()
        self.acceptance.decay()
        self.counters.count(plan.depth, plan.topk, counts, head_skipped)
        now = time.monotonic()
        if now - self._logged_at >= LOG_INTERVAL_S:
            self._logged_at = now
            logger.info("eagle2 adaptive budget: %s", json.dumps(self.summary()))

    def summary(self) -> dict[str, Any]:
        """Counters since start, the drafts sent per request by batch size, the acceptance of each
        depth's likeliest child and the prices (:meth:`Prices.summary`)."""
        return {
            **self.counters.summary(),
            **self.prices.summary(),
            "sent_per_request": {str(b): round(n, 2) for b, n in sorted(self._sent.items())},
            "acceptance_top1": [round(float(x), 3) for x in self.acceptance.model.p[:, 0]],
        }
