"""The benchmark's runs, in one process: one engine after another, each shut down before the next, or
(``--interleave``) the engines of a batch size up together, taking turns."""

from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import replace
from typing import Any

from vllm_eagle2_tools.bench import log
from vllm_eagle2_tools.bench.config import Target, length_range, plan_runs
from vllm_eagle2_tools.bench.records import Run, mean_drafts_per_step
from vllm_eagle2_tools.engine import build_llm, own_metrics, shutdown_llm, spec_counters, use_metrics, warm_up

#: Token-id prompts, as ``llm.generate`` takes them.
Prompts = list[dict[str, list[int]]]


def read_budget(llm: Any, run: Run) -> dict[str, Any] | None:
    """The adaptive budget's counters (None unless the run uses it)."""
    if not run.spec or run.spec.get("method") != "eagle2" or run.spec.get("budget") == "fixed":
        return None
    return llm.collective_rpc("eagle2_budget_summary")[0]


def read_lookup_accepted(llm: Any, run: Run) -> int:
    """Accepted drafts that came from lookup chains so far (0 unless the run grafts them: an eagle2
    run with ``lookup`` unset or above 0, as they are on by default)."""
    if not run.spec or run.spec.get("method") != "eagle2" or run.spec.get("lookup") == 0:
        return 0
    return llm.collective_rpc("eagle2_stats")[0].get("lookup_accepted", 0)


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
        "steps_head_skipped": after["steps_head_skipped"] - before["steps_head_skipped"],
        "mean_drafts_per_step": mean_drafts_per_step(hist, steps),
        "drafts_per_step": {k: v for k, v in hist.items() if v},
        "shapes": {k: v for k, v in shapes.items() if v},
        "overhead_ms": round(after["overhead_ms"], 3),
        "replans": after["replans"] - before["replans"],
        "acceptance_top1": after.get("acceptance_top1"),
        "prices_ms": after.get("prices_ms"),
        # the outcome check: its probes and vetoes in these passes, its measured rates after them
        "probes": after.get("probes", 0) - before.get("probes", 0),
        "steps_vetoed": after.get("steps_vetoed", 0) - before.get("steps_vetoed", 0),
        "measured_rates": after.get("measured_rates"),
    }


def start_engine(run: Run, target: Target, prompts: Prompts, args: argparse.Namespace) -> Any:
    """Start ``run``'s engine and warm it up (a short generation, not timed); returns vLLM's ``LLM``."""
    log(f"{run.label} (batch {run.batch_size}): starting the engine")
    t0 = time.perf_counter()
    llm = build_llm(
        target.model,
        run.spec,
        dtype=target.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=run.batch_size,
        eager=args.enforce_eager,
        **run.engine_kwargs,
    )
    try:
        run.engine_start_seconds = round(time.perf_counter() - t0, 1)
        warm_up(llm, prompts)
    except BaseException:
        stop_engine(llm)
        raise
    return llm


def stop_engine(llm: Any) -> None:
    """Shut the engine down and collect what it held."""
    shutdown_llm(llm)
    gc.collect()


def output_lengths(num_prompts: int, max_tokens: int, range_ratio: float, seed: int) -> list[int]:
    """Each prompt's ``max_tokens``: uniform integers in ``[max_tokens * (1 - range_ratio), max_tokens *
    (1 + range_ratio)]`` (at least 1), the same for every engine of a benchmark (seeded), as ``vllm bench``'s
    ``--random-range-ratio`` spreads its output lengths.

    Why spread them: requests that all stop after the same number of tokens finish in the same step
    without speculation, and the next batch's prompts are then prefilled together in one step, while a
    speculative engine's requests finish steps apart and each prompt is prefilled in a step of its own.
    Measured at batch 4 (16 MT-bench prompts x 32 tokens, fp32): eagle2 spent 6.2 s prefilling in 12
    steps, no speculation 3.3 s in 4, which was the whole of eagle2's deficit. A server's requests
    do not finish in lockstep either.
    """
    rng = random.Random(seed)
    low, high = length_range(max_tokens, range_ratio)
    return [rng.randint(low, high) for _ in range(num_prompts)]


def cold_prefix_cache(llm: Any) -> None:
    """Empty the engine's prefix cache, so that a timed pass prefills every prompt it measures.

    Without it, a pass was served from the blocks that the warm-up and the earlier passes over the
    same prompts left behind, which a server meeting new prompts does not get, and unevenly: vLLM
    gives an EAGLE-type drafter one block less of every hit (the drafter recomputes the target's
    hidden states from there). Measured at batch 64 (64 MT-bench prompts, fp32, 3 rounds): no
    speculation prefilled 11.8k tokens a round against eagle2's 13.6k, of 14.2k without the cache.
    """
    if not llm.reset_prefix_cache():
        raise RuntimeError("benchmark: vLLM did not reset its prefix cache before a timed pass")


def time_generation(llm: Any, run: Run, prompts: Prompts, args: argparse.Namespace) -> Run:
    """Time ``generate`` over ``prompts`` on a warm engine (``args.repeats`` passes from a cold prefix cache,
    the fastest counts) and record the outputs and the counters' deltas in ``run``.

    ``args``: the benchmark's options (``seed``, ``temperature``, ``max_tokens``, ``range_ratio``
    (:func:`output_lengths`), ``repeats``; ``tiny``: ignore EOS, the tiny target's is arbitrary).
    """
    from vllm import SamplingParams

    d0, a0, p0 = spec_counters(llm)
    params = [
        SamplingParams(
            temperature=args.temperature,
            max_tokens=n,
            ignore_eos=args.tiny,
            seed=args.seed if args.temperature > 0 else None,
        )
        for n in output_lengths(len(prompts), args.max_tokens, args.range_ratio, args.seed)
    ]
    b0, l0 = read_budget(llm, run), read_lookup_accepted(llm, run)
    for _ in range(max(1, args.repeats)):
        cold_prefix_cache(llm)
        t1 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        run.seconds_all.append(round(time.perf_counter() - t1, 4))
    run.seconds = min(run.seconds_all)
    d1, a1, p1 = spec_counters(llm)
    run.budget = budget_delta(b0, read_budget(llm, run))
    run.lookup_accepted = read_lookup_accepted(llm, run) - l0
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


def run_engine(run: Run, target: Target, prompts: Prompts, args: argparse.Namespace) -> Run:
    """Start an engine, warm it up, time ``generate`` (:func:`time_generation`), shut the engine down."""
    llm = start_engine(run, target, prompts, args)
    try:
        return time_generation(llm, run, prompts, args)
    finally:
        stop_engine(llm)


def _failed(run: Run, exc: Exception) -> Run:
    run.error = f"{type(exc).__name__}: {exc}"
    log(f"{run.label}: FAILED {run.error}")
    gc.collect()
    return run


def _interleaved(
    args: argparse.Namespace, target: Target, prompt_sets: dict[str, Prompts], bs: int
) -> list[Run]:
    """``--interleave``: the batch size's engines are up together; round r is one timed pass of each
    over each prompt set (``--dataset a,b``: engines start once for all of them).

    Rounds are then seconds apart instead of engine starts apart, so a machine whose speed drifts
    over minutes drifts less within a round. An engine that fails to start fails every round.
    """
    plan = plan_runs(args, target, bs)
    warm_prompts = next(iter(prompt_sets.values()))
    llms: dict[int, Any] = {}
    metrics: dict[int, list[Any]] = {}  # each engine's own counters (engine.own_metrics)
    runs: list[Run] = []
    try:
        for i, run in enumerate(plan):
            try:
                llms[i] = start_engine(run, target, warm_prompts, args)
                metrics[i] = own_metrics()
            except Exception as exc:  # noqa: BLE001 - one failing mode must not lose the others
                _failed(run, exc)
        order = list(range(len(plan)))
        for round_ in range(max(1, args.rounds)):
            for name, prompts in prompt_sets.items():
                for i in order if round_ % 2 == 0 else order[::-1]:
                    # A fresh run per pass (its own lists); one whose engine failed keeps the error.
                    run = replace(
                        plan[i], round=round_, dataset=name, tokens=[], seconds_all=[], accepted_per_pos=[]
                    )
                    if i not in llms:
                        runs.append(run)
                        continue
                    try:
                        use_metrics(metrics[i])
                        runs.append(time_generation(llms[i], run, prompts, args))
                    except Exception as exc:  # noqa: BLE001
                        runs.append(_failed(run, exc))
    finally:
        for llm in llms.values():
            stop_engine(llm)
    return runs


def run_all(
    args: argparse.Namespace, target: Target, prompt_sets: dict[str, Prompts], batch_sizes: list[int]
) -> list[Run]:
    """Every planned run at every batch size over every prompt set (``{name: prompts}``; each run records
    its set's name in ``Run.dataset``), ``args.rounds`` times; a run that fails keeps its error and the
    others go on.

    Rounds alternate the order of the engines (first to last, then last to first), so that a machine
    slowing down or speeding up over a round weighs on each engine alike across two rounds. Each round
    starts every engine anew, or with ``args.interleave`` reuses engines started once per batch size
    (:func:`_interleaved`).
    """
    runs: list[Run] = []
    for bs in batch_sizes:
        if args.interleave:
            runs.extend(_interleaved(args, target, prompt_sets, bs))
            continue
        for name, prompts in prompt_sets.items():
            for round_ in range(max(1, args.rounds)):
                plan = plan_runs(args, target, bs)
                for run in plan if round_ % 2 == 0 else plan[::-1]:
                    run.round, run.dataset = round_, name
                    try:
                        runs.append(run_engine(run, target, prompts, args))
                    except Exception as exc:  # noqa: BLE001 - one failing mode must not lose the others
                        runs.append(_failed(run, exc))
    return runs
