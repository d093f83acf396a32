"""A reduced draft vocabulary: the head scores only the tokens the target emits most.

The draft head shares the target's ``lm_head``; for SmolLM2 (hidden 576, 49,152 tokens) that
matmul is about 85% of a head pass's FLOPs, and its log-softmax and top-k run over 49k columns
for every expanded node. Drafts are only proposals: the verifier checks each one against the
target's full distribution, and sampled verification treats them as point masses (it never
reads the draft's probabilities). So scoring a subset changes how much is accepted, never what
is emitted. (Measured on 2 CPU cores with SmolLM2 and N = 8,192: the same acceptance and 1.22-1.34x
the tokens/s of drafting from the whole vocabulary, see the README's results.)

``draft_vocab.json`` in the head folder ranks token ids by how often the target emits them
(``scripts/train_eagle_head.py`` writes it from its training data); ``draft_vocab_size: N`` in
``speculative_config`` drafts from the first N; ``"auto"``, the default, from the first
:func:`covering_size` (the whole vocabulary for a head without a ranking).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

FILE_NAME = "draft_vocab.json"
#: ``draft_vocab_size: "auto"`` keeps the most frequent tokens that make up this share of the
#: ranking's counts: 8,714 of SmolLM2's 49,152 (they cover 92-93% of its MT-bench answers; drafts
#: for rarer tokens are seldom accepted).
COVERAGE = 0.97


def write_ranking(head: str | Path, token_ids: Sequence[int], counts: Sequence[int], source: str) -> Path:
    """Write ``head/draft_vocab.json``: ``token_ids`` most frequent first, their ``counts``."""
    if len(token_ids) != len(counts):
        raise ValueError(f"{len(token_ids)} token ids but {len(counts)} counts")
    path = Path(head) / FILE_NAME
    path.write_text(
        json.dumps(
            {"source": source, "token_ids": [int(t) for t in token_ids], "counts": [int(c) for c in counts]}
        )
    )
    return path


def _read(head: str | Path, key: str) -> list[Any]:
    path = Path(head) / FILE_NAME
    if not path.is_file():
        raise ValueError(f"no {FILE_NAME} in {head}")
    try:
        values = json.loads(path.read_text())[key]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a draft vocabulary ({exc})") from exc
    if not isinstance(values, list) or not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(f"{path}: {key} must be a list of non-negative integers")
    return values


def read_ranking(head: str | Path) -> list[int]:
    """The ranked token ids of ``head/draft_vocab.json``; raises ValueError if absent or malformed."""
    ids = _read(head, "token_ids")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{Path(head) / FILE_NAME}: token_ids must be distinct")
    return ids


def covering_size(head: str | Path, coverage: float = COVERAGE) -> int:
    """The fewest top-ranked tokens whose counts in ``head/draft_vocab.json`` reach ``coverage``
    of all counted tokens; raises ValueError if the file is absent or malformed."""
    counts = _read(head, "counts")
    if len(counts) != len(read_ranking(head)) or not sum(counts):
        raise ValueError(f"{Path(head) / FILE_NAME}: counts must match token_ids and not all be 0")
    total, running = sum(counts), 0
    for n, count in enumerate(counts, 1):
        running += count
        if running >= coverage * total:
            return n
    return len(counts)


class DraftVocab:
    """The target's ``lm_head`` cut to a sorted subset of token ids.

    ids: [V'] int64 token ids, ascending (so a subset that is the whole vocabulary scores
    exactly like the full head). weight: [V', H] the matching rows of ``lm_head``.
    """

    def __init__(self, ids: torch.Tensor, lm_head_weight: torch.Tensor, scale: float = 1.0) -> None:
        self.ids = ids.long().sort().values.to(lm_head_weight.device)
        self.weight = lm_head_weight.index_select(0, self.ids)
        self.scale = scale
        #: [N, H] -> [N, V'] product with :attr:`weight`; a caller may swap in the platform's own kernel.
        self.gemm: Callable[[torch.Tensor], torch.Tensor] = self._torch_gemm

    def _torch_gemm(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] head outputs -> [N, V'] logits over the subset, in the weight's dtype.

        Not normalised: the tree build's vocabulary top-k normalises only its winners.
        """
        logits = self.gemm(hidden.to(self.weight.dtype).contiguous())
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Subset positions (any shape, int64, -1 = padding, kept) -> token ids."""
        return torch.where(index >= 0, self.ids[index.clamp(min=0)], index)


def platform_gemm(lm_head: Any, weight: torch.Tensor) -> Any:
    """[N, H] -> [N, V'] product with ``weight`` (rows of ``lm_head``'s) by the kernel vLLM gives an
    unquantized ``lm_head`` on this platform; None for any other ``lm_head``.

    On CPU that is oneDNN with a packed weight: for 8,714 x 576 fp32 on 2 AVX2 cores, with the caches
    cold as after a target pass, 2.2 ms against torch's 3.9 ms for one row, 2.5 against 8.0 for four.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    method = getattr(lm_head, "quant_method", None)
    if not isinstance(method, UnquantizedEmbeddingMethod):
        return None
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    method.process_weights_after_loading(layer)
    return lambda hidden: method.apply(layer, hidden)
