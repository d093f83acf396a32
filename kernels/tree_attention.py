"""Attention over vLLM's paged KV cache with a per-request "tree region" mask.

Semantics, for ``R`` requests.  Request ``r`` has, in the paged cache,
``C = context_lens[r]`` context tokens (storage positions ``0 .. C-1``),
followed by a *region* of ``T = region_lens[r]`` tokens (storage positions
``C .. C+T-1``; e.g. the draft-tree tokens being verified, or the draft
"catch-up" tokens with a causal mask).  Its queries are the **last**
``q_r = query_start_loc[r+1] - query_start_loc[r]`` tokens of the region
(``q_r <= T``), concatenated over requests in ``query``.  Query ``i``
(0-based within the request's queries) attends to

* every context token (``s < C``), and
* region token ``j`` (storage position ``C + j``) iff bit ``j % 32`` of word
  ``j // 32`` of ``mask[r, i]`` is set (the packing of
  :func:`vllm_eagle2.kernels.pack_tree_mask`; for a draft tree whose queries
  are the last ``q`` of ``T`` tree tokens, use rows ``T-q .. T-1`` of
  ``build_tree_masks(parents).packed``).

Storage position ``s`` of request ``r`` lives in block
``block_table[r, s // block_size]`` at offset ``s % block_size``.  GQA: query
head ``h`` uses kv head ``h // (H // Hkv)``.  A query that sees no token at
all (only possible with ``C == 0`` and an empty mask row) gets a zero output.

The caches are ``[num_blocks, Hkv, block_size, D]`` tensors that may be
arbitrarily strided views; :mod:`.kv_cache` makes such views of vLLM's caches.

Two interchangeable backends, one module each, both behind :func:`paged_tree_attention`
(which checks the arguments' shapes once, :mod:`.tree_attention_checks`, and picks one):

* ``"torch"``  -- batched pure torch (:mod:`.tree_attention_torch`): the test oracle;
  validates the index values (one host sync).
* ``"triton"`` -- split-KV (flash-decoding) Triton kernels (:mod:`.tree_attention_triton`),
  the CUDA path.  Needs no host sync; does no value validation (out-of-range lengths cannot
  cause out-of-bounds mask/block-table reads but give unspecified outputs).

Every backend can keep the index work that all layers of one forward share in the caller's
``plan_cache``. On CPU, vLLM's caches are read by :mod:`.tree_attention_cpu` instead, in the
layout vLLM chose (its ``"amx"`` layout has no strided view).
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON
from .tree_attention_checks import check_args
from .tree_attention_torch import paged_tree_attention_torch
from .tree_attention_triton import paged_tree_attention_triton

__all__ = ["paged_tree_attention"]


def _resolve_backend(backend: str, query: torch.Tensor) -> str:
    """``"torch"`` or ``"triton"``: ``backend`` itself, or for ``"auto"`` Triton when ``query`` is
    on CUDA and Triton is importable, else torch.  Raises ValueError for an unknown name; runs
    before the argument checks, so ``query`` may still be anything."""
    if backend == "auto":
        on_cuda = isinstance(query, torch.Tensor) and query.is_cuda
        backend = "triton" if on_cuda and HAS_TRITON else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return backend


def paged_tree_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    region_lens: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    plan_cache: dict | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Attention of each request's last region tokens over its paged KV cache, tree-masked.

    See the module docstring for the exact visibility rule.

    Args:
        query: ``[Q, H, D]`` float16/bfloat16/float32, requests concatenated
            (any strides).
        key_cache: ``[num_blocks, Hkv, block_size, D]``, same dtype, any
            strides (see :func:`~vllm_eagle2.kernels.kv_cache_views`).
        value_cache: ``[num_blocks, Hkv, block_size, D]``, same dtype/shape.
        block_table: ``[R, max_blocks]`` int; block of storage position ``s``
            of request ``r`` is ``block_table[r, s // block_size]``.  Entries
            past a request's ``C + T`` positions are never read.
        query_start_loc: ``[R + 1]`` int, cumulative query counts (starts at
            0, ends at ``Q``).
        context_lens: ``[R]`` int, ``C`` (fully visible tokens).
        region_lens: ``[R]`` int, ``T`` (masked region tokens after the
            context); ``q_r <= T``.
        mask: ``[R, max_q, W]`` int32 packed bits, ``max_q >= q_r`` and
            ``32 * W >= T``; bit ``j % 32`` of ``mask[r, i, j // 32]``:
            query ``i`` of request ``r`` sees region token ``j``.  Rows
            ``>= q_r`` and bits ``>= T`` are ignored.
        scale: softmax scale (usually ``D ** -0.5``).
        out: optional ``[Q, H, D]`` output (query's dtype/device, any strides).
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton when the query is on CUDA
            and Triton is importable, else torch).
        plan_cache: optional dict owned by the caller, shared by calls whose index
            tensors (``block_table`` .. ``mask``) are the same, e.g. every layer of one
            forward: the torch backend validates and indexes them once and keeps the
            result there (measured on CPU, 30 layer calls of a 9-query tree over 400
            context tokens: 24 ms -> 16 ms); Triton its tile table, int32 lengths and
            scratch, so that a layer's call is only its kernel launches.
        max_context_len: optional host-side upper bound of ``context_lens`` (Triton only: it
            sizes the split of the context over programs, never affects the result; default
            ``max_blocks * block_size``).

    Returns:
        ``[Q, H, D]`` in the query's dtype (``out`` when given).

    Raises:
        ValueError: an argument has the wrong shape/dtype/device, unknown
            ``backend``; (torch backend) inconsistent lengths.
    """
    backend = _resolve_backend(backend, query)
    tensors = (query, key_cache, value_cache, block_table, query_start_loc, context_lens, region_lens, mask)
    check_args(*tensors, out)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if backend == "torch":
        paged_tree_attention_torch(*tensors, scale, out, plan_cache)
    else:
        paged_tree_attention_triton(
            *tensors, scale, out, plan_cache=plan_cache, max_context_len=max_context_len
        )
    return out
