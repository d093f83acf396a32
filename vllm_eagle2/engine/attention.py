"""Tree attention inside vLLM's attention layers, through a per-forward side channel.

vLLM's attention kernels know causal masks only. Every attention layer's implementation
is wrapped once (:func:`wrap_attention_layers`): the stock kernel still writes the KV cache
and computes all rows, then the rows of tree queries are recomputed by
:func:`vllm_eagle2.kernels.paged_tree_attention` (Triton on CUDA, the C++ kernel on CPU) with
their per-request masks and written over the stock result. Which rows, and with which masks, is
a :class:`TreeBatch` published for one forward through :func:`tree_batch`, a context manager:
vLLM copies its attention metadata before the kernels see it, so extra fields would not survive
that route. Outside a ``with tree_batch(...)`` every layer is plain causal attention, so no
batch can leak into a later forward (a draft level, the drafter's catch-up pass, a dummy run).

* A draft level (:mod:`vllm_eagle2.engine.proposer`) wraps its one head forward in
  ``with tree_batch(batch):``.
* Verification spans vLLM's ``execute_model``: its ``_prepare_inputs`` builds the batch, the
  target forward reads it. :mod:`vllm_eagle2.patches` wraps the whole ``execute_model`` in
  ``with tree_batch() as step.forward:`` (:mod:`vllm_eagle2.engine.step`) and
  :func:`vllm_eagle2.engine.verification.prepare_tree_verification` publishes into it.

The wrapper also keeps a copy of the tree rows' fresh K/V in a verification forward
(``TreeForward.kept_kv``), so that the KV of accepted tree nodes can be moved into place
afterwards, in vLLM's separate ``sample_tokens`` call, with the backend's own writer
(:func:`move_kv`). A copy, not the tensors handed to the cache writer: in vLLM's compiled mode
those are buffers of a compiled piece (or of a CUDA graph's pool) that the pieces after it reuse,
so by the time of the move they held other data (the greedy outputs of eagle2's trees differed
from plain decoding in compiled mode, 4 of 8 tiny-model prompts).

The wrapping is a patch of vLLM (``forward``, ``do_kv_cache_update`` and the ``_eagle2_wrapped`` marker
on each layer's ``impl`` instance, neither recorded nor rolled back): it is listed, with why, its
upstream reference and when to remove it, in the index of :mod:`vllm_eagle2.patches`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_eagle2.config import UNQUANTIZED_KV_DTYPES
from vllm_eagle2.kernels import check_cpu_kv_layout, cpu_backend, kv_cache_views, paged_tree_attention
from vllm_eagle2.kernels.warmup import AttentionCache

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionImpl
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("vllm.eagle2")  # under vLLM's logger: its handlers and level


@dataclass
class TreeBatch:
    """Tree queries of the next forward pass, R requests.

    rows: [Q] int64, rows of the flattened batch that are tree queries, grouped by request.
    query_start_loc: [R + 1] int64, cumulative query counts.
    block_table: [R, max_blocks] int32, the requests' rows of the block table.
    context_lens: [R] int64, tokens before the region (fully visible).
    region_lens: [R] int64, tokens in the region (visible through ``mask``).
    mask: [R, max_q, W] int32, packed visibility of region tokens per query: row i is the
        i-th query of the request, whichever region row it is (the verifier recomputes only
        the rows whose causal result is wrong).
    keep_kv: keep a copy of the fresh K/V of ``rows`` per layer (``TreeForward.kept_kv``) for
        :func:`move_kv`.
    plan_cache: handed to every layer's :func:`paged_tree_attention` call, which keeps the
        index work that all layers of this forward share there (a new batch, a new cache).
    """

    rows: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    region_lens: torch.Tensor
    mask: torch.Tensor
    keep_kv: bool = False
    plan_cache: dict = field(default_factory=dict)


#: Kept K/V of one forward, per layer (by id): ``(layer, key [Q, Hkv, D], value [Q, Hkv, D])``,
#: copies of the forward's rows ``TreeBatch.rows`` (row j of the copy is ``rows[j]``).
KeptKV = dict[int, tuple[Any, torch.Tensor, torch.Tensor]]


@dataclass
class TreeForward:
    """The tree attention of one forward: what its attention layers read and what they keep.

    batch: the tree queries, None = plain causal attention (all layers); set at entry to
        :func:`tree_batch` or once by :meth:`publish`.
    kept_kv: with ``batch.keep_kv``, a copy of each layer's fresh K/V of the tree rows, for
        :func:`move_kv`. The dict outlives the scope (the verifier keeps it on its step); the
        layers stop adding to it when the scope closes.
    """

    batch: TreeBatch | None = None
    kept_kv: KeptKV = field(default_factory=dict)

    def publish(self, batch: TreeBatch) -> None:
        """Set the tree queries of this forward once it has started (the verifier's route).

        Raises:
            RuntimeError: a batch is already published for this forward.
        """
        if self.batch is not None:
            raise RuntimeError("eagle2: this forward already has a tree batch")
        self.batch = batch


#: The forward inside :func:`tree_batch`, None outside: the side channel itself.
_active: TreeForward | None = None
_checked_layouts: set[tuple[str, torch.dtype, int, int]] = set()


@contextmanager
def tree_batch(batch: TreeBatch | None = None) -> Iterator[TreeForward]:
    """Scope of one forward's tree attention: the attention layers see ``batch`` inside only.

    Args:
        batch: the tree queries of the forward run inside; None to publish them later with
            :meth:`TreeForward.publish` (the forward's inputs are prepared inside the scope).

    Yields:
        The :class:`TreeForward`; its ``kept_kv`` stays readable after the scope.

    Raises:
        RuntimeError: another scope is active. One forward runs at a time; a nested scope
            would hide the outer one's batch from its own layers.
    """
    global _active
    if _active is not None:
        raise RuntimeError("eagle2: a tree batch is already active; tree_batch scopes do not nest")
    forward = TreeForward(batch)
    _active = forward
    try:
        yield forward
    finally:
        _active = None


def _layout_of(impl: AttentionImpl) -> str:
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


def unsupported_features(impl: AttentionImpl) -> list[str]:
    """What an attention layer's impl applies that the tree kernel does not (empty = none).

    The tree rows are recomputed by :func:`paged_tree_attention`, which knows plain softmax
    attention over an unquantized cache; any of these would make the tree rows differ from what
    the stock kernel computes for the same tokens, so eagle2 would not be lossless.
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


def _tree_forward(
    impl: AttentionImpl,
    layer: Any,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    batch: TreeBatch,
    max_seq_len: int | None,
) -> None:
    layout = _layout_of(impl)
    if layout == "cpu":
        isa = getattr(layer, "isa", "vec")
        key = (isa, kv_cache.dtype, kv_cache.shape[-1] // 2, kv_cache.shape[2])
        if key not in _checked_layouts:  # the KV layout is read directly: prove we read it right
            check_cpu_kv_layout(isa, kv_cache.dtype, key[2], key[3])
            _checked_layouts.add(key)
    key_cache, value_cache = kv_cache_views(kv_cache, layout)
    num_heads = query.shape[1]
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
    output.view(output.shape[0], num_heads, -1)[batch.rows] = out.to(output.dtype)


def wrap_attention_layers(layers: dict[str, Any]) -> None:
    """Wrap ``forward`` and ``do_kv_cache_update`` of every attention layer's impl once."""
    impls = (getattr(layer, "impl", None) for layer in layers.values())
    todo = [i for i in impls if hasattr(i, "forward") and not getattr(i, "_eagle2_wrapped", False)]
    layouts = {_layout_of(impl) for impl in todo}  # fail at start-up, not mid-request, if unknown
    for name, layer in layers.items():
        features = unsupported_features(getattr(layer, "impl", None))
        if features:
            raise RuntimeError(
                f"eagle2 cannot verify trees for this model: attention layer {name} uses "
                f"{', '.join(features)}, which eagle2's tree attention does not apply, so its output "
                "would differ from vLLM's. Serve it without eagle2 (vLLM's own 'eagle' drafts chains)."
            )
    if "cpu" in layouts:  # build the C++ kernel now, not mid-request (about 15 s, once per machine)
        logger.info("eagle2 tree attention on CPU: %s backend", cpu_backend())
    for impl in todo:
        stock_forward = impl.forward
        stock_update = getattr(impl, "do_kv_cache_update", None)

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
            **kwargs,
        ):
            result = _stock(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            # Outside a tree_batch scope (dummy runs, the catch-up pass): causal, as stock.
            batch = _active.batch if _active is not None else None
            if batch is not None and attn_metadata is not None and batch.rows.numel():
                max_seq_len = getattr(attn_metadata, "max_seq_len", None)
                _tree_forward(_impl, layer, query, kv_cache, result, batch, max_seq_len)
            return result

        def do_kv_cache_update(layer, key, value, kv_cache, slot_mapping, _stock=stock_update):
            _stock(layer, key, value, kv_cache, slot_mapping)
            forward = _active
            if forward is not None and forward.batch is not None and forward.batch.keep_kv:
                rows = forward.batch.rows  # a gather: a copy that no later piece can overwrite
                forward.kept_kv[id(layer)] = (layer, key[rows], value[rows])

        impl.forward = forward
        if stock_update is not None:
            impl.do_kv_cache_update = do_kv_cache_update
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
    """The cache views tree attention reads, one layer per distinct geometry, dtype and strides
    (what a kernel variant depends on): the target's layers and the head's."""
    found: dict[tuple, AttentionCache] = {}
    for layer in layers.values():
        kv_cache = getattr(layer, "kv_cache", None)
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.numel() == 0:
            continue
        key_cache, value_cache = kv_cache_views(kv_cache, _layout_of(layer.impl))
        signature = (key_cache.shape[1:], key_cache.stride(), key_cache.dtype, layer.impl.num_heads)
        found.setdefault(signature, AttentionCache(key_cache, value_cache, layer.impl.num_heads))
    return list(found.values())


def move_kv(
    kept: KeptKV,
    layer_names: set[str],
    layers: dict[str, Any],
    src: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Write kept K/V rows ``src`` [K] (indices into the kept copies) to cache slots ``dst_slots`` [K].

    ``kept``: a finished forward's ``TreeForward.kept_kv``, emptied here. Only for the layers
    named (the target's); uses each backend's own cache writer, so no layout knowledge is
    needed here. A slot of -1 writes nothing (vLLM's writers skip padding slots).

    Raises:
        RuntimeError: a named layer kept nothing: its cache writer ran where the wrapper does
            not (inside a compiled graph), and the accepted nodes' KV would be left unmoved.
    """
    if src.numel() == 0:
        return
    missing = sorted(name for name in layer_names if id(layers[name]) not in kept)
    if missing:
        raise RuntimeError(
            f"eagle2: the verification forward kept no K/V for {len(missing)} target attention "
            f"layers ({missing[0]}, ...): their KV-cache update ran inside a compiled graph, where "
            "eagle2 cannot see it. Keep vllm::unified_kv_cache_update in compilation_config.splitting_ops."
        )
    for name in layer_names:
        layer = layers[name]
        _, key, value = kept[id(layer)]
        layer.impl.do_kv_cache_update(layer, key[src], value[src], layer.kv_cache, dst_slots)
    kept.clear()
