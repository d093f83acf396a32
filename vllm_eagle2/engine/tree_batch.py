"""The side channel of one forward's tree attention: which rows are tree rows, with which masks.

vLLM copies its attention metadata before the kernels see it, so no extra field would survive that
route: a :class:`TreeBatch` is published for one forward through :func:`tree_batch`, a context
manager, and the wrapped attention layers (:mod:`.attention`) read it with :func:`active_batch`.
Outside a ``with tree_batch(...)`` every layer is plain causal attention, so no batch can leak into
a later forward (a draft level, the drafter's catch-up pass, a dummy run).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["TreeBatch", "TreeForward", "active_batch", "tree_batch"]


@dataclass
class TreeBatch:
    """Tree queries of the next forward pass, R requests (those with tree rows, in batch order).

    rows: [Q] int64, rows of the flattened batch that are tree queries, grouped by request: each
        request's are consecutive and the last of its rows.
    query_start_loc: [R + 1] int64, cumulative query counts.
    block_table: [R, max_blocks] int32, the requests' rows of the block table.
    context_lens: [R] int64, tokens before the region (fully visible).
    region_lens: [R] int64, tokens in the region (visible through ``mask``).
    mask: [R, max_q, W] int32, packed visibility of region tokens per query: row i is the
        i-th query of the request, whichever region row it is.
    tails: [n] int64 on the host, for the forward's first n requests (all of its requests, or
        fewer: the rest have none), how many of its last rows are tree rows.
    plan_cache: what every layer of this forward shares (the CPU kernel's plan, vLLM's split
        metadata, the Triton kernel's tile table), made by the first layer that needs it.
    """

    rows: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    region_lens: torch.Tensor
    mask: torch.Tensor
    tails: np.ndarray
    plan_cache: dict = field(default_factory=dict)


@dataclass
class TreeForward:
    """The tree attention of one forward.

    batch: the tree queries, None = plain causal attention (all layers); set at entry to
        :func:`tree_batch` or once by :meth:`publish`.
    """

    batch: TreeBatch | None = None

    def publish(self, batch: TreeBatch) -> None:
        """Set the tree queries of this forward once it has started (the verifier's route).

        Raises:
            RuntimeError: a batch is already published for this forward.
        """
        if self.batch is not None:
            raise RuntimeError("eagle2: this forward already has a tree batch")
        self.batch = batch


#: The forward inside :func:`tree_batch`, None outside: the side channel itself.
_active: TreeForward | None = None


@contextmanager
def tree_batch(batch: TreeBatch | None = None) -> Iterator[TreeForward]:
    """Scope of one forward's tree attention: the attention layers see ``batch`` inside only.

    Args:
        batch: the tree queries of the forward run inside; None to publish them later with
            :meth:`TreeForward.publish` (the forward's inputs are prepared inside the scope).

    Yields:
        The :class:`TreeForward`.

    Raises:
        RuntimeError: another scope is active. One forward runs at a time; a nested scope
            would hide the outer one's batch from its own layers.
    """
    global _active
    if _active is not None:
        raise RuntimeError("eagle2: a tree batch is already active; tree_batch scopes do not nest")
    forward = TreeForward(batch)
    _active = forward
    try:
        yield forward
    finally:
        _active = None


def active_batch() -> TreeBatch | None:
    """The tree queries of the forward running now (None: plain causal attention)."""
    return _active.batch if _active is not None else None
