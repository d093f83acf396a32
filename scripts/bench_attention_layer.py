"""What one attention layer costs a verification pass on CPU, piece by piece, at SmolLM2-135M's shapes.

Times, per layer call (microseconds, median of ``--repeats`` timings of ``--calls`` calls each):

* vLLM's CPU attention kernel over one request's context, for 1 query row (a plain decoding step)
  and for 1 + ``--tree`` rows (a verification pass), on the "amx" KV layout vLLM picks for bf16 on
  AMX and on the "vec" layout eagle2 swaps in, and its KV-cache write for those rows;
* eagle2's tree kernel over the ``--tree`` tree rows (``paged_tree_attention``, the C++ backend),
  and with the gather of the rows and the scatter of their outputs the layer wrapper adds.

No engine and no weights: the kernels' speed depends on the shapes, not on the values. Prints JSON
(with ``--output FILE``, also writes it).

    .venv/bin/python scripts/bench_attention_layer.py --dtype bfloat16 --context 400 --tree 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_eagle2.kernels import kv_cache_views, paged_tree_attention
from vllm_eagle2_tools.machine import cpu_description

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 128  # SmolLM2-135M; vLLM's CPU block size


def _time_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(calls // 4 + 1):  # warm-up
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(runs), 1)


def _vllm_layer(isa: str, rows: int, context: int, dtype: torch.dtype, calls: int, repeats: int) -> dict:
    """vLLM's kernel and cache write for ``rows`` query rows at the end of ``context + rows`` tokens."""
    from vllm import _custom_ops as ops

    seq = context + rows
    blocks = (seq + BLOCK - 1) // BLOCK
    kv = torch.zeros(blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=dtype)
    key_cache, value_cache = kv.view(blocks, KV_HEADS, BLOCK * 2, HEAD_DIM).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(seq, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(seq, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    slots = torch.arange(seq, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    query_start = torch.tensor([0, rows], dtype=torch.int32)
    seq_lens = torch.tensor([seq], dtype=torch.int32)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False, dynamic_causal=None, kv_cache_dtype="auto",
    )  # fmt: skip
    query = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(query)

    def attend() -> None:
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start, seq_lens=seq_lens, scale=HEAD_DIM**-0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=meta, s_aux=None, dynamic_causal=None,
        )  # fmt: skip

    def write() -> None:
        ops.cpu_attn_reshape_and_cache(key[:rows], value[:rows], key_cache, value_cache, slots[context:], isa)

    return {
        "attention_us": _time_us(attend, calls, repeats),
        "cache_write_us": _time_us(write, calls, repeats),
    }


def _tree_layer(tree: int, context: int, dtype: torch.dtype, calls: int, repeats: int) -> dict:
    """eagle2's tree kernel over ``tree`` rows after ``context + 1`` tokens, alone and as the layer
    wrapper runs it (gather the rows' queries, scatter their outputs into the layer's output)."""
    rows = tree + 1
    blocks = (context + rows + BLOCK - 1) // BLOCK
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=gen).to(dtype)
    key_cache, value_cache = kv_cache_views(kv, "cpu")
    query = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    output = torch.empty(rows, HEADS * HEAD_DIM, dtype=dtype)
    tree_rows = torch.arange(1, rows)
    mask = torch.full((1, tree, 1), (1 << tree) - 1, dtype=torch.int32)  # every node sees the others
    lengths = torch.tensor([0, tree]), torch.tensor([context + 1]), torch.tensor([tree])
    index = (torch.arange(blocks)[None], *lengths, mask)
    plan: dict = {}

    def kernel() -> None:
        paged_tree_attention(query[1:], key_cache, value_cache, *index, HEAD_DIM**-0.5, plan_cache=plan)

    def wrapped() -> None:
        out = paged_tree_attention(
            query[tree_rows], key_cache, value_cache, *index, HEAD_DIM**-0.5, plan_cache=plan
        )
        output.view(rows, HEADS, -1)[tree_rows] = out.to(output.dtype)

    return {
        "kernel_us": _time_us(kernel, calls, repeats),
        "with_gather_scatter_us": _time_us(wrapped, calls, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--context", type=int, default=400, help="tokens before the tree")
    parser.add_argument("--tree", type=int, default=8, help="tree nodes verified after the root")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cpu = cpu_description()
    isas = ["vec"]
    if "amx_bf16" in cpu["flags"] and dtype == torch.bfloat16:
        torch.cpu._init_amx()  # the AMX tiles' permission, as vLLM's CPU worker asks for it
        isas.insert(0, "amx")
    report = {"cpu": cpu, **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    for isa in isas:
        for rows in (1, args.tree + 1):
            report[f"vllm_{isa}_{rows}_rows"] = _vllm_layer(
                isa, rows, args.context, dtype, args.calls, args.repeats
            )
    report["eagle2_tree"] = _tree_layer(args.tree, args.context, dtype, args.calls, args.repeats)
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
