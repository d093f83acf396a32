"""Training over the feature shards: epoch plans, shard streaming, held-out evaluation, the loop.

AdamW with linear warm-up then cosine decay and gradient clipping; checkpoints (head, optimizer,
schedule, position in the epoch) every few minutes and at every epoch end, so a resumed run
continues exactly.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_eagle2_tools.training import log
from vllm_eagle2_tools.training.eagle3_head import Eagle3Head
from vllm_eagle2_tools.training.features import frequent_vocab
from vllm_eagle2_tools.training.head import EagleHead
from vllm_eagle2_tools.training.loss import CE_WEIGHT, Batch, StepStats, batch_loss, make_batch
from vllm_eagle2_tools.training.precision import autocast

if TYPE_CHECKING:
    from vllm_eagle2_tools.training.streaming import StreamedShards

EVAL_DEPTHS = 3  # held-out top-1 is also reported for depths 2..EVAL_DEPTHS (the head on its own features)

Head = EagleHead | Eagle3Head


def _device(head: Head) -> torch.device:
    """Where the head's weights are."""
    return head.fc.weight.device


def _stats(head: Head) -> StepStats:
    """An empty accumulator whose loss is the head's (an EAGLE-3 head's is its CE alone)."""
    return StepStats(ce_weight=1.0) if isinstance(head, Eagle3Head) else StepStats()


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
    """Loads one shard at a time (the last one is cached) and cuts batches out of it.

    ``source``: where shards come from when they are streamed (a
    :class:`~vllm_eagle2_tools.training.streaming.StreamedShards`): it makes a shard before it is
    read and may delete the one read before. None: every shard's file exists.
    """

    def __init__(
        self,
        fdir: Path,
        shards: Sequence[dict[str, Any]],
        device: torch.device | str = "cpu",
        source: StreamedShards | None = None,
    ) -> None:
        self.fdir = fdir
        self.shards = shards
        self.device = torch.device(device)
        self.source = source
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None

    def batch(self, shard: int, seqs: Sequence[int]) -> Batch:
        """The :class:`Batch` of sequences ``seqs`` of shard ``shard``."""
        from safetensors.torch import load_file

        if self._cached is None or self._cached[0] != shard:
            if self.source is not None:
                if self._cached is not None:
                    self.source.release(self._cached[0])
                self.source.ensure(shard)
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


@torch.no_grad()
def evaluate(
    head: Head,
    fdir: Path,
    shards: Sequence[dict[str, Any]],
    batch_tokens: int,
    depths: int = EVAL_DEPTHS,
) -> dict[str, float]:
    """Held-out metrics: teacher-forced loss parts and top-1/5/10 agreement with the target's argmax, and
    the top-1 agreement at depths 2..``depths``, where the head reads its own features (an EAGLE-3 head:
    agreement of its draft-vocabulary ranking, a target argmax outside that vocabulary being a miss)."""
    head.eval()
    reader = ShardReader(fdir, shards, _device(head))
    stats = _stats(head)
    for shard, seqs in epoch_plan(shards, batch_tokens, 0, 0, shuffle=False):
        stats.add(batch_loss(head, reader.batch(shard, seqs), train=False, depths=depths))
    head.train()
    return stats.summary()


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
    precision: str = "float32"  # of the training step's arithmetic (training.precision); eval: float32
    save_every_minutes: float = 5.0
    max_minutes: float | None = None  # of training (its feature chunks included) in this invocation
    max_steps: int | None = None  # stop (after saving) once this many steps are done, resumed ones included


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
    head: Head,
    fdir: Path,
    train_shards: Sequence[dict[str, Any]],
    eval_shards: Sequence[dict[str, Any]] | None,
    cfg: TrainConfig,
    checkpoint: Path | None = None,
    resume: bool = False,
    on_epoch_end: Callable[[int, dict[str, Any]], None] | None = None,
    progress: bool = True,
    extra_eval: dict[str, Sequence[dict[str, Any]]] | None = None,
    source: StreamedShards | None = None,
    vocab: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Train ``head`` on the train shards; returns the history (per-step losses, per-epoch eval).

    Each evaluation covers ``eval_shards`` and, under their names, the sets of ``extra_eval``
    (e.g. the target's own MT-bench answers).
    ``checkpoint``: file for resumable state (written every ``cfg.save_every_minutes`` and after each
    epoch); with ``resume`` it is loaded first and training continues at the next batch.
    ``on_epoch_end(epoch, history)`` is called after each epoch's evaluation (e.g. to export the head).
    Stops early, after saving, once this call has trained ``cfg.max_minutes`` minutes, or once
    ``cfg.max_steps`` steps are done in all.
    ``source``: the train shards' :class:`ShardReader` source when they are streamed.
    ``vocab``: the reduced-vocabulary CE's tokens (sorted int64) with ``cfg.vocab_subset``; default:
    ranked from the train shards' features (:func:`frequent_vocab`, which streamed shards do not have).
    """
    trainer = _Trainer(head, fdir, train_shards, eval_shards, cfg, checkpoint, extra_eval, source, vocab)
    if resume:
        trainer.resume()
    return trainer.run(on_epoch_end, progress)


class _Trainer:
    """The state of one training run: optimiser, schedule, position, history (what a checkpoint holds)."""

    def __init__(
        self,
        head: Head,
        fdir: Path,
        train_shards: Sequence[dict[str, Any]],
        eval_shards: Sequence[dict[str, Any]] | None,
        cfg: TrainConfig,
        checkpoint: Path | None,
        extra_eval: dict[str, Sequence[dict[str, Any]]] | None,
        source: StreamedShards | None = None,
        vocab: torch.Tensor | None = None,
    ) -> None:
        self.head, self.fdir, self.cfg, self.checkpoint = head, fdir, cfg, checkpoint
        self.eval_shards, self.extra_eval = eval_shards, extra_eval or {}
        head.set_vocab_dtype(getattr(torch, cfg.precision))  # float32 means float32 everywhere
        torch.manual_seed(cfg.seed)
        self.plans = [epoch_plan(train_shards, cfg.batch_tokens, cfg.seed, e) for e in range(cfg.epochs)]
        total_steps = sum(len(p) for p in self.plans)
        warmup = max(1, int(cfg.warmup_ratio * total_steps))
        self.reg_only_steps = int(cfg.reg_only_ratio * total_steps)
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(total_steps, warmup, cfg.min_lr_ratio)
        )
        self.history: dict[str, Any] = {
            "steps": [],
            "eval": [],
            "train_epochs": [],
            "total_steps": total_steps,
        }
        self.vocab = None
        if cfg.vocab_subset > 0 and isinstance(head, EagleHead):  # (an EAGLE-3 head has its own vocabulary)
            if vocab is None:
                vocab = frequent_vocab(fdir, train_shards, cfg.vocab_subset, head.lm_head_weight.shape[0])
            self.vocab = vocab.to(head.lm_head_weight.device)
            log(f"CE over a reduced vocabulary: {vocab.numel()} frequent tokens + each batch's target top-K")
        self.epoch, self.step_in_epoch, self.global_step, self.train_seconds = 0, 0, 0, 0.0
        self.resumed_seconds = 0.0  # train_seconds of the run this one resumed
        self.reader = ShardReader(fdir, train_shards, _device(head), source)

    def evaluate_all(self) -> dict[str, Any]:
        assert self.eval_shards
        ev: dict[str, Any] = evaluate(self.head, self.fdir, self.eval_shards, self.cfg.batch_tokens)
        for name, shards in self.extra_eval.items():
            ev[name] = evaluate(self.head, self.fdir, shards, self.cfg.batch_tokens)
        return ev

    def resume(self) -> None:
        if self.checkpoint is None or not self.checkpoint.exists():
            log("--resume given but no checkpoint found; starting from scratch")
            return
        state = torch.load(self.checkpoint, weights_only=False)
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.epoch, self.step_in_epoch = state["epoch"], state["step_in_epoch"]
        self.global_step, self.train_seconds = state["global_step"], state["train_seconds"]
        self.resumed_seconds = self.train_seconds
        self.history = state["history"]
        torch.set_rng_state(state["torch_rng"])
        log(
            f"resumed from {self.checkpoint}: epoch {self.epoch + 1}, step {self.step_in_epoch} "
            f"({self.global_step} done)"
        )

    def save(self) -> None:
        if self.checkpoint is None:
            return
        _save_checkpoint(
            self.checkpoint,
            {
                "head": self.head.state_dict(),
                "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(),
                "epoch": self.epoch,
                "step_in_epoch": self.step_in_epoch,
                "global_step": self.global_step,
                "train_seconds": self.train_seconds,
                "history": self.history,
                "torch_rng": torch.get_rng_state(),
                "config": asdict(self.cfg),
            },
        )

    def step(self, shard: Any, seqs: Any) -> tuple[Any, Any, float]:
        """One optimiser step on one batch, recorded in the history; returns (batch, stats, seconds)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        batch = self.reader.batch(shard, seqs)
        self.opt.zero_grad(set_to_none=True)
        with autocast(cfg.precision, _device(self.head).type):  # the weights and AdamW stay float32
            stats = batch_loss(
                self.head,
                batch,
                train=True,
                feature_noise=cfg.feature_noise,
                ce_weight=0.0 if self.global_step < self.reg_only_steps else cfg.ce_weight,
                vocab=self.vocab,
                depths=cfg.depths,
            )
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)) if stats.rows else 0.0
        if stats.rows:
            self.opt.step()
        self.sched.step()
        self.step_in_epoch += 1
        self.global_step += 1
        dt = time.perf_counter() - t0
        self.train_seconds += dt
        s = stats.summary()
        self.history["steps"].append(
            {
                "step": self.global_step,
                "epoch": self.epoch + 1,
                "loss": round(s["loss"], 5),
                "top1": round(s["top1"], 4),
                "lr": self.sched.get_last_lr()[0],
                "grad_norm": round(gnorm, 4),
                "tokens": int(batch.tokens.numel()),
                "seconds": round(dt, 3),
            }
        )
        return batch, stats, dt

    def run_epoch(self, progress: bool, last_save: float) -> tuple[Any, float, bool]:
        """The rest of the current epoch; returns (its running stats, the last save, stopped early)."""
        from tqdm import tqdm

        cfg, plan = self.cfg, self.plans[self.epoch]
        bar = tqdm(
            total=len(plan),
            initial=self.step_in_epoch,
            desc=f"epoch {self.epoch + 1}/{cfg.epochs}",
            dynamic_ncols=True,
            disable=not progress,
        )
        run = _stats(self.head)
        ema: float | None = None
        stopped = False
        while self.step_in_epoch < len(plan):
            spent = self.train_seconds - self.resumed_seconds  # in this invocation
            out_of_time = cfg.max_minutes is not None and spent >= 60 * cfg.max_minutes
            if out_of_time or (cfg.max_steps is not None and self.global_step >= cfg.max_steps):
                stopped = True
                break
            batch, stats, dt = self.step(*plan[self.step_in_epoch])
            run.add(stats)
            loss = stats.summary()["loss"]
            ema = loss if ema is None else 0.9 * ema + 0.1 * loss
            r = run.summary()
            bar.set_postfix(
                loss=f"{ema:.3f}",
                top1=f"{r['top1']:.3f}",
                top5=f"{r['top5']:.3f}",
                **({"top1_d2": f"{r['top1_depth2']:.3f}"} if "top1_depth2" in r else {}),
                tok_s=f"{len(batch.tokens) / dt:.0f}",
            )
            bar.update(1)
            if self.checkpoint is not None and time.perf_counter() - last_save > 60 * cfg.save_every_minutes:
                self.save()
                last_save = time.perf_counter()
        bar.close()
        return run, last_save, stopped

    def run(
        self, on_epoch_end: Callable[[int, dict[str, Any]], None] | None, progress: bool
    ) -> dict[str, Any]:
        cfg, history = self.cfg, self.history
        self.head.train()
        last_save = time.perf_counter()
        stopped_early = False
        while self.epoch < cfg.epochs:
            run, last_save, stopped_early = self.run_epoch(progress, last_save)
            history = self.history  # (a resumed run replaced it)
            if stopped_early:
                log(f"stopped as asked at epoch {self.epoch + 1} step {self.step_in_epoch}")
                self.save()
                if self.eval_shards:
                    ev = self.evaluate_all()
                    done = self.epoch + self.step_in_epoch / max(1, len(self.plans[self.epoch]))
                    ev.update(epoch=round(done, 3), partial=True)
                    history["eval"].append(ev)
                    log(f"held-out (partial epoch) top1 {ev['top1']:.4f} top5 {ev['top5']:.4f}")
                break
            history["train_epochs"].append({"epoch": self.epoch + 1, **run.summary()})
            if self.eval_shards:
                t0 = time.perf_counter()
                ev = self.evaluate_all()
                ev.update(epoch=self.epoch + 1, seconds=round(time.perf_counter() - t0, 1))
                history["eval"].append(ev)
                log(f"epoch {self.epoch + 1}: held-out {_eval_line(ev)}")
                for name in self.extra_eval:
                    log(f"epoch {self.epoch + 1}: {name} {_eval_line(ev[name])}")
            self.epoch += 1
            self.step_in_epoch = 0
            self.save()
            last_save = time.perf_counter()
            if on_epoch_end is not None:
                on_epoch_end(self.epoch, history)
        history = self.history
        history["train_seconds"] = round(self.train_seconds, 1)
        history["stopped_early"] = stopped_early
        history["completed_epochs"] = self.epoch
        return history
