"""EAGLE-2 draft-tree construction, batched over requests, engine-independent.

Every request grows its own tree from the draft head's log-probabilities:

* level 1 = the ``topk`` most likely children of the root (the last verified token);
* every further level expands the current frontier (``topk`` nodes per request): each
  frontier node proposes its ``topk`` most likely children, a child's *value* is its
  parent's value plus its own log-probability (the log of the product of draft
  confidences along the path), all ``topk**2`` children join the candidate pool and the
  next frontier is the *global* top-``topk`` of them;
* after ``depth`` levels the whole pool (``topk + (depth - 1) * topk**2`` nodes) is
  reranked and the ``num_tokens`` best nodes are kept.

Ties always go to the node drafted first (shallower, then higher-ranked), which keeps
the kept set ancestor-closed even for probability-1 children: a child's value never
exceeds its parent's, and the parent comes first in the pool.

The only Python loop is over tree levels; each row of the batch grows its own tree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "TREE_MODES",
    "DraftStep",
    "DraftTree",
    "build_dynamic_tree",
    "pool_size",
    "tree_size",
]

#: Tree-shape policies. ``dynamic`` is EAGLE-2; the others are baselines and the paper's
#: ablations, behind the same interface so one benchmark can compare them.
TREE_MODES: tuple[str, ...] = ("dynamic", "static", "chain", "no_value", "no_rerank")

#: ``draft_step(tokens, prev_slots, level) -> logprobs``.
#: ``tokens`` [B, K] int64 is the frontier to expand (K = topk, or 1 in ``chain`` mode);
#: ``prev_slots`` [B, K] int64 names, for each frontier node, the slot (0..K-1) of its
#: parent in the previous call's ``tokens`` (all zeros on the first call, whose frontier
#: is level 1 and whose parent is the root); ``level`` is the depth of the children being
#: produced (2..depth). Returns draft log-probabilities [B, K, V] of those children.
DraftStep = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]

# ``static`` mode: EAGLE-1's tree has a fixed shape chosen offline from how often the
# draft's rank-r token is accepted. We derive that fixed shape by running the same
# expansion on rank priors instead of the draft's confidences: the rank-0 child is
# accepted ~60% of the time and each lower rank ~22% as often as the one above. The
# log-priors are exact binary fractions so that paths with the same ranks in another
# order tie exactly, and the shape cannot depend on rounding.
_STATIC_TOP1_LOGP = -0.5
_STATIC_RANK_DECAY_LOGP = -1.5


@dataclass(frozen=True)
class DraftTree:
    """One draft tree per request, nodes in an order where parents precede children.

    tokens:  [B, N] int64, the drafted token of each node.
    parents: [B, N] int64, -1 = child of the root, else the index (< own index) of the parent.
    depths:  [B, N] int64, 1 = child of the root.
    scores:  [B, N] float32, the node's value: draft log-probability of its whole path.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def pool_size(depth: int, topk: int) -> int:
    """Number of nodes drafted by ``depth`` levels of top-``topk`` expansion."""
    return topk + (depth - 1) * topk * topk


def tree_size(mode: str, depth: int, topk: int, num_tokens: int) -> int:
    """Number of nodes ``build_dynamic_tree`` returns per request for these settings."""
    if mode == "chain":
        return min(depth, num_tokens)
    return num_tokens


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def validate_tree_args(mode: str, depth: int, topk: int, num_tokens: int) -> None:
    """Raise ValueError naming the first bad argument (no tensors needed)."""
    if mode not in TREE_MODES:
        raise ValueError(f"mode must be one of {', '.join(TREE_MODES)}; got {mode!r}")
    _check_positive_int("depth", depth)
    _check_positive_int("topk", topk)
    _check_positive_int("num_tokens", num_tokens)
    if mode == "chain":
        return
    pool = pool_size(depth, topk)
    if num_tokens > pool:
        raise ValueError(
            f"num_tokens must be <= the tree pool topk + (depth-1)*topk^2 = {pool} "
            f"for depth={depth}, topk={topk}; got {num_tokens}"
        )


def _topk(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values, indices) over the last dim; NaN and +inf never outrank real candidates.

    torch.topk ranks NaN and +inf highest; only when one shows up among the winners is
    the whole tensor cleaned (a full copy of [..., V] at every level would cost more than
    the top-k itself).
    """
    values, indices = logprobs.float().topk(k, dim=-1)
    if bool(torch.isnan(values).any() or torch.isposinf(values).any()):
        clean = torch.nan_to_num(logprobs.float(), nan=-math.inf, posinf=-math.inf)
        values, indices = clean.topk(k, dim=-1)
    return values, indices


def _stable_topk(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [B, k] of the k largest keys per row; ties go to the lower index."""
    return torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :k]


def build_dynamic_tree(
    root_logprobs: torch.Tensor,
    draft_step: DraftStep,
    *,
    depth: int,
    topk: int,
    num_tokens: int,
    mode: str = "dynamic",
) -> DraftTree:
    """Grow one draft tree per request and keep its best ``num_tokens`` nodes.

    Args:
        root_logprobs: [B, V] float, draft log-probabilities of the root's children.
        draft_step: see :data:`DraftStep`; called ``depth - 1`` times (fewer in
            ``chain`` mode when ``num_tokens < depth``).
        depth: number of draft levels (>= 1).
        topk: children per expanded node and frontier width (>= 1, <= V).
        num_tokens: nodes kept per request (the paper's m), <= ``pool_size(depth, topk)``.
        mode: one of :data:`TREE_MODES`:
            ``dynamic``   EAGLE-2: expand and rerank by path value;
            ``static``    EAGLE-1's context-independent shape of the same size (same
                          expansion run on fixed rank priors instead of confidences);
            ``chain``     the top-1 path, ``min(depth, num_tokens)`` nodes;
            ``no_value``  rank by the node's own confidence instead of the path value
                          (capped by its parent's key so the kept set stays a tree);
            ``no_rerank`` keep the nodes chosen as frontiers during expansion, in level
                          order, instead of the global best of the pool.

    Returns:
        :class:`DraftTree` with N = ``tree_size(mode, depth, topk, num_tokens)`` nodes.
    """
    validate_tree_args(mode, depth, topk, num_tokens)
    if root_logprobs.dim() != 2 or not root_logprobs.is_floating_point():
        raise ValueError(
            f"root_logprobs must be a float tensor [B, V]; got {tuple(root_logprobs.shape)} "
            f"{root_logprobs.dtype}"
        )
    batch, vocab = root_logprobs.shape
    if mode == "chain":
        depth, topk = min(depth, num_tokens), 1
        num_tokens = depth
    if topk > vocab:
        raise ValueError(f"topk must be <= the vocabulary size {vocab}; got {topk}")
    device = root_logprobs.device
    k = topk
    pool = pool_size(depth, k)

    pool_tokens = torch.empty(batch, pool, dtype=torch.long, device=device)
    pool_parent = torch.empty(batch, pool, dtype=torch.long, device=device)  # pool index, -1 root
    pool_value = torch.empty(batch, pool, dtype=torch.float32, device=device)
    pool_key = torch.empty(batch, pool, dtype=torch.float32, device=device)
    pool_depth = torch.empty(pool, dtype=torch.long, device=device)
    frontier_flag = torch.zeros(batch, pool, dtype=torch.bool, device=device)

    # Level 1: the root's top-k children, all of them the first frontier.
    logp, tokens = _topk(root_logprobs, k)  # [B, k], sorted descending
    rank_logp = _rank_prior(k, device).expand(batch, k)
    key = _node_key(mode, parent_key=torch.zeros_like(logp), logp=logp, rank_logp=rank_logp)
    pool_tokens[:, :k] = tokens
    pool_parent[:, :k] = -1
    pool_value[:, :k] = logp
    pool_key[:, :k] = key
    pool_depth[:k] = 1
    frontier_flag[:, :k] = True

    frontier_idx = torch.arange(k, device=device).expand(batch, k)  # pool indices
    frontier_tokens, frontier_value, frontier_key = tokens, logp, key
    prev_slots = torch.zeros(batch, k, dtype=torch.long, device=device)
    for level in range(2, depth + 1):
        child_lp = draft_step(frontier_tokens, prev_slots, level)
        if child_lp.shape != (batch, k, vocab):
            raise ValueError(
                f"draft_step must return logprobs of shape {(batch, k, vocab)} at level {level}; "
                f"got {tuple(child_lp.shape)}"
            )
        logp, tokens = _topk(child_lp, k)  # [B, k, k]
        value = (frontier_value.unsqueeze(-1) + logp).flatten(1)  # [B, k*k]
        key = _node_key(
            mode,
            parent_key=frontier_key.unsqueeze(-1),
            logp=logp,
            rank_logp=_rank_prior(k, device).expand(batch, k, k),
        ).flatten(1)
        tokens = tokens.flatten(1)
        base = k + (level - 2) * k * k
        level_slice = slice(base, base + k * k)
        parent_slot = torch.arange(k * k, device=device) // k  # which frontier node
        pool_tokens[:, level_slice] = tokens
        pool_parent[:, level_slice] = frontier_idx[:, parent_slot]
        pool_value[:, level_slice] = value
        pool_key[:, level_slice] = key
        pool_depth[level_slice] = level

        chosen = _stable_topk(key, k)  # [B, k] in 0..k*k-1
        frontier_flag[:, level_slice].scatter_(1, chosen, True)
        prev_slots = chosen // k
        frontier_idx = base + chosen
        frontier_tokens = tokens.gather(1, chosen)
        frontier_value = value.gather(1, chosen)
        frontier_key = key.gather(1, chosen)

    kept = _rerank(mode, pool_key, frontier_flag, num_tokens)  # [B, N] pool indices, ascending
    # Map pool indices to positions in the kept list so parents point inside the tree.
    position_of = torch.full((batch, pool), -1, dtype=torch.long, device=device)
    position_of.scatter_(1, kept, torch.arange(num_tokens, device=device).expand(batch, -1))
    parent_pool = pool_parent.gather(1, kept)
    parents = torch.where(parent_pool >= 0, position_of.gather(1, parent_pool.clamp(min=0)), parent_pool)
    return DraftTree(
        tokens=pool_tokens.gather(1, kept),
        parents=parents,
        depths=pool_depth[kept],
        scores=pool_value.gather(1, kept),
    )


def _rank_prior(k: int, device: torch.device) -> torch.Tensor:
    """[k] log-prior that the rank-r draft token is accepted (``static`` mode)."""
    ranks = torch.arange(k, device=device, dtype=torch.float32)
    return _STATIC_TOP1_LOGP + ranks * _STATIC_RANK_DECAY_LOGP


def _node_key(
    mode: str, *, parent_key: torch.Tensor, logp: torch.Tensor, rank_logp: torch.Tensor
) -> torch.Tensor:
    """Selection key of new nodes; never larger than the parent's key (keeps trees closed)."""
    if mode == "static":
        return parent_key + rank_logp
    if mode == "no_value":
        # Level 1 has parent_key 0 >= any log-prob, so the cap is a no-op there.
        return torch.minimum(parent_key, logp)
    return parent_key + logp


def _rerank(mode: str, pool_key: torch.Tensor, frontier_flag: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Pool indices [B, num_tokens] of the kept nodes, sorted ascending (level order)."""
    if mode == "no_rerank":
        # Frontier nodes first, in drafting order; leftover budget to the best of the rest.
        pool = pool_key.shape[1]
        order = torch.arange(pool, device=pool_key.device, dtype=torch.float64)
        key = torch.where(frontier_flag, 2.0 * pool - order, pool_key.double())
    else:
        key = pool_key
    return _stable_topk(key, num_tokens).sort(dim=-1).values
