"""The adaptive budget's counters, for metrics and ``LLM.collective_rpc("eagle2_budget_summary")``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_eagle2.budget.adaptive import AdaptiveBudget


def summarize(budget: AdaptiveBudget) -> dict[str, Any]:
    """Counters since start: steps, steps without drafts, steps whose lookup chains went alone where
    the plan had head levels, drafts per step and per request
    (histograms, keyed by count), draft shapes planned (``d{depth}k{topk}``; ``d0k0`` = none)."""
    total = sum(n * c for n, c in budget.nodes_per_step.items())
    draft_overhead = budget.draft_overhead
    if draft_overhead is not None:
        draft_overhead *= budget.drafting_speed * 1e3
    return {
        "steps": budget.steps,
        "steps_without_drafts": budget.steps_without_drafts,
        "steps_head_skipped": budget.steps_head_skipped,
        "mean_drafts_per_step": total / budget.steps if budget.steps else 0.0,
        "drafts_per_step": {str(n): c for n, c in sorted(budget.nodes_per_step.items())},
        "drafts_per_request": {str(n): c for n, c in sorted(budget.nodes_per_request.items())},
        "shapes": {f"d{d}k{k}": c for (d, k), c in sorted(budget.shapes.items())},
        "overhead_ms": budget.speed * budget.overhead * 1e3,
        "draft_overhead_ms": draft_overhead,
        "between_steps_ms": budget.speed * budget.between * 1e3,
        "replans": budget.replans,
        "speed": round(budget.speed, 3),
        "drafting_speed": round(budget.drafting_speed, 3),
        "sent_per_request": {str(b): round(n, 2) for b, n in sorted(budget._sent.items())},
        "acceptance_top1": [round(float(x), 3) for x in budget.acceptance.p[:, 0]],
        "prices_ms": _prices_ms(budget),
    }


def _prices_ms(budget: AdaptiveBudget) -> dict[str, dict[str, float]]:
    """The cost model's current prices in ms (a target pass, a verifying one, a draft level),
    at the curves' first knots: what the planner weighs, for the metrics."""
    costs = budget._costs()
    out = {}
    for name in ("target", "verify", "level"):
        knots = [int(k) for k in getattr(budget, name).knots[:7]]
        out[name] = {str(k): round(1e3 * float(costs[name](k)), 2) for k in knots}
    return out
