"""The tree builder's ablation modes (:data:`vllm_eagle2.tree.TREE_MODES`): their rerank keys.

EAGLE-2 (``dynamic``) ranks every node by its path value. The paper's ablations and EAGLE-1's
static shape rank by other keys, kept here, out of the builder's way: ``static`` by fixed rank
priors, ``no_value`` by the node's own confidence, ``no_rerank`` by drafting order.
"""

from __future__ import annotations

import torch

__all__ = ["OWN_KEYS", "ablation_key", "frontiers_first", "static_rank_logp"]

# ``static`` mode: EAGLE-1's tree has a fixed shape chosen offline from how often the
# draft's rank-r token is accepted. We derive that fixed shape by running the same
# expansion on rank priors instead of the draft's confidences: the rank-0 child is
# accepted ~60% of the time and each lower rank ~22% as often as the one above. The
# log-priors are exact binary fractions so that paths with the same ranks in another
# order tie exactly, and the shape cannot depend on rounding.
_STATIC_TOP1_LOGP = -0.5
_STATIC_RANK_DECAY_LOGP = -1.5


#: Modes whose rerank key is not the path value (EAGLE-2's ablations).
OWN_KEYS = ("static", "no_value")


def ablation_key(
    mode: str, frontier_key: torch.Tensor, logp: torch.Tensor, prior: torch.Tensor | None
) -> torch.Tensor:
    """[B, k*k] a level's rerank keys in an ablation mode (``logp``: [B, k, k] the children's
    log-probabilities; ``frontier_key``: [B, k] their parents' keys; ``prior``: static's [k])."""
    batch = logp.shape[0]
    if mode == "static":
        return (frontier_key.unsqueeze(-1) + prior).view(batch, -1)
    return torch.minimum(frontier_key.unsqueeze(-1), logp).view(batch, -1)  # no_value


def frontiers_first(keys: torch.Tensor, chosen: list[torch.Tensor], k: int) -> torch.Tensor:
    """``no_rerank`` keys [B, P] float64: the nodes chosen as frontiers first, in drafting order,
    then the best of the rest (``chosen``: the frontier slots of levels 2..depth)."""
    batch, pool = keys.shape
    kk = k * k
    flags = torch.zeros(batch, pool, dtype=torch.bool, device=keys.device)
    flags[:, :k] = True  # level 1 is the first frontier
    if chosen:
        starts = torch.arange(k, k + len(chosen) * kk, kk, device=keys.device)
        flags.scatter_(1, (torch.stack(chosen, dim=1) + starts.unsqueeze(-1)).flatten(1), True)
    order = torch.arange(pool, device=keys.device, dtype=torch.float64)
    return torch.where(flags, 2.0 * pool - order, keys.double())


def static_rank_logp(k: int, device: torch.device) -> torch.Tensor:
    """[k] the static mode's rank priors ``_STATIC_TOP1_LOGP + r * _STATIC_RANK_DECAY_LOGP``, as one
    arange (exact: binary fractions); the half-step margin keeps exactly k of them."""
    return torch.arange(
        _STATIC_TOP1_LOGP,
        _STATIC_TOP1_LOGP + (k - 0.5) * _STATIC_RANK_DECAY_LOGP,
        _STATIC_RANK_DECAY_LOGP,
        device=device,
    )
