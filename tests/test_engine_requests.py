"""Per-request behaviour with eagle2 equals the engine without speculation.

Three engines stay up for the module: eagle2 with a partly-right head under the fixed budget
(every step drafts its whole tree) and under eagle2's default, the adaptive budget (on fixed step
costs, so that its decisions do not depend on timing), and no speculation: logprobs, tiny
max_tokens, stop tokens inside an accepted path, prompts that leave less room than the tree in
max_model_len, penalised requests, and mixed greedy/sampled batches. Each test asserts what the eagle2 engine
exercised meanwhile: drafts verified, branching trees recomputed, accepted off-chain K/V moved.
"""

from __future__ import annotations

import pytest
import torch
from conftest import freeze_heap
from test_engine_lossless import STEP_COSTS

from vllm_eagle2.budget.costs import COSTS_ENV
from vllm_eagle2_tools.testing import build_pair

MAX_MODEL_LEN = 256
#: The eagle2 engines: the fixed budget, and the default one.
BUDGETS = ["fixed", "adaptive"]


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
    """{"fixed": eagle2, "adaptive": eagle2 with its default budget, "plain": no speculation}."""
    from vllm_eagle2_tools.engine import scoped_env

    target, head = build_pair(tmp_path_factory.mktemp("request_models"), "partial", seed=0)
    spec = {"method": "eagle2", "model": str(head), "num_speculative_tokens": 12, "depth": 4, "topk": 3}
    # The fixed budget drafts every step: the request features meet trees every step.
    llms = {"fixed": make_llm(target, {**spec, "budget": "fixed"})}
    with scoped_env({COSTS_ENV: STEP_COSTS}):  # the adaptive budget reads them at start-up
        llms["adaptive"] = make_llm(target, spec)
    llms["plain"] = make_llm(target, None)
    yield llms
    for llm in llms.values():
        llm.llm_engine.engine_core.shutdown()
    llms.clear()
    UNSPECULATED.clear()
    freeze_heap()


def both(engines, budget, prompts, params):
    """The outputs of the eagle2 engine with ``budget`` and of the engine without speculation."""
    return [engines[budget].generate(prompts, params, use_tqdm=False), unspeculated(engines, prompts, params)]


#: The engine without speculation's outputs by input: each is generated once, whichever budget asks.
UNSPECULATED: dict[str, list] = {}


def unspeculated(engines, prompts, params):
    """The outputs of the engine without speculation."""
    key = repr((prompts, params))
    if key not in UNSPECULATED:
        UNSPECULATED[key] = engines["plain"].generate(prompts, params, use_tqdm=False)
    return UNSPECULATED[key]


def stats(engines, budget) -> dict:
    """What the eagle2 engine's verification has exercised so far (drafts verified, KV moves). Not
    from ``get_metrics()``: with several engines up, vLLM's collectors are the last-started one's."""
    return engines[budget].collective_rpc("eagle2_stats")[0]


def grew(before: dict, after: dict, *keys: str) -> bool:
    return all(after[k] > before[k] for k in keys)


def assert_trees_exercised(before: dict, after: dict) -> None:
    """Since ``before``: drafts verified, branching trees recomputed with their masks, and accepted
    off-chain nodes' K/V moved (so drafts were accepted, off the leading chain too)."""
    assert grew(before, after, "drafts", "tree_rows", "kv_moves"), (before, after)


def prompt(n: int, seed: int = 0) -> dict:
    return {"prompt_token_ids": [(seed * 131 + 7 * i) % 500 + 6 for i in range(n)]}


def greedy(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, **{"max_tokens": 24, **kwargs})


def ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("budget", BUDGETS)
def test_logprobs_of_emitted_tokens_match(engines, budget):
    before = stats(engines, budget)
    spec, plain = both(engines, budget, [prompt(9), prompt(30, 1)], greedy(logprobs=3))
    assert ids(spec) == ids(plain)
    assert_trees_exercised(before, stats(engines, budget))  # logprobs along moved paths too
    for a, b in zip(spec, plain):
        for pos_a, pos_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert set(pos_a) == set(pos_b)
            for token in pos_a:
                assert pos_a[token].logprob == pytest.approx(pos_b[token].logprob, abs=1e-4)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_tiny_max_tokens(engines, budget, max_tokens):
    before = stats(engines, budget)
    spec, plain = both(engines, budget, [prompt(5), prompt(40, 2)], greedy(max_tokens=max_tokens))
    assert ids(spec) == ids(plain)
    assert all(len(t) == max_tokens for t in ids(spec))
    # The prefill emits the first token; every later step verifies drafts.
    assert grew(before, stats(engines, budget), "drafts") == (max_tokens > 1)


@pytest.mark.parametrize("budget", BUDGETS)
def test_stop_token_inside_an_accepted_path_ends_the_output_there(engines, budget):
    reference = ids(unspeculated(engines, [prompt(12, 3)], greedy()))[0]
    stop = reference[7]
    before = stats(engines, budget)
    spec, plain = both(engines, budget, [prompt(12, 3)], greedy(stop_token_ids=[stop]))
    assert ids(spec) == ids(plain)
    assert_trees_exercised(before, stats(engines, budget))
    assert ids(spec)[0][-1] == stop and len(ids(spec)[0]) == reference.index(stop) + 1


@pytest.mark.parametrize("budget", BUDGETS)
def test_prompt_leaving_less_room_than_the_tree(engines, budget):
    # 240 + 16 = max_model_len: the draft tree cannot fit near the end; output must not change.
    before = stats(engines, budget)
    spec, plain = both(engines, budget, [prompt(240, 4), prompt(8, 5)], greedy(max_tokens=16))
    assert ids(spec) == ids(plain)
    assert_trees_exercised(before, stats(engines, budget))  # the short prompt still drafts


def seeded(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(ignore_eos=True, **{"max_tokens": 24, **kwargs})


#: Seeded sampling, plain and with top-p and top-k.
SEEDED = [seeded(temperature=1.0, seed=7), seeded(temperature=0.8, top_p=0.9, top_k=20, seed=3)]


@pytest.mark.parametrize("budget", BUDGETS)
def test_greedy_rows_of_a_batch_mixed_with_seeded_sampling_equal_no_speculation(engines, budget):
    params = [greedy(), SEEDED[0], greedy(max_tokens=10), SEEDED[1]]
    prompts = [prompt(10, i) for i in range(4)]
    before = stats(engines, budget)
    spec, plain = both(engines, budget, prompts, params)
    assert ids(spec)[0] == ids(plain)[0] and ids(spec)[2] == ids(plain)[2]
    assert_trees_exercised(before, stats(engines, budget))


@pytest.mark.parametrize("budget", BUDGETS)
def test_seeded_sampling_is_reproducible_run_to_run(engines, budget):
    """Under the adaptive budget too, whose trees follow what it learnt from earlier requests: a
    seeded request's token k is drawn from (seed, k) alone (vllm_eagle2/verify/seeded.py)."""
    prompts = [prompt(10, 1), prompt(10, 3)]
    before = stats(engines, budget)
    first = engines[budget].generate(prompts, SEEDED, use_tqdm=False)
    assert_trees_exercised(before, stats(engines, budget))
    again = engines[budget].generate(prompts, SEEDED, use_tqdm=False)
    assert ids(first) == ids(again)


@pytest.mark.parametrize("budget", BUDGETS)
def test_requests_with_penalties_are_decoded_exactly_without_drafts(engines, budget):
    prompts = [prompt(10, 6), prompt(20, 7)]
    params = greedy(repetition_penalty=1.3, presence_penalty=0.5)
    before = stats(engines, budget)
    spec, plain = both(engines, budget, prompts, params)
    assert ids(spec) == ids(plain)
    after = stats(engines, budget)
    assert after["drafts"] == before["drafts"]  # no drafts for them
    assert after["requests_without_drafts"] - before["requests_without_drafts"] == len(prompts)
    unpenalised = unspeculated(engines, prompts, greedy())
    assert ids(plain) != ids(unpenalised)  # and the penalties changed what was sampled


@pytest.mark.parametrize("budget", BUDGETS)
def test_n_greater_than_one_with_seeded_sampling_is_reproducible(engines, budget):
    params = seeded(n=3, temperature=1.0, seed=11, max_tokens=16)
    before = stats(engines, budget)
    first = engines[budget].generate([prompt(9, 8)], params, use_tqdm=False)[0]
    again = engines[budget].generate([prompt(9, 8)], params, use_tqdm=False)[0]
    assert len(first.outputs) == 3
    assert [list(c.token_ids) for c in first.outputs] == [list(c.token_ids) for c in again.outputs]
    assert_trees_exercised(before, stats(engines, budget))


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
    out = engines["fixed"].collective_rpc(_warm_up_on_this_cpu)[0]
    limits = out["limits"]
    assert (limits.draft_vocab, limits.target_vocab, limits.max_topk, limits.max_nodes) == (512, 512, 3, 13)
    assert limits.draft_dtype == torch.float32 and limits.target_dtypes == (torch.float32,)
    assert limits.max_rows == engines["fixed"].llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert out["caches"] and all(shape[1:] == (2, 128, 32) for shape in out["caches"]), out["caches"]
    assert out["launches"] > 0
