"""Time eagle2's engine-independent step pieces on a CUDA device, or check its kernels there.

Runs with torch and Triton alone (no vLLM): see :mod:`vllm_eagle2_tools.gpu_bench` for what each row
times. Defaults are Llama-3-8B's shapes (V 128,256, 32 query heads, 8 KV heads, head size 128,
bf16) and the paper's tree (depth 6, topk 10, m 60).

Examples::

    python3 scripts/bench_gpu.py --output results/gpu-bench.json
    python3 scripts/bench_gpu.py --check
    # an earlier release installed as package vllm_eagle2_base, timed beside this one:
    python3 scripts/bench_gpu.py --baseline vllm_eagle2_base --output results/gpu-bench.json
    # a dry run on the CPU (Triton interpreted, tiny shapes):
    TRITON_INTERPRET=1 python3 scripts/bench_gpu.py --device cpu --tiny --repeats 2
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import types
from pathlib import Path

import torch

from vllm_eagle2_tools.gpu_bench import Shapes, Timing, bench_attention, bench_tree_core, run_checks

TINY = Shapes(vocab=2000, depth=3, topk=4, num_nodes=12, heads=4, kv_heads=2, head_size=32)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _baseline(name: str) -> types.SimpleNamespace:
    mods = {m: importlib.import_module(f"{name}.{m}") for m in ("tree", "verify", "kernels")}
    return types.SimpleNamespace(**mods)


def markdown(rows: list[Timing], device: str) -> str:
    """Tables of the rows; attention rows with their ratio to dense SDPA."""
    lines = [f"# eagle2 step pieces on {device}", ""]
    lines += ["| piece | variant | B | wall us | GPU us | launches |", "|---|---|---|---|---|---|"]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for r in rows:
        if r.piece != "attention":
            lines.append(
                f"| {r.piece} | {r.variant} | {r.batch} | {r.wall_us:.0f} | {fmt(r.gpu_us, '.0f')} "
                f"| {fmt(r.launches, '.0f')} |"
            )
    att = [r for r in rows if r.piece == "attention"]
    if att:
        lines += [
            "",
            "| attention (one layer) | R | context | queries | wall us | GPU us | launches | / SDPA wall |",
        ]
        lines.append("|---|---|---|---|---|---|---|---|")
        sdpa = {(r.batch, r.context, r.queries): r.wall_us for r in att if r.variant == "dense SDPA"}
        for r in att:
            ratio = r.wall_us / sdpa[(r.batch, r.context, r.queries)]
            lines.append(
                f"| {r.variant} | {r.batch} | {r.context} | {r.queries} | {r.wall_us:.0f} "
                f"| {fmt(r.gpu_us, '.0f')} | {fmt(r.launches, '.0f')} | {ratio:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="torch device (default cuda)")
    ap.add_argument("--batch-sizes", type=_ints, default=[1, 8, 64], help="default 1,8,64")
    ap.add_argument("--contexts", type=_ints, default=[2048, 8192], help="attention context lengths")
    ap.add_argument("--queries", type=_ints, default=[60, 8], help="tree queries per request (attention)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, for a dry run on the CPU")
    ap.add_argument("--baseline", help="package name of an earlier release to time beside this one")
    ap.add_argument(
        "--check", action="store_true", help="compare every kernel with its torch twin; no timings"
    )
    ap.add_argument("--output", type=Path, help="JSON output; the Markdown table goes beside it (.md)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    shapes = TINY if args.tiny else Shapes()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.check:
        results = run_checks(shapes, device)
        for check, outcome in results.items():
            print(f"{outcome:>6}  {check}")
        return 0 if all(v == "ok" for v in results.values()) else 1

    baseline = _baseline(args.baseline) if args.baseline else None
    rows: list[Timing] = []
    for batch in args.batch_sizes:
        rows += bench_tree_core(shapes, batch, device, repeats=args.repeats, baseline=baseline)
        print(f"[bench_gpu] tree core B={batch} done", file=sys.stderr, flush=True)
    contexts = sorted({min(c, 256) for c in args.contexts}) if args.tiny else args.contexts
    for batch in args.batch_sizes:
        for context in contexts:
            for queries in args.queries:
                q = min(queries, shapes.num_nodes)
                rows += bench_attention(
                    shapes, batch, context, q, device, repeats=args.repeats, baseline=baseline
                )
        print(f"[bench_gpu] attention R={batch} done", file=sys.stderr, flush=True)
    table = markdown(rows, name)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "device": name,
            "torch": torch.__version__,
            "shapes": {k: str(v) for k, v in vars(shapes).items()},
        }
        payload["rows"] = [r.as_dict() for r in rows]
        args.output.write_text(json.dumps(payload, indent=1))
        args.output.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
