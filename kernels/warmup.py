"""Every Triton variant an eagle2 step can launch, enumerated from the engine's limits and
compiled at engine start: no kernel compiles mid-serving, where it would stall a step, trip
vLLM's JIT monitor (which watches for exactly that once warm-up is done) and be priced by the
adaptive budget as drafting cost.

Triton compiles a kernel once per variant: its constexprs and launch options, its tensors'
dtypes and 16-byte alignment, and for every int it specialises, whether the int is 1 and whether
16 divides it. The launchers keep each int that follows the batch out of that specialisation
(``do_not_specialize``) and derive their constexprs from host values with few distinct values:

* vocab top-k (draft levels; verification with ``k = 1``, scaled for sampled requests):
  ``K``, ``KP``, ``HAS_SCALE``, the logits' dtype, and the chunk count, a power of two
  (:func:`.vocab_topk.chunk_plan`) that sets ``CP`` and ``CHP``;
* tree masks: ``BLOCK_N`` and ``BLOCK_W`` from the tree width (:func:`.tree_mask.mask_blocks`);
* tree attention: ``BLOCK_Q`` (and with it ``num_warps``) from a request's most queries
  (:func:`.tree_attention_triton.default_block_q`), and whether the context is split.

:func:`warm_up_kernels` launches each variant once, on tensors of a few rows; the attention reads
the real cache views (their strides and alignment are part of the variant) at block 0 and
writes scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import triton
from .tree_attention_triton import default_block_q, paged_tree_attention_triton
from .tree_mask import _packed_depths_triton, mask_blocks
from .vocab_topk import _vocab_topk_triton, chunk_plan

__all__ = [
    "AttentionCache",
    "StepLimits",
    "attention_variants",
    "mask_variants",
    "topk_variants",
    "warm_up_kernels",
]


@dataclass(frozen=True)
class StepLimits:
    """What bounds the shapes of one step's kernels.

    draft_vocab, draft_dtype: columns and dtype of the head's logits.
    target_vocab, target_dtypes: columns of the verified logits, and the dtypes they may come in
        (the model's; float32 once vLLM's logits processors have run).
    max_topk: children per expanded node; every narrower k occurs too (wide levels are narrowed).
    max_nodes: tree nodes of one request, the root included (m + 1).
    max_rows: rows of one vocab top-k call: a draft level's nodes or a step's verified rows.
    """

    draft_vocab: int
    draft_dtype: torch.dtype
    target_vocab: int
    target_dtypes: tuple[torch.dtype, ...]
    max_topk: int
    max_nodes: int
    max_rows: int


@dataclass(frozen=True)
class AttentionCache:
    """One layer's paged cache views ``[num_blocks, Hkv, block_size, D]`` and its query heads."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    num_heads: int


def topk_variants(limits: StepLimits, device: torch.device) -> list[tuple[int, int, bool, torch.dtype, int]]:
    """``(vocab, k, scaled, dtype, num_chunks)`` of every vocab top-k launch a step can make."""
    calls = [(limits.draft_vocab, k, False, limits.draft_dtype) for k in range(1, limits.max_topk + 1)]
    calls += [(limits.target_vocab, 1, s, t) for s in (False, True) for t in limits.target_dtypes]
    chunk_counts = {}
    for vocab in {limits.draft_vocab, limits.target_vocab}:
        counts = chunk_counts[vocab] = set()
        for rows in range(1, limits.max_rows + 1):
            counts.add(chunk_plan(rows, vocab, device)[0])
            if 1 in counts:  # the count never grows with the rows
                break
    return sorted({(v, k, s, t, c) for v, k, s, t in calls for c in chunk_counts[v]}, key=str)


def mask_variants(max_nodes: int) -> list[int]:
    """One tree width per mask kernel variant: the smallest ``n`` of each (BLOCK_N, BLOCK_W)."""
    first: dict[tuple[int, int], int] = {}
    for n in range(1, max_nodes + 1):
        first.setdefault(mask_blocks(n), n)
    return sorted(first.values())


def attention_variants(max_nodes: int, g: int) -> list[tuple[int, int]]:
    """``(max_q, num_splits)`` per attention variant: a request's most queries for each BLOCK_Q,
    with the context split (2) and walked in the merge kernel (1)."""
    first: dict[int, int] = {}
    for q in range(1, max_nodes + 1):
        first.setdefault(default_block_q(q, g), q)
    return [(q, s) for q in sorted(first.values()) for s in (1, 2)]


def warm_up_kernels(limits: StepLimits, device: torch.device, caches: list[AttentionCache]) -> int:
    """Launch every variant of :func:`topk_variants`, :func:`mask_variants` and
    :func:`attention_variants` (per cache) once; returns the number of launches."""
    launches = 0
    for vocab, k, scaled, dtype, chunks in topk_variants(limits, device):
        logits = torch.zeros(1, vocab, dtype=dtype, device=device)
        scale = torch.ones(1, dtype=torch.float32, device=device) if scaled else None
        _vocab_topk_triton(logits, k, scale=scale, num_chunks=chunks)
        launches += 1
    for n in mask_variants(limits.max_nodes):
        parents = torch.arange(-1, n - 1, dtype=torch.int64, device=device).unsqueeze(0)  # a chain
        _packed_depths_triton(parents)
        launches += 1
    for cache in caches:
        _, hkv, block_size, head_size = cache.key_cache.shape
        for max_q, splits in attention_variants(limits.max_nodes, cache.num_heads // hkv):
            query = torch.zeros(max_q, cache.num_heads, head_size, dtype=cache.key_cache.dtype, device=device)
            ints = dict(dtype=torch.int64, device=device)
            words = triton.cdiv(max_q, 32)
            paged_tree_attention_triton(
                query,
                cache.key_cache,
                cache.value_cache,
                torch.zeros(1, triton.cdiv(max_q, block_size), dtype=torch.int32, device=device),  # block 0
                torch.tensor([0, max_q], **ints),
                torch.zeros(1, **ints),
                torch.full((1,), max_q, **ints),
                torch.full((1, max_q, words), -1, dtype=torch.int32, device=device),
                1.0,
                torch.empty_like(query),
                max_context_len=block_size,
                num_splits=splits,
            )
            launches += 1
    return launches
