"""Draft levels on the paged KV cache: one head pass per level of every request's tree.

A frontier node at level L sits at position ``root + L``; its draft KV is written past the
request's end (slot ``end + (L - 1) * topk + j``) and it attends to the whole context plus its own
ancestors, through the tree side channel of :mod:`vllm_eagle2.engine.attention`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from vllm_eagle2.device import to_device
from vllm_eagle2.engine import attention
from vllm_eagle2.kernels import pack_tree_mask

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata

#: The cache slot of a write that must not happen (vLLM's cache writers skip it).
PAD_SLOT = -1


class HeadRunner(Protocol):
    """The drafter as a draft level sees it (:class:`~vllm_eagle2.engine.proposer.Eagle2Proposer`).

    block_size: the KV cache's block size. run_level: one head pass over ``rows`` frontier nodes,
    their tokens [rows] int64 (head-vocabulary positions), RoPE positions [rows] and parents'
    hidden states [rows, H], with ``cad``'s attention metadata; returns the children's draft logits
    [rows, V] and the head's hidden states [rows, H].
    """

    block_size: int

    def run_level(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        parent_hidden: torch.Tensor,
        cad: CommonAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class TreeExpander:
    """The ``draft_step`` of :func:`build_dynamic_tree`: one head pass per tree level.

    head: runs the passes; cad: the catch-up pass's attention metadata (vLLM's
    ``CommonAttentionMetadata``); root_pos: [B] int64 each root's position; root_hidden: [B, H]
    the head's hidden state at each root; region_capacity: draft KV slots past each request's end
    (sized for the configured tree: an adaptive step may draft a narrower or shallower one);
    max_model_len: the head's position limit; on_level: called with each level's rows as it starts
    (the budget's level timer), or None.
    """

    def __init__(
        self,
        head: HeadRunner,
        cad: CommonAttentionMetadata,
        root_pos: torch.Tensor,
        root_hidden: torch.Tensor,
        *,
        region_capacity: int,
        max_model_len: int,
        on_level: Callable[[int], None] | None = None,
    ) -> None:
        self.head = head
        self.cad = cad
        self.root_pos = root_pos  # [B]
        self.region_capacity = region_capacity
        self.on_level = on_level
        # Draft KV of the tree goes right past the request's end. A request too close to
        # max_model_len gets no drafts: its writes are dropped (padding slots) and its
        # reads kept inside the block table.
        end = root_pos + 1
        self.fits = end + region_capacity <= max_model_len  # [B]
        self.start = torch.minimum(end, torch.full_like(end, max_model_len - region_capacity))
        self.parent_hidden = root_hidden.unsqueeze(1)  # [B, 1 or K, H]
        self.visible: torch.Tensor | None = None  # [B, K, region] ancestor-or-self, region slots
        self.block_table = cad.block_table_tensor[: root_pos.shape[0]]
        # Host-side bounds for the attention metadata (start <= root + 1 <= the first pass's
        # sequence length), so no level reads a length back from the device.
        self.max_seq_len = cad.max_seq_len

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Cache slots [B, K] of storage positions [B, K]; requests that do not fit: padding."""
        bs = self.head.block_size
        block = self.block_table.gather(1, positions // bs).long()
        return torch.where(self.fits.unsqueeze(1), block * bs + positions % bs, PAD_SLOT)

    def __call__(self, tokens: torch.Tensor, prev_slots: torch.Tensor, level: int) -> torch.Tensor:
        batch, k = tokens.shape
        device = tokens.device
        if self.on_level is not None:
            self.on_level(batch * k)
        # Hidden state fed with each node: its parent's head output.
        if level == 2:
            parent_hidden = self.parent_hidden.expand(batch, k, -1).contiguous()
        else:
            hidden_size = self.parent_hidden.shape[-1]
            parent_hidden = self.parent_hidden.gather(1, prev_slots.unsqueeze(-1).expand(-1, -1, hidden_size))
        # Region slot of this level's nodes, and what each of them may see.
        region_len = (level - 1) * k
        own = (level - 2) * k + torch.arange(k, device=device)
        visible = torch.zeros(batch, k, region_len, dtype=torch.bool, device=device)
        if self.visible is not None:
            visible[:, :, : region_len - k] = self.visible.gather(
                1, prev_slots.unsqueeze(-1).expand(-1, -1, self.visible.shape[-1])
            )
        visible[:, torch.arange(k, device=device), own] = True
        self.visible = visible

        storage = self.start.unsqueeze(1) + own.unsqueeze(0)  # [B, K]
        # Materialised: vLLM's CPU kernels index these flat, a stride-0 view would be misread.
        positions = (self.root_pos + level - 1).repeat_interleave(k).view(batch, k)
        rows = batch * k
        qsl_cpu = torch.arange(0, rows + 1, k, dtype=torch.int32)
        qsl = to_device(qsl_cpu, device)
        seq_lens = (self.start + region_len).to(torch.int32)
        max_seq_len = self.max_seq_len + region_len
        cad = dataclasses.replace(
            self.cad,
            query_start_loc=qsl,
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens,
            num_reqs=batch,
            num_actual_tokens=rows,
            max_query_len=k,
            max_seq_len=max_seq_len,
            block_table_tensor=self.block_table,
            slot_mapping=self._slots(storage).flatten(),
            positions=positions.flatten(),
            seq_lens_cpu_upper_bound=torch.full((batch,), max_seq_len, dtype=torch.int32),
            is_prefilling=None,
        )
        level_batch = attention.TreeBatch(
            rows=torch.arange(rows, device=device),
            query_start_loc=qsl.long(),
            block_table=self.block_table,
            context_lens=self.start,
            region_lens=torch.full_like(self.start, region_len),
            mask=pack_tree_mask(visible),
            tails=np.full(batch, k, dtype=np.int64),  # every row of a level is a tree row
        )
        with attention.tree_batch(level_batch):
            logits, hidden = self.head.run_level(
                tokens.flatten(), positions.flatten(), parent_hidden.flatten(0, 1), cad
            )
        self.parent_hidden = hidden.view(batch, k, -1)
        return logits.view(batch, k, -1)
