"""Which path the step takes on a device, and host-to-device copies on that path.

On CUDA the step's glue is fixed-shape and sync-free (a CUDA graph can capture it, and no host
read stalls the stream); on the CPU some of it compacts instead, since a host read costs nothing
there. ``VLLM_EAGLE2_CUDA_PATH=1`` (:data:`CUDA_PATH_ENV`) makes CPU tensors take the CUDA path,
so that the suite runs every line of it on this CPU (kernels excepted: they have torch twins).
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: Set to 1 to run the CUDA path of the glue on CPU tensors (a test mode; slower, same output).
CUDA_PATH_ENV = "VLLM_EAGLE2_CUDA_PATH"


def cuda_path(device: torch.device) -> bool:
    """Whether work on ``device`` takes the fixed-shape, sync-free path (any device but the CPU,
    or the CPU under :data:`CUDA_PATH_ENV`)."""
    return device.type != "cpu" or os.environ.get(CUDA_PATH_ENV) == "1"


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
