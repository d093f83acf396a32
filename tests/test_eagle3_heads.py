"""EAGLE-3 heads drafted as eagle2 trees: loaded as vLLM's ``eagle3`` loads them, and lossless.

Tiny heads (:func:`vllm_eagle2_tools.testing.build_eagle3_head`) for the float32 "partial" target, in
both published layouts: EAGLE-3's own (a partly agreeing head with its own 400-token draft vocabulary,
``d2t``, and a random one over the whole vocabulary that reads two auxiliary layers, its layer saved as
``layers.0``), and the ``speculators`` layout of vLLM's speculators and SGLang's SpecForge, with its
flags set, left to vLLM's defaults, with the extra norms they add, and with a Qwen3 layer (q/k norms).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import acceptance_length, assert_trees_exercised, run_llm
from test_engine_lossless import greedy, greedy_reference, token_prompts, tokens_of

from vllm_eagle2.config import Eagle2ConfigError
from vllm_eagle2.head_files import EAGLE, EAGLE3, TargetShape, check_head
from vllm_eagle2_tools.testing import build_eagle3_head, build_pair

DRAFT_VOCAB = 400
#: speculators-layout heads: their config flags (vLLM defaults norm_before_residual to True when absent)
#: and the nested layer's type (a Qwen3 layer adds per-head q/k norms).
SPECULATORS = {
    "speculators": dict(flags={"norm_before_residual": False}),
    "speculators-defaults": dict(flags={}),
    "speculators-fc-norms": dict(
        flags={"norm_before_residual": False, "norm_before_fc": True, "fc_norm": True}
    ),
    "speculators-qwen3": dict(flags={"norm_before_residual": False}, layer_type="qwen3"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle3_models")
    target, eagle_head = build_pair(root, "partial", seed=0)
    partial = build_eagle3_head(root / "eagle3-partial", target, kind="partial", draft_vocab_size=DRAFT_VOCAB)
    random_head = build_eagle3_head(
        root / "eagle3-random", target, kind="random", aux_layers=(1, 2), seed=1, layer_prefix="layers.0."
    )
    heads = {
        name: build_eagle3_head(
            root / name, target, draft_vocab_size=DRAFT_VOCAB, layout="speculators", **spec
        )
        for name, spec in SPECULATORS.items()
    }
    return {"target": target, "eagle_head": eagle_head, "partial": partial, "random": random_head, **heads}


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return token_prompts(8, 512, seed=0)  # 3 to 120 tokens


@pytest.fixture(scope="module")
def reference(models, prompts):
    """The target without speculation: ``reference(mode)``, "eager" or "compiled"."""
    return greedy_reference(models["target"], prompts)


def eagle2(head: Path, **knobs) -> dict:
    return {"method": "eagle2", "model": str(head), "budget": "fixed", **knobs}


def test_head_files_tell_the_formats_apart(models):
    target = TargetShape(hidden_size=128, vocab_size=512, num_layers=2)
    assert check_head(models["eagle_head"], target).format == EAGLE
    partial = check_head(models["partial"], target)
    assert (partial.format, partial.aux_layers, partial.draft_vocab_size) == (EAGLE3, (0, 1, 2), DRAFT_VOCAB)
    random_head = check_head(models["random"], target)
    assert (random_head.format, random_head.aux_layers, random_head.draft_vocab_size) == (EAGLE3, (1, 2), 0)
    for name in SPECULATORS:
        head = check_head(models[name], target)
        assert (head.format, head.aux_layers, head.draft_vocab_size) == (EAGLE3, (0, 1, 2), DRAFT_VOCAB)
        assert "layers.0.self_attn.q_proj.weight" in head.tensors


def test_a_speculators_config_vllm_cannot_read_fails_before_any_weights_load(models, tmp_path):
    target = TargetShape(hidden_size=128, vocab_size=512, num_layers=2)
    config = json.loads((models["speculators"] / "config.json").read_text())
    cases = [
        ({"speculators_model_type": "peagle"}, "speculators_model_type 'peagle'.*allowed: eagle3"),
        # vLLM's own reason: it has Eagle-3 heads for Llama and Qwen3 layers only.
        (
            {"transformer_layer_config": {**config["transformer_layer_config"], "model_type": "gemma"}},
            "vLLM cannot load this speculators config: Unsupported model_type gemma",
        ),
    ]
    for change, message in cases:
        head = tmp_path / message[:10].replace(" ", "_")
        shutil.copytree(models["speculators"], head)
        (head / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(Eagle2ConfigError, match=message):
            check_head(head, target)


@pytest.mark.parametrize("head", ["partial", *SPECULATORS])
def test_one_head_loads_in_vllms_eagle3_and_in_eagle2_and_drafts_the_same_chain(
    models, prompts, reference, head
):
    # The same files, unchanged, in both methods; the greedy chain of eagle2 must accept exactly what
    # vLLM's eagle3 accepts at every position (a wrong auxiliary state, d2t map, norm flag or draft KV
    # would not).
    k = 3
    vllm_eagle3 = {"method": "eagle3", "model": str(models[head]), "num_speculative_tokens": k}
    chain = eagle2(models[head], num_speculative_tokens=k, depth=k, topk=1, tree="chain")
    per_position = []
    for spec in (vllm_eagle3, chain):
        outputs, metrics = run_llm(models["target"], spec, prompts, greedy())
        assert tokens_of(outputs) == reference()
        per_position.append(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"])
    assert 0 < per_position[0][-1] < per_position[0][0]  # partly accepted chains, deep ones too
    assert per_position[1] == per_position[0]


@pytest.mark.parametrize(
    "head, knobs, mode",
    [
        ("partial", dict(num_speculative_tokens=12, depth=4, topk=3), "eager"),
        ("partial", dict(num_speculative_tokens=30, depth=6, topk=5, tree="static"), "eager"),
        ("random", dict(num_speculative_tokens=4, depth=2, topk=4), "eager"),
        ("partial", dict(num_speculative_tokens=12, depth=4, topk=3), "compiled"),
        ("speculators-fc-norms", dict(num_speculative_tokens=12, depth=4, topk=3), "eager"),
        ("speculators-qwen3", dict(num_speculative_tokens=12, depth=4, topk=3), "eager"),
    ],
    ids=[
        "partial-dynamic-m12-d4-k3",
        "partial-static-m30-d6-k5",
        "random-dynamic-m4-d2-k4",
        "partial-dynamic-m12-d4-k3-compiled",
        "speculators-fc-norms-dynamic-m12-d4-k3",
        "speculators-qwen3-dynamic-m12-d4-k3",
    ],
)
def test_greedy_trees_of_an_eagle3_head_equal_no_speculation(models, prompts, reference, head, knobs, mode):
    spec = eagle2(models[head], **knobs)
    outputs, metrics = run_llm(models["target"], spec, prompts, greedy(), compiled=mode == "compiled")
    assert tokens_of(outputs) == reference(mode)
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    if head != "random":
        assert_trees_exercised(metrics)
        assert acceptance_length(metrics) > 1.1  # the trees were partly accepted


def test_greedy_with_only_method_and_model_set_equals_no_speculation(models, prompts, reference):
    # The defaults: the adaptive budget over the paper's (60, 6, 10) tree.
    spec = {"method": "eagle2", "model": str(models["partial"])}
    outputs, metrics = run_llm(models["target"], spec, prompts, greedy())
    assert tokens_of(outputs) == reference()
    assert metrics["vllm:spec_decode_num_drafts"] > 0
