"""Kernels of vllm_eagle2 (installed as the subpackage ``vllm_eagle2.kernels``)."""

from .kv_cache import KV_LAYOUTS, check_cpu_kv_layout, kv_cache_views
from .tree_attention import paged_tree_attention
from .tree_attention_cpp import CPU_BACKEND_ENV, cpu_backend
from .tree_mask import (
    HAS_TRITON,
    PAD_PARENT,
    ROOT_PARENT,
    TreeMasks,
    ancestor_tables,
    build_tree_masks,
    pack_tree_mask,
)
from .vocab_topk import vocab_topk

__all__ = [
    "CPU_BACKEND_ENV",
    "HAS_TRITON",
    "KV_LAYOUTS",
    "PAD_PARENT",
    "ROOT_PARENT",
    "TreeMasks",
    "ancestor_tables",
    "build_tree_masks",
    "check_cpu_kv_layout",
    "cpu_backend",
    "kv_cache_views",
    "pack_tree_mask",
    "paged_tree_attention",
    "vocab_topk",
]
