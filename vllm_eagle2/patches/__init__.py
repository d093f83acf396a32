"""Every change eagle2 makes to vLLM internals, one module per concern, pinned to vLLM versions.

Applied once per process by the ``vllm.general_plugins`` entry point (the API server, the engine
core and every worker load it), all or nothing. On a vLLM outside :data:`SUPPORTED_VLLM` nothing
is patched: the plugin logs why, and an eagle2 config fails with that message.

Index (vLLM 0.32). Per module: what it patches (fully qualified; ``tests/test_patch_index.py``
checks this list against what apply() records), then Why / How / Upstream / Remove when. "vllm#N" is
github.com/vllm-project/vllm issue or pull request N.

* :mod:`.speculative_config`. Patched:
  ``vllm.config.speculative.SpeculativeConfig.method``: the type, in ``__annotations__['method']`` and
  ``__dataclass_fields__['method'].type`` (the pydantic dataclass is rebuilt);
  ``vllm.config.speculative.SpeculativeConfig.__post_init__``,
  ``vllm.config.speculative.SpeculativeConfig.use_eagle``,
  ``vllm.engine.arg_utils.EngineArgs.create_speculative_config`` (on an unsupported vLLM too, unrecorded:
  it refuses eagle2); ``Eagle2LlamaForCausalLM`` joins ``vllm.ModelRegistry`` (public API).
  Why: ``method`` is a closed Literal; eagle2's keys (depth, topk, tree, budget) are not vLLM's.
  How: "eagle2" joins the Literal; the keys are popped and validated, the head checked, and vLLM builds
  the draft config as its "eagle"/"eagle3" would.
  Upstream: vllm#36219 (RFC, open: one proposer interface). vllm#39487 (merged) gave 0.32
  ``method: "custom_class"``: ``model`` names the class (no head path), eagle2's keys are still unknown
  fields, and the runner's EAGLE paths stay off.
  Remove when: vLLM registers out-of-tree speculative methods with their own config keys.
* :mod:`.vllm_config`. Patched:
  ``vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features``,
  ``vllm.config.vllm.VllmConfig.num_lookahead_tokens``, ``vllm.config.vllm.VllmConfig.__post_init__``.
  Why: Model Runner V2 does not take out-of-tree drafters; the draft tree writes KV past each request; a
  full CUDA graph would replay causal attention for tree rows.
  How: eagle2 listed as unsupported by V2; ``num_lookahead_tokens`` covers the tree's slots; full graphs
  become piecewise.
  Upstream: none filed for out-of-tree proposers in V2; tree attention: vllm#18327 (open request),
  vllm#42121 (merged May 2026) removed vLLM's own.
  Remove when: V2 takes out-of-tree proposers, and vLLM's attention takes tree masks.
* :mod:`.model_runner` (the CPU runner subclasses ``GPUModelRunner``). Patched:
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__``,
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._update_states``,
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model``,
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs`` (reads its result's [1]),
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids``,
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._input_fits_in_drafter``,
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample``,
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync``,
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens``,
  ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._dummy_sampler_run``; on instances: the runner's
  ``drafter``, ``use_aux_hidden_state_outputs`` and ``_eagle2_step``, and
  ``vllm.v1.outputs.ModelRunnerOutput.eagle2_draft_token_ids``.
  Why: the step (draft, verify, move K/V) has no hooks.
  How: the drafter is an ``Eagle2Proposer``; tree masks are published for the target forward; trees are
  verified instead of the rejection sampler; a step without drafts samples as plain decoding; drafts
  return with the output; ``_input_fits_in_drafter`` leaves the per-request context limit to the drafter
  (vLLM's stops the whole batch and zero-fills its drafts); ``_dummy_sampler_run`` also runs the tree
  verifier at its widest, for the memory profile.
  Upstream: vllm#36219 (RFC, open: proposer interface); tree verification: vllm#37396 (open request),
  vllm#22752 (tree sampler, closed unmerged).
  Remove when: vLLM has a tree-verification interface and per-request draft limits.
* :mod:`vllm_eagle2.engine.attention`: :func:`~vllm_eagle2.engine.attention.wrap_attention_layers`,
  from ``Eagle2Proposer.load_model``, on instances (neither recorded nor rolled back). Patched:
  ``vllm.model_executor.layers.attention.attention.Attention.impl.forward`` and the marker
  ``vllm.model_executor.layers.attention.attention.Attention.impl._eagle2_wrapped``, for every attention
  layer of ``static_forward_context`` (target and head; ``FlashAttentionImpl``, ``TritonAttentionImpl``,
  ``CPUAttentionBackendImpl``).
  Why: vLLM's attention kernels know causal masks only, and vLLM copies its attention metadata before
  the kernels see it (no field for a tree mask survives).
  How: on CPU the stock kernel runs over each request's rows before its tree rows (its metadata
  rebuilt once per forward with ``vllm._custom_ops.cpu_attn_get_scheduler_metadata``, the tree rows
  as pseudo-requests of no tokens), and eagle2's kernel computes the tree rows from the cache in the
  layout vLLM chose (``layer.isa``), in place; on CUDA the stock kernel computes every row and the
  tree rows are recomputed by eagle2's kernel and written over its result.
  Upstream: vllm#18327 (open request for tree attention); vllm#42121 (merged) removed vLLM's TREE_ATTN.
  Remove when: vLLM's attention backends take per-request tree masks for speculative decoding.
* :mod:`.scheduling`. Patched: ``vllm.v1.core.sched.scheduler.Scheduler.update_from_output``,
  ``vllm.v1.engine.core.EngineCore.post_step``.
  Why: vLLM fetches drafts in a third worker call per step.
  How: they ride on the step's output.
  Upstream: none filed.
  Remove when: vLLM returns drafts with the output for synchronous scheduling.
* :mod:`.workers`. Patched: ``vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model``,
  ``vllm.v1.worker.gpu_worker.Worker._maybe_activate_jit_monitor``, the RPCs
  ``vllm.v1.worker.gpu_worker.Worker.eagle2_budget_summary``,
  ``vllm.v1.worker.gpu_worker.Worker.eagle2_stats``;
  on CPU also ``vllm.v1.worker.cpu_worker.CPUWorker.compile_or_warm_up_model``,
  ``vllm.v1.worker.cpu_worker.CPUWorker.eagle2_budget_summary``,
  ``vllm.v1.worker.cpu_worker.CPUWorker.eagle2_stats``.
  Why: the adaptive budget needs timings after warm-up; Triton variants must compile before vLLM's JIT
  monitor starts.
  How: wrapped warm-up and JIT-monitor start; two RPCs for stats.
  Upstream: vllm#41481 (open: warm speculative-decoding kernels at start-up).
  Remove when: vLLM gives proposers a warm-up hook.
* :mod:`.cpu_build` -- vLLM's CPU build only. Patched:
  ``torch._dynamo.aot_compile_types.BundledAOTAutogradSerializableCallable.finalize_loading`` (torch's),
  with ``VLLM_EAGLE2_FIX_VLLM_CPU=1`` ``vllm.utils.cpu_triton_utils._expand_kernel_impl``; and the
  runner's ``_sample`` / ``_bookkeeping_sync`` hooks above.
  Why: a seeded request with a chunked prefill
  crashed (``set_offset`` on a CPU generator); the CPU ``expand_kernel`` wrote into a copy (vLLM's own
  speculative methods sampled wrongly); vLLM's compile cache never loaded (``_try_load_aot_compiled_fn``
  calls ``finalize_loading`` on torch's bundled Inductor callable, which lacks it; every engine compiled
  again, a minute each on SmolLM2).
  How: discarded CPU generators kept untouched; the kernel in torch, written
  into ``output`` (opt-in); a no-op ``finalize_loading``, in every CPU engine.
  Upstream: none filed for the generators (the CUDA-only rewind dates from vllm#10097) or the compile
  cache; expand_kernel: vllm#42638 (closed unmerged).
  Remove when: the CPU build restores CPU generators, writes into ``output``, and checks for
  ``finalize_loading``.

Private vLLM methods relied on, besides the private ones patched above (whose signatures matter too);
``EagleProposer``'s are defined in ``vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer``:

* ``vllm.v1.spec_decode.eagle.EagleProposer._get_positions``,
  ``vllm.v1.spec_decode.eagle.EagleProposer._determine_batch_execution_and_padding``,
  ``vllm.v1.spec_decode.eagle.EagleProposer._get_slot_mapping``: engine/head_passes.py,
  ``HeadPasses._run_head``, and engine/proposer.py, ``propose`` (head passes run as vLLM's draft
  loop runs them).
* ``vllm.v1.spec_decode.eagle.EagleProposer._get_eagle3_use_aux_hidden_state_from_config``:
  engine/proposer.py, ``Eagle2Proposer.__init__`` (EAGLE-3 heads).
* ``vllm.v1.spec_decode.eagle.EagleProposer._draft_attn_layer_names`` (an attribute): engine/proposer.py,
  ``Eagle2Proposer.load_model`` (which attention layers are the target's).
* ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._dummy_run``: engine/startup.py, ``calibrate_budget``
  (times the target alone).

  Why: ``Eagle2Proposer`` subclasses ``EagleProposer`` and reuses its inputs, padding and CUDA-graph
  dispatch. Upstream: vllm#36219 (RFC, open: proposer interface); none filed for ``_dummy_run``.
  Remove when: these are public (or the proposer interface offers them); ``tests/test_patch_index.py``
  fails on any private name read that is not listed here.
"""

from __future__ import annotations

import logging

from .cpu_build import FIX_VLLM_CPU_ENV
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

__all__ = ["DRAFTS_ATTR", "FIX_VLLM_CPU_ENV", "SUPPORTED_VLLM", "apply"]

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
