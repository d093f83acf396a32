"""What the benchmark runs: its modes (rows) and their ``speculative_config``, the target and head.

Command-line value types (:func:`_int_list`, :func:`_setting_list`) live here too, so that the
parsing of ``--sweep`` can be tested without starting anything.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from vllm_eagle2_tools.bench.records import Run
from vllm_eagle2_tools.cpu_env import SCRATCH
from vllm_eagle2_tools.datasets import DATASETS
from vllm_eagle2_tools.smollm2 import DEFAULT_HEAD, DEFAULT_TARGET

# eagle2's tree modes: vllm_eagle2.tree.TREE_MODES in plot order (not imported, so --help needs no torch)
TREE_MODES = ("chain", "static", "dynamic", "no_value", "no_rerank")
#: Rows with the EAGLE-3 head (``--eagle3-head``): vLLM's eagle3 chain, and eagle2's dynamic trees.
EAGLE3_MODES = ("eagle3", "eagle3_trees")
#: vLLM's drafters that need no head: prompt lookup (``ngram``, once per ``--eagle-k``) and Arctic's
#: suffix decoding (``suffix``, where the ``arctic-inference`` package installs).
LOOKUP_MODES = ("ngram", "suffix")
DEFAULT_MODES = ("nospec", "eagle", "defaults", "never", *TREE_MODES)
ALL_MODES = (
    "nospec",
    "nospec_sync",
    "eagle",
    *EAGLE3_MODES,
    *LOOKUP_MODES,
    "defaults",
    "lookup",
    "lookup_head",
    "never",
    *TREE_MODES,
)
#: ``never``: step costs (``vllm_eagle2.budget.costs.COSTS_ENV``) under which no draft ever pays.
NEVER_COSTS = '{"target": [0.0, 1.0], "level": [1.0, 0.0], "overhead": 0.0}'
BUDGETS = ("adaptive", "fixed")
AUTO = "auto"  # vllm_eagle2.config.AUTO, the draft_vocab_size default
#: eagle2's (num_speculative_tokens, depth, topk) when not given: the tiny pair, a real model.
TINY_TREE = (12, 4, 3)
REAL_TREE = (16, 5, 4)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _dataset_list(text: str) -> list[str]:
    """``--dataset``: ``"sharegpt-qa,sharegpt-rewrite"`` -> ["sharegpt-qa", "sharegpt-rewrite"]."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in DATASETS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown data sets {bad}; choose from {', '.join(DATASETS)}")
    return names


def draft_vocab_arg(text: str) -> int | str:
    """``--draft-vocab``: ``auto`` (eagle2's default) or a size, 0 = the whole vocabulary."""
    if text == AUTO:
        return AUTO
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not {AUTO} or a size (0 = the whole vocabulary)")
    return int(text)


def vocab_label(vocab: int | str) -> str:
    """A run label's draft-vocabulary part: none for ``auto``, `` V=all`` for the whole vocabulary."""
    return "" if vocab == AUTO else f" V={vocab or 'all'}"


def _setting_list(text: str) -> list[tuple[str, int, int, int, int | str]]:
    """``"16:5:4,static:60:3:10:8192"`` -> [("dynamic", 16, 5, 4, "auto"), ("static", 60, 3, 10, 8192)]
    (tree mode, m, depth, topk, draft vocab; mode ``dynamic`` and draft vocab ``auto`` unless given)."""
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        mode = parts.pop(0) if parts and parts[0] in TREE_MODES else "dynamic"
        if len(parts) not in (3, 4) or not all(x.isdigit() for x in parts[:3]):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not [MODE:]M:DEPTH:TOPK[:DRAFT_VOCAB] (MODE one of {', '.join(TREE_MODES)})"
            )
        m, d, k = (int(x) for x in parts[:3])
        out.append((mode, m, d, k, draft_vocab_arg(parts[3]) if len(parts) == 4 else AUTO))
    return out


@dataclass
class Target:
    """The target and heads the benchmark runs on, their dtype and eagle2's tree (m, depth, topk).

    eagle3_head: an EAGLE-3 head for the :data:`EAGLE3_MODES` rows (None: those rows are not run).
    """

    model: Path
    head: Path
    dtype: str
    tree: tuple[int, int, int]
    description: str
    eagle3_head: Path | None = None


def resolve_target(args: argparse.Namespace) -> Target:
    """``--tiny``: build the seeded tiny pair (float32); else check ``--model`` / ``--head`` (bfloat16).

    ``--dtype``, ``--num-speculative-tokens``, ``--depth`` and ``--topk`` override the defaults.
    """
    eagle3_head = args.eagle3_head.resolve() if args.eagle3_head else None
    if args.tiny:
        from vllm_eagle2_tools.testing import build_eagle3_head, build_pair

        root = SCRATCH / "benchmark-tiny" / f"seed{args.seed}"
        model, head = build_pair(root, "partial", seed=args.seed)
        if eagle3_head is None and any(mode in EAGLE3_MODES for mode in args.modes):
            eagle3_head = build_eagle3_head(root / "eagle3-head", model, draft_vocab_size=400, seed=args.seed)
        dtype = args.dtype or "float32"
        m, d, k = TINY_TREE
        description = f"tiny seeded pair (build_pair 'partial', seed {args.seed})"
    else:
        model = (args.model or DEFAULT_TARGET).resolve()
        head = (args.head or DEFAULT_HEAD).resolve()
        for what, path in (("model", model), ("head", head), ("eagle3-head", eagle3_head)):
            if path is not None and not (path / "config.json").exists():
                raise SystemExit(f"error: --{what} {path} has no config.json")
        if eagle3_head is None and any(mode in EAGLE3_MODES for mode in args.modes):
            raise SystemExit(f"error: modes {', '.join(EAGLE3_MODES)} need --eagle3-head")
        dtype = args.dtype or "bfloat16"
        m, d, k = REAL_TREE
        description = f"{model.name} + {head.name}"
        if args.raw_prompts:
            description += " (raw prompts)"
    tree = (args.num_speculative_tokens or m, args.depth or d, args.topk or k)
    return Target(model, head, dtype, tree, description, eagle3_head)


def eagle2_run(
    mode: str,
    head: Path,
    bs: int,
    m: int,
    d: int,
    k: int,
    vocab: int | str = AUTO,
    budget: str = "adaptive",
    sweep: bool = False,
) -> Run:
    """An eagle2 run of tree ``mode`` with m nodes, depth d, top-k k (upper bounds with the adaptive
    ``budget``), draft vocabulary ``vocab`` (``auto``, 0 = whole, or a size; ``sweep``: a row of the
    tree-size table)."""
    if mode == "defaults":
        return Run("defaults", "eagle2 defaults", bs, {"method": "eagle2", "model": str(head)})
    if mode == "never":
        from vllm_eagle2.budget.costs import COSTS_ENV  # torch: not at import, so --help stays fast

        never = {"env": {COSTS_ENV: NEVER_COSTS}}
        return Run(
            "never",
            "eagle2 never drafting",
            bs,
            {"method": "eagle2", "model": str(head)},
            engine_kwargs=never,
        )
    spec = {
        "method": "eagle2",
        "model": str(head),
        "num_speculative_tokens": m,
        "depth": d,
        "topk": k,
        "tree": mode,
        "budget": budget,
        "draft_vocab_size": vocab,
    }
    label = f"eagle2 {mode} d={d}" if mode == "chain" else f"eagle2 {mode} m={m} d={d} k={k}"
    label += vocab_label(vocab) + f" {budget}"
    return Run("sweep" if sweep else mode, label, bs, spec)


def plan_runs(args: argparse.Namespace, target: Target, bs: int) -> list[Run]:
    """The runs at batch size ``bs``, in order: each of ``--modes`` (vLLM's eagle once per ``--eagle-k``,
    the tree modes once per ``--budget``), then the ``--sweep`` settings."""
    head = target.head
    m, d, k = target.tree
    plan: list[Run] = []
    for mode in args.modes:
        if mode == "nospec":
            plan.append(Run("nospec", "no speculation", bs, None))
        elif mode == "nospec_sync":
            # vLLM schedules the next step during the current one only for its own speculative
            # methods; eagle2 engines run synchronously, as this one does.
            label, sync = "no speculation, synchronous scheduling", {"async_scheduling": False}
            plan.append(Run("nospec_sync", label, bs, None, engine_kwargs=sync))
        elif mode == "eagle":
            for kk in args.eagle_k:
                spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": kk}
                plan.append(Run("eagle", f"vLLM eagle k={kk}", bs, spec))
        elif mode == "ngram":
            for kk in args.eagle_k:
                # vLLM's defaults match 5-grams only; 1-4 finds the shorter repeats chat text has.
                spec = {
                    "method": "ngram",
                    "num_speculative_tokens": kk,
                    "prompt_lookup_min": 1,
                    "prompt_lookup_max": 4,
                }
                plan.append(Run("ngram", f"vLLM ngram k={kk}", bs, spec))
        elif mode == "suffix":
            plan.append(Run("suffix", "vLLM suffix", bs, {"method": "suffix"}))
        elif mode == "eagle3":
            for kk in args.eagle_k:
                spec = {"method": "eagle3", "model": str(target.eagle3_head), "num_speculative_tokens": kk}
                plan.append(Run("eagle3", f"vLLM eagle3 k={kk}", bs, spec))
        elif mode == "eagle3_trees":
            for b in BUDGETS if args.budget == "both" else [args.budget]:
                run = eagle2_run("dynamic", target.eagle3_head, bs, m, d, k, budget=b)
                plan.append(Run("eagle3_trees", f"{run.label} (EAGLE-3 head)", bs, run.spec))
        elif mode in ("defaults", "never"):
            plan.append(eagle2_run(mode, head, bs, m, d, k))
        elif mode == "lookup_head":
            from vllm_eagle2.engine.lookup_drafts import HEAD_SKIP_ENV  # torch: not at import

            label, keep = "eagle2 defaults, head beside every chain", {"env": {HEAD_SKIP_ENV: "0"}}
            plan.append(
                Run("lookup_head", label, bs, {"method": "eagle2", "model": str(head)}, engine_kwargs=keep)
            )
        elif mode == "lookup":
            spec = {"method": "eagle2", "model": str(head), "lookup": args.lookup}
            label = f"eagle2 defaults + lookup {args.lookup}" if args.lookup else "eagle2 defaults, no lookup"
            plan.append(Run("lookup", label, bs, spec))
        else:
            budgets = BUDGETS if args.budget == "both" else [args.budget]
            plan += [eagle2_run(mode, head, bs, m, d, k, args.draft_vocab, b) for b in budgets]
    plan += [eagle2_run(tree, head, bs, *size, budget="fixed", sweep=True) for tree, *size in args.sweep]
    return plan


def length_range(max_tokens: int, range_ratio: float) -> tuple[int, int]:
    """The smallest and largest per-prompt ``max_tokens`` of ``--range-ratio``:
    ``max_tokens * (1 -/+ range_ratio)``, rounded, at least 1."""
    low = max(1, round(max_tokens * (1 - range_ratio)))
    return low, max(low, round(max_tokens * (1 + range_ratio)))


def check_context(prompt_sets: dict[str, list[dict[str, list[int]]]], args: argparse.Namespace) -> None:
    """Refuse, before any engine starts, prompt sets whose longest prompt and longest output
    (``--max-tokens`` spread by ``--range-ratio``) exceed ``--max-model-len``: vLLM would refuse that
    prompt in every timed pass, minutes into the run."""
    longest_output = length_range(args.max_tokens, args.range_ratio)[1]
    over = {
        name: longest
        for name, prompts in prompt_sets.items()
        if (longest := max(len(p["prompt_token_ids"]) for p in prompts)) + longest_output > args.max_model_len
    }
    if over:
        sets = ", ".join(f"{name} (a prompt of {n} tokens)" for name, n in over.items())
        raise SystemExit(
            f"error: --max-model-len {args.max_model_len} cannot hold {sets} plus {longest_output} new "
            "tokens; raise --max-model-len or lower --num-prompts"
        )
