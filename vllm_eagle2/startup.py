"""What an eagle2 drafter does once, at engine start: the adaptive budget's calibration (after
vLLM's warm-up) and the Triton kernels' warm-up (before vLLM's JIT monitor starts watching)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_eagle2 import attention
from vllm_eagle2.kernels import HAS_TRITON, vocab_topk
from vllm_eagle2.kernels.warmup import StepLimits, warm_up_kernels

if TYPE_CHECKING:
    from vllm_eagle2.proposer import Eagle2Proposer

logger = logging.getLogger("vllm.eagle2")


def kernel_limits(proposer: Eagle2Proposer) -> StepLimits:
    """What bounds this engine's kernel shapes (kernels/warmup.py), read from one row of
    each logits producer (their widths and dtypes, whatever the head format)."""
    s = proposer.settings
    with torch.inference_mode():
        draft = proposer._draft_logits(
            torch.zeros(1, proposer.hidden_size, dtype=proposer.dtype, device=proposer.device)
        )
        hidden = proposer.runner.model_config.get_hidden_size()
        target = proposer.runner.model.compute_logits(
            torch.zeros(1, hidden, dtype=proposer.dtype, device=proposer.device)
        )
    return StepLimits(
        draft_vocab=draft.shape[-1],
        draft_dtype=draft.dtype,
        target_vocab=target.shape[-1],
        # vLLM's logits processors hand the sampler float32 logits.
        target_dtypes=tuple(dict.fromkeys((target.dtype, torch.float32))),
        max_topk=1 if s.tree == "chain" else s.topk,
        # The verified tree with its root, or a draft level's region and its queries.
        max_nodes=max(s.nodes_per_step, s.draft_kv_slots + s.topk) + 1,
        max_rows=proposer.runner.scheduler_config.max_num_batched_tokens,
    )


def warm_up(proposer: Eagle2Proposer) -> int:
    """Compile every Triton variant a step can launch, before vLLM's JIT monitor starts
    watching; returns the launches (0 where the kernels' torch twins run)."""
    if proposer.device.type != "cuda" or not HAS_TRITON:
        return 0
    layers = proposer.vllm_config.compilation_config.static_forward_context
    start = time.perf_counter()
    launches = warm_up_kernels(kernel_limits(proposer), proposer.device, attention.tree_caches(layers))
    logger.info("eagle2: %d kernel variants warmed up in %.1f s", launches, time.perf_counter() - start)
    return launches


def calibrate_budget(proposer: Eagle2Proposer, runner: Any) -> None:
    """Time the target and one draft level for the adaptive budget (at engine start)."""
    if proposer.budget is None:
        return
    limit = runner.scheduler_config.max_num_batched_tokens
    sync = torch.cuda.synchronize if proposer.device.type == "cuda" else (lambda: None)

    def timed(fn: Any) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    def time_target(tokens: int) -> float:
        proposer._calibrating = True
        try:
            return timed(lambda: runner._dummy_run(min(tokens, limit), skip_eplb=True))
        finally:
            proposer._calibrating = False

    def time_level(rows: int) -> float:
        rows = min(rows, limit)
        hidden = torch.zeros(rows, proposer.hidden_size, dtype=proposer.dtype, device=proposer.device)
        saved = proposer.num_speculative_tokens
        proposer.num_speculative_tokens = 1

        def level() -> None:
            EagleProposer.dummy_run(proposer, rows)
            vocab_topk(proposer._draft_logits(hidden), proposer.budget.topk)

        try:
            with torch.inference_mode():
                return timed(level)
        finally:
            proposer.num_speculative_tokens = saved

    proposer.budget.calibrate(time_target, time_level)
