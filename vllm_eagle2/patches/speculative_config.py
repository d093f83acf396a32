"""``method: "eagle2"`` in vLLM's speculative config: accepted, validated, and built as the head's
format is (vLLM 0.32 ``config/speculative.py``, ``engine/arg_utils.py``)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from vllm_eagle2.config import (
    EXTRA_KEYS,
    UNQUANTIZED_KV_DTYPES,
    Eagle2ConfigError,
    parse_settings,
    resolve_draft_vocab,
)
from vllm_eagle2.head_files import EAGLE3, TargetShape, check_head, draft_method

from .record import set_attr, set_item, undo


def _literal_values(tp: Any) -> list[Any]:
    values = []
    for arg in typing.get_args(tp):
        if typing.get_origin(arg) is typing.Literal:
            values.extend(_literal_values(arg))
        else:
            values.append(arg)
    return values


def patch_speculative_config() -> None:
    """``method`` accepts "eagle2"; ``__post_init__`` builds the draft config as vLLM's "eagle"
    or "eagle3" would for the head; ``use_eagle`` turns on EAGLE's runner paths and draft KV."""
    from pydantic.dataclasses import rebuild_dataclass
    from vllm import ModelRegistry
    from vllm.config import SpeculativeConfig
    from vllm.config import speculative as speculative_module

    ModelRegistry.register_model("Eagle2LlamaForCausalLM", "vllm_eagle2.head:Eagle2LlamaForCausalLM")
    methods = _literal_values(speculative_module.SpeculativeMethod)
    if "eagle2" not in methods:
        method_type = typing.Literal[tuple(methods) + ("eagle2",)] | None
        set_item(SpeculativeConfig.__annotations__, "method", method_type)
        set_attr(SpeculativeConfig.__dataclass_fields__["method"], "type", method_type)
        rebuild_dataclass(SpeculativeConfig, force=True)
        undo.append(lambda: rebuild_dataclass(SpeculativeConfig, force=True))  # runs after the two above

    post_init = SpeculativeConfig.__post_init__

    def __post_init__(self) -> None:
        if self.method != "eagle2":
            return post_init(self)
        # Build the head's draft config exactly as vLLM's method for its format does, then say what it is.
        self.method = draft_method(self.model)
        try:
            post_init(self)
        finally:
            self.method = "eagle2"

    set_attr(SpeculativeConfig, "__post_init__", __post_init__)
    use_eagle = SpeculativeConfig.use_eagle
    set_attr(SpeculativeConfig, "use_eagle", lambda self: self.method == "eagle2" or use_eagle(self))


def _refuse_unsupported_engines(args: Any, target_model_config: Any) -> None:
    """What eagle2 cannot serve, named before any weights load."""
    kv_dtype = str(getattr(args, "kv_cache_dtype", "auto"))
    if kv_dtype not in UNQUANTIZED_KV_DTYPES:
        raise Eagle2ConfigError(
            f"eagle2 needs an unquantized KV cache: kv_cache_dtype must be one of "
            f"{', '.join(UNQUANTIZED_KV_DTYPES)}; got {kv_dtype!r} (its tree attention reads the cache "
            "as is)"
        )
    if getattr(args, "logits_processors", None):
        raise Eagle2ConfigError(
            "eagle2 does not support engine-wide logits processors (logits_processors / "
            "--logits-processors): they may change any request's logits, and the tree verifier does not "
            "apply them to drafted tokens, so the output would not be the target's. Serve without them, "
            "or use per-request sampling settings (requests eagle2 cannot verify exactly get no drafts)."
        )
    if getattr(target_model_config, "uses_mrope", False):
        raise Eagle2ConfigError(
            "eagle2 does not support models with multi-axis rotary positions (M-RoPE: Qwen2-VL, "
            "Qwen2.5-VL, Qwen3-VL, ...): its tree nodes take positions on one axis. Serve this model "
            "without eagle2, or with vLLM's own eagle."
        )
    if getattr(args, "data_parallel_size", 1) > 1 and target_model_config.is_moe:
        # vLLM synchronises every forward of a data-parallel MoE engine across its ranks; each
        # rank's budget picks its own tree depth, so ranks would wait on each other for good.
        raise Eagle2ConfigError(
            f"eagle2 does not support data_parallel_size > 1 with a mixture-of-experts target "
            f"(data_parallel_size={args.data_parallel_size}): every draft pass would have to run "
            "on every rank in step. Use tensor_parallel_size instead, or vLLM's own eagle."
        )


def _refuse_unknown_keys(spec: dict[str, Any]) -> None:
    """A key neither eagle2's nor vLLM's, named with both lists (vLLM's own error names vLLM's only)."""
    from vllm.config import SpeculativeConfig

    fields = [f.name for f in dataclasses.fields(SpeculativeConfig) if f.init]
    unknown = sorted(key for key in spec if key not in EXTRA_KEYS and key not in fields)
    if unknown:
        raise Eagle2ConfigError(
            f"speculative_config has no field {unknown[0]!r} (method eagle2). eagle2's own: "
            f"{', '.join(EXTRA_KEYS)}; vLLM's: {', '.join(sorted(fields))}"
        )


def patch_engine_args() -> None:
    """``create_speculative_config`` pops and validates eagle2's keys and checks the head, then
    lets vLLM build the config with ``num_speculative_tokens`` = the nodes sent per step."""
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_speculative_config

    def create_speculative_config(self, target_model_config, *args, **kwargs):
        spec = self.speculative_config
        if not (isinstance(spec, dict) and spec.get("method") == "eagle2"):
            return create(self, target_model_config, *args, **kwargs)
        settings = parse_settings(spec)
        _refuse_unknown_keys(spec)
        _refuse_unsupported_engines(self, target_model_config)
        target = TargetShape(
            hidden_size=target_model_config.get_hidden_size(),
            vocab_size=target_model_config.get_vocab_size(),
            num_layers=target_model_config.get_total_num_hidden_layers(),
        )
        head = check_head(spec.get("model"), target)
        settings = dataclasses.replace(settings, head_format=head.format)
        settings = resolve_draft_vocab(
            settings,
            spec.get("model"),
            eagle3_vocab=(head.draft_vocab_size or target.vocab_size) if head.format == EAGLE3 else 0,
            tensor_parallel_size=self.tensor_parallel_size,
            target_vocab_size=target.vocab_size,
        )
        vllm_spec = {key: value for key, value in spec.items() if key not in EXTRA_KEYS}
        vllm_spec["num_speculative_tokens"] = settings.nodes_per_step
        self.speculative_config = vllm_spec
        try:
            config = create(self, target_model_config, *args, **kwargs)
        finally:
            self.speculative_config = spec
        config.eagle2 = settings  # not a pydantic field: survives pickling to workers
        draft = config.draft_model_config
        if draft is not None and draft.hf_config.architectures == ["EagleLlamaForCausalLM"]:
            # Our head class: vLLM's, plus fc.bias of published EAGLE checkpoints.
            draft.hf_config.eagle_fc_bias = "fc.bias" in head.tensors
            draft.hf_config.architectures = ["Eagle2LlamaForCausalLM"]
            config.update_arch_()
        return config

    set_attr(EngineArgs, "create_speculative_config", create_speculative_config)


def guard_unsupported_version(reason: str) -> None:
    """On an unsupported vLLM (nothing else patched), an eagle2 config fails with ``reason``."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # noqa: BLE001 - an unknown vLLM layout: nothing to guard
        return
    original = EngineArgs.create_speculative_config

    def create_speculative_config(self, *args, **kwargs):
        spec = self.speculative_config
        if isinstance(spec, dict) and spec.get("method") == "eagle2":
            raise Eagle2ConfigError(reason)
        return original(self, *args, **kwargs)

    EngineArgs.create_speculative_config = create_speculative_config
