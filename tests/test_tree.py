"""Dynamic draft-tree construction against a plain loop reference written for the tests."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from aten_ops import AtenOps
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_eagle2.tree import TREE_MODES, build_dynamic_tree, pool_size, tree_size


def node_logits(path: tuple[int, ...], vocab: int, seed: int, sharp: float = 3.0) -> torch.Tensor:
    """Draft logits [V] after the token path ``path``: deterministic in (path, seed)."""
    gen = torch.Generator().manual_seed(hash((seed,) + path) % (2**31))
    return torch.randn(vocab, generator=gen) * sharp


class PathDraft:
    """A draft_step whose output depends on each frontier node's full token path."""

    def __init__(self, root_paths: list[tuple[int, ...]], vocab: int, seed: int, fn=node_logits):
        self.vocab, self.seed, self.fn = vocab, seed, fn
        self.paths: list[list[tuple[int, ...]]] | None = None
        self.root_paths = root_paths
        self.calls: list[int] = []

    def root_logits(self) -> torch.Tensor:
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


def reference_tree(root_path, vocab, seed, depth, topk, num_nodes, mode, fn=node_logits):
    """One request's tree, node by node, straight from the definition."""
    if mode == "chain":
        depth, topk = min(depth, num_nodes), 1
        num_nodes = depth
    f32 = torch.float32
    nodes = []  # dict(path, token, parent, depth, value, key, frontier)

    def children(parent_id):
        parent = nodes[parent_id] if parent_id >= 0 else None
        path = parent["path"] if parent else root_path
        logits = fn(path, vocab, seed)
        lp = logits - logits.logsumexp(-1, keepdim=True)  # the log-softmax, as vocab_topk forms it
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
                    rank=rank,
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
        kept = (front + rest)[:num_nodes]  # frontier nodes in drafting order, then by value
    else:
        kept = best(range(len(nodes)), num_nodes)  # best first
    where = {pool_id: pos for pos, pool_id in enumerate(kept)}
    return (
        [nodes[i]["token"] for i in kept],
        [where[nodes[i]["parent"]] if nodes[i]["parent"] >= 0 else -1 for i in kept],
        [nodes[i]["depth"] for i in kept],
        [nodes[i]["rank"] for i in kept],
        [float(nodes[i]["value"]) for i in kept],
    )


def run_fast(batch, vocab, seed, depth, topk, num_nodes, mode, fn=node_logits):
    draft = PathDraft([(1000 + b,) for b in range(batch)], vocab, seed, fn)
    tree = build_dynamic_tree(
        draft.root_logits(), draft, depth=depth, topk=topk, num_nodes=num_nodes, mode=mode
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
    ("depth", "topk", "num_nodes"),
    [(6, 10, 60), (4, 3, 12), (3, 4, 36), (1, 5, 3), (2, 1, 2), (5, 2, 7), (3, 3, 21)],
)
def test_tree_matches_loop_reference(mode, depth, topk, num_nodes):
    vocab, seed, batch = 64, 7, 3
    tree, draft = run_fast(batch, vocab, seed, depth, topk, num_nodes, mode)
    assert tree.tokens.shape == (batch, tree_size(mode, depth, topk, num_nodes))
    for b in range(batch):
        tokens, parents, depths, ranks, scores = reference_tree(
            (1000 + b,), vocab, seed, depth, topk, num_nodes, mode
        )
        assert tree.tokens[b].tolist() == tokens
        assert tree.parents[b].tolist() == parents
        assert tree.depths[b].tolist() == depths
        assert tree.ranks[b].tolist() == ranks
        assert tree.scores[b].tolist() == pytest.approx(scores, abs=1e-6)
    assert_is_tree(tree)


def test_draft_step_called_once_per_level_after_the_first():
    _, draft = run_fast(2, 32, 0, depth=6, topk=4, num_nodes=20, mode="dynamic")
    assert draft.calls == [2, 3, 4, 5, 6]


def test_chain_is_the_top1_path_and_stops_at_num_tokens():
    tree, draft = run_fast(2, 32, 0, depth=6, topk=4, num_nodes=3, mode="chain")
    assert draft.calls == [2, 3]
    assert tree.parents.tolist() == [[-1, 0, 1]] * 2


def test_each_row_grows_its_own_tree():
    tree, _ = run_fast(4, 64, 3, depth=4, topk=3, num_nodes=15, mode="dynamic")
    shapes = {tuple(tree.parents[b].tolist()) for b in range(4)}
    assert len(shapes) > 1


def test_static_shape_does_not_depend_on_the_draft():
    a, _ = run_fast(3, 64, 1, depth=5, topk=4, num_nodes=25, mode="static")
    b, _ = run_fast(3, 64, 2, depth=5, topk=4, num_nodes=25, mode="static")
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
@pytest.mark.parametrize(("depth", "topk", "num_nodes"), [(4, 3, 30), (4, 3, 5), (3, 2, 10), (1, 1, 1)])
def test_adversarial_inputs_still_give_ancestor_closed_trees(fn, mode, depth, topk, num_nodes):
    tree, _ = run_fast(2, 16, 0, depth, topk, num_nodes, mode, fn=fn)
    assert_is_tree(tree)
    if mode in ("dynamic", "chain"):
        # Best first: path values never increase along the kept order.
        assert (tree.scores[:, 1:] <= tree.scores[:, :-1]).all()


@pytest.mark.parametrize("mode", TREE_MODES)
def test_every_prefix_is_the_best_tree_of_its_size(mode):
    # What lets a budget cut each request's tree anywhere: the first n nodes of the m-node tree
    # are exactly the n-node tree.
    depth, topk, m = 4, 3, 20
    full, _ = run_fast(3, 64, 11, depth, topk, m, mode)
    for n in range(1, m + 1):
        part, _ = run_fast(3, 64, 11, depth, topk, n, mode)
        size = part.num_nodes
        for name in ("tokens", "parents", "depths", "ranks", "scores"):
            assert torch.equal(getattr(part, name), getattr(full, name)[:, :size]), (n, name)


def test_num_tokens_equal_to_pool_keeps_every_node():
    depth, topk = 3, 3
    tree, _ = run_fast(2, 32, 5, depth, topk, pool_size(depth, topk), "dynamic")
    assert tree.num_nodes == 21
    assert (tree.depths == 1).sum(1).tolist() == [3, 3]
    assert (tree.depths == 3).sum(1).tolist() == [9, 9]


def test_nan_in_draft_logits_is_never_preferred():
    def nan_logprobs(path, vocab, seed):
        lp = node_logits(path, vocab, seed)
        lp[: vocab // 2] = math.nan
        return lp

    tree, _ = run_fast(2, 32, 0, 3, 4, 12, "dynamic", fn=nan_logprobs)
    assert (tree.tokens >= 16).all() and torch.isfinite(tree.scores).all()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(depth=0, topk=2, num_nodes=2), "depth"),
        (dict(depth=2, topk=0, num_nodes=2), "topk"),
        (dict(depth=2, topk=2, num_nodes=0), "num_nodes"),
        (dict(depth=2, topk=2, num_nodes=7), "num_nodes"),
        (dict(depth=2, topk=2, num_nodes=2, mode="wide"), "mode"),
        (dict(depth=2, topk=20, num_nodes=2), "topk"),
        (dict(depth=2.5, topk=2, num_nodes=2), "depth"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        build_dynamic_tree(torch.zeros(1, 16).log_softmax(-1), lambda *a: None, **kwargs)


def test_shape_mismatches_raise_value_error():
    with pytest.raises(ValueError, match="root_logits"):
        build_dynamic_tree(torch.zeros(16), lambda *a: None, depth=1, topk=2, num_nodes=2)
    with pytest.raises(ValueError, match="draft_step"):
        build_dynamic_tree(
            torch.zeros(1, 16), lambda t, s, lvl: torch.zeros(1, 2, 8), depth=2, topk=2, num_nodes=2
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
    num_nodes = max(1, round(frac * pool_size(depth, topk)))
    tree, _ = run_fast(batch, 24, seed, depth, topk, num_nodes, mode)
    assert_is_tree(tree)
    assert tree.tokens.shape == (batch, tree_size(mode, depth, topk, num_nodes))
    # A node's value is its parent's plus a log-prob <= 0.
    parent_score = torch.where(tree.parents >= 0, tree.scores.gather(1, tree.parents.clamp(min=0)), 0.0)
    assert (tree.scores <= parent_score + 1e-6).all()


# --- Golden equality with the implementation before vocab_topk ----------------------------
# tests/data/tree_golden.pt holds the trees that build_dynamic_tree gave (before it took
# logits and used vocab_topk) on the inputs below: float32 log-probs (log_softmax of
# seeded randn), all modes, batch 1-5, V 50-500.
GOLDEN = Path(__file__).parent / "data" / "tree_golden.pt"


def golden_inputs(seed: int, batch: int, vocab: int):
    gen = torch.Generator().manual_seed(seed)
    root = (torch.randn(batch, vocab, generator=gen) * 3).log_softmax(-1)
    table = torch.randn(4, vocab, vocab, generator=gen) * 3  # [level % 4, token, V]

    def step(tokens, prev_slots, level):
        # Depends on each frontier token, its parent's slot and the level.
        return (table[level % 4][tokens] + 0.25 * prev_slots.unsqueeze(-1).float()).log_softmax(-1)

    return root, step


def tree_nodes(tokens, parents, scores, b: int) -> dict[tuple[int, ...], float]:
    """Request b's tree as {token path from the root: value}, whatever the node order."""
    paths: list[tuple[int, ...]] = []
    for t, p in zip(tokens[b].tolist(), parents[b].tolist()):
        paths.append((paths[p] if p >= 0 else ()) + (t,))
    return dict(zip(paths, scores[b].tolist()))


@pytest.mark.parametrize("case", torch.load(GOLDEN), ids=lambda c: f"{c['mode']}-{c['seed']}")
def test_tree_equals_the_pre_vocab_topk_golden_trees(case):
    # The golden trees are in level order, ours best first: the same nodes, reordered.
    root, step = golden_inputs(case["seed"], case["batch"], case["vocab"])
    tree = build_dynamic_tree(
        root, step, depth=case["depth"], topk=case["topk"], num_nodes=case["num_tokens"], mode=case["mode"]
    )
    for b in range(case["batch"]):
        ours = tree_nodes(tree.tokens, tree.parents, tree.scores, b)
        golden = tree_nodes(case["tokens"], case["parents"], case["scores"], b)
        assert ours.keys() == golden.keys()
        assert [ours[k] for k in golden] == pytest.approx(list(golden.values()), abs=1e-5)


def test_low_precision_logits_give_the_tree_of_their_float32_values():
    gen = torch.Generator().manual_seed(0)
    root = (torch.randn(2, 300, generator=gen) * 3).bfloat16()
    levels = [(torch.randn(2, 4, 300, generator=gen) * 3).bfloat16() for _ in range(3)]
    trees = [
        build_dynamic_tree(
            root.to(dtype),
            lambda tokens, prev_slots, level, dtype=dtype: levels[level - 2].to(dtype),
            depth=4,
            topk=4,
            num_nodes=20,
        )
        for dtype in (torch.bfloat16, torch.float32)
    ]
    assert torch.equal(trees[0].parents, trees[1].parents) and torch.equal(trees[0].scores, trees[1].scores)


# --- Sync-free and cheap: what makes the build CUDA-graph capturable and fast --------------


@pytest.mark.parametrize("mode", TREE_MODES)
def test_tree_build_has_no_host_sync(mode):
    # Meta tensors have no data: .item(), bool(t), .tolist(), nonzero and boolean-mask
    # indexing all raise on them, so any data-dependent host read fails this test.
    meta = torch.device("meta")
    batch, vocab = 3, 50

    def step(tokens, prev_slots, level):
        return torch.empty(batch, tokens.shape[1], vocab, dtype=torch.bfloat16, device=meta)

    tree = build_dynamic_tree(
        torch.empty(batch, vocab, device=meta), step, depth=4, topk=3, num_nodes=10, mode=mode
    )
    n = tree_size(mode, 4, 3, 10)
    for field in (tree.tokens, tree.parents, tree.depths, tree.scores):
        assert field.device == meta and field.shape == (batch, n)


def count_tree_ops(depth: int, mode: str = "dynamic", topk: int = 10, num_nodes: int = 60) -> int:
    batch, vocab = 2, 1000
    gen = torch.Generator().manual_seed(0)
    root = torch.randn(batch, vocab, generator=gen)
    width = 1 if mode == "chain" else topk
    levels = [torch.randn(batch, width, vocab, generator=gen) for _ in range(depth)]  # a list: no ops
    with torch.no_grad(), AtenOps() as counter:
        build_dynamic_tree(
            root,
            lambda tokens, prev_slots, level: levels[level - 2],
            depth=depth,
            topk=topk,
            num_nodes=min(num_nodes, pool_size(depth, topk)),
            mode=mode,
        )
    return counter.total


@pytest.mark.parametrize("mode", TREE_MODES)
def test_tree_build_launch_budget(mode):
    # Reached with the torch vocab_topk (CPU, float32 logits): per middle level 5 ops in
    # vocab_topk (nan_to_num, topk, logsumexp, clamp, sub), 5 of the tree (add, sort,
    # 2 gathers, div) and 6 views; static and no_value add a key op and its gather plus
    # 2 views; the pool's parents, depths and ranks and their gathers cost 18 ops, once (one
    # keep-best for drafted and grafted pools; 8 more than formulas on the kept nodes did).
    # Before vocab_topk: 41 ops per level
    # and 256 at depth 6, with a host sync per level. On CUDA vocab_topk is 2 Triton
    # launches instead of 5 ops.
    per_level = {"static": 20, "no_value": 20}.get(mode, 16)
    total = {"dynamic": 116, "chain": 116, "no_rerank": 132, "static": 138, "no_value": 136}[mode]
    assert count_tree_ops(6, mode) - count_tree_ops(5, mode) <= per_level
    assert count_tree_ops(6, mode) <= total
