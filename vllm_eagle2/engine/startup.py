"""What an eagle2 drafter does once, at engine start: the adaptive budget's calibration (after
vLLM's warm-up) and the Triton kernels' warm-up (before vLLM's JIT monitor starts watching)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_eagle2.engine import attention
from vllm_eagle2.kernels import HAS_TRITON, vocab_topk
from vllm_eagle2.kernels.warmup import StepLimits, warm_up_kernels

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_eagle2.engine.proposer import Eagle2Proposer

logger = logging.getLogger("vllm.eagle2")

#: The long context the calibration prices attention at (or the engine's max_model_len, if shorter).
LONG_CONTEXT = 2048


def kernel_limits(proposer: Eagle2Proposer) -> StepLimits:
    """What bounds this engine's kernel shapes (kernels/warmup.py). The logits' widths and dtypes
    are read from one row of each producer, whatever the head format; a tensor-parallel rank that
    gets no logits back (vLLM gathers them to the first) falls back to the config's."""
    s = proposer.settings
    vocab = proposer.runner.model_config.get_vocab_size()
    with torch.inference_mode():
        hidden = torch.zeros(1, proposer.hidden_size, dtype=proposer.dtype, device=proposer.device)
        draft = proposer.vocab.logits(hidden)
        target_hidden = torch.zeros(
            1, proposer.runner.model_config.get_hidden_size(), dtype=proposer.dtype, device=proposer.device
        )
        target = proposer.runner.model.compute_logits(target_hidden)
    draft_vocab = proposer.vocab.size(vocab) if draft is None else draft.shape[-1]
    target_dtype = proposer.dtype if target is None else target.dtype
    return StepLimits(
        draft_vocab=draft_vocab,
        draft_dtype=proposer.dtype if draft is None else draft.dtype,
        target_vocab=vocab if target is None else target.shape[-1],
        # vLLM's logits processors hand the sampler float32 logits.
        target_dtypes=tuple(dict.fromkeys((target_dtype, torch.float32))),
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


def calibrate_budget(proposer: Eagle2Proposer, runner: GPUModelRunner) -> None:
    """Time the target (with attention, at the least context and at a long one) and one draft
    level for the adaptive budget (at engine start)."""
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

    def time_target(tokens: int, context: int | None) -> tuple[float, float]:
        tokens = min(tokens, limit)
        # vLLM's dummy batch: min(tokens, max_num_seqs) requests sharing the tokens, each of
        # seq_len ``read`` (its K/V slots unwritten; the reads are what is timed).
        query = -(-tokens // min(tokens, runner.max_num_reqs))
        read = max(query, context or 0)

        def run() -> None:
            runner._dummy_run(tokens, skip_eplb=True, force_attention=True, profile_seq_lens=read)

        with proposer.target_alone():
            return timed(run), float(read)

    def time_level(rows: int) -> float:
        rows = min(rows, limit)
        hidden = torch.zeros(rows, proposer.hidden_size, dtype=proposer.dtype, device=proposer.device)
        saved = proposer.num_speculative_tokens
        proposer.num_speculative_tokens = 1

        def level() -> None:
            EagleProposer.dummy_run(proposer, rows)
            vocab_topk(proposer.vocab.logits(hidden), proposer.budget.topk)

        try:
            with torch.inference_mode():
                return timed(level)
        finally:
            proposer.num_speculative_tokens = saved

    target_layers = runner.model_config.get_num_layers(runner.parallel_config)
    head_config = proposer.vllm_config.speculative_config.draft_model_config.hf_config
    head_layers = getattr(head_config, "num_hidden_layers", 1) or 1
    long_context = min(LONG_CONTEXT, runner.max_model_len - 1)
    proposer.budget.calibrate(time_target, time_level, long_context, head_layers / max(target_layers, 1))


def verification_peak(runner: GPUModelRunner) -> tuple[int, int, int]:
    """The widest verification a step of this engine can run: (requests, draft width, logits rows).

    Requests up to ``max_num_seqs``; the width the verifier pads to is at most
    ``num_speculative_tokens`` (:func:`vllm_eagle2.engine.verification._verify_width`); the step's
    logits hold one row per scheduled token, at most ``max_num_batched_tokens``."""
    batch, width = runner.max_num_reqs, runner.num_spec_tokens
    return batch, width, min(batch * (width + 1), runner.max_num_tokens)


def profile_verification(runner: GPUModelRunner, vocab: int) -> None:
    """Run the tree verifier once at :func:`verification_peak`, sampled with top-k and top-p, inside
    vLLM's memory profile (its ``_dummy_sampler_run``).

    A step's verification holds the step's logits [rows, V], their gather [B, N + 1, V] and the
    sampler's top-k / top-p groups: at B=256, N=64 and a 128k vocabulary, gigabytes that vLLM's
    profile of its own sampler never sees, so they came out of the KV cache's share mid-serving.
    Run here, they are reserved before the cache is sized.
    """
    from vllm_eagle2.verify.verifier import verify_tree

    batch, width, rows = verification_peak(runner)
    device = runner.device
    logits = torch.randn(rows, vocab, dtype=torch.float32, device=device)
    row_idx = torch.arange(batch * (width + 1), device=device).view(batch, width + 1) % rows
    tokens = torch.randint(vocab, (batch, width), device=device)
    chain = (torch.arange(width, device=device) - 1).expand(batch, width)
    full = lambda value: torch.full((batch,), value, device=device)  # noqa: E731
    verify_tree(
        tokens, chain, logits[row_idx], temperature=full(0.5), top_k=full(vocab - 1).long(), top_p=full(0.9)
    )
    del logits
