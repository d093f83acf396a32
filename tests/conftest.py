"""Shared test set-up: vLLM on this CPU (docs/design.md, section 3) and an engine runner."""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from vllm_eagle2_tools.cpu_env import configure_cpu_env

configure_cpu_env()  # before vllm is imported anywhere
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU tensors only this way


def freeze_heap() -> None:
    """Put every live object out of the garbage collector's reach (``gc.freeze``).

    vLLM runs a full ``gc.collect()`` about ten times per engine start and stop; in this process,
    which holds torch, vLLM and transformers, each scanned the whole heap: 6.5 s of a tiny
    engine's 8.8 s (measured, 2 cores). Frozen objects are skipped, so a collection scans only
    what is new. vLLM's shutdown unfreezes the heap; :func:`run_llm` freezes it again.
    """
    gc.collect()
    gc.freeze()


try:
    import vllm.entrypoints.llm  # noqa: F401 - its modules are frozen with the rest
except ImportError:  # a GPU machine with torch but no vLLM (docs/gpu.md): ``pytest -m gpu`` needs none
    pass

freeze_heap()


def run_llm(
    target: Path,
    spec: dict[str, Any] | None,
    prompts: Sequence[Any],
    params: Any,
    *,
    fresh_process: bool = False,
    compiled: bool = False,
    **engine_kwargs: Any,
) -> tuple[list[Any], dict[str, Any]]:
    """Generate with a fresh engine (float32), shut it down; returns outputs and metrics.

    Eager unless ``compiled``: vLLM's default mode, the model compiled by torch.compile (Inductor
    here). The first compiled engine of a model shape compiles for about a minute; later ones
    load vLLM's compile cache (about 15 s more than eager).

    The engine core runs inside the test process: a tiny engine starts in about half the time it
    takes in its own process (measured 12-17 s against 26-34 s). ``fresh_process`` puts it in a new
    process instead, where the plugin is loaded (and reads its environment) anew.

    metrics maps counter names to values and vector names to lists; with eagle2, "eagle2_budget"
    holds the adaptive budget's counters (None with the fixed budget) and "eagle2" what the tree
    verification exercised (:class:`vllm_eagle2.engine.verification.VerifyCounters`).
    "aot_loaded" counts the model graphs loaded whole from vLLM's compile cache (no trace, no
    Inductor), None where unread. "compiled_graphs" counts the model graphs torch.compile built or
    loaded for this engine: one per model (the target, and the head where the spec has one) when
    ``compiled``, none when eager;
    asserted here, so that no compiled test runs eager unseen. It is read in this process: None where
    the model runs in others (``fresh_process``, or more than one worker), which ``compiled`` refuses.
    """
    workers = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get("pipeline_parallel_size", 1)
    here = not fresh_process and workers == 1  # the model runs in this process
    if compiled and not here:
        raise ValueError("run_llm: the compile check reads torch's and vLLM's counters in this process")
    from vllm import LLM

    from vllm_eagle2_tools.engine import scoped_env
    from vllm_eagle2_tools.testing import stored

    # Same model, same path: compiled engines of one tiny model share vLLM's compile cache.
    target = stored(target)
    if spec is not None and "model" in spec:
        spec = {**spec, "model": str(stored(spec["model"]))}

    kwargs: dict[str, Any] = dict(
        model=str(target),
        dtype="float32",
        enforce_eager=not compiled,
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
        disable_log_stats=False,
    )
    kwargs.update(engine_kwargs)
    graphs_before, loaded_before = compiled_graphs(), aot_loaded()
    with scoped_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if fresh_process else "0"}):
        llm = LLM(speculative_config=spec, **kwargs)
        try:
            outputs = llm.generate(list(prompts), params, use_tqdm=False)
            metrics: dict[str, Any] = {
                "compiled_graphs": compiled_graphs() - graphs_before if here else None,
                "aot_loaded": aot_loaded() - loaded_before if here else None,
            }
            for m in llm.get_metrics():
                metrics[m.name] = m.value if hasattr(m, "value") else list(getattr(m, "values", []))
            if spec is not None and spec.get("method") == "eagle2":
                metrics["eagle2_budget"] = llm.collective_rpc("eagle2_budget_summary")[0]
                metrics["eagle2"] = llm.collective_rpc("eagle2_stats")[0]
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            freeze_heap()
    if here:
        models = 1 + (spec is not None and "model" in spec)  # the target, and the head
        expected = models if compiled else 0
        assert metrics["compiled_graphs"] == expected, (
            f"{'compiled' if compiled else 'eager'} engine: {metrics['compiled_graphs']} graphs "
            f"compiled or loaded by torch.compile, expected {expected}"
        )
    return outputs, metrics


def compiled_graphs() -> int:
    """Model graphs torch.compile has built or loaded in this process so far.

    Dynamo's count of graphs it traced (each then compiled by Inductor, or taken from its cache), and
    vLLM's count of graphs loaded whole from its ahead-of-time compile cache (no trace). vLLM's other
    counters stay at zero on this CPU, where vLLM hands the trace to torch's own Inductor backend.
    """
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"] + aot_loaded()


def aot_loaded() -> int:
    """Model graphs loaded whole from vLLM's ahead-of-time compile cache in this process so far."""
    from vllm.compilation.counter import compilation_counter

    return compilation_counter.num_aot_artifacts_loaded


def acceptance_length(metrics: dict[str, Any]) -> float:
    """Mean tokens emitted per target pass (accepted drafts + 1) from vLLM's counters."""
    drafts = metrics["vllm:spec_decode_num_drafts"]
    assert drafts > 0, "no speculative steps ran"
    return 1.0 + metrics["vllm:spec_decode_num_accepted_tokens"] / drafts


def assert_trees_exercised(metrics: dict[str, Any], *, branched: bool = True) -> None:
    """The engine verified drafts and accepted some; with ``branched``, it also verified branching
    trees and moved the K/V of accepted off-chain nodes (the paths a chain never takes)."""
    assert metrics["vllm:spec_decode_num_drafts"] > 0, "no drafts were verified"
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0, "no draft was accepted"
    if branched:
        stats = metrics["eagle2"]
        assert stats["tree_rows"] > 0 and stats["kv_moves"] > 0, stats


def assert_accepted_at_every_position(metrics: dict[str, Any], positions: int) -> None:
    """Drafts were accepted at each of the first ``positions`` draft positions (1 to ``positions``
    deep): every output position that speculation decides there met verified drafts."""
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"][:positions]
    assert len(per_position) == positions and all(n > 0 for n in per_position), per_position


def pytest_unconfigure(config: Any) -> None:
    # At exit the frozen heap would outlive the interpreter's last collection (nanobind reports
    # its objects as leaked then).
    gc.unfreeze()


#: Every test module by layer, each a marker: ``pytest -m core`` runs the engine-free core (tree,
#: verification, budget, kernels against their twins) in a few minutes, ``-m engine`` the plugin
#: inside vLLM engines, ``-m tools`` the benchmark, training and scripts, ``-m gpu`` the CUDA checks.
LAYERS = {
    "core": {
        "test_tree",
        "test_verify",
        "test_lookup",
        "test_graft",
        "test_budget",
        "test_budget_outcomes",
        "test_fuzz_core",
        "test_tree_mask",
        "test_tree_attention",
        "test_cpu_tree_attention",
        "test_kv_moves",
        "test_vocab_topk",
        "test_kernel_warmup",
        "test_runner",
        "test_plugin_layout",
    },
    "engine": {
        "test_plugin",
        "test_patch_index",
        "test_engine_lossless",
        "test_engine_requests",
        "test_sampling_lossless",
        "test_eagle3_heads",
        "test_target_families",
        "test_lookup_engine",
        "test_reliability",
        "test_serve",
        "test_edges",
        "test_catch_up",
    },
    "tools": {
        "test_bench_rounds",
        "test_replies",
        "test_results_doc",
        "test_scripts",
        "test_train_head",
        "test_tiny_models",
        "test_quickstart",
    },
    "gpu": {"test_gpu"},
}


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped, and reported so, without one)")
    config.addinivalue_line("markers", "core: the engine-free core: tree, verification, budget, kernels")
    config.addinivalue_line("markers", "engine: the plugin inside vLLM engines (lossless, requests, serving)")
    config.addinivalue_line("markers", "tools: benchmark, training, results docs and scripts")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        layers = [layer for layer, modules in LAYERS.items() if module in modules]
        if len(layers) != 1:
            raise pytest.UsageError(f"tests/conftest.py: put {module} in exactly one of LAYERS")
        item.add_marker(layers[0])
