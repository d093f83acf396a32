"""Tree attention inside vLLM's attention layers, through a per-forward side channel.

vLLM's attention kernels know causal masks only. Every attention layer's implementation is
wrapped once (:func:`wrap_attention_layers`). Which rows are tree rows, and with which masks, is a
:class:`~.tree_batch.TreeBatch` published for one forward through :func:`~.tree_batch.tree_batch`
(re-exported here); outside one, every layer is plain causal attention.

A request's tree rows are always the last of its rows: before them sit the rows that see the
whole context causally (a verified tree's root and its leading chain; none in a draft level).

* On CPU each row is computed once (:mod:`.cpu_rows`): vLLM's kernel the rows before each request's
  tree rows, eagle2's kernel the tree rows, from the cache in the layout vLLM chose, in place.
* On CUDA the stock kernel computes every row, then the tree rows are recomputed by the Triton
  kernel (:func:`vllm_eagle2.kernels.paged_tree_attention`) and written over its result.

Both read the tree's own fresh K/V from the cache (vLLM writes every row's K/V before attention),
as does :func:`move_kv`, which moves the accepted nodes' K/V into place after sampling.

* A draft level (:mod:`vllm_eagle2.engine.expansion`) wraps its one head forward in
  ``with tree_batch(batch):``.
* Verification spans vLLM's ``execute_model``: its ``_prepare_inputs`` builds the batch, the
  target forward reads it. :mod:`vllm_eagle2.patches` wraps the whole ``execute_model`` in
  ``with tree_batch() as step.forward:`` (:mod:`vllm_eagle2.engine.step`) and
  :func:`vllm_eagle2.engine.verification.prepare_tree_verification` publishes into it.

The wrapping is a patch of vLLM (``forward`` and the ``_eagle2_wrapped`` marker on each layer's
``impl`` instance, neither recorded nor rolled back): it is listed, with why, its upstream
reference and when to remove it, in the index of :mod:`vllm_eagle2.patches`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from vllm_eagle2.config import UNQUANTIZED_KV_DTYPES
from vllm_eagle2.engine import cpu_rows
from vllm_eagle2.engine.tree_batch import TreeBatch, TreeForward, active_batch, tree_batch
from vllm_eagle2.kernels import (
    check_cpu_kv_layout,
    cpu_backend,
    cpu_layout,
    kv_cache_views,
    move_kv_slots,
    paged_tree_attention,
    read_kv_slots,
)
from vllm_eagle2.kernels.warmup import AttentionCache

__all__ = [
    "TreeBatch",
    "TreeForward",
    "check_kernel_blocks",
    "check_layouts",
    "move_kv",
    "tree_batch",
    "tree_caches",
    "unsupported_features",
    "wrap_attention_layers",
]

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionImpl
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("vllm.eagle2")  # under vLLM's logger: its handlers and level


def _backend_of(impl: AttentionImpl) -> str:
    """``"cpu"`` (vLLM's CPU_ATTN) or ``"flash"`` (CUDA FlashAttention / Triton, their layout)."""
    name = type(impl).__name__
    if "DiffKV" in name:  # FLASH_ATTN_DIFFKV / TRITON_ATTN_DIFFKV keep K and V in another layout
        raise RuntimeError(
            f"eagle2 tree attention does not read the KV cache of {name} (keys and values of different "
            "head sizes); start vLLM with --attention-backend FLASH_ATTN or TRITON_ATTN, or without eagle2"
        )
    if name.startswith("CPUAttention"):
        return "cpu"
    if name.startswith(("FlashAttention", "TritonAttention")):
        return "flash"
    raise RuntimeError(
        f"eagle2 tree attention does not know the KV-cache layout of {name}; supported: "
        "CPU_ATTN (CPU), FLASH_ATTN and TRITON_ATTN (CUDA): start vLLM with "
        "--attention-backend FLASH_ATTN (or TRITON_ATTN; LLM(..., attention_backend=...))"
    )


def _layout_of(layer: Any) -> str:
    """The KV layout of ``layer``'s cache (:mod:`vllm_eagle2.kernels.kv_cache`)."""
    return cpu_layout(layer.isa) if _backend_of(layer.impl) == "cpu" else "flash"


def unsupported_features(impl: AttentionImpl) -> list[str]:
    """What an attention layer's impl applies that the tree kernels do not (empty = none).

    The tree rows are computed by eagle2's kernels, which know plain softmax attention over an
    unquantized cache; any of these would make the tree rows differ from what the stock kernel
    computes for the same tokens, so eagle2 would not be lossless.
    """
    found = []
    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1)):
        found.append(f"sliding-window attention ({window})")
    if getattr(impl, "logits_soft_cap", None):
        found.append(f"logit soft-capping ({impl.logits_soft_cap})")
    if getattr(impl, "alibi_slopes", None) is not None:
        found.append("ALiBi")
    if getattr(impl, "sinks", None) is not None:
        found.append("attention sinks")
    kv_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    if kv_dtype not in UNQUANTIZED_KV_DTYPES:
        found.append(f"a quantized KV cache (kv_cache_dtype {kv_dtype})")
    return found


def _flash_forward(impl: Any, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
                   batch: TreeBatch, max_seq_len: int | None) -> None:  # fmt: skip
    """The tree rows recomputed by the Triton kernel and written over the stock result."""
    key_cache, value_cache = kv_cache_views(kv_cache, "flash")
    out = paged_tree_attention(
        query[batch.rows],
        key_cache,
        value_cache,
        batch.block_table,
        batch.query_start_loc,
        batch.context_lens,
        batch.region_lens,
        batch.mask,
        impl.scale,
        plan_cache=batch.plan_cache,
        # A host bound on the context sizes the CUDA kernel's split of it (no device read).
        max_context_len=max_seq_len,
    )
    output.view(output.shape[0], impl.num_heads, -1)[batch.rows] = out.to(output.dtype)


def check_layouts(layers: dict[str, Any], dtype: torch.dtype) -> None:
    """At start-up, once vLLM's builders gave every CPU layer its ISA: each layout is one eagle2's
    CPU kernel reads, and vLLM's cache writer stores it as eagle2 reads it (a round trip).

    Raises:
        ValueError: a layout eagle2 does not read, naming it.
        RuntimeError: vLLM writes it otherwise than eagle2 reads it.
    """
    checked = set()
    for layer in layers.values():
        impl = getattr(layer, "impl", None)
        if impl is None or _backend_of(impl) != "cpu" or not hasattr(layer, "isa"):
            continue
        what = (layer.isa, impl.head_size)
        if what not in checked:
            check_cpu_kv_layout(layer.isa, dtype, impl.head_size, 32)
            checked.add(what)
    if checked:
        logger.info(
            "eagle2 tree attention on CPU: %s backend, KV layouts %s",
            cpu_backend(),
            sorted({isa for isa, _ in checked}),
        )


def wrap_attention_layers(layers: dict[str, Any]) -> None:
    """Wrap ``forward`` of every attention layer's impl once."""
    impls = (getattr(layer, "impl", None) for layer in layers.values())
    todo = [i for i in impls if hasattr(i, "forward") and not getattr(i, "_eagle2_wrapped", False)]
    backends = {_backend_of(impl) for impl in todo}  # fail at start-up, not mid-request, if unknown
    for name, layer in layers.items():
        features = unsupported_features(getattr(layer, "impl", None))
        if features:
            raise RuntimeError(
                f"eagle2 cannot verify trees for this model: attention layer {name} uses "
                f"{', '.join(features)}, which eagle2's tree attention does not apply, so its output "
                "would differ from vLLM's. Serve it without eagle2 (vLLM's own 'eagle' drafts chains)."
            )
    if "cpu" in backends:
        cpu_backend()  # build the C++ kernel now, not mid-request (about 20 s, once per machine)
    for impl in todo:
        stock_forward = impl.forward
        on_cpu = _backend_of(impl) == "cpu"

        def forward(
            layer,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            output=None,
            *args,
            _stock=stock_forward,
            _impl=impl,
            _on_cpu=on_cpu,
            **kwargs,
        ):
            # Outside a tree_batch scope (dummy runs, the catch-up pass): causal, as stock.
            batch = active_batch()
            if batch is None or attn_metadata is None or not batch.rows.numel():
                return _stock(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            if _on_cpu:  # each row once: vLLM's kernel the rows before the tree rows, eagle2's these
                split = cpu_rows.split_metadata(batch, attn_metadata, _impl, layer, query.dtype)
                result = _stock(layer, query, key, value, kv_cache, split, output, *args, **kwargs)
                cpu_rows.cpu_tree_rows(_impl, layer, query, kv_cache, result, batch)
                return result
            result = _stock(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            _flash_forward(_impl, query, kv_cache, result, batch, getattr(attn_metadata, "max_seq_len", None))
            return result

        impl.forward = forward
        impl._eagle2_wrapped = True


def check_kernel_blocks(kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int] | None) -> None:
    """Refuse kernel blocks that split the KV manager's blocks (vLLM 0.32 splits them for some
    backends and hybrid models): tree attention and the K/V moves index the manager's block table.

    kv_cache_config: vLLM's KVCacheConfig; kernel_block_sizes: per KV-cache group but encoder-only
    ones (as vLLM lists them), tokens per kernel block.

    Raises:
        RuntimeError: naming the group and both sizes.
    """
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    manager_block_sizes = [
        spec.block_size for spec in specs if type(spec).__name__ != "EncoderOnlyAttentionSpec"
    ]
    for group, (manager, kernel) in enumerate(zip(manager_block_sizes, kernel_block_sizes or [])):
        if manager != kernel:
            raise RuntimeError(
                f"eagle2 does not support split KV-cache blocks: group {group} keeps blocks of {manager} "
                f"tokens that the attention kernels read as blocks of {kernel}. Set --block-size {kernel} "
                "(a block size the attention backend takes whole), or serve without eagle2."
            )


def tree_caches(layers: dict[str, Any]) -> list[AttentionCache]:
    """The cache views the Triton tree kernel reads, one layer per distinct geometry, dtype and
    strides (what a kernel variant depends on): the target's layers and the head's. (CUDA caches;
    a CPU engine's "vec" caches have views too, which the tests warm up under Triton's interpreter.)"""
    found: dict[tuple, AttentionCache] = {}
    for layer in layers.values():
        kv_cache = getattr(layer, "kv_cache", None)
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.numel() == 0 or _layout_of(layer) == "amx":
            continue
        key_cache, value_cache = kv_cache_views(kv_cache, _layout_of(layer))
        signature = (key_cache.shape[1:], key_cache.stride(), key_cache.dtype, layer.impl.num_heads)
        found.setdefault(signature, AttentionCache(key_cache, value_cache, layer.impl.num_heads))
    return list(found.values())


def move_kv(
    layer_names: set[str], layers: dict[str, Any], src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Copy the K/V at cache slots ``src_slots`` [K] to ``dst_slots`` [K] in the layers named (the
    target's). CPU caches: copied within their layout, every layer in one call
    (:func:`~vllm_eagle2.kernels.move_kv_slots`); CUDA caches: read in their layout and written
    with the backend's own writer. All sources are read before any destination is written; a
    destination of -1 writes nothing (vLLM's writers skip padding slots)."""
    if src_slots.numel() == 0:
        return
    on_cpu: dict[str, list[torch.Tensor]] = {}  # layout -> caches: one call moves them all
    for name in layer_names:
        layer = layers[name]
        layout = _layout_of(layer)
        if layout != "flash":
            on_cpu.setdefault(layout, []).append(layer.kv_cache)
            continue
        key, value = read_kv_slots(layer.kv_cache, layout, src_slots)
        layer.impl.do_kv_cache_update(layer, key, value, layer.kv_cache, dst_slots)
    for layout, caches in on_cpu.items():
        move_kv_slots(caches, layout, src_slots, dst_slots)
