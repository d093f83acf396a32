"""Offline engine set-up shared by the scripts (benchmark, quickstart, profile, soak).

One place for what every script did by hand before starting vLLM's offline ``LLM``:

* :func:`prepare_env` -- the process environment, before vLLM is imported: vLLM's CPU variables
  (:func:`vllm_eagle2_tools.cpu_env.configure_cpu_env`: KV-cache size, OpenMP binding, caches in the
  scratch folder, ``LD_PRELOAD`` of the venv's Intel OpenMP for the engine's child processes),
  quiet logs, and opt-in ``VLLM_EAGLE2_FIX_VLLM_CPU=1`` (:data:`vllm_eagle2.patches.FIX_VLLM_CPU_ENV`:
  the plugin's fixes of vLLM's CPU build in engines *without* eagle2 too, e.g. vLLM's own ``eagle``).
* :func:`build_llm` -- ``LLM(...)`` with the arguments every script passes (vLLM's default compiled
  mode unless told ``eager``, stats on,
  so that ``llm.get_metrics()`` has the spec-decode counters), plus environment variables that only
  this engine's processes see (they inherit the environment as it is when they start).
* :func:`warm_up`, :func:`spec_counters`, :func:`shutdown_llm` -- the first short generation (not
  timed), vLLM's spec-decode counters, and the engine's shutdown.

Typical use::

    from vllm_eagle2_tools.engine import build_llm, prepare_env, shutdown_llm, spec_counters, warm_up

    prepare_env(quiet=True)  # before vLLM is imported
    llm = build_llm(model, {"method": "eagle2", "model": head}, dtype="float32", max_num_seqs=4)
    try:
        warm_up(llm, prompts)
        drafts0, accepted0, _ = spec_counters(llm)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()

Nothing here imports vLLM at module level: a script's ``--help`` stays fast.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vllm_eagle2.patches import FIX_VLLM_CPU_ENV
from vllm_eagle2_tools.cpu_env import configure_cpu_env

#: vLLM's counters of speculative decoding (present when the engine has ``disable_log_stats=False``).
DRAFTS_METRIC = "vllm:spec_decode_num_drafts"
ACCEPTED_METRIC = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"


def prepare_env(*, quiet: bool = False, fix_vllm_cpu: bool = False) -> None:
    """Set the environment for vLLM's offline engines; call it before vLLM is imported.

    ``quiet``: vLLM logs warnings only (default: its INFO logs too). ``fix_vllm_cpu``: set
    ``VLLM_EAGLE2_FIX_VLLM_CPU=1`` unless the caller set it, so that engines without eagle2 (no
    speculation, vLLM's ``eagle``) get the plugin's fixes of vLLM's CPU build as well (the benchmark
    does, to compare vLLM's ``eagle`` at temperature > 0). Variables already set are kept.
    """
    configure_cpu_env(quiet=quiet)
    if fix_vllm_cpu:
        os.environ.setdefault(FIX_VLLM_CPU_ENV, "1")


@contextmanager
def scoped_env(env: Mapping[str, str] | None) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the ``with`` block, then restore each variable as it was."""
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def build_llm(
    model: str | Path,
    speculative_config: dict[str, Any] | None = None,
    *,
    dtype: str,
    seed: int = 0,
    max_model_len: int = 2048,
    max_num_seqs: int = 1,
    env: Mapping[str, str] | None = None,
    eager: bool = False,
    **engine_kwargs: Any,
) -> Any:
    """Start vLLM's offline engine ``LLM`` on ``model`` (a folder), as every script here does.

    ``speculative_config``: None (no speculation), ``{"method": "eagle2", "model": HEAD, ...}``, or
    any vLLM method such as ``{"method": "eagle", ...}``. ``dtype``: ``float32``, ``bfloat16`` or
    ``float16``. ``max_num_seqs`` is the batch size. vLLM's default mode, as users run it (the model
    compiled by torch.compile; CUDA graphs on GPUs), unless ``eager`` (``enforce_eager=True``: starts
    sooner, runs slower); always ``disable_log_stats=False`` (the spec-decode counters read by
    :func:`spec_counters`). ``engine_kwargs`` go to ``LLM`` as well. ``env``: environment variables
    set only while the engine starts, so that only its processes see them (e.g.
    ``{"VLLM_EAGLE2_STEP_COSTS": ...}`` for one engine of a benchmark).
    Call :func:`prepare_env` first, once per process. Shut the engine down with :func:`shutdown_llm`.
    """
    from vllm import LLM

    kwargs: dict[str, Any] = {"enforce_eager": eager, "disable_log_stats": False, **engine_kwargs}
    with scoped_env(env):
        return LLM(
            model=str(model),
            speculative_config=speculative_config,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            **kwargs,
        )


def warm_up(llm: Any, prompts: Sequence[Any], max_tokens: int = 8) -> None:
    """A short greedy generation of the first prompt, before anything is timed."""
    from vllm import SamplingParams

    llm.generate(list(prompts[:1]), SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)


def spec_counters(llm: Any) -> tuple[float, float, list[float]]:
    """(drafts, accepted tokens, accepted tokens per draft position) so far, from ``llm.get_metrics()``.

    Zeros (and an empty list) without speculation. Counters grow over the engine's life: take the
    difference between two reads around the generation measured.
    """
    drafts = accepted = 0.0
    per_pos: list[float] = []
    for m in llm.get_metrics():
        if m.name == DRAFTS_METRIC:
            drafts = float(m.value)
        elif m.name == ACCEPTED_METRIC:
            accepted = float(m.value)
        elif m.name == ACCEPTED_PER_POS_METRIC:
            per_pos = [float(v) for v in getattr(m, "values", [])]
    return drafts, accepted, per_pos


def own_metrics() -> list[Any]:
    """vLLM's Prometheus collectors now registered: those of the engine started last.

    Each engine's start unregisters every ``vllm:`` collector of the process, so with several engines
    up at once ``llm.get_metrics()`` reads only the last one's counters (the others read as no
    speculation). Keep each engine's list right after its start and :func:`use_metrics` it before
    reading that engine's counters.
    """
    from prometheus_client import REGISTRY

    return [c for c in list(REGISTRY._collector_to_names) if getattr(c, "_name", "").startswith("vllm:")]


def use_metrics(collectors: list[Any]) -> None:
    """Make ``collectors`` (from :func:`own_metrics`) the process's ``vllm:`` metrics."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    for collector in collectors:
        REGISTRY.register(collector)


def shutdown_llm(llm: Any) -> None:
    """Stop the engine's core (its processes); then drop the last reference and ``gc.collect()``."""
    llm.llm_engine.engine_core.shutdown()
