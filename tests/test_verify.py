"""Tree verification: greedy against a loop reference, sampling checked for losslessness."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from aten_ops import AtenOps
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from vllm_eagle2.kernels import HAS_TRITON
from vllm_eagle2.verify import logits as verify_logits
from vllm_eagle2.verify import verifier as verify
from vllm_eagle2.verify.verifier import (
    apply_top_k_top_p,
    target_probs,
    verify_tree,
)

GOLDEN = Path(__file__).parent / "data" / "verify_golden.pt"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


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
    result = verify_tree(tokens, parents, logits)
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
    result = verify_tree(tokens, parents, logits)
    assert result.output_tokens[0].tolist() == [3, 4, 0, -1]  # fixed width N + 1
    assert result.accepted_nodes[0].tolist() == [0, 2, -1]  # fixed width N


def test_verify_rejects_bad_shapes():
    with pytest.raises(ValueError, match="target_logits"):
        verify_tree(
            torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5)
        )
    with pytest.raises(ValueError, match="parents"):
        verify_tree(
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


def verify_probs(tokens, parents, probs, *, generators=None, seed=None):
    """Sampled verification against target probabilities [B, N + 1, V] (T = 1 over their logs):
    the tests' distributions are tables of probabilities."""
    if seed is not None:
        torch.manual_seed(seed)
    temperature = torch.ones(tokens.shape[0], device=tokens.device)
    return verify_tree(tokens, parents, probs.log(), temperature=temperature, generators=generators)


def fast_outputs(probs: torch.Tensor, seed: int) -> list[list[int]]:
    tokens = torch.tensor([TREE_TOKENS] * DRAWS)
    parents = torch.tensor([TREE_PARENTS] * DRAWS)
    result = verify_probs(tokens, parents, probs.expand(DRAWS, -1, -1), seed=seed)
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
        verify_probs(
            tokens,
            parents,
            batch,
            generators={2: torch.Generator().manual_seed(42), 4: torch.Generator().manual_seed(7)},
        )
        for _ in range(2)
    ]
    alone = verify_probs(
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
    greedy = verify_tree(tokens, parents, logits)
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
    alone = verify_probs(
        torch.tensor([TREE_TOKENS]),
        torch.tensor([TREE_PARENTS]),
        probs.unsqueeze(0),
        generators={0: torch.Generator().manual_seed(5)},
    )
    # The same request next to a deeper tree and with padding nodes appended.
    deep_tokens = [0, 1, 2, 3, 4, 0, 1, -1]
    deep_parents = [-1, 0, 1, 2, 3, 4, 5, -1]
    mixed = verify_probs(
        torch.tensor([deep_tokens, TREE_TOKENS + [-1]]),
        torch.tensor([deep_parents, TREE_PARENTS + [-1]]),
        torch.cat([probs, probs[:1]]).unsqueeze(0).expand(2, -1, -1),
        generators={1: torch.Generator().manual_seed(5)},
    )
    k = int(alone.num_accepted[0])
    assert mixed.output_tokens[1, : k + 1].tolist() == alone.output_tokens[0, : k + 1].tolist()


def test_results_have_fixed_widths():
    tokens = torch.tensor([[3, 5, -1, -1]])
    parents = torch.tensor([[-1, 0, -1, -1]])
    logits = torch.zeros(1, 5, 8)
    for result in (
        verify_tree(tokens, parents, logits),
        verify_tree(tokens, parents, logits, temperature=torch.ones(1)),
    ):
        assert result.accepted_nodes.shape == (1, 4)
        assert result.output_tokens.shape == (1, 5)
        assert result.output_tokens.is_contiguous() and result.accepted_nodes.is_contiguous()


def test_seeded_rows_draw_a_fixed_count_per_call(probs):
    """N + 2 numbers per seeded row and call, whatever its tree: no sync to size them."""
    gen, twin = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    tokens, parents = torch.tensor([TREE_TOKENS]), torch.tensor([TREE_PARENTS])
    verify_probs(tokens, parents, probs.unsqueeze(0), generators={0: gen})
    torch.rand(len(TREE_TOKENS) + 2, generator=twin)
    assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=twin))


# ---------------------------------------------------------------------------------------
# Sample-match (seeded requests in an engine): the target's sample at every row is given, and
# the drafts are matched against it as greedy matches them against the argmax.


def planted_choices(tokens, parents, vocab, rng, hit_rate=0.7):
    """The target's choice at the root and after every node: some child's token ``hit_rate`` of
    the time, else any token."""
    choices = []
    for node in [-1] + list(range(len(tokens))):
        kids = children_of(parents, node)
        hit = kids and rng.random() < hit_rate
        choices.append(tokens[rng.choice(kids)] if hit else rng.randrange(vocab))
    return choices


def test_sample_match_accepts_the_nodes_that_carry_the_choice_at_their_parent():
    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    batch, n, vocab = 48, 20, 12
    trees = [random_tree(n, vocab, rng) for _ in range(batch)]
    tokens = torch.tensor([t for t, _ in trees])
    parents = torch.tensor([p for _, p in trees])
    choices = torch.tensor([planted_choices(t, p, vocab, rng) for t, p in trees])
    logits = torch.randn(batch, n + 1, vocab, generator=gen)  # the choices decide, not these
    result = verify_tree(tokens, parents, logits, temperature=torch.ones(batch), choices=choices)
    depths = []
    for b, (tok, par) in enumerate(trees):
        # The greedy walk on a target whose argmax at every row is the given choice.
        path, out = greedy_reference(tok, par, torch.nn.functional.one_hot(choices[b], vocab))
        k = len(path)
        depths.append(k)
        assert result.accepted_nodes[b, :k].tolist() == path and int(result.num_accepted[b]) == k
        assert result.output_tokens[b, : k + 1].tolist() == out  # ends with the choice at the leaf
        assert (result.output_tokens[b, k + 1 :] == -1).all()
    assert max(depths) >= 3 and min(depths) == 0  # deep and empty paths were exercised


def test_rows_without_choices_verify_as_without_them(probs):
    tokens = torch.tensor([TREE_TOKENS] * 4)
    parents = torch.tensor([TREE_PARENTS] * 4)
    logits = probs.log().expand(4, -1, -1)
    temperature = torch.tensor([1.0, 1.0, 0.0, 0.7])
    choices = torch.full((4, len(TREE_TOKENS) + 1), -1)
    choices[0] = torch.tensor([0, 1, 0, 3, 4, 1, 2, 3])  # root -> node 0 -> node 3 -> node 6
    torch.manual_seed(8)
    given = verify_tree(tokens, parents, logits, temperature=temperature, choices=choices)
    torch.manual_seed(8)
    plain = verify_tree(tokens, parents, logits, temperature=temperature)
    assert given.output_tokens[0].tolist() == [0, 1, 4, 3, -1, -1, -1, -1]
    assert torch.equal(given.output_tokens[1:], plain.output_tokens[1:])
    assert torch.equal(given.accepted_nodes[1:], plain.accepted_nodes[1:])
    assert (plain.num_accepted[1:] > 0).any()  # the rows compared accepted drafts


def test_node_choices_sample_each_node_row_with_a_generator_of_its_output_position():
    from vllm_eagle2.verify.seeded import SeededRows, node_choices, position_generator

    seen = []

    def first_draw(rows, temperature, generators, top_k, top_p):  # a sampler that shows its noise
        seen.append((rows.clone(), temperature, top_k, top_p))
        return torch.cat([torch.randint(0, 1000, (1,), generator=generators[i]) for i in range(len(rows))])

    logits = torch.randn(3, 5, 8)
    temperature, top_k = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([4, 5, 6])
    # Row 2: nodes 1, 1 and 2 deep (the first two siblings), its root at output position 7.
    seeded = SeededRows(rows=[2], seeds=[123], positions=[7], depths=[[1, 1, 2]])
    choices = node_choices(logits, seeded, torch.tensor([9, 9, 42]), temperature, top_k, None, first_draw)

    def expected(position):
        return int(torch.randint(0, 1000, (1,), generator=position_generator(123, position, "cpu")))

    assert choices[2].tolist() == [42, expected(8), expected(8), expected(9), -1]
    assert (choices[:2] == -1).all()  # rows not seeded have no choices
    rows, temps, ks, ps = seen[0]
    assert torch.equal(rows, logits[2, 1:4]) and temps.tolist() == [2.0] * 3 and ks.tolist() == [6] * 3
    assert ps is None


@pytest.mark.parametrize("vocab", [7, 512, 513, 1000, 1024])
def test_cpu_block_argmax_is_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(3, 5, vocab, generator=gen).half().float()
    x[0, 1, [5, 3, vocab - 1]] = 9.0  # ties at the maximum: the first index wins
    x[0, 2, vocab - 1] = 9.0  # maximum in the ragged last block
    x[1, 0] = -torch.inf
    x[1, 1, [4, 2]] = torch.nan  # NaN counts as the maximum, as in argmax
    x[2, 3] = 1.0
    assert torch.equal(verify_logits._argmax_last(x), x.argmax(-1))
    assert torch.equal(verify_logits._argmax_last(x.bfloat16()), x.bfloat16().argmax(-1))


# ---------------------------------------------------------------------------------------
# The fused vocabulary read (CUDA's path: one vocab_topk(k = 1) launch pair over all rows),
# run here by the Triton interpreter, against the CPU path (blocked argmax, chunked lse).


def _force_vocab_kernel(monkeypatch):
    monkeypatch.setattr(verify_logits, "_use_vocab_kernel", lambda logits: True)


def _tied_logits(dtype: torch.dtype) -> torch.Tensor:
    """[3, 7, 1100] random logits (distinct maxima in float32) with planted exact ties."""
    x = torch.randn(3, 7, 1100, generator=torch.Generator().manual_seed(7)) * 3
    x[0, 1, [700, 3, 513]] = 20.0  # the first index wins, across argmax blocks
    x[1, 2, [1099, 1098]] = 20.0  # in the ragged last block
    x[2, 4, [260, 255, 256]] = 20.0  # around a block boundary
    x[2, 5] = -torch.inf
    x[2, 5, [9, 4]] = 0.0  # two finite values only, tied
    return x.to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_argmax_lse_matches_the_cpu_path(dtype, monkeypatch):
    logits = _tied_logits(dtype)
    scale = torch.tensor([1.0, 1 / 0.7, 1 / 1.9])
    want_best, want_lse = verify_logits.argmax_lse(logits, scale)
    assert torch.equal(want_best, logits.argmax(-1))
    exact = (logits.double() * scale.double().view(3, 1, 1)).logsumexp(-1)
    torch.testing.assert_close(want_lse.double(), exact, atol=1e-5, rtol=1e-6)
    monkeypatch.setattr(verify_logits, "_CPU_CHUNK_ELEMS", 5000)  # chunked: 1 row of 3 at a time
    chunked_best, chunked_lse = verify_logits.argmax_lse(logits, scale)
    assert torch.equal(chunked_best, want_best)
    torch.testing.assert_close(chunked_lse, want_lse, atol=1e-6, rtol=1e-6)

    _force_vocab_kernel(monkeypatch)
    best, lse = verify_logits.argmax_lse(logits, scale)
    assert torch.equal(best, want_best)  # bf16 holds more ties at the maximum: first index
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-6)
    best, lse = verify_logits.argmax_lse(logits, None)
    assert torch.equal(best, want_best) and lse is None


def _fused_vs_cpu_runs(tokens, parents, logits):
    """Greedy, sampled (T mixed, same uniforms) and top-k / top-p verification results."""
    batch, n = tokens.shape
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.6])[:batch]
    u = torch.rand(batch, n + 2, generator=torch.Generator().manual_seed(1))
    top_k = torch.tensor([0, 3, 5, 0])[:batch]
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.8])[:batch]
    return [
        verify_tree(tokens, parents, logits),
        verify._verify(tokens, parents, logits=logits, temperature=temperature, uniforms=u),
        verify._verify(tokens, parents, logits=logits, temperature=torch.ones(batch), uniforms=u),
        verify._verify(
            tokens, parents, logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, uniforms=u
        ),
    ]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_vocab_read_verifies_exactly_as_the_cpu_path(dtype, seed, monkeypatch):
    tokens, parents, logits = _batch(4, 12, 600, seed=seed)
    # Softer: a planted child gets p ~ 0.6 at T = 1, so acceptances depend on the uniforms.
    logits = logits * 0.7
    # Ties with the planted argmax (7.0) at a lower token in some rows: the first wins.
    logits[seed % 4, :: 2 + seed, 1] = 7.0
    logits = logits.to(dtype)
    want = _fused_vs_cpu_runs(tokens, parents, logits)
    _force_vocab_kernel(monkeypatch)
    got = _fused_vs_cpu_runs(tokens, parents, logits)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.accepted_nodes, w.accepted_nodes)
        assert torch.equal(g.num_accepted, w.num_accepted)
        assert torch.equal(g.output_tokens, w.output_tokens)
    assert int(want[0].num_accepted.sum()) > 0 and int(want[1].num_accepted.sum()) > 0  # not vacuous


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN arithmetic in the interpreter's numpy
def test_fused_vocab_read_gives_valid_tokens_for_nan_logits(monkeypatch):
    # Unspecified tokens on CUDA (NaN counts as -inf there), but always in [0, V).
    tokens, parents, logits = _batch(3, 8, 300, seed=4)
    logits[0, :, ::3] = torch.nan
    logits[1] = torch.nan
    logits[2, 0, 7] = torch.nan
    _force_vocab_kernel(monkeypatch)
    for result in _fused_vs_cpu_runs(tokens, parents, logits)[:3]:
        final = result.output_tokens.gather(1, result.num_accepted.unsqueeze(1))
        assert ((final >= 0) & (final < 300)).all()


# ---------------------------------------------------------------------------------------
# Golden cases: tests/data/verify_golden.pt holds 32 seeded random batches (B 1-6, N 1-40,
# V 8-300; chains and bushes, duplicate sibling tokens, -1 padding nodes, exact ties at
# the argmax, temperatures 0 / 0.7 / 1, some top-k / top-p) with the results of the
# level-by-level verifier this module had before it became fixed-shape (commit 02572f6):
# greedy, and sampled (its walk on target_probs with safe temperature 1 for T = 0 rows)
# with the stored uniforms [B, D + 2] (D = deepest node): columns 0..D per level, the
# last one for the final token. Old results are D (+ 1) wide, the new ones N (+ 1).


def _golden_uniforms(old: torch.Tensor, n: int) -> torch.Tensor:
    """The old uniforms in the new layout [B, N + 2]: final token first, then levels."""
    filler = torch.rand(old.shape[0], n + 1 - (old.shape[1] - 1), generator=torch.Generator().manual_seed(0))
    return torch.cat([old[:, -1:], old[:, :-1], filler], dim=1)


def _assert_golden(result, golden, n):
    nodes, num, out = golden
    d = nodes.shape[1]
    assert result.accepted_nodes.shape == (num.shape[0], n)
    assert result.output_tokens.shape == (num.shape[0], n + 1)
    assert torch.equal(result.num_accepted, num)
    assert torch.equal(result.accepted_nodes[:, :d], nodes)
    assert (result.accepted_nodes[:, d:] == -1).all()
    assert torch.equal(result.output_tokens[:, : d + 1], out)
    assert (result.output_tokens[:, d + 1 :] == -1).all()


@pytest.mark.parametrize("cpu_blocks", ["default", "tiny"])
def test_matches_the_level_walk_on_golden_cases(cpu_blocks, monkeypatch):
    if cpu_blocks == "tiny":  # also run the CPU-only blocked argmax and chunked softmax paths
        monkeypatch.setattr(verify_logits, "_CPU_ARGMAX_BLOCK", 4)
        monkeypatch.setattr(verify_logits, "_CPU_CHUNK_ELEMS", 100)
    cases = torch.load(GOLDEN)
    assert len(cases) >= 30
    for case in cases:
        tokens, parents, logits = case["tokens"], case["parents"], case["logits"].float()
        n = tokens.shape[1]
        temperature, top_k, top_p = case["temperature"], case["top_k"], case["top_p"]
        u = _golden_uniforms(case["uniforms"], n)
        greedy = verify_tree(tokens, parents, logits)
        _assert_golden(greedy, case["greedy"], n)
        # Every row sampled (greedy rows at T = 1, as the golden walk drew them) ...
        every = torch.where(temperature > 0, temperature, 1.0)
        sampled = verify._verify(
            tokens, parents, logits=logits, temperature=every, top_k=top_k, top_p=top_p, uniforms=u
        )
        _assert_golden(sampled, case["sampled"], n)
        # ... and greedy and sampled rows mixed: each row matches its own golden.
        mixed = verify._verify(
            tokens, parents, logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, uniforms=u
        )
        for b in range(tokens.shape[0]):
            want = greedy if temperature[b] <= 0 else sampled
            assert torch.equal(mixed.output_tokens[b], want.output_tokens[b]), (case["seed"], b)
            assert torch.equal(mixed.accepted_nodes[b], want.accepted_nodes[b]), (case["seed"], b)


# ---------------------------------------------------------------------------------------
# No host sync and a bounded number of ops: what lets a CUDA graph capture verification.


def _batch(batch: int, n: int, vocab: int, device: str = "cpu", seed: int = 0):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    trees = [random_tree(n, vocab, rng) for _ in range(batch)]
    tokens = torch.tensor([t for t, _ in trees])
    parents = torch.tensor([p for _, p in trees])
    logits = torch.stack([planted_logits(t, p, vocab, rng, gen) for t, p in trees])
    return tokens.to(device), parents.to(device), logits.to(device)


def _run_all(tokens, parents, logits, seeded: bool):
    batch = tokens.shape[0]
    gens = {1: torch.Generator(tokens.device).manual_seed(1)} if seeded else None
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0][:batch], device=tokens.device)
    verify_tree(tokens, parents, logits)
    verify_tree(tokens, parents, logits, temperature=temperature, generators=gens)
    choices = torch.where(torch.arange(batch, device=tokens.device).unsqueeze(1) == 1, -1, logits.argmax(-1))
    verify_tree(tokens, parents, logits, temperature=temperature, choices=choices)
    if tokens.device.type != "cpu":  # on CPU top-k/top-p compacts the rows it sorts, on purpose
        k = torch.full((batch,), 5, device=tokens.device)
        verify_tree(tokens, parents, logits, temperature=temperature, top_k=k, top_p=k / 10, generators=gens)


def test_the_sync_detector_catches_a_sync():
    x = torch.ones(3)
    for sync in (lambda: x.sum().item(), lambda: x.nonzero(), lambda: x[x > 0], lambda: bool(x.any())):
        with pytest.raises(AssertionError, match="host sync"), AtenOps():
            sync()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_verify_has_no_host_sync(device):
    # On CPU the CPU-only blocked argmax and chunked softmax run (vocabulary > 2 blocks);
    # on the meta device the paths every other device takes, and any data access fails.
    tokens, parents, logits = _batch(4, 30, 1100, device=device)
    with AtenOps():
        _run_all(tokens, parents, logits, seeded=device == "cpu")


def _op_counts(fn) -> int:
    with AtenOps() as ops:
        fn()
    return ops.total


# aten ops (views included; each is at most one kernel launch) at B = 4, N = 60, V = 1100
# on CPU, whatever the tree's shape. The level-by-level verifier took 264-413 (greedy) and
# 677-1112 (verify_tree at T = 1) on these batches, growing with the accepted depth, with
# 7-14 host syncs. Off CPU without Triton (no blocked argmax) greedy is 78 and T = 1 156;
# on CUDA with Triton (the fused vocabulary read) 79 and 158, plus vocab_topk's 6 buffer
# allocations and 2 Triton launches, and no [B, N + 1, V] pass of torch's any more.
# T = 1 was 173 (Off CPU 160) before the fused read's lse replaced the softmax statistics.
GREEDY_OPS = 92
SAMPLED_OPS = 170


def test_verify_launch_budget():
    tokens, parents, logits = _batch(4, 60, 1100)
    temperature = torch.ones(4)
    greedy = _op_counts(lambda: verify_tree(tokens, parents, logits))
    sampled = _op_counts(lambda: verify_tree(tokens, parents, logits, temperature=temperature))
    assert greedy <= GREEDY_OPS, greedy
    assert sampled <= SAMPLED_OPS, sampled
    assert sampled <= 2 * greedy  # sampling costs at most twice greedy
    # Fixed shape: a chain as deep as the tree costs exactly the same.
    chain = torch.arange(60).expand(4, 60) - 1
    assert _op_counts(lambda: verify_tree(tokens, chain, logits)) == greedy


def test_top_k_top_p_on_the_cuda_path_samples_as_the_cpu_path(monkeypatch):
    """Off CPU every row is filtered, in groups of requests that bound the sort's memory; the
    probabilities at the drafted tokens, and so every draw, are the CPU path's."""
    from vllm_eagle2.device import CUDA_PATH_ENV
    from vllm_eagle2.verify import logits as verify_logits

    tokens, parents, logits = _batch(4, 12, 300, seed=3)
    temperature = torch.tensor([0.7, 1.0, 0.9, 1.3])
    top_k, top_p = torch.tensor([5, 50, 0, 20]), torch.tensor([0.9, 1.0, 0.8, 0.95])

    def run():
        gens = {b: torch.Generator().manual_seed(10 + b) for b in range(4)}
        return verify_tree(
            tokens, parents, logits, temperature=temperature, top_k=top_k, top_p=top_p, generators=gens
        )

    cpu = run()
    monkeypatch.setenv(CUDA_PATH_ENV, "1")
    monkeypatch.setattr(verify_logits, "_FILTER_ELEMS", 2 * 13 * 300)  # groups of two requests
    cuda = run()
    assert torch.equal(cuda.output_tokens, cpu.output_tokens)
    assert torch.equal(cuda.accepted_nodes, cpu.accepted_nodes)
    assert (cpu.num_accepted > 0).any()  # drafts were accepted, not only residual draws
