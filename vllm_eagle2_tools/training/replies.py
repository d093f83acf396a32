"""Distilled replies: the target's own greedy or sampled answers to fixed prompt sets, small to commit.

An EAGLE head learns to predict the target, so its best data is the target's own replies. They take
the longest to make (hours on a CPU) and are the smallest part of the recipe (token ids, not features),
so they are committed and outlive any machine. A replies folder (``data/replies/``) holds:

- ``manifest.json``: the target's identity, each prompt set's source and order, and every slice with
  its prompt range, generation settings, counts and sha256 (:func:`verify` checks them);
- ``prompts-<set>.npz``: the prompt set, chat-template token ids with the generation prompt,
  ``names`` [n] str, ``tokens`` [T] uint16, ``offsets`` [n + 1] int64;
- ``<series>-<k:05d>.npz``: slice k of a series of replies to one prompt set, the replies to its
  prompts ``[start, end)``, packed the same way (``tokens``, ``offsets``); a reply that ended keeps its
  end-of-turn token. The greedy series is named after its prompt set (``sharegpt-00000.npz``);
  another series (``sharegpt-t1``: one sampled reply per prompt) records its name as ``series``.

Slices are filled in order, each in one go (:func:`next_slice`), so generation resumes on any machine.
Nothing here imports vLLM: a GPU machine with torch and transformers fills slices too.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

MANIFEST = "manifest.json"
FORMAT = 1


def pack(seqs: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """Token lists -> ``tokens`` [T] uint16 and ``offsets`` [n + 1] int64 (sequence i is
    ``tokens[offsets[i]:offsets[i + 1]]``)."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(lengths.sum()))
    if flat.size and (flat.min() < 0 or flat.max() >= 1 << 16):
        raise ValueError("token ids must fit in uint16 (vocabularies up to 65,536)")
    return {"tokens": flat.astype(np.uint16), "offsets": np.concatenate([[0], np.cumsum(lengths)])}


def unpack(data: Any) -> list[list[int]]:
    """Inverse of :func:`pack` (``data`` maps ``tokens`` and ``offsets``)."""
    tokens, off = data["tokens"].astype(np.int64), data["offsets"]
    return [tokens[off[i] : off[i + 1]].tolist() for i in range(len(off) - 1)]


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_manifest(folder: Path) -> dict[str, Any]:
    """The folder's manifest; an empty one (no prompt sets, no slices) when there is none yet."""
    path = folder / MANIFEST
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    return {"format": FORMAT, "target": {}, "prompt_sets": {}, "slices": []}


def save_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest atomically (a cut run never leaves half a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    tmp.replace(folder / MANIFEST)


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> str:
    """``np.savez_compressed`` to ``path`` (atomically); returns the file's sha256."""
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)
    return sha256(path)


def add_prompt_set(
    folder: Path, name: str, names: Sequence[str], ids: Sequence[Sequence[int]], info: dict[str, Any]
) -> None:
    """Store prompt set ``name`` (``names`` and chat-template ``ids`` per prompt) and record it with
    ``info`` (source, order, filters) in the manifest. A set is written once: its slices index it."""
    manifest = load_manifest(folder)
    if name in manifest["prompt_sets"]:
        raise ValueError(f"prompt set {name!r} already exists in {folder}")
    file = f"prompts-{name}.npz"
    digest = _save_npz(folder / file, {"names": np.array(list(names)), **pack(ids)})
    manifest["prompt_sets"][name] = {"file": file, "count": len(ids), "sha256": digest, **info}
    save_manifest(folder, manifest)


def prompt_set(folder: Path, name: str) -> tuple[list[str], list[list[int]]]:
    """(names, token ids) of prompt set ``name``."""
    entry = load_manifest(folder)["prompt_sets"].get(name)
    if entry is None:
        raise SystemExit(f"error: no prompt set {name!r} in {folder / MANIFEST}")
    with np.load(folder / entry["file"]) as data:
        return [str(x) for x in data["names"]], unpack(data)


def series_of(entry: dict[str, Any]) -> str:
    """The series a manifest slice belongs to (its prompt set's name for the greedy series)."""
    return entry.get("series", entry["prompts"])


def next_slice(
    folder: Path, name: str, slice_size: int, series: str | None = None
) -> tuple[int, int, int] | None:
    """(k, start, end) of the next slice of ``series`` (default: the greedy one) over prompt set
    ``name`` to fill, or None when all are done."""
    manifest = load_manifest(folder)
    done = [s for s in manifest["slices"] if series_of(s) == (series or name)]
    start = max((s["end"] for s in done), default=0)
    count = manifest["prompt_sets"][name]["count"]
    if start >= count:
        return None
    return len(done), start, min(start + slice_size, count)


def add_slice(
    folder: Path,
    name: str,
    k: int,
    start: int,
    replies: Sequence[Sequence[int]],
    info: dict[str, Any],
    series: str | None = None,
) -> Path:
    """Store slice ``k`` of ``series`` (default: greedy; the replies to prompts ``[start, start +
    len(replies))`` of set ``name``) and record it with ``info`` (engine, dtype, settings, seconds)."""
    file = f"{series or name}-{k:05d}.npz"
    digest = _save_npz(folder / file, pack(replies))
    manifest = load_manifest(folder)
    manifest["slices"].append(
        {
            "file": file,
            "prompts": name,
            **({"series": series} if series and series != name else {}),
            "start": start,
            "end": start + len(replies),
            "reply_tokens": sum(len(r) for r in replies),
            "sha256": digest,
            **info,
        }
    )
    save_manifest(folder, manifest)
    return folder / file


def verify(folder: Path) -> list[str]:
    """Every way the folder disagrees with its manifest (checksums, counts, gaps); [] when it matches."""
    manifest = load_manifest(folder)
    problems: list[str] = []
    for name, entry in manifest["prompt_sets"].items():
        path = folder / entry["file"]
        if not path.exists() or sha256(path) != entry["sha256"]:
            problems.append(f"prompt set {name}: {entry['file']} missing or its sha256 differs")
            continue
        with np.load(path) as data:
            if len(data["offsets"]) - 1 != entry["count"] or len(data["names"]) != entry["count"]:
                problems.append(f"prompt set {name}: {entry['count']} prompts recorded, file differs")
    ends: dict[str, int] = {}
    for s in manifest["slices"]:
        path = folder / s["file"]
        key = series_of(s)
        if s["start"] != ends.get(key, 0):
            ended = ends.get(key, 0)
            problems.append(f"{s['file']}: starts at {s['start']}, previous slice ended at {ended}")
        ends[key] = s["end"]
        if not path.exists() or sha256(path) != s["sha256"]:
            problems.append(f"{s['file']}: missing or its sha256 differs")
            continue
        with np.load(path) as data:
            n, tokens = len(data["offsets"]) - 1, int(data["offsets"][-1])
        if n != s["end"] - s["start"] or tokens != s["reply_tokens"]:
            problems.append(f"{s['file']}: {n} replies / {tokens} tokens, manifest says otherwise")
    prompts_of = {series_of(s): s["prompts"] for s in manifest["slices"]}
    for key, end in ends.items():
        if end > manifest["prompt_sets"].get(prompts_of[key], {}).get("count", 0):
            problems.append(f"slices of {key} run past its prompt set")
    return problems


def conversations(
    folder: Path, name: str, max_tokens: int, exclude: set[str] = frozenset(), limit: int | None = None
) -> tuple[list[str], list[list[int]], list[list[bool]]]:
    """Training sequences from every slice of every series over prompt set ``name``: (names, prompt +
    reply ids cut to ``max_tokens``, masks marking the reply tokens; a prompt with replies in two
    series gives two sequences of one name). Prompts named in ``exclude`` (held out), prompts from
    index ``limit`` on (None: all) and replies under 2 tokens are left out."""
    names, prompts = prompt_set(folder, name)
    out: tuple[list[str], list[list[int]], list[list[bool]]] = ([], [], [])
    for s in load_manifest(folder)["slices"]:
        if s["prompts"] != name:
            continue
        with np.load(folder / s["file"]) as data:
            replies = unpack(data)
        for i, reply in zip(range(s["start"], s["end"]), replies):
            if names[i] in exclude or len(reply) < 2 or (limit is not None and i >= limit):
                continue
            ids = (prompts[i] + reply)[:max_tokens]
            out[0].append(names[i])
            out[1].append(ids)
            out[2].append([j >= len(prompts[i]) for j in range(len(ids))])
    return out


@torch.inference_mode()
def generate_batched(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int,
    eos_id: int,
    pad_id: int,
    progress: Callable[[int, int], None] | None = None,
    temperature: float = 0.0,
) -> list[list[int]]:
    """The replies of a transformers causal LM to ``prompts`` (token ids), on the model's device:
    greedy at ``temperature`` 0, else sampled from the whole distribution at that temperature (no
    top-k / top-p; seed torch's generator first for reproducible draws).

    Prompts are sorted by length and left-padded in batches of ``batch_size``, so padding stays small.
    Each reply stops after its first ``eos_id`` (kept) or at ``max_new_tokens``. ``progress(done,
    tokens)`` is called after each batch. Returns the replies in the order of ``prompts``.
    """
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    replies: list[list[int]] = [[] for _ in prompts]
    done = tokens = 0
    for b in range(0, len(order), batch_size):
        rows = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            n = len(prompts[i])
            ids[r, width - n :] = torch.tensor(prompts[i], dtype=torch.long)
            mask[r, width - n :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            **(
                {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                if temperature > 0
                else {"do_sample": False}
            ),
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
        for r, row in enumerate(out[:, width:].cpu().tolist()):
            cut = row.index(eos_id) + 1 if eos_id in row else len(row)
            replies[rows[r]] = row[:cut]
            tokens += cut
        done += len(rows)
        if progress is not None:
            progress(done, tokens)
    return replies


def fill_slices(
    folder: Path,
    name: str,
    generate: Callable[[list[list[int]]], list[list[int]]],
    slice_size: int,
    info: dict[str, Any],
    deadline: float | None = None,
    max_slices: int | None = None,
    log: Callable[[str], None] = print,
    series: str | None = None,
) -> int:
    """Fill the next slices of ``series`` (default: greedy) over prompt set ``name`` with
    ``generate(prompts) -> replies`` until all are done, ``max_slices`` are written, or
    ``time.monotonic()`` passes ``deadline`` (checked between slices); ``info`` (engine, settings) is
    recorded with each. Returns the slices written."""
    _, prompts = prompt_set(folder, name)
    written = 0
    while (nxt := next_slice(folder, name, slice_size, series)) is not None:
        if (deadline is not None and time.monotonic() > deadline) or written == max_slices:
            break
        k, start, end = nxt
        t0 = time.perf_counter()
        out = generate(prompts[start:end])
        seconds = time.perf_counter() - t0
        path = add_slice(folder, name, k, start, out, {**info, "seconds": round(seconds, 1)}, series)
        tokens = sum(len(r) for r in out)
        log(
            f"{path.name}: {end - start} replies, {tokens} tokens in {seconds:.0f} s "
            f"({tokens / seconds:.0f} tok/s)"
        )
        written += 1
    return written
