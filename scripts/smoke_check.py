"""Smoke check: is eagle2 lossless and drafting on this machine, eagerly and in vLLM's default mode?

Engines on one model folder, one after the other: no speculation; eagle2 as a user gets it
(``{"method": "eagle2", "model": HEAD}``: the adaptive budget, lookup chains); and eagle2 on a
fixed tree (``budget: "fixed"``, ``--num-speculative-tokens``/``--depth``/``--topk``; left out with
``--no-fixed-tree``). Each runs with ``enforce_eager=True`` and in vLLM's default compiled mode
(torch.compile; piecewise CUDA graphs on a GPU). Prints per engine tokens/s, tau, drafts sent and
accepted, KV moves, outputs identical to no speculation and start-up time, the agreement criterion
that ran, then a verdict; exits 1 when it fails. An eagle2 engine that sent no drafts fails: it
checked nothing.

Agreement (``--criterion``, default ``auto``): on a CPU in float32 greedy outputs must be identical
token for token. On CUDA (and in bf16/fp16) they must be identical or part at a near-tie: at the
first difference each side's token is among the other's top-5 logprobs. On CUDA vLLM's Triton
attention computes float32 dot products in TF32 by default while eagle2's tree attention uses IEEE
float32, so strict identity there can fail on a correct install. On a CUDA GPU float32 needs an
attention backend that runs it: the default here is TRITON_ATTN (``--attention-backend``).

    # a CUDA GPU with vLLM 0.32 and vllm-eagle2 installed
    python scripts/smoke_check.py --model MODEL_DIR --head EAGLE_HEAD_DIR
    # this CPU, on the seeded tiny pair (the test suite runs this)
    python scripts/smoke_check.py --tiny
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="target model folder")
    p.add_argument("--head", type=Path, help="EAGLE-1/2 or EAGLE-3 head folder")
    p.add_argument("--tiny", action="store_true", help="build and use the seeded tiny pair (CPU mode)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=1024)
    fixed = p.add_argument_group("the fixed tree", "eagle2 with budget fixed, beside its defaults")
    fixed.add_argument("--num-speculative-tokens", type=int, default=12, help="tree nodes, m (default 12)")
    fixed.add_argument("--depth", type=int, default=4, help="draft levels (default 4)")
    fixed.add_argument("--topk", type=int, default=3, help="children per node (default 3)")
    fixed.add_argument(
        "--no-fixed-tree",
        action="store_true",
        help="run eagle2's defaults only (then nothing compares compiled tau with eager tau)",
    )
    p.add_argument(
        "--criterion",
        default="auto",
        choices=["auto", "identity", "logprobs"],
        help="how outputs must agree: identity, or identity up to a near-tie (each side's token among the "
        "other's top-5 logprobs at the first difference); auto: identity for float32 on a CPU, "
        "logprobs on CUDA or in bf16/fp16",
    )
    p.add_argument(
        "--attention-backend",
        default=None,
        help="vLLM attention backend on CUDA (default TRITON_ATTN, which runs float32); ignored on CPU",
    )
    args = p.parse_args(argv)
    if not args.tiny and (args.model is None or args.head is None):
        p.error("--model and --head are required (or --tiny)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from vllm_eagle2_tools.engine import prepare_env

    prepare_env(quiet=True)
    from vllm_eagle2_tools import datasets
    from vllm_eagle2_tools.bench.smoke import default_criterion, report, smoke_check
    from vllm_eagle2_tools.cpu_env import SCRATCH

    if args.tiny:
        from vllm_eagle2_tools.testing import build_pair, stored

        pair = build_pair(SCRATCH / "smoke" / "tiny", "partial", seed=0)
        args.model, args.head = (stored(p) for p in pair)
        lengths = [3, 120, 17, 64, 9, 33, 90, 5]
        prompts = [{"prompt_token_ids": [(7 * i + 13 * n) % 500 + 6 for i in range(n)]} for n in lengths]
        prompts = prompts[: args.num_prompts]
    else:
        texts = datasets.repeated(datasets.benchmark_texts("mtbench"), args.num_prompts)
        prompts = datasets.token_prompts(args.model, texts)
    engine_kwargs = {"max_model_len": args.max_model_len}
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        engine_kwargs["attention_backend"] = args.attention_backend or "TRITON_ATTN"
    criterion = default_criterion(args.dtype, cuda) if args.criterion == "auto" else args.criterion
    knobs = {"num_speculative_tokens": args.num_speculative_tokens, "depth": args.depth, "topk": args.topk}
    sittings, verdict = smoke_check(
        args.model,
        args.head,
        prompts,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        spec_knobs=knobs,
        fixed_tree=not args.no_fixed_tree,
        criterion=criterion,
        **engine_kwargs,
    )
    print(
        f"model {args.model}, head {args.head}, {len(prompts)} prompts x {args.max_tokens} tokens, "
        f"{args.dtype}, {'CUDA' if cuda else 'CPU'}"
    )
    print(report(sittings, verdict, ", ".join(f"{k} {v}" for k, v in knobs.items())), flush=True)
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
