"""Host-to-device copies on the step's hot path."""

from __future__ import annotations

from typing import Any

import torch


def to_device(x: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` (a numpy array, list or CPU tensor) on ``device``, queued behind the stream's work.

    On CUDA the host side is pinned first: a copy from pageable memory synchronises the stream
    before it starts, "non_blocking" or not, and the step would wait for the GPU each time.
    PyTorch's caching host allocator keeps the pinned block until the copy has run.
    """
    t = torch.as_tensor(x, dtype=dtype)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
