"""What an eagle2 engine needs of vLLM's engine-wide config (vLLM 0.32 ``config/vllm.py``)."""

from __future__ import annotations

import logging

from .record import set_attr

logger = logging.getLogger("vllm.eagle2")


def _is_eagle2(config) -> bool:
    spec = config.speculative_config
    return spec is not None and spec.method == "eagle2"


def patch_vllm_config() -> None:
    """The V1 model runner (Model Runner V2 is told eagle2 is unsupported), KV slots for the draft
    tree past each request, and no full CUDA graphs (they would replay causal attention for tree
    rows; piecewise graphs run attention eagerly)."""
    from vllm.config import VllmConfig

    unsupported = VllmConfig._get_v2_model_runner_unsupported_features

    def _get_v2_model_runner_unsupported_features(self):
        features = list(unsupported(self))
        if _is_eagle2(self):
            features.append("speculative method 'eagle2'")
        return features

    name = "_get_v2_model_runner_unsupported_features"
    set_attr(VllmConfig, name, _get_v2_model_runner_unsupported_features)

    lookahead = VllmConfig.num_lookahead_tokens

    def num_lookahead_tokens(self) -> int:
        slots = lookahead.fget(self)
        if _is_eagle2(self):
            slots = max(slots, self.speculative_config.eagle2.draft_kv_slots)
        return slots

    set_attr(VllmConfig, "num_lookahead_tokens", property(num_lookahead_tokens))

    post_init = VllmConfig.__post_init__

    def __post_init__(self, *args, **kwargs):
        post_init(self, *args, **kwargs)
        if not _is_eagle2(self):
            return
        from vllm.config.compilation import CUDAGraphMode

        compilation = self.compilation_config
        mode = compilation.cudagraph_mode
        if mode is not None and mode.has_full_cudagraphs():
            # The tree side channel is Python: a full graph would replay the stock causal kernel.
            new = CUDAGraphMode.PIECEWISE if mode.has_piecewise_cudagraphs() else CUDAGraphMode.NONE
            logger.warning(
                "eagle2: cudagraph_mode %s -> %s (tree attention runs outside graphs)", mode.name, new.name
            )
            compilation.cudagraph_mode = new

    set_attr(VllmConfig, "__post_init__", __post_init__)
