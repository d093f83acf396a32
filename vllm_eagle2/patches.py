"""Every change eagle2 makes to vLLM internals, in one place, pinned to vLLM versions.

Applied once per process by the ``vllm.general_plugins`` entry point (the API server,
the engine core and every worker load it). On a vLLM outside :data:`SUPPORTED_VLLM`
nothing is patched: the plugin logs why, and an eagle2 config fails with that message.

What is patched (vLLM 0.32, file:function):
* ``config/speculative.py`` SpeculativeConfig: ``method`` accepts "eagle2"; its
  ``__post_init__`` builds the head's draft config exactly as for "eagle" (EAGLE-1/2 heads) or
  "eagle3" (EAGLE-3 heads, :mod:`vllm_eagle2.head_files`); ``use_eagle`` is true for eagle2,
  which turns on draft KV layers and EAGLE's runner paths.
* ``engine/arg_utils.py`` EngineArgs.create_speculative_config: pops and validates the
  eagle2 keys (depth, topk, tree) and checks the head before any weights load.
* ``config/vllm.py`` VllmConfig: eagle2 runs on the V1 model runner (listed as unsupported
  by Model Runner V2), reserves KV slots for the draft tree past each request, and uses no
  full CUDA graphs (they would replay causal attention for tree rows).
* ``v1/worker/gpu_model_runner.py`` GPUModelRunner (the CPU runner subclasses it): the
  drafter becomes :class:`~vllm_eagle2.proposer.Eagle2Proposer` (with an EAGLE-3 head, the target
  also outputs its auxiliary hidden states, as for vLLM's "eagle3"); ``execute_model`` runs inside
  one ``attention.tree_batch()`` scope, so the verification's tree masks (published after
  ``_prepare_inputs``) live exactly as long as the target forward; tree verification instead
  of the rejection sampler; the adaptive budget's step timer starts in ``_prepare_inputs``. A
  step in which no request has drafts to verify prepares its inputs as plain decoding (vLLM's
  plain sampler; vLLM 0.32 otherwise runs its spec-decode metadata and rejection sampler in
  every step); ``propose_draft_token_ids`` lets the budget plan the step before vLLM prepares
  the drafter's inputs (``Eagle2Proposer.begin_step``).
  Also, for eagle2 engines (and for every engine with ``VLLM_EAGLE2_FIX_VLLM_CPU=1``): a seeded
  request whose prefill chunk is discarded keeps its CPU generator untouched (vLLM rewinds it
  with ``set_offset``, which only CUDA generators have: a seeded request with a chunked prefill
  crashed vLLM's CPU build). It can go once vLLM's CPU build restores CPU generators itself.
* ``v1/engine/core.py`` EngineCore.post_step and ``v1/core/sched/scheduler.py``
  Scheduler.update_from_output, with the runner's ``sample_tokens``: in an eagle2 engine that
  schedules synchronously (vLLM 0.32 runs every non-vLLM speculative method so), the drafts come
  back with the step's sampled tokens instead of in a third call to the worker per step
  (``take_draft_token_ids``); the scheduler takes them at the end of ``update_from_output``,
  where vLLM's ``post_step`` would have, before the next step is scheduled.
* ``v1/worker/gpu_worker.py`` Worker and, on CPU only, ``v1/worker/cpu_worker.py`` CPUWorker
  ``compile_or_warm_up_model`` (importing the CPU worker swaps torch.cuda's classes for
  stand-ins process-wide): with eagle2's adaptive budget, after the warm-up, the
  drafter times the target and one draft level (the budget's start-up calibration); and a
  method ``eagle2_budget_summary`` for ``LLM.collective_rpc``, the budget's counters. On the GPU
  worker also ``_maybe_activate_jit_monitor``, its last warm-up act: every Triton variant of
  eagle2's kernels compiles just before vLLM starts watching for compiles mid-serving.
* ``v1/attention/backends/cpu_attn.py`` (CPU only): with eagle2 (or with ``VLLM_EAGLE2_CPU_VEC_LAYOUT=1``)
  the bf16 "amx" KV layout is replaced by the "vec" layout, which the tree attention reads.
* ``utils/cpu_triton_utils.py`` _expand_kernel_impl (the CPU build's ``expand_kernel`` of
  ``v1/sample/rejection_sampler.py``), only with ``VLLM_EAGLE2_FIX_VLLM_CPU=1`` (eagle2 verifies
  with its own sampler and never calls it): it wrote into an int64 copy of the output, so the
  per-token temperature (and top-k, top-p) of vLLM's own rejection sampler was uninitialised
  memory, and vLLM's built-in speculative methods sampled from a wrong distribution at
  temperature > 0. It can go once vLLM's CPU build writes into ``output``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import typing
from typing import Any

from vllm_eagle2.config import (
    EXTRA_KEYS,
    UNQUANTIZED_KV_DTYPES,
    Eagle2ConfigError,
    parse_settings,
    resolve_draft_vocab,
)
from vllm_eagle2.head_files import EAGLE3, TargetShape, check_head, draft_method

logger = logging.getLogger("vllm_eagle2")

#: vLLM releases this module was written against (CPU and CUDA builds).
SUPPORTED_VLLM = ("0.32.",)
#: Set to 1 to fix two bugs of vLLM's CPU build in engines that do not use eagle2 as well.
FIX_VLLM_CPU_ENV = "VLLM_EAGLE2_FIX_VLLM_CPU"
#: Set to 1 to give engines without eagle2 eagle2's bf16 KV layout ("vec" for "amx") too, so
#: that the layout's share of eagle2's cost can be measured (the benchmark's ``nospec_vec``).
VEC_LAYOUT_ENV = "VLLM_EAGLE2_CPU_VEC_LAYOUT"
#: The attribute of a ModelRunnerOutput that carries an eagle2 step's drafts to the scheduler.
DRAFTS_ATTR = "eagle2_draft_token_ids"
_state: dict[str, Any] = {"applied": False, "error": None}


def unsupported_reason(version: str) -> str | None:
    if version.startswith(SUPPORTED_VLLM):
        return None
    return (
        f"vllm-eagle2 supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)} only; this is vLLM "
        f"{version}. The eagle2 method is not registered."
    )


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
        _guard_unsupported_version(reason)
        return False
    try:
        _patch_config()
        _patch_runner()
        _patch_workers()
        _patch_engine_core()
        _patch_cpu_attention()
        _patch_cpu_sampling_expansion()
    except Exception as exc:  # noqa: BLE001 - all or nothing: vLLM is left as it was
        _roll_back()
        _state["error"] = f"vllm-eagle2 could not patch vLLM {vllm.__version__} ({exc!r}); nothing changed"
        logger.exception(_state["error"])
        _guard_unsupported_version(_state["error"])
        return False
    _undo.clear()
    _state["applied"] = True
    return True


#: What :func:`apply` changed so far, as callables that put it back (run in reverse order).
_undo: list[Any] = []
_MISSING = object()


def _set(owner: Any, name: str, value: Any) -> None:
    """``setattr(owner, name, value)``, undone by :func:`_roll_back`."""
    old = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name)
    _undo.append(lambda: delattr(owner, name) if old is _MISSING else setattr(owner, name, old))
    setattr(owner, name, value)


def _set_item(mapping: dict, key: Any, value: Any) -> None:
    """``mapping[key] = value``, undone by :func:`_roll_back`."""
    old = mapping.get(key, _MISSING)
    _undo.append(lambda: mapping.pop(key) if old is _MISSING else mapping.__setitem__(key, old))
    mapping[key] = value


def _roll_back() -> None:
    while _undo:
        _undo.pop()()


def _guard_unsupported_version(reason: str) -> None:
    """On an unsupported vLLM, an eagle2 config fails with the version message."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # noqa: BLE001 - an unknown vLLM layout: nothing to guard
        return
    original = EngineArgs.create_speculative_config

    def create_speculative_config(self, *args, **kwargs):
        spec = self.speculative_config
        if isinstance(spec, dict) and spec.get("method") == "eagle2":
            raise Eagle2ConfigError(reason)
        return original(self, *args, **kwargs)

    EngineArgs.create_speculative_config = create_speculative_config


# -- configuration -------------------------------------------------------------------------


def _literal_values(tp: Any) -> list[Any]:
    values = []
    for arg in typing.get_args(tp):
        if typing.get_origin(arg) is typing.Literal:
            values.extend(_literal_values(arg))
        else:
            values.append(arg)
    return values


def _patch_config() -> None:
    from pydantic.dataclasses import rebuild_dataclass
    from vllm import ModelRegistry
    from vllm.config import SpeculativeConfig, VllmConfig
    from vllm.config import speculative as speculative_module
    from vllm.engine.arg_utils import EngineArgs

    ModelRegistry.register_model("Eagle2LlamaForCausalLM", "vllm_eagle2.head:Eagle2LlamaForCausalLM")
    methods = _literal_values(speculative_module.SpeculativeMethod)
    if "eagle2" not in methods:
        method_type = typing.Literal[tuple(methods) + ("eagle2",)] | None
        _set_item(SpeculativeConfig.__annotations__, "method", method_type)
        _set(SpeculativeConfig.__dataclass_fields__["method"], "type", method_type)
        rebuild_dataclass(SpeculativeConfig, force=True)
        _undo.append(lambda: rebuild_dataclass(SpeculativeConfig, force=True))  # runs after the two above

    post_init = SpeculativeConfig.__post_init__

    def __post_init__(self) -> None:
        if self.method != "eagle2":
            return post_init(self)
        # Build the head's draft config exactly as vLLM's method for its format does, then say what it is.
        self.method = draft_method(self.model)
        try:
            post_init(self)
        finally:
            self.method = "eagle2"

    _set(SpeculativeConfig, "__post_init__", __post_init__)
    use_eagle = SpeculativeConfig.use_eagle
    _set(SpeculativeConfig, "use_eagle", lambda self: self.method == "eagle2" or use_eagle(self))

    create = EngineArgs.create_speculative_config

    def create_speculative_config(self, target_model_config, *args, **kwargs):
        spec = self.speculative_config
        if not (isinstance(spec, dict) and spec.get("method") == "eagle2"):
            return create(self, target_model_config, *args, **kwargs)
        settings = parse_settings(spec)
        kv_dtype = str(getattr(self, "kv_cache_dtype", "auto"))
        if kv_dtype not in UNQUANTIZED_KV_DTYPES:
            raise Eagle2ConfigError(
                f"eagle2 needs an unquantized KV cache: kv_cache_dtype must be one of "
                f"{', '.join(UNQUANTIZED_KV_DTYPES)}; got {kv_dtype!r} (its tree attention reads the cache "
                "as is)"
            )
        if getattr(self, "data_parallel_size", 1) > 1 and target_model_config.is_moe:
            # vLLM synchronises every forward of a data-parallel MoE engine across its ranks; each
            # rank's budget picks its own tree depth, so ranks would wait on each other for good.
            raise Eagle2ConfigError(
                f"eagle2 does not support data_parallel_size > 1 with a mixture-of-experts target "
                f"(data_parallel_size={self.data_parallel_size}): every draft pass would have to run "
                "on every rank in step. Use tensor_parallel_size instead, or vLLM's own eagle."
            )
        target = TargetShape(
            hidden_size=target_model_config.get_hidden_size(),
            vocab_size=target_model_config.get_vocab_size(),
            num_layers=target_model_config.get_total_num_hidden_layers(),
        )
        head = check_head(spec.get("model"), target)
        settings = dataclasses.replace(settings, head_format=head.format)
        settings = resolve_draft_vocab(
            settings,
            spec.get("model"),
            eagle3_vocab=(head.draft_vocab_size or target.vocab_size) if head.format == EAGLE3 else 0,
            tensor_parallel_size=self.tensor_parallel_size,
            target_vocab_size=target.vocab_size,
        )
        vllm_spec = {key: value for key, value in spec.items() if key not in EXTRA_KEYS}
        vllm_spec["num_speculative_tokens"] = settings.nodes_per_step
        self.speculative_config = vllm_spec
        try:
            config = create(self, target_model_config, *args, **kwargs)
        finally:
            self.speculative_config = spec
        config.eagle2 = settings  # not a pydantic field: survives pickling to workers
        draft = config.draft_model_config
        if draft is not None and draft.hf_config.architectures == ["EagleLlamaForCausalLM"]:
            # Our head class: vLLM's, plus fc.bias of published EAGLE checkpoints.
            draft.hf_config.eagle_fc_bias = "fc.bias" in head.tensors
            draft.hf_config.architectures = ["Eagle2LlamaForCausalLM"]
            config.update_arch_()
        return config

    _set(EngineArgs, "create_speculative_config", create_speculative_config)

    unsupported = VllmConfig._get_v2_model_runner_unsupported_features

    def _get_v2_model_runner_unsupported_features(self):
        features = list(unsupported(self))
        spec = self.speculative_config
        if spec is not None and spec.method == "eagle2":
            features.append("speculative method 'eagle2'")
        return features

    VllmConfig._get_v2_model_runner_unsupported_features = _get_v2_model_runner_unsupported_features

    lookahead = VllmConfig.num_lookahead_tokens

    def num_lookahead_tokens(self) -> int:
        slots = lookahead.fget(self)
        spec = self.speculative_config
        if spec is not None and spec.method == "eagle2":
            slots = max(slots, spec.eagle2.draft_kv_slots)
        return slots

    _set(VllmConfig, "num_lookahead_tokens", property(num_lookahead_tokens))

    vllm_post_init = VllmConfig.__post_init__

    def vllm_config_post_init(self, *args, **kwargs):
        vllm_post_init(self, *args, **kwargs)
        spec = self.speculative_config
        if spec is None or spec.method != "eagle2":
            return
        from vllm.config.compilation import CUDAGraphMode

        compilation = self.compilation_config
        mode = compilation.cudagraph_mode
        if mode is not None and mode.has_full_cudagraphs():
            # A full CUDA graph would replay the stock (causal) attention for tree rows: the
            # tree side channel is Python. Piecewise graphs run attention eagerly.
            new = CUDAGraphMode.PIECEWISE if mode.has_piecewise_cudagraphs() else CUDAGraphMode.NONE
            logger.warning(
                "eagle2: cudagraph_mode %s -> %s (tree attention runs outside graphs)", mode.name, new.name
            )
            compilation.cudagraph_mode = new

    _set(VllmConfig, "__post_init__", vllm_config_post_init)


# -- model runner ---------------------------------------------------------------------------


def _patch_runner() -> None:
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_eagle2 import attention
    from vllm_eagle2 import runner as tree_runner
    from vllm_eagle2.proposer import Eagle2Proposer

    init = GPUModelRunner.__init__

    def __init__(self, vllm_config, device, *args, **kwargs):
        init(self, vllm_config, device, *args, **kwargs)
        spec = self.speculative_config
        self._eagle2_step = None
        self._eagle2_hidden_states = None
        if spec is not None and spec.method == "eagle2":
            _state["cpu_isa_vec"] = True
            self.drafter = Eagle2Proposer(self.vllm_config, self.device, self)
            # EAGLE-3 heads read the target's hidden states entering some of its layers.
            self.use_aux_hidden_state_outputs = self.drafter.eagle3_use_aux_hidden_state

    def _is_eagle2(runner) -> bool:
        return isinstance(getattr(runner, "drafter", None), Eagle2Proposer)

    update_states = GPUModelRunner._update_states

    def _update_states(self, scheduler_output, *args, **kwargs):
        if _is_eagle2(self) and scheduler_output.finished_req_ids:
            self.drafter.forget(scheduler_output.finished_req_ids)
        return update_states(self, scheduler_output, *args, **kwargs)

    execute_model = GPUModelRunner.execute_model

    def _execute_model(self, *args, **kwargs):
        if not _is_eagle2(self):
            return execute_model(self, *args, **kwargs)
        # The widest call that holds the verification's tree batch: _prepare_inputs publishes it
        # (prepare_tree_verification), the target's attention layers read it, and it is gone
        # when the forward returns. Sampling comes in vLLM's separate sample_tokens call; what
        # it needs (the kept K/V) rides on runner._eagle2_step, not on the side channel.
        with attention.tree_batch():
            return execute_model(self, *args, **kwargs)

    prepare_inputs = GPUModelRunner._prepare_inputs

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        if not _is_eagle2(self):
            return prepare_inputs(self, scheduler_output, *args, **kwargs)
        if self.drafter.budget is not None:
            total = scheduler_output.total_num_scheduled_tokens
            drafts = sum(len(d) for d in scheduler_output.scheduled_spec_decode_tokens.values())
            prompt = total - len(scheduler_output.num_scheduled_tokens) - drafts
            self.drafter.budget.step_started(total, prompt)
        if scheduler_output.scheduled_spec_decode_tokens:
            out = prepare_inputs(self, scheduler_output, *args, **kwargs)
        else:
            # No request has drafts to verify: plain decoding's inputs, so that the step samples
            # with vLLM's plain sampler. vLLM 0.32 sends every step of a speculative engine
            # through its spec-decode metadata and rejection sampler, zero drafts or not; its
            # _prepare_inputs tells the two apart by speculative_config alone.
            spec, self.speculative_config = self.speculative_config, None
            try:
                out = prepare_inputs(self, scheduler_output, *args, **kwargs)
            finally:
                self.speculative_config = spec
        tree_runner.prepare_tree_verification(self, out[1])
        return out

    propose_draft_token_ids = GPUModelRunner.propose_draft_token_ids

    def _propose_draft_token_ids(self, *args, **kwargs):
        if _is_eagle2(self):
            self.drafter.begin_step(self.input_batch.num_reqs)  # the target pass ends here
        return propose_draft_token_ids(self, *args, **kwargs)

    sample = GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata):
        fix = _is_eagle2(self) or _fix_every_engine()
        saved = [(gen, gen.get_state()) for gen in _discarded_cpu_generators(self)] if fix else []
        try:
            if spec_decode_metadata is not None and getattr(self, "_eagle2_step", None) is not None:
                return tree_runner.sample_with_trees(self, logits, spec_decode_metadata)
            return sample(self, logits, spec_decode_metadata)
        finally:
            # A discarded (partial-prefill) sample must not advance the request's generator.
            for gen, state in saved:
                gen.set_state(state)

    bookkeeping_sync = GPUModelRunner._bookkeeping_sync

    def _bookkeeping_sync(self, *args, **kwargs):
        # _sample already restored these generators; hide them from vLLM's CUDA-only rewind.
        generators = self.input_batch.generators
        fix = _is_eagle2(self) or _fix_every_engine()
        hidden = {i: generators.pop(i) for i in _discarded_cpu_generator_rows(self)} if fix else {}
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    sample_tokens = GPUModelRunner.sample_tokens

    def _sample_tokens(self, *args, **kwargs):
        state = getattr(self, "execute_model_state", None)
        # What the drafter's catch-up pass reads per token: the last hidden state, and an EAGLE-3
        # head's auxiliary ones. Tree verification reorders their rows like the accepted tokens.
        rows = [getattr(state, "hidden_states", None), *(getattr(state, "aux_hidden_states", None) or [])]
        self._eagle2_hidden_states = [h for h in rows if h is not None] if _is_eagle2(self) else None
        try:
            out = sample_tokens(self, *args, **kwargs)
        finally:
            self._eagle2_hidden_states = None
        if _is_eagle2(self) and not self.use_async_scheduling and isinstance(out, ModelRunnerOutput):
            out = copy.copy(out)  # never tag a shared instance (vLLM's EMPTY_MODEL_RUNNER_OUTPUT)
            setattr(out, DRAFTS_ATTR, self.take_draft_token_ids())
        return out

    _set(GPUModelRunner, "__init__", __init__)
    _set(GPUModelRunner, "_update_states", _update_states)
    _set(GPUModelRunner, "execute_model", _execute_model)
    _set(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    _set(GPUModelRunner, "propose_draft_token_ids", _propose_draft_token_ids)
    _set(GPUModelRunner, "_sample", _sample)
    _set(GPUModelRunner, "_bookkeeping_sync", _bookkeeping_sync)
    _set(GPUModelRunner, "sample_tokens", _sample_tokens)


def _patch_workers() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_eagle2.proposer import Eagle2Proposer

    classes = [Worker]
    if current_platform.is_cpu():
        # Only on CPU: importing vLLM's CPU worker replaces torch.cuda's Event and Stream,
        # torch.accelerator's synchronize and memory info, and pinning, for the whole process.
        from vllm.v1.worker.cpu_worker import CPUWorker

        classes.append(CPUWorker)
    for cls in classes:
        warm_up = cls.compile_or_warm_up_model

        def compile_or_warm_up_model(self, *args, _warm_up=warm_up, **kwargs):
            out = _warm_up(self, *args, **kwargs)
            drafter = getattr(self.model_runner, "drafter", None)
            if isinstance(drafter, Eagle2Proposer):
                drafter.calibrate_budget(self.model_runner)
            return out

        _set(cls, "compile_or_warm_up_model", compile_or_warm_up_model)
        _set(cls, "eagle2_budget_summary", _budget_summary)
        _set(cls, "eagle2_stats", _verify_stats)

    # The GPU worker's last warm-up act: eagle2's kernel variants compile just before it.
    activate_monitor = Worker._maybe_activate_jit_monitor

    def _maybe_activate_jit_monitor(self, *args, **kwargs):
        drafter = getattr(self.model_runner, "drafter", None)
        if isinstance(drafter, Eagle2Proposer):
            drafter.warm_up_kernels()
        return activate_monitor(self, *args, **kwargs)

    _set(Worker, "_maybe_activate_jit_monitor", _maybe_activate_jit_monitor)


def _patch_engine_core() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    update_from_output = Scheduler.update_from_output

    def _update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        out = update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs)
        drafts = getattr(model_runner_output, DRAFTS_ATTR, None)
        if drafts is not None:  # what post_step would have fetched from the worker next
            self.update_draft_token_ids(drafts)
        return out

    post_step = EngineCore.post_step

    def _post_step(self, model_executed: bool) -> None:
        spec = self.vllm_config.speculative_config
        if spec is not None and spec.method == "eagle2" and not self.async_scheduling:
            return  # the drafts came with the step's output (update_from_output took them)
        post_step(self, model_executed)

    _set(Scheduler, "update_from_output", _update_from_output)
    _set(EngineCore, "post_step", _post_step)


def _budget_summary(worker: Any) -> dict[str, Any] | None:
    """The adaptive budget's counters, for ``LLM.collective_rpc("eagle2_budget_summary")``.

    None when the engine does not run eagle2 with the adaptive budget.
    """
    budget = getattr(getattr(worker.model_runner, "drafter", None), "budget", None)
    return None if budget is None else budget.summary()


def _verify_stats(worker: Any) -> dict[str, int] | None:
    """What the tree verification exercised, for ``LLM.collective_rpc("eagle2_stats")``:
    :class:`vllm_eagle2.runner.VerifyCounters`. None when the engine does not run eagle2."""
    drafter = getattr(worker.model_runner, "drafter", None)
    counters = getattr(drafter, "counters", None)
    return None if counters is None else counters.summary()


def _fix_every_engine() -> bool:
    """Whether the opt-in asks for vLLM CPU-build fixes in engines without eagle2 too."""
    return os.environ.get(FIX_VLLM_CPU_ENV, "0") == "1"


def _discarded_cpu_generator_rows(runner: Any) -> list[int]:
    """Batch rows whose sample this step is discarded (partial prefill) and that own a CPU generator."""
    num_reqs = runner.input_batch.num_reqs
    generators = runner.input_batch.generators
    if not generators or num_reqs == 0:
        return []
    rows = runner.discard_request_mask.np[:num_reqs].nonzero()[0]
    return [int(i) for i in rows if int(i) in generators and generators[int(i)].device.type == "cpu"]


def _discarded_cpu_generators(runner: Any) -> list[Any]:
    generators = runner.input_batch.generators
    return [generators[i] for i in _discarded_cpu_generator_rows(runner)]


def _patch_cpu_attention() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends import cpu_attn

    get_isa = cpu_attn._get_attn_isa

    def _get_attn_isa(*args, **kwargs) -> str:
        isa = get_isa(*args, **kwargs)
        # The tree attention reads the cache directly; it knows the "vec" layouts.
        vec = _state.get("cpu_isa_vec") or os.environ.get(VEC_LAYOUT_ENV, "0") == "1"
        return "vec" if isa == "amx" and vec else isa

    _set(cpu_attn, "_get_attn_isa", _get_attn_isa)


def _patch_cpu_sampling_expansion() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not _fix_every_engine():
        return
    from vllm.utils import cpu_triton_utils

    # vLLM registers this module's functions as its CPU kernels after the plugins load
    # (WorkerBase: load_general_plugins, then register_triton_kernel_overrides).
    _set(cpu_triton_utils, "_expand_kernel_impl", _expand_kernel_impl)


def _expand_kernel_impl(
    output: Any,
    input_val: Any,
    cu_num_tokens: Any,
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: Any = None,  # noqa: N803 - the Triton kernel's parameter name
) -> None:
    """vLLM's ``expand_kernel`` on CPU, in torch, written into ``output`` in its own dtype.

    ``output`` ``[num_tokens]``: request ``i``'s ``input_val[i]`` at its tokens
    ``cu_num_tokens[i-1]:cu_num_tokens[i]``, ``replace_from`` written as ``replace_to``.
    """
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    expanded = values.repeat_interleave(counts)
    output[: expanded.numel()].copy_(expanded)
