"""Reading the target's logits for verification: argmax, log-sum-exp, and top-k / top-p probabilities.

Shapes as in :mod:`vllm_eagle2.verify.verifier`: logits [B, R, V] (R = N + 1 rows, the root and every node),
per-request settings [B].

The target logits are read once (see :func:`argmax_lse`): every row's argmax (greedy)
and the log-sum-exp of the row scaled by 1 / T (sampling); sampled probabilities are then
formed only where needed: ``exp(logit * scale - lse)`` at the gathered draft tokens, and
a softmax of the one leaf row per request for the residual draw. On CUDA with Triton that read is
the fused kernel :func:`vllm_eagle2.kernels.vocab_topk` with k = 1, which counts NaN and
+inf logits as -inf: a row holding NaN or +inf target logits then yields an unspecified
(but valid, in ``[0, V)``) token, where torch's argmax (the CPU path, unchanged) would pick
the first NaN / +inf. With top-k / top-p the masked distribution is built (a sort over V)
at the rows that parent a candidate: all rows off CPU (in groups of requests, to bound its
memory), only those on CPU.
"""

from __future__ import annotations

import torch

from vllm_eagle2.device import cuda_path
from vllm_eagle2.kernels import HAS_TRITON, vocab_topk

__all__ = ["apply_top_k_top_p", "target_probs"]

# CPU only: per-row log-sum-exps (argmax_lse) are computed in chunks of about this many elements,
# because full-size float32 temporaries are fresh (page-faulting) allocations every call
# and cost more than the arithmetic; chunks of a few MiB are recycled by the allocator.
_CPU_CHUNK_ELEMS = 1 << 20
# CPU only: argmax over the vocabulary in blocks of this size (see _argmax_last).
_CPU_ARGMAX_BLOCK = 256
# Off CPU: top-k / top-p filtering sorts whole rows; requests are filtered in groups of at most
# about this many logits, so that its float32 copies and int64 sort indices (~20 bytes a logit)
# stay near 1 GiB. Filtering every row at once took several GB at B = 64, N + 1 = 61,
# V = 128,256, memory vLLM's profiling never saw.
_FILTER_ELEMS = 1 << 26


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


def _use_vocab_kernel(logits: torch.Tensor) -> bool:
    """Whether :func:`argmax_lse` reads ``logits`` with the fused Triton kernel (CUDA and
    Triton; tests patch this to run the kernel under the Triton interpreter)."""
    return logits.is_cuda and HAS_TRITON


def argmax_lse(logits: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
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


def filtered_node_probs(
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
    batch, n_rows, vocab = logits.shape
    if cuda_path(logits.device):
        # Fixed shapes per group; the groups follow B (host), so nothing reads the device.
        group = max(1, _FILTER_ELEMS // (n_rows * vocab))
        out = []
        for b0 in range(0, batch, group):
            sl = slice(b0, b0 + group)

            def part(x: torch.Tensor | None) -> torch.Tensor | None:
                return None if x is None else x[sl]  # noqa: B023 - used at once, inside this round

            full = target_probs(logits[sl], temperature[sl], part(top_k), part(top_p))
            rows = torch.arange(full.shape[0], device=logits.device).unsqueeze(1)
            out.append(full[rows, parent_row[sl], safe_tokens[sl]])
        return out[0] if len(out) == 1 else torch.cat(out)
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


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits [B, R, V] outside each row's top-k / top-p set with -inf.

    top_k: [B] int64 (>= vocabulary size or <= 0 = off); top_p: [B] float (1 = off).
    Same rule as vLLM's sampler: top-k keeps ties at the threshold, top-p drops the
    lowest tokens whose cumulative probability stays <= 1 - p, and always keeps one.
    Not vLLM's function itself: verification runs where vLLM is not installed (the GPU checks,
    head training) and over [B, R, V] with per-request settings; ``tests/test_verify.py``
    checks it against vLLM's.
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
