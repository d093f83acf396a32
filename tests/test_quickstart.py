"""The quickstart (the README's first command) cannot mislead: medians over rounds in which the engines
take turns batch by batch, and a warning whenever its numbers cannot be right.

The report's checks run on hand-made rounds; one run on the tiny pair checks the whole command.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_eagle2_tools.bench.quickstart import (
    EngineRuns,
    Setup,
    failures,
    report,
    speedup_summary,
    unchecked,
    warnings_for,
)

REPO = Path(__file__).resolve().parents[1]
ARGS = argparse.Namespace(temperature=0.0, max_tokens=8, batch_size=1, enforce_eager=False)
SETUP = Setup(model=Path("m"), head=Path("h"), dtype="float32", tiny=True, description="test pair")


def _runs(
    label: str,
    seconds: list[float],
    tokens: int = 100,
    drafts: float = 0.0,
    accepted: float = 0.0,
    outputs: list[list[int]] | None = None,
):
    return EngineRuns(
        label,
        seconds=seconds,
        tokens=outputs or [[1, 2, 3]],
        num_tokens=[tokens] * len(seconds),
        drafts=drafts,
        accepted=accepted,
    )


def test_the_speedup_is_the_median_of_the_rounds_with_its_range():
    base = _runs("no speculation", [10.0, 10.0, 10.0])
    eagle = _runs("eagle2", [8.0, 5.0, 10.0], drafts=100, accepted=100)  # 1.25x, 2.0x, 1.0x
    assert speedup_summary(base, eagle) == (1.25, 1.0, 2.0)
    assert "1.25x (1.00-2.00)" in report(SETUP, base, eagle, ARGS)


def test_steady_rounds_below_tau_carry_no_warning():
    base = _runs("no speculation", [10.0, 10.5, 10.2])
    eagle = _runs("eagle2", [8.0, 8.3, 8.1], drafts=100, accepted=50)  # tau 1.5, about 1.26x
    assert warnings_for(base, eagle) == []
    assert "UNRELIABLE" not in report(SETUP, base, eagle, ARGS)


def test_a_speedup_above_tau_is_flagged_unreliable():
    base = _runs("no speculation", [10.0, 10.0, 10.0])
    eagle = _runs("eagle2", [5.0, 5.0, 5.0], drafts=100, accepted=20)  # 2.0x with tau 1.2
    (warning,) = warnings_for(base, eagle)
    assert "exceeds tau 1.20" in warning
    assert "UNRELIABLE: the speed-up 2.00x exceeds tau 1.20" in report(SETUP, base, eagle, ARGS)


def test_rounds_that_differ_by_more_than_a_fifth_are_flagged():
    base = _runs("no speculation", [10.0, 13.0, 10.0])  # 30% apart
    eagle = _runs("eagle2", [9.0, 9.0, 9.0], drafts=100, accepted=50)
    (warning,) = warnings_for(base, eagle)
    assert warning.startswith("no speculation's rounds differ by 30%")


def test_an_engine_that_drafted_nothing_fails_and_says_the_tau_check_could_not_run():
    """A run without drafts showed plain decoding, not eagle2: a failure (exit status 1), and the
    speed-up cannot be held against a tau it does not have."""
    base = _runs("no speculation", [10.0, 10.0])
    eagle = _runs("eagle2", [10.1, 10.0])
    text = report(SETUP, base, eagle, ARGS)
    assert "- (drafted nothing)" in text and "verified no drafts" in text
    assert "\nFAIL: eagle2 verified no drafts in any timed round" in text
    assert "NOT CHECKED: the speed-up against tau: eagle2 drafted nothing" in text
    assert failures(SETUP, base, eagle, ARGS)


def test_one_round_says_the_spread_check_needs_two():
    base = _runs("no speculation", [10.0])
    eagle = _runs("eagle2", [8.0], drafts=100, accepted=50)
    (what,) = unchecked(base, eagle)
    assert "needs at least 2 timed rounds, this run had 1" in what
    assert "NOT CHECKED: whether the machine's speed moved between rounds" in report(SETUP, base, eagle, ARGS)
    two = _runs("no speculation", [10.0, 10.0]), _runs("eagle2", [8.0, 8.0], drafts=100, accepted=50)
    assert unchecked(*two) == [] and "NOT CHECKED" not in report(SETUP, *two, ARGS)


@pytest.mark.parametrize(
    ("dtype", "cuda", "fails"),
    [("float32", False, True), ("bfloat16", False, False), ("float32", True, False)],
    ids=["float32-cpu", "bf16", "float32-cuda"],
)
def test_a_greedy_difference_fails_in_float32_on_a_cpu_only(dtype, cuda, fails):
    """Exact in float32 on a CPU (docs/design.md, section 4): a difference is a bug. bf16 near-ties,
    and float32 on CUDA (vLLM's Triton attention in TF32), are reported, not failed."""
    setup = Setup(model=Path("m"), head=Path("h"), dtype=dtype, tiny=True, description="test pair", cuda=cuda)
    base = _runs("no speculation", [10.0, 10.0], outputs=[[1, 2, 3], [4, 5, 6]])
    eagle = _runs("eagle2", [8.0, 8.0], drafts=100, accepted=50, outputs=[[1, 2, 3], [4, 9, 6]])
    text = report(setup, base, eagle, ARGS)
    assert bool(failures(setup, base, eagle, ARGS)) == fails
    assert (
        "FAIL: 1 of 2 greedy outputs differ from no speculation's (first difference at token [1])" in text
    ) == fails
    assert ("diverging outputs: first difference at token [1] (not exact" in text) == (not fails)
    sampled = argparse.Namespace(**{**vars(ARGS), "temperature": 1.0})
    assert failures(setup, base, eagle, sampled) == []  # sampled outputs are not compared


def test_the_exit_status_is_1_on_a_failure(monkeypatch, capsys):
    from vllm_eagle2_tools.bench import quickstart

    args = argparse.Namespace(**{**vars(ARGS), "verbose": False})
    same = _runs("no speculation", [10.0, 10.0]), _runs("eagle2", [8.0, 8.0], drafts=100, accepted=50)
    undrafted = _runs("no speculation", [10.0, 10.0]), _runs("eagle2", [10.0, 10.0])
    differs = same[0], _runs("eagle2", [8.0, 8.0], drafts=100, accepted=50, outputs=[[1, 2, 4]])
    monkeypatch.setattr(quickstart, "prepare_env", lambda quiet: None)
    monkeypatch.setattr(quickstart, "resolve_setup", lambda args: SETUP)
    for runs, status in ((same, 0), (undrafted, 1), (differs, 1)):
        monkeypatch.setattr(quickstart, "run_rounds", lambda setup, spec, args, out=runs: out)
        assert quickstart.run_quickstart(args) == status
        assert ("FAIL:" in capsys.readouterr().out) == bool(status)


def test_the_quickstart_runs_on_the_tiny_pair(tmp_path):
    from vllm_eagle2_tools.testing import build_pair, stored

    target, head = (stored(p) for p in build_pair(tmp_path, "partial"))
    argv = ["--model", str(target), "--head", str(head), "--num-prompts", "2", "--max-tokens", "8"]
    argv += ["--rounds", "2", "--budget", "fixed", "--num-speculative-tokens", "6", "--depth", "3"]
    argv += ["--topk", "2", "--dtype", "float32", "--enforce-eager"]  # compiled mode: test_engine_*
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "quickstart.py"), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},  # engine cores in its process: faster
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "2 timed rounds, the engines taking turns batch by batch" in out
    eagle_row = next(line for line in out.splitlines() if line.startswith("eagle2 "))
    assert "budget=fixed" in eagle_row and eagle_row.rstrip().endswith("2/2"), out  # identical outputs
    assert sum(": round " in line for line in proc.stderr.splitlines()) == 4  # 2 engines x 2 rounds


def test_the_engines_take_turns_batch_by_batch_from_a_cold_prefix_cache(monkeypatch):
    from vllm_eagle2_tools.bench import quickstart

    calls: list[tuple[str, ...]] = []

    class Engine:
        def __init__(self, name: str) -> None:
            self.name = name

        def generate(self, prompts, params, use_tqdm):
            calls.append((self.name, *prompts))
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2])]) for _ in prompts]

    engines = iter([Engine("base"), Engine("eagle2")])
    monkeypatch.setattr(quickstart, "_start", lambda *a: next(engines))
    monkeypatch.setattr(quickstart, "_params", lambda *a: None)
    monkeypatch.setattr(quickstart, "cold_prefix_cache", lambda llm: calls.append((llm.name, "cold")))
    for name in ("own_metrics", "use_metrics", "shutdown_llm"):
        monkeypatch.setattr(quickstart, name, lambda *a: None)
    monkeypatch.setattr(quickstart, "spec_counters", lambda llm: (0, 0, None))
    setup = Setup(model=Path("m"), head=Path("h"), dtype="float32", tiny=True, description="", prompts="abc")
    args = argparse.Namespace(**{**vars(ARGS), "batch_size": 2, "rounds": 2})
    base, eagle = quickstart.run_rounds(setup, {}, args)
    # batches "ab" and "c"; who goes first alternates by batch and by round
    assert calls == [
        ("base", "cold"), ("eagle2", "cold"),
        ("base", "a", "b"), ("eagle2", "a", "b"), ("eagle2", "c"), ("base", "c"),
        ("base", "cold"), ("eagle2", "cold"),
        ("eagle2", "a", "b"), ("base", "a", "b"), ("base", "c"), ("eagle2", "c"),
    ]  # fmt: skip
    assert base.num_tokens == eagle.num_tokens == [6, 6] and len(base.seconds) == 2


@pytest.mark.parametrize(
    ("flags", "dtype"), [(["avx512f", "amx_bf16"], "bfloat16"), (["avx2", "avx512_bf16"], "float32")]
)
def test_the_real_models_dtype_is_bfloat16_only_where_the_cpu_has_amx_tiles(flags, dtype):
    from vllm_eagle2_tools.bench.quickstart import fastest_dtype

    assert fastest_dtype({"model": "x", "flags": flags}) == dtype
