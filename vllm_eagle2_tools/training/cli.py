"""The trainer's command-line options (``scripts/train_eagle_head.py``); the pipeline is in ``recipe``."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_eagle2 import draft_vocab
from vllm_eagle2_tools.smollm2 import DEFAULT_HEAD, DEFAULT_TARGET
from vllm_eagle2_tools.training import recipe
from vllm_eagle2_tools.training.eagle3_head import DEFAULT_DRAFT_VOCAB
from vllm_eagle2_tools.training.loss import CE_WEIGHT, UNROLL_DECAY
from vllm_eagle2_tools.training.precision import CHOICES
from vllm_eagle2_tools.training.recipe import DEFAULT_FEATURE_DIR


def _fraction(text: str) -> float:
    """A float in [0, 1] (argparse type)."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} not in [0, 1]")
    return value


def _data_and_schedule(p: argparse._ActionsContainer) -> None:
    """The target, the data and the optimiser schedule."""
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET, help="HF Llama-family target folder")
    p.add_argument("--output", type=Path, default=DEFAULT_HEAD, help="head folder to write")
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


def _head_options(p: argparse._ActionsContainer) -> None:
    """The head's format, size and initialisation."""
    p.add_argument(
        "--format",
        choices=["eagle", "eagle3"],
        default="eagle",
        help="head to train: eagle (EAGLE-1/2, vLLM's eagle method) or eagle3 (EAGLE-3, vLLM's eagle3 "
        "method: reads --aux-layers, own draft vocabulary of --draft-vocab tokens, CE loss only)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=DEFAULT_DRAFT_VOCAB,
        help="--format eagle3: size of the head's own vocabulary (the most frequent reply tokens; capped "
        "at the target's vocabulary, where the head drafts over all of it and ships no d2t)",
    )
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
        help="target layers whose input hidden states the head reads, e.g. 2,15,27 (EAGLE-3's low/middle/"
        "high features). --format eagle3: its fc input (default vLLM's 2,N//2,N-3 for N target layers); "
        "--format eagle: a measurement only (a head neither vLLM nor the plugin loads)",
    )


def _run_options(p: argparse._ActionsContainer) -> None:
    """Resuming, time limits and partial runs."""
    p.add_argument("--resume", action="store_true", help="continue from <feature run>/checkpoint.pt")
    p.add_argument("--save-every-minutes", type=float, default=5.0)
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop (after saving the checkpoint) once this invocation has trained this many minutes",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--precision",
        choices=CHOICES,
        default="auto",
        help="arithmetic of the target's feature pass and of the head's training step (bf16 autocast; the "
        "weights, AdamW and the held-out evaluation stay float32). auto: bfloat16 on a GPU that has it "
        "and on a CPU with AMX bf16 tiles, float32 elsewhere",
    )
    p.add_argument(
        "--stream-features",
        action="store_true",
        help="extract the training features chunk by chunk (--shard-tokens) as training reaches them and "
        "delete each after use, instead of all up front: a run resumed on a fresh machine remakes only "
        "the chunk it stopped in. The reduced-vocabulary CE then ranks tokens by their count in the replies",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="file of the resumable state (head, AdamW, schedule, data position, RNG); default: in the "
        "feature folder. A path in the repository can be committed, so that --resume works on another "
        "machine",
    )
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


def _loss_and_data_sources(p: argparse._ActionsContainer) -> None:
    """The loss, and which replies or conversations train and evaluate."""
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
        "--replies-prompts",
        type=int,
        default=None,
        help="with --replies: only the replies to its first N sharegpt prompts (default: all)",
    )
    p.add_argument(
        "--eval-replies",
        default=None,
        help="a prompt set of --replies held out for evaluation (e.g. mtbench); the main held-out set "
        "when --eval-conversations is 0",
    )
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        description=recipe.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _data_and_schedule(p.add_argument_group("data and schedule"))
    _head_options(p.add_argument_group("head"))
    _run_options(p.add_argument_group("run"))
    _loss_and_data_sources(p.add_argument_group("loss and data sources"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (None: ``sys.argv[1:]``), then select data, extract features, train, export.

    Returns the exit status.
    """
    return recipe.run(parse_args(argv), argv)
