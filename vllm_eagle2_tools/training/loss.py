"""Packed batches and the EAGLE loss: smooth-L1 feature regression plus weighted CE, per drafting depth
(an EAGLE-3 head: the CE alone, over its draft vocabulary)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_eagle2_tools.training.eagle3_head import Eagle3Head
from vllm_eagle2_tools.training.head import EagleHead

CE_WEIGHT = 0.1  # EAGLE paper: L = L_reg + 0.1 * L_cls
UNROLL_DECAY = 0.8  # loss weight of drafting depth s is UNROLL_DECAY ** (s - 1), as in EAGLE-3


@dataclass
class Batch:
    """Packed head inputs/targets for several sequences."""

    tokens: torch.Tensor  # [N] token i+1
    hidden_in: torch.Tensor  # [N, H] z_i (bf16)
    positions: torch.Tensor  # [N]
    hidden_tgt: torch.Tensor  # [N, H] z_{i+1} (bf16)
    weight: torch.Tensor  # [N] bool: the predicted token is an assistant token
    seq_lens: list[int]
    topk_ids: torch.Tensor | None = None  # [N, K] int32: target's most likely tokens after z_{i+1}
    topk_logp: torch.Tensor | None = None  # [N, K] float32: their log-probs
    aux_in: torch.Tensor | None = None  # [N, A * H] bf16: the target's aux-layer hidden states of i

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on ``device``."""
        moved = {
            k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in vars(self).items()
        }
        return Batch(**moved)


def make_batch(
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    mask: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    topk_ids: torch.Tensor | None = None,
    topk_logp: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
) -> Batch:
    """Pack the sequences ``[start, end)`` of a shard into a :class:`Batch`.

    For a sequence t_0..t_{L-1} with features z_0..z_{L-1}, head position i (0..L-2) gets (t_{i+1}, z_i)
    and regresses z_{i+1}; it counts in the loss when the token it predicts, t_{i+2}, is an assistant token
    (for the last position, t_{L-1}). ``topk_ids`` / ``topk_logp`` ([shard tokens, K], optional) are cut
    like ``z_{i+1}``, ``aux`` ([shard tokens, A * H], optional) like ``z_i``.
    """
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("t", "zi", "p", "zt", "w", "ki", "kl", "a")}
    lens: list[int] = []
    for s, e in spans:
        n = e - s
        if n < 2:
            continue
        m = mask[s:e]
        parts["t"].append(tokens[s + 1 : e].long())
        parts["zi"].append(hidden[s : e - 1])
        parts["p"].append(torch.arange(n - 1))
        parts["zt"].append(hidden[s + 1 : e])
        parts["w"].append(torch.cat([m[2:], m[-1:]]) if n > 2 else m[-1:])
        if topk_ids is not None and topk_logp is not None:
            parts["ki"].append(topk_ids[s + 1 : e])
            parts["kl"].append(topk_logp[s + 1 : e])
        if aux is not None:
            parts["a"].append(aux[s : e - 1])
        lens.append(n - 1)
    return Batch(
        tokens=torch.cat(parts["t"]),
        hidden_in=torch.cat(parts["zi"]),
        positions=torch.cat(parts["p"]),
        hidden_tgt=torch.cat(parts["zt"]),
        weight=torch.cat(parts["w"]).bool(),
        seq_lens=lens,
        topk_ids=torch.cat(parts["ki"]) if parts["ki"] else None,
        topk_logp=torch.cat(parts["kl"]) if parts["kl"] else None,
        aux_in=torch.cat(parts["a"]) if parts["a"] else None,
    )


@dataclass
class StepStats:
    """Sums over the rows that count: loss parts and agreement hits at depth 1, top-1 hits deeper."""

    rows: int = 0
    reg: float = 0.0
    ce: float = 0.0
    top1: int = 0
    top5: int = 0
    top10: int = 0
    ce_weight: float = CE_WEIGHT
    deep_rows: list[int] = field(default_factory=list)  # [depth - 2]: rows counted at depths 2, 3, ...
    deep_top1: list[int] = field(default_factory=list)  # [depth - 2]: their top-1 hits

    def add(self, other: StepStats) -> None:
        """Accumulate."""
        self.rows += other.rows
        self.reg += other.reg
        self.ce += other.ce
        self.top1 += other.top1
        self.top5 += other.top5
        self.top10 += other.top10
        for mine, theirs in ((self.deep_rows, other.deep_rows), (self.deep_top1, other.deep_top1)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, x in enumerate(theirs):
                mine[i] += x

    def summary(self) -> dict[str, float]:
        """Means per row (loss = reg + ce_weight * ce; ``top1_depth<s>`` for the unrolled depths)."""
        n = max(self.rows, 1)
        out = {
            "rows": self.rows,
            "loss": (self.reg + self.ce_weight * self.ce) / n,
            "reg_loss": self.reg / n,
            "ce_loss": self.ce / n,
            "top1": self.top1 / n,
            "top5": self.top5 / n,
            "top10": self.top10 / n,
        }
        for i, (rows, hits) in enumerate(zip(self.deep_rows, self.deep_top1)):
            out[f"top1_depth{i + 2}"] = hits / max(rows, 1)
        return out


def vocab_loss(
    out: torch.Tensor, target_hidden: torch.Tensor, lm_head: torch.Tensor, want_grad: bool, chunk: int = 512
) -> tuple[float, torch.Tensor | None, int, int, int]:
    """Cross-entropy of the head's logits against the target's next-token distribution, in row chunks.

    Logits are ``lm_head`` (a matmul in its dtype, the training's precision) of the head output and of the
    target's hidden state; the softmax runs in float32. Returns (sum of CE over rows, d(sum CE)/d out
    [N, H] or None, top-1 / top-5 / top-10 hits of the target's argmax among the head's top-k).
    """
    ce = 0.0
    hits1 = hits5 = hits10 = 0
    grad = torch.empty_like(out) if want_grad else None
    with torch.no_grad():
        for s in range(0, out.shape[0], chunk):
            hl = (out[s : s + chunk].to(lm_head.dtype) @ lm_head.T).float()  # head logits
            tp = (target_hidden[s : s + chunk].to(lm_head.dtype) @ lm_head.T).float()  # target logits
            targ = tp.argmax(-1, keepdim=True)
            tp = torch.softmax(tp, -1)  # target distribution
            lse = torch.logsumexp(hl, -1, keepdim=True)
            # CE = sum_v p_v (lse - hl_v) = lse - <p, hl>; the row dot product avoids a [N, V] temporary.
            ce += float((lse.squeeze(-1) - torch.bmm(tp[:, None, :], hl[:, :, None]).view(-1)).sum())
            rank = (hl > hl.gather(-1, targ)).sum(-1)  # how many head logits beat the target's argmax
            hits1 += int((rank < 1).sum())
            hits5 += int((rank < 5).sum())
            hits10 += int((rank < 10).sum())
            if grad is not None:
                g = hl.sub_(lse).exp_().sub_(tp)  # softmax(head) - p, in place
                grad[s : s + chunk] = (g.to(lm_head.dtype) @ lm_head).float()
    return ce, grad, hits1, hits5, hits10


def subset_vocab_loss(
    out: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logp: torch.Tensor,
    lm_head: torch.Tensor,
    vocab: torch.Tensor,
    want_grad: bool,
    chunk: int = 256,
) -> tuple[float, torch.Tensor | None, int, int, int]:
    """Cross-entropy over a reduced vocabulary: :func:`vocab_loss` at a fraction of its cost.

    The softmax runs over ``V' = vocab ∪ topk_ids`` (``vocab`` [S] int64: the tokens the target most
    often predicts, see :func:`frequent_vocab`); the soft label is the target's top-K distribution
    (``topk_ids`` [N, K], ``topk_logp`` [N, K]) renormalised. Only ``|V'|`` rows of ``lm_head`` take part
    in the two vocabulary matmuls (49k -> ~8k for SmolLM2), and the target's logits are not recomputed.
    Rows go ``chunk`` at a time, so that the [chunk, V'] float32 logits stay in the CPU's caches through
    the softmax's passes (measured on 2 cores, 4,096 rows, V' of 11k: 488 ms whole, 279 ms in chunks
    of 256).
    Returns what :func:`vocab_loss` returns; the hit counts rank the target's argmax within ``V'``.
    """
    ids = topk_ids.long()
    sub = torch.unique(torch.cat([vocab, ids.flatten()]))  # sorted
    w = lm_head.index_select(0, sub)  # [V', H]
    pos = torch.searchsorted(sub, ids)  # [N, K] columns of the labels in V'
    p = torch.softmax(topk_logp.float(), -1)  # [N, K], renormalised over the top-K
    ce = 0.0
    hits = [0, 0, 0]
    grad = torch.empty_like(out) if want_grad else None
    with torch.no_grad():
        for s in range(0, out.shape[0], chunk):
            rows, label, prob = slice(s, s + chunk), pos[s : s + chunk], p[s : s + chunk]
            hl = (out[rows].to(w.dtype) @ w.T).float()  # [n, V']
            lse = torch.logsumexp(hl, -1)
            ce += float((lse - (prob * hl.gather(-1, label)).sum(-1)).sum())
            rank = (hl > hl.gather(-1, label[:, :1])).sum(-1)
            for j, k in enumerate((1, 5, 10)):
                hits[j] += int((rank < k).sum())
            if grad is not None:
                g = hl.sub_(lse[:, None]).exp_()  # softmax over V', in place
                g.scatter_add_(-1, label, -prob)
                grad[rows] = (g.to(w.dtype) @ w).float()
    return ce, grad, hits[0], hits[1], hits[2]


def draft_vocab_loss(
    head: Eagle3Head,
    out: torch.Tensor,
    target_hidden: torch.Tensor,
    target_top1: torch.Tensor,
    want_grad: bool,
    chunk: int = 512,
) -> tuple[float, torch.Tensor | None, torch.Tensor | None, int, int, int]:
    """Cross-entropy of an EAGLE-3 head's draft-vocabulary logits against the target's next-token
    distribution restricted to (and renormalised over) the draft vocabulary, in row chunks.

    ``out`` [N, H]: the head's normed outputs (``head.norm(y)``); head logits ``out @ lm_head.T`` [N, Vd].
    Target logits: ``target_hidden`` [N, H] (z_{i+1}) times the target's lm_head rows of the draft
    vocabulary (as the stored top-K's). The four vocabulary-sized matmuls (both logits, both gradients)
    run in the head's vocabulary dtype (``target_lm_head``'s, the training's precision) with float32
    softmaxes, as :func:`vocab_loss`'s: bf16 is about 3x faster than float32 on a CPU with AMX, and these
    products dominate the step. ``target_top1`` [N]: the
    target's argmax over its whole vocabulary (stored ``topk_ids[:, 0]``); a row hits top-k when that token
    is in the draft vocabulary and among the head's k best, so a target argmax outside it is a miss.
    Returns (sum of CE, d(sum CE)/d out [N, H], d(sum CE)/d lm_head.weight [Vd, H], top-1/5/10 hits); the
    gradients are None without ``want_grad``.
    """
    wt = head.target_lm_head
    w = head.lm_head.weight.detach().to(wt.dtype)
    want = head.target_to_draft[target_top1.long()]  # [N] draft index of the target's argmax, -1: none
    ce = 0.0
    hits = [0, 0, 0]
    grad = torch.empty_like(out) if want_grad else None
    grad_w = torch.zeros_like(head.lm_head.weight) if want_grad else None
    with torch.no_grad():
        for s in range(0, out.shape[0], chunk):
            o = out[s : s + chunk].to(w.dtype)
            hl = (o @ w.T).float()  # [n, Vd]
            tp = torch.softmax((target_hidden[s : s + chunk].to(wt.dtype) @ wt.T).float(), -1)
            lse = torch.logsumexp(hl, -1, keepdim=True)
            ce += float((lse.squeeze(-1) - torch.bmm(tp[:, None, :], hl[:, :, None]).view(-1)).sum())
            idx = want[s : s + chunk]
            rank = (hl > hl.gather(-1, idx.clamp(min=0)[:, None])).sum(-1)
            for j, k in enumerate((1, 5, 10)):
                hits[j] += int(((idx >= 0) & (rank < k)).sum())
            if grad is not None and grad_w is not None:
                g = hl.sub_(lse).exp_().sub_(tp)  # softmax(head) - p, in place
                g = g.to(w.dtype)
                grad[s : s + chunk] = (g @ w).float()
                grad_w += (g.T @ o).float()
    return ce, grad, grad_w, hits[0], hits[1], hits[2]


def _eagle3_depth_loss(
    head: Eagle3Head, out: torch.Tensor, batch: Batch, sel: torch.Tensor, train: bool
) -> tuple[torch.Tensor, float, int, int, int]:
    """One depth of an EAGLE-3 head: (surrogate with d/dθ = d(sum CE)/dθ, sum CE, top-1/5/10 hits)."""
    if batch.topk_ids is None:
        raise ValueError("an EAGLE-3 head's loss needs the stored target top-K (feature format >= 2)")
    normed = head.norm(out.index_select(0, sel))
    ce, grad, grad_w, h1, h5, h10 = draft_vocab_loss(
        head,
        normed.detach(),
        batch.hidden_tgt.index_select(0, sel),
        batch.topk_ids[:, 0].index_select(0, sel),
        want_grad=train,
    )
    surrogate = torch.zeros((), device=out.device)
    if train:
        assert grad is not None and grad_w is not None
        surrogate = (normed * grad).sum() + (head.lm_head.weight * grad_w).sum()
    return surrogate, ce, h1, h5, h10


def batch_loss(
    head: EagleHead | Eagle3Head,
    batch: Batch,
    train: bool,
    feature_noise: float = 0.0,
    ce_weight: float = CE_WEIGHT,
    vocab: torch.Tensor | None = None,
    depths: int = 1,
) -> StepStats:
    """Forward (and, if ``train``, backward into the head's .grad) of one batch; returns its stats.

    Loss per counted row: smooth-L1(out, z_{i+1}) averaged over hidden units + ``ce_weight`` x CE; the
    batch loss is the mean over counted rows. ``feature_noise`` adds U(-a, a) noise to the input features
    (EAGLE's robustness trick; 0 = off). With ``vocab`` (and the batch's stored target top-K) the CE runs
    over a reduced vocabulary (:func:`subset_vocab_loss`); without, over the whole vocabulary.
    ``depths`` > 1 unrolls the head on its own features (:meth:`EagleHead.forward_unrolled`): depth s
    adds ``UNROLL_DECAY ** (s - 1)`` times its own mean loss, and its top-1 hits to the stats.

    An :class:`Eagle3Head` trains on the CE alone (EAGLE-3 drops the regression; ``ce_weight`` and
    ``vocab`` do not apply): :func:`draft_vocab_loss` over its draft vocabulary, on its normed outputs;
    ``feature_noise`` goes on its input, the aux hidden states.
    """
    eagle3 = isinstance(head, Eagle3Head)
    hidden_in, aux_in = batch.hidden_in.float(), batch.aux_in
    if train and feature_noise > 0:
        if eagle3 and aux_in is not None:
            aux_in = aux_in.float() + (torch.rand_like(aux_in.float()) * 2 - 1) * feature_noise
        else:
            hidden_in = hidden_in + (torch.rand_like(hidden_in) * 2 - 1) * feature_noise
    if eagle3:
        ce_weight = 1.0
    stats = StepStats(ce_weight=ce_weight)
    with torch.set_grad_enabled(train):
        outs = head.forward_unrolled(batch.tokens, hidden_in, batch.positions, batch.seq_lens, depths, aux_in)
        surrogate = torch.zeros((), device=batch.tokens.device)
        for depth, out in enumerate(outs, 1):
            # positions are the rows' indices within their sequences: depth s needs s - 1 rows before
            sel = (batch.weight & (batch.positions >= depth - 1)).nonzero().squeeze(-1)
            n = int(sel.numel())
            if n == 0:
                if depth == 1:
                    return stats
                continue
            reg = 0.0
            if isinstance(head, Eagle3Head):
                part, ce, h1, h5, h10 = _eagle3_depth_loss(head, out, batch, sel, train)
            else:
                part, reg, ce, h1, h5, h10 = _eagle_depth_loss(head, out, batch, sel, train, ce_weight, vocab)
            surrogate = surrogate + UNROLL_DECAY ** (depth - 1) * part / n
            if depth == 1:
                stats.rows, stats.reg, stats.ce = n, reg, ce
                stats.top1, stats.top5, stats.top10 = h1, h5, h10
            else:
                stats.deep_rows.append(n)
                stats.deep_top1.append(h1)
        if train:
            surrogate.backward()
    return stats


def _eagle_depth_loss(
    head: EagleHead,
    out: torch.Tensor,
    batch: Batch,
    sel: torch.Tensor,
    train: bool,
    ce_weight: float,
    vocab: torch.Tensor | None,
) -> tuple[torch.Tensor, float, float, int, int, int]:
    """One depth of an EAGLE head: (surrogate with d/dθ = d(sum of reg + ce_weight * CE)/dθ, sum of
    reg, sum CE, top-1/5/10 hits)."""
    out_m = out.index_select(0, sel)
    tgt = batch.hidden_tgt.index_select(0, sel)
    reg = F.smooth_l1_loss(out_m, tgt.float(), reduction="none").mean(-1).sum()
    if vocab is not None and batch.topk_ids is not None and batch.topk_logp is not None:
        ce, grad, h1, h5, h10 = subset_vocab_loss(
            out_m.detach(),
            batch.topk_ids.index_select(0, sel),
            batch.topk_logp.index_select(0, sel),
            head.lm_head_weight,
            vocab,
            want_grad=train,
        )
    else:
        ce, grad, h1, h5, h10 = vocab_loss(out_m.detach(), tgt, head.lm_head_weight, want_grad=train)
    surrogate = torch.zeros((), device=out.device)
    if train:
        assert grad is not None
        # d/d out of sum(CE) is `grad`, so <out, grad> is a surrogate with the right gradient.
        surrogate = reg + ce_weight * (out_m * grad).sum()
    return surrogate, float(reg.detach()), ce, h1, h5, h10
