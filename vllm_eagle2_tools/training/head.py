"""The trainable EAGLE head (vLLM's ``EagleLlamaForCausalLM`` semantics) and its build, load and export.

At position ``i`` the input is ``fc(cat(embed(t_{i+1}), z_i))``, then Llama decoder layers (the first
without input norm), then the target's frozen ``lm_head`` with no final norm.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_eagle2_tools.training.features import frozen_target_weights, load_target_tensors


class _Norm(nn.Module):
    """RMSNorm with a ``weight`` parameter (vLLM/HF semantics: normalise in float32)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x * rsqrt(mean(x^2) + eps) * weight."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class _Attention(nn.Module):
    """Llama self-attention (GQA, neox RoPE) with HF parameter names.

    q/k/v read ``in_features`` (default: the hidden size; EAGLE-3's layer reads 2H), o_proj writes H.
    """

    def __init__(self, cfg: Any, in_features: int | None = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        d_in = in_features or h
        self.num_heads = cfg.num_attention_heads
        self.num_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // self.num_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(d_in, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_in, self.num_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_in, self.num_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: Sequence[int],
        past: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Attention within each packed sequence; x [T, H], cos/sin [T, d]; returns (out, this step's (k, v)).

        ``past``: the (k, v) [T, kv_heads, d] of the earlier unrolled steps 1..s-1 (see
        :meth:`EagleHead.forward_unrolled`); step s's row r sees step 1's rows <= r - (s - 1) (the context
        the draft cache holds, made from the target's features) and step j's row r - (s - j) for
        j = 2..s (its own earlier drafts). With no ``past`` this is plain causal attention.
        """
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv, self.head_dim)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        keys = [kv[0] for kv in past] + [k]
        values = [kv[1] for kv in past] + [v]
        attend = packed_attention if x.is_cuda else per_sequence_attention
        o = attend(q, keys, values, seq_lens)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim)), (k, v)


def per_sequence_attention(
    q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], seq_lens: Sequence[int]
) -> torch.Tensor:
    """Attention of packed queries q [T, heads, d] over the keys/values [T, kv_heads, d] of unrolled
    steps 1..s (``keys[j]`` is step j+1's), one SDPA call per sequence: no work across sequences, so
    the CPU's choice. Returns [T, heads, d]."""
    steps = len(keys)
    rep = q.shape[1] // keys[0].shape[1]
    outs: list[torch.Tensor] = []
    start = 0
    for n in seq_lens:
        qs = q[start : start + n].transpose(0, 1)
        ks = torch.cat([kk[start : start + n] for kk in keys]).transpose(0, 1).repeat_interleave(rep, 0)
        vs = torch.cat([vv[start : start + n] for vv in values]).transpose(0, 1).repeat_interleave(rep, 0)
        if steps == 1:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=unrolled_mask(n, steps, q.device))
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs)


def packed_attention(
    q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], seq_lens: Sequence[int]
) -> torch.Tensor:
    """:func:`per_sequence_attention` as one SDPA call over the whole packed batch, under a
    [T, s * T] mask that adds "same sequence" to :func:`unrolled_mask`'s rule.

    Does T / mean(seq_len) times the useful work, but in a handful of launches instead of a dozen per
    sequence and step: on a GPU the per-sequence loop, not the arithmetic, bounds training speed.
    """
    t, steps = q.shape[0], len(keys)
    rep = q.shape[1] // keys[0].shape[1]
    lens = torch.as_tensor(list(seq_lens), device=q.device)
    seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=q.device), lens, output_size=t)
    r = torch.arange(t, device=q.device)[:, None]
    same = seq[:, None] == seq[None, :]
    mask = torch.cat(
        [same & (r.T <= r - (steps - 1))] + [same & (r.T == r - (steps - j)) for j in range(2, steps + 1)], 1
    )
    ks = torch.cat(list(keys)).transpose(0, 1).repeat_interleave(rep, 0)  # [heads, s * T, d]
    vs = torch.cat(list(values)).transpose(0, 1).repeat_interleave(rep, 0)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], ks[None], vs[None], attn_mask=mask)
    return o[0].transpose(0, 1)


def unrolled_mask(n: int, steps: int, device: torch.device | None = None) -> torch.Tensor:
    """[n, steps * n] bool: which keys of steps 1..``steps`` row r of step ``steps`` may attend to.

    Step 1's block is causal shifted back by ``steps - 1`` rows; step j's block (j >= 2) is the single
    row r - (steps - j), so the diagonal of the last block is always open (no row is left without keys).
    """
    r = torch.arange(n, device=device)[:, None]
    c = torch.arange(n, device=device)[None, :]
    blocks = [c <= r - (steps - 1)] + [c == r - (steps - j) for j in range(2, steps + 1)]
    return torch.cat(blocks, 1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, d] with cos/sin [T, d]."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos[:, None, :] + torch.cat([-x2, x1], -1) * sin[:, None, :]


class _MLP(nn.Module):
    """SwiGLU MLP with HF parameter names."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = nn.Linear(h, inter, bias=bias)
        self.up_proj = nn.Linear(h, inter, bias=bias)
        self.down_proj = nn.Linear(inter, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """Llama decoder layer: r = x + attn(in_norm(x)); out = r + mlp(norm(r)).

    The first layer of an EAGLE head has no input norm (``in_norm`` = identity), as in vLLM's head;
    later layers have one (vLLM builds ``input_layernorm`` for every layer but the first).
    """

    def __init__(self, cfg: Any, input_norm: bool = False) -> None:
        super().__init__()
        # nn.Identity has no weight, so the first layer's checkpoint has no input_layernorm (vLLM's neither)
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: Sequence[int],
        past: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One layer over packed sequences; returns (out, this step's attention (k, v))."""
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, seq_lens, past)
        residual = x + attn
        return residual + self.mlp(self.post_attention_layernorm(residual)), kv


class EagleHead(nn.Module):
    """Trainable EAGLE head; ``state_dict()`` keys are exactly vLLM's eagle checkpoint keys.

    The target's embedding (in its own dtype) and ``lm_head`` (in the vocabulary matmuls' dtype, bf16
    until :meth:`set_vocab_dtype`) are frozen, non-persistent buffers, so they are never saved.

    A config with ``aux_hidden_state_layers`` (a measurement, not a format vLLM or the plugin loads)
    adds EAGLE-3's extra input: where the head reads a target feature z_i it reads
    ``z_i + aux_fc(cat(RMSNorm_l(a_i^l) for each listed layer l))``, ``a_i^l`` the residual stream
    entering target layer l; its own drafted features get nothing added. ``aux_fc`` starts at zero.
    """

    def __init__(self, cfg: Any, embed: torch.Tensor, lm_head: torch.Tensor, fc_bias: bool = False) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        h = cfg.hidden_size
        self.config = cfg
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        num_aux = len(getattr(cfg, "aux_hidden_state_layers", None) or [])
        if num_aux:
            self.aux_norms = nn.ModuleList([_Norm(h, cfg.rms_norm_eps) for _ in range(num_aux)])
            self.aux_fc = nn.Linear(num_aux * h, h, bias=False)
        self.layers = nn.ModuleList([_Layer(cfg, input_norm=i > 0) for i in range(cfg.num_hidden_layers)])
        self.register_buffer("embed_weight", embed.detach().clone(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head.detach().to(torch.bfloat16), persistent=False)
        self.rotary = LlamaRotaryEmbedding(cfg)
        for p in self.rotary.parameters():
            p.requires_grad_(False)

    def set_vocab_dtype(self, dtype: torch.dtype) -> None:
        """Run the loss's vocabulary matmuls in ``dtype`` (the training's precision: bf16 only where the
        machine runs it fast; emulated on an AVX2 CPU it took a step from about 6 s to 2 min)."""
        self.lm_head_weight = self.lm_head_weight.to(dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        aux: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Head output [T, H] (float32) for packed tokens [T] (token i+1), target hidden [T, H] (of i)
        and, for a head with aux layers, the target's aux hidden states [T, A * H] (of i)."""
        return self.forward_unrolled(tokens, hidden, positions, seq_lens, 1, aux)[0]

    def forward_unrolled(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        steps: int,
        aux: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Outputs [T, H] of drafting depths 1..``steps``, as the drafter runs them on its own features.

        Depth 1 is :meth:`forward`. At depth s, row r reads (token r+1, the depth s-1 output of row r-1)
        in place of the target's feature, and attends as :func:`unrolled_mask` says: to the cache the
        target's features built up to row r - s + 1, then to its own chain of earlier drafts. Its targets
        are row r's, so a head trained on them learns to predict from its own (drifting) features
        (EAGLE-3's training-time test). The first s - 1 rows of each sequence have no such input and
        read their own row's: callers leave them out of the loss.
        """
        emb, cos, sin, prev = unroll_inputs(self.embed_weight, self.rotary, tokens, positions, seq_lens)
        feats = hidden.float()
        if hasattr(self, "aux_fc"):
            if aux is None:
                raise ValueError("this head reads aux hidden states: pass aux [T, A * H]")
            parts = aux.float().split(self.config.hidden_size, -1)
            feats = feats + self.aux_fc(torch.cat([n(a) for n, a in zip(self.aux_norms, parts)], -1))
        outs: list[torch.Tensor] = []
        past: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]  # per layer, per step
        for _ in range(steps):
            out = self.fc(torch.cat([emb, feats], -1))
            for layer, layer_past in zip(self.layers, past):
                out, kv = layer(out, cos, sin, seq_lens, layer_past)
                layer_past.append(kv)
            outs.append(out)
            feats = out.index_select(0, prev)
        return outs


def unroll_inputs(
    embed_weight: torch.Tensor,
    rotary: nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every drafting depth of a packed batch shares: token embeddings [T, H] (float32), RoPE
    cos / sin [T, D], and ``prev`` [T] int64, row r-1 of the same sequence (a first row: itself), the row
    whose output a depth >= 2 reads."""
    emb = embed_weight[tokens].float()
    with torch.no_grad():
        cos, sin = rotary(emb[None], positions[None].long())
    prev = torch.arange(tokens.numel(), device=tokens.device) - 1
    starts = torch.tensor([0, *seq_lens], device=tokens.device).cumsum(0)[: len(seq_lens)]
    prev[starts] = starts
    return emb, cos[0].float(), sin[0].float(), prev


@torch.no_grad()
def fan_in_init_(head: nn.Module) -> None:
    """Every matrix N(0, 1/fan_in), every bias 0 (norm weights keep their 1): the random init both heads
    start from before any target weights are copied in."""
    for name, p in head.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 2:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))


def head_config(target_cfg: Any, num_layers: int = 1) -> Any:
    """The head's ``LlamaConfig``: the target's, with ``num_layers`` layers and the Llama architecture."""
    from transformers import LlamaConfig

    d = target_cfg.to_dict()
    for key in ("architectures", "num_hidden_layers", "auto_map", "quantization_config", "layer_types"):
        d.pop(key, None)
    d["model_type"] = "llama"
    cfg = LlamaConfig(**d)
    cfg.num_hidden_layers = num_layers
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.tie_word_embeddings = False
    return cfg


def check_aux_layers(target_cfg: Any, aux_layers: Sequence[int]) -> None:
    """Exit naming ``--aux-layers`` unless every index is a target layer, 0..L-1 (``hidden_states[L]``
    is the last layer's normed output, the head's main input already)."""
    n = target_cfg.num_hidden_layers
    bad = [j for j in aux_layers if not 0 <= j < n]
    if bad:
        raise SystemExit(f"error: --aux-layers {bad} not in 0..{n - 1} (target layers)")


def build_head(
    target_dir: Path,
    *,
    init: str = "target",
    fc_bias: bool = False,
    seed: int = 0,
    num_layers: int = 1,
    aux_layers: Sequence[int] = (),
) -> EagleHead:
    """Head for ``target_dir``: ``init="target"`` copies its last layer into every head layer and sets
    ``fc = [0 | I]``; the first layer's ``o_proj`` and ``down_proj`` are scaled by 0.1, later layers'
    are zero (each later layer starts as the identity, so a head grown from a trained one by
    :func:`load_head_weights` starts with that head's outputs).

    ``init="random"`` draws every weight from N(0, 1/fan_in) (norm weight 1, biases 0). With
    ``aux_layers`` (target layer indices) the head also reads those layers (see :class:`EagleHead`);
    its ``aux_fc`` starts at zero either way, so the head starts as the plain one.
    """
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(str(target_dir))
    cfg = head_config(tcfg, num_layers)
    check_aux_layers(tcfg, aux_layers)
    if aux_layers:
        cfg.aux_hidden_state_layers = list(aux_layers)
    embed, lm_head = frozen_target_weights(target_dir)
    torch.manual_seed(seed)
    head = EagleHead(cfg, embed, lm_head, fc_bias=fc_bias)
    h = cfg.hidden_size
    with torch.no_grad():
        fan_in_init_(head)
        if init == "target":
            last = tcfg.num_hidden_layers - 1
            prefix = f"model.layers.{last}."
            wanted = [prefix + k for k, _ in head.layers[-1].named_parameters()]
            sd = load_target_tensors(target_dir, wanted)
            for layer in head.layers:
                for k, p in layer.named_parameters():
                    if prefix + k in sd:
                        p.copy_(sd[prefix + k].float())
            # fc = [0 | I] and damped branches: the head starts close to "output = z_i" and learns the step
            # to z_{i+1} (measured: learns top-1 faster than a random init or fc = [I | I] / 2).
            head.fc.weight.zero_()
            head.fc.weight[:, h:].copy_(torch.eye(h))
            head.layers[0].self_attn.o_proj.weight.mul_(0.1)
            head.layers[0].mlp.down_proj.weight.mul_(0.1)
            for layer in head.layers[1:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        elif init != "random":
            raise ValueError(f"unknown init {init!r}")
        if aux_layers:
            head.aux_fc.weight.zero_()
    return head


def load_head_weights(head: EagleHead, head_dir: Path) -> None:
    """Copy the weights of an exported head (``head_dir``/model.safetensors) into ``head``.

    ``head`` may have more layers than the saved head, or aux inputs it lacks (growing it): those keep
    their initialisation. Any other mismatch is an error.
    """
    from safetensors.torch import load_file

    sd = load_file(str(head_dir / "model.safetensors"))
    missing, unexpected = head.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    saved_layers = {int(k.split(".")[1]) for k in sd if k.startswith("layers.")}
    missing = [
        k
        for k in missing
        if not (k.startswith("layers.") and int(k.split(".")[1]) not in saved_layers)
        and not (k.startswith("aux_") and not any(x.startswith("aux_") for x in sd))
    ]
    if missing or unexpected:
        raise SystemExit(
            f"error: {head_dir} does not fit this target's head: missing {missing}, extra {unexpected}"
        )


def export_head(head: nn.Module, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``head.config`` as ``config.json`` and ``head.state_dict()`` as ``model.safetensors`` to
    out_dir (an :class:`EagleHead`: no ``embed_tokens``, no ``lm_head``). Floating-point tensors are
    cast to ``dtype``; integer and bool ones (an EAGLE-3 head's ``d2t`` / ``t2d``) are kept as they are."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = head.config
    cfg.dtype = str(dtype).removeprefix("torch.")
    cfg.save_pretrained(out_dir)
    sd = {
        k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
        for k, v in head.state_dict().items()
    }
    tmp = out_dir / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / "model.safetensors")
    return out_dir
