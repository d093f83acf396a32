"""Training conversations as token ids plus assistant-reply masks.

ShareGPT conversations (a seeded held-out/training split) and distilled JSONL files are rendered with the
target's chat template and tokenized; a per-token mask marks the assistant replies, the text the head
will have to draft. ``write_token_ranking`` turns the training replies into ``draft_vocab.json``.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_eagle2 import draft_vocab
from vllm_eagle2_tools.datasets import sharegpt_conversations


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def render_conversation(
    tokenizer: Any, messages: Sequence[dict[str, str]], max_tokens: int
) -> tuple[list[int], list[bool]]:
    """Render with the chat template, tokenize, and mark the tokens of assistant replies.

    The assistant span of turn ``k`` is the text between the rendering of ``messages[:k]`` with the
    generation prompt and the rendering of ``messages[:k+1]`` (reply and end-of-turn marker). Needs a fast
    tokenizer (offsets). Returns at most ``max_tokens`` ids and a mask of the same length.
    """
    text = _render(tokenizer, messages, False)
    spans: list[tuple[int, int]] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start_text = _render(tokenizer, messages[:k], True) if k else ""
        end_text = _render(tokenizer, messages[: k + 1], False)
        if not text.startswith(end_text) or not end_text.startswith(start_text):
            start_text = _render(tokenizer, messages[:k], False) if k else ""
            if not (text.startswith(end_text) and end_text.startswith(start_text)):
                raise ValueError("chat template renders are not prefixes of each other; cannot mask replies")
        spans.append((len(start_text), len(end_text)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])[:max_tokens]
    offsets = list(enc["offset_mapping"])[:max_tokens]
    mask = [any(s <= a < e for s, e in spans) for a, _ in offsets]
    return ids, mask


@dataclass
class Sequences:
    """Tokenized conversations of one split: ids, assistant masks, and ShareGPT ids."""

    ids: list[list[int]] = field(default_factory=list)
    masks: list[list[bool]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Total tokens."""
        return sum(len(x) for x in self.ids)

    @property
    def num_masked(self) -> int:
        """Total assistant tokens."""
        return sum(sum(m) for m in self.masks)


def select_conversations(
    tokenizer: Any,
    num_train: int,
    num_eval: int,
    max_tokens: int,
    seed: int,
    min_assistant_tokens: int = 16,
) -> tuple[Sequences, Sequences, dict[str, int]]:
    """Seeded choice of held-out and training conversations from ShareGPT (disjoint).

    The whole file is read (about 17.6k conversations), shuffled with ``seed``; the held-out set takes the
    first usable ones, the training set the next. A conversation is usable when its truncated rendering
    keeps at least ``min_assistant_tokens`` assistant tokens. Returns (train, eval, counts).
    """
    items = list(sharegpt_conversations())
    total = len(items)
    items = [(n, m) for n, m in items if m]
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    splits = (Sequences(), Sequences())
    wanted = (num_eval, num_train)
    skipped = 0
    split = 0
    for idx in order:
        while split < 2 and len(splits[split].ids) >= wanted[split]:
            split += 1
        if split >= 2:
            break
        name, messages = items[idx]
        ids, mask = render_conversation(tokenizer, messages, max_tokens)
        if sum(mask) < min_assistant_tokens:
            skipped += 1
            continue
        splits[split].ids.append(ids)
        splits[split].masks.append(mask)
        splits[split].names.append(name)
    eval_set, train_set = splits
    counts = {"sharegpt_items_read": total, "usable_items": len(items), "skipped_short": skipped}
    return train_set, eval_set, counts


def load_distilled(
    tokenizer: Any, paths: Sequence[Path], max_tokens: int, exclude: set[str] = frozenset()
) -> Sequences:
    """Conversations written by ``scripts/distill_target.py`` (JSONL of ``{"id", "messages"}``).

    Rendered and masked like ShareGPT ones; ids in ``exclude`` (the held-out ShareGPT set) are dropped,
    so a distilled reply to a held-out prompt never reaches training.
    """
    out = Sequences()
    for path in paths:
        if not path.exists():
            raise SystemExit(f"error: no distilled file {path} (write it with scripts/distill_target.py)")
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            if item["id"] in exclude:
                continue
            ids, mask = render_conversation(tokenizer, item["messages"], max_tokens)
            if sum(mask) < 2:
                continue
            out.ids.append(ids)
            out.masks.append(mask)
            out.names.append(item["id"])
    return out


def write_token_ranking(out_dir: Path, seqs: Sequences, source: str) -> Path:
    """``out_dir/draft_vocab.json``: the assistant-reply tokens of ``seqs``, most frequent first.

    The plugin's ``draft_vocab_size: N`` drafts from the first N (see ``vllm_eagle2.draft_vocab``).
    """
    counts = Counter(t for ids, mask in zip(seqs.ids, seqs.masks) for t, m in zip(ids, mask) if m)
    ranked = counts.most_common()
    out_dir.mkdir(parents=True, exist_ok=True)
    return draft_vocab.write_ranking(out_dir, [t for t, _ in ranked], [c for _, c in ranked], source)
