"""Micro-benchmark of the EAGLE-2 tree core on the CPU: build, masks and verification.

Every speculative step runs, besides the draft and target models, three pieces of pure
tensor bookkeeping that this package implements:

1. tree construction: :func:`vllm_eagle2.tree.build_dynamic_tree` in ``dynamic`` mode
   (top-k over the vocabulary per level, global top-k of the ``topk**2`` candidates,
   final rerank of the pool). The ``draft_step`` callback here returns PRECOMPUTED random
   log-probabilities ``[B, topk, V]``, so only the tree algorithm, its top-k and its
   bookkeeping are timed, not a draft model; the precompute is timed on its own;
2. tree-attention masks: :func:`vllm_eagle2.kernels.build_tree_masks` with the torch
   backend (the CPU path);
3. verification of the tree against random target output ``[B, N + 1, V]``:
   :func:`vllm_eagle2.verify.verify_greedy` on logits and
   :func:`vllm_eagle2.verify.verify_sampling` on probabilities. The softmax that turns
   logits into probabilities (:func:`vllm_eagle2.verify.target_probs`, temperature 1) is
   timed separately and is not part of the sum.

The point is to see the cost of the tree core relative to a model step: one SmolLM2-135M
forward takes ~17-36 ms on this CPU, so the core should stay well below that per step.
The per-request column is ``(build + masks + greedy + sampling) / B`` in microseconds
(a real step runs only one of the two verifications; both are summed to stay on the
safe side). With random target output almost nothing is accepted, but the number of
loop rounds of both verifications depends only on the tree depth, not on acceptance.

Example::

    .venv/bin/python scripts/bench_tree_core.py --output tree_core.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from vllm_eagle2 import kernels
from vllm_eagle2.tree import build_dynamic_tree, pool_size, validate_tree_args
from vllm_eagle2.verify import target_probs, verify_greedy, verify_sampling

#: Tree settings per number of kept nodes N: (depth, topk). N=60 / depth 6 / topk 10 are
#: the EAGLE-2 paper's defaults; N=16 is a small tree for large batches.
TREE_SETTINGS: dict[int, tuple[int, int]] = {
    16: (4, 4),
    60: (6, 10),
}

DEFAULT_BATCH_SIZES = (1, 8, 32, 128)
DEFAULT_NUM_TOKENS = (16, 60)
DEFAULT_VOCAB = 32000
#: Fraction of the available memory one case may plan to use before it is skipped.
_MEMORY_FRACTION = 0.8


def parse_int_list(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]`` (all >= 1)."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers >= 1, got {text!r}")
    return values


def parse_tree_list(text: str) -> list[tuple[int, int, int]]:
    """``"16,60"`` or ``"16,40:5:8"`` -> ``[(N, depth, topk), ...]``.

    A bare N takes depth and topk from :data:`TREE_SETTINGS`; ``N:depth:topk`` sets them.
    """
    trees = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        try:
            if len(parts) == 1:
                n = int(parts[0])
                if n not in TREE_SETTINGS:
                    raise argparse.ArgumentTypeError(
                        f"no default depth/topk for N={n} (known: {sorted(TREE_SETTINGS)}); "
                        f"write it as N:depth:topk"
                    )
                depth, topk = TREE_SETTINGS[n]
            elif len(parts) == 3:
                n, depth, topk = (int(p) for p in parts)
            else:
                raise ValueError(item)
            validate_tree_args("dynamic", depth, topk, n)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"bad tree spec {item!r}: {exc}") from exc
        trees.append((n, depth, topk))
    if not trees:
        raise argparse.ArgumentTypeError("expected at least one tree size")
    return trees


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where that cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def planned_bytes(batch: int, n: int, depth: int, topk: int, vocab: int) -> int:
    """Rough peak memory of one case: inputs, probabilities and one temporary of each size."""
    draft = (batch * vocab + (depth - 1) * batch * topk * vocab) * 4
    target = batch * (n + 1) * vocab * 4
    return draft + 3 * target  # logits, probs, softmax temporary


def time_call(fn: Callable[[], Any], repeats: int, warmup: int, budget_s: float) -> list[float]:
    """Wall times of the timed runs of ``fn()`` in ms.

    Runs ``warmup`` untimed calls first. If the slowest warm-up call says ``repeats`` runs
    would exceed ``budget_s``, fewer (at least one) are timed; the count is returned so
    the caller can report it (the length of the returned list).
    """
    slowest = 0.0
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        slowest = max(slowest, time.perf_counter() - t0)
    runs = repeats
    if slowest > 0 and slowest * repeats > budget_s:
        runs = max(1, int(budget_s / slowest))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def random_logprobs(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Log-softmax of standard-normal logits (float32)."""
    return torch.randn(shape, generator=generator).log_softmax(dim=-1)


def bench_case(
    batch: int,
    n: int,
    depth: int,
    topk: int,
    vocab: int,
    *,
    repeats: int,
    warmup: int,
    budget_s: float,
    seed: int,
) -> dict[str, Any]:
    """Time the three tree-core pieces for one (B, N) cell of the grid."""
    gen = torch.Generator().manual_seed(seed)
    result: dict[str, Any] = {"batch": batch, "num_tokens": n, "depth": depth, "topk": topk, "vocab": vocab}

    # Precompute (not part of the tree core): draft log-probs per level and target output.
    t0 = time.perf_counter()
    root_lp = random_logprobs((batch, vocab), gen)
    level_lp = {level: random_logprobs((batch, topk, vocab), gen) for level in range(2, depth + 1)}
    result["precompute_draft_ms"] = (time.perf_counter() - t0) * 1e3

    def draft_step(tokens: torch.Tensor, prev_slots: torch.Tensor, level: int) -> torch.Tensor:
        return level_lp[level]

    def build() -> Any:
        return build_dynamic_tree(root_lp, draft_step, depth=depth, topk=topk, num_tokens=n, mode="dynamic")

    times: dict[str, list[float]] = {}
    times["build"] = time_call(build, repeats, warmup, budget_s)
    result["build_ms"] = statistics.median(times["build"])
    tree = build()
    tokens, parents = tree.tokens, tree.parents

    context_lens = torch.randint(16, 2048, (batch,), generator=gen)
    times["masks"] = time_call(
        lambda: kernels.build_tree_masks(parents, context_lens, backend="torch"), repeats, warmup, budget_s
    )

    t0 = time.perf_counter()
    logits = torch.randn((batch, n + 1, vocab), generator=gen)
    result["precompute_logits_ms"] = (time.perf_counter() - t0) * 1e3
    times["greedy"] = time_call(lambda: verify_greedy(tokens, parents, logits), repeats, warmup, budget_s)

    temperature = torch.ones(batch)
    times["softmax"] = time_call(lambda: target_probs(logits, temperature), repeats, warmup, budget_s)
    probs = target_probs(logits, temperature)
    sample_gen = torch.Generator().manual_seed(seed + 1)
    times["sampling"] = time_call(
        lambda: verify_sampling(tokens, parents, probs, generator=sample_gen), repeats, warmup, budget_s
    )

    for piece in ("masks", "greedy", "softmax", "sampling"):
        result[f"{piece}_ms"] = statistics.median(times[piece])
    core_ms = result["build_ms"] + result["masks_ms"] + result["greedy_ms"] + result["sampling_ms"]
    result["core_ms"] = core_ms
    result["core_us_per_request"] = core_ms * 1e3 / batch
    result["runs"] = {piece: len(t) for piece, t in times.items()}
    result["times_ms"] = times
    return result


def format_table(results: list[dict[str, Any]], repeats: int) -> str:
    """Markdown table of the timings (cells timed with fewer runs are marked)."""

    def cell(r: dict[str, Any], key: str, piece: str) -> str:
        text = f"{r[key]:.2f}"
        runs = r["runs"][piece]
        return text if runs == repeats else f"{text} (n={runs})"

    header = (
        "| B | N | depth | topk | build ms | masks ms | greedy verify ms | sampling verify ms "
        "| softmax ms | core µs/request |"
    )
    lines = [header, "|" + "---:|" * (header.count("|") - 1)]
    for r in results:
        if "skipped" in r:
            lines.append(
                f"| {r['batch']} | {r['num_tokens']} | {r['depth']} | {r['topk']} "
                f"| skipped: {r['skipped']} | | | | | |"
            )
            continue
        lines.append(
            f"| {r['batch']} | {r['num_tokens']} | {r['depth']} | {r['topk']} "
            f"| {cell(r, 'build_ms', 'build')} | {cell(r, 'masks_ms', 'masks')} "
            f"| {cell(r, 'greedy_ms', 'greedy')} | {cell(r, 'sampling_ms', 'sampling')} "
            f"| {cell(r, 'softmax_ms', 'softmax')} | {r['core_us_per_request']:.1f} |"
        )
    return "\n".join(lines)


def format_precompute_table(results: list[dict[str, Any]]) -> str:
    """Markdown table of the untimed-by-the-core setup cost, for reference."""
    lines = [
        "| B | N | draft log-probs precompute ms | target logits precompute ms |",
        "|---:|---:|---:|---:|",
    ]
    for r in results:
        if "skipped" in r:
            continue
        lines.append(
            f"| {r['batch']} | {r['num_tokens']} | {r['precompute_draft_ms']:.1f} "
            f"| {r['precompute_logits_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--batch-sizes",
        type=parse_int_list,
        default=",".join(map(str, DEFAULT_BATCH_SIZES)),
        help="comma-separated batch sizes B",
    )
    parser.add_argument(
        "--num-tokens",
        type=parse_tree_list,
        default=",".join(map(str, DEFAULT_NUM_TOKENS)),
        help="comma-separated tree sizes N (depth/topk from TREE_SETTINGS: "
        + ", ".join(f"{n} -> depth {d}, topk {k}" for n, (d, k) in TREE_SETTINGS.items())
        + "), or N:depth:topk",
    )
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help="vocabulary size V")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per piece (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs per piece")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=20.0,
        help="max seconds of timed runs per piece and case; slower pieces get fewer runs "
        "(marked n=... in the table)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--output", metavar="FILE.json", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.vocab < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--vocab and --repeats must be >= 1, --warmup >= 0")
    for n, _depth, topk in args.num_tokens:
        if topk > args.vocab:
            parser.error(f"topk {topk} (N={n}) exceeds --vocab {args.vocab}")

    grid = [(b, n, d, k) for n, d, k in args.num_tokens for b in args.batch_sizes]
    avail = available_memory_bytes()
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for batch, n, depth, topk in tqdm(grid, desc="tree core", unit="case"):
            need = planned_bytes(batch, n, depth, topk, args.vocab)
            if avail is not None and need > _MEMORY_FRACTION * avail:
                reason = f"needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
                tqdm.write(f"B={batch} N={n}: skipped ({reason})")
                results.append(
                    {"batch": batch, "num_tokens": n, "depth": depth, "topk": topk, "skipped": reason}
                )
                continue
            results.append(
                bench_case(
                    batch,
                    n,
                    depth,
                    topk,
                    args.vocab,
                    repeats=args.repeats,
                    warmup=args.warmup,
                    budget_s=args.budget_s,
                    seed=args.seed,
                )
            )
            gc.collect()
    total_s = time.perf_counter() - start

    print(
        f"\nEAGLE-2 tree core on CPU: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"V={args.vocab}, median of {args.repeats} runs after {args.warmup} warm-up "
        f"(pool = topk + (depth-1)*topk^2 nodes: "
        + ", ".join(f"N={n}: {pool_size(d, k)}" for n, d, k in args.num_tokens)
        + ")\n"
    )
    print(format_table(results, args.repeats))
    print(
        "\ncore µs/request = (build + masks + greedy + sampling) * 1000 / B; softmax (target_probs, "
        "temperature 1) is not included.\n"
    )
    print("Setup, not part of the core (random inputs):\n")
    print(format_precompute_table(results))
    print(f"\ntotal wall time {total_s:.1f} s")

    if args.output:
        payload = {
            "benchmark": "tree_core",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "python": sys.version.split()[0],
            "vocab": args.vocab,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "tree_settings": {str(n): {"depth": d, "topk": k} for n, d, k in args.num_tokens},
            "total_s": total_s,
            "results": results,
        }
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
