"""The accepted tree nodes' K/V moved into place, in every target layer's cache at once.

After a verification the accepted path's keys and values sit at its nodes' slots; they move to the
slots right after the root, where the next step's causal attention reads them. On CPU one C++
call (``csrc/kv_moves_cpu.cpp``) copies them within the layout vLLM chose, for every layer; its
torch twin reads each layer's tokens with :func:`~.kv_cache.read_kv_slots` and writes them back with
:func:`~.kv_cache.write_kv_slots` (a few tensor ops per layer, about 50 us each on 2 cores).
"""

from __future__ import annotations

import torch

from ._cpp import load_cpu_ops
from .kv_cache import CPU_LAYOUT_CODES, read_kv_slots, write_kv_slots
from .tree_attention_cpu import cpu_backend

__all__ = ["move_kv_slots", "move_kv_slots_torch"]


def move_kv_slots_torch(
    caches: list[torch.Tensor], layout: str, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """The twin of :func:`move_kv_slots`."""
    for cache in caches:
        key, value = read_kv_slots(cache, layout, src)
        write_kv_slots(cache, layout, dst, key, value)


def move_kv_slots(
    caches: list[torch.Tensor], layout: str, src: torch.Tensor, dst: torch.Tensor, *, backend: str = "auto"
) -> None:
    """Copy the K/V at slots ``src`` [K] to slots ``dst`` [K] in every CPU cache of ``caches``
    (``[num_blocks, Hkv, block_size, 2 * D]``, one layout: ``"vec"`` or ``"amx"``). All sources are
    read before any destination is written; a destination of -1 writes nothing.

    backend: ``"cpp"``, ``"torch"`` or ``"auto"`` (:func:`~.tree_attention_cpu.cpu_backend`).

    Raises:
        ValueError: an unknown layout or backend.
        RuntimeError: (cpp) a cache or a slot the copy cannot address.
    """
    if layout not in CPU_LAYOUT_CODES:
        raise ValueError(f"move_kv_slots moves within layouts {sorted(CPU_LAYOUT_CODES)}, got {layout!r}")
    if backend == "auto":
        backend = cpu_backend()
    src, dst = src.to(torch.int64).contiguous(), dst.to(torch.int64).contiguous()
    if backend == "cpp":
        load_cpu_ops()
        torch.ops.eagle2_cpu.move_kv_slots(caches, CPU_LAYOUT_CODES[layout], src, dst)
    elif backend == "torch":
        move_kv_slots_torch(caches, layout, src, dst)
    else:
        raise ValueError(f"backend must be 'auto', 'cpp' or 'torch', got {backend!r}")
