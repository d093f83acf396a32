"""The verifier's glue: which drafts of a tree need a tree mask, and the per-forward scope of
the tree-attention side channel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_eagle2.engine import attention, verification
from vllm_eagle2.engine.step_state import Eagle2Step
from vllm_eagle2.kernels import PAD_PARENT, build_tree_masks
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


def _batch(keep_kv: bool = False) -> attention.TreeBatch:
    one = torch.zeros(1, dtype=torch.long)
    return attention.TreeBatch(
        rows=one,
        query_start_loc=torch.tensor([0, 1]),
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        context_lens=one,
        region_lens=one + 1,
        mask=torch.ones(1, 1, 1, dtype=torch.int32),
        keep_kv=keep_kv,
    )


def test_tree_batch_is_active_inside_its_with_only():
    assert attention._active is None  # what every wrapped layer reads
    batch = _batch()
    with attention.tree_batch(batch) as forward:
        assert attention._active is forward and forward.batch is batch
    assert attention._active is None
    with pytest.raises(ValueError, match="boom"), attention.tree_batch(batch):
        raise ValueError("boom")  # a forward that fails does not leave its batch behind
    assert attention._active is None


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
        assert attention._active is forward  # the refused scope changed nothing
        batch = _batch()
        forward.publish(batch)
        with pytest.raises(RuntimeError, match="already has a tree batch"):
            forward.publish(_batch())
        assert forward.batch is batch


class FlashAttentionImplFake:
    """Stands in for a vLLM attention impl ("flash" layout): records the cache writes."""

    scale = 1.0

    def __init__(self) -> None:
        self.writes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.writes.append((key.clone(), slot_mapping.clone()))


def test_layers_see_the_batch_and_keep_kv_only_inside_the_scope(monkeypatch: pytest.MonkeyPatch):
    impl = FlashAttentionImplFake()
    layer = SimpleNamespace(impl=impl, kv_cache=torch.zeros(1))
    attention.wrap_attention_layers({"target": layer})
    tree_calls = []
    monkeypatch.setattr(attention, "_tree_forward", lambda *a: tree_calls.append(a[5]))
    key = torch.arange(6.0).view(3, 1, 2)
    meta = SimpleNamespace(max_seq_len=4)

    def forward_pass() -> None:
        impl.do_kv_cache_update(layer, key, key, layer.kv_cache, torch.arange(3))
        impl.forward(layer, key, key, key, layer.kv_cache, meta, torch.zeros(3, 2))

    forward_pass()  # no scope: plain causal attention, nothing kept
    assert tree_calls == []
    batch = _batch(keep_kv=True)
    with attention.tree_batch() as forward:
        forward.publish(batch)
        forward_pass()
    assert tree_calls == [batch]
    kept = forward.kept_kv
    assert list(kept) == [id(layer)]
    forward_pass()  # after the scope: causal again, the kept K/V of the finished forward untouched
    assert tree_calls == [batch] and torch.equal(kept[id(layer)][1], key[batch.rows])

    impl.writes.clear()
    attention.move_kv(kept, {"target"}, {"target": layer}, torch.tensor([0]), torch.tensor([7]))
    ((moved, slots),) = impl.writes
    assert torch.equal(moved, key[batch.rows]) and slots.tolist() == [7]
    assert kept == {}


def test_kept_kv_is_a_copy_that_outlives_the_buffers_of_the_forward():
    """In compiled mode the K/V handed to the cache writer are buffers that later pieces of the
    forward reuse; what the verifier moves afterwards must be what the writer wrote."""
    impl = FlashAttentionImplFake()
    layer = SimpleNamespace(impl=impl, kv_cache=torch.zeros(1))
    attention.wrap_attention_layers({"target": layer})
    key = torch.arange(6.0).view(3, 1, 2)
    batch = _batch(keep_kv=True)
    with attention.tree_batch(batch) as forward:
        impl.do_kv_cache_update(layer, key, key, layer.kv_cache, torch.arange(3))
    written = impl.writes[-1][0]
    key.fill_(-1.0)  # the buffer reused by a later piece
    _, kept_key, kept_value = forward.kept_kv[id(layer)]
    assert torch.equal(kept_key, written[batch.rows]) and torch.equal(kept_value, written[batch.rows])


def test_moving_kv_for_a_layer_that_kept_none_fails_loudly():
    impl = FlashAttentionImplFake()
    layer = SimpleNamespace(impl=impl, kv_cache=torch.zeros(1))
    attention.wrap_attention_layers({"target": layer})
    with pytest.raises(RuntimeError, match="kept no K/V for 1 target attention layers"):
        attention.move_kv({}, {"target"}, {"target": layer}, torch.tensor([0]), torch.tensor([7]))
