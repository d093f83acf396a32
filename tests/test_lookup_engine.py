"""Lookup chains grafted into eagle2's trees inside vLLM (``speculative_config.lookup``): lossless,
exercised, and accepted where the text repeats.

The prompts repeat a random span and begin it once more; the tiny target's greedy continuations
fall into loops of their own, which the requests' suffix indexes find as well. Every run with
lookup chains checks that grafted drafts were verified and accepted (``lookup_drafts``,
``lookup_accepted``).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import acceptance_length, assert_accepted_at_every_position, assert_trees_exercised, run_llm
from test_engine_lossless import greedy, greedy_reference, tokens_of
from test_sampling_lossless import NUM_SAMPLES, _sharpen_the_verifier, homogeneity_pvalue

from vllm_eagle2.budget.costs import COSTS_ENV
from vllm_eagle2.engine.catch_up import DeferredCatchUp
from vllm_eagle2_tools.testing import build_eagle_head, build_pair

TREE = dict(num_speculative_tokens=12, depth=4, topk=3)


def repeating_prompts(num: int, seed: int) -> list[dict]:
    """Prompts ``S S S[:k]``: a random span of 8-24 tokens twice, then its first k tokens."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        span = [rng.randrange(6, 512) for _ in range(rng.randint(8, 24))]
        prompts.append({"prompt_token_ids": span + span + span[: rng.randint(1, len(span) - 1)]})
    return prompts


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("lookup_models"), "partial", seed=0)


@pytest.fixture(scope="module")
def random_head(pair, tmp_path_factory) -> Path:
    """A head that is rarely right: what is accepted comes from the lookup chains."""
    return build_eagle_head(tmp_path_factory.mktemp("lookup_random") / "head", pair[0], kind="random")


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return repeating_prompts(6, seed=0)


@pytest.fixture(scope="module")
def reference(pair, prompts):
    return greedy_reference(pair[0], prompts)


def eagle2(head: Path, **knobs) -> dict:
    return {"method": "eagle2", "model": str(head), **TREE, **knobs}


def assert_lookup_exercised(metrics: dict) -> None:
    stats = metrics["eagle2"]
    assert stats["lookup_drafts"] > 0 and stats["lookup_accepted"] > 0, stats


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_greedy_trees_with_lookup_chains_equal_no_speculation(pair, prompts, reference, mode):
    target, head = pair
    spec = eagle2(head, budget="fixed", lookup=8)
    outputs, metrics = run_llm(target, spec, prompts, greedy(), compiled=mode == "compiled")
    assert tokens_of(outputs) == reference(mode)
    assert_lookup_exercised(metrics)
    assert_trees_exercised(metrics)


#: Head levels cost a second each, verified tokens next to nothing: the budget plans no head drafts.
HEAD_NEVER_PAYS = '{"target": [0.02, 0.0001], "level": [1.0, 0.0], "overhead": 0.002}'


def test_steps_whose_head_drafts_nothing_still_send_lookup_chains(pair, prompts, reference, monkeypatch):
    monkeypatch.setenv(COSTS_ENV, HEAD_NEVER_PAYS)
    target, head = pair
    outputs, metrics = run_llm(target, eagle2(head, lookup=8), prompts, greedy())
    assert tokens_of(outputs) == reference()
    assert_lookup_exercised(metrics)
    stats = metrics["eagle2"]
    # Every draft verified came from a lookup chain, sent as a chain (no tree mask needed).
    assert stats["lookup_drafts"] == metrics["vllm:spec_decode_num_draft_tokens"], stats
    assert stats["tree_rows"] == 0, stats
    # The head's catch-up waited through the chains' verifying steps too: no head pass of its own.
    assert stats["catch_up_deferred_steps"] > 0 and stats["head_passes"] == stats["catch_up_flushes"], stats


def test_a_full_catch_up_queue_at_a_verifying_step_runs_with_its_own_catch_up(
    pair, prompts, reference, monkeypatch
):
    """With the queue full at every step, a step that verified chains cannot run the waiting rows
    with its own (which of them were accepted is on the device): its catch-up pass runs them."""
    monkeypatch.setenv(COSTS_ENV, HEAD_NEVER_PAYS)
    monkeypatch.setattr(DeferredCatchUp, "has_room", lambda self, *args: False)
    target, head = pair
    outputs, metrics = run_llm(target, eagle2(head, lookup=8), prompts, greedy())
    assert tokens_of(outputs) == reference()
    stats = metrics["eagle2"]
    assert stats["lookup_drafts"] > 0 and stats["head_passes"] > stats["catch_up_flushes"] > 0, stats


#: Draft levels of 5 ms beside a 20 ms target: the head's drafts pay, confident chains alone pay more.
HEAD_LEVELS_DEAR = '{"target": [0.02, 0.0005], "level": [0.005, 0.0001], "overhead": 0.002}'


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_the_adaptive_budget_leaves_the_head_levels_unrun_beside_sure_chains_and_the_output_exact(
    pair, prompts, reference, monkeypatch, mode
):
    """The adaptive budget with lookup chains: steps where the head drafts beside the chains, and steps
    where confident chains go alone."""
    monkeypatch.setenv(COSTS_ENV, HEAD_LEVELS_DEAR)
    target, head = pair
    outputs, metrics = run_llm(target, eagle2(head, lookup=8), prompts, greedy(), compiled=mode == "compiled")
    assert tokens_of(outputs) == reference(mode)
    assert_lookup_exercised(metrics)
    stats, budget = metrics["eagle2"], metrics["eagle2_budget"]
    assert budget["steps_head_skipped"] > 0, budget
    # The head drafted in the other steps.
    assert metrics["vllm:spec_decode_num_draft_tokens"] > stats["lookup_drafts"], stats


def test_lookup_chains_raise_the_acceptance_length_where_text_repeats(pair, prompts, random_head, reference):
    taus = {}
    for lookup in (0, 8):
        spec = eagle2(random_head, budget="fixed", lookup=lookup)
        outputs, metrics = run_llm(pair[0], spec, prompts, greedy())
        assert tokens_of(outputs) == reference()
        taus[lookup] = acceptance_length(metrics)
        if lookup:
            assert_lookup_exercised(metrics)
    # The outputs loop after about 20 plain tokens; a loop's steps then accept several tokens each.
    assert taus[8] > taus[0] + 0.3, taus


def test_an_output_cache_continues_what_an_earlier_request_wrote(pair, prompts, random_head, reference):
    """The same prompt twice, one request after the other: with ``lookup_cache`` the second request's
    chains continue the first's output, so more lookup drafts are accepted; the output stays exact."""
    accepted = {}
    for cache in (0, 4096):
        spec = eagle2(random_head, budget="fixed", lookup=8, lookup_cache=cache)
        outputs, metrics = run_llm(pair[0], spec, prompts[:1] * 2, greedy(), max_num_seqs=1)
        assert tokens_of(outputs) == reference()[:1] * 2
        stats = metrics["eagle2"]
        accepted[cache] = stats["lookup_accepted"]
        assert ("lookup_cache_chains" in stats) == bool(cache), stats
    assert metrics["eagle2"]["lookup_cache_chains"] > 0
    assert accepted[4096] > accepted[0] + 10, accepted


@pytest.fixture(scope="module")
def loop_prompt(prompts, reference) -> list[dict]:
    """A prompt that ends in the target's own greedy loop: lookup chains continue the loop, and the
    target samples its next tokens from distributions that give them a fair chance."""
    return [{"prompt_token_ids": prompts[0]["prompt_token_ids"] + reference()[0]}]


def placed_lookup_nodes(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts, over the engine's verifications (its core runs in this process), the lookup nodes
    verified beside a sibling the head drafted ("beside_head"), and those of them accepted off
    their tree's leading chain, where their K/V had to move ("accepted_beside_head_off_chain")."""
    from vllm_eagle2.engine.lookup_drafts import LookupDrafts
    from vllm_eagle2.tree import off_leading_chain

    placed = Counter()
    record = LookupDrafts.record

    def counting_record(self, grafted, buckets, parents, depths, accepted_nodes):
        lookup, head = grafted & (depths > 0), ~grafted & (depths > 0)
        siblings = parents.unsqueeze(2) == parents.unsqueeze(1)  # [B, N, N]: same parent
        beside_head = lookup & (siblings & head.unsqueeze(1)).any(2)
        accepted = torch.zeros_like(grafted)
        rows, cols = (accepted_nodes >= 0).nonzero(as_tuple=True)
        accepted[rows, accepted_nodes[rows, cols]] = True
        placed["beside_head"] += int(beside_head.sum())
        off_chain = accepted & beside_head & off_leading_chain(depths)
        placed["accepted_beside_head_off_chain"] += int(off_chain.sum())
        return record(self, grafted, buckets, parents, depths, accepted_nodes)

    monkeypatch.setattr(LookupDrafts, "record", counting_record)
    return placed


def loop_samples(target: Path, spec: dict | None, prompt: list[dict]) -> tuple[np.ndarray, dict]:
    """NUM_SAMPLES unseeded samples of 4 tokens at temperature 1 (the rejection-sampling path, which
    the biased verifier sharpens), and the engine's metrics, with "lookup_nodes"
    (:func:`placed_lookup_nodes`); with ``spec``, drafts accepted at each draft position that
    decides a sampled position (1 to 3), lookup drafts among them."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True) for _ in range(NUM_SAMPLES)]
    with pytest.MonkeyPatch.context() as mp:
        placed = placed_lookup_nodes(mp)
        outputs, metrics = run_llm(target, spec, prompt * NUM_SAMPLES, params, max_num_seqs=32)
    metrics["lookup_nodes"] = placed
    if spec is not None:
        assert_accepted_at_every_position(metrics, 3)
        assert_lookup_exercised(metrics)
    return np.array(tokens_of(outputs)), metrics


@pytest.fixture(scope="module")
def plain_loop_samples(pair, loop_prompt) -> np.ndarray:
    return loop_samples(pair[0], None, loop_prompt)[0]


def pvalues(a: np.ndarray, b: np.ndarray) -> list[float]:
    """Per sampled position 2..4 (1 comes from the prefill): chi-square p-values of homogeneity."""
    return [homogeneity_pvalue(a[:, j], b[:, j]) for j in range(1, 4)]


def test_sampled_tokens_with_lookup_chains_follow_the_target_distribution(
    pair, random_head, loop_prompt, plain_loop_samples
):
    # A head that is rarely right: its drafts often rank above the lookup chain's and are rejected,
    # and the lookup node beside them is accepted. (With the partly-right head, 22 lookup nodes sat
    # beside the head's siblings in this test, and none was accepted off the leading chain.)
    spec = eagle2(random_head, budget="fixed", lookup=8)
    samples, metrics = loop_samples(pair[0], spec, loop_prompt)
    assert_trees_exercised(metrics)
    placed = metrics["lookup_nodes"]
    assert placed["accepted_beside_head_off_chain"] > 0, placed
    assert min(pvalues(plain_loop_samples, samples)) > 1e-3


def test_sampled_tokens_follow_the_target_distribution_where_sure_chains_go_alone(
    pair, loop_prompt, plain_loop_samples, monkeypatch
):
    monkeypatch.setenv(COSTS_ENV, HEAD_LEVELS_DEAR)
    samples, metrics = loop_samples(pair[0], eagle2(pair[1], lookup=8), loop_prompt)
    assert metrics["eagle2_budget"]["steps_head_skipped"] > 0, metrics["eagle2_budget"]
    assert min(pvalues(plain_loop_samples, samples)) > 1e-3


def test_a_biased_verifier_fails_the_same_test_with_lookup_chains(
    pair, random_head, loop_prompt, plain_loop_samples, monkeypatch
):
    _sharpen_the_verifier(monkeypatch)
    spec = eagle2(random_head, budget="fixed", lookup=8)
    assert min(pvalues(plain_loop_samples, loop_samples(pair[0], spec, loop_prompt)[0])) < 1e-4
