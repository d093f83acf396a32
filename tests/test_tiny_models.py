"""Tests of the seeded tiny models (vllm_eagle2_tools.testing): determinism, oracle exactness, and vLLM.

The vLLM part runs three engines one after another, their cores in this process (under a minute):
random target without speculation, the same target with vLLM's built-in ``eagle`` method (greedy output
must be identical), and the oracle pair with ``eagle`` (mean acceptance length must be ~1 + k).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch
from conftest import acceptance_length, run_llm

from vllm_eagle2_tools.testing import (
    build_eagle_head,
    build_pair,
    build_target,
    build_tokenizer,
    teacher_forced_agreement,
)


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        if (folder / name).exists():
            h.update((folder / name).read_bytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------------
def test_builders_deterministic_and_fast(tmp_path: Path) -> None:
    digests = []
    for run in ("a", "b"):
        t0 = time.perf_counter()
        target, head = build_pair(tmp_path / run, "partial", seed=3)
        elapsed = time.perf_counter() - t0
        assert elapsed < 10.0, f"build_pair took {elapsed:.1f} s"
        digests.append((_digest(target), _digest(head)))
    assert digests[0] == digests[1]
    other, _ = build_pair(tmp_path / "c", "partial", seed=4)
    assert _digest(other) != digests[0][0]


def test_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path / "a", seed=0)
    build_tokenizer(tmp_path / "b", seed=0)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert len(tok) == 512
    text = "def main(argv):\n    return sorted(argv, key=len)  # ünïcode"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and tok.eos_token_id is not None
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_target_loads_in_transformers_and_head_layout(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    target = build_target(tmp_path / "t", kind="random")
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    logits = model(torch.tensor([[0, 10, 20, 30]])).logits[0]
    assert logits.std() > 1.0  # not flat
    head = build_eagle_head(tmp_path / "h", target, kind="oracle", with_fc_bias=True)
    keys = set(load_file(str(head / "model.safetensors")))
    assert "embed_tokens.weight" in keys and "fc.bias" in keys
    assert not any(k.startswith("model.") or "input_layernorm" in k or "lm_head" in k for k in keys)
    assert load_file(str(head / "model.safetensors"))["fc.weight"].shape == (128, 256)
    head2 = build_eagle_head(tmp_path / "h2", target, kind="random", include_embed=False)
    assert "embed_tokens.weight" not in set(load_file(str(head2 / "model.safetensors")))


# ---------------------------------------------------------------------------------------------------
# agreement (plain torch / transformers, teacher-forced)
# ---------------------------------------------------------------------------------------------------
def test_oracle_head_is_exact(tmp_path: Path) -> None:
    target, head = build_pair(tmp_path, "oracle", seed=0)
    assert teacher_forced_agreement(target, head, num_seqs=8, seq_len=64, seed=1) == 1.0
    # the exactness does not depend on fc.bias (zero) nor on the embedding being shared
    head_b = build_eagle_head(tmp_path / "hb", target, kind="oracle", with_fc_bias=True, include_embed=False)
    assert teacher_forced_agreement(target, head_b, num_seqs=4, seq_len=32, seed=2) == 1.0


@pytest.mark.parametrize("seed", [0, 1])
def test_noisy_head_on_partial_target_agrees_partly(tmp_path: Path, seed: int) -> None:
    target, head = build_pair(tmp_path, "partial", seed=seed)
    agreement = teacher_forced_agreement(target, head, num_seqs=8, seq_len=64, seed=seed)
    assert 0.30 < agreement < 0.95, agreement
    # the context-free oracle head is also only partly right on the partial target
    oracle_head = build_eagle_head(tmp_path / "oh", target, kind="oracle", seed=seed)
    assert 0.30 < teacher_forced_agreement(target, oracle_head, seed=seed) < 0.95


# ---------------------------------------------------------------------------------------------------
# vLLM (built-in eagle), three engines one after another
# ---------------------------------------------------------------------------------------------------
PROMPTS = ["def main(argv):", "Hello, my name is", "import os\nimport sys\n", "The result of the parser"]
NUM_SPEC = 3
MAX_TOKENS = 48


def _run_llm(target: Path, head: Path | None) -> tuple[list[list[int]], dict[str, float]]:
    from vllm import SamplingParams

    spec = None if head is None else dict(method="eagle", model=str(head), num_speculative_tokens=NUM_SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs, metrics = run_llm(target, spec, PROMPTS, params)
    return [list(o.outputs[0].token_ids) for o in outputs], metrics


@pytest.fixture(scope="module")
def vllm_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[list[list[int]], dict[str, float]]]:
    root = tmp_path_factory.mktemp("vllm_models")
    random_target = build_target(root / "target-random", kind="random", seed=0)
    # an oracle-style head on a random target: right only part of the time -> accept and reject paths
    random_head = build_eagle_head(root / "head-random", random_target, kind="oracle", seed=0)
    oracle_target, oracle_head = build_pair(root, "oracle", seed=0)
    return {
        "random/nospec": _run_llm(random_target, None),
        "random/eagle": _run_llm(random_target, random_head),
        "oracle/eagle": _run_llm(oracle_target, oracle_head),
    }


def test_vllm_eagle_greedy_is_lossless_and_oracle_accepts_all(vllm_runs) -> None:
    base, _ = vllm_runs["random/nospec"]
    spec, spec_metrics = vllm_runs["random/eagle"]
    assert all(len(t) == MAX_TOKENS for t in base)
    assert spec == base
    # the random-target head is partly right: both acceptance and rejection happen
    assert 1.0 < acceptance_length(spec_metrics) < 1.0 + NUM_SPEC

    _, oracle_metrics = vllm_runs["oracle/eagle"]
    tau = acceptance_length(oracle_metrics)
    print(f"acceptance length: random target {acceptance_length(spec_metrics):.3f}, oracle pair {tau:.3f}")
    assert tau > 1.0 + NUM_SPEC - 0.2, tau
