"""Torch twins of the CPU tree kernel and its plan (:mod:`.tree_attention_cpu`): the references they
are tested against, and the CPU path where the C++ kernels cannot be built.

Each request's tokens are read out of the cache in its own layout (:func:`.kv_cache.read_kv_slots`)
into a dense one-block-per-request cache, and :func:`.tree_attention_torch.paged_tree_attention_torch`
(batched, float32 scores) attends over it; no Python loop over requests or tokens.
"""

from __future__ import annotations

import torch

from .kv_cache import read_kv_slots
from .tree_attention_torch import paged_tree_attention_torch

__all__ = ["cpu_tree_attention_torch", "plan_torch"]


def cpu_tree_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: str,
    plan: torch.Tensor,
    block_table: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The C++ ``tree_attention``'s twin, with its arguments (:class:`~.tree_attention_cpu.CpuTreePlan`'s
    tensors; ``layout``: ``"vec"`` or ``"amx"``); writes the plan's rows of ``out``."""
    req = plan[1:]
    first, nq, ctx, reg = req.unbind(1)
    if int(nq.sum()) == 0:
        return
    r = req.shape[0]
    _, hkv, bs, _ = kv_cache.shape
    seq = int((ctx + reg).max())
    pos = torch.arange(seq)
    inside = pos < (ctx + reg).unsqueeze(1)  # [R, S]
    blocks = block_table.long()[:, (pos // bs).clamp(max=block_table.shape[1] - 1)]
    slots = torch.where(inside, blocks * bs + pos % bs, 0)  # past a sequence: any valid slot, never seen
    key, value = read_kv_slots(kv_cache, layout, slots.flatten())
    # [R, Hkv, S, D]; zeros past each sequence, whatever its slots hold (a weight of 0 times NaN is NaN)
    dense = [
        torch.where(inside.view(r, seq, 1, 1), t.view(r, seq, hkv, -1), 0).transpose(1, 2)
        for t in (key, value)
    ]
    rows = (
        torch.repeat_interleave(first, nq)
        + torch.arange(int(nq.sum()))
        - torch.repeat_interleave(nq.cumsum(0) - nq, nq)
    )
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), nq.cumsum(0)])
    got = torch.empty(rows.numel(), query.shape[1], query.shape[2], dtype=query.dtype)
    paged_tree_attention_torch(
        query[rows], *dense, torch.arange(r).unsqueeze(1), qsl, ctx, reg, mask, scale, got
    )
    out[rows] = got


def plan_torch(
    rows: torch.Tensor,
    qsl: torch.Tensor,
    table: torch.Tensor,
    ctx: torch.Tensor,
    reg: torch.Tensor,
    mask: torch.Tensor,
    num_blocks: int,
    block_size: int,
    num_rows: int,
) -> torch.Tensor:
    """Twin of the C++ ``tree_attention_plan``: the same plan [R + 1, 4] int64 and the same checks
    (ValueError); arguments as :func:`~vllm_eagle2.kernels.plan_cpu_tree_attention`, converted."""
    r = qsl.numel() - 1
    if r < 0 or table.shape[0] != r or ctx.numel() != r or reg.numel() != r or mask.shape[0] != r:
        raise ValueError(
            "query_start_loc [R + 1], block_table [R, B], context_lens and region_lens [R], mask [R, ...] "
            "disagree on R"
        )
    if block_size % 32:
        raise ValueError(f"the CPU tree kernel reads blocks of a multiple of 32 tokens, got {block_size}")
    nq = qsl.diff()
    if qsl[0] != 0 or qsl[-1] != rows.numel() or (nq < 0).any():
        raise ValueError(f"query_start_loc must rise from 0 to Q={rows.numel()}")
    _, max_blocks = table.shape
    max_q, bits = mask.shape[1], 32 * mask.shape[2]
    bad = (nq > max_q) | (nq > reg) | (ctx < 0) | (reg > bits) | (ctx + reg > max_blocks * block_size)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"request {i}: {int(nq[i])} queries, context {int(ctx[i])}, region {int(reg[i])} do not fit "
            f"mask rows {max_q}, mask bits {bits} or the block table's {max_blocks * block_size} tokens"
        )
    req = torch.repeat_interleave(torch.arange(r), nq)
    first = torch.where(nq > 0, rows[qsl[:-1].clamp(max=max(rows.numel() - 1, 0))] if rows.numel() else 0, 0)
    if rows.numel() and (
        (rows != first[req] + torch.arange(rows.numel()) - qsl[req]).any()
        or first[nq > 0].min() < 0
        or (first + nq)[nq > 0].max() > num_rows
    ):
        raise ValueError(f"each request's rows must be consecutive and within the forward's {num_rows} rows")
    needed = (torch.arange(max_blocks) * block_size < (ctx + reg).unsqueeze(1)) & (nq > 0).unsqueeze(1)
    if ((table < 0) | (table >= num_blocks))[needed].any():
        raise ValueError(f"a block_table entry a request reads is outside [0, {num_blocks})")
    plan = torch.empty(r + 1, 4, dtype=torch.int64)
    plan[0] = torch.tensor([r, num_blocks, block_size, num_rows])
    plan[1:] = torch.stack([first, nq, ctx, reg], dim=1)
    return plan
