"""Kernel warm-up: every Triton variant a step can launch is compiled at engine start.

Triton compiles per variant: constexprs and launch options, tensor dtypes and 16-byte
alignment, and (for ints it specialises) whether an int is 1 and whether 16 divides it. These
tests wrap each kernel in a recorder that computes that variant key at every launch (the kernels
run under the Triton interpreter here), then check that launches at every shape a step can
make (rows, k, tree widths, context lengths) find only variants the warm-up launched.
"""

from __future__ import annotations

from importlib import import_module

import pytest
import torch

from vllm_eagle2 import kernels
from vllm_eagle2.kernels.warmup import (
    AttentionCache,
    StepLimits,
    attention_variants,
    mask_variants,
    warm_up_kernels,
)

# The modules (``kernels.vocab_topk`` is also the function's name).
vocab_topk, tree_mask, tree_attention_triton = (
    import_module(f"vllm_eagle2.kernels.{name}")
    for name in ("vocab_topk", "tree_mask", "tree_attention_triton")
)

KERNELS = [
    (vocab_topk, "_chunk_topk_kernel"),
    (vocab_topk, "_merge_topk_kernel"),
    (tree_mask, "_tree_mask_kernel"),
    (tree_attention_triton, "_ctx_split_kernel"),
    (tree_attention_triton, "_region_merge_kernel"),
]

# Vocabularies of several 2048-wide tiles, so that the top-k's chunk count varies with the rows.
LIMITS = StepLimits(
    draft_vocab=8292,
    draft_dtype=torch.float32,
    target_vocab=4200,
    target_dtypes=(torch.float32,),
    max_topk=3,
    max_nodes=13,
    max_rows=48,
)
HKV, G, BLOCK, D, BLOCKS = 2, 2, 16, 32, 40
CPU = torch.device("cpu")


def _variant(kernel, args, kwargs) -> tuple:
    """The key Triton compiles a launch under (its specialisation rules, as of Triton 3.x)."""
    skip = set(kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or not isinstance(value, int):
            key.append((name, type(value).__name__))
        elif name in skip:
            key.append((name, "int", value >= 2**31))
        else:
            key.append((name, "int", value == 1, value % 16 == 0))
    return (kernel.fn.__name__, tuple(key), tuple(sorted(kwargs.items())))


class Launches:
    """The variants launched; with ``run`` False launches are recorded only (no output is read
    on the host, so a sweep over shapes needs no results)."""

    def __init__(self) -> None:
        self.seen: set = set()
        self.run = True


class Recorder:
    """Stands in for a JIT kernel: records each launch's variant, then runs the kernel."""

    def __init__(self, kernel, launches: Launches) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.seen.add(_variant(self.kernel, args, kwargs))
            if self.launches.run:
                self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def launches(monkeypatch) -> Launches:
    """Every Triton kernel of the step recorded, on a device of 16 programs' width (as a GPU
    would be: on CPU tensors the top-k would otherwise aim at one chunk)."""
    out = Launches()
    for module, name in KERNELS:
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), out))
    monkeypatch.setattr(vocab_topk, "_num_programs_target", lambda device: 16)
    return out


def _cache(device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> AttentionCache:
    """A random paged KV cache in vLLM 0.32's flash layout, [BLOCKS, HKV, BLOCK, 2 * D] split into
    key and value views of [BLOCKS, HKV, BLOCK, D] each, for HKV * G query heads, on ``device`` in
    ``dtype`` (the defaults are this CPU's float32; ``tests/test_gpu.py`` asks for CUDA and bf16)."""
    cache = torch.randn(BLOCKS, HKV, BLOCK, 2 * D).to(device=device, dtype=dtype)
    key_cache, value_cache = kernels.kv_cache_views(cache, "flash")
    return AttentionCache(key_cache, value_cache, num_heads=HKV * G)


def _random_parents(gen: torch.Generator, batch: int, n: int, device: torch.device = CPU) -> torch.Tensor:
    """[batch, n] int64 trees in topological order (-1: child of the root), some rows padded."""
    parents = torch.full((batch, n), -1, dtype=torch.int64)
    for j in range(1, n):
        parents[:, j] = torch.randint(-1, j, (batch,), generator=gen)
    return parents.to(device)


def serve_every_shape(cache: AttentionCache, limits: StepLimits = LIMITS) -> None:
    """Launch the kernels as steps do, over every row count, k, width, and short and long contexts."""
    device = cache.key_cache.device
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    for rows in range(1, limits.max_rows + 1):
        for k in range(1, limits.max_topk + 1):
            kernels.vocab_topk(randn(rows, limits.draft_vocab).to(limits.draft_dtype), k, backend="triton")
        for dtype in limits.target_dtypes:
            logits = randn(rows, limits.target_vocab).to(dtype)
            kernels.vocab_topk(logits, 1, backend="triton")
            kernels.vocab_topk(logits, 1, scale=torch.full((rows,), 1.5, device=device), backend="triton")
    for n in range(1, limits.max_nodes + 1):
        kernels.build_tree_masks(_random_parents(gen, 3, n, device), backend="triton", check_values=False)
    # Contexts long enough to be split over programs and short enough not to be.
    for max_q, context in [(1, 5), (4, 600), (9, 3), (13, 300), (13, 0), (2, 620)]:
        q_lens = torch.tensor([max_q, max(1, max_q // 2)])
        masks = kernels.build_tree_masks(_random_parents(gen, 2, max_q), backend="torch").packed
        query = randn(int(q_lens.sum()), HKV * G, D).to(cache.key_cache.dtype)
        kernels.paged_tree_attention(
            query,
            cache.key_cache,
            cache.value_cache,
            torch.stack([torch.arange(BLOCKS), torch.arange(BLOCKS).flip(0)]).to(torch.int32).to(device),
            torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(device),
            torch.tensor([context, context // 2], device=device),
            q_lens.to(device),
            masks.to(device),
            D**-0.5,
            backend="triton",
            max_context_len=context,
        )


def test_every_variant_a_step_launches_was_launched_by_the_warm_up(launches) -> None:
    cache = _cache()
    count = warm_up_kernels(LIMITS, CPU, [cache])  # run for real: every warm-up launch works
    warmed = set(launches.seen)
    assert count > 0 and {v[0] for v in warmed} == {name for _, name in KERNELS}
    launches.seen.clear()
    launches.run = False
    serve_every_shape(cache)
    seen = launches.seen
    assert {v[0] for v in seen} == {name for _, name in KERNELS}, "the sweep must reach every kernel"
    assert len({v for v in seen if v[0] == "_merge_topk_kernel"}) > 4, "and several chunk counts"
    missed = seen - warmed
    assert not missed, f"{len(missed)} variants would compile mid-serving, e.g. {sorted(missed, key=str)[:2]}"


def test_a_shape_beyond_the_limits_is_a_variant_the_warm_up_did_not_launch(launches) -> None:
    """The check above can fail: a k wider than the engine's topk is a new variant."""
    launches.run = False
    warm_up_kernels(LIMITS, CPU, [])
    warmed = set(launches.seen)
    kernels.vocab_topk(torch.randn(4, LIMITS.draft_vocab), LIMITS.max_topk + 1, backend="triton")
    assert launches.seen - warmed


def test_row_counts_map_to_a_few_variants(monkeypatch) -> None:
    """What keeps start-up short: on an H100-sized device (132 SMs), any row count of a 128k
    vocabulary gives one of a handful of chunk counts, and trees of up to 64 nodes one of a
    handful of mask and attention blocks."""
    monkeypatch.setattr(vocab_topk, "_num_programs_target", lambda device: 4 * 132)
    chunks = {vocab_topk.chunk_plan(r, 128256, CPU) for r in range(1, 70_000)}
    assert len(chunks) <= 8
    assert len(mask_variants(64)) <= 8
    assert len(attention_variants(64, g=4)) <= 10


def test_a_tensor_parallel_rank_without_logits_takes_the_widths_from_the_config() -> None:
    """vLLM gathers logits to the first tensor-parallel rank; the others warm up the same variants."""
    from types import SimpleNamespace

    from vllm_eagle2.config import Eagle2Settings
    from vllm_eagle2.engine.startup import kernel_limits

    runner = SimpleNamespace(
        model_config=SimpleNamespace(get_vocab_size=lambda: 4200, get_hidden_size=lambda: 8),
        model=SimpleNamespace(compute_logits=lambda hidden: None),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=48),
    )
    proposer = SimpleNamespace(
        settings=Eagle2Settings(num_nodes=12, depth=4, topk=3),
        runner=runner,
        hidden_size=8,
        dtype=torch.bfloat16,
        device=CPU,
        vocab=SimpleNamespace(logits=lambda hidden: None, size=lambda target_vocab: 300),
    )
    limits = kernel_limits(proposer)
    assert (limits.draft_vocab, limits.target_vocab, limits.max_topk, limits.max_nodes) == (300, 4200, 3, 13)
    assert limits.draft_dtype == torch.bfloat16 and limits.target_dtypes == (torch.bfloat16, torch.float32)
