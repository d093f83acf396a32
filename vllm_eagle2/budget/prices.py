"""What one engine's budget has learnt from timings: the prices its decisions weigh.

The curves of a target pass (without and with drafts to verify) and of one draft level, the
price of the context their rows read, the machine's speed for each kind of step, and the time a
step costs besides its passes. Learnt at engine start (:meth:`Prices.calibrate`) and refined by
every step; they outlive steps.

A pass over ``t`` rows whose requests hold ``c`` tokens of context on average costs
``speed * (curve(t) + context * t * c)``: the curves are the price at no context, and every row
reads its request's context in each attention layer (a tree row as a causal one). Priced by rows
alone, a curve learnt on short prompts under-priced the verification of long ones (the tree's rows
read the whole context), and one learnt late over-priced a fresh request's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_eagle2.budget.costs import (
    Agree,
    CostCurve,
    ScaledCurve,
    calibrate_curves,
    fixed_costs,
    set_linear,
)

logger = logging.getLogger("vllm.eagle2")

__all__ = ["CONTEXT_TOKENS", "OVERHEAD_RATE", "SPEED_RATE", "Prices"]

#: Per step, the overheads move this far towards the measured one. The time between two steps rises by
#: at most this share of itself per step: it includes the engine's idle time.
OVERHEAD_RATE = 0.2
#: Per target pass, the machine's speed moves this far towards the one the pass measured.
SPEED_RATE = 0.3
#: The calibration prices context on passes of this many rows (one per request, as decoding runs).
CONTEXT_TOKENS = 8

#: Times one target pass over ``tokens`` rows whose requests hold ``context`` tokens each (None:
#: as few as the rows allow); returns (seconds, the context the pass really read per request).
TimeTarget = Callable[[int, int | None], tuple[float, float]]


class Prices:
    """Cost curves and overheads, learnt at speed 1; a price is a speed times its curve.

    target: a pass in a step without drafts to verify; verify: in a step with them (the same
    calibration; priced as ``target`` until a verifying step has been timed); level: one draft
    level by rows. overhead / draft_overhead: seconds at speed 1 of a step besides its passes, to
    the drafter's end, without / with drafts (None: not measured yet, ``overhead`` stands in);
    between: from that end to the next step's start (vLLM's own work, shared by both). speed /
    drafting_speed: the machine's, for a step without / with drafts (:meth:`observe_target`).
    context / level_context: seconds at speed 1 per row and context token of a target pass / of a
    draft level (the head's layers read the context too).
    ``VLLM_EAGLE2_STEP_COSTS`` replaces the measured costs by fixed linear ones (``fixed``).
    """

    def __init__(self, max_tokens: int, max_level_rows: int) -> None:
        self.target = CostCurve(max_tokens)
        self.verify = CostCurve(max_tokens)
        self.level = CostCurve(max_level_rows)
        self.overhead = 0.0
        self.draft_overhead: float | None = None
        self.between = 0.0
        self.speed = 1.0
        self.drafting_speed = 1.0
        self.context = 0.0
        self.level_context = 0.0
        self.fixed = fixed_costs()
        if self.fixed is not None:
            set_linear(self.target, *self.fixed["target"])
            set_linear(self.verify, *self.fixed["target"])
            set_linear(self.level, *self.fixed["level"])
            self.overhead = self.fixed["overhead"]
            self.draft_overhead = self.fixed.get("draft_overhead")
            self.context = self.fixed["context"]

    def calibrate(
        self,
        time_target: TimeTarget,
        time_level: Callable[[int], float],
        agree: Agree,
        long_context: int = 0,
        level_share: float = 0.0,
        widest: int | None = None,
    ) -> None:
        """Time the target and one draft level at engine start; skipped with fixed costs.

        First the price of context: ``CONTEXT_TOKENS`` rows at the least context and at
        ``long_context`` tokens (0: not priced), the best of three each; a draft level is priced
        ``level_share`` of it (its layers over the target's). Then the curves at 1, 2, 4, ...
        rows (:func:`calibrate_curves`), at the least context and less its price: every pass runs
        attention, as a step's passes do (without it, every price lacked it, and the first
        widths a step happened to run rescaled the rest by luck); the target's up to ``widest``
        rows (a decoding step's most: every request with all its drafts; None: the curve's
        last knot). ``time_level(rows)`` runs one draft level."""
        if self.fixed is not None:
            return
        if long_context > 0:
            seconds = []
            for context in (None, long_context):
                runs = [time_target(CONTEXT_TOKENS, context) for _ in range(3)]
                best, read = min(runs)
                seconds.append((float(agree(np.array([best]))[0]), read))
            (short, short_read), (long, long_read) = seconds
            if long_read > short_read:
                self.context = max(long - short, 0.0) / (CONTEXT_TOKENS * (long_read - short_read))
            self.level_context = self.context * level_share
            logger.info(
                "eagle2 adaptive budget: %d rows at %d / %d tokens of context: %.2f / %.2f ms",
                CONTEXT_TOKENS,
                short_read,
                long_read,
                1e3 * short,
                1e3 * long,
            )

        def at_no_context(tokens: int) -> float:
            seconds, read = time_target(tokens, None)
            return max(seconds - self.context * tokens * read, 0.5 * seconds)

        calibrate_curves(
            {self.target: at_no_context, self.level: time_level},
            also=(self.target, self.verify),
            agree=agree,
            widest=None if widest is None else {self.target: widest},
        )

    def observe_target(self, tokens: int, seconds: float, *, verifies: bool, context: float = 0.0) -> None:
        """A target pass over ``tokens`` took ``seconds`` (``verifies``: it verified drafts; its
        requests held ``context`` tokens each on average, which the curve is priced without).

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
        read = self.context * tokens * context
        predicted = speed * (float(curve(tokens)) + read)
        if predicted > 0:
            ratio = min(max(seconds / predicted, 0.5), 2.0)
            change = 1.0 + SPEED_RATE * (ratio - 1.0)
            self.drafting_speed *= change
            if not verifies:
                self.speed *= change
        at_speed = seconds / (self.drafting_speed if verifies else self.speed)
        curve.observe(tokens, max(at_speed - read, 0.5 * at_speed))

    def observe_level(self, rows: int, seconds: float, context: float = 0.0) -> None:
        """A draft level over ``rows`` rows, of requests holding ``context`` tokens each on
        average, took ``seconds``."""
        at_speed = seconds / self.drafting_speed
        read = self.level_context * rows * context
        self.level.observe(rows, max(at_speed - read, 0.5 * at_speed))

    def observe_overheads(self, other: float | None, drafting: bool, gap: float, step: float) -> None:
        """Learn a step's ``other`` seconds besides its passes (None: a step that teaches none) and
        the ``gap`` from its end to the next step's start (``step``: its own length, the first gap's
        bound). ``drafting``: the step verified or sent drafts: its overhead is a drafting step's."""
        if other is not None:
            if drafting:
                # Tree bookkeeping, the allocation and the drafts' transfer: a drafting step's own.
                other /= self.drafting_speed
                last = self.overhead if self.draft_overhead is None else self.draft_overhead
                self.draft_overhead = last + OVERHEAD_RATE * (other - last)
            else:
                self.overhead += OVERHEAD_RATE * (other / self.speed - self.overhead)
        gap /= self.speed
        self.between += OVERHEAD_RATE * min(gap - self.between, self.between or step)

    def costs(self, context: float = 0.0) -> dict[str, Any]:
        """The cost model as :func:`~vllm_eagle2.budget.decisions.plan_draft` and ``step_cost`` take
        it, for requests holding ``context`` tokens each on average, on the live curves: the budget
        learns only as a step starts, so they hold for a step."""
        speed, drafting = self.speed, self.drafting_speed
        row, level_row = self.context * context, self.level_context * context
        target, verify, level = self.target, self.verify, self.level
        if self.draft_overhead is None:
            draft_overhead = speed * self.overhead
        else:
            draft_overhead = drafting * self.draft_overhead
        plain = ScaledCurve(target, speed, row)
        return {
            "target": plain,
            "verify": ScaledCurve(verify, drafting, row) if verify.observed else plain,
            "level": ScaledCurve(level, drafting, level_row),
            "overhead": speed * (self.overhead + self.between),
            "draft_overhead": draft_overhead + speed * self.between,
        }

    #: The scalars :meth:`state` holds, in order (``draft_overhead`` NaN while unset).
    SCALARS = ("speed", "drafting_speed", "overhead", "draft_overhead", "between", "context", "level_context")

    def state(self) -> np.ndarray:
        """Everything learnt from timings, as one float64 vector (NaN = unset)."""
        scalars = [getattr(self, name) for name in self.SCALARS]
        scalars = [np.nan if x is None else x for x in scalars]
        curves = [curve.state() for curve in (self.target, self.verify, self.level)]
        return np.concatenate([np.array(scalars, dtype=np.float64), *curves])

    def load_state(self, state: np.ndarray) -> None:
        """Take another engine's :meth:`state` (the same settings)."""
        for name, x in zip(self.SCALARS, state[: len(self.SCALARS)]):
            setattr(self, name, None if np.isnan(x) else float(x))
        curves = (self.target, self.verify, self.level)
        parts = np.split(
            state[len(self.SCALARS) :], np.cumsum([3 * len(curve.knots) for curve in curves])[:-1]
        )
        for curve, part in zip(curves, parts):
            curve.load_state(part)

    def summary(self) -> dict[str, Any]:
        """The overheads and speeds, and the curves' prices in ms at their first knots (a target
        pass, a verifying one, a draft level): what the planner weighs, for the metrics."""
        costs = self.costs()
        draft_overhead = self.draft_overhead
        if draft_overhead is not None:
            draft_overhead *= self.drafting_speed * 1e3
        prices = {}
        for name in ("target", "verify", "level"):
            knots = [int(k) for k in getattr(self, name).knots[:7]]
            prices[name] = {str(k): round(1e3 * float(costs[name](k)), 2) for k in knots}
        return {
            "overhead_ms": self.speed * self.overhead * 1e3,
            "draft_overhead_ms": draft_overhead,
            "between_steps_ms": self.speed * self.between * 1e3,
            "speed": round(self.speed, 3),
            "drafting_speed": round(self.drafting_speed, 3),
            # a target row's attention over 1,000 tokens of context, at the machine's speed
            "context_ms_per_row_1k": round(self.speed * self.context * 1e6, 4),
            "prices_ms": prices,
        }
