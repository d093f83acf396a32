"""The adaptive tree budget of one engine: measurements in, :mod:`vllm_eagle2.budget.decisions` decisions out.

* **Costs.** :meth:`AdaptiveBudget.calibrate` times the target and one draft level at engine start
  (:mod:`vllm_eagle2.budget.costs`); every step's passes and the rest of it then refine the curves. A
  step that verifies drafts is priced apart (its own ``verify`` curve and overhead): priced alike with
  a plain pass, drafting went on at a loss. On CUDA the timings are events, read after the step's sync.
* **Acceptance.** The verifier adds each step's outcome to a small device table
  (:meth:`record_verification`): per depth and sibling rank, trials and acceptances; per depth, accepted
  nodes and the summed exp(path value) of the verified ones; copied with the drafter's own transfer.
* **Decisions.** :meth:`plan` (host, before drafting), :meth:`chains_alone_pay` (host, once lookup chains are
  known) and :meth:`allocate` (device, after).

``VLLM_EAGLE2_STEP_COSTS`` (:data:`~vllm_eagle2.budget.costs.COSTS_ENV`) replaces the measured costs by
fixed linear ones, for tests and what-if runs.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vllm_eagle2.budget.costs import (
    Agree,
    Clock,
    CostCurve,
    ScaledCurve,
    calibrate_curves,
    fixed_costs,
    same_everywhere,
    set_linear,
)
from vllm_eagle2.budget.decisions import (
    NO_DRAFTS,
    AcceptanceModel,
    DraftPlan,
    allocate_nodes,
    chains_alone_pay,
    draft_seconds,
    plan_draft,
    step_cost,
)
from vllm_eagle2.budget.summary import summarize
from vllm_eagle2.device import to_device
from vllm_eagle2.verify.paths import accepted_and_reached

logger = logging.getLogger("vllm.eagle2")  # under vLLM's logger: its handlers and level

#: Per step, drafting or not, older acceptance counts are multiplied by this (a memory of ~50
#: steps). While nothing is drafted, a table measured low thus drifts back to its prior, and
#: drafting is tried again (a few unlucky drafts would otherwise rule it out for good).
DISCOUNT = 0.98
#: Plans are cached per batch size and recomputed after this many steps, or as soon as the
#: price of the cached plan (or of not drafting) has moved by more than ``REPLAN_DRIFT``.
REPLAN_STEPS = 16
REPLAN_DRIFT = 0.15
#: Per step, the overheads move this far towards the measured one. The time between two steps rises by
#: at most this share of itself per step: it includes the engine's idle time.
OVERHEAD_RATE = 0.2
#: Per target pass, the machine's speed moves this far towards the one the pass measured.
SPEED_RATE = 0.3
# Drafts per request the allocation sends, per batch size: an average at SENT_RATE per drafting step (of
# one more where it sent all planned). A step without drafts moves it SENT_RECOVERY back to the upper
# bound, so drafting is tried again within a replan or two (it once took 64 steps).
SENT_RATE = 0.2
SENT_RECOVERY = 0.05
LOG_INTERVAL_S = 10.0


class AdaptiveBudget:
    """Cost curves, acceptance statistics and per-step decisions for one eagle2 drafter.

    depth / topk / max_nodes: the user's upper bounds (``depth``, ``topk``,
    ``num_speculative_tokens``); chain: the ``chain`` tree mode (trees of width 1 only).
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
        # target: a pass in a step without drafts to verify; verify: in a step with them (the
        # same calibration; priced as ``target`` until a verifying step has been timed).
        self.target = CostCurve(max_tokens)
        self.verify = CostCurve(max_tokens)
        self.level = CostCurve(max_batch * topk)
        # Seconds at speed 1 of a step besides its passes, to the drafter's end (count_step), without /
        # with drafts; and from that end to the next step's start (vLLM's own work, shared by both).
        self.overhead = 0.0
        self.draft_overhead: float | None = None  # None: not measured yet, ``overhead`` stands in
        self.between = 0.0
        # The machine's speed: a price is a speed times its curve (or overhead), learnt at speed 1;
        # ``speed`` for a step without drafts, ``drafting_speed`` for a drafting one (observe_target).
        self.speed = 1.0
        self.drafting_speed = 1.0
        self.acceptance = AcceptanceModel(depth, topk)
        # [depth, 2 * topk + 2]: trials | accepts per (depth, rank), then per depth the summed
        # exp(value) of verified nodes and their accepted count.
        self.stats = torch.zeros(depth, 2 * topk + 2, device=device)
        self._stats_host = torch.zeros_like(self.stats, device="cpu", pin_memory=device.type == "cuda")
        self._stats_copied = False
        self.clock = Clock(device)
        self.fixed = fixed_costs()
        if self.fixed is not None:
            set_linear(self.target, *self.fixed["target"])
            set_linear(self.verify, *self.fixed["target"])
            set_linear(self.level, *self.fixed["level"])
            self.overhead = self.fixed["overhead"]
            self.draft_overhead = self.fixed.get("draft_overhead")
        # Under tensor parallelism every rank must decide alike (a level runs the head's collectives;
        # counts shape the masks): each step's prices are rank 0's (:meth:`plan`), frozen for the step.
        self.agree: Agree = same_everywhere
        self._prices: dict[str, Any] | None = None
        self._plans: dict[int, tuple[int, DraftPlan, float, float]] = {}
        self._sent: dict[int, float] = {}
        self._step = 0
        self._step_verifies = False  # this step verifies the drafts of the step before
        self._step_drafted = False  # this step sent drafts
        self._lookup_only = False  # ... and they were lookup chains alone (no head drafts)
        self._step_host: float | None = None
        self._step_end: float | None = None
        self._step_mark: Any = None
        self._step_tokens = 0
        self._step_prompt = False  # this step holds prompt tokens (prefill chunks)
        self._step_target = 0.0
        self._step_draft = 0.0
        self._levels: list[tuple[Any, int]] = []
        self.steps = 0
        self.steps_without_drafts = 0
        self.steps_head_skipped = 0  # steps that sent lookup chains alone, the plan's head levels unrun
        self.nodes_per_step: Counter[int] = Counter()
        self.nodes_per_request: Counter[int] = Counter()
        self.shapes: Counter[tuple[int, int]] = Counter()
        self.replans = 0
        self._logged_at = time.monotonic()

    # -- costs ---------------------------------------------------------------------------------
    def calibrate(self, time_target: Callable[[int], float], time_level: Callable[[int], float]) -> None:
        """Time the target and one draft level at 1, 2, 4, ... tokens (:func:`calibrate_curves`);
        skipped with fixed costs. ``time_target(tokens)`` / ``time_level(rows)`` run one pass."""
        if self.fixed is None:
            calibrate_curves(
                {self.target: time_target, self.level: time_level},
                also=(self.target, self.verify),
                agree=self.agree,
            )

    def step_started(self, tokens: int, prompt_tokens: int = 0) -> None:
        """The runner starts a step over ``tokens`` scheduled tokens, ``prompt_tokens`` of them
        prompt (prefill chunks), the rest one per decoding request and its drafts."""
        # The last step's timings first, drafting or not: on CUDA its events have passed by now (vLLM
        # synced on its sampled tokens). Resolved only after drafting steps, a step without drafts
        # left its target pass unresolved, so its overhead learnt the whole pass (and the pending
        # events piled up).
        self.clock.resolve()
        now = time.perf_counter()
        if self._step_host is not None and self.fixed is None:
            self._observe_overheads(now)
        self._step_verifies, self._step_drafted = self._step_drafted, False
        self._step_host = now
        self._step_mark = self.clock.mark()
        self._step_tokens = tokens
        self._step_prompt = prompt_tokens > 0
        self._step_target = self._step_draft = 0.0

    def _observe_overheads(self, now: float) -> None:
        """Learn the last step's overhead and the time from its end to ``now``.

        That gap is mostly the engine's own work, but also any time it waited for requests: one
        idle minute taken as overhead priced every step of its kind at seconds, and the budget never
        ran that kind again (batch 4: 32.8 tok/s, after 30 s idle 24.8 tok/s, for good). So the
        overheads stop at the drafter's end, and the gap rises by at most ``OVERHEAD_RATE`` of
        itself per step.

        A step with prompt tokens teaches no overhead: the head's catch-up pass over them, which
        lands there in a step without drafts, is paid alike whatever the step drafts (measured at
        batch 16: the overhead of a step without drafts learnt at 30-40 ms against 6-8 ms for a
        drafting one, so not drafting looked dear).
        """
        end = self._step_end if self._step_end is not None and self._step_end >= self._step_host else now
        other = max(end - self._step_host - self._step_target - self._step_draft, 0.0)
        # A step that sent lookup chains alone built no tree: its overhead is not the head's.
        if not self._step_prompt and not self._lookup_only:
            if self._step_verifies or self._step_drafted:
                # Tree bookkeeping, the allocation and the drafts' transfer: a drafting step's own.
                other /= self.drafting_speed
                last = self.overhead if self.draft_overhead is None else self.draft_overhead
                self.draft_overhead = last + OVERHEAD_RATE * (other - last)
            else:
                self.overhead += OVERHEAD_RATE * (other / self.speed - self.overhead)
        gap = (now - end) / self.speed
        self.between += OVERHEAD_RATE * min(gap - self.between, self.between or (end - self._step_host))

    def target_done(self) -> None:
        """The step's target pass, sampling and verification are done (the drafter starts)."""
        if self._step_mark is None:
            return
        tokens, verifies = self._step_tokens, self._step_verifies
        # A prompt chunk's pass is not the decoding pass the plans price (hundreds of rows, long
        # attention): learnt as one, it moved the machine's speed by up to 1.6x (batch 16).
        learn = self.fixed is None and not self._step_prompt

        def sink(seconds: float) -> None:
            self._step_target = seconds
            if learn:
                self.observe_target(tokens, seconds, verifies=verifies)

        self.clock.measure(self._step_mark, self.clock.mark(), sink)
        self._step_mark = None

    def observe_target(self, tokens: int, seconds: float, *, verifies: bool) -> None:
        """A target pass over ``tokens`` took ``seconds`` (``verifies``: it verified drafts).

        The pass's error moves a speed by ``SPEED_RATE`` (the ratio clipped to [0.5, 2]), the rest
        of it the curve of that kind of pass (:meth:`CostCurve.observe`). A shared machine speeds
        up and slows down for every pass alike; learnt per curve only, a price the planner stopped
        running would keep the price of the moment it last ran. A plain pass moves both speeds. A
        verifying pass moves only ``drafting_speed``: taken as the machine's, its own price raised
        that of a step without drafts, which was then not run to correct it (batch 16: priced at
        190-200 ms against 120-140 ms run, so drafting looked to pay where it lost).
        """
        curve = self.verify if verifies else self.target
        speed = self.drafting_speed if verifies else self.speed
        predicted = speed * float(curve(tokens))
        if predicted > 0:
            ratio = min(max(seconds / predicted, 0.5), 2.0)
            change = 1.0 + SPEED_RATE * (ratio - 1.0)
            self.drafting_speed *= change
            if not verifies:
                self.speed *= change
        curve.observe(tokens, seconds / (self.drafting_speed if verifies else self.speed))

    def level_started(self, rows: int) -> None:
        """A draft level over ``rows`` rows starts (the root level, then each expansion)."""
        self._levels.append((self.clock.mark(), rows))

    def drafting_done(self, timed: bool = True) -> None:
        """The last level ended: each level is timed from its start to the next one's (``timed``
        False: the levels are dropped, as where the head drafted nothing after the catch-up)."""
        if not self._levels or not timed:
            self._levels = []
            return
        self._levels.append((self.clock.mark(), 0))
        for i, ((start, rows), (end, _)) in enumerate(zip(self._levels, self._levels[1:])):
            # The root level holds the catch-up pass, over the prompt tokens too: not a level's price.
            learn = self.fixed is None and not (i == 0 and self._step_prompt)

            def sink(seconds: float, rows: int = rows, learn: bool = learn) -> None:
                self._step_draft += seconds
                if learn:
                    self.level.observe(rows, seconds / self.drafting_speed)

            self.clock.measure(start, end, sink)
        self._levels = []

    # -- acceptance ----------------------------------------------------------------------------
    def record_verification(
        self,
        parents: torch.Tensor,
        depths: torch.Tensor,
        ranks: torch.Tensor,
        values: torch.Tensor,
        known: torch.Tensor,
        accepted_nodes: torch.Tensor,
    ) -> None:
        """Add one verification to the device table (no host reads).

        parents / depths / ranks: [B, N] int64 of the verified trees; values: [B, N] float path
        log-probabilities; known: [B, N] bool, the nodes whose tree position is known (drafts of
        this drafter, not padding); accepted_nodes: [B, N] int64, the accepted path, -1 padded.
        """
        accepted, parent_ok = accepted_and_reached(parents, accepted_nodes)
        # A known node's parent is known too (a lookup node never has a head node below it).
        accepted, parent_ok = accepted & known, parent_ok & known
        depth0 = (depths - 1).clamp(0, self.depth - 1)
        cell = depth0 * self.stats.shape[1] + ranks.clamp(0, self.topk - 1)
        stats = self.stats.view(-1)
        stats.index_add_(0, cell.flatten(), parent_ok.flatten().float())
        stats.index_add_(0, (cell + self.topk).flatten(), accepted.flatten().float())
        row = depth0 * self.stats.shape[1] + 2 * self.topk
        stats.index_add_(0, row.flatten(), (values.float().exp() * known).flatten())
        stats.index_add_(0, (row + 1).flatten(), accepted.flatten().float())

    def copy_stats(self) -> None:
        """Start the table's copy to the host; it lands with the drafter's next host sync."""
        self._stats_host.copy_(self.stats, non_blocking=True)
        self._stats_copied = True

    def after_sync(self) -> None:
        """The drafter's host sync completed: read the copied table and pending timings."""
        self.clock.resolve()
        if self._stats_copied:
            host = self._stats_host.numpy()
            self.acceptance.update(host[:, : self.topk], host[:, self.topk : 2 * self.topk])
            self._stats_copied = False

    def correction(self) -> torch.Tensor:
        """[depth + 1] device: observed acceptance per unit of exp(path value), by depth (0 unused)."""
        mass, accepted = self.stats[:, 2 * self.topk], self.stats[:, 2 * self.topk + 1]
        return torch.cat([mass.new_ones(1), (accepted + 1.0) / (mass + 1.0)])

    # -- decisions -----------------------------------------------------------------------------
    def _step_prices(self) -> dict[str, Any]:
        """The prices :meth:`plan` froze for this step (the current ones before any plan)."""
        return self._prices if self._prices is not None else self._costs()

    def _costs(self, frozen: bool = False) -> dict[str, Any]:
        """The cost model as :func:`plan_draft` and :func:`step_cost` take it; ``frozen``: on copies
        of the curves, which the step's own timings (a draft level's, before the allocation) leave
        as they are."""
        speed, drafting = self.speed, self.drafting_speed
        target, verify, level = (c.copy() if frozen else c for c in (self.target, self.verify, self.level))
        if self.draft_overhead is None:
            draft_overhead = speed * self.overhead
        else:
            draft_overhead = drafting * self.draft_overhead
        return {
            "target": ScaledCurve(target, speed),
            "verify": ScaledCurve(verify, drafting) if verify.observed else ScaledCurve(target, speed),
            "level": ScaledCurve(level, drafting),
            "overhead": speed * (self.overhead + self.between),
            "draft_overhead": draft_overhead + speed * self.between,
        }

    def cost_state(self) -> np.ndarray:
        """Everything the budget has learnt from timings, as one float64 vector (NaN = unset)."""
        draft_overhead = np.nan if self.draft_overhead is None else self.draft_overhead
        scalars = [self.speed, self.drafting_speed, self.overhead, draft_overhead, self.between]
        curves = [curve.state() for curve in (self.target, self.verify, self.level)]
        return np.concatenate([np.array(scalars, dtype=np.float64), *curves])

    def load_cost_state(self, state: np.ndarray) -> None:
        """Take another budget's :meth:`cost_state` (the same settings)."""
        self.speed, self.drafting_speed, self.overhead, draft_overhead, self.between = (
            float(x) for x in state[:5]
        )
        self.draft_overhead = None if np.isnan(draft_overhead) else draft_overhead
        curves = (self.target, self.verify, self.level)
        parts = np.split(state[5:], np.cumsum([3 * len(curve.knots) for curve in curves])[:-1])
        for curve, part in zip(curves, parts):
            curve.load_state(part)

    def plan(self, batch: int) -> DraftPlan:
        """This step's draft shape for ``batch`` requests.

        Cached per batch size for ``REPLAN_STEPS`` steps, unless the cost model now prices the
        cached plan, or a step without drafts, ``REPLAN_DRIFT`` away from what it did when it
        chose: a plan chosen on a price the first steps proved wrong is dropped at once.

        First every rank takes rank 0's learnt costs (``agree``), and the step's prices are frozen:
        the plan, :meth:`chains_alone_pay` and :meth:`allocate` then decide alike on every rank, from
        host state that is the same everywhere and device state that vLLM keeps the same.
        """
        self._step += 1
        if self.fixed is None and self.agree is not same_everywhere:
            self.load_cost_state(self.agree(self.cost_state()))
        costs = self._prices = self._costs(frozen=True)
        cached = self._plans.get(batch)
        if cached is not None and self._step - cached[0] < REPLAN_STEPS:
            step, plan, planned, planned_none = cached
            none = step_cost(NO_DRAFTS, batch, **costs)
            now = step_cost(plan, batch, **costs) if plan.drafts else none
            drift = max(abs(now - planned) / planned, abs(none - planned_none) / planned_none)
            if drift <= REPLAN_DRIFT:
                return plan
            self.replans += 1
        plan = plan_draft(
            batch,
            max_depth=self.depth,
            max_topk=self.topk,
            max_nodes=self.max_nodes,
            acceptance=self.acceptance.p,
            chain_only=self.chain,
            sent=self._sent.get(batch),
            **costs,
        )
        none = step_cost(NO_DRAFTS, batch, **costs)
        seconds = step_cost(plan, batch, **costs) if plan.drafts else none
        self._plans[batch] = (self._step, plan, seconds, none)
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
            self.correction(),
            step_seconds,
            grafted,
            max_drafts=self.max_tokens - batch,
        )

    def count_step(self, plan: DraftPlan, counts: list[int], head_skipped: bool = False) -> None:
        """Metrics of one step: the plan and the drafts sent for each request (``head_skipped``: the
        head drafted nothing of ``plan``, lookup chains went alone)."""
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
        self._step_drafted = total > 0
        self._lookup_only = total > 0 and (head_skipped or not plan.drafts)
        # Once per step: the device table and its host copy forget alike (the copy, if one landed
        # this step, was taken before this).
        self.stats.mul_(DISCOUNT)
        self.acceptance.decay(DISCOUNT)
        self.steps += 1
        self.steps_without_drafts += total == 0
        self.steps_head_skipped += head_skipped
        self.nodes_per_step[total] += 1
        self._step_end = time.perf_counter()
        self.nodes_per_request.update(counts)
        self.shapes[(plan.depth, plan.topk)] += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_INTERVAL_S:
            self._logged_at = now
            logger.info("eagle2 adaptive budget: %s", json.dumps(self.summary()))

    def summary(self) -> dict[str, Any]:
        """Counters since start (:func:`vllm_eagle2.budget.summary.summarize`)."""
        return summarize(self)
