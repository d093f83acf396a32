"""Lookup chains grafted into a draft-tree pool, so that their nodes compete for the same top-m.

A request's lookup chain (:mod:`vllm_eagle2.lookup`) is a guess at its next tokens, each with an
estimated log-probability of being accepted along the chain. Grafting walks the chain down the
pool from the root: while the chain's token is a drafted child of the node reached, the chain
follows it (the node's key rises to the chain's value where that is higher); the first token that
is not becomes a new node under the node reached, and the rest of the chain hangs below it. So a
lookup branch starts at the root or at any drafted node whose path it matches, and no node ever
has two children with the same token (the verifier's siblings stay distinct).

Keys stay a tree order: a new node's key is capped by its parent's, a raised key never exceeds
its parent's raised key (chain values do not increase along the chain), and new nodes come after
every pool node, so a stable top-m keeps an ancestor-closed, parents-first set.

Batched and fixed-shape: one loop over the chain's positions (like the tree's levels), no host
reads. A pool operation only: :mod:`vllm_eagle2.tree` keeps the best of the grafted pool, as of any.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GraftedPool", "LookupChains", "graft_chains"]


@dataclass(frozen=True)
class LookupChains:
    """One lookup chain per request.

    tokens: [B, L] int64 token ids of the chain, -1 past its end (a chain may be empty).
    values: [B, L] float32, the estimated log-probability that the chain is accepted through
        position i; non-increasing along the chain, -inf past its end.
    """

    tokens: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class GraftedPool:
    """The pool with the chains grafted: P pool nodes, then L new nodes per request.

    tokens: [B, P + L] int64 token ids, -1 for a chain position that added no node.
    keys: [B, P + L] float32 rerank keys (pool keys raised where a chain passes).
    parents: [B, P + L] int64 parent's index in this pool, -1 = the root.
    depths: [B, P + L] int64, 1 = child of the root.
    grafted: [B, P + L] bool, the new nodes (tokens the head did not draft).
    """

    tokens: torch.Tensor
    keys: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    grafted: torch.Tensor


def graft_chains(
    tokens: torch.Tensor,
    keys: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    chains: LookupChains,
) -> GraftedPool:
    """Graft ``chains`` into a pool.

    Args:
        tokens: [B, P] int64 token ids of the pool's nodes (distinct among siblings).
        keys: [B, P] float rerank keys, a child's never above its parent's.
        parents: [B, P] int64 parent index in the pool (< own index), -1 = the root.
        depths: [B, P] int64, 1 = child of the root.
        chains: the requests' chains (L positions each).
    """
    batch, pool = tokens.shape
    length = chains.tokens.shape[1]
    device = tokens.device
    keys = keys.float().clone()
    new_tokens = torch.full((batch, length), -1, dtype=torch.long, device=device)
    new_keys = torch.full((batch, length), float("-inf"), device=device)
    new_parents = torch.full((batch, length), -1, dtype=torch.long, device=device)
    at = torch.full((batch,), -1, dtype=torch.long, device=device)  # node reached, -1 = root
    at_key = torch.zeros(batch, device=device)  # its key (the root's: log 1)
    rows = torch.arange(batch, device=device)
    for i in range(length):
        token, value = chains.tokens[:, i], chains.values[:, i].float()
        valid = token >= 0
        # [B, P], at most one; none once the chain has left the pool (new nodes have no pool children)
        child = (parents == at.unsqueeze(1)) & (tokens == token.unsqueeze(1))
        found = child.any(1) & valid
        hit = child.int().argmax(1)
        raised = torch.maximum(keys[rows, hit], value)
        keys[rows, hit] = torch.where(found, raised, keys[rows, hit])
        added = valid & ~found
        key = torch.minimum(value, at_key)
        new_tokens[:, i] = torch.where(added, token, -1)
        new_keys[:, i] = torch.where(added, key, float("-inf"))
        new_parents[:, i] = at
        at = torch.where(found, hit, pool + i)
        at_key = torch.where(found, raised, key)
    position = torch.arange(1, length + 1, device=device).expand(batch, length)
    return GraftedPool(
        tokens=torch.cat([tokens, new_tokens], 1),
        keys=torch.cat([keys, new_keys], 1),
        parents=torch.cat([parents, new_parents], 1),
        depths=torch.cat([depths, position], 1),
        grafted=torch.cat([torch.zeros_like(tokens, dtype=torch.bool), new_tokens >= 0], 1),
    )
