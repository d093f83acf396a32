"""EAGLE-2 draft-tree construction, batched over requests, engine-independent.

Every request grows its own tree from the draft head's log-probabilities (the top-k of
each node's log-softmax, taken straight from the head's logits by
:func:`vllm_eagle2.kernels.vocab_topk`):

* level 1 = the ``topk`` most likely children of the root (the last verified token);
* every further level expands the current frontier (``topk`` nodes per request): each
  frontier node proposes its ``topk`` most likely children, a child's *value* is its
  parent's value plus its own log-probability (the log of the product of draft
  confidences along the path), all ``topk**2`` children join the candidate pool and the
  next frontier is the *global* top-``topk`` of them;
* after ``depth`` levels the whole pool (``topk + (depth - 1) * topk**2`` nodes) is
  reranked and the ``num_nodes`` best nodes are kept, best first: every prefix of the
  result is the best tree of its size, so a budget can cut it anywhere.

Ties always go to the node drafted first (shallower, then higher-ranked), which keeps
the kept set ancestor-closed even for probability-1 children: a child's value never
exceeds its parent's, and the parent comes first in the pool.

The only Python loop is over tree levels; each row of the batch grows its own tree. No
step reads tensor data on the host and every shape follows from the arguments, so the
build can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from vllm_eagle2.graft import LookupChains, graft_chains
from vllm_eagle2.kernels import vocab_topk
from vllm_eagle2.tree_ablations import OWN_KEYS, ablation_key, frontiers_first, static_rank_logp

__all__ = [
    "TREE_MODES",
    "DraftStep",
    "DraftTree",
    "build_dynamic_tree",
    "lookup_chain_tree",
    "off_leading_chain",
    "pool_size",
    "tree_size",
]

#: Tree-shape policies. ``dynamic`` is EAGLE-2; the others are baselines and the paper's
#: ablations, behind the same interface so one benchmark can compare them.
TREE_MODES: tuple[str, ...] = ("dynamic", "static", "chain", "no_value", "no_rerank")

#: ``draft_step(tokens, prev_slots, level) -> logits``.
#: ``tokens`` [B, K] int64 is the frontier to expand (K = topk, or 1 in ``chain`` mode);
#: ``prev_slots`` [B, K] int64 names, for each frontier node, the slot (0..K-1) of its
#: parent in the previous call's ``tokens`` (all zeros on the first call, whose frontier
#: is level 1 and whose parent is the root); ``level`` is the depth of the children being
#: produced (2..depth). Returns the draft's logits [B, K, V] (any float dtype, unnormalised;
#: log-probs work too) of those children; only their top-``K`` log-softmax is ever formed.
DraftStep = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class DraftTree:
    """One draft tree per request, nodes best first (by the mode's key; ties to the node
    drafted first), so parents precede children and every prefix is a tree.

    tokens:  [B, N] int64, the drafted token of each node.
    parents: [B, N] int64, -1 = child of the root, else the index (< own index) of the parent.
    depths:  [B, N] int64, 1 = child of the root.
    ranks:   [B, N] int64, the node's rank (0 = likeliest) among its parent's drafted children.
    scores:  [B, N] float32, the node's value: draft log-probability of its whole path (a
             grafted node's: its chain's estimated log-probability of acceptance).
    grafted: [B, N] bool, nodes from lookup chains that the head did not draft (their rank
             is 0; :mod:`vllm_eagle2.graft`); None when no chains were given.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor
    scores: torch.Tensor
    grafted: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def off_leading_chain(depths: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: the nodes off each tree's leading chain.

    depths: [B, N] int64 (:attr:`DraftTree.depths`; 0 = padding, never off the chain). Node j is
    on the leading chain when its ancestors are exactly nodes 0..j-1, that is when it is j + 1
    deep (parents precede children). Flattened after the root, such a node's causal attention
    is exactly its tree attention: only the nodes off the chain need a tree mask.
    """
    col = torch.arange(depths.shape[1], device=depths.device)
    return (depths > 0) & (depths != col + 1)


def pool_size(depth: int, topk: int) -> int:
    """Number of nodes drafted by ``depth`` levels of top-``topk`` expansion."""
    return topk + (depth - 1) * topk * topk


def tree_size(mode: str, depth: int, topk: int, num_nodes: int) -> int:
    """Number of nodes ``build_dynamic_tree`` returns per request for these settings."""
    if mode == "chain":
        return min(depth, num_nodes)
    return num_nodes


def validate_tree_args(
    mode: str, depth: int, topk: int, num_nodes: int, names: dict[str, str] | None = None
) -> None:
    """Raise ValueError naming the first bad argument (no tensors needed).

    names: how the message names each argument (``mode``, ``depth``, ``topk``, ``num_nodes``),
    e.g. as the speculative_config field a user set.
    """
    name = {"mode": "mode", "depth": "depth", "topk": "topk", "num_nodes": "num_nodes", **(names or {})}
    if mode not in TREE_MODES:
        raise ValueError(f"{name['mode']} must be one of {', '.join(TREE_MODES)}; got {mode!r}")
    for arg, value in (("depth", depth), ("topk", topk), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name[arg]} must be an integer >= 1; got {value!r}")
    pool = pool_size(depth, topk)
    if mode != "chain" and num_nodes > pool:
        raise ValueError(
            f"{name['num_nodes']} must be in [1, {pool}] (the tree pool topk + (depth-1)*topk^2 "
            f"for depth={depth}, topk={topk}); got {num_nodes}"
        )


def build_dynamic_tree(
    root_logits: torch.Tensor,
    draft_step: DraftStep,
    *,
    depth: int,
    topk: int,
    num_nodes: int,
    mode: str = "dynamic",
    token_ids: Callable[[torch.Tensor], torch.Tensor] | None = None,
    lookup: LookupChains | None = None,
) -> DraftTree:
    """Grow one draft tree per request and keep its best ``num_nodes`` nodes.

    Sync-free and fixed-shape (no host reads of tensor data, every shape follows from the
    arguments), so a whole call can be captured in a CUDA graph with its ``draft_step``.
    Each level costs one :func:`~vllm_eagle2.kernels.vocab_topk` over its ``[B*K, V]``
    logits plus a handful of small ops on ``[B, topk**2]`` tensors.

    Args:
        root_logits: [B, V] float (any float dtype), unnormalised draft logits of the
            root's children (log-probs work too: the log-softmax is idempotent). NaN and
            +inf count as -inf.
        draft_step: see :data:`DraftStep`; called ``depth - 1`` times (fewer in
            ``chain`` mode when ``num_nodes < depth``).
        depth: number of draft levels (>= 1).
        topk: children per expanded node and frontier width (>= 1, <= V).
        num_nodes: nodes kept per request (the paper's m), <= ``pool_size(depth, topk)``.
        mode: one of :data:`TREE_MODES`:
            ``dynamic``   EAGLE-2: expand and rerank by path value;
            ``static``    EAGLE-1's context-independent shape of the same size (same
                          expansion run on fixed rank priors instead of confidences);
            ``chain``     the top-1 path, ``min(depth, num_nodes)`` nodes;
            ``no_value``  rank by the node's own confidence instead of the path value
                          (capped by its parent's key so the kept set stays a tree);
            ``no_rerank`` keep the nodes chosen as frontiers during expansion, in level
                          order, instead of the global best of the pool.
        token_ids: maps the head's vocabulary positions [B, n] (a draft vocabulary) to token
            ids; the tree's tokens are then token ids. None: positions are token ids.
        lookup: chains grafted into the pool before the rerank (:mod:`vllm_eagle2.graft`),
            ``dynamic`` mode only; their nodes compete with the head's for the ``num_nodes``.

    Returns:
        :class:`DraftTree` with N = ``tree_size(mode, depth, topk, num_nodes)`` nodes.
    """
    depth, topk, num_nodes = _checked_shape(root_logits, mode, depth, topk, num_nodes)
    if lookup is not None and mode != "dynamic":
        raise ValueError(f"lookup chains are grafted in dynamic mode only; got mode {mode!r}")
    pool, chosen = _expand(root_logits, draft_step, depth, topk, mode)
    if mode == "no_rerank":
        pool = replace(pool, keys=frontiers_first(pool.keys, chosen, topk))
    if lookup is not None:
        # Chains are token ids: the pool's tokens become ids before the graft, not after the keep.
        pool = _grafted(pool if token_ids is None else replace(pool, tokens=token_ids(pool.tokens)), lookup)
        token_ids = None
    tree = _keep_best(pool, num_nodes)
    return tree if token_ids is None else replace(tree, tokens=token_ids(tree.tokens))


def lookup_chain_tree(chains: LookupChains, num_nodes: int) -> DraftTree:
    """The first ``num_nodes`` nodes of each request's lookup chain alone, as a tree.

    For a step whose head drafts nothing: a chain is a tree of width 1 whose nodes are all
    grafted, valued by the chain (its estimated log-probability of acceptance; -inf past its end,
    where the token is -1).
    """
    tokens = chains.tokens[:, :num_nodes]
    batch, n = tokens.shape
    col = torch.arange(n, device=tokens.device).expand(batch, n)
    return DraftTree(
        tokens=tokens,
        parents=col - 1,
        depths=col + 1,
        ranks=torch.zeros_like(tokens),
        scores=chains.values[:, :num_nodes].float(),
        grafted=tokens >= 0,
    )


@dataclass(frozen=True)
class _Pool:
    """Every node drafted (P of them per request), in pool order: level 1 = the root's k children
    at 0..k-1; level L >= 2 = k*k nodes at ``k + (L-2)*k*k + j``, child ``j % k`` (in rank order)
    of frontier slot ``j // k`` of level L-1; then any grafted nodes.

    tokens: [B, P] int64; values: [B, P] float path values (a grafted node's: its capped chain
    value); keys: [B, P] the rerank keys (the values, but in the ablation modes and where a chain
    raised them); parents: [B, P] int64 pool index, -1 = the root; depths / ranks: [B, P] int64
    (may be expanded views); grafted: [B, P] bool or None (no chains).
    """

    tokens: torch.Tensor
    values: torch.Tensor
    keys: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor
    grafted: torch.Tensor | None = None


def _expand(
    root_logits: torch.Tensor, draft_step: DraftStep, depth: int, k: int, mode: str
) -> tuple[_Pool, list[torch.Tensor]]:
    """Draft ``depth`` levels of top-``k`` expansion. Returns the pool and the frontier slots chosen
    at levels 2.. ([B, k] each, in 0..k*k-1; the last level's too in ``no_rerank`` mode)."""
    batch, vocab = root_logits.shape
    device = root_logits.device
    kk = k * k
    # Level lists are concatenated once at the end instead of written per level.
    logp, tokens = vocab_topk(root_logits, k)  # [B, k], sorted descending
    prior = static_rank_logp(k, device) if mode == "static" else None
    # The root's key is 0: static keys are the rank priors; no_value's cap by it is a no-op.
    key = logp if prior is None else prior.expand(batch, k)
    level_tokens, level_values, level_keys = [tokens], [logp], [key]
    chosen_per_level: list[torch.Tensor] = []
    frontier_tokens, frontier_value, frontier_key = tokens, logp, key
    prev_slots = torch.zeros(batch, k, dtype=torch.long, device=device)
    for level in range(2, depth + 1):
        child_logits = draft_step(frontier_tokens, prev_slots, level)
        if child_logits.shape != (batch, k, vocab):
            raise ValueError(
                f"draft_step must return logits of shape {(batch, k, vocab)} at level {level}; "
                f"got {tuple(child_logits.shape)}"
            )
        logp, tokens = vocab_topk(child_logits.reshape(batch * k, vocab), k)  # [B*k, k]
        logp = logp.view(batch, k, k)
        value = (frontier_value.unsqueeze(-1) + logp).view(batch, kk)
        key = value if mode not in OWN_KEYS else ablation_key(mode, frontier_key, logp, prior)
        tokens = tokens.view(batch, kk)
        level_tokens.append(tokens)
        level_values.append(value)
        level_keys.append(key)
        if level == depth and mode != "no_rerank":
            break
        chosen = _stable_topk(key, k)  # [B, k] in 0..k*k-1
        chosen_per_level.append(chosen)
        if level == depth:
            break
        prev_slots = chosen.div(k, rounding_mode="floor")
        frontier_tokens = tokens.gather(1, chosen)
        frontier_value = value.gather(1, chosen)
        frontier_key = key.gather(1, chosen) if mode in OWN_KEYS else frontier_value

    values = _cat(level_values)
    pool = values.shape[1]
    index = torch.arange(pool, device=device)
    frontier1 = _frontier1(chosen_per_level[: depth - 2], k, batch, device)
    parents = frontier1[:, index.div(k, rounding_mode="floor")]
    return _Pool(
        tokens=_cat(level_tokens),
        values=values,
        keys=_cat(level_keys) if mode in OWN_KEYS else values,
        parents=parents - 1,
        # Pool index p is at depth 1 if p < k, else 2 + (p - k) // k^2; one formula for both.
        depths=((index + (kk - k)).div(kk, rounding_mode="floor") + 1).expand(batch, pool),
        # Level 1 is the root's k children in rank order, later levels k children per frontier
        # slot; (p - k) mod k (a non-negative remainder) is the rank for both.
        ranks=(index - k).remainder(k).expand(batch, pool),
    ), chosen_per_level


def _keep_best(pool: _Pool, num_nodes: int) -> DraftTree:
    """The best ``num_nodes`` nodes of ``pool`` by key, best first, as a :class:`DraftTree`.

    A child's key never exceeds its parent's and ties go to the lower pool index, which the
    parent always has: the order is parents-first and each prefix is ancestor-closed.
    """
    kept = _stable_topk(pool.keys, num_nodes)  # [B, N] pool indices
    return DraftTree(
        tokens=pool.tokens.gather(1, kept),
        parents=_positions_in(kept, pool.parents.gather(1, kept) + 1, pool.tokens.shape[1]),
        depths=pool.depths.gather(1, kept),
        ranks=pool.ranks.gather(1, kept),
        scores=pool.values.gather(1, kept),
        grafted=None if pool.grafted is None else pool.grafted.gather(1, kept),
    )


def _grafted(pool: _Pool, chains: LookupChains) -> _Pool:
    """``pool`` with ``chains`` grafted in (:func:`vllm_eagle2.graft.graft_chains`): L new nodes
    per request after the P drafted ones, rank 0, valued by their capped chain values."""
    grafted = graft_chains(pool.tokens, pool.keys, pool.parents, pool.depths, chains)
    drafted = pool.tokens.shape[1]
    return _Pool(
        tokens=grafted.tokens,
        values=torch.cat([pool.values.float(), grafted.keys[:, drafted:]], 1),
        keys=grafted.keys,
        parents=grafted.parents,
        depths=grafted.depths,
        ranks=torch.cat([pool.ranks, pool.ranks.new_zeros(()).expand_as(grafted.keys[:, drafted:])], 1),
        grafted=grafted.grafted,
    )


def _stable_topk(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [B, k] of the k largest keys per row; ties go to the lower index."""
    return torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :k]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _positions_in(kept: torch.Tensor, parent1: torch.Tensor, pool: int) -> torch.Tensor:
    """[B, N] positions in ``kept`` ([B, N] pool indices) of the pool nodes ``parent1`` ([B, N]
    pool indices shifted by one, 0 = the root); -1 for the root and for nodes not kept."""
    batch, num_nodes = kept.shape
    # position1[b, p + 1] = position of pool node p in kept, or -1 (root and dropped nodes).
    position1 = torch.full((batch, pool + 1), -1, dtype=torch.long, device=kept.device)
    position1.scatter_(1, kept + 1, torch.arange(num_nodes, device=kept.device).expand(batch, num_nodes))
    return position1.gather(1, parent1)


def _checked_shape(
    root_logits: torch.Tensor, mode: str, depth: int, topk: int, num_nodes: int
) -> tuple[int, int, int]:
    """The arguments checked; returns (depth, topk, num_nodes) as the mode grows them (a chain
    is ``min(depth, num_nodes)`` nodes of width 1)."""
    validate_tree_args(mode, depth, topk, num_nodes)
    if root_logits.dim() != 2 or not root_logits.is_floating_point():
        raise ValueError(
            f"root_logits must be a float tensor [B, V]; got {tuple(root_logits.shape)} {root_logits.dtype}"
        )
    if mode == "chain":
        depth = min(depth, num_nodes)
        return depth, 1, depth
    if topk > root_logits.shape[1]:
        raise ValueError(f"topk must be <= the vocabulary size {root_logits.shape[1]}; got {topk}")
    return depth, topk, num_nodes


def _frontier1(
    chosen_per_level: list[torch.Tensor], k: int, batch: int, device: torch.device
) -> torch.Tensor:
    """[B, 1 + (depth-1)*k] pool indices shifted by one (root = 0) of the root and of the frontier
    nodes of levels 1..depth-1 (``chosen_per_level``: levels 2..depth-1): pool node p's shifted
    parent is entry ``p // k`` (0 for level 1, else 1 + (L-2)*k + slot // k for child slot of
    level L)."""
    kk = k * k
    frontier1 = torch.arange(k + 1, device=device).expand(batch, k + 1)  # root, level 1
    if chosen_per_level:
        # Level L >= 2 starts at pool index k + (L-2)*k*k, shifted by one.
        starts = torch.arange(k + 1, k + 1 + len(chosen_per_level) * kk, kk, device=device)
        later = (torch.stack(chosen_per_level, dim=1) + starts.unsqueeze(-1)).flatten(1)
        frontier1 = torch.cat([frontier1, later], dim=1)
    return frontier1
