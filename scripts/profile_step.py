"""Where the time of one decoding step goes, for eagle2 and for the same engine without speculation.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and timers are wrapped around
the model runner's and the drafter's methods from outside (nothing of the plugin changes):

* ``target forward``: ``GPUModelRunner.execute_model`` (input preparation and the target's forward
  over root + tree nodes), less the tree preparation below;
* ``tree masks / positions``: ``vllm_eagle2.engine.verification.prepare_tree_verification``;
* ``verification``: ``vllm_eagle2.engine.verification.sample_with_trees`` (greedy / rejection walk
  over each tree, vLLM's sampler at the root), less the KV moves;
* ``KV moves``: ``_move_accepted_path`` (accepted path's KV and rows to the slots after the root);
* ``draft: catch-up pass`` and ``draft: expansion passes``: the head's forwards (first pass over the
  accepted tokens; one pass per further tree level), each with its ``lm_head``;
* ``draft: tree build``: ``build_dynamic_tree`` less the expansion passes (top-k, rerank, parents);
* ``other``: the rest of the runner's step (vLLM's sampler and bookkeeping, drafter set-up) and, in
  ``engine overhead``, what ``generate`` spends outside the runner (scheduler, detokenizer).

Numbers are milliseconds per engine step, summed over the timed ``generate``; on CUDA every timer
synchronizes the device. Outputs a Markdown table (printed and written beside ``--output``) and JSON.

Example (the winning setting of the benchmark on this CPU)::

    .venv/bin/python scripts/profile_step.py --num-prompts 8 --max-tokens 128 \\
        --num-speculative-tokens 16 --depth 5 --topk 4 --output results/profile.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_eagle2_tools.bench.config import AUTO, draft_vocab_arg
from vllm_eagle2_tools.profiling import profile
from vllm_eagle2_tools.smollm2 import DEFAULT_HEAD, DEFAULT_TARGET


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the seeded tiny pair, float32 (pipeline check)")
    p.add_argument("--model", type=Path, default=DEFAULT_TARGET)
    p.add_argument("--head", type=Path, default=DEFAULT_HEAD)
    p.add_argument("--dataset", choices=["mtbench", "humaneval"], default="mtbench")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--num-speculative-tokens", type=int, default=16)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--tree", default="dynamic")
    p.add_argument(
        "--draft-vocab",
        type=draft_vocab_arg,
        default=AUTO,
        help="eagle2 draft_vocab_size: auto (the default) or a size (0 = the whole vocabulary)",
    )
    p.add_argument("--never", action="store_true", help="eagle2 priced never to draft")
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="eagle2's adaptive budget on measured costs (default: the fixed tree)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--output", type=Path, default=Path("profile.json"), help="JSON file (.md beside)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = profile(args)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
