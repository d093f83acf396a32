"""Seeded tiny test models: a byte-level BPE tokenizer, a tiny Llama target and EAGLE-1 heads.

Everything here is built locally in about a second (no model hub), is deterministic for a seed, and is
saved as a folder that vLLM (and transformers) can load:

- :func:`build_tokenizer`: byte-level BPE trained on Python standard-library source, saved as a
  ``PreTrainedTokenizerFast`` with ``<s>``/``</s>``/``<pad>`` and a small chat template.
- :func:`build_target`: a ``LlamaForCausalLM`` folder (``config.json`` + ``model.safetensors`` + tokenizer).
- :func:`build_eagle_head`: an EAGLE-1 head in vLLM's ``eagle`` format (what
  ``vllm/model_executor/models/llama_eagle.py`` ``EagleLlamaForCausalLM`` loads).
- :func:`build_pair`: a (target, head) pair of a given kind.
- :class:`EagleHeadReference` / :func:`teacher_forced_agreement`: a plain-torch twin of vLLM's EAGLE head
  forward, to measure how often a head's greedy draft equals the target's greedy token.

How the oracle pair is exact under vLLM's semantics (vLLM 0.32, read in ``models/llama.py``,
``models/llama_eagle.py``, ``v1/worker/gpu_model_runner.py``, ``v1/spec_decode/llm_base_proposer.py``):

1. The target ("oracle"): every attention ``o_proj`` is zero and every MLP ``down_proj`` except the last
   layer's is zero. The residual stream of token ``t`` therefore stays ``e = E[t]`` up to the last layer,
   whose MLP adds ``m = MLP(RMSNorm_post(e))``; the pre-norm output is ``y = e + m``, the final norm
   (weight all ones) gives ``z = y / rms(y)``, and the logits are ``W_lm z``. The next token is a function
   of the current token only.
2. What vLLM feeds the drafter: for ``method="eagle"`` the runner passes the target model's output
   ``hidden_states``, and ``LlamaModel.forward`` returns them AFTER ``self.norm`` -- so the head receives
   ``z_i`` (post-final-norm) of position ``i``, paired with token ``t_{i+1}`` (inputs shifted by one; the
   last slot gets the token just sampled).
3. vLLM's head: ``x = fc(cat(embed(t_{i+1}), z_i))`` -- embedding FIRST, hidden state second. The one
   layer has ``input_layernorm = Identity`` and starts with ``residual = x``; attention output ``a``;
   ``post_attention_layernorm`` is the fused add-norm: ``residual = x + a``, ``h = RMSNorm(residual)``;
   ``out = residual + MLP(h)``. There is NO final norm, and the logits are ``lm_head(out)`` with the
   target's ``lm_head`` (the head checkpoint has no ``lm_head``, so vLLM shares the target's; an
   ``embed_tokens`` identical to the target's is shared as well).
4. The oracle head: ``fc = [I | 0]`` so ``x = E[t_{i+1}]`` exactly (the target hidden state is ignored),
   ``o_proj = 0`` so ``a = 0`` and ``residual = x``, and the MLP and ``post_attention_layernorm`` are
   copies of the target's last layer, so ``out = e + m = y``: the target's PRE-final-norm state for token
   ``t_{i+1}``. The target's logits are ``W_lm (y / rms(y))``, a positive multiple of the head's
   ``W_lm y``; with the final norm weight all ones (any uniform positive weight would do) the argmax is
   the same. So the head's greedy draft equals the target's greedy token, at every draft depth (the head
   output fed back as the next "hidden state" is ignored by ``fc``), and acceptance is 100% up to float
   ties. A non-uniform final-norm weight would break this (it is not a scalar multiple).

"partial" targets scale ``o_proj`` down instead of zeroing it, so context moves the logits a little and
the context-free oracle head agrees only part of the time; "noisy" heads add seeded Gaussian noise to
every head weight except ``embed_tokens`` (including the zero ``o_proj``, so the head's own attention
matters too). Such pairs catch tree-mask and KV-compaction bugs on both sides.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

__all__ = [
    "build_tokenizer",
    "build_target",
    "build_eagle_head",
    "build_pair",
    "EagleHeadReference",
    "teacher_forced_agreement",
]

TargetKind = Literal["random", "oracle", "partial"]
HeadKind = Literal["oracle", "noisy", "random"]

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

# Defaults of the "partial" target and the "noisy" head (see build_target / build_eagle_head).
DEFAULT_PARTIAL_ATTN_SCALE = 0.25
DEFAULT_HEAD_NOISE = 0.1


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
            next token depends only on the current token (see the module docstring); "partial" -- like
            "oracle" but ``o_proj`` has std ``attn_scale/sqrt(H)`` instead of 0, so context matters a little.
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
            from the target's last layer: exact for an "oracle" target (module docstring);
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

    cfg = _llama_config(
        vocab_size=tcfg["vocab_size"],
        hidden_size=h,
        num_layers=num_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        intermediate_size=inter,
        max_position_embeddings=tcfg["max_position_embeddings"],
        dtype=dtype,
        bos_token_id=tcfg.get("bos_token_id"),
        eos_token_id=tcfg.get("eos_token_id"),
        pad_token_id=tcfg.get("pad_token_id"),
    )
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


# ----------------------------------------------------------------------------------------------------
# plain-torch reference of vLLM's EAGLE-1 head, and teacher-forced agreement
# ----------------------------------------------------------------------------------------------------
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
