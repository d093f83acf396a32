"""Which float type the trainer computes in, chosen from what the machine runs fast.

The head's master weights, its optimiser state and the held-out evaluation stay float32 everywhere.
What bf16 changes is the arithmetic: the target's forward during feature extraction (the features
are stored in bf16 either way) and, under ``torch.autocast``, the head's matmuls in training.

``auto`` takes bf16 only where it is fast and float32 elsewhere:

* CUDA: bf16 when the GPU supports it;
* CPU: bf16 where the CPU has bf16 dot products: AMX bf16 tiles (``amx_bf16`` in ``/proc/cpuinfo``)
  or AVX-512 bf16 (``avx512_bf16``). Measured with ``scripts/bench_train_step.py``, 2 threads,
  SmolLM2-135M's shapes (``heads/smollm2-135m-eagle/README.md``): on an Intel Xeon with AMX, training
  1.4x and features 1.5x float32's rate; on an AMD EPYC with AVX-512 bf16 and no AMX, 1.8x and 2.4x.
  With AVX2 alone torch emulates bf16 on one thread and float32 is far faster.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from vllm_eagle2_tools.machine import cpu_description

CHOICES = ("auto", "float32", "bfloat16")
#: CPU flags whose bf16 dot products make bf16 faster than float32 (measured, module docstring).
BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


@dataclass(frozen=True)
class Precision:
    """A resolved choice: ``dtype`` (torch.float32 or torch.bfloat16) on ``device_type``, and why."""

    dtype: torch.dtype
    device_type: str
    reason: str

    @property
    def name(self) -> str:
        """``"float32"`` or ``"bfloat16"``."""
        return str(self.dtype).removeprefix("torch.")

    def autocast(self) -> AbstractContextManager:
        """The training step's context (:func:`autocast`)."""
        return autocast(self.name, self.device_type)


def autocast(name: str, device_type: str) -> AbstractContextManager:
    """A training step's context for precision ``name``: bf16 autocast, or nothing in float32."""
    if name == "float32":
        return nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, name))


def choose_precision(
    requested: str, device: torch.device | str, cpu_flags: list[str] | None = None
) -> Precision:
    """Resolve ``--precision`` (one of :data:`CHOICES`) for ``device``.

    ``cpu_flags``: the CPU's flags as :func:`~vllm_eagle2_tools.machine.cpu_description` lists them
    (default: this machine's).

    Raises:
        ValueError: ``requested`` is not one of :data:`CHOICES`, or bf16 is asked on a CUDA device
            without it.
    """
    if requested not in CHOICES:
        raise ValueError(f"precision must be one of {', '.join(CHOICES)}, got {requested!r}")
    device = torch.device(device)
    if device.type == "cuda":
        has_bf16 = torch.cuda.is_bf16_supported()
        where = f"{torch.cuda.get_device_name(device)} {'supports' if has_bf16 else 'lacks'} bf16"
    else:
        flags = cpu_description()["flags"] if cpu_flags is None else cpu_flags
        has_bf16 = bool(BF16_CPU_FLAGS & set(flags))
        where = f"CPU {'has' if has_bf16 else 'lacks'} bf16 dot products (amx_bf16 or avx512_bf16)"
    if requested == "auto":
        dtype = torch.bfloat16 if has_bf16 else torch.float32
        return Precision(dtype, device.type, f"auto: {where}")
    if requested == "bfloat16" and device.type == "cuda" and not has_bf16:
        raise ValueError(f"precision bfloat16 asked, but {where}")
    return Precision(getattr(torch, requested), device.type, f"asked ({where})")
