"""What one attention layer costs a verification pass on CPU, piece by piece, at SmolLM2-135M's shapes.

Times per layer call (microseconds, median of ``--repeats`` timings of ``--calls`` calls each), on
every KV layout vLLM picks for the dtype on this machine ("amx" for bf16 on AMX CPUs, else "vec"),
with the cache written by vLLM's own op:

* ``vllm_1_row``: vLLM's kernel over one query row (a plain decoding step);
* ``vllm_9_rows``: over the root and 8 drafts, causally (vLLM's chain verification);
* ``eagle2_tree_rows``: eagle2's tree kernel over the 8 drafts as tree rows (every node sees the
  root and the others: the most work a tree of 8 can ask for);
* ``eagle2_verify_layer``: what a tree verification costs the layer: vLLM's kernel over the root
  alone (its tree rows left to eagle2, split metadata) plus eagle2's kernel over the 8 tree rows.

``per_forward_us``: the index work a tree forward does once for all its layers (the tree kernel's
plan, vLLM's split scheduler metadata). No engine and no weights: the kernels' speed depends on
the shapes, not on the values. Prints JSON (with ``--output FILE``, also writes it).

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

from vllm_eagle2.kernels import cpu_tree_attention, plan_cpu_tree_attention
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


def _layer(isa: str, tree: int, context: int, dtype: torch.dtype, calls: int, repeats: int) -> dict:
    from vllm import _custom_ops as ops

    rows = 1 + tree
    seq = context + rows
    blocks = (seq + BLOCK - 1) // BLOCK
    kv = torch.zeros(blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=dtype)
    key_cache, value_cache = kv.view(blocks, KV_HEADS, BLOCK * 2, HEAD_DIM).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, seq, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(seq), isa)
    query = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(query)
    table = torch.arange(blocks, dtype=torch.int32)[None]

    def vllm(query_start: list[int], seq_lens: list[int]) -> Callable[[], None]:
        qsl, lens = torch.tensor(query_start, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
        bt = table.expand(len(seq_lens), -1).contiguous()
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=lens,
            dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=True, dynamic_causal=None, kv_cache_dtype="auto",
        )  # fmt: skip
        n = query_start[-1]

        def attend() -> None:
            ops.cpu_attention_with_kv_cache(
                query=query[:n], key_cache=key_cache, value_cache=value_cache, output=out[:n],
                query_start_loc=qsl, seq_lens=lens, scale=HEAD_DIM**-0.5, causal=True,
                alibi_slopes=None, sliding_window=-1, block_table=bt, softcap=0.0,
                scheduler_metadata=meta, s_aux=None, dynamic_causal=None,
            )  # fmt: skip

        return attend

    def plan():  # noqa: ANN202 - the forward's plan, as the engine builds it
        mask = torch.full((1, tree, 1), (1 << rows) - 1, dtype=torch.int32)  # each node sees the root and all
        return plan_cpu_tree_attention(
            torch.arange(1, rows), torch.tensor([0, tree]), table, torch.tensor([context]),
            torch.tensor([rows]), mask, num_blocks=blocks, block_size=BLOCK, num_rows=rows,
        )  # fmt: skip

    the_plan = plan()

    def tree_rows() -> None:
        cpu_tree_attention(query, kv, isa, the_plan, HEAD_DIM**-0.5, out, backend="cpp")

    root_alone = vllm([0, 1, rows], [context + 1, 0])

    def verify_layer() -> None:
        root_alone()
        tree_rows()

    def split_metadata() -> None:
        qsl, lens = (
            torch.tensor([0, 1, rows], dtype=torch.int32),
            torch.tensor([context + 1, 0], dtype=torch.int32),
        )
        ops.cpu_attn_get_scheduler_metadata(
            num_reqs=2, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=lens, dtype=dtype,
            query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True,
            dynamic_causal=None, kv_cache_dtype="auto",
        )  # fmt: skip

    return {
        "vllm_1_row_us": _time_us(vllm([0, 1], [context + 1]), calls, repeats),
        f"vllm_{rows}_rows_us": _time_us(vllm([0, rows], [seq]), calls, repeats),
        "eagle2_tree_rows_us": _time_us(tree_rows, calls, repeats),
        "eagle2_verify_layer_us": _time_us(verify_layer, calls, repeats),
        "per_forward_us": {
            "tree_plan": _time_us(plan, calls, repeats),
            "vllm_split_metadata": _time_us(split_metadata, calls, repeats),
        },
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
        report[isa] = _layer(isa, args.tree, args.context, dtype, args.calls, args.repeats)
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
