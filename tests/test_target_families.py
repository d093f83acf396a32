"""Targets other than Llama: Qwen2, Qwen3 and a Qwen3 mixture of experts, each drafted by an EAGLE-1 and
an EAGLE-3 head, token for token equal to the same target without speculation (float32).

The targets are the "partial" Llama target converted (:func:`vllm_eagle2_tools.testing.convert_target`):
Qwen2 adds zero q/k/v biases, Qwen3 per-head q/k norms, the MoE target routes every token to two of
four identical experts. vLLM runs each through its own model class, so the tree masks, positions and
KV moves go through those classes' attention layers and, for EAGLE-3, their auxiliary hidden states.
A target whose attention the tree kernel does not implement (here a sliding window) is refused when
the engine starts, naming the feature and the layer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import acceptance_length, assert_trees_exercised, run_llm
from test_engine_lossless import greedy, token_prompts, tokens_of

from vllm_eagle2_tools.testing import TARGET_FAMILIES, build_eagle3_head, build_pair, convert_target

TREE = dict(num_speculative_tokens=12, depth=4, topk=3, budget="fixed")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    llama, head = build_pair(root, "partial", seed=0)
    eagle3 = build_eagle3_head(root / "eagle3", llama, kind="partial", draft_vocab_size=400)
    targets = {family: convert_target(llama, root / f"target-{family}", family) for family in TARGET_FAMILIES}
    sliding = root / "target-sliding-window"
    shutil.copytree(llama, sliding)  # as Mistral and Gemma configs say it: per-layer types, one window
    config = json.loads((sliding / "config.json").read_text())
    config.update(sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    (sliding / "config.json").write_text(json.dumps(config))
    return {"eagle": head, "eagle3": eagle3, "sliding-window": sliding, **targets}


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return token_prompts(6, 512, seed=3)


@pytest.fixture(scope="module")
def reference(models, prompts) -> dict[str, list[list[int]]]:
    """Each target's greedy tokens without speculation, computed once."""
    cache: dict[str, list[list[int]]] = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            cache[family] = tokens_of(run_llm(models[family], None, prompts, greedy())[0])
        return cache[family]

    return get


@pytest.mark.parametrize("head", ["eagle", "eagle3"])
@pytest.mark.parametrize("family", TARGET_FAMILIES)
def test_greedy_trees_on_other_target_families_equal_no_speculation(models, prompts, reference, family, head):
    spec = {"method": "eagle2", "model": str(models[head]), **TREE}
    outputs, metrics = run_llm(models[family], spec, prompts, greedy())
    assert tokens_of(outputs) == reference(family)
    assert_trees_exercised(metrics)
    assert acceptance_length(metrics) > 1.1


def test_a_sliding_window_target_is_refused_at_start_naming_the_feature(models, prompts):
    outputs, _ = run_llm(models["sliding-window"], None, prompts[:1], greedy())  # vLLM serves it alone
    assert tokens_of(outputs)[0]
    spec = {"method": "eagle2", "model": str(models["eagle"]), **TREE}
    with pytest.raises(Exception, match=r"model\.layers\.0\.self_attn\.attn uses sliding-window attention"):
        run_llm(models["sliding-window"], spec, prompts[:1], greedy())
