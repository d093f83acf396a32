"""Test fixtures: seeded tiny models (a byte-level BPE tokenizer, a tiny Llama target, EAGLE-1/3 heads).

Not used by the plugin at run time; the tests and a few scripts (``--tiny`` runs) build these models.
Everything here is built locally in about a second (no model hub), is deterministic for a seed, and is
saved as a folder that vLLM (and transformers) can load:

- :mod:`vllm_eagle2_tools.testing.targets`: :func:`build_tokenizer` and :func:`build_target`.
- :mod:`vllm_eagle2_tools.testing.heads`: :func:`build_eagle_head` and :func:`build_pair`.
- :mod:`vllm_eagle2_tools.testing.eagle3_heads`: :func:`build_eagle3_head` (vLLM's ``eagle3`` format).
- :mod:`vllm_eagle2_tools.testing.store`: :func:`stored`, a content-addressed copy of a built folder
  (vLLM's compile cache is keyed by the model's path).
- :mod:`vllm_eagle2_tools.testing.reference`: :class:`EagleHeadReference` /
  :func:`teacher_forced_agreement`, a plain-torch twin of vLLM's EAGLE head forward (kept independent
  of the trainer's head on purpose: the tests check the trainer against it), to measure how often a
  head's greedy draft equals the target's greedy token.

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

from vllm_eagle2_tools.testing.eagle3_heads import build_eagle3_head
from vllm_eagle2_tools.testing.heads import build_eagle_head, build_pair
from vllm_eagle2_tools.testing.reference import EagleHeadReference, teacher_forced_agreement
from vllm_eagle2_tools.testing.store import stored
from vllm_eagle2_tools.testing.targets import TARGET_FAMILIES, build_target, build_tokenizer, convert_target

__all__ = [
    "build_tokenizer",
    "TARGET_FAMILIES",
    "build_target",
    "convert_target",
    "build_eagle_head",
    "build_eagle3_head",
    "build_pair",
    "EagleHeadReference",
    "teacher_forced_agreement",
    "stored",
]
