"""The eagle2 step inside vLLM's model runner (vLLM 0.32 ``v1/worker/gpu_model_runner.py``; the
CPU runner subclasses it). Each hook hands over to :mod:`vllm_eagle2.engine.proposer` (drafting) or
:mod:`vllm_eagle2.engine.verification` (verification) and does nothing for engines without eagle2."""

from __future__ import annotations

import copy
import inspect
from typing import Any

from . import cpu_build
from .record import set_attr

#: The attribute of a ModelRunnerOutput that carries an eagle2 step's drafts to the scheduler.
DRAFTS_ATTR = "eagle2_draft_token_ids"


def _is_eagle2(runner: Any) -> bool:
    from vllm_eagle2.engine.proposer import Eagle2Proposer

    return isinstance(getattr(runner, "drafter", None), Eagle2Proposer)


def patch_runner_setup() -> None:
    """``__init__``: the drafter is an Eagle2Proposer (an EAGLE-3 head also gets the target's
    auxiliary hidden states); ``_update_states``: finished requests leave the drafter."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_eagle2.engine.proposer import Eagle2Proposer

    init = GPUModelRunner.__init__

    def __init__(self, vllm_config, device, *args, **kwargs):
        init(self, vllm_config, device, *args, **kwargs)
        spec = self.speculative_config
        self._eagle2_step = None  # an Eagle2Step from execute_model to the end of sample_tokens
        if spec is not None and spec.method == "eagle2":
            self.drafter = Eagle2Proposer(self.vllm_config, self.device, self)
            self.use_aux_hidden_state_outputs = self.drafter.eagle3_use_aux_hidden_state

    update_states = GPUModelRunner._update_states

    def _update_states(self, scheduler_output, *args, **kwargs):
        if _is_eagle2(self) and scheduler_output.finished_req_ids:
            self.drafter.forget(scheduler_output.finished_req_ids)
        return update_states(self, scheduler_output, *args, **kwargs)

    set_attr(GPUModelRunner, "__init__", __init__)
    set_attr(GPUModelRunner, "_update_states", _update_states)


def patch_runner_forward() -> None:
    """``execute_model`` holds the verification's tree batch for exactly the target forward;
    ``_prepare_inputs`` starts the budget's step timer, prepares a step without drafts as plain
    decoding and publishes the tree masks; ``propose_draft_token_ids`` lets the budget plan the
    step before vLLM prepares the drafter's inputs."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_eagle2.engine import step as eagle2_step

    execute_model = GPUModelRunner.execute_model

    def _execute_model(self, *args, **kwargs):
        if not _is_eagle2(self):
            return execute_model(self, *args, **kwargs)
        # The step opens here. _prepare_inputs publishes the tree batch into the forward's scope,
        # the target's attention layers read it, and it is gone when the forward returns; what
        # sampling needs (the kept K/V) stays on the step.
        with eagle2_step.begin(self):
            return execute_model(self, *args, **kwargs)

    prepare_inputs = GPUModelRunner._prepare_inputs

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        if not _is_eagle2(self):
            return prepare_inputs(self, scheduler_output, *args, **kwargs)
        eagle2_step.started(self, self._eagle2_step, scheduler_output)
        if scheduler_output.scheduled_spec_decode_tokens:
            out = prepare_inputs(self, scheduler_output, *args, **kwargs)
        else:
            # No drafts to verify: plain decoding's inputs and vLLM's plain sampler. vLLM 0.32 tells
            # the two apart by speculative_config alone, and would run its rejection sampler.
            spec, self.speculative_config = self.speculative_config, None
            try:
                out = prepare_inputs(self, scheduler_output, *args, **kwargs)
            finally:
                self.speculative_config = spec
        eagle2_step.prepare(self, self._eagle2_step, out[1])
        return out

    propose_draft_token_ids = GPUModelRunner.propose_draft_token_ids
    propose_signature = inspect.signature(propose_draft_token_ids)

    def _propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        if _is_eagle2(self):  # the target pass ends here
            if self._eagle2_step is None:  # (a step opened elsewhere than execute_model: no tree state)
                self._eagle2_step = eagle2_step.Eagle2Step()
            cad = propose_signature.bind(self, scheduler_output, sampled_token_ids, *args, **kwargs)
            cad = cad.arguments.get("common_attn_metadata")
            limit = scheduler_output.num_spec_tokens_to_schedule
            waited = eagle2_step.draft(self, self._eagle2_step, sampled_token_ids, cad, limit)
            if waited is not None:  # no head drafts, the head's catch-up waits: vLLM's drafter is skipped
                return waited
        return propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs)

    input_fits_in_drafter = GPUModelRunner._input_fits_in_drafter

    def _input_fits_in_drafter(self, common_attn_metadata):
        if not _is_eagle2(self) or common_attn_metadata is None:
            return input_fits_in_drafter(self, common_attn_metadata)
        # vLLM asks whether every request has room for num_speculative_tokens more, and else
        # skips the drafter for the whole batch (the head's catch-up pass too) and zero-fills its
        # drafts. eagle2 stops drafting per request, where its tree does not fit (the proposer's
        # ``fits``); the head only needs the batch within its own positions.
        return common_attn_metadata.max_seq_len <= self.effective_drafter_max_model_len

    set_attr(GPUModelRunner, "execute_model", _execute_model)
    set_attr(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    set_attr(GPUModelRunner, "propose_draft_token_ids", _propose_draft_token_ids)
    set_attr(GPUModelRunner, "_input_fits_in_drafter", _input_fits_in_drafter)


def patch_runner_sampling() -> None:
    """``_sample`` seeds each seeded request's generator for its output position
    (:func:`vllm_eagle2.engine.seeding.reseed`), verifies trees instead of the rejection sampler
    (and keeps discarded CPU generators, :mod:`.cpu_build`); ``_bookkeeping_sync`` hides those
    from vLLM's CUDA-only rewind; ``sample_tokens`` hands the drafter the rows it reads and returns
    the step's drafts with its output (:mod:`.scheduling`); ``_dummy_sampler_run`` (vLLM's memory
    profile) also runs the tree verifier at its widest
    (:func:`vllm_eagle2.engine.startup.profile_verification`)."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_eagle2.engine import seeding
    from vllm_eagle2.engine import step as eagle2_step

    sample = GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata):
        eagle2 = _is_eagle2(self)
        fix = eagle2 or cpu_build.fix_every_engine()
        saved = [(gen, gen.get_state()) for gen in cpu_build.discarded_cpu_generators(self)] if fix else []
        try:
            if eagle2:  # a seeded request's token k is drawn from a state of (seed, k) alone
                seeding.reseed(self)
            step = getattr(self, "_eagle2_step", None)
            if spec_decode_metadata is not None and step is not None and step.verify is not None:
                return eagle2_step.sample(self, step, logits, spec_decode_metadata)
            return sample(self, logits, spec_decode_metadata)
        finally:
            # A discarded (partial-prefill) sample must not advance the request's generator.
            for gen, gen_state in saved:
                gen.set_state(gen_state)

    bookkeeping_sync = GPUModelRunner._bookkeeping_sync

    def _bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        fix = _is_eagle2(self) or cpu_build.fix_every_engine()
        rows = cpu_build.discarded_cpu_generator_rows(self) if fix else []
        hidden = {i: generators.pop(i) for i in rows}
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    sample_tokens = GPUModelRunner.sample_tokens

    def _sample_tokens(self, *args, **kwargs):
        if not _is_eagle2(self):
            return sample_tokens(self, *args, **kwargs)
        step = self._eagle2_step
        if step is not None:
            eagle2_step.keep_hidden_rows(self, step)
        try:
            out = sample_tokens(self, *args, **kwargs)
        finally:
            self._eagle2_step = None  # the step ends with its drafts
        if not self.use_async_scheduling and isinstance(out, ModelRunnerOutput):
            out = copy.copy(out)  # never tag a shared instance (vLLM's EMPTY_MODEL_RUNNER_OUTPUT)
            drafts = self.take_draft_token_ids()
            if step is not None:
                drafts = eagle2_step.drafts_sent(self, step, drafts)
            setattr(out, DRAFTS_ATTR, drafts)
        return out

    dummy_sampler_run = GPUModelRunner._dummy_sampler_run

    def _dummy_sampler_run(self, hidden_states, *args, **kwargs):
        out = dummy_sampler_run(self, hidden_states, *args, **kwargs)
        if _is_eagle2(self) and self.device.type == "cuda":  # the CPU's KV cache is sized by hand
            from vllm_eagle2.engine.startup import profile_verification

            vocab = self.model.compute_logits(hidden_states[:1]).shape[-1]
            profile_verification(self, vocab)
        return out

    set_attr(GPUModelRunner, "_dummy_sampler_run", _dummy_sampler_run)
    set_attr(GPUModelRunner, "_sample", _sample)
    set_attr(GPUModelRunner, "_bookkeeping_sync", _bookkeeping_sync)
    set_attr(GPUModelRunner, "sample_tokens", _sample_tokens)


def patch_model_runner() -> None:
    patch_runner_setup()
    patch_runner_forward()
    patch_runner_sampling()
