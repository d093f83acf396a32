"""The target's features: frozen tensors, content-addressed feature shards, and their fingerprints.

The target runs in bfloat16 over every conversation; its last hidden state after the final norm, the
token ids, the reply mask and its top-K next-token log-probs go to safetensors shards under
``<feature root>/<fingerprint>/``, shared through ``<feature root>/by-content/`` between runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_eagle2_tools.training import log
from vllm_eagle2_tools.training.conversations import Sequences

FEATURE_FORMAT = 2  # bump when the shard layout changes (2: target top-K log-probs stored)
TARGET_TOPK = 16  # target log-probs kept per position: the reduced-vocabulary loss's soft labels


def load_target_tensors(target_dir: Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Read the named tensors from the target's safetensors file(s) (sharded or not); missing are left out."""
    from safetensors import safe_open

    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"error: no .safetensors files in {target_dir}")
    out: dict[str, torch.Tensor] = {}
    wanted = set(names)
    for path in files:
        with safe_open(str(path), "pt") as fh:
            for key in wanted & set(fh.keys()):
                out[key] = fh.get_tensor(key)
    return out


def frozen_target_weights(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and ``lm_head`` ([V, H] each; tied models give the same tensor)."""
    sd = load_target_tensors(target_dir, ["model.embed_tokens.weight", "lm_head.weight"])
    if "model.embed_tokens.weight" not in sd:
        raise SystemExit(f"error: {target_dir} has no model.embed_tokens.weight (not a Llama-family folder?)")
    embed = sd["model.embed_tokens.weight"]
    return embed, sd.get("lm_head.weight", embed)


def shard_plan(seqs: Sequences, shard_tokens: int) -> list[list[int]]:
    """Sequence indices per shard: consecutive sequences up to ``shard_tokens`` tokens (at least one)."""
    plan: list[list[int]] = [[]]
    count = 0
    for i, ids in enumerate(seqs.ids):
        if plan[-1] and count + len(ids) > shard_tokens:
            plan.append([])
            count = 0
        plan[-1].append(i)
        count += len(ids)
    return plan


def planned_shards(seqs: Sequences, split: str, shard_tokens: int) -> list[dict[str, Any]]:
    """The shard list of a split (file name, sequence lengths) before any file exists."""
    return [
        {"file": f"{split}-{k:05d}.safetensors", "lengths": [len(seqs.ids[i]) for i in members]}
        for k, members in enumerate(shard_plan(seqs, shard_tokens))
    ]


def shard_tensors(
    inner: nn.Module,
    lm_head: torch.Tensor,
    seqs: Sequences,
    members: list[int],
    batch: int,
    aux_layers: Sequence[int],
    target_topk: int,
    bar: Any,
) -> dict[str, torch.Tensor]:
    """One shard's tensors (see :func:`write_feature_shards`) for the sequences ``members``."""
    device = lm_head.device
    hidden: list[torch.Tensor] = []
    aux: list[torch.Tensor] = []
    top_ids: list[torch.Tensor] = []
    top_logp: list[torch.Tensor] = []
    # Sequences go through the target `batch` at a time, right-padded: causal attention keeps
    # the padding out of every real position (one at a time on a CPU, many per launch on a GPU).
    for b in range(0, len(members), batch):
        group = members[b : b + batch]
        lens = [len(seqs.ids[i]) for i in group]
        ids = torch.zeros((len(group), max(lens)), dtype=torch.long)
        for r, i in enumerate(group):
            ids[r, : lens[r]] = torch.tensor(seqs.ids[i], dtype=torch.long)
        keep = torch.arange(ids.shape[1])[None, :] < torch.tensor(lens)[:, None]
        with torch.inference_mode():
            out = inner(
                input_ids=ids.to(device),
                attention_mask=keep.long().to(device) if len(group) > 1 else None,
                output_hidden_states=bool(aux_layers),
            )
            rows = keep.flatten().to(device)
            h = out.last_hidden_state.flatten(0, 1)[rows].to(torch.bfloat16)
            if aux_layers:
                layers = [out.hidden_states[j].flatten(0, 1)[rows] for j in aux_layers]
                aux.append(torch.cat(layers, -1).to(torch.bfloat16).cpu())
            # From the stored (bf16) hidden state, as the loss recomputes it, in lm_head's dtype: the
            # target's, so bf16 only where the precision chose it (emulated on an AVX2 CPU, this one
            # product held the feature pass to 150 tok/s).
            logp = torch.log_softmax((h.to(lm_head.dtype) @ lm_head.T).float(), -1)
            val, idx = logp.topk(min(target_topk, logp.shape[-1]), -1)
        hidden.append(h.cpu())
        top_ids.append(idx.to(torch.int32).cpu())
        top_logp.append(val.cpu())
        bar.update(sum(lens))
    lengths = torch.tensor([len(seqs.ids[i]) for i in members], dtype=torch.long)
    tensors = {
        "tokens": torch.tensor([t for i in members for t in seqs.ids[i]], dtype=torch.int32),
        "hidden": torch.cat(hidden).contiguous(),
        "mask": torch.tensor([m for i in members for m in seqs.masks[i]], dtype=torch.bool),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "topk_ids": torch.cat(top_ids).contiguous(),
        "topk_logp": torch.cat(top_logp).contiguous(),
    }
    if aux:
        tensors["aux"] = torch.cat(aux).contiguous()
    return tensors


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Save a shard atomically: a reader never sees half of one."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def write_feature_shards(
    model: nn.Module,
    seqs: Sequences,
    out_dir: Path,
    split: str,
    shard_tokens: int,
    desc: str | None = None,
    target_topk: int = TARGET_TOPK,
    aux_layers: Sequence[int] = (),
    store: Path | None = None,
    identity: bytes = b"",
    batch: int = 1,
) -> list[dict[str, Any]]:
    """Run ``model`` (a transformers causal LM) over every sequence and write bf16 feature shards.

    Shard ``{split}-{k:05d}.safetensors`` holds ``tokens`` int32 [N], ``hidden`` bf16 [N, H] (the last
    hidden state after the final norm), ``mask`` bool [N] (assistant tokens), ``offsets`` int64
    [n+1] (sequence starts), and the target's next-token distribution at each position, cut to its
    ``target_topk`` most likely tokens: ``topk_ids`` int32 [N, K] (most likely first) and
    ``topk_logp`` float32 [N, K] (full-vocabulary log-probs of ``lm_head(hidden)`` in the target's dtype,
    from the stored bf16 hidden state, the logits the training loss used to recompute every epoch).
    With ``aux_layers`` also ``aux`` bf16
    [N, len(aux_layers) * H]: the residual stream entering each of those target layers (transformers'
    ``hidden_states[l]``), side by side in the given order (EAGLE-3's low/middle-layer features).
    The split of sequences into shards is fixed by their lengths, and existing shards are kept, so an
    interrupted extraction resumes. With ``store`` every shard is also hard-linked there under
    :func:`shard_key` of ``identity`` (the model's, :func:`feature_identity`) and its sequences, and a
    shard found there is linked instead of computed: a data set that grows by appending files
    extracts only its new shards. ``batch`` sequences go through the target per forward (right-padded).
    Returns the shard list (file, lengths).
    """
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    plan = shard_plan(seqs, shard_tokens)
    shards = planned_shards(seqs, split, shard_tokens)
    names = [shard["file"] for shard in shards]
    keys: list[str] = []
    if store is not None:
        keys = [shard_key(identity, [seqs.ids[i] for i in m], [seqs.masks[i] for i in m]) for m in plan]
        store.mkdir(parents=True, exist_ok=True)
        for name, key in zip(names, keys):
            if not (out_dir / name).exists() and (store / key).exists():
                os.link(store / key, out_dir / name)
    todo = [k for k, name in enumerate(names) if not (out_dir / name).exists()]
    todo_tokens = sum(len(seqs.ids[i]) for k in todo for i in plan[k])
    bar = tqdm(total=todo_tokens, unit="tok", desc=desc or f"features {split}", dynamic_ncols=True)
    inner = getattr(model, "model", model)
    lm_head = model.get_output_embeddings().weight.detach()  # in the target's dtype
    for k in todo:
        name, members = names[k], plan[k]
        tensors = shard_tensors(inner, lm_head, seqs, members, batch, aux_layers, target_topk, bar)
        write_shard(out_dir / name, tensors)
        if store is not None and not (store / keys[k]).exists():
            os.link(out_dir / name, store / keys[k])
    bar.close()
    return shards


def feature_identity(
    target_dir: Path, aux_layers: Sequence[int] = (), dtype: torch.dtype = torch.bfloat16
) -> bytes:
    """What makes two feature extractions of the same tokens equal: the target (config, weight file
    sizes), the shard format, the stored aux layers and the target's dtype."""
    parts = [(target_dir / "config.json").read_bytes()]
    parts += [f"{p.name}:{p.stat().st_size}".encode() for p in sorted(target_dir.glob("*.safetensors"))]
    parts.append(f"format{FEATURE_FORMAT}".encode())
    if aux_layers:
        parts.append(f"aux{list(aux_layers)}".encode())
    if dtype != torch.bfloat16:  # (keeps the identities of the extractions made before the choice)
        parts.append(f"dtype{dtype}".encode())
    return b"".join(parts)


def shard_key(identity: bytes, ids: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]]) -> str:
    """Content address of a feature shard: hex sha256 of ``identity`` and its sequences' tokens and masks."""
    h = hashlib.sha256(identity)
    for seq, mask in zip(ids, masks):
        h.update(len(seq).to_bytes(4, "little"))
        h.update(torch.tensor(seq, dtype=torch.int32).numpy().tobytes())
        h.update(bytes(mask))
    return h.hexdigest() + ".safetensors"


def data_fingerprint(
    target_dir: Path,
    splits: dict[str, Sequences],
    aux_layers: Sequence[int] = (),
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    """Hash of the target (config, weight file sizes), the stored aux layers, the target's dtype and
    every token id and mask of every split."""
    h = hashlib.sha256(feature_identity(target_dir, aux_layers, dtype))
    for name, seqs in splits.items():
        h.update(f"|split {name}|".encode())
        for ids, mask in zip(seqs.ids, seqs.masks):
            h.update(torch.tensor(ids, dtype=torch.int32).numpy().tobytes())
            h.update(bytes(mask))
    return h.hexdigest()


def extract_features(
    target_dir: Path,
    splits: dict[str, Sequences],
    feature_root: Path,
    shard_tokens: int,
    aux_layers: Sequence[int] = (),
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    streamed: Sequence[str] = (),
) -> tuple[Path, dict[str, Any]]:
    """Features of every split under ``feature_root/<fingerprint[:16]>`` (reused when already complete;
    shards that another run already extracted are hard-linked from ``feature_root/by-content``), with
    the target on ``device`` in ``dtype``. The splits named in ``streamed`` are only planned: their
    manifest entries list shards no file holds yet (:mod:`vllm_eagle2_tools.training.streaming` makes
    them as training reaches them)."""
    fp = data_fingerprint(target_dir, splits, aux_layers, dtype)
    identity = feature_identity(target_dir, aux_layers, dtype)
    fdir = feature_root / fp[:16]
    manifest_path = fdir / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") == fp:
            log(f"reusing features in {fdir}")
            manifest["reused"] = True
            return fdir, manifest
    from transformers import AutoModelForCausalLM

    log(f"extracting features into {fdir} (target in {str(dtype).removeprefix('torch.')} on {device})")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(device).eval()
    manifest = {
        "fingerprint": fp,
        "target": str(target_dir),
        "hidden_size": model.config.hidden_size,
        "aux_layers": list(aux_layers),
        "splits": {},
    }
    for split, seqs in splits.items():
        if split in streamed:
            shards = planned_shards(seqs, split, shard_tokens)
            manifest["splits"][split] = {"shards": shards, "streamed": True}
            continue
        shards = write_feature_shards(
            model,
            seqs,
            fdir,
            split,
            shard_tokens,
            aux_layers=aux_layers,
            store=feature_root / "by-content",
            identity=identity,
            batch=1 if torch.device(device).type == "cpu" else 32,
        )
        manifest["splits"][split] = {
            "shards": shards,
            "num_sequences": len(seqs.ids),
            "num_tokens": seqs.num_tokens,
            "num_assistant_tokens": seqs.num_masked,
        }
    del model
    manifest["extraction_seconds"] = round(time.perf_counter() - t0, 1)
    manifest_path.write_text(json.dumps(manifest, indent=1))
    manifest["reused"] = False
    return fdir, manifest


def frequent_vocab(fdir: Path, shards: Sequence[dict[str, Any]], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` tokens with the most target probability mass over the shards' assistant positions.

    Mass = sum of the stored top-K probabilities; returns sorted int64 ids [<= size]. A softmax over them
    plus each batch's own top-K ranks the head's logits almost as the full one does (the held-out
    evaluation always uses the full vocabulary, so any gap shows there).
    """
    from safetensors.torch import load_file

    mass = torch.zeros(vocab_size)
    for shard in shards:
        data = load_file(str(fdir / shard["file"]))
        if "topk_ids" not in data:
            raise SystemExit(f"error: {shard['file']} has no target top-K (features of an older format)")
        rows = data["mask"]
        mass.index_add_(0, data["topk_ids"][rows].long().flatten(), data["topk_logp"][rows].exp().flatten())
    k = min(size, int((mass > 0).sum()))
    return mass.topk(k).indices.sort().values
