"""An EAGLE head folder: its format, and whether it can serve a target (no vLLM imports).

Two checkpoint formats load, the two vLLM loads:

* ``eagle`` (EAGLE-1 and EAGLE-2 heads, vLLM's ``eagle`` method): ``fc`` [H, 2H] (+ ``fc.bias`` in
  published checkpoints) over ``cat(embed(token), last target hidden state)``, ``layers.0.*``; the
  target's embedding and ``lm_head`` are shared.
* ``eagle3`` (EAGLE-3 heads, vLLM's ``eagle3`` method): ``fc`` [H, A * Ht] over the target's hidden
  states entering A of its layers (low, middle, high; the ``eagle_aux_hidden_state_layer_ids`` of the
  config, or vLLM's defaults), ``midlayer.*`` (or ``layers.0.*``) with q/k/v over
  ``cat(norm(embed), norm(hidden))``, a final ``norm``, its own ``lm_head`` over a draft vocabulary
  of ``draft_vocab_size`` tokens, and ``d2t`` (draft index -> target id offset) when that vocabulary
  is not the target's.

Both come in two config layouts: the one EAGLE's authors publish (a flat ``LlamaConfig``; EAGLE-3
layers as ``midlayer.*``), and the ``speculators`` layout of vLLM's ``speculators`` and SGLang's SpecForge
(``speculators_model_type: "eagle3"``, the layer's config nested in ``transformer_layer_config``, flags
such as ``norm_before_residual``, ``norm_before_fc`` and ``fc_norm``; layers as ``layers.N.*``). A
``speculators`` config is read as vLLM reads it (:func:`flat_config`), so every flag means what it
means in vLLM's ``eagle3``, whose head class eagle2 drafts with.

Everything here reads ``config.json`` and the weight files' headers only, so a head that cannot
serve the target fails before any weights load, naming what is wrong. No vLLM import at module level:
only a ``speculators`` config asks vLLM's own reader.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_eagle2.config import Eagle2ConfigError

EAGLE = "eagle"
EAGLE3 = "eagle3"
HEAD_FORMATS = (EAGLE, EAGLE3)
_WHAT = "speculative_config.model"


@dataclass(frozen=True)
class TargetShape:
    """What a head must fit: the target's hidden size, vocabulary and decoder layer count."""

    hidden_size: int | None
    vocab_size: int | None
    num_layers: int | None = None


@dataclass(frozen=True)
class HeadInfo:
    """A head folder that fits its target.

    format: one of :data:`HEAD_FORMATS`. tensors: weight name -> shape.
    aux_layers: EAGLE-3 only, the target layers whose input hidden states the head reads, in the
    order vLLM concatenates them (ascending); () for EAGLE-1/2 heads and EAGLE-3 heads that read the
    last hidden state only (``use_aux_hidden_state: false``).
    draft_vocab_size: the head's own vocabulary (EAGLE-3), 0 when it drafts over the target's.
    """

    format: str
    tensors: dict[str, tuple[int, ...]]
    aux_layers: tuple[int, ...] = ()
    draft_vocab_size: int = 0


#: The ``speculators_model_type`` values eagle2 drafts trees from.
SPECULATORS_TYPES = ("eagle3",)


def flat_config(cfg: dict[str, Any], path: Any = "") -> dict[str, Any]:
    """A head's ``config.json`` as vLLM 0.32 builds the head's config from it.

    A ``speculators`` config (``speculators_model_type`` set) goes through vLLM's own reader
    (``SpeculatorsConfig.extract_transformers_pre_trained_config``): the layer's nested config
    plus the algorithm's fields, with vLLM's defaults (``norm_before_residual`` True when absent).
    Any other config is returned as it is.

    Raises:
        Eagle2ConfigError: a ``speculators`` type other than :data:`SPECULATORS_TYPES`, or one that
            vLLM cannot read (with vLLM's reason).
    """
    kind = cfg.get("speculators_model_type")
    if kind is None:
        return cfg
    if kind not in SPECULATORS_TYPES:
        raise Eagle2ConfigError(
            f"{_WHAT}: speculators_model_type {kind!r} is not a head eagle2 drafts trees from "
            f"(allowed: {', '.join(SPECULATORS_TYPES)}): {path}"
        )
    try:
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    except ImportError as exc:
        raise Eagle2ConfigError(
            f"{_WHAT}: a speculators-format head needs vLLM to read it ({exc}): {path}"
        ) from exc
    try:
        return SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(cfg))
    except (ValueError, TypeError, KeyError) as exc:
        raise Eagle2ConfigError(f"{_WHAT}: vLLM cannot load this speculators config: {exc}: {path}") from exc


def head_format(cfg: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> str:
    """``eagle3`` for a head in vLLM's EAGLE-3 format (by architecture or tensor names), else ``eagle``."""
    if any("Eagle3" in arch for arch in cfg.get("architectures") or []):
        return EAGLE3
    if "d2t" in tensors or any(name.startswith("midlayer.") for name in tensors):
        return EAGLE3
    return EAGLE


def draft_method(head: Any) -> str:
    """vLLM's method for building this head's draft config: ``eagle3`` or ``eagle`` (never raises)."""
    try:
        path = Path(str(head)).expanduser()
        return head_format(flat_config(_read_config_json(path), path), read_tensor_shapes(path))
    except Eagle2ConfigError:
        return EAGLE  # check_head reports it


def check_head(head: Any, target: TargetShape) -> HeadInfo:
    """Fail fast, before any weights load, on a head that cannot serve ``target``."""
    if not head:
        raise Eagle2ConfigError(f"{_WHAT} must name the EAGLE head folder; got nothing")
    path = Path(str(head)).expanduser()
    if not path.exists():
        raise Eagle2ConfigError(f"{_WHAT}: head path does not exist: {head}")
    if not path.is_dir():
        raise Eagle2ConfigError(f"{_WHAT} must be a folder with config.json: {head}")
    cfg = flat_config(_read_config_json(path), head)
    vocab = cfg.get("vocab_size")
    if target.vocab_size is not None and vocab is not None and vocab != target.vocab_size:
        raise Eagle2ConfigError(
            f"{_WHAT}: head vocab_size {vocab} does not match the target's {target.vocab_size}: {head}"
        )
    tensors = read_tensor_shapes(path)
    if head_format(cfg, tensors) == EAGLE3:
        return _check_eagle3(head, cfg, tensors, target)
    _check_hidden_size(head, "hidden_size", cfg.get("hidden_size"), target)
    return HeadInfo(EAGLE, tensors)


def _check_hidden_size(head: Any, key: str, size: Any, target: TargetShape) -> None:
    if target.hidden_size is not None and size is not None and size != target.hidden_size:
        raise Eagle2ConfigError(
            f"{_WHAT}: head {key} {size} does not match the target's hidden size {target.hidden_size}: {head}"
        )


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM 0.32's default EAGLE-3 aux layers for a Llama target of ``num_layers`` layers (low, mid, high)."""
    return [2, num_layers // 2, num_layers - 3]


def eagle3_aux_layers(cfg: dict[str, Any], num_layers: int | None) -> tuple[int, ...] | None:
    """The layer ids an EAGLE-3 head names (vLLM reads the top-level key, then ``eagle_config``'s),
    else vLLM's defaults for a Llama target of ``num_layers`` layers; None if neither is known."""
    eagle_config = cfg.get("eagle_config") or {}
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(ids)
    if num_layers is None:
        return None
    return tuple(default_aux_layers(num_layers))


def _check_eagle3(
    head: Any, cfg: dict[str, Any], tensors: dict[str, tuple[int, ...]], target: TargetShape
) -> HeadInfo:
    hidden = cfg.get("hidden_size")
    target_hidden = cfg.get("target_hidden_size", hidden)
    _check_hidden_size(
        head, "target_hidden_size" if "target_hidden_size" in cfg else "hidden_size", target_hidden, target
    )
    if "embed_tokens.weight" not in tensors:
        # The head reads the target's embedding: it must be as wide as the head.
        _check_hidden_size(head, "hidden_size", hidden, target)

    eagle_config = cfg.get("eagle_config") or {}
    aux: tuple[int, ...] = ()
    if eagle_config.get("use_aux_hidden_state", True):
        fc = tensors.get("fc.weight")
        if fc is None or len(fc) != 2:
            raise Eagle2ConfigError(f"{_WHAT}: EAGLE-3 head has no 2-d fc.weight: {head}")
        width = target_hidden or fc[1]
        if fc[1] % width:
            raise Eagle2ConfigError(
                f"{_WHAT}: EAGLE-3 head fc.weight is {list(fc)}; its input {fc[1]} is not a multiple of the "
                f"target's hidden size {width}: {head}"
            )
        aux = _check_aux_layers(head, cfg, fc[1] // width, target.num_layers)

    draft_vocab = cfg.get("draft_vocab_size") or cfg.get("vocab_size")
    lm_head = tensors.get("lm_head.weight")
    if lm_head is not None and draft_vocab is not None and lm_head[0] != draft_vocab:
        raise Eagle2ConfigError(
            f"{_WHAT}: EAGLE-3 head lm_head.weight has {lm_head[0]} rows, draft_vocab_size {draft_vocab}: "
            f"{head}"
        )
    target_vocab = target.vocab_size or cfg.get("vocab_size")
    d2t = tensors.get("d2t")
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab and d2t is None:
        raise Eagle2ConfigError(
            f"{_WHAT}: EAGLE-3 head drafts over {draft_vocab} tokens (draft_vocab_size) but has no d2t "
            f"table mapping them to the target's {target_vocab}: {head}"
        )
    if d2t is not None and list(d2t) != [draft_vocab]:
        raise Eagle2ConfigError(
            f"{_WHAT}: EAGLE-3 head d2t has shape {list(d2t)}; it must have one entry per draft token "
            f"(draft_vocab_size {draft_vocab}): {head}"
        )
    own_vocab = draft_vocab if draft_vocab != target_vocab else 0
    return HeadInfo(EAGLE3, tensors, aux_layers=aux, draft_vocab_size=own_vocab)


def _check_aux_layers(
    head: Any, cfg: dict[str, Any], fc_inputs: int, num_layers: int | None
) -> tuple[int, ...]:
    """The aux layers, checked against the target's layer count and the head's ``fc``."""
    ids = eagle3_aux_layers(cfg, num_layers)
    if ids is None:
        return ()
    named = "eagle_aux_hidden_state_layer_ids" in cfg or "eagle_aux_hidden_state_layer_ids" in (
        cfg.get("eagle_config") or {}
    )
    source = "eagle_aux_hidden_state_layer_ids" if named else f"vLLM's default layers for {num_layers} layers"
    if len(set(ids)) != len(ids):
        raise Eagle2ConfigError(
            f"{_WHAT}: EAGLE-3 auxiliary layers {list(ids)} ({source}) repeat a layer: {head}"
        )
    if num_layers is not None and not all(0 <= i <= num_layers for i in ids):
        raise Eagle2ConfigError(
            f"{_WHAT}: EAGLE-3 auxiliary layers {list(ids)} ({source}) must lie in [0, {num_layers}] "
            f"for this {num_layers}-layer target: {head}"
        )
    if len(ids) != fc_inputs:
        raise Eagle2ConfigError(
            f"{_WHAT}: EAGLE-3 head reads {len(ids)} auxiliary layers {list(ids)} ({source}) but its "
            f"fc.weight takes {fc_inputs} hidden states: set eagle_aux_hidden_state_layer_ids in its "
            f"config.json to {fc_inputs} layer ids: {head}"
        )
    # vLLM 0.32 sizes fc from num_aux_hidden_states, else from eagle_config's layer ids, else for 3.
    eagle_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    sized_for = cfg.get("num_aux_hidden_states") or (len(eagle_ids) if eagle_ids else 3)
    if sized_for != fc_inputs:
        raise Eagle2ConfigError(
            f"{_WHAT}: vLLM builds this EAGLE-3 head's fc for {sized_for} auxiliary hidden states (from "
            f"num_aux_hidden_states, else eagle_config.eagle_aux_hidden_state_layer_ids, else 3) but its "
            f"fc.weight takes {fc_inputs}: set num_aux_hidden_states to {fc_inputs} in its config.json: "
            f"{head}"
        )
    return tuple(sorted(ids))


def _read_config_json(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise Eagle2ConfigError(f"{_WHAT} has no config.json: {path}")
    try:
        return json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise Eagle2ConfigError(f"{_WHAT} config.json is not valid JSON ({exc}): {config_file}") from exc


def read_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a head's weights; raises Eagle2ConfigError on missing or broken files.

    Reads safetensors headers only (and checks each file is as long as its header says),
    so a truncated or corrupt head fails here, before vLLM starts loading it.
    """
    files = sorted(path.glob("*.safetensors"))
    shapes: dict[str, tuple[int, ...]] = {}
    if not files:
        bins = sorted(path.glob("*.bin"))
        if not bins:
            raise Eagle2ConfigError(f"{_WHAT}: no *.safetensors or *.bin weights in {path}")
        import torch

        for file in bins:
            try:
                state = torch.load(file, map_location="meta", weights_only=True, mmap=True)
            except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
                raise Eagle2ConfigError(f"{_WHAT}: cannot read {file}: {exc}") from exc
            shapes.update({name: tuple(t.shape) for name, t in state.items()})
        return shapes
    for file in files:
        shapes.update(_safetensors_shapes(file))
    return shapes


def _safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    size = file.stat().st_size
    try:
        with open(file, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError("header length past the end of the file")
            header = json.loads(handle.read(header_len))
        header.pop("__metadata__", None)
        end = max((t["data_offsets"][1] for t in header.values()), default=0)
        if 8 + header_len + end > size:
            raise ValueError(f"file is truncated ({size} bytes, header says {8 + header_len + end})")
        return {name: tuple(t["shape"]) for name, t in header.items()}
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise Eagle2ConfigError(f"{_WHAT}: corrupt safetensors file {file}: {exc}") from exc
