"""Kernels of vllm_eagle2 (installed as the subpackage ``vllm_eagle2.kernels``)."""

from .kv_cache import (
    CPU_KV_LAYOUTS,
    KV_LAYOUTS,
    check_cpu_kv_layout,
    cpu_layout,
    kv_cache_views,
    read_kv_slots,
    write_kv_slots,
)
from .kv_moves import move_kv_slots
from .tree_attention import paged_tree_attention
from .tree_attention_cpu import (
    CPU_BACKEND_ENV,
    CpuTreePlan,
    cpu_backend,
    cpu_tree_attention,
    plan_cpu_tree_attention,
)
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
    "CPU_KV_LAYOUTS",
    "HAS_TRITON",
    "KV_LAYOUTS",
    "CpuTreePlan",
    "PAD_PARENT",
    "ROOT_PARENT",
    "TreeMasks",
    "ancestor_tables",
    "build_tree_masks",
    "check_cpu_kv_layout",
    "cpu_backend",
    "cpu_layout",
    "cpu_tree_attention",
    "kv_cache_views",
    "move_kv_slots",
    "pack_tree_mask",
    "paged_tree_attention",
    "plan_cpu_tree_attention",
    "read_kv_slots",
    "vocab_topk",
    "write_kv_slots",
]
