"""The smoke check: eagle2 against no speculation, eager and in vLLM's default (compiled) mode.

For anyone with vLLM 0.32 on a machine: four engines on one model folder, one after the other in
this process, the same prompts and greedy decoding: no speculation and eagle2, each eagerly
(``enforce_eager=True``) and in vLLM's default mode (torch.compile; piecewise CUDA graphs on a
GPU). The verdict holds when, in each mode, eagle2's outputs equal no speculation's token for
token, eagle2 accepted drafts (tau > 1) and verified branching trees, and the compiled tau is
within ``TAU_TOLERANCE`` of the eager one (a compiled head that misreads its inputs drafts worse).

Greedy identity is exact in float32 (the default here); in bf16 a near-tie between two tokens can
flip between a one-token step and a verification pass, so a bf16 run may report a difference that
is not a bug (rerun in float32 to tell).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_eagle2_tools.bench.records import first_divergence
from vllm_eagle2_tools.engine import build_llm, shutdown_llm, spec_counters
from vllm_eagle2_tools.progress import stderr_log

log = stderr_log("smoke")

#: Largest relative gap between compiled and eager tau that passes.
TAU_TOLERANCE = 0.02
MODES = ("eager", "compiled")


@dataclass
class Sitting:
    """One engine's run: greedy tokens per prompt, generation seconds, spec-decode counters."""

    engine: str  # "no speculation" or "eagle2"
    mode: str  # "eager" or "compiled"
    tokens: list[list[int]]
    seconds: float
    start_seconds: float
    drafts: float = 0.0
    accepted: float = 0.0
    eagle2: dict[str, int] | None = None  # VerifyCounters' summary

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds

    @property
    def tau(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.drafts else None


@dataclass
class Verdict:
    passed: bool
    reasons: list[str] = field(default_factory=list)


def run_sitting(
    model: Path,
    spec: dict[str, Any] | None,
    prompts: list[Any],
    *,
    mode: str,
    dtype: str,
    max_tokens: int,
    **engine_kwargs: Any,
) -> Sitting:
    """Start one engine, generate greedily (not timed: start-up and a warm-up pass), shut it down."""
    from vllm import SamplingParams

    engine = "no speculation" if spec is None else "eagle2"
    log(f"{engine}, {mode}: starting the engine")
    t0 = time.perf_counter()
    llm = build_llm(
        model, spec, dtype=dtype, eager=mode == "eager", max_num_seqs=len(prompts), **engine_kwargs
    )
    try:
        start = time.perf_counter() - t0
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        drafts0, accepted0, _ = spec_counters(llm)
        t1 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t1
        drafts1, accepted1, _ = spec_counters(llm)
        counters = llm.collective_rpc("eagle2_stats")[0] if spec is not None else None
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()
    return Sitting(
        engine=engine,
        mode=mode,
        tokens=[list(o.outputs[0].token_ids) for o in outputs],
        seconds=seconds,
        start_seconds=start,
        drafts=drafts1 - drafts0,
        accepted=accepted1 - accepted0,
        eagle2=counters,
    )


def judge(sittings: dict[tuple[str, str], Sitting]) -> Verdict:
    """The verdict over the four sittings, keyed (engine, mode)."""
    verdict = Verdict(passed=True)

    def fail(reason: str) -> None:
        verdict.passed = False
        verdict.reasons.append(reason)

    for mode in MODES:
        base, eagle = sittings[("no speculation", mode)], sittings[("eagle2", mode)]
        diverged = [first_divergence(a, b) for a, b in zip(base.tokens, eagle.tokens) if a != b]
        if diverged:
            fail(f"{mode}: {len(diverged)} of {len(base.tokens)} outputs differ (first at tokens {diverged})")
        if eagle.tau is None or eagle.tau <= 1.0:
            fail(f"{mode}: eagle2 accepted no drafts")
        if not eagle.eagle2 or eagle.eagle2["kv_moves"] == 0:
            fail(f"{mode}: no accepted off-chain node (a branching tree) was verified")
    eager, compiled = sittings[("eagle2", "eager")].tau, sittings[("eagle2", "compiled")].tau
    if eager and compiled and abs(compiled / eager - 1.0) > TAU_TOLERANCE:
        fail(f"compiled tau {compiled:.3f} is not within {TAU_TOLERANCE:.0%} of eager tau {eager:.3f}")
    return verdict


def report(sittings: dict[tuple[str, str], Sitting], verdict: Verdict) -> str:
    """The table and the verdict, as printed."""
    rows = [["mode", "engine", "tokens/s", "tau", "identical to no-spec", "start-up s (compile incl.)"]]
    for (engine, mode), s in sittings.items():
        base = sittings[("no speculation", mode)]
        same = sum(a == b for a, b in zip(base.tokens, s.tokens))
        rows.append(
            [
                mode,
                engine,
                f"{s.tokens_per_s:.1f}",
                f"{s.tau:.3f}" if s.tau else "-",
                "(reference)" if s is base else f"{same}/{len(base.tokens)}",
                f"{s.start_seconds:.0f}",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("verdict: PASS" if verdict.passed else "verdict: FAIL")
    lines.extend(f"  - {r}" for r in verdict.reasons)
    return "\n".join(lines)


def smoke_check(
    model: Path,
    head: Path,
    prompts: list[Any],
    *,
    dtype: str,
    max_tokens: int,
    spec_knobs: dict[str, Any],
    **engine_kwargs: Any,
) -> tuple[dict[tuple[str, str], Sitting], Verdict]:
    """Run the four sittings (eager first, so a compile failure still leaves the eager verdict)."""
    spec = {"method": "eagle2", "model": str(head), "budget": "fixed", **spec_knobs}
    sittings: dict[tuple[str, str], Sitting] = {}
    for mode in MODES:
        for engine_spec in (None, spec):
            s = run_sitting(
                model, engine_spec, prompts, mode=mode, dtype=dtype, max_tokens=max_tokens, **engine_kwargs
            )
            sittings[(s.engine, mode)] = s
    return sittings, judge(sittings)
