"""The trainable EAGLE-3 head (vLLM 0.32's ``Eagle3LlamaForCausalLM`` semantics): build, init, load, export.

At position ``i``, with ``a_i`` [A*Ht] the target's hidden states entering its aux layers (ascending, as
vLLM concatenates them), ``e = E[t_{i+1}]`` the target's embedding (frozen, shared: never saved) and
``n_*`` RMSNorms::

    g  = fc(a_i)                    (drafting depth >= 2: the head's own pre-norm output y, no fc)
    x  = cat(n_in(e), n_hidden(g))  [2H]
    r  = g + o_proj(attn(q(x), k(x), v(x)))      (Llama GQA, RoPE at the EagleHead's positions)
    y  = r + mlp(n_post(r))         (the pre-norm output: the next depth's g)
    logits = lm_head(n_final(y))    [Vd] over the draft vocabulary; draft index j is token j + d2t[j]

Checkpoint (``export_head``): ``config.json`` (``LlamaConfig``, ``architectures=["LlamaForCausalLMEagle3"]``,
one layer, ``vocab_size`` the target's, ``draft_vocab_size``, ``target_hidden_size``,
``eagle_aux_hidden_state_layer_ids``, also in ``eagle_config``) and ``model.safetensors``:
``midlayer.*`` (q/k/v [*, 2H]), ``norm.weight``, ``fc.weight`` [H, A*Ht], ``lm_head.weight`` [Vd, H]
and, when Vd is below the target's vocabulary, ``d2t`` int64 [Vd] and ``t2d`` bool [V].
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_eagle2.head_files import default_aux_layers
from vllm_eagle2_tools.training.features import frozen_target_weights, load_target_tensors
from vllm_eagle2_tools.training.head import _MLP, _Attention, _Norm, fan_in_init_, head_config, unroll_inputs

ARCHITECTURE = "LlamaForCausalLMEagle3"
DEFAULT_DRAFT_VOCAB = 32_000  # published EAGLE-3 Llama heads' draft vocabulary (capped at the target's)


def eagle3_aux_layers(target_cfg: Any, aux_layers: Sequence[int]) -> list[int]:
    """The aux layers an EAGLE-3 head reads: ``aux_layers`` (default vLLM's, ``default_aux_layers``), sorted
    ascending (vLLM concatenates the states in layer order); exits naming ``--aux-layers`` unless they are
    distinct target layers 0..L-1."""
    n = target_cfg.num_hidden_layers
    layers = sorted(aux_layers) if aux_layers else default_aux_layers(n)
    if len(set(layers)) != len(layers) or not all(0 <= j < n for j in layers):
        raise SystemExit(f"error: --aux-layers {layers}: need distinct target layers in 0..{n - 1}")
    return layers


def select_draft_vocab(
    ranked: Sequence[int], size: int, vocab_size: int, fill: Sequence[int] = ()
) -> torch.Tensor:
    """The draft vocabulary: sorted int64 token ids [min(size, vocab_size)].

    Takes the first ``size`` of ``ranked`` (the reply tokens, most frequent first), then of ``fill``
    (e.g. the tokens the target predicts most), then the lowest ids not yet taken.
    """
    size = min(size, vocab_size)
    chosen: dict[int, None] = {}
    for t in (*ranked, *fill, *range(vocab_size)):
        if len(chosen) >= size:
            break
        if 0 <= t < vocab_size:
            chosen.setdefault(int(t), None)
    return torch.tensor(sorted(chosen), dtype=torch.long)


class _Midlayer(nn.Module):
    """EAGLE-3's decoder layer (checkpoint prefix ``midlayer.``): q/k/v over cat(n_in(e), n_hidden(g))."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = _Norm(h, eps)
        self.hidden_norm = _Norm(h, eps)
        self.self_attn = _Attention(cfg, in_features=2 * h)
        self.post_attention_layernorm = _Norm(h, eps)
        self.mlp = _MLP(cfg)

    def forward(
        self,
        emb: torch.Tensor,
        g: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: Sequence[int],
        past: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """emb [T, H] (token embeddings), g [T, H] -> (pre-norm output y [T, H], this step's (k, v))."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], -1)
        attn, kv = self.self_attn(x, cos, sin, seq_lens, past)
        r = g + attn
        return r + self.mlp(self.post_attention_layernorm(r)), kv


class Eagle3Head(nn.Module):
    """Trainable EAGLE-3 head; ``state_dict()`` keys are exactly vLLM's eagle3 checkpoint keys.

    ``draft_ids`` [Vd] sorted int64: the target token of each draft index. Buffers: ``d2t`` [Vd] int64
    and ``t2d`` [V] bool (saved, only when Vd < V); not saved: the target's embedding ``embed_weight``
    [V, H], ``target_lm_head`` [Vd, H] (the target's lm_head rows of the draft vocabulary, for the
    loss's target distribution, in the vocabulary matmuls' dtype: bf16 until :meth:`set_vocab_dtype`)
    and ``target_to_draft`` [V] int64 (draft index of a target id, -1: none).
    """

    def __init__(self, cfg: Any, embed: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        h, vocab = cfg.hidden_size, cfg.vocab_size
        self.config = cfg
        self.midlayer = _Midlayer(cfg)
        self.norm = _Norm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.eagle_aux_hidden_state_layer_ids) * cfg.target_hidden_size, h, bias=False)
        self.lm_head = nn.Linear(h, draft_ids.numel(), bias=False)
        if draft_ids.numel() < vocab:
            self.register_buffer("d2t", draft_ids - torch.arange(draft_ids.numel()))
            self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids, True))
        self.register_buffer("draft_ids", draft_ids.clone(), persistent=False)
        to_draft = torch.full((vocab,), -1, dtype=torch.long)
        to_draft[draft_ids] = torch.arange(draft_ids.numel())
        self.register_buffer("target_to_draft", to_draft, persistent=False)
        self.register_buffer("embed_weight", embed.detach().clone(), persistent=False)
        self.register_buffer(
            "target_lm_head", lm_head.detach().index_select(0, draft_ids).to(torch.bfloat16), persistent=False
        )
        self.rotary = LlamaRotaryEmbedding(cfg)
        for p in self.rotary.parameters():
            p.requires_grad_(False)

    def set_vocab_dtype(self, dtype: torch.dtype) -> None:
        """Run the loss's vocabulary matmuls in ``dtype`` (the training's precision)."""
        self.target_lm_head = self.target_lm_head.to(dtype)

    def forward(
        self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, seq_lens: Sequence[int]
    ) -> torch.Tensor:
        """Depth-1 draft-vocabulary logits [T, Vd] (float32): tokens [T] (token i+1), aux [T, A*Ht] (of i)."""
        return self.logits(self.forward_unrolled(tokens, None, positions, seq_lens, 1, aux)[0])

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs [N, H] -> draft-vocabulary logits [N, Vd]: lm_head(norm(out))."""
        return self.lm_head(self.norm(out))

    def forward_unrolled(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor | None,
        positions: torch.Tensor,
        seq_lens: Sequence[int],
        steps: int,
        aux: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Pre-norm outputs y [T, H] (float32) of drafting depths 1..``steps``.

        As :meth:`EagleHead.forward_unrolled <vllm_eagle2_tools.training.head.EagleHead.forward_unrolled>`
        (same rows, same attention over the unrolled steps), but depth 1 reads ``g = fc(aux)`` and depth s
        reads the depth s-1 output y of row r-1 as g, without fc. ``hidden`` (the target's last hidden
        state) is not an input of an EAGLE-3 head; it is accepted so both heads run under one loss.
        """
        if aux is None:
            raise ValueError("an EAGLE-3 head reads the target's aux hidden states: pass aux [T, A * Ht]")
        emb, cos, sin, prev = unroll_inputs(self.embed_weight, self.rotary, tokens, positions, seq_lens)
        g = self.fc(aux.float())
        outs: list[torch.Tensor] = []
        past: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in range(steps):
            out, kv = self.midlayer(emb, g, cos, sin, seq_lens, past)
            past.append(kv)
            outs.append(out)
            g = out.index_select(0, prev)
        return outs


def eagle3_head_config(target_cfg: Any, aux_layers: Sequence[int], draft_vocab_size: int) -> Any:
    """The head's ``LlamaConfig``: the target's shape, one layer, vLLM's EAGLE-3 fields.

    The aux layers are written twice: top-level ``eagle_aux_hidden_state_layer_ids`` (what the model
    runner reads first, as published heads carry it) and inside ``eagle_config``, where vLLM's
    ``llama_eagle3.LlamaModel`` looks for their number (without it, it assumes 3 when sizing ``fc``).
    """
    cfg = head_config(target_cfg, 1)
    cfg.architectures = [ARCHITECTURE]
    cfg.draft_vocab_size = int(draft_vocab_size)
    cfg.target_hidden_size = target_cfg.hidden_size
    cfg.eagle_aux_hidden_state_layer_ids = list(aux_layers)
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True}
    return cfg


def build_eagle3_head(
    target_dir: Path,
    aux_layers: Sequence[int],
    draft_ids: torch.Tensor,
    *,
    init: str = "target",
    seed: int = 0,
) -> Eagle3Head:
    """EAGLE-3 head for ``target_dir`` reading ``aux_layers`` (ascending) and drafting over ``draft_ids``.

    Every init starts ``lm_head`` as the target's ``lm_head`` rows of the draft vocabulary (a random one
    over 32k tokens would take most of a short run to learn). ``init="target"``, so that the head starts
    close to the target's own computation:

    * ``fc = [I | I | I] / A``: g is the mean of the residual streams entering the aux layers, at the
      target's residual scale (which is also the scale of the pre-norm output y that later depths read
      as g). Measured against ``[0 | 0 | I]`` (g = the last aux layer's state) and a random fc, on
      SmolLM2-135M (24 ShareGPT conversations, 24 steps of 512 tokens, depths 1-2, 4,096-token draft
      vocabulary): held-out CE 6.33 / 6.49 / 7.69 and top-1 11.8% / 8.3% / 5.4%;
    * the midlayer is the target's last decoder layer: q/k/v = [W | W] (it reads n_in(e) + n_hidden(g)
      as that layer reads its normalised residual stream), with ``o_proj`` and ``down_proj`` scaled by 0.1
      (as the EAGLE head's init: small branches, trained up); ``hidden_norm`` and
      ``post_attention_layernorm`` are that layer's two norms, ``input_layernorm`` (of the embedding) is
      the target's first layer's, ``norm`` the target's final norm.

    ``init="random"``: every other matrix N(0, 1/fan_in), norms 1.
    """
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(str(target_dir))
    cfg = eagle3_head_config(tcfg, aux_layers, draft_ids.numel())
    embed, lm_head = frozen_target_weights(target_dir)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, embed, lm_head, draft_ids)
    h = cfg.hidden_size
    with torch.no_grad():
        fan_in_init_(head)
        head.lm_head.weight.copy_(lm_head.index_select(0, draft_ids).float())
        if init == "target":
            last = f"model.layers.{tcfg.num_hidden_layers - 1}."
            attn = ("q_proj", "k_proj", "v_proj", "o_proj")
            names = [f"{last}self_attn.{k}.weight" for k in attn]
            names += [f"{last}mlp.{k}.weight" for k in ("gate_proj", "up_proj", "down_proj")]
            names += [f"{last}input_layernorm.weight", f"{last}post_attention_layernorm.weight"]
            names += ["model.layers.0.input_layernorm.weight", "model.norm.weight"]
            sd = {k: v.float() for k, v in load_target_tensors(target_dir, names).items()}
            mid = head.midlayer
            for k in ("q_proj", "k_proj", "v_proj"):
                w = sd[f"{last}self_attn.{k}.weight"]
                getattr(mid.self_attn, k).weight.copy_(torch.cat([w, w], 1))
            mid.self_attn.o_proj.weight.copy_(0.1 * sd[f"{last}self_attn.o_proj.weight"])
            mid.mlp.gate_proj.weight.copy_(sd[f"{last}mlp.gate_proj.weight"])
            mid.mlp.up_proj.weight.copy_(sd[f"{last}mlp.up_proj.weight"])
            mid.mlp.down_proj.weight.copy_(0.1 * sd[f"{last}mlp.down_proj.weight"])
            mid.hidden_norm.weight.copy_(sd[f"{last}input_layernorm.weight"])
            mid.post_attention_layernorm.weight.copy_(sd[f"{last}post_attention_layernorm.weight"])
            mid.input_layernorm.weight.copy_(sd["model.layers.0.input_layernorm.weight"])
            head.norm.weight.copy_(sd["model.norm.weight"])
            num_aux = len(aux_layers)
            head.fc.weight.copy_(torch.eye(h).repeat(1, num_aux) / num_aux)
        elif init != "random":
            raise ValueError(f"unknown init {init!r}")
    return head


def load_eagle3_weights(head: Eagle3Head, head_dir: Path) -> None:
    """Copy the weights of an exported EAGLE-3 head (``head_dir``/model.safetensors) into ``head``
    (``--init-from``); exits unless its keys, shapes and draft vocabulary are ``head``'s."""
    from safetensors.torch import load_file

    sd = load_file(str(head_dir / "model.safetensors"))
    mine = head.state_dict()
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    if shapes != {k: tuple(v.shape) for k, v in mine.items()}:
        raise SystemExit(f"error: {head_dir} is not an EAGLE-3 head of this shape ({sorted(shapes)})")
    if "d2t" in sd and not torch.equal(sd["d2t"].long(), mine["d2t"].cpu()):
        raise SystemExit(f"error: {head_dir} drafts over another vocabulary (its d2t differs)")
    head.load_state_dict({k: v.to(mine[k].dtype) for k, v in sd.items()})
