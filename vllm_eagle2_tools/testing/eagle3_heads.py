"""Seeded tiny EAGLE-3 heads in vLLM's ``eagle3`` checkpoint format (the format published heads use).

What vLLM 0.32's ``Eagle3LlamaForCausalLM`` (``models/llama_eagle3.py``) computes at position ``i``, with
``a_i`` the target's hidden states entering the listed layers (concatenated in ascending layer order),
``e = E[t_{i+1}]`` the target's embedding (shared: the head ships none) and ``n(.)`` an RMSNorm:

    g = fc(a_i)                      (at draft depth >= 2: the head's own pre-norm output instead)
    x = cat(n_in(e), n_hidden(g));   r = g + o_proj(attention(q(x), k(x), v(x)))
    y = r + MLP(n_post(r));          logits = lm_head(n_final(y))   over the draft vocabulary

and draft index ``j`` is target token ``j + d2t[j]``.

The "partial" head agrees with an "oracle"/"partial" target (:mod:`vllm_eagle2_tools.testing`) part of
the time:
its q and k read only ``n_in(e)``, through the same projection and scaled up, so every position attends
almost only to itself (and to earlier copies of its own token, which carry the same value); v and
``o_proj`` then pass on ``n_in(e)`` (exactly when the target has as many KV heads as heads, else its
projection on the KV subspace). With the MLP and ``n_post`` copied from the target's last layer, the head
output is ``n(e) + m + g`` where the oracle target's is ``e + m``: close, not equal (``e`` has RMS near 1,
not 1; ``fc`` is small noise over the auxiliary states). Tokens outside the draft vocabulary are never
drafted. "random" draws every weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from vllm_eagle2_tools.testing.targets import _head_config, _load_config, _load_state, _normal

__all__ = ["build_eagle3_head"]

Eagle3Kind = Literal["partial", "random"]
Eagle3Layout = Literal["eagle3", "speculators"]
Eagle3Layer = Literal["llama", "qwen3"]
#: Scale of the q and k projections of the "partial" head: self-attention scores far above the rest.
_SELF_ATTENTION_GAIN = 4.0


def build_eagle3_head(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    kind: Eagle3Kind = "partial",
    aux_layers: Sequence[int] = (0, 1, 2),
    draft_vocab_size: int | None = None,
    seed: int = 0,
    layer_prefix: str = "midlayer.",
    layout: Eagle3Layout = "eagle3",
    flags: dict[str, bool] | None = None,
    layer_type: Eagle3Layer = "llama",
) -> Path:
    """Build an EAGLE-3 head for ``target_dir`` (a :func:`~vllm_eagle2_tools.testing.build_target` folder).

    Files: ``config.json`` (a ``LlamaConfig``: ``architectures=["LlamaForCausalLMEagle3"]``, one layer,
    ``vocab_size`` the target's, ``draft_vocab_size``, ``target_hidden_size``,
    ``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``model.safetensors``: ``fc.weight`` [H, A*H],
    ``{layer_prefix}self_attn.{q,k,v}_proj.weight`` [*, 2H], ``o_proj``, ``mlp.*``, ``input_layernorm``,
    ``hidden_norm``, ``post_attention_layernorm``, ``norm.weight``, ``lm_head.weight`` [Vd, H] and, when
    ``Vd`` is below the target's vocabulary, ``d2t`` [Vd] int64 and ``t2d`` [V] bool. No ``embed_tokens``.

    Args:
        kind: see the module docstring.
        aux_layers: target layers (0 .. num_layers) whose input hidden states ``fc`` reads.
        draft_vocab_size: the head's vocabulary; None = the target's (no ``d2t``). Otherwise a seeded
            choice of that many target tokens, ascending.
        seed: seeds every drawn weight and the draft vocabulary.
        layer_prefix: ``midlayer.`` as EAGLE-3 publishes heads, or ``layers.0.`` (vLLM reads both).
        layout: ``eagle3``, the config as EAGLE-3's authors publish it (above); or ``speculators``, as
            vLLM's ``speculators`` and SGLang's SpecForge save heads: ``speculators_model_type``
            "eagle3", the layer's ``LlamaConfig`` nested in ``transformer_layer_config``, the
            auxiliary layers at the top level, ``speculators_config`` (proposal methods, verifier),
            weights under ``layers.0.`` whatever ``layer_prefix`` says.
        flags: with ``speculators``, the config's ``norm_before_residual``, ``norm_before_fc`` (adds
            ``input_norm.weight`` [A*H]) and ``fc_norm`` (adds ``fc_norm.{i}.weight`` [H]); a flag left
            out is left out of the config (vLLM then defaults ``norm_before_residual`` to True). With
            ``norm_before_residual`` the "partial" head's ``hidden_norm`` is scaled down, so that the
            normed ``fc`` output it adds to the residual stays small, as the raw one is.
        layer_type: with ``speculators``, the nested layer's ``model_type``: ``llama``, or ``qwen3``
            (vLLM's ``Eagle3Qwen3ForCausalLM``), which adds per-head ``self_attn.{q,k}_norm.weight`` [d]:
            the "partial" head's set to the self-attention gain (a per-head RMSNorm would otherwise
            undo the scaled-up q and k), the "random" head's drawn near 1.
    """
    if kind not in ("partial", "random"):
        raise ValueError(f"unknown EAGLE-3 head kind {kind!r}")
    if layout not in ("eagle3", "speculators"):
        raise ValueError(f"unknown EAGLE-3 head layout {layout!r}")
    flags = dict(flags or {})
    if (flags or layer_type != "llama") and layout != "speculators":
        raise ValueError("flags and layer_type are fields of the speculators layout")
    if layer_type not in ("llama", "qwen3"):
        raise ValueError(f"unknown EAGLE-3 layer type {layer_type!r}; one of llama, qwen3")
    if layout == "speculators":
        layer_prefix = "layers.0."
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tcfg = _load_config(target_dir)
    tsd = _load_state(target_dir)
    h, inter, vocab = tcfg["hidden_size"], tcfg["intermediate_size"], tcfg["vocab_size"]
    n_heads, n_kv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    d = h // n_heads
    last = tcfg["num_hidden_layers"] - 1
    dtype = tsd["lm_head.weight"].dtype
    gen = torch.Generator().manual_seed(seed + 3_000_017)
    num_aux = len(aux_layers)

    vd = vocab if draft_vocab_size is None else draft_vocab_size
    ids = torch.arange(vocab) if vd == vocab else torch.randperm(vocab, generator=gen)[:vd].sort().values
    p = layer_prefix
    sd: dict[str, torch.Tensor] = {
        f"{p}input_layernorm.weight": torch.ones(h),
        f"{p}hidden_norm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
    }
    if kind == "random":
        sd["fc.weight"] = _normal(gen, (h, num_aux * h), 1 / math.sqrt(num_aux * h))
        sd[f"{p}self_attn.q_proj.weight"] = _normal(gen, (n_heads * d, 2 * h), 1 / math.sqrt(2 * h))
        sd[f"{p}self_attn.k_proj.weight"] = _normal(gen, (n_kv * d, 2 * h), 1 / math.sqrt(2 * h))
        sd[f"{p}self_attn.v_proj.weight"] = _normal(gen, (n_kv * d, 2 * h), 1 / math.sqrt(2 * h))
        sd[f"{p}self_attn.o_proj.weight"] = _normal(gen, (h, n_heads * d), 1 / math.sqrt(h))
        sd[f"{p}mlp.gate_proj.weight"] = _normal(gen, (inter, h), 1 / math.sqrt(h))
        sd[f"{p}mlp.up_proj.weight"] = _normal(gen, (inter, h), 1 / math.sqrt(h))
        sd[f"{p}mlp.down_proj.weight"] = _normal(gen, (h, inter), 1 / math.sqrt(inter))
        sd[f"{p}post_attention_layernorm.weight"] = 1 + _normal(gen, (h,), 0.1)
        sd["lm_head.weight"] = _normal(gen, (vd, h), 3.0 / math.sqrt(h))
    else:
        sd["fc.weight"] = _normal(gen, (h, num_aux * h), 0.1 / math.sqrt(num_aux * h))
        group = n_heads // n_kv
        proj = _normal(gen, (n_kv * d, h), 1 / math.sqrt(h))  # per KV head: what its q and k compare
        basis = torch.linalg.qr(_normal(gen, (h, h), 1.0))[0].T[: n_kv * d]  # orthonormal rows: v's subspace
        q = (
            proj.view(n_kv, d, h).repeat_interleave(group, 0).reshape(n_heads * d, h)
        )  # query head -> its KV head
        o = torch.zeros(h, n_heads * d)
        for g in range(n_kv):  # the first query head of each group passes its KV head's value on
            o[:, g * group * d : (g * group + 1) * d] = basis[g * d : (g + 1) * d].T
        zeros = torch.zeros
        sd[f"{p}self_attn.q_proj.weight"] = torch.cat([_SELF_ATTENTION_GAIN * q, zeros(n_heads * d, h)], 1)
        sd[f"{p}self_attn.k_proj.weight"] = torch.cat([_SELF_ATTENTION_GAIN * proj, zeros(n_kv * d, h)], 1)
        sd[f"{p}self_attn.v_proj.weight"] = torch.cat([basis, zeros(n_kv * d, h)], 1)
        sd[f"{p}self_attn.o_proj.weight"] = o
        for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"):
            sd[f"{p}{name}.weight"] = tsd[f"model.layers.{last}.{name}.weight"].float().clone()
        sd["lm_head.weight"] = tsd["lm_head.weight"].float()[ids].clone()
    if flags.get("norm_before_residual", layout == "speculators"):
        sd[f"{p}hidden_norm.weight"] = torch.full((h,), 0.01 if kind == "partial" else 1.0)
    if layer_type == "qwen3":
        for name in ("q_norm", "k_norm"):
            sd[f"{p}self_attn.{name}.weight"] = (
                torch.full((d,), _SELF_ATTENTION_GAIN) if kind == "partial" else 1 + _normal(gen, (d,), 0.1)
            )
    if flags.get("norm_before_fc"):
        sd["input_norm.weight"] = 1 + _normal(gen, (num_aux * h,), 0.1)
    if flags.get("fc_norm"):
        for i in range(num_aux):
            sd[f"fc_norm.{i}.weight"] = 1 + _normal(gen, (h,), 0.1)
    if vd != vocab:
        sd["d2t"] = ids - torch.arange(vd)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        sd["t2d"] = t2d

    cfg = _head_config(tcfg, 1, dtype)
    if layout == "speculators":
        if layer_type == "qwen3":
            from transformers import Qwen3Config

            layer = {k: v for k, v in cfg.to_dict().items() if k not in ("model_type", "mlp_bias")}
            cfg = Qwen3Config(
                **{**layer, "head_dim": d, "attention_bias": False, "use_sliding_window": False}
            )
        _save_speculators_config(out, cfg, target_dir, vd, h, aux_layers, flags)
    else:
        cfg.architectures = ["LlamaForCausalLMEagle3"]
        cfg.draft_vocab_size = vd
        cfg.target_hidden_size = h
        # In eagle_config: vLLM 0.32 sizes fc from there (a top-level list only picks the layers).
        cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
        cfg.save_pretrained(out)
    from safetensors.torch import save_file

    # d2t and t2d keep their int64 and bool dtypes.
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _save_speculators_config(
    out: Path,
    layer_cfg: Any,
    target_dir: str | Path,
    draft_vocab_size: int,
    target_hidden_size: int,
    aux_layers: Sequence[int],
    flags: dict[str, bool],
) -> None:
    """``config.json`` as ``speculators`` saves an EAGLE-3 head (vLLM reads it with its SpeculatorsConfig)."""
    import json

    layer = layer_cfg.to_dict()
    layer.pop("architectures", None)
    # vLLM sizes fc for 3 auxiliary states unless the layer's config says otherwise.
    layer["num_aux_hidden_states"] = len(aux_layers)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        **flags,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1}
            ],
            "verifier": {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": str(layer.get("torch_dtype", layer.get("dtype", "float32"))).replace("torch.", ""),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
