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
* Sample-match (rows given ``choices``, the seeded requests of an engine): the target's own
  sample at every row is given (the choice at row ``i + 1`` is a sample of the target's filtered
  distribution after node ``i``, with noise of its own per output position:
  :mod:`vllm_eagle2.verify.seeded`). The greedy rule with the argmax replaced by these choices: a
  node is accepted iff its token is the choice at its parent's row and its parent is accepted,
  and the final token is the choice at the last accepted node's row. Each emitted token is then
  the target's sample given the accepted prefix, so the output is distributed as sampling from
  the target alone; a child is accepted with probability ``p(x)``, as under rejection sampling
  of a point-mass draft. Such rows draw no uniforms from their generators.

All three rules accept at most one child of each accepted node, so the accepted nodes form one
root path, and every node's own test ("would it be accepted if its parent were?") needs
only its parent's row. Hence the whole tree is verified at once, in fixed shapes: a
per-node ``hit`` test, then pointer jumping (ceil(log2 N) rounds) to keep the nodes whose
every ancestor hit too. No data-dependent host sync (no ``nonzero``, ``.item()``,
boolean-mask indexing or early exit), so the functions can be captured in a CUDA graph.
Sampled verification without per-request generators has no sync either; seeded rows loop
in Python over the seeded rows only (as vLLM's sampler does), without syncing; rows given
choices draw nothing.

The target logits are read once: every row's argmax (greedy) and the log-sum-exp of the
row scaled by 1 / T (sampling); sampled probabilities are then formed only where needed
(at the gathered draft tokens and the one leaf row per request). On CUDA with Triton that
read is a fused kernel that counts NaN and +inf logits as -inf (a row holding them yields
an unspecified but valid token); details in :mod:`vllm_eagle2.verify.logits`.

Modules: this one holds the per-node tests (greedy hit, rejection-sampling hit, residual
draw), the fixed-shape driver and the public functions; :mod:`vllm_eagle2.verify.paths`
the tree bookkeeping (result type, pointer jumping, siblings, accepted path);
:mod:`vllm_eagle2.verify.logits` the read of the target logits and the top-k / top-p
probabilities. Every public name is importable from here.
"""

from __future__ import annotations

import torch

from vllm_eagle2.kernels import ancestor_tables
from vllm_eagle2.verify.logits import apply_top_k_top_p, argmax_lse, filtered_node_probs, target_probs
from vllm_eagle2.verify.paths import (
    VerifyResult,
    accepted_path,
    check_tree,
    path_sums,
    siblings,
    verify_result,
)

__all__ = [
    "VerifyResult",
    "apply_top_k_top_p",
    "target_probs",
    "verify_tree",
]


def _greedy_hits(
    tokens: torch.Tensor, parents: torch.Tensor, candidate: torch.Tensor, best: torch.Tensor
) -> torch.Tensor:
    """[B, N] bool: candidate nodes carrying the target's choice best [B, N + 1] (its argmax, or
    the given choices) at their parent."""
    return candidate & (tokens == best.gather(1, parents + 1))


def _sampled_hits(
    candidate: torch.Tensor,
    sibling_before: torch.Tensor,
    p_node: torch.Tensor,
    u_node: torch.Tensor,
) -> torch.Tensor:
    """[B, N] bool: candidates that the rejection walk accepts if it reaches their parent.

    p_node: [B, N] target probability of each node's token at its parent's row; u_node:
    [B, N] the uniform of the node's level. Sibling i wins iff the mass of the candidate
    siblings tried before it is <= u < that mass + p_i (same rule as the level walk).
    """
    p_node = torch.where(candidate, p_node.float(), 0.0)
    before = torch.where(sibling_before, p_node.unsqueeze(1), 0.0).sum(dim=2)
    return candidate & (p_node > 0) & (before <= u_node) & (u_node < before + p_node)


def _sample_residual(
    p: torch.Tensor, children: torch.Tensor, safe_tokens: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Sample [B] from p [B, V] with the (all rejected) children's tokens removed.

    children: [B, N] bool, the candidate children of the row's node; safe_tokens: [B, N]
    their tokens (clamped to >= 0); u: [B] uniforms. Inverse-CDF sampling with one
    uniform per row: exact, and cheap next to drawing V exponentials. Zero-probability
    tokens are never chosen.
    """
    p = p.float()
    rejected = torch.zeros_like(p).scatter_add_(1, safe_tokens, children.float())
    residual = torch.where(rejected > 0, 0.0, p)
    # Rounding can leave (almost) no mass when the children covered it: use p itself.
    residual = torch.where(residual.sum(dim=1, keepdim=True) <= 0, p, residual)
    cdf = residual.cumsum(dim=1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=p.shape[1] - 1)


def _verify(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    *,
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    choices: torch.Tensor | None = None,
) -> VerifyResult:
    """Fixed-shape verification; every public function ends here.

    * ``logits`` [B, N + 1, V] and ``temperature`` None: greedy for every row;
    * ``logits`` and ``temperature`` [B]: rows with temperature <= 0 greedy, the others
      sampled from softmax(apply_top_k_top_p(logits / T)) (both computed for all rows,
      merged per row: no split of the batch, so no sync).

    uniforms: [B, N + 2] for sampling: ``uniforms[:, 0]`` for the final (correction or
    bonus) token, ``uniforms[:, 1 + l]`` for tree level l (the children of depth-l
    nodes). choices: [B, N + 1] int64, the target's choice at every row; rows whose
    ``choices[:, 0] >= 0`` take the greedy rule on these instead of the argmax (merged per
    row, like the greedy rows).
    """
    batch, n = tokens.shape
    rows = torch.arange(batch, device=tokens.device)
    safe_tokens = tokens.clamp(min=0)
    parent_row = parents + 1  # row of the parent's next-token distribution
    candidate, sibling_before = siblings(tokens, parents)
    tables = ancestor_tables(parents)
    sampled = temperature is not None
    greedy_row = scale = None
    if sampled:
        greedy_row = temperature <= 0
        # Greedy rows also run the sampled branch (result discarded): a safe T = 1,
        # which also keeps their argmax (scale 1) exact in the fused read.
        temperature = torch.where(greedy_row, 1.0, temperature.float())
        if top_k is None and top_p is None:  # else the masked probabilities serve
            scale = temperature.reciprocal()
    best, lse = argmax_lse(logits, scale)  # [B, N + 1] each
    if choices is not None:  # sample-match: the given choices stand in for the argmax
        matched = choices[:, 0] >= 0
        best = torch.where(matched.unsqueeze(1), choices, best)
        if sampled:  # these rows take the greedy rule on their choices
            greedy_row = greedy_row | matched
    hit = _greedy_hits(tokens, parents, candidate, best)
    if sampled:
        assert uniforms is not None
        filtered = lse is None  # top-k / top-p: no fused read
        if filtered:
            p_node = filtered_node_probs(
                logits, temperature, top_k, top_p, parent_row, safe_tokens, candidate
            )
        else:  # softmax(logits / T) at the draft tokens only
            # (A float32 scale makes the product float32, computed as the kernel does.)
            picked = logits[rows.unsqueeze(1), parent_row, safe_tokens] * scale.unsqueeze(1)
            p_node = (picked - lse.gather(1, parent_row)).exp()
        depths = path_sums(tables, torch.ones_like(parents))
        u_node = uniforms.gather(1, depths)  # column 1 + level = depth
        sampled_hit = _sampled_hits(candidate, sibling_before, p_node, u_node)
        hit = torch.where(greedy_row.unsqueeze(1), hit, sampled_hit)
    nodes, num_accepted, out, leaf_row = accepted_path(tokens, tables, hit)
    final = best.gather(1, leaf_row.unsqueeze(1)).squeeze(1)
    if sampled:
        if filtered:
            leaf_probs = target_probs(logits[rows, leaf_row].unsqueeze(1), temperature, top_k, top_p).squeeze(
                1
            )
        else:  # only the leaf rows become probabilities, [B, V]: one softmax op
            leaf_probs = (logits[rows, leaf_row] * scale.unsqueeze(1)).softmax(dim=-1)
        leaf_node = leaf_row - 1  # -1 = root
        children = candidate & (parents == leaf_node.unsqueeze(1))
        drawn = _sample_residual(leaf_probs, children, safe_tokens, uniforms[:, 0])
        final = torch.where(greedy_row, final, drawn)
    return verify_result(nodes, num_accepted, out, final)


def _uniforms(
    batch: int,
    n: int,
    device: torch.device,
    generators: dict[int, torch.Generator] | None,
) -> torch.Tensor:
    """Uniforms [B, N + 2]: column 0 for the final token, column 1 + l for tree level l.

    Every seeded row draws exactly N + 2 numbers from its own generator, in that order,
    whatever its tree and the batch hold: no sync to learn its depth, and the numbers it
    uses (the first depth + 2) do not depend on N or on the other rows. Its generator
    does advance by N + 2, so later steps of a seeded request reproduce when N (the
    batch's tree width) does, e.g. when the caller pads trees to a fixed width.
    """
    u = torch.rand((batch, n + 2), device=device)
    for row, gen in (generators or {}).items():  # Python loop over the seeded rows only
        u[row] = torch.rand(n + 2, device=device, generator=gen)
    return u


def verify_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
    choices: torch.Tensor | None = None,
) -> VerifyResult:
    """Verify a batch mixing greedy (temperature 0) and sampled requests.

    temperature/top_k/top_p: [B] per-request settings; ``temperature`` None or <= 0
    (per row) = greedy. ``generators``: per-row generators (row index -> generator) for
    seeded requests, each drawing N + 2 numbers per call (see :func:`_uniforms`); other rows
    draw from torch's global one.
    ``choices``: [B, N + 1] int64, the target's sample at each row (row 0 after the root, row
    ``i + 1`` after node ``i``), -1 for the rows that have none: rows whose ``choices[:, 0] >= 0``
    are verified by sample-match (module docstring), and need every row their nodes can reach,
    and no generator (pass those of the other seeded rows only: a given generator still draws).
    Without top-k / top-p, target probabilities are only formed at the gathered draft
    tokens (from each row's log-sum-exp) and the leaf row; with them, the masked
    distribution is built for the rows that parent a candidate (see
    :func:`filtered_node_probs`) and the leaf row. Both branches run for every row when
    ``temperature`` is given, and are merged per row: no split of the batch, no sync.

    Returns fixed widths: accepted_nodes [B, N], output_tokens [B, N + 1].
    """
    check_tree(tokens, parents, target_logits, "target_logits")
    if choices is not None and choices.shape != target_logits.shape[:2]:
        raise ValueError(f"choices: expected {tuple(target_logits.shape[:2])}, got {tuple(choices.shape)}")
    if temperature is None:
        return _verify(tokens, parents, logits=target_logits, choices=choices)
    batch, n = tokens.shape
    u = _uniforms(batch, n, tokens.device, generators)
    return _verify(
        tokens,
        parents,
        logits=target_logits,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        uniforms=u,
        choices=choices,
    )
