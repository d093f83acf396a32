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
arbitrarily strided views; :func:`kv_cache_views` makes such views of vLLM's
CPU (``"cpu"``) and CUDA FlashAttention/Triton (``"flash"``) cache layouts
without copying, and :func:`check_cpu_kv_layout` verifies the CPU layout
against vLLM's own cache-write op.

Three interchangeable backends:

* ``"cpp"``    -- a C++ CPU kernel (``csrc/tree_attention_cpu.cpp``, built on first use):
  reads K/V in place through the block table and the caches' strides, float32 scores;
  one work item per (request, tile of 8 of its queries, kv head), so each K/V block is
  converted once for the tile's queries and the group's query heads.  The CPU path
  inside vLLM; validates the index values like the torch backend.
* ``"torch"``  -- batched pure torch (gathers each request's K/V through the
  block table, float32 scores, masked softmax; no Python loop over requests
  or tokens, only over chunks of kv heads to bound memory).  The test oracle, and
  the CPU path where the C++ kernel cannot be built.  Also validates the index values
  (one host sync).
* ``"triton"`` -- split-KV (flash-decoding) Triton kernels, float32 online softmax
  (``tree_attention_triton.py``): one launch computes partial attentions of tiles of
  ``BLOCK_Q`` query tokens x the ``H // Hkv`` query heads of a kv head over chunks of the
  request's context (no mask there), spread over enough programs to fill the GPU; a second one
  adds the masked region and merges the partials by log-sum-exp.  Big batches skip the split
  (one launch).  Reads K/V, block table and mask in place through their strides; the index
  work is kept in ``plan_cache`` for every layer of a forward.  Needs no host sync; does no
  value validation (out-of-range lengths cannot cause out-of-bounds mask/block-table reads
  but give unspecified outputs).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._cpp import load_cpu_ops
from ._triton import HAS_TRITON
from .tree_attention_triton import paged_tree_attention_triton

__all__ = [
    "CPU_BACKEND_ENV",
    "KV_LAYOUTS",
    "check_cpu_kv_layout",
    "cpu_backend",
    "kv_cache_views",
    "paged_tree_attention",
]

#: Layouts understood by :func:`kv_cache_views`.
KV_LAYOUTS = ("cpu", "flash")

_BITS = 32
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: float32 elements of the score tensor the torch backend materialises per kv-head chunk.
_TORCH_SCORE_BUDGET = 1 << 26

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- #
# KV-cache layouts
# --------------------------------------------------------------------------- #


def kv_cache_views(kv_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views ``[num_blocks, Hkv, block_size, D]`` of a vLLM KV cache (no copy).

    Args:
        kv_cache: one layer's cache tensor.

            * ``layout="cpu"`` (vLLM CPU_ATTN backend, ISAs ``"vec"`` /
              ``"vec16"``): shape ``[num_blocks, Hkv, block_size, 2*D]``.  Per
              (block, kv head) the contiguous ``block_size * 2D`` elements hold
              first the keys stored transposed as ``[D, block_size]``
              (element ``(d, t)`` at offset ``d * block_size + t``), then the
              values as ``[block_size, D]`` (offset
              ``block_size * D + t * D + d``).  The last two dims must be
              contiguous; block and head strides are taken from the tensor.
            * ``layout="flash"`` (vLLM 0.32 CUDA FlashAttention / Triton attention
              backends, "LBHNC"): shape ``[num_blocks, Hkv, block_size, 2*D]`` with
              each token's key in ``[..., :D]`` and its value in ``[..., D:]``.

        layout: ``"cpu"`` or ``"flash"``.

    Returns:
        ``(key_cache, value_cache)``, each ``[num_blocks, Hkv, block_size, D]``
        sharing storage with ``kv_cache``.

    Raises:
        ValueError: unknown ``layout`` or ``kv_cache`` of the wrong shape /
            strides for it.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if layout == "cpu":
        if kv_cache.dim() != 4 or kv_cache.shape[3] % 2 != 0:
            raise ValueError(
                f"kv_cache for layout 'cpu' must be [num_blocks, Hkv, block_size, 2*D], "
                f"got shape {tuple(kv_cache.shape)}"
            )
        nb, hkv, bs, d2 = kv_cache.shape
        d = d2 // 2
        if kv_cache.stride(3) != 1 or (bs > 1 and kv_cache.stride(2) != d2):
            raise ValueError(
                "kv_cache for layout 'cpu' must be contiguous in its last two dims, "
                f"got strides {kv_cache.stride()}"
            )
        s0, s1 = kv_cache.stride(0), kv_cache.stride(1)
        base = kv_cache.storage_offset()
        key = torch.as_strided(kv_cache, (nb, hkv, bs, d), (s0, s1, 1, bs), base)
        value = torch.as_strided(kv_cache, (nb, hkv, bs, d), (s0, s1, d, 1), base + bs * d)
        return key, value
    if layout == "flash":
        if kv_cache.dim() != 4 or kv_cache.shape[3] % 2 != 0:
            raise ValueError(
                "kv_cache for layout 'flash' must be [num_blocks, Hkv, block_size, 2*D], "
                f"got shape {tuple(kv_cache.shape)}"
            )
        d = kv_cache.shape[3] // 2
        return kv_cache[..., :d], kv_cache[..., d:]
    raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")


def check_cpu_kv_layout(isa: str, dtype: torch.dtype, head_size: int, block_size: int) -> None:
    """Verify that vLLM's CPU cache-write op uses the ``"cpu"`` layout of :func:`kv_cache_views`.

    Writes a few random tokens with ``vllm._custom_ops.cpu_attn_reshape_and_cache``
    (exactly as vLLM's CPU_ATTN backend does) into a small scratch cache
    ``[2, 2, block_size, 2*head_size]`` and reads them back through the views.

    Args:
        isa: the CPU attention ISA vLLM selected (``"vec"``, ``"vec16"``, ...).
        dtype: KV-cache dtype.
        head_size: ``D``.
        block_size: tokens per cache block.

    Raises:
        RuntimeError: vLLM is not importable, its op rejects the
            configuration, or the data it wrote is not where the views expect
            it (e.g. the ``"amx"`` layout).
    """
    try:
        from vllm import _custom_ops as ops
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(f"check_cpu_kv_layout needs vLLM's custom ops: {exc}") from exc

    what = f"isa={isa!r}, dtype={dtype}, head_size={head_size}, block_size={block_size}"
    nb, hkv = 2, 2
    ntok = min(nb * block_size, 2 * block_size + 3)
    gen = torch.Generator().manual_seed(1234)
    key = torch.randn(ntok, hkv, head_size, generator=gen).to(dtype)
    val = torch.randn(ntok, hkv, head_size, generator=gen).to(dtype)
    slots = torch.randperm(nb * block_size, generator=gen)[:ntok].to(torch.int64)
    kv = torch.zeros(nb, hkv, block_size, 2 * head_size, dtype=dtype)
    k_cache, v_cache = kv.view(nb, hkv, block_size * 2, head_size).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(key, val, k_cache, v_cache, slots, isa)
    except Exception as exc:
        raise RuntimeError(f"vLLM's cpu_attn_reshape_and_cache failed for {what}: {exc}") from exc
    k_view, v_view = kv_cache_views(kv, "cpu")
    blk, off = slots // block_size, slots % block_size
    if not (torch.equal(k_view[blk, :, off], key) and torch.equal(v_view[blk, :, off], val)):
        raise RuntimeError(
            f"vLLM's CPU KV-cache layout for {what} differs from the one paged_tree_attention "
            "assumes (per block and kv head: keys transposed as [D, block_size], then values "
            "as [block_size, D]); tree attention cannot read this cache"
        )


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #


def _shape(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _check_int(name: str, x: object, shape: tuple[int, ...] | None, ndim: int) -> None:
    ok = isinstance(x, torch.Tensor) and x.dim() == ndim and (shape is None or tuple(x.shape) == shape)
    if not ok:
        want = f"{list(shape)}" if shape is not None else f"{ndim}-D"
        raise ValueError(f"{name} must be a {want} torch.Tensor, got {_shape(x)}")
    if x.dtype not in _INT_DTYPES:  # type: ignore[union-attr]
        raise ValueError(f"{name} must have an integer dtype, got {x.dtype}")  # type: ignore[union-attr]


def _check_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    region_lens: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Shape/dtype checks (no device sync)."""
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError(f"query must be a 3-D [Q, H, D] torch.Tensor, got {_shape(query)}")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"query must be float16, bfloat16 or float32, got {query.dtype}")
    _, h, d = query.shape
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            raise ValueError(f"{name} must be a 4-D [num_blocks, Hkv, block_size, D] tensor, got {_shape(c)}")
        if c.dtype != query.dtype:
            raise ValueError(f"{name} dtype {c.dtype} differs from the query dtype {query.dtype}")
        if c.device != query.device:
            raise ValueError(f"{name} is on {c.device}, query on {query.device}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ in shape"
        )
    hkv = key_cache.shape[1]
    if key_cache.shape[3] != d:
        raise ValueError(f"key_cache head size {key_cache.shape[3]} differs from the query's {d}")
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"query heads {h} must be a multiple of the key_cache kv heads {hkv}")
    if key_cache.shape[2] < 1:
        raise ValueError("key_cache block_size must be >= 1")
    _check_int("block_table", block_table, None, 2)
    r = block_table.shape[0]
    _check_int("query_start_loc", query_start_loc, (r + 1,), 1)
    _check_int("context_lens", context_lens, (r,), 1)
    _check_int("region_lens", region_lens, (r,), 1)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 3 or mask.shape[0] != r:
        raise ValueError(f"mask must be a 3-D [{r}, max_q, W] torch.Tensor, got {_shape(mask)}")
    if mask.dtype != torch.int32:
        raise ValueError(f"mask must be int32 (packed bits), got {mask.dtype}")
    for name, t in (
        ("block_table", block_table),
        ("query_start_loc", query_start_loc),
        ("context_lens", context_lens),
        ("region_lens", region_lens),
        ("mask", mask),
    ):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != query.shape:
            raise ValueError(f"out must be a {list(query.shape)} torch.Tensor, got {_shape(out)}")
        if out.dtype != query.dtype or out.device != query.device:
            raise ValueError(f"out must have the query's dtype/device, got {out.dtype} on {out.device}")


def _check_values(
    q_total: int,
    qsl: torch.Tensor,
    ctx: torch.Tensor,
    reg: torch.Tensor,
    max_q: int,
    n_words: int,
    max_blocks: int,
    block_size: int,
) -> int:
    """Value checks of the int64 index tensors (one host sync); returns max(C + T)."""
    q_lens = qsl[1:] - qsl[:-1]
    total = ctx + reg
    zero = torch.zeros(1, dtype=torch.int64, device=qsl.device)
    stats = torch.stack(
        [
            (qsl[0] != 0).to(torch.int64),
            (qsl[-1] != q_total).to(torch.int64),
            (torch.cat([q_lens, zero]) < 0).any().to(torch.int64),
            (torch.cat([q_lens, zero]) > max_q).any().to(torch.int64),
            (torch.cat([q_lens - reg, zero]) > 0).any().to(torch.int64),
            (torch.cat([torch.minimum(ctx, reg), zero]) < 0).any().to(torch.int64),
            torch.cat([reg, zero]).max(),
            torch.cat([total, zero]).max(),
        ]
    ).tolist()
    bad_first, bad_last, neg_q, big_q, q_gt_t, neg_len, max_t, max_s = stats
    if bad_first or bad_last:
        raise ValueError(f"query_start_loc must start at 0 and end at Q={q_total}")
    if neg_q:
        raise ValueError("query_start_loc must be non-decreasing")
    if big_q:
        raise ValueError(f"a request has more queries than mask rows (max_q={max_q})")
    if q_gt_t:
        raise ValueError("a request has more queries (query_start_loc) than region tokens (region_lens)")
    if neg_len:
        raise ValueError("context_lens and region_lens must be >= 0")
    if max_t > _BITS * n_words:
        raise ValueError(f"region_lens up to {max_t} do not fit in mask's {n_words} packed words")
    if max_s > max_blocks * block_size:
        raise ValueError(
            f"context_lens + region_lens up to {max_s} exceed block_table capacity "
            f"{max_blocks} x {block_size}"
        )
    return int(max_s)


# --------------------------------------------------------------------------- #
# Torch backend
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _TorchPlan:
    """The torch backend's index work for one set of index tensors (every layer of a forward shares it).

    req, row: [Q] int64, request of each query and its row among that request's queries.
    blk, off: [R, S] int64, cache block and offset of storage position s (block 0 past the sequence).
    visible: [R, 1, max_q, S] bool, what each (request, query row) attends to.
    seen: [R, 1, max_q, 1] bool, the row sees at least one token (else its output is zero).
    """

    req: torch.Tensor
    row: torch.Tensor
    blk: torch.Tensor
    off: torch.Tensor
    visible: torch.Tensor
    seen: torch.Tensor


def _torch_plan(
    q_total: int,
    block_size: int,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    region_lens: torch.Tensor,
    mask: torch.Tensor,
) -> _TorchPlan:
    """Validate the index values (one host sync) and turn them into gather indices and a dense mask."""
    dev = block_table.device
    bs = block_size
    r, max_blocks = block_table.shape
    _, max_q, n_words = mask.shape
    qsl = query_start_loc.to(torch.int64)
    ctx = context_lens.to(torch.int64)
    reg = region_lens.to(torch.int64)
    s_len = _check_values(q_total, qsl, ctx, reg, max_q, n_words, max_blocks, bs)

    tok = torch.arange(q_total, device=dev)
    req = torch.searchsorted(qsl[1:], tok, right=True)
    row = tok - qsl[req]

    # Storage positions 0 .. S-1 of every request -> (block, offset).
    pos = torch.arange(s_len, device=dev)
    total = ctx + reg
    in_seq = pos[None, :] < total[:, None]  # [R, S]
    blk = block_table[:, pos // bs].to(torch.int64)
    blk = torch.where(in_seq, blk, torch.zeros_like(blk))  # never touch entries past the sequence
    off = (pos % bs)[None, :].expand(r, s_len)

    # Visibility [R, max_q, S]: context, or the region bit of the query's mask row.
    vis = (pos[None, :] < ctx[:, None])[:, None, :].expand(r, max_q, s_len)
    if n_words > 0:
        rel = pos[None, :] - ctx[:, None]  # [R, S]
        in_reg = (rel >= 0) & in_seq
        rel = torch.where(in_reg, rel, torch.zeros_like(rel))
        words = torch.gather(mask, 2, (rel // _BITS)[:, None, :].expand(r, max_q, s_len))  # int32
        bits = (words >> (rel % _BITS).to(torch.int32)[:, None, :]) & 1
        vis = vis | (in_reg[:, None, :] & (bits != 0))
    visible = vis[:, None]
    return _TorchPlan(req, row, blk, off, visible, visible.any(-1, keepdim=True))


def _paged_tree_attention_torch(
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
    plan_cache: dict | None = None,
) -> None:
    """Batched torch twin; writes ``out`` ``[Q, H, D]``.

    ``plan_cache``: a dict kept by the caller for calls that share the index tensors (every layer
    of one forward); the validation and index work is done once and stored there.
    """
    q_total, h, d = query.shape
    _, hkv, bs, _ = key_cache.shape
    key = (q_total, bs)
    plan = plan_cache.get(key) if plan_cache is not None else None
    if plan is None:
        plan = _torch_plan(q_total, bs, block_table, query_start_loc, context_lens, region_lens, mask)
        if plan_cache is not None:
            plan_cache[key] = plan
    if q_total == 0:
        return
    r, _, max_q, s_len = plan.visible.shape
    if s_len == 0:
        out.zero_()
        return

    g = h // hkv
    q_pad = torch.zeros(r, max_q, h, d, dtype=torch.float32, device=query.device)
    q_pad[plan.req, plan.row] = query.to(torch.float32)
    q_pad = q_pad.transpose(1, 2)  # [R, H, max_q, D]
    o_pad = torch.empty(r, h, max_q, d, dtype=torch.float32, device=query.device)

    def gather(cache: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
        """[R, hc, S, D] float32: the requests' tokens of kv heads h0 .. h1-1."""
        return cache[:, h0:h1][plan.blk, :, plan.off].transpose(1, 2).to(torch.float32)

    per_head = max(1, r * g * max_q * s_len)
    chunk = max(1, min(hkv, _TORCH_SCORE_BUDGET // per_head))
    for h0 in range(0, hkv, chunk):
        h1 = min(hkv, h0 + chunk)
        o_pad[:, h0 * g : h1 * g] = F.scaled_dot_product_attention(
            q_pad[:, h0 * g : h1 * g],
            gather(key_cache, h0, h1),
            gather(value_cache, h0, h1),
            attn_mask=plan.visible,
            scale=scale,
            enable_gqa=g > 1,
        )
    o_pad = torch.where(plan.seen, o_pad, 0.0)  # a row that sees nothing: zeros, not NaN
    out.copy_(o_pad.transpose(1, 2)[plan.req, plan.row])


# --------------------------------------------------------------------------- #
# C++ CPU backend
# --------------------------------------------------------------------------- #

#: Environment variable that picks the CPU backend of ``backend="auto"`` (unset: cpp, else torch).
CPU_BACKEND_ENV = "VLLM_EAGLE2_CPU_ATTENTION"
_cpp_state: dict[str, bool] = {}  # "ok": whether the kernel was built, once tried


def cpu_backend() -> str:
    """The backend ``"auto"`` takes on CPU: ``"cpp"`` (built on the first call), else ``"torch"``.

    ``$VLLM_EAGLE2_CPU_ATTENTION`` = ``cpp`` or ``torch`` forces one (``cpp`` then fails if the
    kernel cannot be built, instead of falling back).

    Raises:
        ValueError: the variable holds another value.
        RuntimeError: it says ``cpp`` and the kernel cannot be built.
    """
    forced = os.environ.get(CPU_BACKEND_ENV, "")
    if forced not in ("", "cpp", "torch"):
        raise ValueError(f"{CPU_BACKEND_ENV} must be 'cpp' or 'torch' (or unset), got {forced!r}")
    if forced == "torch":
        return "torch"
    if forced == "cpp":
        load_cpu_ops()
        return "cpp"
    if "ok" not in _cpp_state:
        try:
            load_cpu_ops()
            _cpp_state["ok"] = True
        except RuntimeError as exc:
            logger.warning("eagle2 tree attention falls back to its slower torch backend: %s", exc)
            _cpp_state["ok"] = False
    return "cpp" if _cpp_state["ok"] else "torch"


def _paged_tree_attention_cpp(
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
    plan_cache: dict | None = None,
) -> None:
    """Run the C++ kernel; writes ``out`` ``[Q, H, D]``.

    ``plan_cache`` keeps the index tensors as the kernel takes them (contiguous int64 / int32)
    for every layer of one forward.
    """
    load_cpu_ops()
    key = ("cpp", query.shape[0])
    idx = plan_cache.get(key) if plan_cache is not None else None
    if idx is None:
        lengths = (block_table, query_start_loc, context_lens, region_lens)
        idx = (*(t.to(torch.int64).contiguous() for t in lengths), mask.contiguous())
        if plan_cache is not None:
            plan_cache[key] = idx
    torch.ops.eagle2_cpu.tree_attention(query, key_cache, value_cache, *idx, float(scale), out)


# --------------------------------------------------------------------------- #
# Public entry point
# --------------------------------------------------------------------------- #


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
            strides (see :func:`kv_cache_views`).
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
        backend: ``"cpp"``, ``"torch"``, ``"triton"`` or ``"auto"`` (Triton when the
            query is on CUDA and Triton is importable; on CPU :func:`cpu_backend`).
        plan_cache: optional dict owned by the caller, shared by calls whose index
            tensors (``block_table`` .. ``mask``) are the same, e.g. every layer of one
            forward: the torch backend validates and indexes them once and keeps the
            result there (measured on CPU, 30 layer calls of a 9-query tree over 400
            context tokens: 24 ms -> 16 ms); the C++ backend its int64 copies of them; Triton
            its tile table, int32 lengths and scratch, so that a layer's call is only its
            kernel launches.
        max_context_len: optional host-side upper bound of ``context_lens`` (Triton only: it
            sizes the split of the context over programs, never affects the result; default
            ``max_blocks * block_size``).

    Returns:
        ``[Q, H, D]`` in the query's dtype (``out`` when given).

    Raises:
        ValueError: an argument has the wrong shape/dtype/device, unknown
            ``backend``; (torch and cpp backends) inconsistent lengths.
    """
    if backend == "auto":
        on_cuda = isinstance(query, torch.Tensor) and query.is_cuda
        if on_cuda:
            backend = "triton" if HAS_TRITON else "torch"
        else:
            backend = cpu_backend()
    if backend not in ("cpp", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'cpp', 'torch' or 'triton', got {backend!r}")
    tensors = (query, key_cache, value_cache, block_table, query_start_loc, context_lens, region_lens, mask)
    _check_args(*tensors, out)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if backend == "torch":
        _paged_tree_attention_torch(*tensors, scale, out, plan_cache)
    elif backend == "cpp":
        _paged_tree_attention_cpp(*tensors, scale, out, plan_cache)
    else:
        paged_tree_attention_triton(
            *tensors, scale, out, plan_cache=plan_cache, max_context_len=max_context_len
        )
    return out
