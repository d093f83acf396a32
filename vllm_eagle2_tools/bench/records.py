"""Measurement records: one engine's timed generation (:class:`Run`) and its row of results."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
    lookup_accepted: float = 0.0  # of ``accepted``, the drafts that came from lookup chains
    accepted_per_pos: list[float] = field(default_factory=list)
    budget: dict[str, Any] | None = None
    error: str | None = None
    round: int = 0  # ``--rounds``: which pass over the batch size's engines timed this run
    dataset: str = ""  # the prompt set timed (``--dataset a,b`` times several on the same engines)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed on to vLLM's ``LLM``

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


def speedup_text(row: dict[str, Any]) -> str:
    """A row's speed-up, ``1.02x``, or over several rounds their median and range: ``1.02x (0.97-1.05)``."""
    if not row.get("speedup"):
        return "-"
    rounds = row.get("speedup_rounds", [])
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"{row['speedup']:.2f}x{spread}"


def mean_drafts_per_step(hist: dict[str, int], steps: int) -> float:
    """Mean drafts per step from a histogram {drafts as a string: steps}."""
    return sum(int(k) * v for k, v in hist.items()) / steps if steps else 0.0


def _budget_sum(budgets: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The adaptive budget's counters of several rounds, added up (None without any)."""
    have = [b for b in budgets if b]
    if not have:
        return None
    steps = sum(b["steps"] for b in have)
    hist = dict(sum((Counter(b["drafts_per_step"]) for b in have), Counter()))
    return {
        "steps": steps,
        "steps_without_drafts": sum(b["steps_without_drafts"] for b in have),
        "steps_head_skipped": sum(b.get("steps_head_skipped", 0) for b in have),
        "mean_drafts_per_step": mean_drafts_per_step(hist, steps),
        "drafts_per_step": hist,
        "shapes": dict(sum((Counter(b["shapes"]) for b in have), Counter())),
        "overhead_ms": float(np.median([b["overhead_ms"] for b in have])),
        "replans": sum(b.get("replans", 0) for b in have),
        # the last round's state of the cost and acceptance models: what the plans weighed
        "acceptance_top1": have[-1].get("acceptance_top1"),
        "prices_ms": have[-1].get("prices_ms"),
        "probes": sum(b.get("probes", 0) for b in have),
        "steps_vetoed": sum(b.get("steps_vetoed", 0) for b in have),
        "measured_rates": have[-1].get("measured_rates"),
    }


def summarize(runs: list[Run], bases: list[Run | None], greedy: bool) -> dict[str, Any]:
    """One row of results for one engine timed in one or more rounds (``runs[i]`` in round i, against
    that round's no-speculation run ``bases[i]``): speed, tau, per-position acceptance, identity with no
    speculation.

    ``seconds``: the median over rounds of each round's fastest pass; ``speedup``: the median of the
    rounds' own speed-ups (``speedup_rounds``), so that a slow spell of the machine, which slows both
    engines of a round, cancels out. Counters are summed over rounds; at temperature 0 every round's
    outputs are compared with its own round's no-speculation outputs.
    """
    ok = [(r, b) for r, b in zip(runs, bases) if not r.error]
    first = ok[0][0] if ok else runs[0]
    width = max((len(r.accepted_per_pos) for r, _ in ok), default=0)
    total = Run(  # the rounds' counters added up, for tau and the acceptance per position
        first.mode,
        first.label,
        first.batch_size,
        first.spec,
        drafts=sum(r.drafts for r, _ in ok),
        accepted=sum(r.accepted for r, _ in ok),
        accepted_per_pos=[
            sum(r.accepted_per_pos[i] for r, _ in ok if i < len(r.accepted_per_pos)) for i in range(width)
        ],
    )
    seconds = float(np.median([r.seconds for r, _ in ok])) if ok else 0.0
    row: dict[str, Any] = {
        "mode": first.mode,
        "label": first.label,
        "batch_size": first.batch_size,
        "spec": first.spec,
        "tokens": first.num_tokens,
        "seconds": round(seconds, 3),
        "seconds_all_repeats": [s for r, _ in ok for s in r.seconds_all],
        "tokens_per_s": round(first.num_tokens / seconds, 2) if seconds > 0 else None,
        "engine_start_seconds": first.engine_start_seconds,
        "drafts": total.drafts,
        "accepted": total.accepted,
        "tau": round(total.tau, 4) if total.tau is not None else None,
        # tau's share from lookup chains: tau = 1 + (accepted - this) / drafts + this / drafts
        "accepted_from_lookup": sum(r.lookup_accepted for r, _ in ok),
        "acceptance_per_pos": [round(x, 4) for x in total.acceptance_per_pos],
        "budget": _budget_sum([r.budget for r, _ in ok]),
        "error": next((r.error for r in runs if r.error), None),
    }
    speedups = [
        r.tokens_per_s / b.tokens_per_s for r, b in ok if b is not None and b.tokens_per_s and r.tokens_per_s
    ]
    if speedups:
        row["speedup"] = round(float(np.median(speedups)), 3)
        row["speedup_rounds"] = [round(x, 3) for x in speedups]
    pairs = [(r, b) for r, b in ok if greedy and b is not None and r.tokens and r is not b]
    if pairs:
        divs = [first_divergence(x, y) for r, b in pairs for x, y in zip(b.tokens, r.tokens)]
        row["identical"] = sum(d is None for d in divs)
        row["compared"] = len(divs)
        row["first_divergence"] = sorted(d for d in divs if d is not None)
    return row


def result_rows(runs: list[Run], batch_sizes: list[int], greedy: bool) -> tuple[list[dict], list[dict]]:
    """(all rows, main rows): one row per engine (its rounds combined, see :func:`summarize`), batch size
    by batch size, each against the no-speculation run of its own round at its batch size; the main rows
    leave out the sweep and all of vLLM's eagle (and eagle3) rows but the fastest at each batch size."""
    all_rows: list[dict[str, Any]] = []
    main_rows: list[dict[str, Any]] = []
    for bs in batch_sizes:
        at_bs = [r for r in runs if r.batch_size == bs]
        base = {r.round: r for r in at_bs if r.mode == "nospec" and not r.error}
        labels = list(dict.fromkeys(r.label for r in at_bs))
        rows = []
        for label in labels:
            rounds = sorted((r for r in at_bs if r.label == label), key=lambda r: r.round)
            rows.append(summarize(rounds, [base.get(r.round) for r in rounds], greedy))
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
