"""Torch backend ("torch") of paged tree attention: the twin every kernel is tested against.

Batched pure torch: gathers each request's K/V through the block table, float32 scores and a
masked softmax (``scaled_dot_product_attention`` with a dense visibility mask), with no Python
loop over requests or tokens, only over chunks of kv heads to bound memory.  Also the CPU path
where the C++ kernel cannot be built.  Semantics: :mod:`vllm_eagle2.kernels.tree_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .tree_attention_checks import check_values
from .tree_mask import _BITS

__all__ = ["paged_tree_attention_torch"]

#: float32 elements of the score tensor the torch backend materialises per kv-head chunk.
_TORCH_SCORE_BUDGET = 1 << 26


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
    s_len = check_values(q_total, qsl, ctx, reg, max_q, n_words, max_blocks, bs)

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


def paged_tree_attention_torch(
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
    """Batched torch twin of the C++ and Triton kernels; writes ``out`` ``[Q, H, D]``.

    Arguments as :func:`~vllm_eagle2.kernels.paged_tree_attention`, shapes already checked
    (:func:`~.tree_attention_checks.check_args`); the index values are checked here (one host
    sync per plan).

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
