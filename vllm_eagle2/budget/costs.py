"""What passes cost: cost curves over token counts, fixed costs for tests, timers, calibration.

No vLLM here. A :class:`CostCurve` learns the seconds of one pass per token count (knots at 1, 2,
4, ... tokens); the adaptive budget (:mod:`vllm_eagle2.budget.adaptive`) calibrates the target's and a
draft level's at engine start (:func:`calibrate_curves`) and refines them while serving, timed
by a :class:`Clock` (CUDA events on GPUs, resolved after the step's one host sync).

``VLLM_EAGLE2_STEP_COSTS='{"target": [a, b], "level": [a, b], "overhead": s}'`` replaces the
measured costs by fixed linear ones (seconds = a + b * tokens): no calibration, no online
updates; ``"draft_overhead"`` (default: ``overhead``) prices a drafting step's own apart, and
``"context"`` (default 0) each target row's reads of its request's context, in seconds per token
of context. For tests and for what-if runs; the engine never needs it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("vllm.eagle2")

COSTS_ENV = "VLLM_EAGLE2_STEP_COSTS"
#: Calibration stops doubling a curve once one pass takes longer than this (seconds), but not
#: below ``CALIBRATION_MIN_TOKENS``: a pass that stalls (a shared machine) would otherwise leave
#: one knot, and a curve proportional from the origin prices a second token as a second pass,
#: so that drafting never looks worth trying again.
CALIBRATION_PASS_S = 0.25
CALIBRATION_MIN_TOKENS = 64

#: The slowest rate at which a cost knot follows the passes it sees (a memory of ~10 passes).
OBSERVE_RATE = 0.1


class CostCurve:
    """Seconds of one pass as a piecewise-linear function of the tokens (rows) it processes.

    Knots at 1, 2, 4, ... up to the first power of two >= ``max_tokens``. Two layers:

    * the *base* curve, from a calibration (:meth:`set`): knots never set are filled by
      linear interpolation and, past the last set knot, by extending its segment
      (proportionally from the origin when only one knot is set);
    * *live* knots, from the passes the engine times (:meth:`observe`). A knot never observed
      keeps the base curve's shape scaled to the nearest observed knot: a start-up
      calibration that prices every pass at a third of the real cost is corrected for all
      sizes by the sizes the engine actually runs.

    The base curve is made non-decreasing from the top (a knot costs at most what the next
    larger one does): on a shared machine a calibration pass can stall, and a stalled small
    knot would otherwise price every size above it as nearly free.
    """

    def __init__(self, max_tokens: int) -> None:
        top = max(1, int(max_tokens) - 1).bit_length()
        self.knots = np.array([1 << i for i in range(top + 1)], dtype=np.float64)
        self._base = np.full(len(self.knots), np.nan)
        self._live = np.full(len(self.knots), np.nan)
        self._weight = np.zeros(len(self.knots))  # observations each live knot has averaged
        self._values: np.ndarray | None = None

    @property
    def observed(self) -> bool:
        """Whether any knot has been observed (not only calibrated)."""
        return bool(np.isfinite(self._live).any())

    @property
    def ready(self) -> bool:
        """Whether any knot has been calibrated or observed."""
        return bool(np.isfinite(self._base).any() or np.isfinite(self._live).any())

    def set(self, tokens: int, seconds: float) -> None:
        """Calibrate knot ``tokens`` (a power of two within the curve)."""
        i = int(np.searchsorted(self.knots, tokens))
        if i >= len(self.knots) or self.knots[i] != tokens:
            raise ValueError(f"{tokens} is not a knot of this curve (powers of two to {self.knots[-1]:.0f})")
        self._base[i] = max(float(seconds), 0.0)
        self._values = None

    def _filled(self, known: np.ndarray) -> np.ndarray:
        have = np.isfinite(known)
        x, y = self.knots[have], known[have]
        filled = np.interp(self.knots, x, y)
        slope = y[0] / x[0] if len(x) == 1 else max((y[-1] - y[-2]) / (x[-1] - x[-2]), 0.0)
        after = self.knots > x[-1]
        filled[after] = y[-1] + slope * (self.knots[after] - x[-1])
        return filled

    def values(self) -> np.ndarray:
        """Seconds at every knot."""
        if self._values is None:
            if not self.ready:
                raise RuntimeError("CostCurve has no measurement yet")
            live = np.isfinite(self._live)
            base = None
            if np.isfinite(self._base).any():
                # Stalls only ever add time: the smaller of two calibrated costs is the truer one.
                base = np.minimum.accumulate(self._filled(self._base)[::-1])[::-1]
            if base is None:
                self._values = self._filled(self._live)
            elif not live.any():
                self._values = base
            else:
                base = np.maximum(base, 1e-12)
                observed = np.flatnonzero(live)
                pos = np.arange(len(self.knots))
                right = np.clip(np.searchsorted(observed, pos), 0, len(observed) - 1)
                left = np.clip(right - 1, 0, len(observed) - 1)
                nearest = np.where(
                    np.abs(observed[left] - pos) < np.abs(observed[right] - pos),
                    observed[left],
                    observed[right],
                )
                self._values = np.where(live, self._live, base * self._live[nearest] / base[nearest])
            # A pass never costs less than a smaller one. Without this envelope a knot priced
            # high by a stall is never run again, so never corrected (measured at batch 1: 4-token
            # verification priced at 55 ms against 36 ms for 8 tokens, for over 150 steps).
            self._values = np.minimum.accumulate(self._values[::-1])[::-1]
        return self._values

    def __call__(self, tokens: np.ndarray | float) -> np.ndarray:
        """Predicted seconds at ``tokens`` (any shape); linear past the last knot."""
        y = self.values()
        t = np.asarray(tokens, dtype=np.float64)
        inside = np.interp(t, self.knots, y)
        slope = max((y[-1] - y[-2]) / (self.knots[-1] - self.knots[-2]), 0.0) if len(y) > 1 else y[0]
        return np.where(t > self.knots[-1], y[-1] + slope * (t - self.knots[-1]), inside)

    def state(self) -> np.ndarray:
        """[3 * knots] float64: calibrated knots, live knots (NaN = unset) and their weights."""
        return np.concatenate([self._base, self._live, self._weight])

    def load_state(self, state: np.ndarray) -> None:
        """Take another curve's :meth:`state` (same knots)."""
        self._base, self._live, self._weight = (np.array(part) for part in np.split(state, 3))
        self._values = None

    def observe(self, tokens: float, seconds: float) -> None:
        """Move the curve at ``tokens`` towards ``seconds``: a running mean per knot.

        Each knot averages the passes it has seen, weighted by how close they ran to it, with
        its current price counted as one pass: a rate of ``1 / (observations + 1)``, but at
        least ``OBSERVE_RATE``. Early passes correct a calibration quickly (start-up passes
        under-price real steps, here by up to 3.5x); later ones average out the machine's
        noise (steps of one shape vary by +-20% here), where a fixed high rate let one slow
        pass reprice a size for good once the planner stopped running it. The error is
        clipped to [-0.5, +1] times the prediction. On a curve with no knot yet, the
        observation sets the nearest knot.
        """
        t = min(max(float(tokens), 1.0), self.knots[-1])
        if not self.ready:
            i = int(np.argmin(np.abs(np.log2(self.knots) - math.log2(t))))
            self._live[i] = max(seconds, 0.0)
            self._values = None
            return
        y = self.values()
        hi = min(int(np.searchsorted(self.knots, t)), len(self.knots) - 1)
        lo = max(hi - 1, 0)
        w_hi = 1.0 if hi == lo else (t - self.knots[lo]) / (self.knots[hi] - self.knots[lo])
        predicted = (1 - w_hi) * y[lo] + w_hi * y[hi]
        err = float(np.clip(seconds - predicted, -0.5 * predicted, predicted))
        for knot, weight in ((lo, 1 - w_hi), (hi, w_hi)):
            if weight > 0:  # a knot the measurement does not touch keeps following its neighbours
                self._weight[knot] += weight
                rate = max(weight / (self._weight[knot] + 1.0), OBSERVE_RATE * weight)
                self._live[knot] = y[knot] + rate * err
        self._values = None


class ScaledCurve:
    """A :class:`CostCurve` at the machine's current speed and a context:
    ``factor * (curve(tokens) + per_row * tokens)`` (``per_row``: the price at speed 1 of one
    row's reads of its context)."""

    def __init__(self, curve: CostCurve, factor: float, per_row: float = 0.0) -> None:
        self.curve, self.factor, self.per_row = curve, factor, per_row

    def __call__(self, tokens: np.ndarray | float) -> np.ndarray:
        return self.factor * (self.curve(tokens) + self.per_row * np.asarray(tokens, dtype=np.float64))


#: What the chooser prices passes with: a :class:`CostCurve` or a :class:`ScaledCurve`.
Cost = CostCurve | ScaledCurve


def fixed_costs() -> dict[str, Any] | None:
    """The linear costs :data:`COSTS_ENV` fixes (seconds = a + b * tokens), or None."""
    raw = os.environ.get(COSTS_ENV)
    if not raw:
        return None
    try:
        costs = json.loads(raw)
        for name in ("target", "level"):
            a, b = costs[name]
            costs[name] = (float(a), float(b))
        costs["overhead"] = float(costs.get("overhead", 0.0))
        costs["context"] = float(costs.get("context", 0.0))
        if costs.get("draft_overhead") is not None:
            costs["draft_overhead"] = float(costs["draft_overhead"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f'{COSTS_ENV} must be JSON like {{"target": [a, b], "level": [a, b], "overhead": s, '
            f'"draft_overhead": s, "context": s}} (the last three optional); got {raw!r}'
        ) from exc
    return costs


#: A point in time on a :class:`Clock`: host seconds (CPU) or a recorded CUDA event.
Mark = float | torch.cuda.Event


class Clock:
    """Durations on the host (CPU) or as CUDA events, resolved once the device reached them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[Mark, Mark, Callable[[float], None]]] = []

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def measure(self, start: Mark, end: Mark, sink: Callable[[float], None]) -> None:
        """Call ``sink(seconds)`` for ``start -> end``, now on CPU, after :meth:`resolve` on CUDA."""
        if self.cuda:
            self.pending.append((start, end, sink))
        else:
            sink(end - start)

    def resolve(self) -> None:
        keep = []
        for start, end, sink in self.pending:
            if end.query():
                sink(start.elapsed_time(end) / 1e3)
            else:
                keep.append((start, end, sink))
        self.pending = keep[-256:]  # bounded, should the device never catch up


def set_linear(curve: CostCurve, a: float, b: float) -> None:
    """Set every knot of ``curve`` to ``a + b * tokens`` seconds."""
    for knot in curve.knots:
        curve.set(int(knot), a + b * knot)


#: Makes host values the same on every tensor-parallel rank: rank 0's, broadcast
#: (:func:`vllm_eagle2.engine.ranks.rank_agreement`); the identity with one rank.
Agree = Callable[[np.ndarray], np.ndarray]


def same_everywhere(values: np.ndarray) -> np.ndarray:
    """The :data:`Agree` of an engine with one rank."""
    return values


def calibrate_curves(
    runs: dict[CostCurve, Callable[[int], float]],
    also: Iterable[CostCurve] = (),
    agree: Agree = same_everywhere,
    widest: dict[CostCurve, int] | None = None,
) -> None:
    """Time each curve's pass at 1, 2, 4, ... tokens, the best of two, until a pass takes longer
    than ``CALIBRATION_PASS_S`` past ``CALIBRATION_MIN_TOKENS``, or the knot reaches the curve's
    ``widest`` (the most tokens a pass the plans price can hold: past it only prefill chunks run,
    which no plan prices); ``runs[curve](tokens)`` runs one pass and returns its seconds.
    ``also``: (source, copy) curves, the copy set as the source is.

    Each knot's seconds go through ``agree``: under tensor parallelism every rank then sets the same
    knots and stops after the same pass. A pass runs the model's collectives, so ranks that timed
    alone and stopped apart paired every later collective with the wrong one (wrong output from the
    first token, or a hang)."""
    start = time.perf_counter()
    source, copy = tuple(also) or (None, None)
    for curve, run in runs.items():
        run(1)  # warm-up
        for knot in curve.knots:
            seconds = float(agree(np.array([min(run(int(knot)) for _ in range(2))]))[0])
            curve.set(int(knot), seconds)
            if curve is source:
                copy.set(int(knot), seconds)
            if seconds > CALIBRATION_PASS_S and knot >= CALIBRATION_MIN_TOKENS:
                break
            if widest is not None and knot >= widest.get(curve, knot + 1):
                break
    shown = "; ".join(_describe(curve) for curve in runs)
    logger.info("eagle2 adaptive budget: calibrated in %.1f s; %s", time.perf_counter() - start, shown)


def _describe(curve: CostCurve) -> str:
    y = curve.values()
    shown = [0, len(y) // 2, len(y) - 1]
    return ", ".join(f"{int(curve.knots[i])} tok {y[i] * 1e3:.2f} ms" for i in shown)
