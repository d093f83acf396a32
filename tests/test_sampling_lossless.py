"""eagle2 sampling inside vLLM is lossless: same token distribution as without speculation.

Many samples of a short continuation of one prompt, at temperature 1, from the engine without
speculation and from eagle2 with a partly-right head. For every output position that
speculation decides (2 and later; position 1 comes from the prefill), the two samples' token
counts are compared with a chi-square test of homogeneity. A deliberately biased verifier (the
right algorithm run on a wrongly tempered target distribution) must fail the same test, so the
test can fail.

Unseeded requests take the recursive rejection sampling; seeded ones (``seed=``) the sample-match
path, where vLLM's sampler draws every tree row with noise of its output position
(:mod:`vllm_eagle2.verify.seeded`): lossless too, and the same tokens whatever the drafts.

vLLM's built-in ``eagle`` with the same head passes the same test too, with the plugin installed:
on vLLM 0.32's CPU build its rejection sampler divided the target's logits by uninitialised memory
instead of the temperature (``vllm_eagle2/patches.py`` says why), and this test failed.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import assert_accepted_at_every_position, assert_trees_exercised, run_llm
from scipy.stats import chi2_contingency

from vllm_eagle2 import draft_vocab
from vllm_eagle2.budget.costs import COSTS_ENV
from vllm_eagle2.patches import FIX_VLLM_CPU_ENV
from vllm_eagle2_tools.testing import build_eagle3_head, build_pair

NUM_SAMPLES = 400
MAX_TOKENS = 4
PROMPT = {"prompt_token_ids": [17, 250, 99, 31, 402, 77, 8, 190]}
SPEC = dict(num_speculative_tokens=12, depth=4, topk=3)
#: Step costs (seconds = a + b * tokens) under which, at temperature 1 and 32 requests a step, the
#: adaptive budget gives requests trees of 1 to 12 nodes, some of them deep enough to be accepted 3 deep.
#: (Under test_engine_lossless.py's costs it drafted in 3 steps of 52, never past depth 1.)
STEP_COSTS = '{"target": [0.02, 0.00001], "level": [0.0002, 0.00001], "overhead": 0.001}'


def sampling_params(seeded: bool = False):
    """NUM_SAMPLES requests at temperature 1; ``seeded``: request i seeded 1000 + i."""
    from vllm import SamplingParams

    return [
        SamplingParams(
            temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=1000 + i if seeded else None
        )
        for i in range(NUM_SAMPLES)
    ]


def sample_with_metrics(
    target, spec, fresh_process: bool = False, positions: int = MAX_TOKENS - 1, seeded: bool = False
) -> tuple[np.ndarray, dict]:
    """NUM_SAMPLES samples of MAX_TOKENS tokens, and the engine's metrics; with ``spec``, asserts
    what the engine exercised (:func:`assert_speculation_decided`, drafts accepted 1 to
    ``positions`` deep)."""
    outputs, metrics = run_llm(
        target,
        spec,
        [PROMPT] * NUM_SAMPLES,
        sampling_params(seeded),
        max_num_seqs=32,
        fresh_process=fresh_process,
    )
    if spec is not None:
        assert_speculation_decided(metrics, spec, positions)
    return np.array([list(o.outputs[0].token_ids) for o in outputs]), metrics


def sample(target, spec, fresh_process: bool = False, positions: int = MAX_TOKENS - 1) -> np.ndarray:
    """NUM_SAMPLES unseeded samples (:func:`sample_with_metrics`)."""
    return sample_with_metrics(target, spec, fresh_process, positions)[0]


def assert_speculation_decided(metrics: dict, spec: dict, positions: int) -> None:
    """Drafts were verified and accepted at every draft position 1 to ``positions`` (so at each
    output position that the chi-square tests compare, drafts decided tokens), and eagle2's trees
    branched: rows recomputed with their tree masks, accepted off-chain nodes' K/V moved."""
    assert_accepted_at_every_position(metrics, positions)
    if spec["method"] == "eagle2":
        assert_trees_exercised(metrics)


def homogeneity_pvalue(a: np.ndarray, b: np.ndarray, min_count: int = 10) -> float:
    """Chi-square p-value that two samples of tokens share one distribution (rare tokens pooled)."""
    tokens, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    common = tokens[counts >= min_count]
    table = [[int((x == t).sum()) for t in common] + [int((~np.isin(x, common)).sum())] for x in (a, b)]
    table = np.array(table)
    table = table[:, table.sum(0) > 0]
    return float(chi2_contingency(table).pvalue)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("sampling_models"), "partial", seed=0)


@pytest.fixture(scope="module")
def eagle3_head(pair, tmp_path_factory):
    """A partly agreeing EAGLE-3 head with its own 400-token vocabulary (``d2t``) for the same target."""
    return build_eagle3_head(
        tmp_path_factory.mktemp("sampling_eagle3") / "head", pair[0], draft_vocab_size=400
    )


@pytest.fixture(scope="module")
def reference(pair) -> np.ndarray:
    return sample(pair[0], None)


@pytest.mark.parametrize("budget", ["fixed", "adaptive"])
def test_sampled_tokens_follow_the_target_distribution(pair, reference, budget, monkeypatch):
    # The adaptive budget on fixed costs under which requests and steps carry trees of different sizes.
    monkeypatch.setenv(COSTS_ENV, STEP_COSTS)
    target, head = pair
    spec = {"method": "eagle2", "model": str(head), **SPEC, "budget": budget}
    spec_samples = sample(target, spec)
    pvalues = [homogeneity_pvalue(reference[:, j], spec_samples[:, j]) for j in range(1, MAX_TOKENS)]
    assert min(pvalues) > 1e-3, pvalues


def test_sampled_tokens_with_an_eagle3_head_follow_the_target_distribution(pair, reference, eagle3_head):
    # Draft probabilities over the head's own vocabulary, mapped to target ids: tokens outside it are
    # never drafted, and the residual distribution must still restore them.
    spec = {"method": "eagle2", "model": str(eagle3_head), **SPEC, "budget": "fixed"}
    # This head seldom agrees twice in a row at temperature 1: of 400 samples none accepted 3 drafts.
    spec_samples = sample(pair[0], spec, positions=2)
    pvalues = [homogeneity_pvalue(reference[:, j], spec_samples[:, j]) for j in range(1, MAX_TOKENS)]
    assert min(pvalues) > 1e-3, pvalues


def test_sampled_tokens_drafted_from_a_draft_vocabulary_follow_the_target_distribution(
    pair, reference, tmp_path
):
    # The head ranks the reference's tokens; draft_vocab_size "auto" (the default) keeps the most
    # frequent ones, so the rarer tokens are never drafted and only the residual restores them.
    head = shutil.copytree(pair[1], tmp_path / "ranked-head")
    tokens, counts = np.unique(reference, return_counts=True)
    order = np.argsort(-counts, kind="stable")
    draft_vocab.write_ranking(head, tokens[order].tolist(), counts[order].tolist(), "test")
    assert SPEC["topk"] <= draft_vocab.covering_size(head) < len(tokens)
    spec = {"method": "eagle2", "model": str(head), **SPEC, "budget": "fixed"}
    spec_samples = sample(pair[0], spec)
    pvalues = [homogeneity_pvalue(reference[:, j], spec_samples[:, j]) for j in range(1, MAX_TOKENS)]
    assert min(pvalues) > 1e-3, pvalues


def test_vllm_eagle_samples_the_target_distribution_with_the_cpu_fix_opted_in(pair, reference, monkeypatch):
    # vLLM 0.32's CPU build expands temperatures into uninitialised memory; the plugin's fix for
    # engines without eagle2 is opt-in (FIX_VLLM_CPU_ENV).
    monkeypatch.setenv(FIX_VLLM_CPU_ENV, "1")
    target, head = pair
    # A fresh engine process: the plugin reads the opt-in when it is loaded.
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    spec_samples = sample(target, spec, fresh_process=True)
    pvalues = [homogeneity_pvalue(reference[:, j], spec_samples[:, j]) for j in range(1, MAX_TOKENS)]
    assert min(pvalues) > 1e-3, pvalues


# --- vLLM's default (compiled) mode, with top-k and top-p, two prompts, every tree depth ----------
#: Filters on top of temperature, and 6 tokens: a depth-4 tree decides output positions 2 to 6.
FILTERED = dict(temperature=0.8, top_k=20, top_p=0.9, max_tokens=6, ignore_eos=True)
TWO_PROMPTS = [PROMPT, {"prompt_token_ids": [300, 12, 75, 488, 9, 260, 133]}]
PER_PROMPT = 250


def sample_filtered(target, spec) -> tuple[list[np.ndarray], dict]:
    """Compiled engine; per prompt, [PER_PROMPT, 6] tokens; and the engine's metrics."""
    from vllm import SamplingParams

    prompts = TWO_PROMPTS * PER_PROMPT
    params = [SamplingParams(**FILTERED) for _ in prompts]  # unseeded: the rejection-sampling path
    outputs, metrics = run_llm(target, spec, prompts, params, max_num_seqs=32, compiled=True)
    if spec is not None:  # output positions 2 to 6, trees 4 deep
        assert_speculation_decided(metrics, spec, min(FILTERED["max_tokens"] - 1, SPEC["depth"]))
    tokens = np.array([list(o.outputs[0].token_ids) for o in outputs])
    return [tokens[i :: len(TWO_PROMPTS)] for i in range(len(TWO_PROMPTS))], metrics


def filtered_pvalues(reference: list[np.ndarray], samples: list[np.ndarray]) -> list[float]:
    return [
        homogeneity_pvalue(ref[:, j], got[:, j])
        for ref, got in zip(reference, samples)
        for j in range(1, FILTERED["max_tokens"])
    ]


@pytest.fixture(scope="module")
def filtered_reference(pair) -> list[np.ndarray]:
    return sample_filtered(pair[0], None)[0]


def test_compiled_top_k_top_p_samples_follow_the_target_distribution_at_every_depth(pair, filtered_reference):
    target, head = pair
    spec = {"method": "eagle2", "model": str(head), **SPEC, "budget": "fixed"}
    samples, _ = sample_filtered(target, spec)  # drafts accepted at every depth of the trees
    pvalues = filtered_pvalues(filtered_reference, samples)
    assert min(pvalues) > 1e-3, pvalues


def test_a_biased_verifier_fails_the_compiled_top_k_top_p_test(pair, filtered_reference, monkeypatch):
    _sharpen_the_verifier(monkeypatch)
    target, head = pair
    biased, _ = sample_filtered(target, {"method": "eagle2", "model": str(head), **SPEC, "budget": "fixed"})
    pvalues = filtered_pvalues(filtered_reference, biased)
    assert min(pvalues) < 1e-4, pvalues


def _sharpen_the_verifier(monkeypatch) -> None:
    """The right algorithm on a wrongly tempered target distribution (the engine runs in this process,
    run_llm's default, so its worker sees the patched verifier)."""
    from vllm_eagle2.engine import verification as runner

    exact = runner.verify_tree

    def sharpened(*args, temperature=None, **kwargs):
        wrong = None if temperature is None else torch.where(temperature > 0, temperature * 0.6, temperature)
        return exact(*args, temperature=wrong, **kwargs)

    monkeypatch.setattr(runner, "verify_tree", sharpened)


def test_a_biased_verifier_fails_the_same_test(pair, reference, monkeypatch):
    _sharpen_the_verifier(monkeypatch)
    target, head = pair
    biased = sample(target, {"method": "eagle2", "model": str(head), **SPEC, "budget": "fixed"})
    pvalues = [homogeneity_pvalue(reference[:, j], biased[:, j]) for j in range(1, MAX_TOKENS)]
    assert min(pvalues) < 1e-4, pvalues


# --- seeded requests: sample-match, the same tokens whatever the drafts ---------------------------
ADAPTIVE = {**SPEC, "budget": "adaptive"}


@pytest.fixture(scope="module")
def seeded_adaptive(pair) -> tuple[np.ndarray, dict]:
    """Seeded samples from eagle2 under the adaptive budget on STEP_COSTS, and the metrics."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(COSTS_ENV, STEP_COSTS)
        spec = {"method": "eagle2", "model": str(pair[1]), **ADAPTIVE}
        return sample_with_metrics(pair[0], spec, seeded=True)


def test_seeded_sampled_tokens_follow_the_target_distribution(reference, seeded_adaptive):
    spec_samples, metrics = seeded_adaptive
    assert metrics["eagle2_budget"] is not None  # the adaptive budget drafted (and drafts decided)
    pvalues = [homogeneity_pvalue(reference[:, j], spec_samples[:, j]) for j in range(1, MAX_TOKENS)]
    assert min(pvalues) > 1e-3, pvalues


def test_seeded_requests_sample_the_same_tokens_whatever_their_drafts(pair, seeded_adaptive):
    # The fixed budget sends every request its whole tree each step, the adaptive one 1 to 12 nodes.
    adaptive, adaptive_metrics = seeded_adaptive
    spec = {"method": "eagle2", "model": str(pair[1]), **SPEC, "budget": "fixed"}
    fixed, fixed_metrics = sample_with_metrics(pair[0], spec, seeded=True)
    drafts = [m["vllm:spec_decode_num_draft_tokens"] for m in (adaptive_metrics, fixed_metrics)]
    assert drafts[0] != drafts[1], drafts  # the drafts sent differed
    for metrics in (adaptive_metrics, fixed_metrics):
        assert_trees_exercised(metrics)  # and were accepted, off-chain nodes too
    assert np.array_equal(adaptive, fixed)


def test_a_biased_seeded_path_fails_the_same_test(pair, reference, monkeypatch):
    """The node rows of seeded trees sampled at a sharpened temperature (the root keeps vLLM's own
    sample) must fail the seeded distribution test. Only the tokens that accepted nodes decide are
    biased: at T * 0.6 (the other biased tests' factor) the smallest p-value was 5e-4, at T * 0.4
    6e-10."""
    from vllm_eagle2.engine import seeding

    exact = seeding.node_choices

    def sharpened(logits, seeded, root, temperature, *args):
        return exact(logits, seeded, root, temperature * 0.4, *args)

    monkeypatch.setattr(seeding, "node_choices", sharpened)
    monkeypatch.setenv(COSTS_ENV, STEP_COSTS)
    spec = {"method": "eagle2", "model": str(pair[1]), **ADAPTIVE}
    biased, _ = sample_with_metrics(pair[0], spec, seeded=True)
    pvalues = [homogeneity_pvalue(reference[:, j], biased[:, j]) for j in range(1, MAX_TOKENS)]
    assert min(pvalues) < 1e-4, pvalues
