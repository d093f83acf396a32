"""What the adaptive budget did, for metrics and ``LLM.collective_rpc("eagle2_budget_summary")``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepCounters"]


@dataclass
class StepCounters:
    """Counters since start: steps, steps without drafts, steps whose lookup chains went alone where
    the plan had head levels, drafts per step and per request (histograms, keyed by count), draft
    shapes planned (``(depth, topk)``; ``(0, 0)`` = none), replans of a cached plan."""

    steps: int = 0
    steps_without_drafts: int = 0
    steps_head_skipped: int = 0
    nodes_per_step: Counter[int] = field(default_factory=Counter)
    nodes_per_request: Counter[int] = field(default_factory=Counter)
    shapes: Counter[tuple[int, int]] = field(default_factory=Counter)
    replans: int = 0

    def count(self, depth: int, topk: int, counts: list[int], head_skipped: bool) -> None:
        """One step that planned ``depth`` x ``topk`` and sent ``counts`` drafts per request."""
        total = sum(counts)
        self.steps += 1
        self.steps_without_drafts += total == 0
        self.steps_head_skipped += head_skipped
        self.nodes_per_step[total] += 1
        self.nodes_per_request.update(counts)
        self.shapes[(depth, topk)] += 1

    def summary(self) -> dict[str, Any]:
        """The counters as JSON (``d{depth}k{topk}`` shapes, ``d0k0`` = none)."""
        total = sum(n * c for n, c in self.nodes_per_step.items())
        return {
            "steps": self.steps,
            "steps_without_drafts": self.steps_without_drafts,
            "steps_head_skipped": self.steps_head_skipped,
            "mean_drafts_per_step": total / self.steps if self.steps else 0.0,
            "drafts_per_step": {str(n): c for n, c in sorted(self.nodes_per_step.items())},
            "drafts_per_request": {str(n): c for n, c in sorted(self.nodes_per_request.items())},
            "shapes": {f"d{d}k{k}": c for (d, k), c in sorted(self.shapes.items())},
            "replans": self.replans,
        }
