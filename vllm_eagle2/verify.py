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

Both rules accept at most one child of each accepted node, so the accepted nodes form one
root path, and every node's own test ("would it be accepted if its parent were?") needs
only its parent's row. Hence the whole tree is verified at once, in fixed shapes: a
per-node ``hit`` test, then pointer jumping (ceil(log2 N) rounds) to keep the nodes whose
every ancestor hit too. No data-dependent host sync (no ``nonzero``, ``.item()``,
boolean-mask indexing or early exit), so the functions can be captured in a CUDA graph.
Sampled verification without per-request generators has no sync either; seeded rows loop
in Python over the seeded rows only (as vLLM's sampler does), without syncing.

The target logits are read once (see :func:`_argmax_lse`): every row's argmax (greedy)
and the log-sum-exp of the row scaled by 1 / T (sampling); sampled probabilities are then
formed only where needed: ``exp(logit * scale - lse)`` at the gathered draft tokens, and
a softmax of the one leaf row per request for the residual draw. On CUDA with Triton that read is
the fused kernel :func:`vllm_eagle2.kernels.vocab_topk` with k = 1, which counts NaN and
+inf logits as -inf: a row holding NaN or +inf target logits then yields an unspecified
(but valid, in ``[0, V)``) token, where torch's argmax (the CPU path, unchanged) would pick
the first NaN / +inf. With top-k / top-p the masked distribution is built (a sort over V)
at the rows that parent a candidate: all rows off CPU, only those on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_eagle2.kernels import HAS_TRITON, vocab_topk

__all__ = [
    "VerifyResult",
    "apply_top_k_top_p",
    "target_probs",
    "verify_greedy",
    "verify_sampling",
    "verify_tree",
]

# CPU only: per-row log-sum-exps (_argmax_lse) are computed in chunks of about this many elements,
# because full-size float32 temporaries are fresh (page-faulting) allocations every call
# and cost more than the arithmetic; chunks of a few MiB are recycled by the allocator.
_CPU_CHUNK_ELEMS = 1 << 20
# CPU only: argmax over the vocabulary in blocks of this size (see _argmax_last).
_CPU_ARGMAX_BLOCK = 256


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


def _check_tree(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, name: str) -> None:
    if tokens.dim() != 2 or parents.shape != tokens.shape:
        raise ValueError(
            f"tokens and parents must both be [B, N]; got {tuple(tokens.shape)} and {tuple(parents.shape)}"
        )
    batch, n = tokens.shape
    if target.dim() != 3 or target.shape[:2] != (batch, n + 1):
        raise ValueError(f"{name} must be [B, N + 1, V] = [{batch}, {n + 1}, V]; got {tuple(target.shape)}")


def _jump_rounds(n: int) -> int:
    """Pointer-jumping rounds that cover a path of n nodes: ceil(log2 n)."""
    return max(0, n - 1).bit_length()


def _jump_pointers(parents: torch.Tensor) -> list[torch.Tensor]:
    """Pointer-jumping tables for a batch of trees, one per round.

    Entry r is [B, N + 1]: every node's ancestor 2**r hops up, with the root as an extra
    node N that points to itself (so jumping past the root needs no masking).
    """
    n = parents.shape[1]
    up = torch.nn.functional.pad(torch.where(parents < 0, n, parents), (0, 1), value=n)
    tables = [up]
    for _ in range(_jump_rounds(n) - 1):
        tables.append(tables[-1].gather(1, tables[-1]))
    return tables


def _path_sums(tables: list[torch.Tensor], values: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` [B, N] over each node and all its ancestors, [B, N].

    tables: from :func:`_jump_pointers`. The root adds 0; round r adds the sums held
    2**r hops up, doubling the covered path, so ceil(log2 N) rounds reach the root.
    """
    n = values.shape[1]
    total = torch.nn.functional.pad(values, (0, 1), value=0)
    for up in tables:
        total = total + total.gather(1, up)
    return total[:, :n]


def _siblings(tokens: torch.Tensor, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def _argmax_last(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (first index of the maximum, NaN counting as maximum), exactly.

    On CPU, argmax is not vectorised and costs ~15x a vectorised ``amax``; reading the
    whole [B, N + 1, V] logits that way would make greedy verification slower than the
    level walk it replaces. So on CPU: the maximum of every block of the vocabulary
    (``amax``), the first block that holds the row maximum, then argmax inside it only.
    """
    vocab = x.shape[-1]
    block = _CPU_ARGMAX_BLOCK
    if x.device.type != "cpu" or vocab <= 2 * block:
        return x.argmax(dim=-1)
    whole = vocab - vocab % block
    block_max = x[..., :whole].unflatten(-1, (whole // block, block)).amax(dim=-1)
    if whole < vocab:
        block_max = torch.cat([block_max, x[..., whole:].amax(dim=-1, keepdim=True)], dim=-1)
    first = block_max.argmax(dim=-1, keepdim=True)  # argmax, so ties pick the first block
    cols = (first * block + torch.arange(block, device=x.device)).clamp(max=vocab - 1)
    return cols.gather(-1, x.gather(-1, cols).argmax(dim=-1, keepdim=True)).squeeze(-1)


def _accept(
    tokens: torch.Tensor, tables: list[torch.Tensor], hit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accepted path from the per-node tests (tables: :func:`_jump_pointers`).

    hit: [B, N] bool, node i passes its own test at its parent's row (at most one child
    of any node). A node is accepted iff it and all its ancestors hit: every hit counts 1
    and every miss N + 1 along the path, so a path sum <= N means all hit and is the depth.

    Returns accepted_nodes [B, N] (-1 padded), num_accepted [B], output_tokens [B, N + 1]
    with -1 where the final token goes (position num_accepted), and leaf_row [B]: the
    target row after the accepted path (0 = root, i + 1 = node i).
    """
    batch, n = tokens.shape
    weight = torch.where(hit, 1, n + 1)
    depth = _path_sums(tables, weight)
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


def _finish(
    nodes: torch.Tensor, num_accepted: torch.Tensor, out: torch.Tensor, final: torch.Tensor
) -> VerifyResult:
    """Put the final token [B] at position num_accepted of out [B, N + 1]."""
    out = out.scatter(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return VerifyResult(accepted_nodes=nodes, num_accepted=num_accepted, output_tokens=out)


def _greedy_hits(
    tokens: torch.Tensor, parents: torch.Tensor, candidate: torch.Tensor, best: torch.Tensor
) -> torch.Tensor:
    """[B, N] bool: candidate nodes carrying the target's argmax best [B, N + 1] at their parent."""
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


def _use_vocab_kernel(logits: torch.Tensor) -> bool:
    """Whether :func:`_argmax_lse` reads ``logits`` with the fused Triton kernel (CUDA and
    Triton; tests patch this to run the kernel under the Triton interpreter)."""
    return logits.is_cuda and HAS_TRITON


def _argmax_lse(logits: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's argmax and the log-sum-exp of the scaled row, in one read of the logits.

    logits: [B, R, V]; scale: [B] float32 (> 0), the per-request multiplier 1 / T, or
    None when only the argmax is wanted. Returns best [B, R] int64, the first index of
    the row maximum (``logits.argmax(-1)``), and lse [B, R] float32,
    ``logsumexp(logits.float() * scale[b])`` (None without scale).

    * :func:`_use_vocab_kernel`: one ``vocab_topk(k=1)`` over all B * R rows gives the
      scaled row's maximum (lowest index among ties, argmax's rule) and its log-prob, so
      lse = that maximum - its log-prob. The argmax of ``x * s`` is that of ``x`` for any
      s > 0 (float32 products of distinct bf16/fp16 values stay distinct and ordered), so
      greedy requests can share the call with scale 1. NaN and +inf count as -inf here
      (see the module docstring). A row with no finite value gets lse NaN.
    * Otherwise torch, exactly argmax for ``best`` (on CPU the blocked
      :func:`_argmax_last`), and the row max and sum of exponentials of the scaled logits
      as a float32 temporary, in row chunks on CPU (see ``_CPU_CHUNK_ELEMS``).
    """
    batch, n_rows, vocab = logits.shape
    if _use_vocab_kernel(logits):
        flat = logits.reshape(batch * n_rows, vocab)
        flat_scale = None if scale is None else scale.float().unsqueeze(1).expand(batch, n_rows).reshape(-1)
        logprob, index = vocab_topk(flat, 1, scale=flat_scale, backend="triton")  # [B * R, 1]
        best = index.view(batch, n_rows)
        if scale is None:
            return best, None
        top = flat.gather(1, index) * flat_scale.unsqueeze(1)  # the scaled maximum, as the kernel forms it
        return best, (top - logprob).view(batch, n_rows)
    best = _argmax_last(logits)
    if scale is None:
        return best, None
    s = scale.float().view(batch, 1, 1)
    step = n_rows
    if logits.device.type == "cpu":
        step = max(1, _CPU_CHUNK_ELEMS // max(1, batch * vocab))
    lse = []
    for start in range(0, n_rows, step):  # one round off CPU
        # The float32 scale promotes the product: no separate float copy of the logits.
        scaled = (logits if step >= n_rows else logits[:, start : start + step]) * s
        top = scaled.amax(dim=-1, keepdim=True)
        lse.append(top.squeeze(-1) + scaled.sub_(top).exp_().sum(dim=-1).log_())
    return best, lse[0] if len(lse) == 1 else torch.cat(lse, 1)


def _filtered_node_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    parent_row: torch.Tensor,
    safe_tokens: torch.Tensor,
    candidate: torch.Tensor,
) -> torch.Tensor:
    """Top-k / top-p target probability [B, N] of each node's token at its parent's row.

    Non-candidates may get 0. Filtering sorts each row it touches. Off CPU every row is
    filtered: fixed shapes, as vLLM's rejection sampler does. On CPU, where a compaction
    costs no device sync, only the rows that parent a candidate are (at B = 1, m = 4,
    V = 49,152: 2-3 sorted rows instead of 5).
    """
    batch, n_rows, _ = logits.shape
    if logits.device.type != "cpu":
        full = target_probs(logits, temperature, top_k, top_p)
        rows = torch.arange(batch, device=logits.device).unsqueeze(1)
        return full[rows, parent_row, safe_tokens]
    need = torch.zeros(batch, n_rows, dtype=torch.int32).scatter_add_(1, parent_row, candidate.int()) > 0
    b_idx, r_idx = need.nonzero(as_tuple=True)
    if b_idx.numel() == 0:
        return torch.zeros(parent_row.shape, dtype=torch.float32)

    def pick(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[b_idx]

    probs = target_probs(logits[b_idx, r_idx].unsqueeze(1), temperature[b_idx], pick(top_k), pick(top_p))
    slot = torch.full((batch, n_rows), -1, dtype=torch.long)
    slot[b_idx, r_idx] = torch.arange(b_idx.numel())
    at = slot.gather(1, parent_row)
    p_node = probs.squeeze(1)[at.clamp(min=0), safe_tokens]
    return torch.where(at >= 0, p_node, 0.0)


def _verify(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    *,
    logits: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
) -> VerifyResult:
    """Fixed-shape verification; every public function ends here.

    Exactly one of:
    * ``logits`` [B, N + 1, V] and ``temperature`` None: greedy for every row;
    * ``logits`` and ``temperature`` [B]: rows with temperature <= 0 greedy, the others
      sampled from softmax(apply_top_k_top_p(logits / T)) (both computed for all rows,
      merged per row: no split of the batch, so no sync);
    * ``probs`` [B, N + 1, V]: sampled from these target probabilities.

    uniforms: [B, N + 2] for sampling: ``uniforms[:, 0]`` for the final (correction or
    bonus) token, ``uniforms[:, 1 + l]`` for tree level l (the children of depth-l
    nodes).
    """
    batch, n = tokens.shape
    rows = torch.arange(batch, device=tokens.device)
    safe_tokens = tokens.clamp(min=0)
    parent_row = parents + 1  # row of the parent's next-token distribution
    candidate, sibling_before = _siblings(tokens, parents)
    tables = _jump_pointers(parents)
    sampled = probs is not None or temperature is not None
    greedy_row = scale = lse = None
    hit = best = None
    if logits is not None:
        if temperature is not None:
            greedy_row = temperature <= 0
            # Greedy rows also run the sampled branch (result discarded): a safe T = 1,
            # which also keeps their argmax (scale 1) exact in the fused read.
            temperature = torch.where(greedy_row, 1.0, temperature.float())
            if top_k is None and top_p is None:  # else the masked probabilities serve
                scale = temperature.reciprocal()
        best, lse = _argmax_lse(logits, scale)  # [B, N + 1] each
        hit = _greedy_hits(tokens, parents, candidate, best)
    if sampled:
        assert uniforms is not None
        full_probs = probs
        filtered = full_probs is None and lse is None  # top-k / top-p: no fused read
        if filtered:
            p_node = _filtered_node_probs(
                logits, temperature, top_k, top_p, parent_row, safe_tokens, candidate
            )
        elif full_probs is not None:
            p_node = full_probs[rows.unsqueeze(1), parent_row, safe_tokens]
        else:  # softmax(logits / T) at the draft tokens only
            # (A float32 scale makes the product float32, computed as the kernel does.)
            picked = logits[rows.unsqueeze(1), parent_row, safe_tokens] * scale.unsqueeze(1)
            p_node = (picked - lse.gather(1, parent_row)).exp()
        depths = _path_sums(tables, torch.ones_like(parents))
        u_node = uniforms.gather(1, depths)  # column 1 + level = depth
        sampled_hit = _sampled_hits(candidate, sibling_before, p_node, u_node)
        hit = sampled_hit if greedy_row is None else torch.where(greedy_row.unsqueeze(1), hit, sampled_hit)
    nodes, num_accepted, out, leaf_row = _accept(tokens, tables, hit)
    final = None
    if best is not None:
        final = best.gather(1, leaf_row.unsqueeze(1)).squeeze(1)
    if sampled:
        if full_probs is not None:
            leaf_probs = full_probs[rows, leaf_row]
        elif filtered:
            leaf_probs = target_probs(logits[rows, leaf_row].unsqueeze(1), temperature, top_k, top_p).squeeze(
                1
            )
        else:  # only the leaf rows become probabilities, [B, V]: one softmax op
            leaf_probs = (logits[rows, leaf_row] * scale.unsqueeze(1)).softmax(dim=-1)
        leaf_node = leaf_row - 1  # -1 = root
        children = candidate & (parents == leaf_node.unsqueeze(1))
        drawn = _sample_residual(leaf_probs, children, safe_tokens, uniforms[:, 0])
        final = drawn if greedy_row is None else torch.where(greedy_row, final, drawn)
    return _finish(nodes, num_accepted, out, final)


def _uniforms(
    batch: int,
    n: int,
    device: torch.device,
    generators: dict[int, torch.Generator] | None,
    default: torch.Generator | None,
) -> torch.Tensor:
    """Uniforms [B, N + 2]: column 0 for the final token, column 1 + l for tree level l.

    Every seeded row draws exactly N + 2 numbers from its own generator, in that order,
    whatever its tree and the batch hold: no sync to learn its depth, and the numbers it
    uses (the first depth + 2) do not depend on N or on the other rows. Its generator
    does advance by N + 2, so later steps of a seeded request reproduce when N (the
    batch's tree width) does, e.g. when the caller pads trees to a fixed width.
    """
    u = torch.rand((batch, n + 2), device=device, generator=default)
    for row, gen in (generators or {}).items():  # Python loop over the seeded rows only
        u[row] = torch.rand(n + 2, device=device, generator=gen)
    return u


def verify_greedy(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_logits: torch.Tensor,
) -> VerifyResult:
    """Greedy verification: longest path matching the target's argmax, plus the bonus token.

    Args:
        tokens: [B, N] int64 drafted tokens (< 0 = padding).
        parents: [B, N] int64, -1 = child of root, else index of the parent (< own index).
        target_logits: [B, N + 1, V] target logits (or probabilities) at root and nodes.

    Returns fixed widths: accepted_nodes [B, N], output_tokens [B, N + 1].
    """
    _check_tree(tokens, parents, target_logits, "target_logits")
    return _verify(tokens, parents, logits=target_logits)


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
            requests, each drawing N + 2 numbers per call (see :func:`_uniforms`); other
            rows draw from ``generator`` (or torch's global one).

    Returns fixed widths: accepted_nodes [B, N], output_tokens [B, N + 1].
    """
    _check_tree(tokens, parents, target_probs, "target_probs")
    batch, n = tokens.shape
    u = _uniforms(batch, n, tokens.device, generators, generator)
    return _verify(tokens, parents, probs=target_probs, uniforms=u)


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
    Without top-k / top-p, target probabilities are only formed at the gathered draft
    tokens (from each row's log-sum-exp) and the leaf row; with them, the masked
    distribution is built for the rows that parent a candidate (see
    :func:`_filtered_node_probs`) and the leaf row. Both branches run for every row when
    ``temperature`` is given, and are merged per row: no split of the batch, no sync.

    Returns fixed widths: accepted_nodes [B, N], output_tokens [B, N + 1].
    """
    _check_tree(tokens, parents, target_logits, "target_logits")
    if temperature is None:
        return _verify(tokens, parents, logits=target_logits)
    batch, n = tokens.shape
    u = _uniforms(batch, n, tokens.device, generators, None)
    return _verify(
        tokens,
        parents,
        logits=target_logits,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        uniforms=u,
    )
