"""A dispatch mode that counts aten ops and fails on host syncs: the tests' launch and sync probe.

Every aten op is at most one kernel launch (views none), so the count bounds the launches of a
CUDA run of the same code; an op that needs tensor data on the host (``.item()``, ``bool(t)``,
``nonzero``, boolean-mask indexing) would stall a GPU stream and break CUDA-graph capture.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.item.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.equal.default,
}


class AtenOps(TorchDispatchMode):
    """Counts aten ops by name (``counts``, ``total``); raises AssertionError on a host sync."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None
        )
        if func in SYNC_OPS or bool_index:
            raise AssertionError(f"host sync: {func}")
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)
