"""Which machine a measurement ran on: sittings can land on different CPUs, and a speed-up only
compares within one machine."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

#: CPU flags that decide vLLM's CPU kernels (its bf16 GEMMs and attention layout), in report order.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_description(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's model name and which of :data:`CPU_FLAGS` it has (Linux ``/proc/cpuinfo``).

    ``cpuinfo``: the file's text (default: read it).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = platform.processor() or platform.machine(), set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags]}


def cpu_note(cpu: dict[str, Any] | None) -> str:
    """`` (MODEL; FLAG, ...)`` of a :func:`cpu_description`, for a report's set-up line ("" for None)."""
    if not cpu:
        return ""
    return f" ({cpu['model']}; {', '.join(cpu['flags']) or 'none of ' + ', '.join(CPU_FLAGS)})"
