"""Every change eagle2 makes to vLLM internals, one module per concern, pinned to vLLM versions.

Applied once per process by the ``vllm.general_plugins`` entry point (the API server, the engine
core and every worker load it), all or nothing. On a vLLM outside :data:`SUPPORTED_VLLM` nothing
is patched: the plugin logs why, and an eagle2 config fails with that message.

Index (vLLM 0.32). Why / How / Upstream / Remove when:

* :mod:`.speculative_config` -- ``SpeculativeConfig`` and ``EngineArgs.create_speculative_config``.
  Why: ``method`` is a closed Literal; eagle2's keys (depth, topk, tree, budget) are not vLLM's.
  How: "eagle2" joins the Literal; the keys are popped and validated, the head checked, and
  vLLM builds the draft config as its "eagle"/"eagle3" would. Upstream: no plug-in point for
  speculative methods. Remove when: vLLM registers out-of-tree proposers.
* :mod:`.vllm_config` -- ``VllmConfig``. Why: Model Runner V2 does not take out-of-tree
  drafters; the draft tree writes KV past each request; a full CUDA graph would replay causal
  attention for tree rows. How: eagle2 listed as unsupported by V2; ``num_lookahead_tokens``
  covers the tree's slots; full graphs become piecewise. Remove when: V2 takes proposers, and
  vLLM has tree attention (it removed its own in May 2026).
* :mod:`.model_runner` -- ``GPUModelRunner`` (the CPU runner subclasses it). Why: the step
  (draft, verify, move K/V) has no hooks. How: the drafter is an ``Eagle2Proposer``; tree
  masks are published for the target forward; trees are verified instead of the rejection
  sampler; a step without drafts samples as plain decoding; drafts return with the output;
  ``_input_fits_in_drafter`` leaves the per-request context limit to the drafter (vLLM's stops
  the whole batch and zero-fills its drafts); ``_dummy_sampler_run`` also runs the tree verifier
  at its widest, for the memory profile. Upstream: none. Remove when: vLLM has a
  tree-verification interface.
* :mod:`.scheduling` -- ``Scheduler.update_from_output``, ``EngineCore.post_step``. Why: vLLM
  fetches drafts in a third worker call per step. How: they ride on the step's output. Remove
  when: vLLM returns drafts with the output for synchronous scheduling.
* :mod:`.workers` -- ``Worker``/``CPUWorker``. Why: the adaptive budget needs timings after
  warm-up; Triton variants must compile before vLLM's JIT monitor starts. How: wrapped
  ``compile_or_warm_up_model`` and ``_maybe_activate_jit_monitor``; two RPCs for stats.
  Remove when: vLLM gives proposers a warm-up hook.
* :mod:`.cpu_build` -- vLLM's CPU build only. Why: the bf16 "amx" KV layout is not one the tree
  kernel reads; a seeded request with a chunked prefill crashed (``set_offset`` on a CPU
  generator); the CPU ``expand_kernel`` wrote into a copy (vLLM's own speculative methods
  sampled wrongly, opt-in fix ``VLLM_EAGLE2_FIX_VLLM_CPU=1``); vLLM's compile cache never loaded
  (``_try_load_aot_compiled_fn`` calls ``finalize_loading`` on torch's bundled Inductor callable,
  which lacks it; every engine compiled again, a minute each on SmolLM2): that callable gets a
  no-op one, in every CPU engine. Remove when: the CPU build reads "vec" for speculative engines,
  restores CPU generators, writes into ``output``, and checks for ``finalize_loading``.
"""

from __future__ import annotations

import logging

from .cpu_build import FIX_VLLM_CPU_ENV, VEC_LAYOUT_ENV
from .cpu_build import patch_cpu_attention as _patch_cpu_attention
from .cpu_build import patch_cpu_compile_cache as _patch_cpu_compile_cache
from .cpu_build import patch_cpu_sampling_expansion as _patch_cpu_sampling_expansion
from .model_runner import DRAFTS_ATTR
from .model_runner import patch_model_runner as _patch_runner
from .record import roll_back as _roll_back
from .record import state as _state
from .record import undo as _undo
from .scheduling import patch_scheduling as _patch_engine_core
from .speculative_config import guard_unsupported_version, patch_engine_args, patch_speculative_config
from .vllm_config import patch_vllm_config
from .workers import patch_workers as _patch_workers

__all__ = ["DRAFTS_ATTR", "FIX_VLLM_CPU_ENV", "SUPPORTED_VLLM", "VEC_LAYOUT_ENV", "apply"]

logger = logging.getLogger("vllm.eagle2")

#: vLLM releases these patches were written against (CPU and CUDA builds).
SUPPORTED_VLLM = ("0.32.",)


def unsupported_reason(version: str) -> str | None:
    if version.startswith(SUPPORTED_VLLM):
        return None
    return (
        f"vllm-eagle2 supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)} only; this is vLLM "
        f"{version}. The eagle2 method is not registered."
    )


def _patch_config() -> None:
    patch_speculative_config()
    patch_engine_args()
    patch_vllm_config()


def apply() -> bool:
    """Patch vLLM once; returns False (and logs why) on an unsupported vLLM. Never raises.

    All or nothing: should any patch fail, the ones before it are undone, and an eagle2 config
    then fails with the reason."""
    if _state["applied"]:
        return True
    if _state["error"] is not None:  # already refused in this process: say it once
        return False
    try:
        import vllm
    except ImportError:
        _state["error"] = "vllm-eagle2 needs vLLM installed (pip install 'vllm-eagle2[cpu]' or '[cuda]')"
        logger.error(_state["error"])
        return False
    reason = unsupported_reason(vllm.__version__)
    if reason is not None:
        _state["error"] = reason
        logger.error(reason)
        guard_unsupported_version(reason)
        return False
    try:
        # Looked up here at call time, in this order (a test replaces one to make it fail).
        for patch in (
            _patch_config,
            _patch_runner,
            _patch_workers,
            _patch_engine_core,
            _patch_cpu_attention,
            _patch_cpu_compile_cache,
            _patch_cpu_sampling_expansion,
        ):
            patch()
    except Exception as exc:  # noqa: BLE001 - all or nothing: vLLM is left as it was
        _roll_back()
        _state["error"] = f"vllm-eagle2 could not patch vLLM {vllm.__version__} ({exc!r}); nothing changed"
        logger.exception(_state["error"])
        guard_unsupported_version(_state["error"])
        return False
    _undo.clear()
    _state["applied"] = True
    return True
