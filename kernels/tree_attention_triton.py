"""Triton backend of :func:`vllm_eagle2.kernels.paged_tree_attention` (split-KV, flash-decoding style).

The semantics (context fully visible, region tokens through the packed mask, GQA, zero rows)
are in :mod:`vllm_eagle2.kernels.tree_attention`'s docstring.  This module plans and launches the
kernels (:mod:`~vllm_eagle2.kernels.tree_attention_triton_kernels`, their device functions in
:mod:`~vllm_eagle2.kernels.tree_attention_triton_steps`); the torch twin they are tested against
is :mod:`~vllm_eagle2.kernels.tree_attention_torch`.

Work unit.  A *tile* is ``BLOCK_Q`` consecutive query tokens of one request; with the
``G = H // Hkv`` query heads of one kv head it makes ``BLOCK_M = BLOCK_Q * BLOCK_G`` rows
(``BLOCK_G = next_power_of_2(G)``), row ``m`` being query token ``row0 + m // BLOCK_G`` and
query head ``kvh * G + m % BLOCK_G``.  Every K/V tile loaded is thus shared by all the query
heads of the group and all the tile's query tokens, and the dots have >= 16 rows.

Two kernels per call:

* ``_ctx_split_kernel``, grid ``(tiles, Hkv, num_splits)``: the request's context
  ``[0, C)`` is cut into ``num_splits`` chunks of ``chunk = roundup(ceil(C / num_splits),
  BLOCK_N)`` tokens (per request, so short and long contexts both spread evenly); each program
  runs an online softmax (base 2, float32) over its chunk, with no visibility mask and no
  position mask but in a last partial tile, and writes the
  unnormalised partial ``acc [BLOCK_M, BLOCK_D]``, running max ``m`` and sum ``l`` to scratch.
  Programs whose chunk is empty return at once and write nothing.
* ``_region_merge_kernel``, grid ``(tiles, Hkv)``: the masked attention over the region
  (storage positions ``C .. C+T-1``, at most a few dozen tokens), then a log-sum-exp merge
  with the partials of the non-empty chunks, normalisation, and the store to ``out``.
  Rows that see nothing get 0.

When the grid is already large without splitting (big batches), ``num_splits`` is 1 and the
split kernel is not launched at all: the region kernel then walks the context itself
(``CONTEXT_INLINE``), one launch and no scratch traffic.

Everything that depends only on the index tensors (tile -> request/row table, int32 copies of
the lengths, scratch buffers, grid sizes) is computed once and kept in the caller's
``plan_cache``, shared by all the layers of one forward: a layer's call is then the launches
alone, with no torch op and no host sync.

Measured on an H200 (bf16, H = 32, Hkv = 8, D = 128, block size 16, 60 tree queries per
request over 2,048 context tokens, CUDA-graph replay): R = 1, 9 splits: 30 us (dense SDPA
over the same tokens 34 us; the former one-kernel version 209 us in 22 launches); R = 64, one
launch: 553 us (SDPA 528-537 us; former 2,216 us).  Eager calls at R = 1 are bound by the
host (~65 us to enqueue the two launches, mostly Triton's launch path and the argument checks).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ._triton import HAS_TRITON

if HAS_TRITON:
    from .tree_attention_triton_kernels import _ctx_split_kernel, _region_merge_kernel

__all__ = ["paged_tree_attention_triton"]

#: Fewest context tokens per split worth a program of its own (4 iterations of BLOCK_N = 64).
_MIN_SPLIT_TOKENS = 256
#: Most splits of one request's context.
_MAX_SPLITS = 64
#: Split-KV programs aimed at, per streaming multiprocessor (2 keeps every SM busy while the
#: tail of the grid drains).
_PROGRAMS_PER_SM = 2
#: Multiprocessor count assumed off CUDA (the interpreter), where it only sizes the grid.
_DEFAULT_SMS = 132

_LOG2E = math.log2(math.e)

_sm_counts: dict[int, int] = {}


@dataclass(frozen=True)
class _TritonPlan:
    """Index work, scratch and launch configuration of one forward (every layer of it shares them).

    tiles: [n_tiles, 6] int32, per tile: request (-1 = unused grid slot), first query row
        within the request, the request's first token in ``query``, its query count, C, T.
    acc, ml: float32 scratch of the split kernel, ``[n_tiles * Hkv * num_splits * BLOCK_M *
        BLOCK_D]`` and ``[n_tiles * Hkv * num_splits * 2 * BLOCK_M]``; ``tiles`` itself (never
        read as scratch) when ``num_splits == 1``.
    n_tiles, num_splits: grid sizes (``num_splits == 1``: no split kernel).
    consts: the split kernel's constexpr / launch keywords; region_consts the region kernel's
        (the same plus ``CONTEXT_INLINE``).
    """

    tiles: torch.Tensor
    acc: torch.Tensor
    ml: torch.Tensor
    n_tiles: int
    num_splits: int
    consts: dict
    region_consts: dict


def _next_pow2(n: int) -> int:
    """Smallest power of 2 >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def default_block_q(max_q: int, g: int) -> int:
    """Query tokens per tile for requests of at most ``max_q`` queries and ``g`` query heads per
    kv head: 64 rows (one Hopper warpgroup's MMA height), >= 16 rows for tl.dot, and no more
    query tokens than a request can have. With ``num_splits == 1`` or not, the only constexpr
    that follows the batch (:mod:`.warmup` compiles each value at engine start)."""
    block_g = _next_pow2(g)
    return max(16 // block_g, min(_next_pow2(max(max_q, 1)), 64 // block_g), 1)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_counts:
        _sm_counts[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_counts[idx]


def _choose_num_splits(n_tiles: int, hkv: int, max_context_len: int, block_n: int, n_sms: int) -> int:
    """Splits of the context so that ``tiles x Hkv x splits`` fills ~``_PROGRAMS_PER_SM`` x the SMs.

    Host ints only (no sync).  A split gets at least ``_MIN_SPLIT_TOKENS`` (and BLOCK_N) of the
    longest possible context, so short contexts are not cut into programs that do no work.
    """
    want = -(-_PROGRAMS_PER_SM * n_sms // max(1, n_tiles * hkv))
    per_split = max(_MIN_SPLIT_TOKENS, block_n)
    cap = max(1, -(-max_context_len // per_split))
    return max(1, min(want, cap, _MAX_SPLITS))


def _tile_sizes(
    g: int, d: int, max_q: int, block_q: int | None, block_n: int | None
) -> tuple[int, int, int, int]:
    """``(block_q, block_g, block_n, block_d)`` for ``g`` query heads per kv head, head size ``d``
    and at most ``max_q`` queries per request: ``block_q`` / ``block_n`` as given (checked) or the
    defaults, ``block_g`` / ``block_d`` the padded group and head sizes.

    Raises:
        ValueError: ``block_q`` not a power of 2 with ``block_q * block_g >= 16``, or ``block_n``
            not a power of 2 >= 16.
    """
    block_g = _next_pow2(g)
    block_d = max(16, _next_pow2(d))
    if block_q is None:
        block_q = default_block_q(max_q, g)
    if block_q < 1 or block_q * block_g < 16 or block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of 2 with block_q * {block_g} >= 16, got {block_q}")
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32  # K and V tiles of 64 x 256 would crowd shared memory
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of 2 >= 16, got {block_n}")
    return block_q, block_g, block_n, block_d


def _tile_table(
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    region_lens: torch.Tensor,
    r: int,
    n_grid: int,
    block_q: int,
) -> torch.Tensor:
    """``[n_grid, 6]`` int32 contiguous, the plan's ``tiles`` (see :class:`_TritonPlan`); torch
    ops, no host sync.

    ``r`` requests; request ``i`` gets ``ceil(q_i / block_q)`` consecutive tiles, requests in
    order; the grid slots past the last tile (``n_grid`` is an upper bound) get request -1.
    """
    qsl = query_start_loc.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    n_tiles = (q_lens + block_q - 1) // block_q
    tile_end = torch.cumsum(n_tiles, 0)
    p = torch.arange(n_grid, device=query_start_loc.device)
    req = torch.searchsorted(tile_end, p, right=True)
    req_c = req.clamp(max=r - 1)  # unused slots (req == r) index in range; the kernels skip them
    tiles = torch.stack(
        [
            torch.where(req < r, req, torch.full_like(req, -1)),
            (p - (tile_end - n_tiles)[req_c]) * block_q,
            qsl[req_c],
            q_lens[req_c],
            context_lens.to(torch.int64)[req_c],
            region_lens.to(torch.int64)[req_c],
        ],
        dim=1,
    )
    return tiles.to(torch.int32).contiguous()


def _make_plan(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    region_lens: torch.Tensor,
    mask: torch.Tensor,
    max_context_len: int | None,
    num_splits: int | None,
    block_q: int | None,
    block_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
) -> _TritonPlan:
    """Tiling, split count, tile table and scratch (torch ops, no host sync).

    Request ``r`` gets ``ceil(q_r / block_q)`` tiles; their number is at most
    ``Q // block_q + R`` (each request wastes less than one tile), the grid size.
    """
    q_total, h, d = query.shape
    _, hkv, bs, _ = key_cache.shape
    r, max_blocks = block_table.shape
    g = h // hkv
    block_q, block_g, block_n, block_d = _tile_sizes(g, d, mask.shape[1], block_q, block_n)
    block_m = block_q * block_g
    n_grid = q_total // block_q + r
    if num_splits is None:
        bound = max_blocks * bs if max_context_len is None else max_context_len
        num_splits = _choose_num_splits(n_grid, hkv, bound, block_n, _num_sms(query.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # Triton's interpreter (CPU tests) computes bfloat16 tl.dot wrongly; on GPUs bf16 dots are fine.
    upcast = query.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    consts = dict(
        BLOCK_SIZE=bs,
        D=d,
        G=g,
        BLOCK_Q=block_q,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if upcast or query.dtype == torch.float32 else "tf32",
        UPCAST=upcast,
        num_warps=num_warps or (4 if block_m <= 64 else 8),  # 128 x 128 float32 accumulators: 8 warps
        num_stages=num_stages or 3,
    )

    dev = query_start_loc.device
    tiles = _tile_table(query_start_loc, context_lens, region_lens, r, n_grid, block_q)
    if num_splits > 1:
        n_parts = n_grid * hkv * num_splits
        acc = torch.empty(n_parts * block_m * block_d, dtype=torch.float32, device=dev)
        ml = torch.empty(n_parts * 2 * block_m, dtype=torch.float32, device=dev)
    else:
        acc = ml = tiles
    region_consts = {**consts, "CONTEXT_INLINE": num_splits == 1}
    return _TritonPlan(tiles, acc, ml, n_grid, num_splits, consts, region_consts)


def _cached_plan(
    plan_cache: dict | None,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    region_lens: torch.Tensor,
    mask: torch.Tensor,
    tuning: tuple,
) -> _TritonPlan:
    """The plan of these shapes from ``plan_cache``, made (:func:`_make_plan`) and kept on a miss;
    ``tuning``: (max_context_len, num_splits, block_q, block_n, num_warps, num_stages)."""
    # Everything the plan depends on besides the index tensors' values (which the plan_cache
    # contract fixes for its lifetime).
    key = ("triton", query.shape, query.dtype, key_cache.shape[1:3], block_table.shape, mask.shape, *tuning)
    plan = plan_cache.get(key) if plan_cache is not None else None
    if plan is None:
        plan = _make_plan(
            query, key_cache, block_table, query_start_loc, context_lens, region_lens, mask, *tuning
        )
        if plan_cache is not None:
            plan_cache[key] = plan
    return plan


def _launch_ctx_split(
    plan: _TritonPlan,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    qk_scale: float,
) -> None:
    """Launch ``_ctx_split_kernel`` on grid ``(n_tiles, Hkv, num_splits)``: the partials (``acc``,
    ``m``, ``l``) of every non-empty context chunk into ``plan.acc`` / ``plan.ml``.  ``qk_scale``:
    the softmax scale times log2(e) (the kernels' softmax is base 2)."""
    hkv, max_blocks = key_cache.shape[1], block_table.shape[1]
    _ctx_split_kernel[(plan.n_tiles, hkv, plan.num_splits)](
        query,
        key_cache,
        value_cache,
        block_table,
        plan.tiles,
        plan.acc,
        plan.ml,
        qk_scale,
        plan.num_splits,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_table.stride(),
        max_blocks,
        **plan.consts,
    )


def _launch_region_merge(
    plan: _TritonPlan,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    mask: torch.Tensor,
    qk_scale: float,
) -> None:
    """Launch ``_region_merge_kernel`` on grid ``(n_tiles, Hkv)``: the masked region, merged with
    the split kernel's partials (``num_splits > 1``) or with the context walked inline, into
    ``out``; ``qk_scale`` as :func:`_launch_ctx_split`."""
    hkv, max_blocks = key_cache.shape[1], block_table.shape[1]
    _region_merge_kernel[(plan.n_tiles, hkv)](
        query,
        key_cache,
        value_cache,
        out,
        block_table,
        mask,
        plan.tiles,
        plan.acc,
        plan.ml,
        qk_scale,
        plan.num_splits,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *out.stride(),
        *block_table.stride(),
        *mask.stride(),
        max_blocks,
        mask.shape[1],
        mask.shape[2],
        **plan.region_consts,
    )


def paged_tree_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    region_lens: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    plan_cache: dict | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Launch the Triton kernels (arguments already checked); writes ``out`` ``[Q, H, D]``.

    Args:
        query .. out: as :func:`vllm_eagle2.kernels.paged_tree_attention`, shapes checked.
        plan_cache: the caller's per-forward dict; the plan (tiling, tile table, scratch, split
            count) is made on the first call and reused by the next calls with the same shapes,
            which then cost only the launches.
        max_context_len: a host-side upper bound of ``context_lens`` that sizes the split
            count (default ``max_blocks * block_size``); any value is correct, a tight one
            avoids splits that find nothing to do.
        num_splits: force the number of context splits (tests); 1 = no split kernel.
        block_q: query tokens per tile (power of 2, ``block_q * next_pow2(G) >= 16``).
        block_n: kv positions per inner iteration (power of 2, >= 16).
        num_warps, num_stages: launch options (default 4 warps for tiles of <= 64 rows, else 8;
            3 stages).
    """
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' requested but triton is not importable")
    q_total = query.shape[0]
    if q_total == 0 or block_table.shape[0] == 0:
        return
    tuning = (max_context_len, num_splits, block_q, block_n, num_warps, num_stages)
    plan = _cached_plan(
        plan_cache, query, key_cache, block_table, query_start_loc, context_lens, region_lens, mask, tuning
    )

    qk_scale = float(scale) * _LOG2E
    if plan.num_splits > 1:
        _launch_ctx_split(plan, query, key_cache, value_cache, block_table, qk_scale)
    _launch_region_merge(plan, query, key_cache, value_cache, out, block_table, mask, qk_scale)
