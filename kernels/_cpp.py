"""The C++ CPU kernels (``csrc/``), compiled on first use with the system's C++ compiler.

Built once per machine with ``torch.utils.cpp_extension`` (about 15 s on 2 cores) into
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and loaded from there
afterwards; concurrent processes wait on torch's build lock. ``-march=native`` is part of the
build, so the extension's name carries a hash of this CPU's feature flags: a cache directory
shared with another kind of CPU never hands it a binary it cannot run.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

__all__ = ["load_cpu_ops"]

_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("tree_attention_cpu.cpp", "kv_moves_cpu.cpp")]
_FLAGS = ["-O3", "-march=native", "-fopenmp"]
_loaded = False


def _cpu_tag() -> str:
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line
                break
    except OSError:  # not Linux: the machine name alone
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _ninja_on_path() -> None:
    """Put the interpreter's own ``bin/`` on PATH when ninja is only there.

    vLLM installs the ``ninja`` package into the environment, but a venv used without activation
    (``.venv/bin/python ...``) does not have its ``bin/`` on PATH, where torch's build looks.
    """
    bindir = Path(sys.executable).parent
    if shutil.which("ninja") is None and (bindir / "ninja").exists():
        os.environ["PATH"] = os.pathsep.join(p for p in (str(bindir), os.environ.get("PATH")) if p)


def load_cpu_ops() -> None:
    """Build (first time) and load the ``torch.ops.eagle2_cpu`` operators into this process.

    Raises:
        RuntimeError: the extension could not be built or loaded (no C++ compiler, no ninja, ...),
            with the compiler's message.
    """
    global _loaded
    if _loaded:
        return
    from torch.utils import cpp_extension

    _ninja_on_path()
    try:
        cpp_extension.load(
            name=f"eagle2_cpu_{_cpu_tag()}",
            sources=[str(s) for s in _SOURCES],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:
        raise RuntimeError(
            f"could not build eagle2's C++ CPU kernels ({', '.join(s.name for s in _SOURCES)}); they need a "
            f"C++ compiler and ninja: {exc}"
        ) from exc
    if not hasattr(torch.ops.eagle2_cpu, "tree_attention"):  # pragma: no cover - defensive
        raise RuntimeError("eagle2's C++ CPU kernels loaded but registered no tree_attention operator")
    _loaded = True
