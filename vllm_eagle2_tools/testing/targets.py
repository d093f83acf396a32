"""Seeded tiny targets: a byte-level BPE tokenizer and a tiny Llama ``LlamaForCausalLM`` folder.

- :func:`build_tokenizer`: byte-level BPE trained on Python standard-library source, saved as a
  ``PreTrainedTokenizerFast`` with ``<s>``/``</s>``/``<pad>`` and a small chat template.
- :func:`build_target`: a ``LlamaForCausalLM`` folder (``config.json`` + ``model.safetensors`` + tokenizer)
  of kind "random", "oracle" or "partial" (what the kinds mean and why the oracle pair is exact under
  vLLM's semantics: the :mod:`vllm_eagle2_tools.testing` docstring).

The weight helpers here (``_normal``, ``_layer_weights``, ``_llama_config``, ``_head_config``,
``_save_safetensors``, ``_load_state``, ``_load_config``) are shared with
:mod:`vllm_eagle2_tools.testing.heads`,
:mod:`vllm_eagle2_tools.testing.eagle3_heads` and :mod:`vllm_eagle2_tools.testing.reference`.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from typing import Literal

import torch

__all__ = ["build_tokenizer", "build_target"]

TargetKind = Literal["random", "oracle", "partial"]

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Standard-library modules whose source is the tokenizer's training text (a few hundred kB).
_CORPUS_MODULES = (
    "argparse",
    "textwrap",
    "string",
    "json.decoder",
    "json.encoder",
    "functools",
    "dataclasses",
)

# Default of the "partial" target (see build_target).
DEFAULT_PARTIAL_ATTN_SCALE = 0.25


# ----------------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------------
def _corpus(seed: int) -> list[str]:
    """Training text: lines of a few stdlib modules' source; the seed picks a 90% subset of the lines."""
    import importlib

    lines: list[str] = []
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        assert module.__file__ is not None
        lines.extend(Path(module.__file__).read_text(encoding="utf-8").splitlines())
    rng = random.Random(seed)
    return [line for line in lines if line.strip() and rng.random() < 0.9]


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, seed: int = 0) -> Path:
    """Train a byte-level BPE tokenizer on local text and save it as a transformers fast tokenizer.

    Args:
        out_dir: folder to write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``
            (and the chat template) into; created if missing.
        vocab_size: total vocabulary, 256 byte tokens + 6 special tokens + merges.
        seed: picks the subset of training lines, so different seeds give (slightly) different merges.

    Returns:
        ``out_dir`` as a Path. Special tokens: ``<s>`` (bos, prepended by the post-processor), ``</s>``
        (eos), ``<pad>``, ``<|system|>``, ``<|user|>``, ``<|assistant|>``; ids 0..5 in that order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
    fast.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------------
def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _save_safetensors(state: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})


def _llama_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    dtype: torch.dtype,
    bos_token_id: int | None,
    eos_token_id: int | None,
    pad_token_id: int | None,
):
    from transformers import LlamaConfig

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype=str(dtype).removeprefix("torch."),
    )


def _head_config(tcfg: dict, num_layers: int, dtype: torch.dtype):
    """A head's ``LlamaConfig``: the target's (``tcfg``, its config.json) shape with ``num_layers`` layers."""
    return _llama_config(
        vocab_size=tcfg["vocab_size"],
        hidden_size=tcfg["hidden_size"],
        num_layers=num_layers,
        num_heads=tcfg["num_attention_heads"],
        num_kv_heads=tcfg["num_key_value_heads"],
        intermediate_size=tcfg["intermediate_size"],
        max_position_embeddings=tcfg["max_position_embeddings"],
        dtype=dtype,
        bos_token_id=tcfg.get("bos_token_id"),
        eos_token_id=tcfg.get("eos_token_id"),
        pad_token_id=tcfg.get("pad_token_id"),
    )


def _layer_weights(
    gen: torch.Generator,
    prefix: str,
    h: int,
    inter: int,
    n_heads: int,
    n_kv: int,
    o_scale: float,
    mlp_scale: float,
) -> dict[str, torch.Tensor]:
    """One Llama layer's weights (HF names under ``prefix``), fan-in scaled normal init.

    ``o_scale`` / ``mlp_scale`` multiply the output projections (0 zeroes the attention / MLP branch).
    """
    d = h // n_heads
    sd = {
        f"{prefix}self_attn.q_proj.weight": _normal(gen, (n_heads * d, h), 1 / math.sqrt(h)),
        f"{prefix}self_attn.k_proj.weight": _normal(gen, (n_kv * d, h), 1 / math.sqrt(h)),
        f"{prefix}self_attn.v_proj.weight": _normal(gen, (n_kv * d, h), 1 / math.sqrt(h)),
        f"{prefix}self_attn.o_proj.weight": _normal(gen, (h, n_heads * d), o_scale / math.sqrt(h)),
        f"{prefix}mlp.gate_proj.weight": _normal(gen, (inter, h), 1 / math.sqrt(h)),
        f"{prefix}mlp.up_proj.weight": _normal(gen, (inter, h), 1 / math.sqrt(h)),
        f"{prefix}mlp.down_proj.weight": _normal(gen, (h, inter), mlp_scale / math.sqrt(inter)),
        f"{prefix}input_layernorm.weight": 1 + _normal(gen, (h,), 0.1),
        f"{prefix}post_attention_layernorm.weight": 1 + _normal(gen, (h,), 0.1),
    }
    return sd


def build_target(
    out_dir: str | Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    kind: TargetKind = "random",
    attn_scale: float = DEFAULT_PARTIAL_ATTN_SCALE,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Build a tiny ``LlamaForCausalLM`` folder (``config.json``, ``model.safetensors``, tokenizer files).

    Init: embeddings N(0, 1); linear weights N(0, 1/fan_in) (unit-gain, so every branch moves the residual
    stream by O(1)); norm weights 1 + N(0, 0.1²); final norm weight exactly 1 for "oracle"/"partial";
    ``lm_head`` N(0, (3/sqrt(H))²) so logits have std ~3 and the greedy argmax is well separated.

    Args:
        out_dir: output folder (created).
        vocab_size: model vocabulary (also the tokenizer's, trained with the same size).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings: shape.
        seed: seeds the tokenizer and every weight; same seed -> byte-identical weights.
        kind: "random" -- every branch active, output depends on context; "oracle" -- every attention
            ``o_proj`` and every MLP ``down_proj`` but the last layer's are zero, final norm weight 1: the
            next token depends only on the current token (see the :mod:`vllm_eagle2_tools.testing` docstring);
            "partial" -- like "oracle" but ``o_proj`` has std ``attn_scale/sqrt(H)`` instead of 0, so
            context matters a little.
        attn_scale: ``o_proj`` gain of the "partial" kind (ignored otherwise).
        dtype: dtype of the saved weights and ``config.dtype``.

    Returns:
        ``out_dir`` as a Path.
    """
    if kind not in ("random", "oracle", "partial"):
        raise ValueError(f"unknown target kind {kind!r}")
    out = Path(out_dir)
    build_tokenizer(out, vocab_size=vocab_size, seed=seed)
    tok_cfg = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in tok_cfg}
    cfg = _llama_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        dtype=dtype,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    gen = torch.Generator().manual_seed(seed)
    h = hidden_size
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _normal(gen, (vocab_size, h), 1.0)}
    for i in range(num_layers):
        last = i == num_layers - 1
        if kind == "random":
            o_scale, mlp_scale = 1.0, 1.0
        else:
            o_scale = attn_scale if kind == "partial" else 0.0
            mlp_scale = 2.0 if last else 0.0
        sd.update(
            _layer_weights(
                gen, f"model.layers.{i}.", h, intermediate_size, num_heads, num_kv_heads, o_scale, mlp_scale
            )
        )
    sd["model.norm.weight"] = 1 + _normal(gen, (h,), 0.1) if kind == "random" else torch.ones(h)
    sd["lm_head.weight"] = _normal(gen, (vocab_size, h), 3.0 / math.sqrt(h))
    cfg.save_pretrained(out)
    _save_safetensors(sd, out / "model.safetensors", dtype)
    return out


def _load_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def _load_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


#: Model families a Llama target converts to (:func:`convert_target`).
TARGET_FAMILIES = ("qwen2", "qwen3", "qwen3_moe")
#: Experts of a converted ``qwen3_moe`` target, and how many each token is routed to.
MOE_EXPERTS, MOE_TOP_K = 4, 2


def convert_target(src_dir: str | Path, out_dir: str | Path, family: str, seed: int = 0) -> Path:
    """The same tiny Llama target (:func:`build_target`) as another model family, for vLLM's model class
    of that family: ``qwen2`` (q/k/v biases, zero), ``qwen3`` (per-head q/k RMSNorms, weight 1: the
    attention changes, the MLP path the heads copy does not), ``qwen3_moe`` (every layer's MLP becomes
    ``MOE_EXPERTS`` identical experts behind a seeded router with ``MOE_TOP_K`` of them per token and
    normalised weights, so that the layer computes what the dense MLP did, through vLLM's MoE code).

    Heads built for ``src_dir`` (:func:`~vllm_eagle2_tools.testing.build_eagle_head`,
    :func:`~vllm_eagle2_tools.testing.build_eagle3_head`) fit the converted target: same vocabulary,
    hidden size, embedding and ``lm_head``.
    """
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if family not in TARGET_FAMILIES:
        raise ValueError(f"unknown target family {family!r}; one of {', '.join(TARGET_FAMILIES)}")
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    tcfg, sd = _load_config(src), _load_state(src)
    dtype = sd["lm_head.weight"].dtype
    h, d, n_heads, n_kv = (
        tcfg["hidden_size"],
        tcfg["head_dim"],
        tcfg["num_attention_heads"],
        tcfg["num_key_value_heads"],
    )
    shape = {
        key: tcfg[key]
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "rms_norm_eps",
            "hidden_act",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        )
    }
    common = dict(shape, tie_word_embeddings=False, rope_theta=10000.0, use_sliding_window=False)
    gen = torch.Generator().manual_seed(seed + 7)
    for i in range(tcfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if family == "qwen2":
            sd[p + "self_attn.q_proj.bias"] = torch.zeros(n_heads * d, dtype=dtype)
            sd[p + "self_attn.k_proj.bias"] = torch.zeros(n_kv * d, dtype=dtype)
            sd[p + "self_attn.v_proj.bias"] = torch.zeros(n_kv * d, dtype=dtype)
        else:
            sd[p + "self_attn.q_norm.weight"] = torch.ones(d, dtype=dtype)
            sd[p + "self_attn.k_norm.weight"] = torch.ones(d, dtype=dtype)
        if family == "qwen3_moe":
            for name in ("gate_proj", "up_proj", "down_proj"):
                weight = sd.pop(f"{p}mlp.{name}.weight")
                for e in range(MOE_EXPERTS):
                    sd[f"{p}mlp.experts.{e}.{name}.weight"] = weight.clone()
            sd[p + "mlp.gate.weight"] = _normal(gen, (MOE_EXPERTS, h), 1.0).to(dtype)
    if family == "qwen2":
        cfg = Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    elif family == "qwen3":
        cfg = Qwen3Config(**common, attention_bias=False, architectures=["Qwen3ForCausalLM"])
    else:
        cfg = Qwen3MoeConfig(
            **common,
            attention_bias=False,
            num_experts=MOE_EXPERTS,
            num_experts_per_tok=MOE_TOP_K,
            moe_intermediate_size=tcfg["intermediate_size"],
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            architectures=["Qwen3MoeForCausalLM"],
        )
    cfg.dtype = str(dtype).removeprefix("torch.")
    cfg.save_pretrained(out)
    _save_safetensors(sd, out / "model.safetensors", dtype)
    return out
