"""The benchmark's ``--rounds``: engines run in alternating order, speed-ups paired within a round; with
``--interleave`` the engines of a batch size stay up together and take turns.

Pure bookkeeping on hand-made runs (no engine starts): what the tables and plots report.
"""

from __future__ import annotations

import argparse

import pytest

from vllm_eagle2_tools.bench import engines
from vllm_eagle2_tools.bench.records import Run, result_rows
from vllm_eagle2_tools.bench.report import markdown_table

SPEC = {"method": "eagle2", "model": "head"}


def _run(mode: str, round_: int, seconds: float, *, tokens=None, drafts=0.0, accepted=0.0) -> Run:
    label = "no speculation" if mode == "nospec" else "eagle2 defaults"
    run = Run(mode, label, 4, None if mode == "nospec" else SPEC, round=round_)
    run.tokens = tokens or [[1, 2, 3, 4]] * 5  # 20 tokens
    run.seconds, run.seconds_all = seconds, [seconds]
    run.drafts, run.accepted, run.accepted_per_pos = drafts, accepted, [accepted]
    return run


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    # Round 1 is a slow spell of the machine: both engines take twice as long.
    runs = [
        _run("nospec", 0, 10.0),
        _run("defaults", 0, 8.0, drafts=10, accepted=5),
        _run("nospec", 1, 20.0),
        _run("defaults", 1, 16.0, drafts=10, accepted=5),
        _run("nospec", 2, 10.0),
        _run("defaults", 2, 12.0, drafts=20, accepted=2, tokens=[[1, 2, 3, 4]] * 4 + [[1, 2, 3, 9]]),
    ]
    all_rows, _ = result_rows(runs, [4], greedy=True)
    return all_rows


def test_one_row_per_engine_across_rounds(rows: list[dict]) -> None:
    assert [r["label"] for r in rows] == ["no speculation", "eagle2 defaults"]


def test_speedup_is_the_median_of_each_rounds_own_ratio(rows: list[dict]) -> None:
    """Rounds' ratios 1.25, 1.25, 0.83: the median is 1.25. The ratio of the median times would
    be 10 / 12 = 0.83, the slow spell counted against eagle2."""
    spec = rows[1]
    assert spec["speedup_rounds"] == [1.25, 1.25, 0.833]
    assert spec["speedup"] == 1.25
    assert spec["seconds"] == 12.0  # the median round's time, for tokens/s


def test_counters_add_up_over_rounds(rows: list[dict]) -> None:
    spec = rows[1]
    assert (spec["drafts"], spec["accepted"]) == (40, 12)
    assert spec["tau"] == 1.3
    assert spec["acceptance_per_pos"] == [0.3]


def test_every_rounds_outputs_are_compared_with_its_own_no_speculation(rows: list[dict]) -> None:
    spec = rows[1]
    assert (spec["identical"], spec["compared"], spec["first_divergence"]) == (14, 15, [3])


def test_table_shows_the_median_and_range_of_the_speedups(rows: list[dict]) -> None:
    assert "1.25x (0.83-1.25)" in markdown_table(rows, greedy=True)


def _three_modes(args, target, bs: int) -> list[Run]:
    return [Run(m, m, bs, None) for m in ("nospec", "eagle", "defaults")]


#: (round, mode) of three engines over three rounds: first to last, then last to first.
ALTERNATING = [
    (0, "nospec"),
    (0, "eagle"),
    (0, "defaults"),
    (1, "defaults"),
    (1, "eagle"),
    (1, "nospec"),
    (2, "nospec"),
    (2, "eagle"),
    (2, "defaults"),
]


def test_rounds_alternate_the_order_of_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[int, str]] = []

    def fake_run_engine(run: Run, target, prompts, args) -> Run:
        order.append((run.round, run.mode))
        return run

    monkeypatch.setattr(engines, "run_engine", fake_run_engine)
    monkeypatch.setattr(engines, "plan_runs", _three_modes)
    runs = engines.run_all(argparse.Namespace(rounds=3, interleave=False), None, {"mtbench": []}, [1])
    assert order == ALTERNATING
    assert len({id(r) for r in runs}) == 9  # a fresh run per round: no shared token lists


def _interleave(monkeypatch: pytest.MonkeyPatch, datasets: tuple[str, ...]) -> tuple[list, list[Run]]:
    """``--interleave --rounds 3`` over three fake engines, the second of which fails to start, timing
    each of ``datasets``: (events in order, the runs returned)."""
    events: list[tuple] = []

    def start_engine(run: Run, target, prompts, args) -> str:
        events.append(("start", run.mode))
        if run.mode == "eagle":
            raise RuntimeError("no memory left")
        return f"llm-{run.mode}"

    def time_generation(llm: str, run: Run, prompts, args) -> Run:
        assert prompts == [run.dataset]
        events.append(("pass", run.round, run.mode, llm, metrics[0]))
        run.tokens.append([run.round])
        return run

    monkeypatch.setattr(engines, "plan_runs", _three_modes)
    monkeypatch.setattr(engines, "start_engine", start_engine)
    monkeypatch.setattr(engines, "time_generation", time_generation)
    monkeypatch.setattr(engines, "stop_engine", lambda llm: events.append(("stop", llm)))
    # The counters read in a pass: those of the engine started last, unless a pass swaps its own in.
    metrics = [None]
    monkeypatch.setattr(engines, "own_metrics", lambda: f"metrics-{events[-1][1]}")
    monkeypatch.setattr(engines, "use_metrics", lambda m: metrics.__setitem__(0, m))
    sets = {name: [name] for name in datasets}
    runs = engines.run_all(argparse.Namespace(rounds=3, interleave=True), None, sets, [1])
    return events, runs


@pytest.fixture
def interleaved(monkeypatch: pytest.MonkeyPatch) -> tuple[list, list[Run]]:
    return _interleave(monkeypatch, ("mtbench",))


def test_interleave_starts_each_engine_once_and_alternates_their_passes_on_their_own_counters(
    interleaved,
) -> None:
    events, _ = interleaved
    assert events == [
        ("start", "nospec"),
        ("start", "eagle"),
        ("start", "defaults"),
        ("pass", 0, "nospec", "llm-nospec", "metrics-nospec"),
        ("pass", 0, "defaults", "llm-defaults", "metrics-defaults"),
        ("pass", 1, "defaults", "llm-defaults", "metrics-defaults"),
        ("pass", 1, "nospec", "llm-nospec", "metrics-nospec"),
        ("pass", 2, "nospec", "llm-nospec", "metrics-nospec"),
        ("pass", 2, "defaults", "llm-defaults", "metrics-defaults"),
        ("stop", "llm-nospec"),
        ("stop", "llm-defaults"),
    ]


def test_interleave_gives_every_pass_a_fresh_run_and_fails_an_unstarted_engine_in_every_round(
    interleaved,
) -> None:
    _, runs = interleaved
    assert [(r.round, r.mode) for r in runs] == ALTERNATING
    assert all(r.tokens == [[r.round]] for r in runs if r.mode != "eagle")  # no token list shared
    assert {r.error for r in runs if r.mode == "eagle"} == {"RuntimeError: no memory left"}
    assert all(r.error is None for r in runs if r.mode != "eagle")


def test_several_data_sets_share_the_engines_each_round_timing_every_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events, runs = _interleave(monkeypatch, ("sharegpt-qa", "sharegpt-rewrite"))
    assert [e[1] for e in events if e[0] == "start"] == ["nospec", "eagle", "defaults"]  # once each
    timed = [(r.round, r.dataset, r.mode) for r in runs if r.mode != "eagle"]
    assert timed == [
        (round_, name, mode)
        for round_ in range(3)
        for name in ("sharegpt-qa", "sharegpt-rewrite")
        for mode in (("nospec", "defaults") if round_ % 2 == 0 else ("defaults", "nospec"))
    ]


def test_an_engines_own_metrics_come_back_after_a_later_engine_unregistered_them() -> None:
    from prometheus_client import REGISTRY, Counter
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from vllm_eagle2_tools.engine import own_metrics, use_metrics

    counter = Counter("vllm:test_drafts", "drafts of a first engine")
    try:
        first = own_metrics()
        assert counter in first
        unregister_vllm_metrics()  # what a second engine's start does
        assert counter not in own_metrics()
        use_metrics(first)
        counter.inc(3)
        assert REGISTRY.get_sample_value("vllm:test_drafts_total") == 3
    finally:
        unregister_vllm_metrics()


def test_budget_counters_add_up_over_rounds() -> None:
    runs = [
        _run("nospec", 0, 10.0),
        _run("defaults", 0, 8.0),
        _run("nospec", 1, 10.0),
        _run("defaults", 1, 8.0),
    ]
    runs[1].budget = {
        "steps": 10,
        "steps_without_drafts": 2,
        "steps_head_skipped": 3,
        "drafts_per_step": {"0": 2, "3": 8},
        "shapes": {"d0k0": 2, "d1k3": 8},
        "overhead_ms": 1.0,
        "replans": 1,
    }
    runs[3].budget = {
        "steps": 5,
        "steps_without_drafts": 5,
        "drafts_per_step": {"0": 5},
        "shapes": {"d0k0": 5},
        "overhead_ms": 3.0,
        "replans": 0,
    }
    budget = result_rows(runs, [4], greedy=True)[0][1]["budget"]
    assert (budget["steps"], budget["steps_without_drafts"], budget["replans"]) == (15, 7, 1)
    assert budget["steps_head_skipped"] == 3  # the second round's record predates the counter
    assert budget["drafts_per_step"] == {"0": 7, "3": 8}
    assert budget["mean_drafts_per_step"] == pytest.approx(24 / 15)


def test_each_data_set_gets_its_own_record_named_after_it(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """``--dataset a,b``: one timed run list, split into ``FILE-a.json`` and ``FILE-b.json``."""
    import json

    from vllm_eagle2_tools.bench import cli
    from vllm_eagle2_tools.bench.config import Target

    def run_all(args, target, prompt_sets, batch_sizes) -> list[Run]:
        runs = []
        for name in prompt_sets:
            for mode, seconds in (("nospec", 10.0), ("defaults", 8.0 if name == "sharegpt-qa" else 5.0)):
                runs.append(_run(mode, 0, seconds, drafts=4, accepted=2))
                runs[-1].dataset = name
        return runs

    target = Target(tmp_path, tmp_path, "float32", (4, 2, 2), "pair")
    monkeypatch.setattr(cli, "prepare_env", lambda **kw: None)
    monkeypatch.setattr(cli, "resolve_target", lambda args: target)
    monkeypatch.setattr(cli, "load_prompts", lambda name, model, num, chat: [{"prompt_token_ids": [1, 2]}])
    monkeypatch.setattr(cli, "run_all", run_all)
    out = tmp_path / "copy.json"
    argv = ["--dataset", "sharegpt-qa,sharegpt-rewrite", "--batch-size", "4", "--output", str(out)]
    assert cli.main(argv) == 0
    speedups = {}
    for name in ("sharegpt-qa", "sharegpt-rewrite"):
        record = json.loads((tmp_path / f"copy-{name}.json").read_text())
        assert record["setup"]["dataset"] == name and record["setup"]["description"] == f"pair, {name}"
        speedups[name] = record["main_rows"][1]["speedup"]
    assert speedups == {"sharegpt-qa": 1.25, "sharegpt-rewrite": 2.0}
    assert not out.exists()


def test_an_unknown_data_set_is_refused_naming_the_choices(capsys: pytest.CaptureFixture) -> None:
    from vllm_eagle2_tools.bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--dataset", "mtbench,sharegpt-qq"])
    err = capsys.readouterr().err
    assert "sharegpt-qq" in err and "sharegpt-rewrite" in err


def test_a_prompt_longer_than_the_context_is_refused_before_any_engine_starts() -> None:
    from vllm_eagle2_tools.bench.config import check_context

    args = argparse.Namespace(max_tokens=32, range_ratio=0.5, max_model_len=2048)  # outputs up to 48
    check_context({"mtbench": [{"prompt_token_ids": [1] * 2000}]}, args)
    with pytest.raises(SystemExit, match=r"--max-model-len 2048 cannot hold sharegpt-qa \(a prompt of 2001"):
        check_context(
            {"mtbench": [{"prompt_token_ids": [1] * 10}], "sharegpt-qa": [{"prompt_token_ids": [1] * 2001}]},
            args,
        )
