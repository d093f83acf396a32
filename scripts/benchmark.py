"""Benchmark eagle2 against no speculation and vLLM's built-in EAGLE chain, in one process and sitting.

A thin command line over :mod:`vllm_eagle2_tools.bench` (``--help`` lists the modes, outputs and
options); the same as the console command ``vllm-eagle2-bench`` that the package installs.

    .venv/bin/python scripts/benchmark.py --tiny --num-prompts 4 --max-tokens 32 --output /tmp/b/tiny.json
"""

from __future__ import annotations

import sys

from vllm_eagle2_tools.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
