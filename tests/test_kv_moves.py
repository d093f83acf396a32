"""The accepted nodes' K/V moves on CPU: one C++ call for every layer, within vLLM's own layouts.

After a move, every destination slot holds what its source held before any move (paths overlap: a
node's slot can be another's destination), a destination of -1 is written nowhere, and every other
slot is untouched; the C++ kernel and its torch twin leave the same bits.
"""

from __future__ import annotations

import pytest
import torch

from vllm_eagle2.kernels import move_kv_slots, read_kv_slots

BS, HKV, D, BLOCKS = 32, 3, 64, 4
CASES = [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16)]


def caches(dtype: torch.dtype, layers: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(BLOCKS, HKV, BS, 2 * D, generator=gen).to(dtype) for _ in range(layers)]


# A chain shifted down by one (each source is the next pair's destination), a jump across blocks,
# and a padding pair (destination -1).
SRC = torch.tensor([40, 41, 42, 100, 7])
DST = torch.tensor([39, 40, 41, 33, -1])


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize(("layout", "dtype"), CASES)
def test_each_destination_holds_its_source_as_it_was(layout: str, dtype: torch.dtype, backend: str) -> None:
    layers = caches(dtype)
    before = [c.clone() for c in layers]
    move_kv_slots(layers, layout, SRC, DST, backend=backend)
    for old, new in zip(before, layers):
        want_k, want_v = read_kv_slots(old, layout, SRC[:4])
        got_k, got_v = read_kv_slots(new, layout, DST[:4])
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        # Every slot but the destinations is as it was (7, whose pair writes nothing, included).
        others = torch.tensor([s for s in range(BLOCKS * BS) if s not in DST.tolist()])
        assert torch.equal(read_kv_slots(new, layout, others)[0], read_kv_slots(old, layout, others)[0])
        assert torch.equal(read_kv_slots(new, layout, others)[1], read_kv_slots(old, layout, others)[1])


@pytest.mark.parametrize(("layout", "dtype"), CASES)
def test_the_kernel_leaves_the_twins_bits(layout: str, dtype: torch.dtype) -> None:
    by_kernel, by_twin = caches(dtype), caches(dtype)
    move_kv_slots(by_kernel, layout, SRC, DST, backend="cpp")
    move_kv_slots(by_twin, layout, SRC, DST, backend="torch")
    for a, b in zip(by_kernel, by_twin):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_slot_outside_the_cache_is_refused_before_any_layer_is_written() -> None:
    layers = caches(torch.float32)
    before = [c.clone() for c in layers]
    with pytest.raises(ValueError, match="outside the cache"):
        move_kv_slots(layers, "vec", torch.tensor([3, BLOCKS * BS]), torch.tensor([4, 5]), backend="cpp")
    assert all(torch.equal(a, b) for a, b in zip(before, layers))


def test_a_layout_the_move_does_not_know_is_named() -> None:
    with pytest.raises(ValueError, match="'flash'"):
        move_kv_slots(caches(torch.float32), "flash", SRC, DST)
