"""Training features made chunk by chunk, as the trainer reaches them, instead of all up front.

The target's features of millions of tokens take hours on a CPU and gigabytes of disk, and a machine
is not kept between sessions. Streamed, a shard (one chunk of ``--shard-tokens`` tokens) is extracted
when the epoch plan first reads it and deleted once the plan has moved past it, so a run resumed on a
fresh machine pays only for the chunk it stopped in. The split of sequences into shards, and with it
every epoch plan, is fixed by the sequences' lengths alone: it is known before any feature exists.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_eagle2_tools.training import log
from vllm_eagle2_tools.training.conversations import Sequences
from vllm_eagle2_tools.training.features import (
    TARGET_TOPK,
    planned_shards,
    shard_plan,
    shard_tensors,
    write_shard,
)


class StreamedShards:
    """The feature shards of one split, extracted on demand with the target at ``dtype``.

    ``shards``: the shard list as :func:`~vllm_eagle2_tools.training.features.write_feature_shards`
    returns it (file, lengths), before any file exists. ``keep``: keep every shard once made (the
    bulk behaviour, for runs of several epochs on one machine); otherwise a shard is deleted when
    the trainer moves on. ``aux_layers``: as ``write_feature_shards``'s. ``model``: the target, already
    loaded (default: loaded from ``target_dir`` at the first shard to compute). ``extracted``: shard
    indices computed here, in order (what a test asserts).
    """

    def __init__(
        self,
        target_dir: Path,
        seqs: Sequences,
        fdir: Path,
        split: str,
        shard_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        keep: bool = False,
        aux_layers: Sequence[int] = (),
        model: Any = None,
    ) -> None:
        self.target_dir, self.seqs, self.fdir, self.dtype = target_dir, seqs, fdir, dtype
        self.aux_layers = list(aux_layers)
        self.device, self.keep, self._model = torch.device(device), keep, model
        self.members = shard_plan(seqs, shard_tokens)
        self.shards = planned_shards(seqs, split, shard_tokens)
        self.extracted: list[int] = []
        fdir.mkdir(parents=True, exist_ok=True)

    def _target(self) -> Any:
        if self._model is None:  # loaded at the first shard that must be computed
            from transformers import AutoModelForCausalLM

            log(f"target in {str(self.dtype).removeprefix('torch.')} on {self.device} for streamed features")
            path = str(self.target_dir)
            self._model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        return self._model

    def ensure(self, k: int) -> None:
        """Make shard ``k``'s file if it does not exist (an interrupted run finds it there)."""
        path = self.fdir / self.shards[k]["file"]
        if path.exists():
            return
        from tqdm import tqdm

        model = self._target()
        lm_head = model.get_output_embeddings().weight.detach()  # in the target's dtype
        members = self.members[k]
        total = sum(len(self.seqs.ids[i]) for i in members)
        batch = 1 if self.device.type == "cpu" else 32
        inner, aux = getattr(model, "model", model), self.aux_layers
        desc = f"features {path.stem}"
        with tqdm(total=total, unit="tok", desc=desc, dynamic_ncols=True, leave=False) as bar:
            tensors = shard_tensors(inner, lm_head, self.seqs, members, batch, aux, TARGET_TOPK, bar)
        write_shard(path, tensors)
        self.extracted.append(k)

    def release(self, k: int) -> None:
        """The trainer is done with shard ``k`` for now: delete it unless ``keep``."""
        if not self.keep:
            (self.fdir / self.shards[k]["file"]).unlink(missing_ok=True)


def frequent_reply_tokens(seqs: Sequences, size: int) -> torch.Tensor:
    """The ``size`` most frequent reply tokens, sorted int64 ids: the reduced-vocabulary CE's tokens
    when the features are streamed (the bulk path ranks tokens by the target's predicted mass over
    every shard, which streaming does not have up front; on the target's own greedy replies the
    tokens it emits are the ones it predicts)."""
    counts: Counter[int] = Counter()
    for ids, mask in zip(seqs.ids, seqs.masks):
        counts.update(t for t, m in zip(ids, mask) if m)
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)), dtype=torch.int64)
