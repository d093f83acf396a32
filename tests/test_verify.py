"""Tree verification: greedy against a loop reference, sampling checked for losslessness."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from vllm_eagle2.verify import (
    apply_top_k_top_p,
    target_probs,
    verify_greedy,
    verify_sampling,
    verify_tree,
)


def random_tree(n: int, vocab: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Parents-first random tree with distinct sibling tokens."""
    parents, tokens, used = [], [], {}
    for i in range(n):
        parent = rng.randrange(-1, i)
        free = [t for t in range(vocab) if t not in used.setdefault(parent, set())]
        if not free:
            parent, free = -1, [t for t in range(vocab) if t not in used[-1]] or list(range(vocab))
        tok = rng.choice(free)
        used.setdefault(parent, set()).add(tok)
        parents.append(parent)
        tokens.append(tok)
    return tokens, parents


def children_of(parents: list[int], node: int) -> list[int]:
    return [i for i, p in enumerate(parents) if p == node]


def greedy_reference(tokens, parents, logits):
    """Walk down from the root while some child carries the target's argmax."""
    node, path = -1, []
    while True:
        want = int(logits[node + 1].argmax())
        nxt = [c for c in children_of(parents, node) if tokens[c] == want]
        if not nxt:
            return path, [tokens[i] for i in path] + [want]
        node = nxt[0]
        path.append(node)


def planted_logits(tokens, parents, vocab, rng, gen, hit_rate=0.7):
    """Random logits where the target's argmax follows some child ``hit_rate`` of the time."""
    logits = torch.randn(len(tokens) + 1, vocab, generator=gen)
    for node in [-1] + list(range(len(tokens))):
        kids = children_of(parents, node)
        if kids and rng.random() < hit_rate:
            logits[node + 1, tokens[rng.choice(kids)]] = 10.0
    return logits


def test_greedy_matches_loop_reference_on_random_trees():
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    batch, n, vocab = 64, 20, 12
    trees = [random_tree(n, vocab, rng) for _ in range(batch)]
    tokens = torch.tensor([t for t, _ in trees])
    parents = torch.tensor([p for _, p in trees])
    logits = torch.stack([planted_logits(t, p, vocab, rng, gen) for t, p in trees])
    result = verify_greedy(tokens, parents, logits)
    depths = []
    for b, (tok, par) in enumerate(trees):
        path, out = greedy_reference(tok, par, logits[b])
        k = len(path)
        depths.append(k)
        assert int(result.num_accepted[b]) == k
        assert result.accepted_nodes[b, :k].tolist() == path
        assert (result.accepted_nodes[b, k:] == -1).all()
        assert result.output_tokens[b, : k + 1].tolist() == out
        assert (result.output_tokens[b, k + 1 :] == -1).all()
    assert max(depths) >= 3 and min(depths) == 0  # the test exercised deep and empty paths


def test_greedy_padding_nodes_are_never_accepted():
    tokens = torch.tensor([[3, -1, 4]])
    parents = torch.tensor([[-1, 0, 0]])
    logits = torch.zeros(1, 4, 8)
    logits[0, 0, 3] = logits[0, 1, 4] = 1.0  # root -> 3 -> 4 is the target's path
    logits[0, 2, 5] = 1.0
    result = verify_greedy(tokens, parents, logits)
    assert result.output_tokens[0].tolist() == [3, 4, 0]
    assert result.accepted_nodes[0].tolist() == [0, 2]


def test_verify_rejects_bad_shapes():
    with pytest.raises(ValueError, match="target_logits"):
        verify_greedy(
            torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5)
        )
    with pytest.raises(ValueError, match="parents"):
        verify_greedy(
            torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, 5)
        )


# ---------------------------------------------------------------------------------------
# Sampling: the emitted tokens must be distributed exactly as the target alone would give.
# A fixed tree, fixed target distributions at every node, and many independent draws in
# one batch; each conditional distribution of the k-th emitted token given the first
# k - 1 is compared with the target's by a chi-square test.

VOCAB = 5
# node:          0  1  2  3  4  5  6
TREE_TOKENS = [0, 1, 2, 1, 3, 0, 4]
TREE_PARENTS = [-1, -1, -1, 0, 0, 1, 3]
DRAWS = 30_000


def target_table() -> torch.Tensor:
    """Target distribution [N + 1, V] at the root and every node, most mass on the tree."""
    return torch.tensor(
        [
            [0.40, 0.30, 0.10, 0.15, 0.05],  # root: children 0, 1, 2
            [0.10, 0.50, 0.10, 0.20, 0.10],  # node 0: children 1, 3
            [0.60, 0.10, 0.10, 0.10, 0.10],  # node 1: child 0
            [0.20, 0.20, 0.00, 0.30, 0.30],  # node 2: leaf, token 2 impossible
            [0.10, 0.10, 0.10, 0.20, 0.50],  # node 3: child 4
            [0.20, 0.20, 0.20, 0.20, 0.20],  # node 4: leaf
            [0.10, 0.20, 0.30, 0.20, 0.20],  # node 5: leaf
            [0.30, 0.30, 0.20, 0.10, 0.10],  # node 6: leaf
        ]
    )


def node_of_path(prefix: tuple[int, ...]) -> int | None:
    node = -1
    for tok in prefix:
        kids = [c for c in children_of(TREE_PARENTS, node) if TREE_TOKENS[c] == tok]
        if not kids:
            return None
        node = kids[0]
    return node


def lossless_pvalues(outputs: list[list[int]], probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Chi-square p-value of the next emitted token for every tree prefix seen often enough."""
    counts: dict[tuple[int, ...], list[int]] = {}
    for seq in outputs:
        for k in range(len(seq)):
            prefix = tuple(seq[:k])
            counts.setdefault(prefix, [0] * VOCAB)[seq[k]] += 1
    pvalues = {}
    for prefix, obs in counts.items():
        node = node_of_path(prefix)
        assert node is not None, f"emitted a continuation of {prefix}, which is not in the tree"
        total = sum(obs)
        if total < 2000:
            continue
        row = probs[node + 1].double()
        expected = row / row.sum() * total
        support = expected > 0
        assert all(o == 0 for o, s in zip(obs, support.tolist()) if not s), "zero-probability token emitted"
        obs_t = torch.tensor(obs, dtype=torch.float64)[support]
        pvalues[prefix] = float(chisquare(obs_t.numpy(), expected[support].numpy()).pvalue)
    return pvalues


def sequential_sampler(probs: torch.Tensor, rng: random.Random, *, bug: str | None = None) -> list[int]:
    """Textbook recursive rejection sampling, one request, written as loops.

    bug = "no_renorm": accept sibling x with probability p(x) without renormalising after
          earlier rejections; bug = "keep_rejected": on total rejection sample from p
          itself, rejected children included.
    """
    node, out = -1, []
    while True:
        p = probs[node + 1].tolist()
        accepted = None
        for child in children_of(TREE_PARENTS, node):
            x = TREE_TOKENS[child]
            mass = sum(p)
            accept_prob = p[x] if bug == "no_renorm" else (p[x] / mass if mass > 0 else 0.0)
            if rng.random() < accept_prob:
                accepted = child
                break
            if bug != "keep_rejected":
                p[x] = 0.0
        if accepted is None:
            out.append(rng.choices(range(VOCAB), weights=p)[0])
            return out
        out.append(TREE_TOKENS[accepted])
        node = accepted


def fast_outputs(probs: torch.Tensor, seed: int) -> list[list[int]]:
    tokens = torch.tensor([TREE_TOKENS] * DRAWS)
    parents = torch.tensor([TREE_PARENTS] * DRAWS)
    result = verify_sampling(
        tokens, parents, probs.expand(DRAWS, -1, -1), generator=torch.Generator().manual_seed(seed)
    )
    n_out = result.num_accepted + 1
    # Accepted nodes must form a connected path and carry the emitted tokens.
    for b in range(0, DRAWS, 997):
        nodes = result.accepted_nodes[b, : int(result.num_accepted[b])].tolist()
        assert [TREE_PARENTS[n] for n in nodes] == ([-1] + nodes)[: len(nodes)]
        assert [TREE_TOKENS[n] for n in nodes] == result.output_tokens[b, : len(nodes)].tolist()
    return [row[: int(k)] for row, k in zip(result.output_tokens.tolist(), n_out)]


@pytest.fixture(scope="module")
def probs() -> torch.Tensor:
    return target_table()


def test_sampling_verifier_is_lossless(probs):
    pvalues = lossless_pvalues(fast_outputs(probs, seed=1), probs)
    assert len(pvalues) == 8  # every node's prefix was seen often enough
    assert min(pvalues.values()) > 1e-3, pvalues


def test_loop_reference_sampler_is_lossless(probs):
    rng = random.Random(2)
    pvalues = lossless_pvalues([sequential_sampler(probs, rng) for _ in range(DRAWS)], probs)
    assert min(pvalues.values()) > 1e-3, pvalues


@pytest.mark.parametrize("bug", ["no_renorm", "keep_rejected"])
def test_biased_verifiers_fail_the_same_test(probs, bug):
    rng = random.Random(3)
    pvalues = lossless_pvalues([sequential_sampler(probs, rng, bug=bug) for _ in range(DRAWS)], probs)
    assert min(pvalues.values()) < 1e-6, pvalues


def test_seeded_rows_are_reproducible_and_independent_of_batch(probs):
    tokens = torch.tensor([TREE_TOKENS] * 6)
    parents = torch.tensor([TREE_PARENTS] * 6)
    batch = probs.expand(6, -1, -1)
    runs = [
        verify_sampling(
            tokens,
            parents,
            batch,
            generators={2: torch.Generator().manual_seed(42), 4: torch.Generator().manual_seed(7)},
        )
        for _ in range(2)
    ]
    alone = verify_sampling(
        tokens[:1], parents[:1], batch[:1], generators={0: torch.Generator().manual_seed(42)}
    )
    assert torch.equal(runs[0].output_tokens[[2, 4]], runs[1].output_tokens[[2, 4]])
    assert torch.equal(runs[0].output_tokens[2], alone.output_tokens[0])


def test_top_k_top_p_match_vllm_sampler():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1, 50, generator=gen)
    logits[1, 0, :10] = 2.0  # ties at the top-k threshold
    k = torch.tensor([5, 12, 50, 1])
    p = torch.tensor([0.9, 0.5, 1.0, 0.3])
    ours = apply_top_k_top_p(logits, k, p)
    theirs = apply_top_k_top_p_pytorch(logits[:, 0].clone(), k, p)
    assert torch.equal(torch.isinf(ours[:, 0]), torch.isinf(theirs))


def test_verify_tree_mixes_greedy_and_sampled_rows(probs):
    tokens = torch.tensor([TREE_TOKENS] * 4)
    parents = torch.tensor([TREE_PARENTS] * 4)
    # Break the table's ties so that top-k = 1 leaves exactly one token.
    logits = (probs.log() + 1e-3 * torch.arange(VOCAB)).expand(4, -1, -1).clone()
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0])
    mixed = verify_tree(
        tokens,
        parents,
        logits,
        temperature=temperature,
        top_k=torch.tensor([0, 1, 0, 1]),
        top_p=torch.tensor([1.0, 1.0, 1.0, 1.0]),
    )
    greedy = verify_greedy(tokens, parents, logits)
    assert torch.equal(mixed.output_tokens[[0, 2]], greedy.output_tokens[[0, 2]])
    # top_k = 1 at temperature 1 is greedy too, whatever the random draws.
    assert torch.equal(mixed.output_tokens[[1, 3]], greedy.output_tokens[[1, 3]])


def test_target_probs_apply_temperature():
    logits = torch.tensor([[[0.0, 1.0, 2.0]]])
    probs = target_probs(logits, torch.tensor([0.5]))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1))


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 24),
    vocab=st.integers(2, 9),
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
)
def test_accepted_paths_are_connected_and_emit_their_tokens(n, vocab, seed, temperature):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    trees = [random_tree(n, vocab, rng) for _ in range(3)]
    tokens = torch.tensor([t for t, _ in trees])
    parents = torch.tensor([p for _, p in trees])
    logits = torch.stack([planted_logits(t, p, vocab, rng, gen, 0.8) for t, p in trees])
    result = verify_tree(tokens, parents, logits, temperature=torch.full((3,), temperature))
    for b in range(3):
        k = int(result.num_accepted[b])
        nodes = result.accepted_nodes[b, :k].tolist()
        assert [trees[b][1][i] for i in nodes] == ([-1] + nodes)[: len(nodes)]
        assert result.output_tokens[b, :k].tolist() == [trees[b][0][i] for i in nodes]
        assert 0 <= int(result.output_tokens[b, k]) < vocab
        assert (result.output_tokens[b, k + 1 :] == -1).all()


def test_a_seeded_row_draws_the_same_numbers_whatever_the_batch(probs):
    alone = verify_sampling(
        torch.tensor([TREE_TOKENS]),
        torch.tensor([TREE_PARENTS]),
        probs.unsqueeze(0),
        generators={0: torch.Generator().manual_seed(5)},
    )
    # The same request next to a deeper tree and with padding nodes appended.
    deep_tokens = [0, 1, 2, 3, 4, 0, 1, -1]
    deep_parents = [-1, 0, 1, 2, 3, 4, 5, -1]
    mixed = verify_sampling(
        torch.tensor([deep_tokens, TREE_TOKENS + [-1]]),
        torch.tensor([deep_parents, TREE_PARENTS + [-1]]),
        torch.cat([probs, probs[:1]]).unsqueeze(0).expand(2, -1, -1),
        generators={1: torch.Generator().manual_seed(5)},
    )
    k = int(alone.num_accepted[0])
    assert mixed.output_tokens[1, : k + 1].tolist() == alone.output_tokens[0, : k + 1].tolist()
