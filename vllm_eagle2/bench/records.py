"""Measurement records: one engine's timed generation (:class:`Run`) and its row of results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: vLLM's chain methods, run once per k; the main table keeps the fastest k of each.
CHAIN_MODES = ("eagle", "eagle3")


@dataclass
class Run:
    """One engine's timed generation."""

    mode: str
    label: str
    batch_size: int
    spec: dict[str, Any] | None
    tokens: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    seconds_all: list[float] = field(default_factory=list)
    engine_start_seconds: float = 0.0
    drafts: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)
    budget: dict[str, Any] | None = None
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        """Generated tokens."""
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens per second of generation wall time."""
        return self.num_tokens / self.seconds if self.seconds > 0 else None

    @property
    def tau(self) -> float | None:
        """Mean acceptance length: tokens per target pass (1 + accepted / drafts)."""
        return 1.0 + self.accepted / self.drafts if self.drafts > 0 else None

    @property
    def acceptance_per_pos(self) -> list[float]:
        """Fraction of drafting steps that accepted a token at draft position j (j = 1, 2, ...)."""
        if self.drafts <= 0:
            return []
        rates = [a / self.drafts for a in self.accepted_per_pos]
        while rates and rates[-1] == 0:
            rates.pop()
        return rates


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(run: Run, base: Run | None, greedy: bool) -> dict[str, Any]:
    """One row of results: speed, tau, per-position acceptance, identity with no speculation."""
    row: dict[str, Any] = {
        "mode": run.mode,
        "label": run.label,
        "batch_size": run.batch_size,
        "spec": run.spec,
        "tokens": run.num_tokens,
        "seconds": round(run.seconds, 3),
        "seconds_all_repeats": run.seconds_all,
        "tokens_per_s": round(run.tokens_per_s, 2) if run.tokens_per_s else None,
        "engine_start_seconds": run.engine_start_seconds,
        "drafts": run.drafts,
        "accepted": run.accepted,
        "tau": round(run.tau, 4) if run.tau is not None else None,
        "acceptance_per_pos": [round(x, 4) for x in run.acceptance_per_pos],
        "budget": run.budget,
        "error": run.error,
    }
    if base is not None and base.tokens_per_s and run.tokens_per_s:
        row["speedup"] = round(run.tokens_per_s / base.tokens_per_s, 3)
    if greedy and base is not None and run.tokens and run is not base:
        divs = [first_divergence(a, b) for a, b in zip(base.tokens, run.tokens)]
        row["identical"] = sum(d is None for d in divs)
        row["compared"] = len(divs)
        row["first_divergence"] = sorted(d for d in divs if d is not None)
    return row


def result_rows(runs: list[Run], batch_sizes: list[int], greedy: bool) -> tuple[list[dict], list[dict]]:
    """(all rows, main rows): every run's row, batch size by batch size, each against the no-speculation
    run at its batch size; the main rows leave out the sweep and all of vLLM's eagle (and eagle3) rows
    but the fastest at each batch size."""
    all_rows: list[dict[str, Any]] = []
    main_rows: list[dict[str, Any]] = []
    for bs in batch_sizes:
        at_bs = [r for r in runs if r.batch_size == bs]
        base = next((r for r in at_bs if r.mode == "nospec" and not r.error), None)
        rows = [summarize(r, base, greedy) for r in at_bs]
        all_rows.extend(rows)
        best = {}  # vLLM's chains: the fastest k of each method
        for method in CHAIN_MODES:
            chains = [r for r in rows if r["mode"] == method and r["tokens_per_s"]]
            best[method] = max(chains, key=lambda r: r["tokens_per_s"]) if chains else None
        for r in rows:
            if r["mode"] == "sweep":
                continue
            if r["mode"] not in CHAIN_MODES or best[r["mode"]] is None or r is best[r["mode"]]:
                main_rows.append(r)
    return all_rows, main_rows
