"""Tree bookkeeping of verification: result type, shape checks, pointer jumping, siblings, accepted path.

Layout as in :mod:`vllm_eagle2.verify.verifier`: a batch of B trees of N nodes (``tokens`` [B, N],
``tokens < 0`` marks padding; ``parents`` [B, N], -1 = child of the root, else the parent's index,
< own index) and the target's output at the root and every node, [B, N + 1, V]. Every function
here has fixed shapes and no data-dependent host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["VerifyResult", "accepted_and_reached"]


@dataclass(frozen=True)
class VerifyResult:
    """Per-request outcome of verification, in fixed widths (N = nodes per tree).

    accepted_nodes: [B, N] int64, accepted node indices root-side first, -1 padded:
        the KV entries to keep, in order.
    num_accepted: [B] int64, number of accepted draft nodes (0..N).
    output_tokens: [B, N + 1] int64, the accepted tokens then the bonus / correction
        token, -1 padded: ``num_accepted + 1`` tokens per request.
    """

    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor
    output_tokens: torch.Tensor


def check_tree(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, name: str) -> None:
    if tokens.dim() != 2 or parents.shape != tokens.shape:
        raise ValueError(
            f"tokens and parents must both be [B, N]; got {tuple(tokens.shape)} and {tuple(parents.shape)}"
        )
    batch, n = tokens.shape
    if target.dim() != 3 or target.shape[:2] != (batch, n + 1):
        raise ValueError(f"{name} must be [B, N + 1, V] = [{batch}, {n + 1}, V]; got {tuple(target.shape)}")


def path_sums(tables: list[torch.Tensor], values: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` [B, N] over each node and all its ancestors, [B, N].

    tables: from :func:`ancestor_tables`. The root adds 0; round r adds the sums held
    2**r hops up, doubling the covered path, so ceil(log2 N) rounds reach the root.
    """
    n = values.shape[1]
    total = torch.nn.functional.pad(values, (0, 1), value=0)
    for up in tables:
        total = total + total.gather(1, up)
    return total[:, :n]


def siblings(tokens: torch.Tensor, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate children and earlier candidate siblings.

    Returns candidate [B, N] bool (real nodes whose token no earlier sibling already
    carries: only they can be accepted, a duplicate can never win after its twin was
    rejected) and before [B, N, N] bool, ``before[b, i, j]`` = j is a candidate sibling of
    i with j < i (the siblings tried before i).
    """
    n = tokens.shape[1]
    valid = tokens >= 0
    earlier = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril(-1)
    sibling_before = (parents.unsqueeze(2) == parents.unsqueeze(1)) & earlier
    duplicate = (sibling_before & (tokens.unsqueeze(2) == tokens.unsqueeze(1)) & valid.unsqueeze(1)).any(2)
    candidate = valid & ~duplicate
    return candidate, sibling_before & candidate.unsqueeze(1)


def accepted_path(
    tokens: torch.Tensor, tables: list[torch.Tensor], hit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accepted path from the per-node tests (tables: :func:`ancestor_tables`).

    hit: [B, N] bool, node i passes its own test at its parent's row (at most one child
    of any node). A node is accepted iff it and all its ancestors hit: every hit counts 1
    and every miss N + 1 along the path, so a path sum <= N means all hit and is the depth.

    Returns accepted_nodes [B, N] (-1 padded), num_accepted [B], output_tokens [B, N + 1]
    with -1 where the final token goes (position num_accepted), and leaf_row [B]: the
    target row after the accepted path (0 = root, i + 1 = node i).
    """
    batch, n = tokens.shape
    weight = torch.where(hit, 1, n + 1)
    depth = path_sums(tables, weight)
    accepted = depth <= n
    depth = torch.where(accepted, depth, 0)
    num_accepted, leaf = depth.max(dim=1)
    leaf_row = torch.where(num_accepted > 0, leaf + 1, 0)
    # Each accepted node goes to slot depth - 1; the others add -1 under amax (a no-op).
    slot = (depth - 1).clamp(min=0)
    node_ids = torch.arange(n, device=tokens.device).expand(batch, n)
    nodes = torch.full((batch, n), -1, dtype=torch.long, device=tokens.device)
    nodes = nodes.scatter_reduce(1, slot, torch.where(accepted, node_ids, -1), "amax")
    out = torch.full((batch, n + 1), -1, dtype=torch.long, device=tokens.device)
    out = out.scatter_reduce(1, slot, torch.where(accepted, tokens, -1), "amax")
    return nodes, num_accepted, out, leaf_row


def verify_result(
    nodes: torch.Tensor, num_accepted: torch.Tensor, out: torch.Tensor, final: torch.Tensor
) -> VerifyResult:
    """Put the final token [B] at position num_accepted of out [B, N + 1]."""
    out = out.scatter(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return VerifyResult(accepted_nodes=nodes, num_accepted=num_accepted, output_tokens=out)


def accepted_and_reached(
    parents: torch.Tensor, accepted_nodes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which nodes a verification accepted, and which it reached (their parent, or the root, accepted).

    parents: [B, N] int64 of the verified trees (-1 = child of the root); accepted_nodes: [B, N]
    int64, the accepted path's node indices, -1 padded. Returns two [B, N] bool tensors; no host reads.
    """
    batch, n = parents.shape
    accepted = torch.zeros(batch, n + 1, dtype=torch.bool, device=parents.device)
    accepted.scatter_(1, torch.where(accepted_nodes >= 0, accepted_nodes, n), True)
    accepted = accepted[:, :n]
    reached = torch.where(parents >= 0, accepted.gather(1, parents.clamp(min=0)), True)
    return accepted, reached
