"""The eagle2 draft head: vLLM's EAGLE Llama head, able to load published checkpoints.

Published EAGLE-1/EAGLE-2 heads (e.g. for Vicuna and LLaMA-2) carry ``fc.bias``, which
vLLM's built-in head cannot load; they ship no ``embed_tokens`` (the target's is
shared, as vLLM already does) and no final norm (vLLM's head has none either).
"""

from __future__ import annotations

from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.utils import maybe_prefix


class Eagle2LlamaForCausalLM(EagleLlamaForCausalLM):
    """vLLM's ``EagleLlamaForCausalLM`` with ``fc`` biased when the checkpoint has ``fc.bias``.

    The config flag ``eagle_fc_bias`` is set by the plugin from the head's tensor names
    (:mod:`vllm_eagle2.patches.speculative_config`, via :mod:`vllm_eagle2.head_files`).
    """

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if getattr(self.config, "eagle_fc_bias", False):
            hidden = self.config.hidden_size
            self.model.fc = ReplicatedLinear(
                input_size=2 * hidden,
                output_size=hidden,
                bias=True,
                params_dtype=vllm_config.model_config.dtype,
                quant_config=self.model.quant_config,
                prefix=maybe_prefix(maybe_prefix(prefix, "model"), "fc"),
                return_bias=False,
            )
