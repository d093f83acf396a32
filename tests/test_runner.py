"""The verifier's glue: which drafts of a tree need a tree mask, the per-forward scope of the
tree-attention side channel, the K/V moves, and on CPU vLLM's kernel kept off the tree rows."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_eagle2.engine import attention, cpu_rows, verification
from vllm_eagle2.engine.step_state import Eagle2Step
from vllm_eagle2.engine.tree_batch import active_batch
from vllm_eagle2.kernels import PAD_PARENT, build_tree_masks, read_kv_slots, write_kv_slots
from vllm_eagle2.tree import off_leading_chain


def _off_chain(parents: list[list[int]]) -> list[list[bool]]:
    """Parents: -1 = child of the root, PAD_PARENT = padding."""
    return off_leading_chain(build_tree_masks(torch.tensor(parents)).depths).tolist()


def test_a_leading_chain_keeps_the_causal_result():
    # a (child of the root), b (child of a): causal attention is the tree's.
    assert _off_chain([[-1, 0]]) == [[False, False]]


def test_a_branch_and_what_hangs_below_it_need_a_tree_mask():
    # a (child of root), b (child of a), c (child of root), d (child of c)
    assert _off_chain([[-1, 0, -1, 2]]) == [[False, False, True, True]]


def test_a_node_after_a_branch_needs_a_tree_mask_even_deep_in_a_chain():
    # a, b (second child of root), c (child of a): c's predecessors include b
    assert _off_chain([[-1, -1, 0]]) == [[False, True, True]]


def test_padding_never_needs_a_tree_mask():
    assert _off_chain([[-1, PAD_PARENT, PAD_PARENT], [-1, -1, 1]]) == [
        [False, False, False],
        [False, True, True],
    ]


# --------------------------------------------------------------------------- #
# The tree-attention side channel: one `with tree_batch(...)` per forward
# --------------------------------------------------------------------------- #


def _batch() -> attention.TreeBatch:
    one = torch.zeros(1, dtype=torch.long)
    return attention.TreeBatch(
        rows=one,
        query_start_loc=torch.tensor([0, 1]),
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        context_lens=one,
        region_lens=one + 1,
        mask=torch.ones(1, 1, 1, dtype=torch.int32),
        tails=np.ones(1, dtype=np.int64),
    )


def test_tree_batch_is_active_inside_its_with_only():
    assert active_batch() is None  # what every wrapped layer reads
    batch = _batch()
    with attention.tree_batch(batch) as forward:
        assert active_batch() is batch and forward.batch is batch
    assert active_batch() is None
    with pytest.raises(ValueError, match="boom"), attention.tree_batch(batch):
        raise ValueError("boom")  # a forward that fails does not leave its batch behind
    assert active_batch() is None


def test_verification_refuses_to_prepare_outside_a_step():
    with pytest.raises(RuntimeError, match="no tree batch is active"):
        verification.prepare_tree_verification(SimpleNamespace(), None, None)
    with pytest.raises(RuntimeError, match="no tree batch is active"):
        verification.prepare_tree_verification(SimpleNamespace(), Eagle2Step(), None)


def test_tree_batch_scopes_do_not_nest_and_publish_once():
    with attention.tree_batch() as forward:
        assert forward.batch is None
        with pytest.raises(RuntimeError, match="do not nest"), attention.tree_batch(_batch()):
            pass
        batch = _batch()
        forward.publish(batch)  # the refused scope changed nothing: this forward's is still open
        assert active_batch() is batch
        with pytest.raises(RuntimeError, match="already has a tree batch"):
            forward.publish(_batch())
        assert forward.batch is batch


class FlashAttentionImplFake:
    """Stands in for a vLLM attention impl ("flash" layout); its cache writer is eagle2's twin of
    vLLM's, and it records what it writes."""

    scale = 1.0
    num_heads = 1

    def __init__(self) -> None:
        self.writes: list[torch.Tensor] = []

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.writes.append(slot_mapping.clone())
        write_kv_slots(kv_cache, "flash", slot_mapping, key, value)


def test_layers_see_the_batch_only_inside_the_scope(monkeypatch: pytest.MonkeyPatch):
    impl = FlashAttentionImplFake()
    layer = SimpleNamespace(impl=impl, kv_cache=torch.zeros(1))
    attention.wrap_attention_layers({"target": layer})
    tree_calls = []
    monkeypatch.setattr(attention, "_flash_forward", lambda *a: tree_calls.append(a[4]))
    key = torch.arange(6.0).view(3, 1, 2)
    meta = SimpleNamespace(max_seq_len=4)

    def forward_pass() -> None:
        impl.forward(layer, key, key, key, layer.kv_cache, meta, torch.zeros(3, 2))

    forward_pass()  # no scope: plain causal attention
    assert tree_calls == []
    batch = _batch()
    with attention.tree_batch() as forward:
        forward.publish(batch)
        forward_pass()
    assert tree_calls == [batch]
    forward_pass()  # after the scope: causal again
    assert tree_calls == [batch]


def test_moved_kv_is_read_from_the_cache_before_any_slot_is_written():
    """An accepted node's K/V moves from its own slot; all are read first, so a destination that is
    another move's source still gives that move the old contents."""
    impl = FlashAttentionImplFake()
    kv = torch.randn(2, 2, 32, 8)
    layer = SimpleNamespace(impl=impl, kv_cache=kv)
    before = kv.clone()
    attention.move_kv({"target"}, {"target": layer}, torch.tensor([3, 40]), torch.tensor([1, 3]))
    assert [w.tolist() for w in impl.writes] == [[1, 3]]
    old = read_kv_slots(before, "flash", torch.tensor([3, 40]))
    new = read_kv_slots(kv, "flash", torch.tensor([1, 3]))
    assert all(torch.equal(a, b) for a, b in zip(old, new))
    untouched = [s for s in range(64) if s not in (1, 3)]
    assert torch.equal(read_kv_slots(kv, "flash", torch.tensor(untouched))[0],
                       read_kv_slots(before, "flash", torch.tensor(untouched))[0])  # fmt: skip


class CPUAttentionImplFake:
    """Named as vLLM's CPU backend, so the layer's cache is one of vLLM's CPU layouts."""


def test_cpu_layers_move_their_kv_in_one_call_per_layout(monkeypatch):
    """Every CPU layer's K/V moves in one kernel call (per layout), within the layout vLLM chose."""
    calls = []
    monkeypatch.setattr(attention, "move_kv_slots", lambda caches, layout, *_: calls.append((caches, layout)))
    layers = {
        f"l{i}": SimpleNamespace(impl=CPUAttentionImplFake(), isa=isa, kv_cache=torch.zeros(1, 1, 32, 128))
        for i, isa in enumerate(["vec", "vec16", "amx"])
    }
    attention.move_kv(set(layers), layers, torch.tensor([3]), torch.tensor([1]))
    by_layout = {layout: {id(c) for c in caches} for caches, layout in calls}
    assert len(calls) == 2 and by_layout == {
        "vec": {id(layers["l0"].kv_cache), id(layers["l1"].kv_cache)},
        "amx": {id(layers["l2"].kv_cache)},
    }


# --------------------------------------------------------------------------- #
# On CPU: vLLM's kernel over the rows before the tree rows only
# --------------------------------------------------------------------------- #

H, HKV, D, BS = 9, 3, 64, 32


def _vllm_forward(meta, query: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
    from vllm import _custom_ops as ops

    k, v = kv.view(kv.shape[0], HKV, 2 * BS, D).chunk(2, dim=2)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=k, value_cache=v, output=out, query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens, scale=D**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=meta.block_table, softcap=0.0, scheduler_metadata=meta.scheduler_metadata, s_aux=None,
        dynamic_causal=None,
    )  # fmt: skip


def _cpu_forward_case():
    """Two requests: a root, 2 chain drafts and 3 tree rows after 100 tokens; a root and 3 chain
    drafts after 50 (no tree rows). vLLM's metadata for the whole forward, and the tree batch."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    gen = torch.Generator().manual_seed(0)
    seqs = [106, 54]
    kv = torch.zeros(8, HKV, BS, 2 * D)
    k, v = kv.view(8, HKV, 2 * BS, D).chunk(2, dim=2)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    slots = torch.cat([torch.arange(106), 128 + torch.arange(54)])
    ops.cpu_attn_reshape_and_cache(*torch.randn(2, 160, HKV, D, generator=gen), k, v, slots, "vec")
    qsl, seq_lens = torch.tensor([0, 6, 10], dtype=torch.int32), torch.tensor(seqs, dtype=torch.int32)
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=2, num_heads=H, num_kv_heads=HKV, head_dim=D, seq_lens=seq_lens, dtype=torch.float32,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=True,
        dynamic_causal=None, kv_cache_dtype="auto",
    )  # fmt: skip
    meta = CPUAttentionMetadata(
        num_actual_tokens=10, max_query_len=6, query_start_loc=qsl, max_seq_len=106, seq_lens=seq_lens,
        block_table=table, slot_mapping=slots, scheduler_metadata=scheduler,
    )  # fmt: skip
    batch = attention.TreeBatch(
        rows=torch.arange(3, 6), query_start_loc=torch.tensor([0, 3]), block_table=table[:1],
        context_lens=torch.tensor([100]), region_lens=torch.tensor([6]),
        mask=torch.full((1, 3, 1), 0b111111, dtype=torch.int32), tails=np.array([3, 0]),
    )  # fmt: skip
    impl = SimpleNamespace(num_heads=H, num_kv_heads=HKV, head_size=D, kv_cache_dtype="auto")
    return meta, batch, impl, kv, torch.randn(10, H, D, generator=gen)


def test_vllms_kernel_computes_the_rows_before_the_tree_rows_and_never_touches_these():
    meta, batch, impl, kv, query = _cpu_forward_case()
    full = torch.empty_like(query)
    _vllm_forward(meta, query, kv, full)
    split_meta = cpu_rows.causal_rows_only(meta, batch, impl, SimpleNamespace(isa="vec"), torch.float32)
    assert split_meta.query_start_loc.tolist() == [0, 3, 6, 10, 10]  # request 1 has no tree rows
    assert split_meta.seq_lens.tolist() == [103, 0, 54, 0]
    split = torch.full_like(query, 7.0)
    _vllm_forward(split_meta, query, kv, split)
    causal = torch.tensor([0, 1, 2, 6, 7, 8, 9])
    assert torch.equal(split[causal], full[causal])  # bit for bit: the same work, fewer rows
    assert (split[3:6] == 7.0).all()


def test_rows_that_are_not_their_requests_last_are_refused():
    meta, batch, impl, _, _ = _cpu_forward_case()
    isa = SimpleNamespace(isa="vec")
    for rows in (torch.arange(2, 5), torch.tensor([3, 5, 4])):
        with pytest.raises(RuntimeError, match="not the last rows of their requests"):
            cpu_rows.causal_rows_only(meta, dataclasses.replace(batch, rows=rows), impl, isa, torch.float32)
    with pytest.raises(RuntimeError, match="not the last rows"):  # more tree rows than rows
        cpu_rows.causal_rows_only(
            meta, dataclasses.replace(batch, tails=np.array([3, 5])), impl, isa, torch.float32
        )
