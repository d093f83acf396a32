"""Fuzzing the tree core and the verifier: random shapes, -inf / NaN / ties, mixed batches.

Whatever the draft says (garbage included), what is emitted is the target's own choice.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_eagle2.tree import TREE_MODES, build_dynamic_tree, pool_size
from vllm_eagle2.verify.verifier import verify_tree


def garbage_logits(gen: torch.Generator, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    x = torch.randn(shape, generator=gen) * 3
    if kind == "nan":
        x[torch.rand(shape, generator=gen) < 0.5] = math.nan
    elif kind == "neg_inf":
        x[torch.rand(shape, generator=gen) < 0.8] = -math.inf
    elif kind == "all_nan":
        x[:] = math.nan
    elif kind == "ties":
        x = torch.zeros(shape)
    elif kind == "pos_inf":
        x[torch.rand(shape, generator=gen) < 0.1] = math.inf
    return x


def target_path(tokens: list[int], parents: list[int], logits: torch.Tensor) -> list[int]:
    """What the target alone emits greedily, walking the tree: matched nodes, then its own token."""
    node, out = -1, []
    while True:
        want = int(logits[node + 1].argmax())
        out.append(want)
        kids = [i for i, p in enumerate(parents) if p == node and tokens[i] == want]
        if not kids:
            return out
        node = kids[0]


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 4),
    vocab=st.integers(2, 40),
    depth=st.integers(1, 5),
    topk=st.integers(1, 4),
    frac=st.floats(0, 1),
    mode=st.sampled_from(TREE_MODES),
    kind=st.sampled_from(["plain", "nan", "neg_inf", "all_nan", "ties", "pos_inf"]),
    temperature=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_garbage_drafts_never_change_what_is_emitted(
    batch, vocab, depth, topk, frac, mode, kind, temperature, seed
):
    topk = min(topk, vocab)
    gen = torch.Generator().manual_seed(seed)
    num_nodes = max(1, round(frac * pool_size(depth, topk)))

    def step(tokens, prev_slots, level):
        return garbage_logits(gen, (*tokens.shape, vocab), kind)

    tree = build_dynamic_tree(
        garbage_logits(gen, (batch, vocab), kind),
        step,
        depth=depth,
        topk=topk,
        num_nodes=num_nodes,
        mode=mode,
    )
    n = tree.num_nodes
    assert ((tree.parents == -1) | ((tree.parents >= 0) & (tree.parents < torch.arange(n)))).all()
    assert ((tree.tokens >= 0) & (tree.tokens < vocab)).all()
    logits = torch.randn(batch, n + 1, vocab, generator=gen)
    result = verify_tree(tree.tokens, tree.parents, logits, temperature=torch.full((batch,), temperature))
    for b in range(batch):
        k = int(result.num_accepted[b])
        emitted = result.output_tokens[b, : k + 1].tolist()
        if temperature == 0.0:
            assert emitted == target_path(tree.tokens[b].tolist(), tree.parents[b].tolist(), logits[b])
        assert all(0 <= t < vocab for t in emitted)


def test_nan_draft_rows_fall_back_to_the_targets_token():
    tokens = torch.tensor([[5, 6, 7]])
    parents = torch.tensor([[-1, 0, 1]])
    logits = torch.full((1, 4, 10), -1.0)
    logits[0, 0, 3] = 5.0  # the target wants 3 first: no draft matches
    result = verify_tree(tokens, parents, logits)
    assert result.output_tokens[0].tolist() == [3, -1, -1, -1]
    assert int(result.num_accepted[0]) == 0
