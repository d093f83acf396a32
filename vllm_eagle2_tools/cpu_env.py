"""Environment for vLLM's CPU build, set before vLLM is imported (docs/design.md, section 3).

Used by the tests and the scripts, so that every place runs vLLM on a CPU the same way.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

SCRATCH = Path(tempfile.gettempdir()) / "vllm_eagle2_scratch"


def configure_cpu_env(*, quiet: bool = False) -> None:
    """Set vLLM's CPU variables unless the caller already set them.

    ``LD_PRELOAD`` of the venv's Intel OpenMP only reaches processes started afterwards (the
    engine core and its workers): without it vLLM warns that speculative decoding is slow.
    """
    SCRATCH.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # else one core is held back
    os.environ.setdefault("VLLM_CACHE_ROOT", str(SCRATCH / "vllm_cache"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(SCRATCH / "inductor"))
    if quiet:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists() and "libiomp5" not in os.environ.get("LD_PRELOAD", ""):
        os.environ["LD_PRELOAD"] = ":".join(p for p in (os.environ.get("LD_PRELOAD"), str(iomp)) if p)
