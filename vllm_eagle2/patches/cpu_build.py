"""vLLM's CPU build: fixes of three of its bugs (vLLM 0.32 ``utils/cpu_triton_utils.py``, torch's
bundled Inductor callable under vLLM's compile cache, and the runner's generator rewind, hooked in
:mod:`.model_runner`)."""

from __future__ import annotations

import os
from typing import Any

from .record import set_attr

#: Set to 1 to fix two bugs of vLLM's CPU build in engines that do not use eagle2 as well.
FIX_VLLM_CPU_ENV = "VLLM_EAGLE2_FIX_VLLM_CPU"


def fix_every_engine() -> bool:
    """Whether the opt-in asks for vLLM CPU-build fixes in engines without eagle2 too."""
    return os.environ.get(FIX_VLLM_CPU_ENV, "0") == "1"


def discarded_cpu_generator_rows(runner: Any) -> list[int]:
    """Batch rows whose sample this step is discarded (partial prefill) and that own a CPU generator.

    vLLM rewinds their generators with ``set_offset``, which only CUDA generators have: a seeded
    request with a chunked prefill crashed the CPU build. The runner hooks keep them untouched.
    """
    num_reqs = runner.input_batch.num_reqs
    generators = runner.input_batch.generators
    if not generators or num_reqs == 0:
        return []
    rows = runner.discard_request_mask.np[:num_reqs].nonzero()[0]
    return [int(i) for i in rows if int(i) in generators and generators[int(i)].device.type == "cpu"]


def discarded_cpu_generators(runner: Any) -> list[Any]:
    generators = runner.input_batch.generators
    return [generators[i] for i in discarded_cpu_generator_rows(runner)]


def patch_cpu_compile_cache() -> None:
    """vLLM's compile cache loads on CPU instead of failing and compiling both engines again.

    On CPU vLLM compiles with mode ``DYNAMO_TRACE_ONCE`` and the ``"inductor"`` backend, so torch
    saves the model as a ``BundledAOTAutogradSerializableCallable``; on load vLLM calls
    ``finalize_loading``, which only its own ``VllmSerializableFunction`` has, and the wrapper's
    ``__getattr__`` forwards it to a plain function: "'function' object has no attribute
    'finalize_loading'", then a full compile (about a minute per engine here). The bundled
    callable is complete once deserialised, so finalising it is a no-op.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as bundled
    except ImportError:  # a torch without AOT compile: vLLM compiles as before
        return
    if "finalize_loading" not in bundled.__dict__:
        set_attr(bundled, "finalize_loading", _nothing_to_finalize)


def _nothing_to_finalize(self: Any, vllm_config: Any) -> None:
    """``finalize_loading`` of a callable that deserialisation already made complete."""


def patch_cpu_sampling_expansion() -> None:
    """With the opt-in only (eagle2 verifies with its own sampler and never calls it): the CPU
    ``expand_kernel`` of vLLM's rejection sampler wrote into an int64 copy of its output, so the
    per-token temperature, top-k and top-p were uninitialised memory."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not fix_every_engine():
        return
    from vllm.utils import cpu_triton_utils

    # vLLM registers this module's functions as its CPU kernels after the plugins load
    # (WorkerBase: load_general_plugins, then register_triton_kernel_overrides).
    set_attr(cpu_triton_utils, "_expand_kernel_impl", _expand_kernel_impl)


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
