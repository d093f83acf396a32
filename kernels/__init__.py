"""Kernels of vllm_eagle2 (installed as the subpackage ``vllm_eagle2.kernels``)."""

from .tree_mask import (
    HAS_TRITON,
    PAD_PARENT,
    ROOT_PARENT,
    TreeMasks,
    build_tree_masks,
    pack_tree_mask,
    unpack_tree_mask,
)

__all__ = [
    "HAS_TRITON",
    "PAD_PARENT",
    "ROOT_PARENT",
    "TreeMasks",
    "build_tree_masks",
    "pack_tree_mask",
    "unpack_tree_mask",
]
