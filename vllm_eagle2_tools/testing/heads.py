"""Seeded tiny EAGLE-1 heads in vLLM's ``eagle`` checkpoint format, and (target, head) pairs.

- :func:`build_eagle_head`: an EAGLE-1 head in vLLM's ``eagle`` format (what
  ``vllm/model_executor/models/llama_eagle.py`` ``EagleLlamaForCausalLM`` loads), for a target folder from
  :func:`vllm_eagle2_tools.testing.targets.build_target`.
- :func:`build_pair`: a (target, head) pair of a given kind.

What the head kinds mean and why the oracle pair is exact: the :mod:`vllm_eagle2_tools.testing` docstring.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import torch

from vllm_eagle2_tools.testing.targets import (
    TargetKind,
    _head_config,
    _layer_weights,
    _load_config,
    _load_state,
    _normal,
    _save_safetensors,
    build_target,
)

__all__ = ["build_eagle_head", "build_pair"]

HeadKind = Literal["oracle", "noisy", "random"]

# Default of the "noisy" head (see build_eagle_head).
DEFAULT_HEAD_NOISE = 0.1


def build_eagle_head(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    kind: HeadKind = "oracle",
    noise: float = DEFAULT_HEAD_NOISE,
    seed: int = 0,
    with_fc_bias: bool = False,
    include_embed: bool = True,
    num_layers: int = 1,
) -> Path:
    """Build an EAGLE-1 head for ``target_dir`` in vLLM's ``eagle`` checkpoint format.

    Files: ``config.json`` (a ``LlamaConfig`` with ``num_hidden_layers=num_layers``,
    ``architectures=["LlamaForCausalLM"]``, the target's other dimensions; vLLM's ``EAGLEConfig`` turns the
    architecture into ``EagleLlamaForCausalLM``) and ``model.safetensors`` with keys (no ``model.`` prefix):
    ``embed_tokens.weight`` [V, H] (a copy of the target's, so vLLM shares it; left out if not
    ``include_embed``), ``fc.weight`` [H, 2H] acting on ``cat(embedding, target_hidden)``, ``fc.bias`` [H]
    if ``with_fc_bias`` (vLLM's built-in head cannot load it: for the plugin's own head class only),
    ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.post_attention_layernorm.weight``,
    ``layers.0.mlp.{gate,up,down}_proj.weight``. No ``input_layernorm`` in layer 0, no final norm, no
    ``lm_head`` (vLLM shares the target's). Layers 1.. (``num_layers`` > 1) are full Llama layers, with
    ``input_layernorm``.

    Args:
        out_dir: output folder (created).
        target_dir: a folder from :func:`build_target` (its last layer's MLP and norm are copied).
        kind: "oracle" -- ``fc = [I | 0]``, ``o_proj = 0``, MLP and ``post_attention_layernorm`` copied
            from the target's last layer: exact for an "oracle" target (the
            :mod:`vllm_eagle2_tools.testing` docstring);
            "noisy" -- the oracle head plus N(0, (noise/sqrt(fan_in))²) on every weight matrix except
            ``embed_tokens`` (and N(0, noise²·0.1²) on the norm weight), so it agrees only partly;
            "random" -- every weight freshly drawn.
        noise: noise gain of "noisy" (ignored otherwise).
        seed: seeds q/k/v and the noise.
        with_fc_bias: add ``fc.bias`` (zeros for "oracle", noise for "noisy", random for "random").
        include_embed: write ``embed_tokens.weight``.
        num_layers: decoder layers; for "oracle" and "noisy" the layers after the first start as the
            identity (``o_proj`` and ``down_proj`` zero) before any noise, so the oracle stays exact.

    Returns:
        ``out_dir`` as a Path.
    """
    if kind not in ("oracle", "noisy", "random"):
        raise ValueError(f"unknown head kind {kind!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tcfg = _load_config(target_dir)
    tsd = _load_state(target_dir)
    h, inter = tcfg["hidden_size"], tcfg["intermediate_size"]
    n_heads, n_kv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    last = tcfg["num_hidden_layers"] - 1
    dtype = tsd["lm_head.weight"].dtype
    gen = torch.Generator().manual_seed(seed + 1_000_003)

    layer = _layer_weights(gen, "layers.0.", h, inter, n_heads, n_kv, 1.0, 1.0)
    del layer["layers.0.input_layernorm.weight"]
    branch_scale = 1.0 if kind == "random" else 0.0
    for i in range(1, num_layers):
        layer.update(_layer_weights(gen, f"layers.{i}.", h, inter, n_heads, n_kv, branch_scale, branch_scale))
    sd: dict[str, torch.Tensor] = {}
    if kind == "random":
        sd["fc.weight"] = _normal(gen, (h, 2 * h), 1 / math.sqrt(2 * h))
        if with_fc_bias:
            sd["fc.bias"] = _normal(gen, (h,), 0.1)
        sd.update(layer)
    else:
        sd["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        if with_fc_bias:
            sd["fc.bias"] = torch.zeros(h)
        sd.update(layer)
        sd["layers.0.self_attn.o_proj.weight"] = torch.zeros(h, h)
        for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"):
            sd[f"layers.0.{name}.weight"] = tsd[f"model.layers.{last}.{name}.weight"].float().clone()
        if kind == "noisy":
            for name in sorted(sd):
                w = sd[name]
                if w.dim() == 2:
                    sd[name] = w + _normal(gen, tuple(w.shape), noise / math.sqrt(w.shape[1]))
                else:
                    sd[name] = w + _normal(gen, tuple(w.shape), noise * 0.1)
    if include_embed:
        sd["embed_tokens.weight"] = tsd["model.embed_tokens.weight"].clone()

    cfg = _head_config(tcfg, num_layers, dtype)
    cfg.save_pretrained(out)
    _save_safetensors(sd, out / "model.safetensors", dtype)
    return out


def build_pair(root: str | Path, kind: TargetKind = "oracle", seed: int = 0) -> tuple[Path, Path]:
    """Build ``root/target-{kind}`` and ``root/head-{kind}``; returns ``(target_dir, head_dir)``.

    kind "oracle": oracle target + oracle head (greedy acceptance 100%); "partial": partial target + noisy
    head (partial acceptance, attention matters on both sides); "random": random target + random head.
    """
    root = Path(root)
    target = build_target(root / f"target-{kind}", kind=kind, seed=seed)
    head_kind: HeadKind = {"oracle": "oracle", "partial": "noisy", "random": "random"}[kind]  # type: ignore[assignment]
    head = build_eagle_head(root / f"head-{kind}", target, kind=head_kind, seed=seed)
    return target, head
