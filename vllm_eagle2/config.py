"""The eagle2 knobs of ``speculative_config`` and their validation (no vLLM imports).

Users write ``{"method": "eagle2", "model": HEAD, "num_speculative_tokens": m, "depth": 6,
"topk": 10, "tree": "dynamic", "budget": "adaptive", "draft_vocab_size": "auto", "lookup": 8,
"lookup_cache": 0}``. vLLM's own config class rejects unknown keys, so the plugin pops the eagle2 keys
here, validates everything that can be checked without weights, and hands the rest to vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_eagle2 import draft_vocab
from vllm_eagle2.tree import tree_size, validate_tree_args

#: ``kv_cache_dtype`` values of an unquantized cache, the only kind eagle2's tree attention reads.
UNQUANTIZED_KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")

#: The paper's defaults (7-8B targets): m = 60 verified nodes, 6 levels, top-10.
DEFAULT_DEPTH = 6
DEFAULT_TOPK = 10
DEFAULT_NUM_TOKENS = 60
DEFAULT_TREE = "dynamic"
#: ``adaptive``: each step drafts and verifies what pays on this machine at this batch size,
#: with m, depth and topk as upper bounds (:mod:`vllm_eagle2.budget.adaptive`); ``fixed``: always
#: the full (m, depth, topk) tree.
BUDGETS = ("adaptive", "fixed")
DEFAULT_BUDGET = "adaptive"
#: ``draft_vocab_size: "auto"``: the head's most frequent tokens covering
#: :data:`vllm_eagle2.draft_vocab.COVERAGE` of its ranking, when the head ships one and its
#: format and the parallelism allow it; else the whole vocabulary.
AUTO = "auto"
#: ``lookup: L`` grafts into every tree a chain of up to L tokens that continues the longest
#: repeated suffix of the request's own text (:mod:`vllm_eagle2.engine.lookup_drafts`); 0 = off.
#: On by default in ``dynamic`` trees (the only ones it grafts into), 0 in the others.
DEFAULT_LOOKUP = 8
MAX_LOOKUP = 64
#: ``lookup_cache: N`` lets chains also continue spans of finished requests' outputs, the last N
#: to 2N tokens of them (:class:`vllm_eagle2.lookup.OutputCache`); 0 = off, the default (not yet
#: measured on a benchmark: a cache pays only where requests repeat each other).
MAX_LOOKUP_CACHE = 1 << 22
EXTRA_KEYS = ("depth", "topk", "tree", "budget", "draft_vocab_size", "lookup", "lookup_cache")


class Eagle2ConfigError(ValueError):
    """An invalid eagle2 setting; the message names the field and what is allowed."""


_FLAG_VALUES = {
    **dict.fromkeys(("1", "true", "on", "yes"), True),
    **dict.fromkeys(("0", "false", "off", "no"), False),
}


def env_flag(name: str, *, default: bool) -> bool:
    """An on/off environment variable: unset is ``default``; 1/true/on/yes or 0/false/off/no
    (any case); anything else is an Eagle2ConfigError naming the variable and those values."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = _FLAG_VALUES.get(raw.strip().lower())
    if value is None:
        raise Eagle2ConfigError(f"{name} must be one of {', '.join(_FLAG_VALUES)}; got {raw!r}")
    return value


@dataclass(frozen=True)
class Eagle2Settings:
    """Validated eagle2 settings.

    num_nodes: tree nodes verified per step (the paper's m, vLLM's num_speculative_tokens).
    depth: draft levels; topk: children per expanded node and frontier width.
    tree: one of :data:`vllm_eagle2.tree.TREE_MODES`.
    budget: one of :data:`BUDGETS`; with ``adaptive`` the three sizes above are upper bounds.
    draft_vocab_size: draft from the head's N most frequent tokens (0: the whole vocabulary),
    see :mod:`vllm_eagle2.draft_vocab`; None until the plugin resolves ``"auto"`` against the
    head (:func:`resolve_draft_vocab`). draft_vocab_auto: the user left it at ``"auto"`` (a
    head that cannot cut its ``lm_head`` then drafts from the whole vocabulary instead of
    failing). draft_vocab_ids: the N token ids, read from the head folder by the plugin.
    head_format: the head's checkpoint format, ``eagle`` or ``eagle3`` (read from the head folder
    by the plugin, :func:`vllm_eagle2.head_files.check_head`).
    lookup: tokens per lookup chain grafted into each tree (0 = none; ``dynamic`` trees only).
    lookup_cache: tokens of finished requests' outputs the chains may continue too (0 = none).
    """

    num_nodes: int = DEFAULT_NUM_TOKENS
    depth: int = DEFAULT_DEPTH
    topk: int = DEFAULT_TOPK
    tree: str = DEFAULT_TREE
    budget: str = DEFAULT_BUDGET
    draft_vocab_size: int | None = None
    draft_vocab_auto: bool = True
    draft_vocab_ids: tuple[int, ...] = field(default=(), repr=False)
    head_format: str = "eagle"
    lookup: int = DEFAULT_LOOKUP
    lookup_cache: int = 0

    @property
    def nodes_per_step(self) -> int:
        """Draft tokens sent to the target per step (fewer than m in ``chain`` mode)."""
        return tree_size(self.tree, self.depth, self.topk, self.num_nodes)

    @property
    def draft_kv_slots(self) -> int:
        """KV slots the draft tree writes past a request's end (expanded frontier nodes)."""
        width = 1 if self.tree == "chain" else self.topk
        return (self.depth - 1) * width


#: The speculative_config fields of the tree's arguments, for its error messages.
_TREE_FIELDS = {
    "mode": "speculative_config.tree",
    "depth": "speculative_config.depth",
    "topk": "speculative_config.topk",
    "num_nodes": "speculative_config.num_speculative_tokens",
}


def _int_field(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise Eagle2ConfigError(f"speculative_config.{name} must be {allowed}; got {value!r}")
    return value


def parse_settings(spec: dict[str, Any]) -> Eagle2Settings:
    """Validate the eagle2 fields of a speculative_config dict (not modified)."""
    budget = spec.get("budget", DEFAULT_BUDGET)
    if budget not in BUDGETS:
        raise Eagle2ConfigError(
            f"speculative_config.budget must be one of {', '.join(BUDGETS)}; got {budget!r}"
        )
    tree = spec.get("tree", DEFAULT_TREE)
    depth = _int_field("depth", spec.get("depth", DEFAULT_DEPTH), 1, 64)
    topk = _int_field("topk", spec.get("topk", DEFAULT_TOPK), 1, 64)
    raw_m = spec.get("num_speculative_tokens")
    num_nodes = _int_field("num_speculative_tokens", DEFAULT_NUM_TOKENS if raw_m is None else raw_m, 1)
    try:
        validate_tree_args(tree, depth, topk, num_nodes, names=_TREE_FIELDS)
    except ValueError as exc:
        raise Eagle2ConfigError(str(exc)) from None
    raw_vocab = spec.get("draft_vocab_size", AUTO)
    draft_vocab_size = None if raw_vocab == AUTO else _vocab_field(raw_vocab)
    if draft_vocab_size is not None and 0 < draft_vocab_size < topk:
        raise Eagle2ConfigError(
            f"speculative_config.draft_vocab_size must be 0 (the whole vocabulary) or >= topk ({topk}); "
            f"got {draft_vocab_size}"
        )
    default_lookup = DEFAULT_LOOKUP if tree == "dynamic" else 0
    lookup = _int_field("lookup", spec.get("lookup", default_lookup), 0, MAX_LOOKUP)
    if lookup and tree != "dynamic":
        raise Eagle2ConfigError(
            f"speculative_config.lookup must be 0 with tree {tree!r} (lookup chains are grafted into "
            f"dynamic trees only); got {lookup}"
        )
    lookup_cache = _int_field("lookup_cache", spec.get("lookup_cache", 0), 0, MAX_LOOKUP_CACHE)
    if lookup_cache and not lookup:
        raise Eagle2ConfigError(
            "speculative_config.lookup_cache needs lookup chains (lookup > 0, in a dynamic tree); "
            f"got lookup_cache {lookup_cache} with lookup 0"
        )
    return Eagle2Settings(
        lookup=lookup,
        lookup_cache=lookup_cache,
        num_nodes=num_nodes,
        depth=depth,
        topk=topk,
        tree=tree,
        budget=budget,
        draft_vocab_size=draft_vocab_size,
        draft_vocab_auto=draft_vocab_size is None,
    )


def _vocab_field(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Eagle2ConfigError(
            f'speculative_config.draft_vocab_size must be "{AUTO}", 0 (the whole vocabulary) or a '
            f"positive integer; got {value!r}"
        )
    return value


def resolve_draft_vocab(
    settings: Eagle2Settings,
    head: Any,
    *,
    eagle3_vocab: int,
    tensor_parallel_size: int,
    target_vocab_size: int | None,
) -> Eagle2Settings:
    """``settings`` with the draft vocabulary fixed: ``"auto"`` resolved, the token ids read.

    eagle3_vocab: 0 for a head that drafts over the target's vocabulary; else the size of the
    EAGLE-3 head's own. ``"auto"`` is the whole vocabulary for an EAGLE-3 head (already cut), with
    tensor parallelism (the cut ``lm_head`` is unsharded) and for a head without a ranking;
    otherwise the head's most frequent tokens covering :data:`draft_vocab.COVERAGE` of its
    ranking's counts (at least ``topk``). An explicit size those rule out is an Eagle2ConfigError.
    """
    size = settings.draft_vocab_size
    if size is None:
        path = Path(str(head)).expanduser()
        size = 0
        if not eagle3_vocab and tensor_parallel_size == 1 and (path / draft_vocab.FILE_NAME).is_file():
            try:
                ranked = len(draft_vocab.read_ranking(path))
                # A ranking shorter than topk cannot fill a frontier: the whole vocabulary instead.
                size = max(draft_vocab.covering_size(path), settings.topk) if ranked >= settings.topk else 0
            except ValueError as exc:
                raise Eagle2ConfigError(
                    f'speculative_config.draft_vocab_size="{AUTO}" reads the head\'s token ranking: {exc} '
                    "(rewrite it with scripts/train_eagle_head.py --draft-vocab-only, or set "
                    "draft_vocab_size to 0)"
                ) from exc
    elif size and eagle3_vocab:
        raise Eagle2ConfigError(
            "speculative_config.draft_vocab_size must be 0 with an EAGLE-3 head (it drafts over its "
            f"own vocabulary of {eagle3_vocab} tokens); got {size}"
        )
    elif size and tensor_parallel_size > 1:
        raise Eagle2ConfigError(
            "speculative_config.draft_vocab_size must be 0 with tensor_parallel_size > 1 "
            f"(the draft vocabulary cuts an unsharded lm_head); got {size}"
        )
    ids = tuple(check_draft_vocab(head, size, target_vocab_size)) if size else ()
    return replace(settings, draft_vocab_size=size, draft_vocab_ids=ids)


def check_draft_vocab(head: Any, size: int, target_vocab_size: int | None) -> list[int]:
    """The ``size`` token ids the head drafts from (its ``draft_vocab.json``, most frequent first).

    Raises Eagle2ConfigError, before any weights load, when the file is missing or broken, ranks
    fewer than ``size`` tokens, or names a token outside the target's vocabulary.
    """
    try:
        ranking = draft_vocab.read_ranking(Path(str(head)).expanduser())
    except ValueError as exc:
        raise Eagle2ConfigError(
            f"speculative_config.draft_vocab_size={size} needs the head's token ranking: {exc} "
            "(write it with scripts/train_eagle_head.py --draft-vocab-only, or set draft_vocab_size to 0)"
        ) from exc
    if size > len(ranking):
        raise Eagle2ConfigError(
            f"speculative_config.draft_vocab_size must be in [topk, {len(ranking)}] for this head (its "
            f"{draft_vocab.FILE_NAME} ranks {len(ranking)} tokens) or 0 (the whole vocabulary); got {size}"
        )
    chosen = ranking[:size]
    if target_vocab_size is not None and max(chosen) >= target_vocab_size:
        raise Eagle2ConfigError(
            f"speculative_config.model: {draft_vocab.FILE_NAME} names token {max(chosen)}, outside the "
            f"target's vocabulary of {target_vocab_size}: {head}"
        )
    return chosen
