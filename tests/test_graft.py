"""Lookup chains grafted into the dynamic tree: the tree a plain reference builds, its invariants kept,
and verified as any tree is."""

from __future__ import annotations

import random

import pytest
import torch
from test_tree import PathDraft

from vllm_eagle2.graft import LookupChains
from vllm_eagle2.tree import build_dynamic_tree, lookup_chain_tree, off_leading_chain, pool_size
from vllm_eagle2.verify import verify_tree

VOCAB, DEPTH, TOPK, LENGTH = 12, 4, 3, 5


def build(draft: PathDraft, num_nodes: int, chains: LookupChains | None):
    return build_dynamic_tree(
        draft.root_logits(), draft, depth=DEPTH, topk=TOPK, num_nodes=num_nodes, lookup=chains
    )


def paths(tree, b: int) -> list[tuple[int, ...]]:
    """Each kept node's token path from the root, in the tree's order."""
    out: list[tuple[int, ...]] = []
    for j in range(tree.num_nodes):
        parent, token = int(tree.parents[b, j]), int(tree.tokens[b, j])
        out.append((out[parent] if parent >= 0 else ()) + (token,))
    return out


def reference_graft(full, b: int, chain: list[int], values: list[float], num_nodes: int):
    """The grafted tree of request b from its whole pool ``full`` (every pool node, best first), by
    the definition: walk the chain down the drafted nodes, raise their keys, add the rest below."""
    nodes = [dict(path=p, key=float(full.scores[b, j]), grafted=False) for j, p in enumerate(paths(full, b))]
    at, at_key = (), 0.0
    for token, value in zip(chain, values):
        path = at + (token,)
        drafted = [n for n in nodes if n["path"] == path and not n["grafted"]]
        if drafted:
            drafted[0]["key"] = max(drafted[0]["key"], value)
            at_key = drafted[0]["key"]
        else:
            at_key = min(value, at_key)
            nodes.append(dict(path=path, key=at_key, grafted=True))
        at = path
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i]["key"], i))[:num_nodes]
    return [nodes[i]["path"] for i in order], [nodes[i]["grafted"] for i in order]


def random_chains(full, seed: int) -> tuple[list[list[int]], list[list[float]]]:
    """Per request: a chain that follows the head's best path for a while then leaves it, a random
    one, or none; values falling along the chain, some above the head's, some below."""
    rng = random.Random(seed)
    chains, values = [], []
    for b in range(full.tokens.shape[0]):
        kind = rng.choice(["follow", "random", "empty"])
        length = 0 if kind == "empty" else rng.randint(1, LENGTH)
        chain = [int(t) for t in paths(full, b)[rng.randrange(full.num_nodes)]] if kind == "follow" else []
        chain = (chain + [rng.randrange(VOCAB) for _ in range(LENGTH)])[:length]
        value, row = rng.uniform(-2.0, 0.0), []
        for _ in chain:
            value += rng.uniform(-1.5, 0.0)
            row.append(value)
        chains.append(chain)
        values.append(row)
    return chains, values


def as_chains(chains: list[list[int]], values: list[list[float]]) -> LookupChains:
    tokens = torch.full((len(chains), LENGTH), -1, dtype=torch.long)
    vals = torch.full((len(chains), LENGTH), float("-inf"))
    for b, (chain, row) in enumerate(zip(chains, values)):
        tokens[b, : len(chain)] = torch.tensor(chain, dtype=torch.long)
        vals[b, : len(row)] = torch.tensor(row)
    return LookupChains(tokens, vals)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_nodes", [1, 6, 20])
def test_grafted_trees_equal_a_reference_built_from_the_definition(seed, num_nodes):
    batch = 6
    roots = [(100 + b,) for b in range(batch)]
    full = build(PathDraft(roots, VOCAB, seed), pool_size(DEPTH, TOPK), None)
    chains, values = random_chains(full, seed)
    tree = build(PathDraft(roots, VOCAB, seed), num_nodes, as_chains(chains, values))
    for b in range(batch):
        want_paths, want_grafted = reference_graft(full, b, chains[b], values[b], num_nodes)
        assert paths(tree, b) == want_paths
        assert tree.grafted[b].tolist() == want_grafted


@pytest.mark.parametrize("seed", range(6))
def test_grafted_trees_keep_the_tree_invariants(seed):
    batch, num_nodes = 6, 16
    roots = [(200 + b,) for b in range(batch)]
    full = build(PathDraft(roots, VOCAB, seed), pool_size(DEPTH, TOPK), None)
    tree = build(PathDraft(roots, VOCAB, seed), num_nodes, as_chains(*random_chains(full, seed + 10)))
    assert tree.tokens.shape == tree.parents.shape == tree.scores.shape == (batch, num_nodes)
    for b in range(batch):
        for j in range(num_nodes):
            parent = int(tree.parents[b, j])
            assert -1 <= parent < j  # parents first: every prefix is an ancestor-closed tree
            assert int(tree.depths[b, j]) == (int(tree.depths[b, parent]) + 1 if parent >= 0 else 1)
        siblings = list(zip(tree.parents[b].tolist(), tree.tokens[b].tolist()))
        assert len(set(siblings)) == len(siblings)  # no two children of a node share a token
        assert bool((tree.tokens[b] >= 0).all())  # enough real nodes: no padding kept


def test_no_chains_and_empty_chains_build_the_same_tree():
    roots = [(300 + b,) for b in range(4)]
    plain = build(PathDraft(roots, VOCAB, 0), 10, None)
    empty = LookupChains(torch.full((4, LENGTH), -1), torch.full((4, LENGTH), float("-inf")))
    grafted = build(PathDraft(roots, VOCAB, 0), 10, empty)
    for name in ("tokens", "parents", "depths", "ranks", "scores"):
        assert torch.equal(getattr(plain, name), getattr(grafted, name)), name
    assert not grafted.grafted.any()


def test_a_confident_chain_is_sent_whole_beyond_the_heads_depth():
    roots = [(400,)]
    chain = [7, 3, 3, 9, 1]  # longer than DEPTH: lookup reaches where the head does not
    tree = build(PathDraft(roots, VOCAB, 0), 6, as_chains([chain], [[-0.01 * (i + 1) for i in range(5)]]))
    assert paths(tree, 0)[:5] == [tuple(chain[: i + 1]) for i in range(5)]
    assert int(tree.depths[0, 4]) == 5


def test_a_grafted_tree_verifies_as_any_tree():
    # The target's argmax follows the chain for three tokens, then says 5: greedy verification
    # accepts the three chain nodes and emits 5, wherever the head's nodes are.
    roots = [(500,)]
    chain = [7, 3, 3, 9, 1]
    tree = build(PathDraft(roots, VOCAB, 1), 8, as_chains([chain], [[-0.1 * (i + 1) for i in range(5)]]))
    logits = torch.zeros(1, tree.num_nodes + 1, VOCAB)
    path = paths(tree, 0)
    for row, prefix in enumerate([(), *path]):
        follow = prefix == tuple(chain[: len(prefix)])
        logits[0, row, chain[len(prefix)] if follow and len(prefix) < 3 else 5] = 1.0
    result = verify_tree(tree.tokens, tree.parents, logits)
    assert int(result.num_accepted[0]) == 3
    assert result.output_tokens[0, :4].tolist() == [7, 3, 3, 5]


def test_a_chain_alone_is_a_tree_of_grafted_nodes_that_verifies_as_a_chain():
    # A step whose head drafts nothing sends the chain alone (lookup_chain_tree).
    chains = as_chains([[7, 3, 3, 9], [4, 2]], [[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6]])
    tree = lookup_chain_tree(chains, 3)
    assert tree.tokens.tolist() == [[7, 3, 3], [4, 2, -1]]
    assert tree.parents.tolist() == [[-1, 0, 1]] * 2 and tree.depths.tolist() == [[1, 2, 3]] * 2
    assert tree.grafted.tolist() == [[True] * 3, [True, True, False]]
    assert tree.scores[1, 2] == float("-inf")
    assert not off_leading_chain(tree.depths).any()  # no tree mask needed
    logits = torch.zeros(2, 4, VOCAB)
    logits[0, torch.arange(4), torch.tensor([7, 3, 8, 1])] = 1.0  # accepts 7 3, then says 8
    logits[1, torch.arange(4), torch.tensor([4, 2, 6, 1])] = 1.0  # accepts 4 2, then says 6
    result = verify_tree(tree.tokens, tree.parents, logits)
    assert result.num_accepted.tolist() == [2, 2]
    assert result.output_tokens[:, :3].tolist() == [[7, 3, 8], [4, 2, 6]]
