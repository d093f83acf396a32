"""Dynamic draft-tree construction against a plain loop reference written for the tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_eagle2.tree import TREE_MODES, build_dynamic_tree, pool_size, tree_size


def node_logprobs(path: tuple[int, ...], vocab: int, seed: int, sharp: float = 3.0) -> torch.Tensor:
    """Draft log-probs [V] after the token path ``path``: deterministic in (path, seed)."""
    gen = torch.Generator().manual_seed(hash((seed,) + path) % (2**31))
    return (torch.randn(vocab, generator=gen) * sharp).log_softmax(-1)


class PathDraft:
    """A draft_step whose output depends on each frontier node's full token path."""

    def __init__(self, root_paths: list[tuple[int, ...]], vocab: int, seed: int, fn=node_logprobs):
        self.vocab, self.seed, self.fn = vocab, seed, fn
        self.paths: list[list[tuple[int, ...]]] | None = None
        self.root_paths = root_paths
        self.calls: list[int] = []

    def root_logprobs(self) -> torch.Tensor:
        return torch.stack([self.fn(p, self.vocab, self.seed) for p in self.root_paths])

    def __call__(self, tokens: torch.Tensor, prev_slots: torch.Tensor, level: int) -> torch.Tensor:
        self.calls.append(level)
        batch, k = tokens.shape
        prev = self.paths or [[root] * k for root in self.root_paths]
        self.paths = [
            [prev[b][int(prev_slots[b, j])] + (int(tokens[b, j]),) for j in range(k)] for b in range(batch)
        ]
        return torch.stack(
            [torch.stack([self.fn(p, self.vocab, self.seed) for p in row]) for row in self.paths]
        )


def reference_tree(root_path, vocab, seed, depth, topk, num_tokens, mode, fn=node_logprobs):
    """One request's tree, node by node, straight from the definition."""
    if mode == "chain":
        depth, topk = min(depth, num_tokens), 1
        num_tokens = depth
    f32 = torch.float32
    nodes = []  # dict(path, token, parent, depth, value, key, frontier)

    def children(parent_id):
        parent = nodes[parent_id] if parent_id >= 0 else None
        path = parent["path"] if parent else root_path
        lp = fn(path, vocab, seed)
        order = sorted(range(vocab), key=lambda t: -float(lp[t]))[:topk]
        out = []
        for rank, tok in enumerate(order):
            own = lp[tok].to(f32)
            pv = parent["value"] if parent else torch.tensor(0.0, dtype=f32)
            pk = parent["key"] if parent else torch.tensor(0.0, dtype=f32)
            if mode == "static":
                key = pk + torch.tensor(-0.5 - 1.5 * rank, dtype=f32)
            elif mode == "no_value":
                key = torch.minimum(pk, own)
            else:
                key = pv + own
            out.append(
                dict(
                    path=path + (tok,),
                    token=tok,
                    parent=parent_id,
                    depth=(parent["depth"] + 1) if parent else 1,
                    value=pv + own,
                    key=key,
                    frontier=False,
                )
            )
        return out

    def best(ids, k):
        return sorted(ids, key=lambda i: (-float(nodes[i]["key"]), i))[:k]

    level_ids = []
    for node in children(-1):
        nodes.append(node)
        level_ids.append(len(nodes) - 1)
    frontier = best(level_ids, topk)
    for i in frontier:
        nodes[i]["frontier"] = True
    for _ in range(2, depth + 1):
        level_ids = []
        for parent_id in frontier:
            for node in children(parent_id):
                nodes.append(node)
                level_ids.append(len(nodes) - 1)
        frontier = best(level_ids, topk)
        for i in frontier:
            nodes[i]["frontier"] = True
    if mode == "no_rerank":
        front = [i for i, n in enumerate(nodes) if n["frontier"]]
        rest = sorted(
            (i for i, n in enumerate(nodes) if not n["frontier"]),
            key=lambda i: (-float(nodes[i]["value"]), i),
        )
        kept = sorted((front + rest)[:num_tokens])
    else:
        kept = sorted(best(range(len(nodes)), num_tokens))
    where = {pool_id: pos for pos, pool_id in enumerate(kept)}
    return (
        [nodes[i]["token"] for i in kept],
        [where[nodes[i]["parent"]] if nodes[i]["parent"] >= 0 else -1 for i in kept],
        [nodes[i]["depth"] for i in kept],
        [float(nodes[i]["value"]) for i in kept],
    )


def run_fast(batch, vocab, seed, depth, topk, num_tokens, mode, fn=node_logprobs):
    draft = PathDraft([(1000 + b,) for b in range(batch)], vocab, seed, fn)
    tree = build_dynamic_tree(
        draft.root_logprobs(), draft, depth=depth, topk=topk, num_tokens=num_tokens, mode=mode
    )
    return tree, draft


def assert_is_tree(tree):
    n = tree.num_nodes
    idx = torch.arange(n)
    assert ((tree.parents == -1) | ((tree.parents >= 0) & (tree.parents < idx))).all()
    parent_depth = torch.where(tree.parents >= 0, tree.depths.gather(1, tree.parents.clamp(min=0)), 0)
    assert torch.equal(tree.depths, parent_depth + 1)


@pytest.mark.parametrize("mode", TREE_MODES)
@pytest.mark.parametrize(
    ("depth", "topk", "num_tokens"),
    [(6, 10, 60), (4, 3, 12), (3, 4, 36), (1, 5, 3), (2, 1, 2), (5, 2, 7), (3, 3, 21)],
)
def test_tree_matches_loop_reference(mode, depth, topk, num_tokens):
    vocab, seed, batch = 64, 7, 3
    tree, draft = run_fast(batch, vocab, seed, depth, topk, num_tokens, mode)
    assert tree.tokens.shape == (batch, tree_size(mode, depth, topk, num_tokens))
    for b in range(batch):
        tokens, parents, depths, scores = reference_tree(
            (1000 + b,), vocab, seed, depth, topk, num_tokens, mode
        )
        assert tree.tokens[b].tolist() == tokens
        assert tree.parents[b].tolist() == parents
        assert tree.depths[b].tolist() == depths
        assert tree.scores[b].tolist() == pytest.approx(scores, abs=1e-6)
    assert_is_tree(tree)


def test_draft_step_called_once_per_level_after_the_first():
    _, draft = run_fast(2, 32, 0, depth=6, topk=4, num_tokens=20, mode="dynamic")
    assert draft.calls == [2, 3, 4, 5, 6]


def test_chain_is_the_top1_path_and_stops_at_num_tokens():
    tree, draft = run_fast(2, 32, 0, depth=6, topk=4, num_tokens=3, mode="chain")
    assert draft.calls == [2, 3]
    assert tree.parents.tolist() == [[-1, 0, 1]] * 2


def test_each_row_grows_its_own_tree():
    tree, _ = run_fast(4, 64, 3, depth=4, topk=3, num_tokens=15, mode="dynamic")
    shapes = {tuple(tree.parents[b].tolist()) for b in range(4)}
    assert len(shapes) > 1


def test_static_shape_does_not_depend_on_the_draft():
    a, _ = run_fast(3, 64, 1, depth=5, topk=4, num_tokens=25, mode="static")
    b, _ = run_fast(3, 64, 2, depth=5, topk=4, num_tokens=25, mode="static")
    assert torch.equal(a.parents, b.parents) and torch.equal(a.depths, b.depths)
    assert (a.parents == a.parents[0]).all()


def one_hot_logprobs(path, vocab, seed):
    """Probability-1 children everywhere: every node's value equals its parent's."""
    lp = torch.full((vocab,), -math.inf)
    lp[(sum(path) + seed) % vocab] = 0.0
    return lp


def tied_logprobs(path, vocab, seed):
    """Uniform draft: every candidate of a level ties with every other."""
    return torch.full((vocab,), -math.log(vocab))


@pytest.mark.parametrize("fn", [one_hot_logprobs, tied_logprobs], ids=["prob1", "ties"])
@pytest.mark.parametrize("mode", TREE_MODES)
@pytest.mark.parametrize(("depth", "topk", "num_tokens"), [(4, 3, 30), (4, 3, 5), (3, 2, 10), (1, 1, 1)])
def test_adversarial_inputs_still_give_ancestor_closed_trees(fn, mode, depth, topk, num_tokens):
    tree, _ = run_fast(2, 16, 0, depth, topk, num_tokens, mode, fn=fn)
    assert_is_tree(tree)
    # Ties go to the shallower node: depths never decrease along the kept order.
    assert (tree.depths[:, 1:] >= tree.depths[:, :-1]).all()


def test_num_tokens_equal_to_pool_keeps_every_node():
    depth, topk = 3, 3
    tree, _ = run_fast(2, 32, 5, depth, topk, pool_size(depth, topk), "dynamic")
    assert tree.num_nodes == 21
    assert (tree.depths == 1).sum(1).tolist() == [3, 3]
    assert (tree.depths == 3).sum(1).tolist() == [9, 9]


def test_nan_in_draft_logits_is_never_preferred():
    def nan_logprobs(path, vocab, seed):
        lp = node_logprobs(path, vocab, seed)
        lp[: vocab // 2] = math.nan
        return lp

    tree, _ = run_fast(2, 32, 0, 3, 4, 12, "dynamic", fn=nan_logprobs)
    assert (tree.tokens >= 16).all() and torch.isfinite(tree.scores).all()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(depth=0, topk=2, num_tokens=2), "depth"),
        (dict(depth=2, topk=0, num_tokens=2), "topk"),
        (dict(depth=2, topk=2, num_tokens=0), "num_tokens"),
        (dict(depth=2, topk=2, num_tokens=7), "num_tokens"),
        (dict(depth=2, topk=2, num_tokens=2, mode="wide"), "mode"),
        (dict(depth=2, topk=20, num_tokens=2), "topk"),
        (dict(depth=2.5, topk=2, num_tokens=2), "depth"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        build_dynamic_tree(torch.zeros(1, 16).log_softmax(-1), lambda *a: None, **kwargs)


def test_shape_mismatches_raise_value_error():
    with pytest.raises(ValueError, match="root_logprobs"):
        build_dynamic_tree(torch.zeros(16), lambda *a: None, depth=1, topk=2, num_tokens=2)
    with pytest.raises(ValueError, match="draft_step"):
        build_dynamic_tree(
            torch.zeros(1, 16), lambda t, s, lvl: torch.zeros(1, 2, 8), depth=2, topk=2, num_tokens=2
        )


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    depth=st.integers(1, 5),
    topk=st.integers(1, 4),
    frac=st.floats(0.0, 1.0),
    mode=st.sampled_from(TREE_MODES),
    seed=st.integers(0, 10_000),
)
def test_random_settings_give_trees_with_parents_first(batch, depth, topk, frac, mode, seed):
    num_tokens = max(1, round(frac * pool_size(depth, topk)))
    tree, _ = run_fast(batch, 24, seed, depth, topk, num_tokens, mode)
    assert_is_tree(tree)
    assert tree.tokens.shape == (batch, tree_size(mode, depth, topk, num_tokens))
    # A node's value is its parent's plus a log-prob <= 0.
    parent_score = torch.where(tree.parents >= 0, tree.scores.gather(1, tree.parents.clamp(min=0)), 0.0)
    assert (tree.scores <= parent_score + 1e-6).all()
