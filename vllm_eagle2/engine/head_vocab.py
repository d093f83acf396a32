"""What the head drafts over: the target's vocabulary, the head's most frequent tokens of it
(``draft_vocab_size``, :mod:`vllm_eagle2.draft_vocab`), or an EAGLE-3 head's own vocabulary."""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_eagle2.config import Eagle2Settings
from vllm_eagle2.draft_vocab import DraftVocab, platform_gemm

logger = logging.getLogger("vllm.eagle2")


class HeadVocabulary:
    """Draft logits of the head's outputs, and the token ids of their columns.

    cut: the ``lm_head`` cut to the draft vocabulary, or None; d2t: an EAGLE-3 head's [Vd] int64
    (target id - draft index), or None.
    """

    def __init__(self, model: Any, settings: Eagle2Settings) -> None:
        self.model = model
        self.cut = load_cut(model, settings) if settings.draft_vocab_ids else None
        self.d2t: torch.Tensor | None = getattr(model, "draft_id_to_target_id", None)

    def size(self, target_vocab: int) -> int:
        """Columns of the draft logits."""
        if self.d2t is not None:
            return self.d2t.numel()
        return target_vocab if self.cut is None else len(self.cut.ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] head outputs -> [N, V] draft logits (model dtype); V = :meth:`size`.

        Never normalised here: the tree's vocabulary top-k finds each row's winners and its
        log-sum-exp in one pass, so no [N, V] float32 log-probs are materialised.
        """
        if self.cut is not None:
            return self.cut.logits(hidden)
        if self.d2t is not None:
            # An EAGLE-3 head's own vocabulary, not scattered into the target's as compute_logits does.
            return self.model.logits_processor(self.model.lm_head, hidden)
        return self.model.compute_logits(hidden)

    def token_ids(self, draft_index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary positions (-1 = padding) -> token ids."""
        if self.cut is not None:
            return self.cut.token_ids(draft_index)
        if self.d2t is not None:
            return torch.where(
                draft_index >= 0, draft_index + self.d2t[draft_index.clamp(min=0)], draft_index
            )
        return draft_index


def load_cut(model: Any, settings: Eagle2Settings) -> DraftVocab | None:
    """The ``lm_head`` cut to the draft vocabulary; None (the whole vocabulary) where it cannot be
    cut and the user left ``draft_vocab_size`` at ``"auto"``."""
    weight = getattr(model.lm_head, "weight", None)
    processor = model.logits_processor
    problem = None
    if weight is None or weight.dim() != 2 or not weight.is_floating_point():
        problem = "needs an unquantized lm_head"
    elif getattr(processor, "soft_cap", None):
        problem = "does not support logit soft-capping"
    if problem and settings.draft_vocab_auto:
        logger.info("eagle2: drafting from the whole vocabulary (a draft vocabulary %s)", problem)
        return None
    if problem:
        raise RuntimeError(f"eagle2 draft_vocab_size {problem}; set it to 0")
    ids = torch.tensor(settings.draft_vocab_ids, dtype=torch.long)
    logger.info(
        "eagle2: drafting from the head's %d most frequent tokens (draft_vocab_size%s)",
        len(ids),
        ": auto" if settings.draft_vocab_auto else "",
    )
    vocab = DraftVocab(ids, weight.detach(), scale=float(processor.scale))
    gemm = platform_gemm(model.lm_head, vocab.weight)
    if gemm is not None:
        vocab.gemm = gemm
    return vocab
