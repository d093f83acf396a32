"""A tree forward on CPU, each row computed once: vLLM's kernel over each request's rows before
its tree rows, eagle2's kernel over the tree rows, both writing the layer's output in place.

vLLM's CPU kernel takes a request's rows as one causal block ending at its sequence's end. Each
request is handed to it as two pseudo-requests: its rows before the tree rows, over its sequence
up to them (exactly what they attend to), and its tree rows over no tokens, which vLLM's scheduler
gives no work, so its kernel never touches them (:func:`causal_rows_only`). The tree rows are
then :func:`~vllm_eagle2.kernels.cpu_tree_attention`'s, read from the cache in the layout vLLM
chose. What every layer of a forward shares is made by its first layer, kept in the batch's
``plan_cache``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_eagle2.kernels import cpu_tree_attention, plan_cpu_tree_attention

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionImpl

    from vllm_eagle2.engine.tree_batch import TreeBatch

__all__ = ["causal_rows_only", "cpu_tree_rows", "split_metadata"]


def causal_rows_only(meta: Any, batch: TreeBatch, impl: AttentionImpl, layer: Any, dtype: torch.dtype) -> Any:
    """vLLM's CPU attention metadata with every request's tree rows left out.

    Request r becomes two pseudo-requests of vLLM's kernel: its rows before the tree rows, over
    its sequence up to them (exactly what they attend to causally), and its tree rows over no
    tokens, which vLLM's scheduler gives no work: the kernel never touches those rows. Made once
    per forward and attention group (the layers of a group share ``meta``).

    Raises:
        RuntimeError: the tree rows are not the last rows of their requests (then vLLM's kernel
            would skip rows that only it computes).
    """
    from vllm import _custom_ops as ops
    from vllm import envs

    qsl = meta.query_start_loc.numpy().astype(np.int64)
    n = qsl.size - 1
    if batch.tails.size > n or not meta.causal or meta.dynamic_causal is not None:
        raise RuntimeError("eagle2: a tree batch was published for a forward that is not causal decoding")
    tails = np.zeros(n, dtype=np.int64)
    tails[: batch.tails.size] = batch.tails
    ends = qsl[1:]
    total = int(tails.sum())
    want = np.repeat(ends - tails, tails) + np.arange(total) - np.repeat(np.cumsum(tails) - tails, tails)
    if (tails > np.diff(qsl)).any() or not np.array_equal(want, batch.rows.cpu().numpy()):
        raise RuntimeError("eagle2: this forward's tree rows are not the last rows of their requests")
    split_qsl = np.empty(2 * n + 1, dtype=np.int32)
    split_qsl[0:-1:2], split_qsl[1::2], split_qsl[-1] = qsl[:-1], ends - tails, qsl[-1]
    seq = np.zeros(2 * n, dtype=np.int32)
    seq[0::2] = meta.seq_lens.numpy() - tails
    query_start_loc, seq_lens = torch.from_numpy(split_qsl), torch.from_numpy(seq)
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=2 * n,
        num_heads=impl.num_heads,
        num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size,
        seq_lens=seq_lens,
        dtype=dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=-1,  # windows are refused at start-up (unsupported_features)
        isa=layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
    return dataclasses.replace(
        meta,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=meta.block_table.repeat_interleave(2, dim=0),
        scheduler_metadata=scheduler,
    )


def split_metadata(batch: TreeBatch, meta: Any, impl: Any, layer: Any, dtype: torch.dtype) -> Any:
    """:func:`causal_rows_only` of ``meta``, once per forward and attention group."""
    key = ("vllm", id(meta.scheduler_metadata))
    if key not in batch.plan_cache:
        batch.plan_cache[key] = causal_rows_only(meta, batch, impl, layer, dtype)
    return batch.plan_cache[key]


def cpu_tree_rows(impl: Any, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
                   batch: TreeBatch) -> None:  # fmt: skip
    """The tree rows by eagle2's CPU kernel, written into the layer's output in place; the plan is
    made (and its index values checked) by the forward's first layer."""
    key = ("cpu", *kv_cache.shape[:3])
    plan = batch.plan_cache.get(key)
    if plan is None:
        plan = batch.plan_cache[key] = plan_cpu_tree_attention(
            batch.rows, batch.query_start_loc, batch.block_table, batch.context_lens, batch.region_lens,
            batch.mask, num_blocks=kv_cache.shape[0], block_size=kv_cache.shape[2], num_rows=query.shape[0],
        )  # fmt: skip
    cpu_tree_attention(
        query, kv_cache, layer.isa, plan, impl.scale, output.view(output.shape[0], impl.num_heads, -1)
    )
