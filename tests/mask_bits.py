"""Reading packed tree masks back as bools, for the tests (the kernels only ever read the bits)."""

from __future__ import annotations

import torch

from vllm_eagle2.kernels import TreeMasks


def unpack_tree_mask(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int32 mask words ``[..., W]`` -> bool ``[..., n]``: element ``j`` is bit ``j % 32`` of word
    ``j // 32`` (the inverse of ``pack_tree_mask``)."""
    assert packed.dtype == torch.int32 and 0 <= n <= 32 * packed.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # arithmetic shift is fine: & 1
    return bits.flatten(-2)[..., :n].to(torch.bool)


def dense_mask(masks: TreeMasks) -> torch.Tensor:
    """``[B, N, N]`` bool: the ancestor-or-self mask of ``masks.packed``."""
    return unpack_tree_mask(masks.packed, masks.packed.shape[1])
