"""The benchmark's runs: one engine after another in one process, each shut down before the next."""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

from vllm_eagle2.bench import log
from vllm_eagle2.bench.config import Target, plan_runs
from vllm_eagle2.bench.records import Run, mean_drafts_per_step
from vllm_eagle2.engine import build_llm, shutdown_llm, spec_counters, warm_up


def read_budget(llm: Any, run: Run) -> dict[str, Any] | None:
    """The adaptive budget's counters (None unless the run uses it)."""
    if not run.spec or run.spec.get("method") != "eagle2" or run.spec.get("budget") == "fixed":
        return None
    return llm.collective_rpc("eagle2_budget_summary")[0]


def budget_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the timed passes did: steps, steps without drafts, mean drafts per step, plans chosen (and how
    often the plan was recomputed)."""
    if before is None or after is None:
        return None
    steps = after["steps"] - before["steps"]
    hist = {k: v - before["drafts_per_step"].get(k, 0) for k, v in after["drafts_per_step"].items()}
    shapes = {k: v - before["shapes"].get(k, 0) for k, v in after["shapes"].items()}
    return {
        "steps": steps,
        "steps_without_drafts": after["steps_without_drafts"] - before["steps_without_drafts"],
        "mean_drafts_per_step": mean_drafts_per_step(hist, steps),
        "drafts_per_step": {k: v for k, v in hist.items() if v},
        "shapes": {k: v for k, v in shapes.items() if v},
        "overhead_ms": round(after["overhead_ms"], 3),
        "replans": after["replans"] - before["replans"],
    }


def run_engine(
    run: Run, target: Target, prompts: list[dict[str, list[int]]], args: argparse.Namespace
) -> Run:
    """Start an engine, warm it up, time ``generate``, read the counters' deltas, shut the engine down.

    ``args``: the benchmark's options (``max_model_len``, ``seed``, ``temperature``, ``max_tokens``,
    ``repeats``; ``tiny``: ignore EOS, the tiny target's is arbitrary).
    """
    from vllm import SamplingParams

    log(f"{run.label} (batch {run.batch_size}): starting the engine")
    t0 = time.perf_counter()
    llm = build_llm(
        target.model,
        run.spec,
        dtype=target.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=run.batch_size,
        **run.engine_kwargs,
    )
    try:
        run.engine_start_seconds = round(time.perf_counter() - t0, 1)
        warm_up(llm, prompts)
        d0, a0, p0 = spec_counters(llm)
        params = SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            ignore_eos=args.tiny,
            seed=args.seed if args.temperature > 0 else None,
        )
        b0 = read_budget(llm, run)
        for _ in range(max(1, args.repeats)):
            t1 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            run.seconds_all.append(round(time.perf_counter() - t1, 4))
        run.seconds = min(run.seconds_all)
        d1, a1, p1 = spec_counters(llm)
        run.budget = budget_delta(b0, read_budget(llm, run))
    finally:
        shutdown_llm(llm)
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


def run_all(
    args: argparse.Namespace, target: Target, prompts: list[dict[str, list[int]]], batch_sizes: list[int]
) -> list[Run]:
    """Every planned run at every batch size, ``args.rounds`` times; a run that fails keeps its error and
    the others go on.

    Rounds alternate the order of the engines (first to last, then last to first), so that a machine
    slowing down or speeding up over a round weighs on each engine alike across two rounds.
    """
    runs: list[Run] = []
    for bs in batch_sizes:
        for round_ in range(max(1, args.rounds)):
            plan = plan_runs(args, target, bs)
            for run in plan if round_ % 2 == 0 else plan[::-1]:
                run.round = round_
                try:
                    runs.append(run_engine(run, target, prompts, args))
                except Exception as exc:  # noqa: BLE001 - one failing mode must not lose the others
                    run.error = f"{type(exc).__name__}: {exc}"
                    log(f"{run.label}: FAILED {run.error}")
                    runs.append(run)
                    gc.collect()
    return runs
