"""Lossless verification of draft trees against the target model, batched over requests.

Layout shared by every function here: a batch of B trees of N nodes (see
:class:`vllm_eagle2.tree.DraftTree`; ``tokens < 0`` marks padding nodes that can never be
accepted) and the target's output at the root and at every node, ``[B, N + 1, V]``: row 0
is the target's next-token distribution after the root, row ``i + 1`` after node ``i``.

* Greedy: the longest root-to-node path whose every token equals the target's argmax at
  its parent, plus the target's argmax after that path (the bonus token).
* Sampling: recursive rejection sampling over each accepted node's children. Draft
  proposals are deterministic (q is a point mass), so child ``x`` is accepted with
  probability ``p(x)``; on rejection ``p(x)`` is zeroed and ``p`` renormalised before the
  next sibling, and if every child is rejected the output token is drawn from what is
  left. One uniform ``u`` per level realises exactly these probabilities: sibling ``j``
  is accepted iff ``sum_{i<j} p_i <= u < sum_{i<=j} p_i``. The emitted tokens are then
  distributed exactly as sampling from the target alone.

Only loops over tree levels; every request is handled in the same tensor ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "VerifyResult",
    "apply_top_k_top_p",
    "target_probs",
    "verify_greedy",
    "verify_sampling",
    "verify_tree",
]


@dataclass(frozen=True)
class VerifyResult:
    """Per-request outcome of verification.

    accepted_nodes: [B, D] int64, accepted node indices root-side first, -1 padded
        (D = the deepest node's depth): the KV entries to keep, in order.
    num_accepted: [B] int64, number of accepted draft nodes.
    output_tokens: [B, D + 1] int64, the accepted tokens then the bonus / correction
        token, -1 padded: ``num_accepted + 1`` tokens per request.
    """

    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor
    output_tokens: torch.Tensor


def _check_tree(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, name: str) -> None:
    if tokens.dim() != 2 or parents.shape != tokens.shape:
        raise ValueError(
            f"tokens and parents must both be [B, N]; got {tuple(tokens.shape)} and {tuple(parents.shape)}"
        )
    batch, n = tokens.shape
    if target.dim() != 3 or target.shape[:2] != (batch, n + 1):
        raise ValueError(f"{name} must be [B, N + 1, V] = [{batch}, {n + 1}, V]; got {tuple(target.shape)}")


def _node_depths(parents: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Depth of every node [B, N] (1 = child of root) and the maximum depth.

    Pointer jumping: each round adds the hop length of the node's current target and
    jumps to that target's target, so log2(N) rounds reach the root from any node.
    """
    depths = torch.ones_like(parents)
    target = parents.clone()
    for _ in range(max(1, parents.shape[1]).bit_length()):
        up = target >= 0
        safe = target.clamp(min=0)
        depths = depths + torch.where(up, depths.gather(1, safe), 0)
        target = torch.where(up, target.gather(1, safe), target)
    max_depth = int(depths.max()) if depths.numel() else 0
    return depths, max_depth


def _result_from_leaf(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    max_depth: int,
    leaf: torch.Tensor,
    final_token: torch.Tensor,
) -> VerifyResult:
    """Build the result from the deepest accepted node per request (-1 = none)."""
    batch = tokens.shape[0]
    rows = torch.arange(batch, device=tokens.device)
    num_accepted = torch.where(leaf >= 0, depths[rows, leaf.clamp(min=0)], 0)
    accepted = torch.full((batch, max_depth), -1, dtype=torch.long, device=tokens.device)
    output = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=tokens.device)
    node = leaf
    for _ in range(max_depth):  # walk up from the leaf, one level per round
        valid = node >= 0
        safe = node.clamp(min=0)
        slot = (depths[rows, safe] - 1).clamp(min=0)
        accepted[rows[valid], slot[valid]] = node[valid]
        output[rows[valid], slot[valid]] = tokens[rows[valid], safe[valid]]
        node = torch.where(valid, parents[rows, safe], node)
    output[rows, num_accepted] = final_token
    return VerifyResult(accepted_nodes=accepted, num_accepted=num_accepted, output_tokens=output)


def verify_greedy(tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Greedy verification: longest path matching the target's argmax, plus the bonus token.

    Args:
        tokens: [B, N] int64 drafted tokens (< 0 = padding).
        parents: [B, N] int64, -1 = child of root, else index of the parent (< own index).
        target_logits: [B, N + 1, V] target logits (or probabilities) at root and nodes.
    """
    _check_tree(tokens, parents, target_logits, "target_logits")
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    return _walk(tokens, parents, lambda current: target_logits[rows, current + 1], uniforms=None)


def _sibling_candidates(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: real nodes whose token no earlier sibling already carries."""
    n = tokens.shape[1]
    valid = tokens >= 0
    same_parent = parents.unsqueeze(2) == parents.unsqueeze(1)
    same_token = tokens.unsqueeze(2) == tokens.unsqueeze(1)
    earlier = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril(-1)
    duplicate = (same_parent & same_token & earlier & valid.unsqueeze(1)).any(dim=2)
    return valid & ~duplicate


def _walk(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    row_at: Callable[[torch.Tensor], torch.Tensor],
    *,
    uniforms: torch.Tensor | None,
) -> VerifyResult:
    """Walk every tree from the root, one level per round, reading only visited rows.

    row_at(current [B], -1 = root) returns the target's row [B, V] at those nodes:
    logits for greedy walks (``uniforms`` None), probabilities for sampled walks, which
    use ``uniforms`` [B, D + 1]: one per level, the last one for the final token.
    """
    batch = tokens.shape[0]
    device = tokens.device
    depths, max_depth = _node_depths(parents)
    candidate = _sibling_candidates(tokens, parents)
    safe_tokens = tokens.clamp(min=0)
    current = torch.full((batch,), -1, dtype=torch.long, device=device)  # -1 = root
    active = torch.ones(batch, dtype=torch.bool, device=device)
    final = torch.zeros(batch, dtype=torch.long, device=device)
    for level in range(max_depth + 1):  # a node at max_depth has no children: all stop
        row = row_at(current)
        children = candidate & (parents == current.unsqueeze(1)) & active.unsqueeze(1)
        if uniforms is None:
            choice = row.argmax(dim=1)
            hit = children & (tokens == choice.unsqueeze(1))
            stop_token = choice
        else:
            p_child = torch.where(children, row.float().gather(1, safe_tokens), 0.0)
            hit = children & (p_child > 0) & (uniforms[:, level : level + 1] < p_child.cumsum(dim=1))
            stop_token = _sample_residual(row, children, safe_tokens, uniforms[:, -1])
        accepted_any = hit.any(dim=1)
        final = torch.where(active & ~accepted_any, stop_token, final)
        current = torch.where(accepted_any, hit.int().argmax(dim=1), current)
        active = active & accepted_any
        if not bool(active.any()):
            break
    return _result_from_leaf(tokens, parents, depths, max_depth, current, final)


def _sample_residual(
    p: torch.Tensor, children: torch.Tensor, safe_tokens: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Sample [B] from p [B, V] with the (all rejected) children's tokens removed.

    Inverse-CDF sampling with one uniform per row: exact, and cheap next to drawing V
    exponentials. Zero-probability tokens are never chosen.
    """
    p = p.float()
    rejected = torch.zeros_like(p).scatter_add_(1, safe_tokens, children.float())
    residual = torch.where(rejected > 0, 0.0, p)
    # Rounding can leave (almost) no mass when the children covered it: use p itself.
    residual = torch.where(residual.sum(dim=1, keepdim=True) <= 0, p, residual)
    cdf = residual.cumsum(dim=1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=p.shape[1] - 1)


def _uniforms(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    generators: dict[int, torch.Generator] | None,
    default: torch.Generator | None,
) -> torch.Tensor:
    """Uniforms [B, D + 2]: one per level of the walk, the last one for the final token.

    A seeded request draws exactly (its own tree depth + 2) numbers from its own generator,
    whatever else (padding included) is in the batch, so its output is reproducible.
    """
    depths, max_depth = _node_depths(parents)
    u = torch.rand((parents.shape[0], max_depth + 2), device=parents.device, generator=default)
    if generators:
        real = torch.where(tokens >= 0, depths, 0)
        row_depth = real.amax(dim=1).tolist() if real.numel() else [0] * parents.shape[0]
        for row, gen in generators.items():
            draws = torch.rand(row_depth[row] + 2, device=parents.device, generator=gen)
            u[row, : row_depth[row] + 1] = draws[:-1]
            u[row, -1] = draws[-1]
    return u


def verify_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    generators: dict[int, torch.Generator] | None = None,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Lossless recursive rejection sampling over each request's tree.

    Args:
        tokens: [B, N] int64 drafted tokens (< 0 = padding).
        parents: [B, N] int64, -1 = child of root, else index of the parent.
        target_probs: [B, N + 1, V] target probabilities at the root and every node,
            after temperature / top-k / top-p (rows sum to 1).
        generators: optional per-row generators (row index -> generator) for seeded
            requests; other rows draw from ``generator`` (or torch's global one).
    """
    _check_tree(tokens, parents, target_probs, "target_probs")
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    u = _uniforms(tokens, parents, generators, generator)
    return _walk(tokens, parents, lambda current: target_probs[rows, current + 1], uniforms=u)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits [B, R, V] outside each row's top-k / top-p set with -inf.

    top_k: [B] int64 (>= vocabulary size or <= 0 = off); top_p: [B] float (1 = off).
    Same rule as vLLM's sampler: top-k keeps ties at the threshold, top-p drops the
    lowest tokens whose cumulative probability stays <= 1 - p, and always keeps one.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k).clamp(max=vocab).long()
        threshold = sorted_logits.gather(-1, (vocab - k).view(-1, 1, 1).expand(*logits.shape[:-1], 1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, -torch.inf)
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p.view(-1, 1, 1)
        drop[..., -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Target distribution [B, R, V] from logits [B, R, V] after temperature [B] (> 0)."""
    scaled = logits.float() / temperature.float().view(-1, 1, 1)
    return apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)


def verify_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> VerifyResult:
    """Verify a batch mixing greedy (temperature 0) and sampled requests.

    temperature/top_k/top_p: [B] per-request settings; ``temperature`` None or <= 0
    (per row) = greedy. ``generators`` as in :func:`verify_sampling`.
    """
    greedy = verify_greedy(tokens, parents, target_logits)
    if temperature is None:
        return greedy
    sampled_rows = (temperature > 0).nonzero().squeeze(1)
    if sampled_rows.numel() == 0:
        return greedy
    row_of = {int(r): i for i, r in enumerate(sampled_rows.tolist())}
    sub_logits = target_logits[sampled_rows]
    sub_rows = torch.arange(sampled_rows.numel(), device=tokens.device)
    sub_temperature = temperature[sampled_rows]
    sub_top_k = None if top_k is None else top_k[sampled_rows]
    sub_top_p = None if top_p is None else top_p[sampled_rows]

    def probs_at(current: torch.Tensor) -> torch.Tensor:
        # Only the rows the walk visits are turned into probabilities (<= depth + 1 of N + 1).
        row = sub_logits[sub_rows, current + 1].unsqueeze(1)
        return target_probs(row, sub_temperature, sub_top_k, sub_top_p).squeeze(1)

    sub_tokens, sub_parents = tokens[sampled_rows], parents[sampled_rows]
    gens = {row_of[r]: g for r, g in (generators or {}).items() if r in row_of}
    u = _uniforms(sub_tokens, sub_parents, gens, None)
    sampled = _walk(sub_tokens, sub_parents, probs_at, uniforms=u)
    merged = []
    for full, part in zip(
        (greedy.accepted_nodes, greedy.num_accepted, greedy.output_tokens),
        (sampled.accepted_nodes, sampled.num_accepted, sampled.output_tokens),
    ):
        full = full.clone()
        if full.dim() == 2:  # the sampled rows' trees may be shallower: pad with -1
            part = torch.nn.functional.pad(part, (0, full.shape[1] - part.shape[1]), value=-1)
        full[sampled_rows] = part
        merged.append(full)
    return VerifyResult(*merged)
