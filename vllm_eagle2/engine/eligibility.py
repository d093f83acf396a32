"""Which requests get drafts: the tree verifier applies temperature, top-k and top-p only."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams


def supports_tree_drafting(sampling_params: SamplingParams) -> bool:
    """Whether the tree verifier reproduces this request's sampler exactly.

    Penalties, logit processors and grammars look at the tokens before each position; the
    tree verifier applies temperature, top-k and top-p only. Such requests are decoded
    without drafts, which is lossless too.
    """
    sp = sampling_params
    if sp is None:
        return True
    return (
        all(getattr(sp, name) == neutral for name, neutral in _NEUTRAL_SAMPLING.items())
        and not sp.logit_bias
        and not sp.allowed_token_ids
        and not sp.bad_words
        and sp.structured_outputs is None
        and not getattr(sp, "logits_processors", None)
    )


#: Sampling settings the tree verifier does not apply, at their neutral values.
_NEUTRAL_SAMPLING = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
    "min_tokens": 0,
}


def drafting_blockers(defaults: dict[str, Any]) -> list[str]:
    """The settings of a model's default sampling parameters (vLLM reads them from its
    ``generation_config.json``) under which its requests get no drafts, as ``name=value``.

    Qwen's ``repetition_penalty`` 1.05 is one: every request that keeps it is decoded without
    drafts, which is lossless but no faster.
    """
    return [f"{k}={defaults[k]}" for k, v in _NEUTRAL_SAMPLING.items() if k in defaults and defaults[k] != v]


def warn_of_default_blockers(defaults: dict[str, Any]) -> None:
    """Warn once, at engine start, where the model's generation config (``defaults``) sets a
    sampling parameter that keeps requests from drafting (:func:`drafting_blockers`)."""
    blockers = drafting_blockers(defaults)
    if blockers:
        logging.getLogger("vllm.eagle2").warning(
            "eagle2: the model's generation config sets %s by default: requests that keep it are "
            "decoded without drafts (the tree verifier applies temperature, top-k and top-p only). "
            "To draft, start vLLM with --generation-config vllm or send neutral values per request.",
            ", ".join(blockers),
        )


class EligibleRequests:
    """Per request id, cached: whether the tree verifier reproduces its sampling exactly.

    refused: requests decoded without drafts so far (``eagle2_stats``' ``requests_without_drafts``).
    """

    def __init__(self) -> None:
        self._known: dict[str, bool] = {}
        self.refused = 0

    def rows(self, requests: dict[str, Any], req_ids: list[str]) -> list[bool]:
        """``requests``: the runner's request states by id."""
        for rid in req_ids:
            if rid not in self._known:
                state = requests.get(rid)
                self._known[rid] = supports_tree_drafting(getattr(state, "sampling_params", None))
                self.refused += not self._known[rid]
        return [self._known[rid] for rid in req_ids]

    def forget(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self._known.pop(rid, None)
