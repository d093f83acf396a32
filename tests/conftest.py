"""Shared test set-up: vLLM on this CPU (DESIGN.md section 4) and an engine runner."""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# vLLM on a CPU-only machine; set before vllm is imported anywhere.
_VENV_LIB = Path(__file__).resolve().parents[1] / ".venv" / "lib" / "libiomp5.so"
_SCRATCH = Path(tempfile.gettempdir()) / "vllm_eagle2_scratch"
_SCRATCH.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(_SCRATCH / "vllm_cache"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_SCRATCH / "inductor"))
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU tensors only this way
if _VENV_LIB.exists() and "libiomp5" not in os.environ.get("LD_PRELOAD", ""):
    # Reaches the engine's child processes (this interpreter is already loaded).
    os.environ["LD_PRELOAD"] = ":".join(p for p in (os.environ.get("LD_PRELOAD"), str(_VENV_LIB)) if p)


def run_llm(
    target: Path,
    spec: dict[str, Any] | None,
    prompts: Sequence[Any],
    params: Any,
    **engine_kwargs: Any,
) -> tuple[list[Any], dict[str, Any]]:
    """Generate with a fresh engine (float32, eager), shut it down; returns outputs and metrics.

    metrics maps counter names to values and vector names to lists.
    """
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=str(target),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=8,
        seed=0,
        disable_log_stats=False,
    )
    kwargs.update(engine_kwargs)
    llm = LLM(speculative_config=spec, **kwargs)
    try:
        outputs = llm.generate(list(prompts), params, use_tqdm=False)
        metrics: dict[str, Any] = {}
        for m in llm.get_metrics():
            metrics[m.name] = m.value if hasattr(m, "value") else list(getattr(m, "values", []))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return outputs, metrics


def acceptance_length(metrics: dict[str, Any]) -> float:
    """Mean tokens emitted per target pass (accepted drafts + 1) from vLLM's counters."""
    drafts = metrics["vllm:spec_decode_num_drafts"]
    assert drafts > 0, "no speculative steps ran"
    return 1.0 + metrics["vllm:spec_decode_num_accepted_tokens"] / drafts
