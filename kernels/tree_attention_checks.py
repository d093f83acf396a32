"""Argument checks of paged tree attention, shared by every backend.

:func:`check_args` (shapes, dtypes, devices; no sync) runs in the public entry point
:func:`vllm_eagle2.kernels.paged_tree_attention` before any backend; :func:`check_values` (the
index values; one host sync) is called by the torch backend while it plans.  The mask's bit
packing (32 bits per int32 word) and the accepted integer dtypes are :mod:`.tree_mask`'s.
"""

from __future__ import annotations

import torch

from .tree_mask import _BITS, _INT_DTYPES

__all__ = ["check_args", "check_values"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _shape(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _check_int(name: str, x: object, shape: tuple[int, ...] | None, ndim: int) -> None:
    ok = isinstance(x, torch.Tensor) and x.dim() == ndim and (shape is None or tuple(x.shape) == shape)
    if not ok:
        want = f"{list(shape)}" if shape is not None else f"{ndim}-D"
        raise ValueError(f"{name} must be a {want} torch.Tensor, got {_shape(x)}")
    if x.dtype not in _INT_DTYPES:  # type: ignore[union-attr]
        raise ValueError(f"{name} must have an integer dtype, got {x.dtype}")  # type: ignore[union-attr]


def check_args(
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
    """Shape, dtype and device checks of :func:`~vllm_eagle2.kernels.paged_tree_attention`'s arguments.

    No device sync: the entry point runs them for every backend (for Triton they are the only
    checks).

    Raises:
        ValueError: naming the first argument that is wrong.
    """
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


def check_values(
    q_total: int,
    qsl: torch.Tensor,
    ctx: torch.Tensor,
    reg: torch.Tensor,
    max_q: int,
    n_words: int,
    max_blocks: int,
    block_size: int,
) -> int:
    """Value checks of the int64 index tensors (one host sync); returns max(C + T).

    ``qsl`` ``[R + 1]``, ``ctx`` / ``reg`` ``[R]``: query_start_loc, context_lens and region_lens
    as int64; ``max_q`` / ``n_words``: the mask's rows and words per row; ``max_blocks`` /
    ``block_size``: the block table's capacity.  All conditions are reduced on the device and
    read back in one ``tolist()``.  The backends that read only in-bounds memory whatever the
    values (Triton) skip it to stay sync-free.

    Raises:
        ValueError: the lengths are inconsistent (see the messages).
    """
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
