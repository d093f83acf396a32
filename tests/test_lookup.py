"""The lookup matcher: one request's longest repeated suffix and what followed it, kept incrementally
in bounded memory (:class:`vllm_eagle2.lookup.SuffixIndex`); and the chains' outlook the budget weighs
(:meth:`vllm_eagle2.engine.lookup_drafts.StepChains.reach`)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_eagle2.engine.lookup_drafts import PRIOR_RATES, LookupDrafts
from vllm_eagle2.lookup import SuffixIndex


def brute_force_match(text: list[int], max_tokens: int) -> tuple[int, list[int]]:
    """The longest suffix of ``text`` that ends earlier too, and what followed its first earlier end,
    copied on token by token past the text's end (an overlapping copy)."""
    n = len(text)
    for length in range(n - 1, 0, -1):
        suffix = text[n - length :]
        for end in range(length - 1, n - 1):  # earliest earlier end first
            if text[end - length + 1 : end + 1] == suffix:
                copied = list(text)
                for i in range(max_tokens):
                    copied.append(copied[end + 1 + i])
                return length, copied[n:]
    return 0, []


@pytest.mark.parametrize("alphabet", [2, 3, 8, 50])
def test_every_match_equals_a_brute_force_search(alphabet):
    rng = random.Random(alphabet)
    for _ in range(20):
        index, text = SuffixIndex(), []
        for _ in range(rng.randint(1, 60)):
            chunk = [rng.randrange(alphabet) for _ in range(rng.randint(1, 4))]  # a step's accepted tokens
            index.extend(chunk)
            text += chunk
            assert index.match(5) == brute_force_match(text, 5), text


def test_text_that_repeats_a_span_continues_it():
    index = SuffixIndex()
    index.extend([7, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3])
    assert index.match(3) == (3, [4, 5, 6])
    assert SuffixIndex().match(3) == (0, [])


def test_text_caught_in_a_loop_continues_the_loop():
    index = SuffixIndex()
    index.extend([5, 8, 1, 2, 3, 1, 2, 3, 1])
    assert index.match(7) == (4, [2, 3, 1, 2, 3, 1, 2])
    index.extend([4, 4, 4])
    assert index.match(3) == (2, [4, 4, 4])


def test_a_window_keeps_the_last_tokens_and_matches_within_them():
    rng = random.Random(0)
    index, text = SuffixIndex(window=16), []
    for _ in range(200):
        chunk = [rng.randrange(3) for _ in range(rng.randint(1, 3))]
        index.extend(chunk)
        text += chunk
        kept = list(index.tokens)
        assert 16 <= len(kept) <= 32 or len(text) < 16
        assert kept == text[len(text) - len(kept) :]
        assert index.match(4) == brute_force_match(kept, 4)


def transitions(index) -> int:
    """Transitions the automaton holds (its ``_next`` maps)."""
    return sum(len(state) for state in index._next)


@pytest.mark.parametrize("kind", ["random", "one token", "two tokens", "fibonacci"])
def test_the_automaton_stays_linear_in_the_tokens_added(kind):
    # Work counted in transitions set and suffix links followed (no timing): at most 4 per token.
    n = 20_000
    rng = random.Random(1)
    if kind == "fibonacci":  # the classic worst case for suffix structures
        a, b = [0], [0, 1]
        while len(b) < n:
            a, b = b, b + a
        text = b[:n]
    else:
        text = {
            "random": [rng.randrange(4) for _ in range(n)],
            "one token": [5] * n,
            "two tokens": [1, 2] * (n // 2),
        }[kind]
    index = SuffixIndex(window=n)
    for i in range(0, n, 3):
        index.extend(text[i : i + 3])
    assert len(index) == n
    # A suffix automaton of n tokens: at most 2n - 1 states and 3n - 4 transitions (each extend adds
    # what its loops visit, so the work stays linear too).
    assert index.num_states <= 2 * n - 1 and transitions(index) <= max(3 * n - 4, 1)


def test_memory_per_request_is_bounded_by_twice_the_window():
    # Bound: at most 2 * window tokens and 2 * (2 * window) - 1 states, whatever the request's length.
    window = 256
    index = SuffixIndex(window=window)
    rng = random.Random(2)
    for _ in range(40 * window):
        index.extend([rng.randrange(1000)])
        assert len(index) <= 2 * window
        assert index.num_states <= 2 * len(index)
    assert transitions(index) <= 3 * len(index)


def brute_force_find(text: list[int], query: list[int], max_tokens: int) -> tuple[int, list[int]]:
    """The longest suffix of ``query`` that occurs in ``text``, and what followed its first
    occurrence there, up to ``max_tokens`` tokens and cut before a negative token."""
    for length in range(len(query), 0, -1):
        suffix = query[len(query) - length :]
        for end in range(length - 1, len(text)):
            if text[end - length + 1 : end + 1] == suffix:
                continuation = []
                for token in text[end + 1 : end + 1 + max_tokens]:
                    if token < 0:
                        break
                    continuation.append(token)
                return length, continuation
    return 0, []


@pytest.mark.parametrize("alphabet", [2, 3, 8])
def test_another_texts_suffix_is_found_as_a_brute_force_search_finds_it(alphabet):
    rng = random.Random(100 + alphabet)
    for _ in range(40):
        text = [rng.randrange(alphabet) if rng.random() > 0.1 else -rng.randint(1, 3) for _ in range(50)]
        index = SuffixIndex()
        index.extend(text)
        for _ in range(10):
            query = [rng.randrange(alphabet) for _ in range(rng.randint(0, 12))]
            assert index.find(query, 5) == brute_force_find(text, query, 5), (text, query)


def test_the_output_cache_continues_an_earlier_output_and_never_across_two():
    from vllm_eagle2.lookup import OutputCache

    cache = OutputCache(tokens=64)
    cache.add([10, 11, 12, 13])
    cache.add([])  # an empty output adds nothing, not even a separator
    cache.add([12, 13, 20, 21])
    assert len(cache) == 10
    assert cache.find([9, 10, 11], 3) == (2, [12, 13])  # stops at the first output's end
    assert cache.find([5, 12, 13], 2) == (2, [])  # its first occurrence ended an output: nothing to copy
    assert cache.find([13, 20], 5) == (2, [21])
    assert cache.find([99], 3) == (0, [])


def test_the_output_cache_holds_at_most_twice_its_size():
    from vllm_eagle2.lookup import OutputCache

    rng = random.Random(0)
    cache = OutputCache(tokens=100)
    for _ in range(300):
        cache.add([rng.randrange(50) for _ in range(rng.randint(1, 20))])
        assert len(cache) <= 200 and cache.num_states <= 2 * len(cache)
    assert len(cache) >= 100


def runner_with(texts: list[list[int]]) -> SimpleNamespace:
    """What :meth:`LookupDrafts.chains` reads of vLLM's model runner: each request's text on the host."""
    ids = np.zeros((len(texts), max(map(len, texts))), dtype=np.int64)
    for i, text in enumerate(texts):
        ids[i, : len(text)] = text
    lengths = np.array([len(t) for t in texts])
    batch = SimpleNamespace(token_ids_cpu=ids, num_tokens_no_spec=lengths, num_prompt_tokens=lengths)
    discard = SimpleNamespace(np=np.zeros(len(texts), dtype=bool))
    return SimpleNamespace(input_batch=batch, discard_request_mask=discard)


#: A 12-token span, then its first 9 again: a match of 9 tokens (bucket 8-15), 8 tokens to continue.
REPEATED = list(range(100, 112)) + list(range(100, 109))
UNIQUE = list(range(200, 220))


def test_the_outlook_prices_a_chain_by_its_match_length_and_a_request_without_one_at_zero():
    drafts = LookupDrafts(8, torch.device("cpu"))
    chains = drafts.chains(runner_with([REPEATED, UNIQUE]), ["a", "b"], None)
    assert chains.buckets.tolist() == [3, -1]
    rate = PRIOR_RATES[3]
    assert chains.reach(8) == pytest.approx(np.array([rate ** np.arange(1, 9), np.zeros(8)]))
    assert chains.reach(3) == pytest.approx(np.array([rate ** np.arange(1, 4), np.zeros(3)]))


def test_the_outlook_follows_the_acceptance_verification_teaches():
    drafts = LookupDrafts(8, torch.device("cpu"))
    runner = runner_with([REPEATED])
    before = drafts.chains(runner, ["a"], None).reach(8)[0, 0]
    for _ in range(5):  # the chain's first token reached and rejected, five times
        one = torch.ones((1, 1), dtype=torch.long)
        drafts.record(one.bool(), torch.tensor([3]), -one, one, -one)
    for _ in range(2):  # the outlook reads the rates of the step before
        chains = drafts.chains(runner, ["a"], None)
    after = chains.reach(8)[0, 0]
    assert after < 0.5 * before, (before, after)
