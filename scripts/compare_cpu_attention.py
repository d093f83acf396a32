"""How closely eagle2's CPU tree-attention backends agree, on the inputs a real engine gives them.

Runs eagle2 in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and, in every tree-attention call of
the target and the drafter, computes the tree rows with both CPU backends (the C++ kernel and its
torch twin) on the same inputs (the cache in the layout vLLM chose), before the engine's own call
goes on. Reported:

* per call, the fraction of output elements where the two backends differ (in the model's dtype),
  and the largest difference.

(Rows before a request's tree rows are vLLM's kernel's alone, so there is no row on which to
compare the backends with vLLM's kernel.)

In float32 the backends differ only in the last bits; in bfloat16 a differing element is one
rounding step, which is what makes a near-tie flip between speculative and plain decoding.

Usage: python scripts/compare_cpu_attention.py [--batch-size 4] [--num-prompts 8] [--max-tokens 24]
       python scripts/compare_cpu_attention.py --tiny      # seeded tiny pair, float32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

from vllm_eagle2_tools.cpu_env import SCRATCH, configure_cpu_env
from vllm_eagle2_tools.datasets import load_prompts
from vllm_eagle2_tools.smollm2 import DEFAULT_HEAD, DEFAULT_TARGET


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(DEFAULT_TARGET))
    parser.add_argument("--head", default=str(DEFAULT_HEAD))
    parser.add_argument("--tiny", action="store_true", help="use a seeded tiny target/head pair (float32)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--dtype", default=None, help="default: float32 with --tiny, else bfloat16")
    parser.add_argument("--output", default=None, help="write the summary as JSON here")
    args = parser.parse_args()
    configure_cpu_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the hook must reach the attention layers

    import torch
    from vllm import LLM, SamplingParams

    from vllm_eagle2.engine import cpu_rows
    from vllm_eagle2.kernels import cpu_tree_attention

    if args.tiny:
        from vllm_eagle2_tools.testing import build_pair

        model, head = map(str, build_pair(SCRATCH / "compare-tiny", "partial", seed=0))
        # The tiny pair has its own 512-token vocabulary: seeded token ids, as profile_step.py uses.
        rng = random.Random(0)
        prompts = [
            {"prompt_token_ids": [rng.randrange(6, 512) for _ in range(24)]} for _ in range(args.num_prompts)
        ]
    else:
        model, head = args.model, args.head
        for path, what in ((model, "--model"), (head, "--head")):
            if not Path(path).exists():
                sys.exit(f"{what} {path} does not exist (scripts/prepare_smollm2.py makes the model)")
        prompts = load_prompts("mtbench", Path(model), args.num_prompts, chat=True)

    calls: list[tuple[float, float]] = []  # (fraction differing, max abs difference) per call
    stock_tree_rows = cpu_rows.cpu_tree_rows

    def compared(impl, layer, query, kv_cache, output, batch):  # type: ignore[no-untyped-def]
        stock_tree_rows(impl, layer, query, kv_cache, output, batch)  # the plan, made once per forward
        plan = batch.plan_cache[("cpu", *kv_cache.shape[:3])]
        got = {}
        for backend in ("cpp", "torch"):
            out = torch.zeros(query.shape[0], impl.num_heads, query.shape[2], dtype=query.dtype)
            cpu_tree_attention(query, kv_cache, layer.isa, plan, impl.scale, out, backend=backend)
            got[backend] = out[batch.rows]
        calls.append(
            (
                (got["cpp"] != got["torch"]).float().mean().item(),
                (got["cpp"].float() - got["torch"].float()).abs().max().item(),
            )
        )

    cpu_rows.cpu_tree_rows = compared
    dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    llm = LLM(
        model=model,
        speculative_config={
            "method": "eagle2",
            "model": head,
            "num_speculative_tokens": 4,
            "depth": 2,
            "topk": 2,
            "budget": "fixed",  # this tree every step: the measurement needs it
        },
        dtype=dtype,
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=args.batch_size,
        seed=0,
    )
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    if not calls:
        sys.exit("no tree-attention call was made (no drafts were verified)")
    summary = {
        "dtype": dtype,
        "batch_size": args.batch_size,
        "calls": len(calls),
        "cpp_vs_torch_max_fraction_differing": max(c[0] for c in calls),
        "cpp_vs_torch_max_abs_difference": max(c[1] for c in calls),
    }
    print(json.dumps(summary, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
