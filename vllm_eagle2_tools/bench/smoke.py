"""The smoke check: eagle2 against no speculation, eager and in vLLM's default (compiled) mode.

For anyone with vLLM 0.32 on a machine: engines on one model folder, one after the other in this
process, the same prompts and greedy decoding, each eagerly (``enforce_eager=True``) and in vLLM's
default mode (torch.compile; piecewise CUDA graphs on a GPU):

* no speculation, the reference;
* eagle2 as a user gets it, ``{"method": "eagle2", "model": HEAD}`` and nothing else: the adaptive
  budget (m, depth and topk as upper bounds), lookup chains of 8;
* eagle2 on a fixed tree (``budget: "fixed"``, m, depth and topk as given), unless left out: its
  trees do not depend on measured time, so its compiled tau must equal its eager tau, and it
  always branches (a compiled head that misreads its inputs drafts worse; a broken KV move breaks
  outputs only once an off-chain node is accepted).

The verdict holds when, in each mode, every eagle2 engine's outputs agree with no speculation's
(:data:`CRITERIA`), it sent drafts and some were accepted (an engine that drafted nothing exercised
nothing), the fixed tree accepted an off-chain node (a KV move), and the fixed tree's compiled tau
is within ``TAU_TOLERANCE`` of its eager tau. The adaptive budget's tau is not compared across
modes: it sizes trees from timings, and compiled steps time differently.

Agreement is exact identity in float32 on a CPU. On CUDA vLLM's Triton attention computes float32
dot products in TF32 (Triton's default for ``tl.dot``) while eagle2's tree attention computes them
in IEEE float32, so a correct install can part at a near-tie; there, and in bf16, outputs agree when
at their first difference each side's token is among the other's top-5 logprobs, as vLLM's own
spec-decode and model tests compare.
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

#: Largest relative gap between compiled and eager tau that passes (fixed trees only).
TAU_TOLERANCE = 0.02
MODES = ("eager", "compiled")
NO_SPEC = "no speculation"
#: eagle2's defaults: the engine a user gets from ``{"method": "eagle2", "model": HEAD}``.
DEFAULTS = "eagle2"
#: eagle2 with ``budget: "fixed"`` and the given tree.
FIXED = "eagle2 fixed tree"
#: Logprobs kept per output token under the ``logprobs`` criterion (vLLM's tests use 5 too).
TOP_LOGPROBS = 5
#: How eagle2's greedy outputs must agree with no speculation's, by criterion name.
CRITERIA = {
    "identity": "identical token for token (float32 on a CPU: any difference is a bug)",
    "logprobs": (
        f"identical, or at the first difference each side's token is among the other's top-{TOP_LOGPROBS} "
        "logprobs (a near-tie; on CUDA vLLM's Triton attention uses TF32 dot products by default "
        "while eagle2's tree attention uses IEEE float32)"
    ),
}


@dataclass
class Sitting:
    """One engine's run: greedy tokens per prompt, generation seconds, what it drafted.

    ``drafts`` and ``accepted`` are vLLM's counters over the timed generation (drafts: requests
    times steps that carried drafts; accepted: draft tokens accepted). ``eagle2``: what eagle2's
    verification exercised over the same generation (VerifyCounters' summary: ``drafts`` draft
    tokens verified, ``kv_moves`` accepted off-chain nodes, ...). ``logprobs``: per prompt, per
    output token, {token id: logprob} of the top :data:`TOP_LOGPROBS` and the sampled token (kept
    only under the ``logprobs`` criterion). ``budget``: the eagle2 budget ("adaptive", "fixed"),
    None without speculation.
    """

    engine: str  # NO_SPEC, DEFAULTS or FIXED
    mode: str  # "eager" or "compiled"
    tokens: list[list[int]]
    seconds: float
    start_seconds: float
    drafts: float = 0.0
    accepted: float = 0.0
    eagle2: dict[str, int] | None = None
    logprobs: list[list[dict[int, float]]] | None = None
    budget: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds

    @property
    def tau(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.drafts else None


@dataclass
class Verdict:
    """Whether the check passed, why not (``reasons``), what else the reader should know
    (``notes``: not failures), and the agreement criterion it ran (a key of :data:`CRITERIA`)."""

    passed: bool
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    criterion: str = "identity"


def default_criterion(dtype: str, cuda: bool) -> str:
    """``identity`` for float32 on a CPU, else ``logprobs`` (see the module's docstring)."""
    return "identity" if dtype == "float32" and not cuda else "logprobs"


def near_tie(
    a: list[int], a_logprobs: list[dict[int, float]], b: list[int], b_logprobs: list[dict[int, float]]
) -> bool:
    """Whether greedy outputs ``a`` and ``b`` (token ids) part at a near-tie: at their first differing
    position i, ``a[i]`` is among ``b``'s top logprobs at i and ``b[i]`` among ``a``'s (vLLM's
    ``check_logprobs_close``). ``*_logprobs``: per output token, {token id: logprob}. Equal outputs
    are trivially close; outputs of different lengths that agree up to the shorter are not (greedy
    runs here ignore EOS, so lengths differ only when something is wrong)."""
    i = first_divergence(a, b)
    if i is None:
        return True
    if i >= min(len(a), len(b)) or i >= min(len(a_logprobs), len(b_logprobs)):
        return False
    return a[i] in b_logprobs[i] and b[i] in a_logprobs[i]


def _stats_delta(after: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int] | None:
    if after is None:
        return None
    return {k: v - (before or {}).get(k, 0) for k, v in after.items()}


def run_sitting(
    model: Path,
    spec: dict[str, Any] | None,
    prompts: list[Any],
    *,
    engine: str,
    mode: str,
    dtype: str,
    max_tokens: int,
    logprobs: bool = False,
    **engine_kwargs: Any,
) -> Sitting:
    """Start one engine, generate greedily (timed: the generation only, after start-up and a short
    untimed pass), shut it down. ``logprobs``: keep the top :data:`TOP_LOGPROBS` per token."""
    from vllm import SamplingParams

    log(f"{engine}, {mode}: starting the engine")
    t0 = time.perf_counter()
    llm = build_llm(
        model, spec, dtype=dtype, eager=mode == "eager", max_num_seqs=len(prompts), **engine_kwargs
    )
    try:
        start = time.perf_counter() - t0
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=TOP_LOGPROBS if logprobs else None,
        )
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        drafts0, accepted0, _ = spec_counters(llm)
        stats0 = llm.collective_rpc("eagle2_stats")[0] if spec is not None else None
        t1 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t1
        drafts1, accepted1, _ = spec_counters(llm)
        stats1 = llm.collective_rpc("eagle2_stats")[0] if spec is not None else None
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()
    kept = None
    if logprobs:
        kept = [
            [{t: lp.logprob for t, lp in position.items()} for position in o.outputs[0].logprobs or []]
            for o in outputs
        ]
    return Sitting(
        engine=engine,
        mode=mode,
        tokens=[list(o.outputs[0].token_ids) for o in outputs],
        seconds=seconds,
        start_seconds=start,
        drafts=drafts1 - drafts0,
        accepted=accepted1 - accepted0,
        eagle2=_stats_delta(stats1, stats0),
        logprobs=kept,
        budget=None if spec is None else spec.get("budget", "adaptive"),
    )


def _where(engine: str, mode: str) -> str:
    """How a reason names a sitting: the mode for eagle2's defaults, mode and tree otherwise."""
    return mode if engine == DEFAULTS else f"{mode}, {engine.removeprefix('eagle2 ')}"


def judge(sittings: dict[tuple[str, str], Sitting], criterion: str = "identity") -> Verdict:
    """The verdict over the sittings, keyed (engine, mode); each eagle2 engine is judged against
    no speculation in the same mode, under ``criterion`` (a key of :data:`CRITERIA`)."""
    verdict = Verdict(passed=True, criterion=criterion)

    def fail(reason: str) -> None:
        verdict.passed = False
        verdict.reasons.append(reason)

    engines = [e for e in dict.fromkeys(e for e, _ in sittings) if e != NO_SPEC]
    for engine in engines:
        for mode in MODES:
            if (engine, mode) not in sittings:
                continue
            base, eagle = sittings[(NO_SPEC, mode)], sittings[(engine, mode)]
            where = _where(engine, mode)
            differ = [i for i, (a, b) in enumerate(zip(base.tokens, eagle.tokens)) if a != b]
            at = [first_divergence(base.tokens[i], eagle.tokens[i]) for i in differ]
            if differ and criterion == "identity":
                fail(f"{where}: {len(differ)} of {len(base.tokens)} outputs differ (first at tokens {at})")
            elif differ:
                far = [
                    i
                    for i in differ
                    if base.logprobs is None
                    or eagle.logprobs is None
                    or not near_tie(base.tokens[i], base.logprobs[i], eagle.tokens[i], eagle.logprobs[i])
                ]
                if far:
                    far_at = [first_divergence(base.tokens[i], eagle.tokens[i]) for i in far]
                    fail(
                        f"{where}: {len(far)} of {len(base.tokens)} outputs differ beyond a near-tie "
                        f"(first at tokens {far_at})"
                    )
                if len(far) < len(differ):
                    verdict.notes.append(
                        f"{where}: {len(differ) - len(far)} of {len(base.tokens)} outputs part at a near-tie "
                        f"(each side's token among the other's top-{TOP_LOGPROBS}), accepted by the criterion"
                    )
            if not eagle.drafts:
                fail(f"{where}: eagle2 sent no drafts, so this engine exercised no speculation")
            elif eagle.tau is None or eagle.tau <= 1.0:
                fail(f"{where}: eagle2 accepted no drafts")
            moved = (eagle.eagle2 or {}).get("kv_moves", 0)
            if not moved and eagle.budget != "adaptive":
                fail(f"{where}: no accepted off-chain node (a branching tree) was verified")
            elif not moved and eagle.drafts:
                verdict.notes.append(
                    f"{where}: the adaptive budget's trees had no accepted off-chain node (no KV move)"
                )
        eager, compiled = sittings.get((engine, "eager")), sittings.get((engine, "compiled"))
        # The adaptive budget sizes trees from measured step times, which differ between modes.
        if eager and compiled and eager.budget != "adaptive" and eager.tau and compiled.tau:
            if abs(compiled.tau / eager.tau - 1.0) > TAU_TOLERANCE:
                name = "" if engine == DEFAULTS else f"{engine.removeprefix('eagle2 ')}: "
                fail(
                    f"{name}compiled tau {compiled.tau:.3f} is not within {TAU_TOLERANCE:.0%} of eager tau "
                    f"{eager.tau:.3f}"
                )
    return verdict


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def report(sittings: dict[tuple[str, str], Sitting], verdict: Verdict, fixed_knobs: str = "") -> str:
    """The tables and the verdict, as printed: eagle2's defaults beside no speculation, one row
    per (mode, engine); then the fixed tree's rows, if it ran (``fixed_knobs``: its settings)."""
    head = ["tokens/s", "tau", "drafts", "draft tokens", "accepted", "KV moves", "identical to no-spec"]
    head += ["start-up s (compile incl.)"]

    def cells(s: Sitting) -> list[str]:
        base = sittings[(NO_SPEC, s.mode)]
        if s is base:
            return [f"{s.tokens_per_s:.1f}", "-", "-", "-", "-", "-", "(reference)", f"{s.start_seconds:.0f}"]
        same = sum(a == b for a, b in zip(base.tokens, s.tokens))
        stats = s.eagle2 or {}
        return [
            f"{s.tokens_per_s:.1f}",
            f"{s.tau:.3f}" if s.tau else "- (drafted nothing)" if not s.drafts else "-",
            f"{s.drafts:.0f}",
            str(stats.get("drafts", "-")),
            f"{s.accepted:.0f}",
            str(stats.get("kv_moves", "-")),
            f"{same}/{len(base.tokens)}",
            f"{s.start_seconds:.0f}",
        ]

    lines = ["eagle2's defaults (adaptive budget, lookup chains) against no speculation:"]
    lines += _table(
        [["mode", "engine", *head]]
        + [
            [mode, engine, *cells(s)]
            for (engine, mode), s in sittings.items()
            if engine in (NO_SPEC, DEFAULTS)
        ]
    )
    fixed = [s for (engine, _), s in sittings.items() if engine == FIXED]
    if fixed:
        lines += ["", f"eagle2 on a fixed tree (budget fixed{', ' + fixed_knobs if fixed_knobs else ''}):"]
        lines += _table([["fixed tree, mode", *head]] + [[f"fixed tree, {s.mode}", *cells(s)] for s in fixed])
    lines += [
        "",
        "drafts: requests x steps that carried drafts; draft tokens: verified; accepted: draft tokens "
        "accepted; KV moves: accepted off-chain nodes (branching trees)",
        f"criterion ({verdict.criterion}): eagle2's greedy outputs {CRITERIA[verdict.criterion]}",
        "",
        "verdict: PASS" if verdict.passed else "verdict: FAIL",
    ]
    lines.extend(f"  - {r}" for r in verdict.reasons)
    lines.extend(f"  note: {n}" for n in verdict.notes)
    return "\n".join(lines)


def smoke_check(
    model: Path,
    head: Path,
    prompts: list[Any],
    *,
    dtype: str,
    max_tokens: int,
    spec_knobs: dict[str, Any],
    fixed_tree: bool = True,
    criterion: str = "identity",
    **engine_kwargs: Any,
) -> tuple[dict[tuple[str, str], Sitting], Verdict]:
    """Run the sittings, eager first (so a compile failure still leaves the eager verdict): per
    mode no speculation, eagle2's defaults, and with ``fixed_tree`` eagle2 on the fixed tree
    ``spec_knobs`` (num_speculative_tokens, depth, topk). ``criterion``: a key of :data:`CRITERIA`."""
    specs: dict[str, dict[str, Any] | None] = {
        NO_SPEC: None,
        DEFAULTS: {"method": "eagle2", "model": str(head)},
    }
    if fixed_tree:
        specs[FIXED] = {"method": "eagle2", "model": str(head), "budget": "fixed", **spec_knobs}
    sittings: dict[tuple[str, str], Sitting] = {}
    for mode in MODES:
        for engine, spec in specs.items():
            sittings[(engine, mode)] = run_sitting(
                model,
                spec,
                prompts,
                engine=engine,
                mode=mode,
                dtype=dtype,
                max_tokens=max_tokens,
                logprobs=criterion == "logprobs",
                **engine_kwargs,
            )
    return sittings, judge(sittings, criterion)
