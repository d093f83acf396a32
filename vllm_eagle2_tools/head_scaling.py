"""How a draft head's held-out agreement grows with its training data, and what a goal would take.

The library half of ``scripts/head_data_scaling.py``, whose docstring (its ``--help``) says what is
trained, how the fit works and what is written: one head per prefix of a feature run, top-1 fitted as
``a + b * log2(tokens)``, no fit over less than one doubling of the data.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_eagle2_tools.smollm2 import WORKDIR
from vllm_eagle2_tools.training import log
from vllm_eagle2_tools.training.head import build_head
from vllm_eagle2_tools.training.loop import TrainConfig, evaluate, train
from vllm_eagle2_tools.training.loss import CE_WEIGHT

# train_eagle_head.py's held-out splits: ShareGPT conversations, and the --eval-distilled replies
SPLIT_LABELS = {"eval": "ShareGPT", "eval_distilled": "distilled answers"}


def fit_log_linear(tokens: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``values ≈ a + b * log2(tokens)``; needs two distinct token counts."""
    x = [math.log2(t) for t in tokens]
    if len(set(x)) < 2:
        raise ValueError("a fit needs at least two different token counts")
    mx, my = sum(x) / len(x), sum(values) / len(values)
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, values)) / sum((xi - mx) ** 2 for xi in x)
    return my - b * mx, b


def tokens_for(goal: float, a: float, b: float) -> float | None:
    """Training tokens at which ``a + b * log2(tokens)`` reaches ``goal``; None if it never does."""
    return 2 ** ((goal - a) / b) if b > 0 else None


def run(
    target: Path,
    fdir: Path,
    train_shards: Sequence[dict[str, Any]],
    eval_sets: dict[str, Sequence[dict[str, Any]]],
    prefixes: Sequence[int],
    cfg: TrainConfig,
) -> list[dict[str, Any]]:
    """One head per prefix: trained from the same init on ``train_shards[:k]`` with ``cfg``, then
    evaluated on every held-out set. Returns one row per prefix:
    ``{"shards": k, "tokens": int, "train_seconds": float, "eval": {set name: metrics}}``."""
    rows = []
    for k in prefixes:
        shards = train_shards[:k]
        tokens = sum(sum(s["lengths"]) for s in shards)
        log(f"head {len(rows) + 1}/{len(prefixes)}: {k} shard(s), {tokens} tokens")
        head = build_head(target, init="target", seed=cfg.seed)
        t0 = time.perf_counter()
        train(head, fdir, shards, None, cfg)
        seconds = time.perf_counter() - t0
        evals = {name: evaluate(head, fdir, s, cfg.batch_tokens) for name, s in eval_sets.items()}
        log(f"  {tokens} tokens: " + ", ".join(f"{n} top-1 {e['top1']:.3f}" for n, e in evals.items()))
        rows.append({"shards": k, "tokens": tokens, "train_seconds": seconds, "eval": evals})
    return rows


def released_head(name: str, record: dict[str, Any]) -> dict[str, Any]:
    """A trained head as a point beside the line, from its ``train_eagle_head.py`` record:
    ``{"name", "tokens": its training set's tokens, "eval": {set name: metrics}}`` with the record's
    final held-out metrics under this module's set names. The main held-out split is ShareGPT when the
    run held out conversations, else the MT-bench answers (``--eval-replies`` alone); a second split
    named ``<eval_replies>_replies`` is the MT-bench answers."""
    final, args = record["final_heldout"], record["args"]
    answers = f"{args.get('eval_replies')}_replies"
    main_set = "ShareGPT" if args.get("eval_conversations") else SPLIT_LABELS["eval_distilled"]
    evals = {main_set: {k: v for k, v in final.items() if not isinstance(v, dict)}}
    if isinstance(final.get(answers), dict):
        evals[SPLIT_LABELS["eval_distilled"]] = final[answers]
    return {"name": name, "tokens": record["data"]["train_tokens"], "eval": evals}


def per_doubling(a: dict[str, Any], b: dict[str, Any], name: str) -> float | None:
    """Top-1 points (as a fraction) per doubling of the data from head ``a`` to head ``b`` on held-out set
    ``name``; None if either lacks the set or their data do not differ."""
    if name not in a["eval"] or name not in b["eval"] or a["tokens"] == b["tokens"]:
        return None
    return fit_log_linear([a["tokens"], b["tokens"]], [a["eval"][name]["top1"], b["eval"][name]["top1"]])[1]


#: The smallest ratio of the largest to the smallest training set that gets a fit: one doubling.
MIN_FIT_SPAN = 2.0


def token_span(rows: Sequence[dict[str, Any]]) -> float:
    """Largest over smallest training-token count of the rows."""
    tokens = [r["tokens"] for r in rows]
    return max(tokens) / min(tokens)


def fits(rows: Sequence[dict[str, Any]], goal: float) -> dict[str, dict[str, float | None] | None]:
    """Per held-out set: the top-1 fit and the tokens it extrapolates to ``goal`` (None: never).

    A set's fit is None when the rows span less than ``MIN_FIT_SPAN`` of training tokens.
    """
    out: dict[str, dict[str, float | None] | None] = {}
    for name in rows[0]["eval"]:
        if token_span(rows) < MIN_FIT_SPAN:
            out[name] = None
            continue
        a, b = fit_log_linear([r["tokens"] for r in rows], [r["eval"][name]["top1"] for r in rows])
        out[name] = {"a": a, "per_doubling": b, "tokens_for_goal": tokens_for(goal, a, b)}
    return out


def heads_markdown(heads: Sequence[dict[str, Any]], names: Sequence[str]) -> list[str]:
    """The released heads' table (top-1 at depths 1 / 2 / 3 per held-out set), then the gain per
    doubling of the data between each head and the next (by tokens)."""
    lines = [
        "",
        "Released heads (trained longer and from earlier heads, held out on their own records' sets):",
        "",
        "| head | training tokens | " + " | ".join(f"{n} top-1 (depth 1 / 2 / 3)" for n in names) + " |",
        "|" + "---|" * (2 + len(names)),
    ]
    for h in heads:
        cells = [
            " / ".join(f"{100 * h['eval'][n][k]:.1f}%" for k in ("top1", "top1_depth2", "top1_depth3"))
            if n in h["eval"]
            else "-"
            for n in names
        ]
        lines.append(f"| {h['name']} | {h['tokens']:,} | " + " | ".join(cells) + " |")
    lines.append("")
    ordered = sorted(heads, key=lambda h: h["tokens"])
    for a, b in zip(ordered, ordered[1:]):
        for n in names:
            d = per_doubling(a, b, n)
            if d is not None:
                lines.append(
                    f"- {a['name']} to {b['name']} (x{b['tokens'] / a['tokens']:.2f} tokens), {n}: "
                    f"{100 * d:+.1f} points of top-1 per doubling of the data"
                )
    return lines


def markdown(
    rows: Sequence[dict[str, Any]],
    fit: dict[str, dict[str, Any]],
    goal: float,
    command: str,
    heads: Sequence[dict[str, Any]] = (),
) -> str:
    """The table of every head's held-out top-1 / top-5, then one line per fit, then the released heads."""
    names = list(rows[0]["eval"])
    head = "| training tokens | training minutes | " + " | ".join(f"{n} top-1 / top-5" for n in names) + " |"
    lines = [f"`{command}`", "", head, "|" + "---|" * (2 + len(names))]
    for r in rows:
        cells = [f"{100 * r['eval'][n]['top1']:.1f}% / {100 * r['eval'][n]['top5']:.1f}%" for n in names]
        lines.append(f"| {r['tokens']:,} | {r['train_seconds'] / 60:.1f} | " + " | ".join(cells) + " |")
    lines.append("")
    for n in names:
        f = fit[n]
        if f is None:
            lines.append(
                f"- {n}: no fit: the heads' data spans x{token_span(rows):.2f}, less than one doubling"
            )
            continue
        reach = f"{f['tokens_for_goal'] / 1e6:.1f}M tokens" if f["tokens_for_goal"] else "never"
        lines.append(
            f"- {n}: +{100 * f['per_doubling']:.1f} points of top-1 per doubling of the data; "
            f"{100 * goal:.0f}% at {reach} by this fit (optimistic: such curves bend down)"
        )
    if heads:
        lines += heads_markdown(heads, names)
    return "\n".join(lines) + "\n"


def plot(
    rows: Sequence[dict[str, Any]],
    fit: dict[str, dict[str, Any]],
    goal: float,
    path: Path,
    heads: Sequence[dict[str, Any]] = (),
) -> None:
    """PNG: held-out top-1 against tokens (log scale), each fit drawn out to the goal (or 1000x the data),
    and the released heads as labelled diamonds in their set's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r["tokens"] for r in rows]
    hi_data = max([*tokens, *[h["tokens"] for h in heads]])
    reach = [f["tokens_for_goal"] for f in fit.values() if f and f["tokens_for_goal"]]
    hi = max([hi_data * 4, *[min(t, max(tokens) * 1000) for t in reach]])
    xs = [min(tokens) * (hi / min(tokens)) ** (i / 50) for i in range(51)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, f in fit.items():
        (line,) = ax.plot(
            tokens, [100 * r["eval"][name]["top1"] for r in rows], "o", label=f"{name} (held out)"
        )
        if f is None:
            continue
        ys = [100 * (f["a"] + f["per_doubling"] * math.log2(x)) for x in xs]
        ax.plot(
            xs,
            ys,
            "--",
            color=line.get_color(),
            label=f"fit: +{100 * f['per_doubling']:.1f} points per doubling",
        )
        points = [h for h in heads if name in h["eval"]]
        if points:
            ys = [100 * h["eval"][name]["top1"] for h in points]
            ax.plot([h["tokens"] for h in points], ys, "D-", color=line.get_color(), mfc="white",
                    label=f"{name}: released heads")  # fmt: skip
            for h, y in zip(points, ys):
                ax.annotate(
                    h["name"], (h["tokens"], y), textcoords="offset points", xytext=(4, 4), fontsize=7
                )
    ax.axhline(100 * goal, color="gray", lw=1)
    ax.text(min(tokens), 100 * goal + 0.5, f"goal {100 * goal:.0f}%", color="gray")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (log scale)")
    ax.set_ylabel("top-1 agreement with the target (%)")
    ax.set_title("Draft head: held-out top-1 against training data")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _prefixes(text: str) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of shard counts") from None
    if len(ks) < 2 or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least two shard counts, each >= 1")
    return ks


def _head(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=TRAINING_JSON, a train_eagle_head.py record")
    return name, Path(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    same = "as in train_eagle_head.py (every head the same)"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--features", type=Path, help="a feature run folder (holds manifest.json)")
    source.add_argument(
        "--from-record",
        type=Path,
        help="an earlier output JSON: redraw its line without training (to add --head)",
    )
    p.add_argument("--target", type=Path, default=WORKDIR / "models" / "smollm2-135m-instruct")
    p.add_argument("--shards", type=_prefixes, help="training-shard prefixes, e.g. 1,2,4 (with --features)")
    p.add_argument(
        "--head", type=_head, action="append", default=[], metavar="NAME=TRAINING_JSON",
        help="a released head's record (its final held-out eval and training tokens), drawn beside the line",
    )  # fmt: skip
    p.add_argument("--epochs", type=int, default=4, help=same)
    p.add_argument("--lr", type=float, default=1e-3, help=same)
    p.add_argument("--min-lr-ratio", type=float, default=0.05, help=same)
    p.add_argument("--batch-tokens", type=int, default=TrainConfig.batch_tokens, help=same)
    p.add_argument("--ce-weight", type=float, default=CE_WEIGHT, help=same)
    p.add_argument("--vocab-subset", type=int, default=8192, help=same)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goal", type=float, default=0.6, help="top-1 to extrapolate the data for")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", type=Path, default=WORKDIR / "results" / "head-scaling.json")
    args = p.parse_args(argv)
    if args.features is not None and args.shards is None:
        p.error("--features needs --shards")
    return args


def _train_line(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Trains one head per ``--shards`` prefix of ``--features``; the record's command, config and rows."""
    manifest_file = args.features / "manifest.json"
    if not manifest_file.exists():
        raise SystemExit(f"error: --features: no manifest.json in {args.features}")
    manifest = json.loads(manifest_file.read_text())
    train_shards = manifest["splits"]["train"]["shards"]
    if args.shards[-1] > len(train_shards):
        raise SystemExit(
            f"error: --shards {args.shards[-1]}: the feature run has {len(train_shards)} training shards"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    eval_sets = {
        SPLIT_LABELS.get(name, name): split["shards"]
        for name, split in manifest["splits"].items()
        if name != "train"
    }
    cfg = TrainConfig(
        epochs=args.epochs,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        batch_tokens=args.batch_tokens,
        ce_weight=args.ce_weight,
        vocab_subset=args.vocab_subset,
        seed=args.seed,
    )
    rows = run(args.target.resolve(), args.features.resolve(), train_shards, eval_sets, args.shards, cfg)
    return {"command": command, "config": vars(cfg), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv)
    if args.from_record:
        record = json.loads(args.from_record.read_text())
        record["heads_command"] = command
    else:
        record = _train_line(args, command)
    if args.head:
        record["heads"] = [released_head(name, json.loads(path.read_text())) for name, path in args.head]
    heads = record.get("heads", [])
    rows, record["goal"] = record["rows"], args.goal
    record["fits"] = fit = fits(rows, args.goal)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=1, default=str))
    md = markdown(rows, fit, args.goal, record["command"], heads)
    if record.get("heads_command"):
        md += f"\nHeads drawn by `{record['heads_command']}`\n"
    args.output.with_suffix(".md").write_text(md)
    plot(rows, fit, args.goal, args.output.with_suffix(".png"), heads)
    print(md)
    return 0
