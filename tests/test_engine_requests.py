"""Per-request behaviour with eagle2 equals the engine without speculation.

Two engines stay up for the module (eagle2 with a partly-right head, and no speculation):
logprobs, tiny max_tokens, stop tokens inside an accepted path, prompts that leave less room
than the tree in max_model_len, and mixed greedy/sampled batches.
"""

from __future__ import annotations

import pytest
import torch
from conftest import freeze_heap

from vllm_eagle2_tools.testing import build_pair

MAX_MODEL_LEN = 256


def make_llm(target, spec):
    """An engine whose core runs in this process: it starts in half the time of its own process."""
    from vllm import LLM

    from vllm_eagle2_tools.engine import scoped_env

    with scoped_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        return LLM(
            model=str(target),
            speculative_config=spec,
            dtype="float32",
            enforce_eager=True,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=8,
            seed=0,
            disable_log_stats=False,
        )


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    target, head = build_pair(tmp_path_factory.mktemp("request_models"), "partial", seed=0)
    spec = {"method": "eagle2", "model": str(head), "num_speculative_tokens": 12, "depth": 4, "topk": 3}
    spec["budget"] = "fixed"  # every step drafts: the request features meet trees every step
    llms = {"eagle2": make_llm(target, spec), "plain": make_llm(target, None)}
    yield llms
    for llm in llms.values():
        llm.llm_engine.engine_core.shutdown()
    llms.clear()
    freeze_heap()


def both(engines, prompts, params):
    return [engines[name].generate(prompts, params, use_tqdm=False) for name in ("eagle2", "plain")]


def stats(engines) -> dict:
    """What the eagle2 engine's verification has exercised so far (drafts verified, KV moves). Not
    from ``get_metrics()``: with two engines up, vLLM's collectors are the last-started engine's."""
    return engines["eagle2"].collective_rpc("eagle2_stats")[0]


def grew(before: dict, after: dict, *keys: str) -> bool:
    return all(after[k] > before[k] for k in keys)


def prompt(n: int, seed: int = 0) -> dict:
    return {"prompt_token_ids": [(seed * 131 + 7 * i) % 500 + 6 for i in range(n)]}


def greedy(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 24, **kwargs})


def ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_logprobs_of_emitted_tokens_match(engines):
    before = stats(engines)
    spec, plain = both(engines, [prompt(9), prompt(30, 1)], greedy(logprobs=3))
    assert ids(spec) == ids(plain)
    assert grew(before, stats(engines), "drafts", "kv_moves")  # logprobs along moved paths too
    for a, b in zip(spec, plain):
        for pos_a, pos_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(pos_a) == set(pos_b)
            for token in pos_a:
                assert pos_a[token].logprob == pytest.approx(pos_b[token].logprob, abs=1e-4)


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_tiny_max_tokens(engines, max_tokens):
    spec, plain = both(engines, [prompt(5), prompt(40, 2)], greedy(max_tokens=max_tokens))
    assert ids(spec) == ids(plain)
    assert all(len(t) == max_tokens for t in ids(spec))


def test_stop_token_inside_an_accepted_path_ends_the_output_there(engines):
    reference = ids(engines["plain"].generate([prompt(12, 3)], greedy(), use_tqdm=False))[0]
    stop = reference[7]
    before = stats(engines)
    spec, plain = both(engines, [prompt(12, 3)], greedy(stop_token_ids=[stop]))
    assert ids(spec) == ids(plain)
    assert grew(before, stats(engines), "drafts")
    assert ids(spec)[0][-1] == stop and len(ids(spec)[0]) == reference.index(stop) + 1


def test_prompt_leaving_less_room_than_the_tree(engines):
    # 240 + 16 = max_model_len: the draft tree cannot fit near the end; output must not change.
    before = stats(engines)
    spec, plain = both(engines, [prompt(240, 4), prompt(8, 5)], greedy(max_tokens=16))
    assert ids(spec) == ids(plain)
    assert grew(before, stats(engines), "drafts")  # the short prompt still drafts


def test_mixed_greedy_and_seeded_sampling_batch(engines):
    from vllm import SamplingParams

    params = [
        greedy(),
        SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
        greedy(max_tokens=10),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=24, ignore_eos=True),
    ]
    prompts = [prompt(10, i) for i in range(4)]
    first = engines["eagle2"].generate(prompts, params, use_tqdm=False)
    again = engines["eagle2"].generate(prompts, params, use_tqdm=False)
    plain = engines["plain"].generate(prompts, params, use_tqdm=False)
    assert ids(first)[0] == ids(plain)[0] and ids(first)[2] == ids(plain)[2]  # greedy rows exact
    assert ids(first) == ids(again)  # seeded sampling is reproducible run to run


def test_requests_with_penalties_are_decoded_exactly_without_drafts(engines):
    prompts = [prompt(10, 6), prompt(20, 7)]
    params = greedy(repetition_penalty=1.3, presence_penalty=0.5)
    before = stats(engines)
    spec, plain = both(engines, prompts, params)
    assert ids(spec) == ids(plain)
    after = stats(engines)
    assert after["drafts"] == before["drafts"]  # no drafts for them
    assert after["requests_without_drafts"] - before["requests_without_drafts"] == len(prompts)
    unpenalised = engines["plain"].generate(prompts, greedy(), use_tqdm=False)
    assert ids(plain) != ids(unpenalised)  # and the penalties changed what was sampled


def test_n_greater_than_one_with_seeded_sampling_is_reproducible(engines):
    from vllm import SamplingParams

    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    first = engines["eagle2"].generate([prompt(9, 8)], params, use_tqdm=False)[0]
    again = engines["eagle2"].generate([prompt(9, 8)], params, use_tqdm=False)[0]
    assert len(first.outputs) == 3
    assert [list(c.token_ids) for c in first.outputs] == [list(c.token_ids) for c in again.outputs]


def test_model_defaults_that_turn_drafts_off_are_named():
    from vllm_eagle2.engine.eligibility import drafting_blockers

    assert drafting_blockers({"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05}) == [
        "repetition_penalty=1.05"
    ]
    assert drafting_blockers({"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.0}) == []


def _warm_up_on_this_cpu(worker) -> dict:
    """In the worker: the drafter's kernel limits and caches, warmed up under the Triton
    interpreter as the GPU worker does it before vLLM's JIT monitor starts."""
    from vllm_eagle2.engine import attention, startup
    from vllm_eagle2.kernels.warmup import warm_up_kernels

    drafter = worker.model_runner.drafter
    limits = startup.kernel_limits(drafter)
    caches = attention.tree_caches(drafter.vllm_config.compilation_config.static_forward_context)
    launches = warm_up_kernels(limits, drafter.device, caches)
    return {"limits": limits, "caches": [c.key_cache.shape for c in caches], "launches": launches}


def test_kernel_warm_up_reads_its_limits_and_caches_from_the_engine(engines):
    """The glue of the GPU worker's warm-up, run on this engine's own head, target and caches
    (m=12 d=4 k=3: a verified tree of 13 rows with its root, a draft level of 3 queries over
    a region of 9 + 3)."""
    out = engines["eagle2"].collective_rpc(_warm_up_on_this_cpu)[0]
    limits = out["limits"]
    assert (limits.draft_vocab, limits.target_vocab, limits.max_topk, limits.max_nodes) == (512, 512, 3, 13)
    assert limits.draft_dtype == torch.float32 and limits.target_dtypes == (torch.float32,)
    assert limits.max_rows == engines["eagle2"].llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert out["caches"] and all(shape[1:] == (2, 128, 32) for shape in out["caches"]), out["caches"]
    assert out["launches"] > 0
