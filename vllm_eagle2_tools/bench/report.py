"""The benchmark's output: the results (``FILE.json``), the Markdown tables (``FILE.md``, also printed)
and the plots (``FILE.modes.png``, ``FILE.batch.png``; :mod:`vllm_eagle2_tools.bench.plot`)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from vllm_eagle2_tools.bench import log
from vllm_eagle2_tools.bench.config import Target, length_range
from vllm_eagle2_tools.bench.plot import plot
from vllm_eagle2_tools.bench.records import Run, result_rows, speedup_text
from vllm_eagle2_tools.machine import cpu_description, cpu_note


def git_commit() -> str | None:
    """The checkout's commit, with ``+dirty`` when files differ from it; None outside a git checkout."""

    def git(*argv: str) -> str:
        here = Path(__file__).resolve().parent
        return subprocess.run(["git", *argv], cwd=here, capture_output=True, text=True, check=True).stdout

    try:
        head, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.strip() + ("+dirty" if dirty.strip() else "")


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (other work on the machine skews the speeds)."""
    return [round(x, 2) for x in os.getloadavg()]


def _lengths_note(setup: dict[str, Any]) -> str:
    """``max 64``, or with ``--range-ratio`` ``max 32-96`` (older results have no ratio: all alike)."""
    ratio = setup.get("range_ratio", 0.0)
    if not ratio:
        return f"max {setup['max_tokens']}"
    low, high = length_range(setup["max_tokens"], ratio)
    return f"max {low}-{high} (uniform, seeded)"


def _rounds_note(rounds: int, interleave: bool = False) -> str:
    """The report's sentence on ``--rounds`` and ``--interleave`` (empty for one round)."""
    if rounds <= 1:
        return ""
    how = (
        "passes of engines kept up together (interleaved, alternating order)"
        if interleave
        else "rounds (alternating order)"
    )
    return (
        f" Every engine ran in {rounds} {how}; speed-ups are the median of the rounds'"
        " own, each against its round's no speculation, with their range; tokens/s is the median round's."
    )


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
            speedup_text(r),
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


def build_results(
    args: argparse.Namespace,
    target: Target,
    prompts: list[dict[str, list[int]]],
    batch_sizes: list[int],
    runs: list[Run],
    *,
    dataset: str,
    command: str,
    load_start: list[float],
    wall_seconds: float,
) -> dict[str, Any]:
    """Everything, as written to the JSON file: command, set-up, rows (main and all), outputs.

    ``runs``: those over ``prompts``, the set named ``dataset`` (``file:PATH`` for ``--prompts``)."""
    all_rows, main_rows = result_rows(runs, batch_sizes, greedy=args.temperature == 0.0)
    m, d, k = target.tree
    return {
        "command": command,
        "setup": {
            "description": f"{target.description}, {dataset}",
            "model": str(target.model),
            "head": str(target.head),
            "eagle3_head": str(target.eagle3_head) if target.eagle3_head else None,
            "dataset": dataset,
            "num_prompts": len(prompts),
            "prompt_tokens": [len(p["prompt_token_ids"]) for p in prompts],
            "max_tokens": args.max_tokens,
            "range_ratio": args.range_ratio,
            "temperature": args.temperature,
            "dtype": target.dtype,
            "vllm_mode": "eager" if getattr(args, "enforce_eager", False) else "compiled",
            "commit": git_commit(),
            "eagle2": {"num_speculative_tokens": m, "depth": d, "topk": k},
            "eagle_k": args.eagle_k,
            "ignore_eos": args.tiny,
            "seed": args.seed,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "interleave": args.interleave,
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "cpu": cpu_description(),
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "load_average_start": load_start,
            "load_average_end": load_average(),
        },
        "batch_sizes": batch_sizes,
        "main_rows": main_rows,
        "all_rows": all_rows,
        "outputs": {f"{r.label} @bs{r.batch_size}": r.tokens for r in runs},
        "wall_seconds": wall_seconds,
    }


def markdown_report(results: dict[str, Any], sweep: bool) -> list[str]:
    """The Markdown report's lines: set-up, main table, vLLM eagle at every k, the ``--sweep`` table."""
    setup = results["setup"]
    greedy = setup["temperature"] == 0.0
    eagle2 = setup["eagle2"]
    all_rows = results["all_rows"]
    eagle_all = [r for r in all_rows if r["mode"] == "eagle"]
    md = [
        f"## {setup['description']}",
        "",
        f"{setup['num_prompts']} prompts, {_lengths_note(setup)} new tokens, temperature "
        f"{setup['temperature']}, {setup['dtype']}, eagle2 m={eagle2['num_speculative_tokens']} "
        f"depth={eagle2['depth']} topk={eagle2['topk']}; vLLM eagle: best of k={setup['eagle_k']} "
        f"by tokens/s. Load average at start / end: {setup['load_average_start'][0]} / "
        f"{setup['load_average_end'][0]} on {setup['cpu_count']} CPUs{cpu_note(setup.get('cpu'))}."
        + _rounds_note(setup.get("rounds", 1), setup.get("interleave", False)),
        "",
        markdown_table(results["main_rows"], greedy),
    ]
    if len(eagle_all) > len(results["batch_sizes"]):
        md += ["", "vLLM eagle, every k:", "", markdown_table(eagle_all, greedy)]
    eagle3_all = [r for r in all_rows if r["mode"] == "eagle3"]
    if len(eagle3_all) > len(results["batch_sizes"]):
        md += ["", "vLLM eagle3 (the EAGLE-3 head), every k:", "", markdown_table(eagle3_all, greedy)]
    rows = [r for r in all_rows if r["mode"] in ("sweep", "static", "dynamic")]
    if sweep:
        md += ["", "eagle2 trees at other settings (m, depth, topk):", "", markdown_table(rows, greedy)]
    return md


def write_outputs(results: dict[str, Any], out: Path, sweep: bool) -> None:
    """Write ``out`` (JSON), the plots beside it and ``out`` .md; print the Markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    md = markdown_report(results, sweep)
    plots = plot(results, out)
    md += ["", "Plots: " + ", ".join(Path(p).name for p in plots) if plots else ""]
    text = "\n".join(md) + "\n"
    out.with_suffix(".md").write_text(text)
    print(text, flush=True)
    log(f"wrote {out}, {out.with_suffix('.md')}, {', '.join(plots)} in {results['wall_seconds']:.0f} s")
