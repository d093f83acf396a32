"""eagle2 inside vLLM is lossless: same tokens as the same engine without speculation.

In both modes vLLM runs: eager, and compiled (its default; the tests marked ``compiled`` compare
with the compiled engine without speculation). Each test asserts what it exercised: drafts
verified and accepted, and for trees, off-chain nodes whose K/V was moved.

Float32 tiny models (docs/design.md, section 4: bf16 rounds differently per batch shape). The "partial"
pair has a head that agrees with its target only ~65% of the time, so trees are accepted
at varied depths and branches: the pair that catches tree-mask and KV-compaction bugs.
"""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
from conftest import acceptance_length, assert_trees_exercised, run_llm

from vllm_eagle2 import draft_vocab
from vllm_eagle2.budget.costs import COSTS_ENV
from vllm_eagle2_tools.testing import build_eagle_head, build_pair, build_target

MAX_TOKENS = 40


def token_prompts(num: int, vocab: int, seed: int) -> list[dict]:
    """Prompts of mixed lengths (3..120 tokens) as token ids."""
    rng = random.Random(seed)
    lengths = [3, 120, 17, 64, 9, 33, 90, 5][:num]
    return [{"prompt_token_ids": [rng.randrange(6, vocab) for _ in range(n)]} for n in lengths]


def greedy(max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tokens_of(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine_models")
    partial_target, noisy_head = build_pair(root / "partial", "partial", seed=0)
    noisy_2l = build_eagle_head(root / "noisy-2l", partial_target, kind="noisy", seed=0, num_layers=2)
    oracle_target, oracle_head = build_pair(root / "oracle", "oracle", seed=0)
    # A head as EAGLE-1/EAGLE-2 publish them: fc with a bias, no embed_tokens (the target's is used).
    published_head = build_eagle_head(
        root / "published-head", oracle_target, kind="oracle", with_fc_bias=True, include_embed=False
    )
    # A random target, and a head built as if the target were token-to-token: rarely right.
    random_target = build_target(root / "random-target", kind="random", seed=1)
    random_head = build_eagle_head(root / "random-head", random_target, kind="oracle", seed=1)
    return {
        "random": random_target,
        "random_head": random_head,
        "partial": partial_target,
        "noisy": noisy_head,
        "noisy_2l": noisy_2l,
        "oracle": oracle_target,
        "oracle_head": oracle_head,
        "published_head": published_head,
    }


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return token_prompts(8, 512, seed=0)


def greedy_reference(target: Path, prompts: list[dict]):
    """``target`` without speculation, greedy: ``get(mode)`` for mode "eager" or "compiled", each
    engine run on first use."""
    done: dict[str, list[list[int]]] = {}

    def get(mode: str = "eager") -> list[list[int]]:
        if mode not in done:
            outputs, _ = run_llm(target, None, prompts, greedy(), compiled=mode == "compiled")
            done[mode] = tokens_of(outputs)
        return done[mode]

    return get


@pytest.fixture(scope="module")
def reference(models, prompts):
    """The partial target without speculation: ``reference(mode)``."""
    return greedy_reference(models["partial"], prompts)


#: An exact head's 4-deep chain: every step accepts all 4 drafts.
CHAIN4 = dict(num_speculative_tokens=4, depth=4, topk=3, tree="chain")


def eagle2(head: Path, **knobs) -> dict:
    """The head's fixed tree unless ``budget`` or ``lookup`` is given: these tests pin the trees they
    check (lookup chains, on by default, have their own tests in ``test_lookup_engine.py``)."""
    return {"method": "eagle2", "model": str(head), "budget": "fixed", "lookup": 0, **knobs}


M12 = dict(num_speculative_tokens=12, depth=4, topk=3)


@pytest.fixture(scope="module")
def m12(models, prompts):
    """eagle2 m=12 d=4 k=3 on the partial pair: ``m12(mode)`` -> (tokens, metrics), run on first use."""
    done: dict[str, tuple[list[list[int]], dict]] = {}

    def get(mode: str) -> tuple[list[list[int]], dict]:
        if mode not in done:
            spec, compiled = eagle2(models["noisy"], **M12), mode == "compiled"
            outputs, metrics = run_llm(models["partial"], spec, prompts, greedy(), compiled=compiled)
            done[mode] = tokens_of(outputs), metrics
        return done[mode]

    return get


@pytest.mark.parametrize(
    "knobs, mode",
    [
        (M12, "eager"),
        (dict(num_speculative_tokens=30, depth=6, topk=5), "eager"),
        (dict(num_speculative_tokens=4, depth=2, topk=4), "eager"),
        (M12, "compiled"),
    ],
    ids=["m12-d4-k3", "m30-d6-k5", "m4-d2-k4", "m12-d4-k3-compiled"],
)
def test_greedy_dynamic_tree_equals_no_speculation(models, prompts, reference, m12, knobs, mode):
    if knobs is M12:
        tokens, metrics = m12(mode)
    else:
        spec = eagle2(models["noisy"], **knobs)
        outputs, metrics = run_llm(models["partial"], spec, prompts, greedy())
        tokens = tokens_of(outputs)
    assert tokens == reference(mode)
    assert_trees_exercised(metrics)
    tau = acceptance_length(metrics)
    assert 1.2 < tau < knobs["depth"] + 1  # partly accepted trees, not all-or-nothing


def test_a_compiled_engine_loaded_from_the_compile_cache_equals_no_speculation(
    models, prompts, reference, m12
):
    """The second compiled engine of a model loads vLLM's compile cache (on CPU it failed to load
    and compiled again, a minute per engine on SmolLM2) and is as exact as the one that compiled."""
    m12("compiled")  # compiles, or loads a cache an earlier engine left
    spec = eagle2(models["noisy"], **M12)
    outputs, metrics = run_llm(models["partial"], spec, prompts, greedy(), compiled=True)
    assert metrics["aot_loaded"] == 2  # the target and the head, no trace
    assert tokens_of(outputs) == reference("compiled")
    assert_trees_exercised(metrics)


def test_compiled_mode_accepts_as_many_drafts_as_eager(m12):
    """Same trees, same verifier: a compiled head that misread its inputs drafted worse (vLLM's
    compiled head was traced on int32 ids; int64 ids took tau from 3.67 to 2.12 here)."""
    eager, compiled = m12("eager")[1], m12("compiled")[1]
    assert acceptance_length(compiled) == pytest.approx(acceptance_length(eager), rel=0.02)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_kv_move_that_moves_nothing_breaks_equality(models, prompts, reference, monkeypatch, mode):
    """Negative control: these tests see a verifier that leaves accepted off-chain K/V in place."""
    from vllm_eagle2.engine import attention

    monkeypatch.setattr(attention, "move_kv", lambda *args: None)
    spec, compiled = eagle2(models["noisy"], **M12), mode == "compiled"
    outputs, metrics = run_llm(models["partial"], spec, prompts, greedy(), compiled=compiled)
    assert_trees_exercised(metrics)
    assert tokens_of(outputs) != reference(mode)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_tree_mask_that_shows_every_node_breaks_equality(models, prompts, reference, monkeypatch, mode):
    """Negative control: these tests see tree rows that attend to their siblings' K/V too."""
    from vllm_eagle2.engine import verification as runner

    build = runner.build_tree_masks

    def see_all(parents, **kwargs):
        masks = build(parents, **kwargs)
        masks.packed.fill_(-1)  # every bit: every region token visible
        return masks

    monkeypatch.setattr(runner, "build_tree_masks", see_all)
    spec, compiled = eagle2(models["noisy"], **M12), mode == "compiled"
    outputs, metrics = run_llm(models["partial"], spec, prompts, greedy(), compiled=compiled)
    assert_trees_exercised(metrics)
    assert tokens_of(outputs) != reference(mode)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_tree_rows_left_to_vllms_causal_kernel_break_equality(models, prompts, reference, monkeypatch, mode):
    """Negative control: on CPU vLLM's kernel never computes the tree rows (eagle2's kernel alone
    does); without eagle2's, they hold whatever the output buffer held."""
    from vllm_eagle2.engine import cpu_rows

    monkeypatch.setattr(cpu_rows, "cpu_tree_rows", lambda *args: None)
    spec, compiled = eagle2(models["noisy"], **M12), mode == "compiled"
    outputs, metrics = run_llm(models["partial"], spec, prompts, greedy(), compiled=compiled)
    assert metrics["eagle2"]["tree_rows"] > 0
    assert tokens_of(outputs) != reference(mode)


def test_greedy_on_the_glues_cuda_path_equals_no_speculation(models, prompts, reference, monkeypatch):
    """The CUDA path of the glue on this CPU: fixed-shape KV moves, every (request, depth) pair
    written, the no-ops to slot -1, which vLLM's cache writers skip."""
    from vllm_eagle2.device import CUDA_PATH_ENV

    monkeypatch.setenv(CUDA_PATH_ENV, "1")
    outputs, metrics = run_llm(models["partial"], eagle2(models["noisy"], **M12), prompts, greedy())
    assert tokens_of(outputs) == reference()
    assert_trees_exercised(metrics)


def test_head_passes_padded_as_for_a_cuda_graph_stay_exact(models, prompts, reference, monkeypatch):
    """On a GPU every head pass is padded to a captured CUDA-graph size and replayed; here the
    padding runs without the graph: rows past the batch with stale inputs and no KV write."""
    from vllm.config import CUDAGraphMode

    from vllm_eagle2.engine.proposer import Eagle2Proposer

    padded = []

    def pad_to_16(self, num_tokens, use_cudagraphs=True):
        size = -(-num_tokens // 16) * 16
        padded.append(size > num_tokens)
        return CUDAGraphMode.NONE, size, None

    monkeypatch.setattr(Eagle2Proposer, "_determine_batch_execution_and_padding", pad_to_16)
    outputs, metrics = run_llm(models["partial"], eagle2(models["noisy"], **M12), prompts, greedy())
    assert tokens_of(outputs) == reference()
    assert_trees_exercised(metrics)
    assert sum(padded) > 10, padded


def test_a_level_wider_than_the_token_budget_is_narrowed_and_stays_exact(models, prompts, reference):
    """16 tokens a step hold 5 requests of 1 + 2 drafts; 5 x topk 4 = 20 rows per draft level, over
    max_num_batched_tokens: the step drafts with topk 3 instead of overflowing the head's buffers."""
    outputs, metrics = run_llm(
        models["partial"],
        eagle2(models["noisy"], num_speculative_tokens=2, depth=2, topk=4),
        prompts,
        greedy(),
        max_num_batched_tokens=16,
        enable_chunked_prefill=True,
    )
    assert tokens_of(outputs) == reference()
    assert metrics["eagle2"]["narrowed_steps"] > 0, metrics["eagle2"]
    assert_trees_exercised(metrics)


def test_greedy_with_a_two_layer_head_equals_no_speculation(models, prompts, reference):
    # Each draft layer has its own paged KV cache and reads the tree mask: both must hold up.
    spec = eagle2(models["noisy_2l"], num_speculative_tokens=12, depth=4, topk=3)
    outputs, metrics = run_llm(models["partial"], spec, prompts, greedy())
    assert tokens_of(outputs) == reference()
    assert_trees_exercised(metrics)
    assert acceptance_length(metrics) > 1.2


@pytest.mark.parametrize("head", ["noisy", "noisy_2l"])
def test_chain_drafts_exactly_what_vllms_eagle_drafts(models, prompts, head):
    # Same head, same greedy chain: the accepted count at every draft position must match vLLM's
    # own EAGLE step for step (a draft layer that read a stale or wrong KV entry would not).
    def accepted_per_position(spec: dict) -> list[int]:
        _, metrics = run_llm(models["partial"], spec, prompts, greedy())
        return metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]

    k = 3
    vllm_eagle = {"method": "eagle", "model": str(models[head]), "num_speculative_tokens": k}
    chain = eagle2(models[head], num_speculative_tokens=k, depth=k, topk=1, tree="chain")
    expected = accepted_per_position(vllm_eagle)
    assert 0 < expected[-1] < expected[0]  # partly accepted chains
    assert accepted_per_position(chain) == expected


# --- the adaptive budget ---------------------------------------------------------------------------
#: Fixed step costs (seconds = a + b * tokens) under which a few nodes per request pay. The budget
#: then sizes every step's trees from the acceptance it has seen: sizes differ step to step and
#: request to request, deterministically (no timing in the decisions).
STEP_COSTS = '{"target": [0.02, 0.0005], "level": [0.001, 0.0001], "overhead": 0.002}'


@pytest.mark.parametrize(
    "knobs, mode",
    [
        (M12, "eager"),
        (dict(num_speculative_tokens=30, depth=6, topk=5), "eager"),
        (dict(num_speculative_tokens=12, depth=4, topk=3, tree="static"), "eager"),
        (dict(num_speculative_tokens=4, depth=4, topk=3, tree="chain"), "eager"),
        (M12, "compiled"),
    ],
    ids=["m12-d4-k3", "m30-d6-k5", "static", "chain", "m12-d4-k3-compiled"],
)
def test_greedy_with_the_adaptive_budget_equals_no_speculation(
    models, prompts, reference, knobs, mode, monkeypatch
):
    monkeypatch.setenv(COSTS_ENV, STEP_COSTS)
    spec = eagle2(models["noisy"], budget="adaptive", **knobs)
    outputs, metrics = run_llm(models["partial"], spec, prompts, greedy(), compiled=mode == "compiled")
    assert tokens_of(outputs) == reference(mode)
    assert_trees_exercised(metrics, branched=knobs.get("tree") != "chain")
    budget = metrics["eagle2_budget"]
    assert len(budget["drafts_per_step"]) >= 3, budget  # trees of several sizes, step to step
    assert len([n for n in budget["drafts_per_request"] if n != "0"]) >= 2, budget  # and per request


@pytest.fixture(scope="module")
def never_drafting(models, prompts) -> tuple[list[list[int]], dict, Counter]:
    """The adaptive budget under costs where verification is too dear to draft: (tokens, metrics,
    calls of vLLM's rejection sampler and of the head's passes and its draft ``lm_head``)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from vllm_eagle2.engine.head_vocab import HeadVocabulary
    from vllm_eagle2.engine.proposer import Eagle2Proposer

    calls = Counter()
    spec = eagle2(models["noisy"], budget="adaptive", num_speculative_tokens=12, depth=4, topk=3)
    with pytest.MonkeyPatch.context() as mp:
        for cls, name in [
            (RejectionSampler, "forward"),
            (Eagle2Proposer, "_run_head"),
            (HeadVocabulary, "logits"),
        ]:
            stock = getattr(cls, name)
            mp.setattr(
                cls, name, lambda *a, _stock=stock, _name=name, **k: calls.update([_name]) or _stock(*a, **k)
            )
        mp.setenv(COSTS_ENV, '{"target": [0.0, 1.0], "level": [0.001, 0.0], "overhead": 0.0}')
        outputs, metrics = run_llm(models["partial"], spec, prompts, greedy())
    return tokens_of(outputs), metrics, calls


def test_adaptive_budget_drafts_nothing_when_verification_costs_too_much(never_drafting, reference):
    tokens, metrics, _ = never_drafting
    assert tokens == reference()
    budget = metrics["eagle2_budget"]
    assert budget["steps"] > 0 and budget["steps_without_drafts"] == budget["steps"]
    assert metrics["vllm:spec_decode_num_drafts"] == 0


def test_a_step_without_drafts_skips_the_rejection_sampler_and_the_draft_lm_head(never_drafting):
    """vLLM 0.32 sends every step of a speculative engine through its rejection sampler, drafts or
    not; a step eagle2 keeps without drafts samples as plain decoding and drafts nothing."""
    calls = never_drafting[2]
    assert calls["forward"] == 0 and calls["logits"] == 0, calls


def test_greedy_with_only_method_and_model_set_equals_no_speculation(models, prompts, reference):
    # The defaults a new user gets: m=60, depth 6, topk 10 as upper bounds of the adaptive
    # budget, its costs calibrated on this machine at engine start.
    spec = {"method": "eagle2", "model": str(models["noisy"])}
    outputs, metrics = run_llm(models["partial"], spec, prompts, greedy())
    assert tokens_of(outputs) == reference()
    assert metrics["eagle2_budget"]["steps"] > 0
    assert metrics["vllm:spec_decode_num_drafts"] > 0


def test_greedy_on_a_random_target_equals_no_speculation(models, prompts):
    spec = eagle2(models["random_head"], num_speculative_tokens=12, depth=4, topk=3)
    outputs, metrics = run_llm(models["random"], spec, prompts, greedy())
    assert tokens_of(outputs) == tokens_of(run_llm(models["random"], None, prompts, greedy())[0])
    assert_trees_exercised(metrics)  # some drafts accepted, most rejected


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("tree", ["static", "chain", "no_value", "no_rerank"])
def test_greedy_every_tree_mode_equals_no_speculation(models, prompts, reference, tree, mode):
    spec = eagle2(models["noisy"], num_speculative_tokens=10, depth=4, topk=3, tree=tree)
    outputs, metrics = run_llm(models["partial"], spec, prompts, greedy(), compiled=mode == "compiled")
    assert tokens_of(outputs) == reference(mode)
    assert_trees_exercised(metrics, branched=tree != "chain")


def test_chain_drafts_verify_on_vllms_causal_attention_alone(models, prompts, reference):
    """Drafts on their tree's leading chain need no tree mask: a step of chains publishes no tree
    batch and moves no KV (every accepted path is already in place)."""
    from vllm_eagle2.engine import attention
    from vllm_eagle2.engine import verification as tree_runner

    calls = Counter()
    spec = eagle2(models["noisy"], num_speculative_tokens=3, depth=3, topk=1)
    with pytest.MonkeyPatch.context() as mp:
        for owner, name in [(attention.TreeForward, "publish"), (tree_runner, "_move_accepted_path")]:
            stock = getattr(owner, name)
            mp.setattr(
                owner, name, lambda *a, _stock=stock, _n=name, **k: calls.update([_n]) or _stock(*a, **k)
            )
        outputs, metrics = run_llm(models["partial"], spec, prompts, greedy())
    assert tokens_of(outputs) == reference()
    assert_trees_exercised(metrics, branched=False)
    assert calls == Counter(), calls


def test_greedy_with_chunked_prefill_and_prefix_caching(models, prompts, monkeypatch):
    # Repeat the prompts so prefix caching hits; a small token budget forces chunked prefill. vLLM's
    # CPU blocks hold 128 tokens and only whole blocks are cached: two prompts of 2-3 blocks join them.
    from vllm.v1.core.sched.scheduler import Scheduler

    rng = random.Random(1)
    long = [{"prompt_token_ids": [rng.randrange(6, 512) for _ in range(n)]} for n in (300, 270)]
    prompts = prompts[:4] + long
    expected = tokens_of(run_llm(models["partial"], None, prompts, greedy())[0])

    chunked = []
    schedule = Scheduler.schedule

    def counting_schedule(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        for req in out.scheduled_new_reqs:  # a first chunk that stops short of the prompt's end
            left = len(req.prompt_token_ids) - req.num_computed_tokens
            chunked.append(out.num_scheduled_tokens[req.req_id] < left)
        return out

    monkeypatch.setattr(Scheduler, "schedule", counting_schedule)
    spec = eagle2(models["noisy"], num_speculative_tokens=12, depth=4, topk=3)
    outputs, metrics = run_llm(
        models["partial"],
        spec,
        prompts + prompts,
        greedy(),
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=64,
    )
    assert tokens_of(outputs) == expected * 2
    assert any(chunked), "no prompt was prefilled in chunks"
    assert metrics["vllm:prefix_cache_hits"] > 0, "no prompt hit the prefix cache"
    assert_trees_exercised(metrics)


@pytest.mark.parametrize(
    "knobs",
    # The whole pool (topk + (depth-1)·topk² = 30) or the chain: the exact top-1 path is in the
    # tree. (With m < pool, reranking may rightly prefer shallow alternatives to a deep path
    # of low draft confidence, even for an exact head.)
    [
        dict(num_speculative_tokens=30, depth=4, topk=3),
        dict(num_speculative_tokens=4, depth=4, topk=3, tree="chain"),
    ],
    ids=["dynamic-full-pool", "chain"],
)
def test_exact_head_accepts_the_whole_depth(models, prompts, knobs):
    spec = eagle2(models["oracle_head"], **knobs)
    _assert_full_depth(models, prompts, spec, knobs["depth"])


def test_published_head_format_loads_and_is_exact(models, prompts):
    _assert_full_depth(models, prompts, eagle2(models["published_head"], **CHAIN4), CHAIN4["depth"])


def ranked_copy(head: Path, outputs: list[list[int]], dest: Path) -> tuple[Path, int]:
    """``head`` with a draft_vocab.json ranking the tokens of ``outputs``; returns it and their count."""
    ranked = Counter(t for row in outputs for t in row).most_common()
    shutil.copytree(head, dest)
    draft_vocab.write_ranking(dest, [t for t, _ in ranked], [c for _, c in ranked], "test")
    return dest, len(ranked)


def test_greedy_with_a_draft_vocabulary_equals_no_speculation(models, prompts, reference, tmp_path):
    # The 64 most frequent output tokens: the head cannot even propose the others.
    head, _ = ranked_copy(models["noisy"], reference(), tmp_path / "ranked")
    spec = eagle2(head, num_speculative_tokens=12, depth=4, topk=3, draft_vocab_size=64)
    outputs, metrics = run_llm(models["partial"], spec, prompts, greedy())
    assert tokens_of(outputs) == reference()
    assert_trees_exercised(metrics)
    assert acceptance_length(metrics) > 1.2


def test_exact_head_with_a_draft_vocabulary_of_its_outputs_accepts_the_whole_depth(models, prompts, tmp_path):
    # Positions in the draft vocabulary must map back to token ids on the way into the head and
    # out to the verifier; a slip anywhere and the exact head's chains break at depth 1.
    expected = tokens_of(run_llm(models["oracle"], None, prompts, greedy(1 + 8 * 5))[0])
    head, size = ranked_copy(models["oracle_head"], expected, tmp_path / "ranked")
    assert size < 512 // 2  # a real cut of the 512-token vocabulary
    knobs = dict(num_speculative_tokens=4, depth=4, topk=3, tree="chain", draft_vocab_size=size)
    _assert_full_depth(models, prompts, eagle2(head, **knobs), knobs["depth"])


def _assert_full_depth(models, prompts, spec, depth, **engine):
    # 1 token from the prefill, then steps of depth + 1 = 5 tokens each.
    _, metrics = run_llm(models["oracle"], spec, prompts, greedy(1 + 8 * 5), **engine)
    assert acceptance_length(metrics) == pytest.approx(depth + 1, abs=0.05)


def test_drafts_reach_the_scheduler_with_the_steps_output_not_in_a_worker_call_of_their_own(
    models, prompts, monkeypatch
):
    """vLLM's synchronous scheduling asks the worker for the drafts in a third call per step; eagle2's
    come with the sampled tokens, and every one of them is still verified."""
    from vllm.v1.worker.gpu_worker import Worker

    calls = []
    take = Worker.take_draft_token_ids
    monkeypatch.setattr(Worker, "take_draft_token_ids", lambda self: calls.append(1) or take(self))
    _assert_full_depth(models, prompts, eagle2(models["oracle_head"], **CHAIN4), CHAIN4["depth"])
    assert calls == []


def test_drafts_cross_to_an_engine_core_in_its_own_process(models, prompts):
    """The drafts ride on the step's output through vLLM's worker-to-engine queue (pickled)."""
    spec = eagle2(models["oracle_head"], **CHAIN4)
    _assert_full_depth(models, prompts, spec, CHAIN4["depth"], fresh_process=True)
