"""What one engine's budget has learnt from timings: the prices its decisions weigh.

The curves of a target pass (without and with drafts to verify) and of one draft level, the
machine's speed for each kind of step, and the time a step costs besides its passes. Learnt at
engine start (:meth:`Prices.calibrate`) and refined by every step; they outlive steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_eagle2.budget.costs import (
    Agree,
    CostCurve,
    ScaledCurve,
    calibrate_curves,
    fixed_costs,
    same_everywhere,
    set_linear,
)

__all__ = ["OVERHEAD_RATE", "SPEED_RATE", "Prices"]

#: Per step, the overheads move this far towards the measured one. The time between two steps rises by
#: at most this share of itself per step: it includes the engine's idle time.
OVERHEAD_RATE = 0.2
#: Per target pass, the machine's speed moves this far towards the one the pass measured.
SPEED_RATE = 0.3


class Prices:
    """Cost curves and overheads, learnt at speed 1; a price is a speed times its curve.

    target: a pass in a step without drafts to verify; verify: in a step with them (the same
    calibration; priced as ``target`` until a verifying step has been timed); level: one draft
    level by rows. overhead / draft_overhead: seconds at speed 1 of a step besides its passes, to
    the drafter's end, without / with drafts (None: not measured yet, ``overhead`` stands in);
    between: from that end to the next step's start (vLLM's own work, shared by both). speed /
    drafting_speed: the machine's, for a step without / with drafts (:meth:`observe_target`).
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
        self.fixed = fixed_costs()
        if self.fixed is not None:
            set_linear(self.target, *self.fixed["target"])
            set_linear(self.verify, *self.fixed["target"])
            set_linear(self.level, *self.fixed["level"])
            self.overhead = self.fixed["overhead"]
            self.draft_overhead = self.fixed.get("draft_overhead")

    def calibrate(
        self, time_target: Callable[[int], float], time_level: Callable[[int], float], agree: Agree
    ) -> None:
        """Time the target and one draft level at 1, 2, 4, ... tokens (:func:`calibrate_curves`);
        skipped with fixed costs. ``time_target(tokens)`` / ``time_level(rows)`` run one pass."""
        if self.fixed is None:
            calibrate_curves(
                {self.target: time_target, self.level: time_level},
                also=(self.target, self.verify),
                agree=agree,
            )

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

    def observe_level(self, rows: int, seconds: float) -> None:
        """A draft level over ``rows`` rows took ``seconds``."""
        self.level.observe(rows, seconds / self.drafting_speed)

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

    def costs(self) -> dict[str, Any]:
        """The cost model as :func:`~vllm_eagle2.budget.decisions.plan_draft` and ``step_cost`` take
        it, on the live curves: the budget learns only as a step starts, so they hold for a step."""
        speed, drafting = self.speed, self.drafting_speed
        target, verify, level = self.target, self.verify, self.level
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

    def agree(self, agree: Agree) -> None:
        """Take rank 0's prices (``agree``), so that every rank decides alike; no-op with one rank
        or fixed costs."""
        if self.fixed is None and agree is not same_everywhere:
            self.load_state(agree(self.state()))

    def state(self) -> np.ndarray:
        """Everything learnt from timings, as one float64 vector (NaN = unset)."""
        draft_overhead = np.nan if self.draft_overhead is None else self.draft_overhead
        scalars = [self.speed, self.drafting_speed, self.overhead, draft_overhead, self.between]
        curves = [curve.state() for curve in (self.target, self.verify, self.level)]
        return np.concatenate([np.array(scalars, dtype=np.float64), *curves])

    def load_state(self, state: np.ndarray) -> None:
        """Take another engine's :meth:`state` (the same settings)."""
        self.speed, self.drafting_speed, self.overhead, draft_overhead, self.between = (
            float(x) for x in state[:5]
        )
        self.draft_overhead = None if np.isnan(draft_overhead) else draft_overhead
        curves = (self.target, self.verify, self.level)
        parts = np.split(state[5:], np.cumsum([3 * len(curve.knots) for curve in curves])[:-1])
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
            "prices_ms": prices,
        }
