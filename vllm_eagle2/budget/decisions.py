"""How many tree nodes each step verifies: cost curves, acceptance statistics, the chooser.

No vLLM here. Speculation pays only while verified tokens are cheap, and what a token costs
depends on the batch: at batch 1 the target reads its weights once for a few tokens, in a
full batch every extra node costs real compute. Each step therefore takes two decisions,
both maximising expected tokens per second of the next step:

* before drafting, on the host, :func:`plan_draft` picks the draft's shape (depth, topk)
  and the nodes per request it pays to verify, or no drafts at all, from the batch size,
  the :class:`~vllm_eagle2.budget.costs.CostCurve` of the target and of one draft level, and the
  :class:`~vllm_eagle2.budget.acceptance.AcceptanceModel` (acceptance per depth and sibling rank);
* after drafting, on the device, :func:`allocate_nodes` splits one budget across the batch
  in order of calibrated path value (EAGLE-2's own ordering, corrected per depth by the
  acceptance the engine observed): confident trees get more nodes, doubtful ones fewer.

Both are pure functions of their arguments; :mod:`vllm_eagle2.budget.adaptive` feeds them
measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_eagle2.budget.costs import Cost
from vllm_eagle2.tree import pool_size

__all__ = [
    "DraftPlan",
    "NO_DRAFTS",
    "allocate_nodes",
    "chains_alone_pay",
    "draft_seconds",
    "plan_draft",
    "step_cost",
]


@dataclass(frozen=True)
class DraftPlan:
    """One step's draft: ``depth`` levels of ``topk``, ``num_nodes`` nodes kept per request.

    ``num_nodes == 0``: no drafts this step (depth and topk are then 0 too).
    ``rate``: the tokens per second the plan expects; ``per_request``: the nodes per request
    the plan was sized for (``num_nodes`` may be larger, to leave the allocation room);
    ``gain``: the accepted drafts per request it expects.
    """

    depth: int
    topk: int
    num_nodes: int
    per_request: int
    rate: float
    gain: float = 0.0

    @property
    def drafts(self) -> bool:
        return self.num_nodes > 0


#: The plan of a step without drafts (its ``rate`` unpriced).
NO_DRAFTS = DraftPlan(0, 0, 0, 0, 0.0)


def fit_level_rows(plan: DraftPlan, batch: int, max_rows: int) -> DraftPlan:
    """``plan`` narrowed so that one draft level of ``batch`` requests, ``batch * topk`` rows, fits
    the head's ``max_rows`` (vLLM's ``max_num_batched_tokens``: its input buffers, slot mapping and
    compiled sizes). At vLLM's GPU defaults (8,192 tokens) topk 10 overflows past 819 requests.
    """
    topk = min(plan.topk, max(1, max_rows // max(batch, 1)))
    if topk == plan.topk:
        return plan
    pool = pool_size(plan.depth, topk)
    return DraftPlan(
        depth=plan.depth,
        topk=topk,
        num_nodes=min(plan.num_nodes, pool),
        per_request=min(plan.per_request, pool),
        rate=plan.rate,
        gain=plan.gain,
    )


def plan_draft(
    batch: int,
    *,
    max_depth: int,
    max_topk: int,
    max_nodes: int,
    acceptance: np.ndarray,
    target: Cost,
    level: Cost,
    overhead: float,
    chain_only: bool = False,
    verify: Cost | None = None,
    draft_overhead: float | None = None,
    sent: float | None = None,
) -> DraftPlan:
    """The draft shape and size that maximise the next step's expected tokens per second.

    A plan of shape (d, k) with n nodes per request is expected to yield
    ``batch * (1 + E[d, k, n])`` tokens (E: the summed path values of the n best nodes) in
    ``verify(batch * (1 + n)) + level(batch) + (d - 1) * level(batch * k) + draft_overhead``
    seconds: verification of every node, the root level and ``d - 1`` expansion levels of
    the draft, and the fixed costs of a step that drafts; no drafts yield ``batch`` tokens in
    ``target(batch) + overhead`` (:func:`step_cost`). Every d <= ``max_depth``,
    k <= ``max_topk`` (k = 1 only when ``chain_only``) and n <= ``max_nodes`` is considered;
    of equal rates the smallest k, then d, then n wins.

    Args:
        batch: requests in the step (>= 1).
        acceptance: [>= max_depth, >= max_topk] acceptance rates
            (:attr:`~vllm_eagle2.budget.acceptance.AcceptanceModel.p`).
        target: seconds of a target pass by tokens in a step without drafts to verify;
            verify: the same in a step that verifies drafts (default ``target``); level:
            seconds of a draft level by rows.
        overhead / draft_overhead: seconds a step without / with drafts costs besides these
            passes (``draft_overhead`` defaults to ``overhead``).
        sent: drafts per request that :func:`allocate_nodes` is expected to send at most (None:
            as many as planned). A plan of n nodes is priced for the ``min(n, sent)`` best it
            sends (their gain and verification, at a fractional count) and for all of its
            drafting: the allocation keeps a node only if its own calibrated value pays for it,
            so a deep or wide shape whose extra nodes seldom do costs its levels and brings
            little more than a small one.
    """
    verify = target if verify is None else verify
    draft_overhead = overhead if draft_overhead is None else draft_overhead
    none_rate = batch / (float(target(batch)) + overhead)
    topks = np.arange(1, (1 if chain_only else max_topk) + 1)
    counts = np.arange(max_nodes + 1, dtype=np.float64)
    if sent is not None:  # n planned, min(n, sent) sent
        counts = np.minimum(counts, max(float(sent), 0.0))
    # A plan's seconds: verified + root + (d - 1) * expand + draft_overhead (summed in that order).
    verified = verify(batch * (1.0 + counts)) + float(level(batch))  # [N + 1], the root level's too
    expand = level(batch * topks)[:, None]  # [K, 1]
    best_rate, best_nodes, best_gain = _rate_shapes(
        batch, acceptance, topks, max_depth, max_nodes, counts, (verified, expand, draft_overhead), chain_only
    )
    k, d = np.unravel_index(int(np.argmax(best_rate)), best_rate.shape)
    if not best_rate[k, d] > none_rate:
        return DraftPlan(0, 0, 0, 0, none_rate)
    topk, depth = int(topks[k]), int(d) + 1
    size = min(max_nodes, pool_size(depth, topk))
    return DraftPlan(depth, topk, size, int(best_nodes[k, d]), float(best_rate[k, d]), float(best_gain[k, d]))


def _rate_shapes(
    batch: int,
    acceptance: np.ndarray,
    topks: np.ndarray,
    max_depth: int,
    max_nodes: int,
    counts: np.ndarray,
    seconds: tuple[np.ndarray, np.ndarray, float],
    chain_only: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The best rate of every shape (k, d) over its node counts, its count and its gain, each [K, D]
    (:func:`plan_draft`'s search; -inf where a chain stopped early).

    counts: [N + 1] the drafts sent at each count planned (fractional where ``sent`` caps them);
    seconds: (verified [N + 1], the verification and root level at each count; expand [K, 1], an
    expansion level for each topk; draft_overhead).
    """
    verified, expand, draft_overhead = seconds
    low = np.floor(counts).astype(np.int64)
    high, above = np.minimum(low + 1, max_nodes), counts - low
    best_rate = np.full((len(topks), max_depth), -np.inf)  # of each shape (k, d), at its best n
    best_nodes = np.zeros((len(topks), max_depth), np.int64)
    best_gain = np.zeros((len(topks), max_depth))
    # Depth by depth for every k at once, rather than growing each shape's tree on its own
    # (at the defaults 6 rounds of array work instead of 60 shapes of it). Row k - 1 holds
    # topk k: ``pool`` its best max_nodes path values so far (0 = no node) and ``level_values``
    # its last level's, both best first; ``ranked`` says which of K ranks topk k has.
    ranked = np.arange(len(topks))[None, :] < topks[:, None]  # [K, K]
    level_values = np.where(ranked, acceptance[0, : len(topks)], 0.0)  # [K, K]: level 1 is the frontier
    pool = np.zeros((len(topks), max_nodes))
    for d in range(1, max_depth + 1):
        if d > 1:
            frontier = np.where(ranked, level_values[:, : len(topks)], 0.0)
            children = np.where(ranked, acceptance[d - 1, : len(topks)], 0.0)
            level_values = -np.sort(-(frontier[:, :, None] * children[:, None, :]).reshape(len(topks), -1))
        merged = np.concatenate([pool, level_values], axis=1)
        pool = -np.sort(-merged, axis=1)[:, :max_nodes]
        gain = np.concatenate([np.zeros((len(topks), 1)), np.cumsum(pool, axis=1)], axis=1)
        gain = (1.0 - above) * gain[:, low] + above * gain[:, high]  # at the counts sent
        rate = batch * (1 + gain) / (verified + (d - 1) * expand + draft_overhead)  # [K, N + 1]
        if chain_only:  # a chain keeps all d of its nodes (d <= max_nodes: the loop stops there)
            j = np.full(1, d)
        else:
            # A tree keeps any number of nodes (the allocation may use more). Past a shape's pool
            # the gain is flat and costs never fall, so the first best n is within the pool.
            j = np.argmax(rate[:, 1:], axis=1) + 1
        best_rate[:, d - 1] = rate[np.arange(len(topks)), j]
        best_nodes[:, d - 1] = j
        best_gain[:, d - 1] = gain[np.arange(len(topks)), j]
        if chain_only and d >= max_nodes:
            break
    return best_rate, best_nodes, best_gain


def step_cost(
    plan: DraftPlan,
    batch: int,
    *,
    target: Cost,
    level: Cost,
    overhead: float,
    verify: Cost | None = None,
    draft_overhead: float | None = None,
) -> float:
    """Predicted seconds of a step of ``batch`` requests that drafts by ``plan``.

    The cost :func:`plan_draft` weighs for that plan (with ``plan.per_request`` nodes per
    request); arguments as there. Cheap (a few curve lookups): the engine re-prices a cached
    plan with it every step and plans afresh once the price has moved.
    """
    if not plan.drafts:
        return float(target(batch)) + overhead
    verify = target if verify is None else verify
    draft_overhead = overhead if draft_overhead is None else draft_overhead
    return float(verify(batch * (1 + plan.per_request))) + draft_seconds(plan, batch, level) + draft_overhead


def chains_alone_pay(
    plan: DraftPlan,
    reach: np.ndarray,
    *,
    target: Cost,
    level: Cost,
    overhead: float,
    verify: Cost | None = None,
    draft_overhead: float | None = None,
) -> bool:
    """Whether the requests' lookup chains sent alone are expected to yield more tokens per second
    than drafting ``plan`` with the head beside them (the head's levels then go unrun).

    reach: [B, L] float, the probability that each chain position is accepted (with its
    ancestors), 0 past a chain's end. Either way the allocation sends the chains' best nodes of
    the batch, as many as pay, so each side is priced at its best count of them. Beside a chain, a
    request's head tree is worth ``(1 - reach[:, 0]) * plan.gain``: where the chain's first token
    fails the head's tree stands alone, and where the chain goes on it dominates the head's nodes
    along it; that side verifies ``plan.per_request`` nodes more per request and drafts ``plan``'s
    levels. ``plan`` drafts (a plan without drafts has no levels to leave unrun). Other arguments as in
    :func:`plan_draft`.
    """
    batch = reach.shape[0]
    verify = target if verify is None else verify
    draft_overhead = overhead if draft_overhead is None else draft_overhead
    gain = np.concatenate([[0.0], np.cumsum(np.sort(reach, axis=None)[::-1])])  # by chain nodes sent
    sent = np.arange(len(gain), dtype=np.float64)
    alone = (batch + gain) / (verify(batch + sent) + draft_overhead)
    head = batch + plan.gain * float(np.sum(1.0 - reach[:, 0]))
    seconds = (
        verify(batch * (1 + plan.per_request) + sent) + draft_seconds(plan, batch, level) + draft_overhead
    )
    return float(alone.max()) >= float(((head + gain) / seconds).max())


def draft_seconds(plan: DraftPlan, batch: int, level: Cost) -> float:
    """Predicted seconds of drafting ``plan`` for ``batch`` requests: the root level (with the
    catch-up pass) over ``batch`` rows and ``depth - 1`` expansions over ``batch * topk``.

    Zero for :data:`NO_DRAFTS` (a step that sends lookup chains only): its catch-up pass is
    paid by a step without drafts too, so it lies in both kinds of step's overhead."""
    if not plan.drafts:
        return 0.0
    return float(level(batch)) + (plan.depth - 1) * float(level(batch * plan.topk))


def allocate_nodes(
    values: torch.Tensor,
    depths: torch.Tensor,
    allowed: torch.Tensor,
    correction: torch.Tensor,
    step_seconds: torch.Tensor,
    grafted: torch.Tensor | None = None,
    max_drafts: int | None = None,
) -> torch.Tensor:
    """Drafts per request [B] int64 that maximise the next step's expected tokens per second.

    Each node's expected acceptance is ``correction[depth] * exp(value)``, made
    non-increasing along each row (a node is accepted only with its ancestors). The best
    ``j`` nodes of the whole batch are kept, for the ``j`` that maximises
    ``(B + expected accepted) / step_seconds[j]``: one budget, filled in order of
    calibrated path value, so requests with confident drafts get more of it. Every row
    keeps a prefix, which :func:`vllm_eagle2.tree.build_dynamic_tree` guarantees is a tree.
    Fixed shapes and no host reads.

    ``allowed`` is a constraint, not a price: a node it rules out is never kept, whatever
    ``step_seconds`` says (priced as zero gain, it was kept wherever more verified tokens were
    priced below fewer).

    Args:
        values: [B, N] float, the nodes' path log-probabilities, best first per row.
        depths: [B, N] int64, 1 = child of the root.
        allowed: [B] bool (False = the request takes no drafts) or [B, N] bool per node (False =
            the node, and so every node after it in its row, is not sent).
        correction: [D + 1] float, accepted per unit of exp(value) at each depth (D >= max depth).
        step_seconds: [B * N + 1] float, predicted seconds of a step verifying j drafts in all.
        grafted: [B, N] bool, nodes of lookup chains, whose values are already acceptance
            estimates (no correction; they may lie deeper than the head drafts).
        max_drafts: drafts the next step can schedule in all (vLLM's token budget less one token
            per request), None = no limit. Past it the scheduler leaves requests out of the step,
            and verifies their drafts a step late, against no tree.
    """
    batch, n = values.shape
    if allowed.dim() == 1:
        allowed = allowed.unsqueeze(1).expand(batch, n)
    else:  # a row sends a prefix: a node is allowed only with every node before it
        allowed = torch.cummin(allowed.to(torch.int8), dim=1).values.bool()
    scale = correction[depths.clamp(max=correction.shape[0] - 1)]
    if grafted is not None:
        scale = torch.where(grafted, 1.0, scale)
    gain = (scale * values.float().exp()).clamp(0.0, 1.0)
    gain = torch.cummin(gain, dim=1).values
    # Ruled-out nodes sort after every allowed one, and no count reaches them.
    order = torch.sort(torch.where(allowed, gain, -1.0).flatten(), descending=True, stable=True)
    cum = torch.cat([gain.new_zeros(1), order.values.clamp(min=0.0).cumsum(0)])
    rate = (batch + cum) / step_seconds.to(cum)
    sendable = torch.arange(batch * n + 1, device=values.device) <= allowed.sum()
    if max_drafts is not None:
        sendable[max(max_drafts, 0) + 1 :] = False
    keep = torch.argmax(torch.where(sendable, rate, -torch.inf))  # the first best: ties go to fewer nodes
    rank = torch.empty_like(order.indices)
    rank[order.indices] = torch.arange(batch * n, device=values.device)
    return (rank.view(batch, n) < keep).sum(dim=1)
