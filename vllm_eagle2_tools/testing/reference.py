"""A plain-torch float32 twin of vLLM 0.32's EAGLE-1 head forward, and teacher-forced agreement.

- :class:`EagleHeadReference`: ``EagleLlamaForCausalLM``'s forward (one sequence, causal) from a head
  folder and its target folder.
- :func:`teacher_forced_agreement`: how often a head's greedy draft equals the target's greedy token.

Why a second head next to the trainer's (:class:`vllm_eagle2_tools.training.head.EagleHead`): this one is the
independent oracle the tests hold the trainer against. ``tests/test_train_head.py`` exports a trained
head and checks that it computes the same function as this twin of vLLM's forward (embedding first in
``fc``, no input norm in layer 0, neox RoPE, fused add-norm, no final norm). Were the trainer's head the
reference, that test would compare the head with itself, and a bug in the shared code (the attention
function, the RoPE, the ``fc`` order) would pass unseen. So the two are kept apart on purpose: this one
stays minimal, float32 throughout (the trainer keeps ``lm_head`` in bf16), with no packing, no unrolled
drafting and no dependency on :mod:`vllm_eagle2_tools.training`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_eagle2_tools.testing.targets import SPECIAL_TOKENS, _load_config, _load_state

__all__ = ["EagleHeadReference", "teacher_forced_agreement"]


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style (rotate-half) rotary embedding of x [T, heads, d] at positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = positions.float()[:, None] * inv[None, :]  # [T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@dataclass
class EagleHeadReference:
    """Plain-torch float32 twin of vLLM 0.32's ``EagleLlamaForCausalLM`` forward (one sequence, causal).

    Built with :meth:`load`; ``forward`` maps tokens [T] + target hidden states [T, H] (+ positions [T])
    to the head's output hidden states [T, H]; ``logits`` applies the target's ``lm_head`` ([T, V]).
    Independent of the trainer's ``EagleHead`` on purpose (module docstring): the tests check the
    trainer's head against it.
    """

    sd: dict[str, torch.Tensor]
    lm_head: torch.Tensor
    num_layers: int
    num_heads: int
    num_kv_heads: int
    eps: float
    rope_theta: float

    @classmethod
    def load(cls, head_dir: str | Path, target_dir: str | Path) -> EagleHeadReference:
        """Load the head's weights; ``embed_tokens`` falls back to the target's if the head has none."""
        cfg = _load_config(head_dir)
        sd = {k: v.float() for k, v in _load_state(head_dir).items()}
        tsd = _load_state(target_dir)
        sd.setdefault("embed_tokens.weight", tsd["model.embed_tokens.weight"].float())
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        return cls(
            sd=sd,
            lm_head=tsd["lm_head.weight"].float(),
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"],
            eps=cfg["rms_norm_eps"],
            rope_theta=float(theta),
        )

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Head output [T, H] for tokens [T] (token i+1 of the sequence) and target hidden [T, H] (of i)."""
        sd = self.sd
        if positions is None:
            positions = torch.arange(input_ids.shape[0])
        x = torch.cat([sd["embed_tokens.weight"][input_ids], hidden.float()], -1) @ sd["fc.weight"].T
        if "fc.bias" in sd:
            x = x + sd["fc.bias"]
        for i in range(self.num_layers):
            x = self._layer(x, positions, f"layers.{i}.")
        return x

    def _layer(self, x: torch.Tensor, positions: torch.Tensor, p: str) -> torch.Tensor:
        """One causal decoder layer over x [T, H]; the first layer has no ``input_layernorm``."""
        sd = self.sd
        t, h = x.shape
        d = h // self.num_heads
        normed = (
            _rms_norm(x, sd[p + "input_layernorm.weight"], self.eps)
            if p + "input_layernorm.weight" in sd
            else x
        )
        q = (normed @ sd[p + "self_attn.q_proj.weight"].T).view(t, self.num_heads, d)
        k = (normed @ sd[p + "self_attn.k_proj.weight"].T).view(t, self.num_kv_heads, d)
        v = (normed @ sd[p + "self_attn.v_proj.weight"].T).view(t, self.num_kv_heads, d)
        q, k = _rope(q, positions, self.rope_theta), _rope(k, positions, self.rope_theta)
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        a = torch.einsum("hqk,khd->qhd", att, v).reshape(t, h) @ sd[p + "self_attn.o_proj.weight"].T
        residual = x + a
        n = _rms_norm(residual, sd[p + "post_attention_layernorm.weight"], self.eps)
        gate, up = n @ sd[p + "mlp.gate_proj.weight"].T, n @ sd[p + "mlp.up_proj.weight"].T
        return residual + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T

    def logits(self, head_hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [T, V] = target ``lm_head`` applied to the head output (no final norm)."""
        return head_hidden @ self.lm_head.T


@torch.no_grad()
def teacher_forced_agreement(
    target_dir: str | Path,
    head_dir: str | Path,
    *,
    num_seqs: int = 8,
    seq_len: int = 64,
    seed: int = 0,
) -> float:
    """Fraction of positions where the head's greedy draft equals the target's greedy next token.

    Random token sequences ``t_0..t_{T-1}`` (ids >= the 6 special tokens) run through the target in
    transformers (float32); ``z_i`` = post-final-norm hidden state, ``a_i`` = argmax of its logits (the
    target's choice for position i+1). The head sees ``(t_{i+1}, z_i)`` at position i, as vLLM's first
    draft pass does, and its argmax is compared with ``a_{i+1}``: ``num_seqs * (seq_len - 1)`` comparisons.
    """
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    head = EagleHeadReference.load(head_dir, target_dir)
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    hits = total = 0
    for _ in range(num_seqs):
        ids = torch.randint(len(SPECIAL_TOKENS), vocab, (seq_len,), generator=gen)
        out = target.model(input_ids=ids[None])
        z = out.last_hidden_state[0]
        a = target.lm_head(z).argmax(-1)
        draft = head.logits(head.forward(ids[1:], z[:-1], torch.arange(seq_len - 1))).argmax(-1)
        hits += int((draft == a[1:]).sum())
        total += seq_len - 1
    return hits / total
