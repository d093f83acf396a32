"""Acceptance by tree position, as the engine observes it: the budget's learning table.

The verifier adds each step's outcome to a small device table (:meth:`AcceptanceTable.record`):
per depth and sibling rank, trials and acceptances; per depth, the accepted nodes and the summed
exp(path value) of the verified ones. Its host copy rides on the drafter's own transfer and feeds
the :class:`AcceptanceModel` the planner reads; the device table calibrates the allocation
(:meth:`AcceptanceTable.correction`) without a sync. Both forget at :data:`DISCOUNT` per step.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_eagle2.verify.paths import accepted_and_reached

__all__ = ["DISCOUNT", "AcceptanceModel", "AcceptanceTable"]

#: Per step, drafting or not, older acceptance counts are multiplied by this (a memory of ~50
#: steps), in every table that learns acceptance (this one, the lookup chains'). While nothing is
#: drafted, a table measured low thus drifts back to its prior, and drafting is tried again (a few
#: unlucky drafts would otherwise rule it out for good).
DISCOUNT = 0.98


class AcceptanceModel:
    """Acceptance by tree position, learnt from the trees the engine verifies.

    ``p[d, r]``: the probability that the rank-``r`` child (0 = likeliest) of a node at depth
    ``d`` (0 = the root) is accepted, given that its parent was. Counts are discounted sums
    (recent steps weigh more) plus a prior of ``prior_weight`` pseudo-trials, which only matters
    until the engine has seen that position a few times. Each position's prior is the estimate
    next to it: the rank above's times ``prior_decay``, for rank 0 the level above's rank 0, and
    ``prior_top1`` for the root's likeliest child. A fixed prior per position (0.5, 0.25, ...)
    priced the positions a batch-1 engine rarely drafts (ranks 1+, depth 2+) far above the
    measured top-1 (0.25 at rank 1 beside 0.28 measured at rank 0), so the budget kept trying
    wider and deeper trees that returned half their predicted gain.
    """

    def __init__(
        self,
        depth: int,
        topk: int,
        prior_top1: float = 0.5,
        prior_decay: float = 0.5,
        prior_weight: float = 2.0,
    ) -> None:
        self.depth, self.topk = depth, topk
        self.prior_top1, self.prior_decay, self.prior_weight = prior_top1, prior_decay, prior_weight
        self.trials = np.zeros((depth, topk))
        self.accepts = np.zeros((depth, topk))

    def update(self, trials: np.ndarray, accepts: np.ndarray) -> None:
        """Replace the counts with the engine's discounted sums, each [depth, topk]."""
        self.trials = np.asarray(trials, dtype=np.float64)[: self.depth, : self.topk]
        accepts = np.asarray(accepts, dtype=np.float64)[: self.depth, : self.topk]
        self.accepts = np.minimum(accepts, self.trials)

    def decay(self, factor: float) -> None:
        """Discount the counts by ``factor`` (towards the prior)."""
        self.trials = self.trials * factor
        self.accepts = self.accepts * factor

    @property
    def p(self) -> np.ndarray:
        """[depth, topk] conditional acceptance probabilities."""
        w = self.prior_weight
        denominator = self.trials + w
        out = np.empty((self.depth, self.topk))
        prior = self.prior_top1
        for d in range(self.depth):  # rank 0, level by level
            prior = out[d, 0] = (self.accepts[d, 0] + w * prior) / denominator[d, 0]
        for r in range(1, self.topk):  # then each rank from the one above, all levels at once
            out[:, r] = (self.accepts[:, r] + w * self.prior_decay * out[:, r - 1]) / denominator[:, r]
        return out


class AcceptanceTable:
    """The device table of acceptance and its host copy, for one drafter of ``depth`` x ``topk``.

    stats: [depth, 2 * topk + 2] float32 on the device: trials | accepts per (depth, rank), then
    per depth the summed exp(value) of verified nodes and their accepted count. model: the
    :class:`AcceptanceModel` read from the last host copy. accepted: [] float32 on the device,
    the drafts the last verification accepted, every kind (head and lookup); ``last_accepted``
    its value in the last host copy (None: no copy landed since the previous read).
    """

    def __init__(self, depth: int, topk: int, device: torch.device) -> None:
        self.depth, self.topk = depth, topk
        self.model = AcceptanceModel(depth, topk)
        self.stats = torch.zeros(depth, 2 * topk + 2, device=device)
        self.accepted = torch.zeros((), device=device)
        # One host buffer for both: the stats, then the accepted count.
        self._host = torch.zeros(self.stats.numel() + 1, pin_memory=device.type == "cuda")
        self._copied = False
        self.last_accepted: float | None = None

    def record(
        self,
        parents: torch.Tensor,
        depths: torch.Tensor,
        ranks: torch.Tensor,
        values: torch.Tensor,
        known: torch.Tensor,
        accepted_nodes: torch.Tensor,
    ) -> None:
        """Add one verification to the device table (no host reads).

        parents / depths / ranks: [B, N] int64 of the verified trees; values: [B, N] float path
        log-probabilities; known: [B, N] bool, the nodes whose tree position is known (drafts of
        this drafter, not padding); accepted_nodes: [B, N] int64, the accepted path, -1 padded.
        """
        accepted, parent_ok = accepted_and_reached(parents, accepted_nodes)
        # A known node's parent is known too (a lookup node never has a head node below it).
        accepted, parent_ok = accepted & known, parent_ok & known
        depth0 = (depths - 1).clamp(0, self.depth - 1)
        cell = depth0 * self.stats.shape[1] + ranks.clamp(0, self.topk - 1)
        stats = self.stats.view(-1)
        stats.index_add_(0, cell.flatten(), parent_ok.flatten().float())
        stats.index_add_(0, (cell + self.topk).flatten(), accepted.flatten().float())
        row = depth0 * self.stats.shape[1] + 2 * self.topk
        stats.index_add_(0, row.flatten(), (values.float().exp() * known).flatten())
        stats.index_add_(0, (row + 1).flatten(), accepted.flatten().float())

    def copy_to_host(self) -> None:
        """Start the table's copy to the host; it lands with the drafter's next host sync."""
        self._host[:-1].view_as(self.stats).copy_(self.stats, non_blocking=True)
        self._host[-1:].copy_(self.accepted.view(1), non_blocking=True)
        self._copied = True

    def read_host_copy(self) -> None:
        """After the drafter's host sync: the model takes the copied counts."""
        self.last_accepted = None
        if self._copied:
            host = self._host[:-1].view(self.stats.shape).numpy()
            self.model.update(host[:, : self.topk], host[:, self.topk : 2 * self.topk])
            self.last_accepted = float(self._host[-1])
            self._copied = False

    def correction(self) -> torch.Tensor:
        """[depth + 1] device: observed acceptance per unit of exp(path value), by depth (0 unused)."""
        mass, accepted = self.stats[:, 2 * self.topk], self.stats[:, 2 * self.topk + 1]
        return torch.cat([mass.new_ones(1), (accepted + 1.0) / (mass + 1.0)])

    def decay(self) -> None:
        """Once per step: the device table and its host model forget alike (a copy that landed this
        step was taken before this)."""
        self.stats.mul_(DISCOUNT)
        self.model.decay(DISCOUNT)
