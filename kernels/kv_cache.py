"""vLLM's paged KV-cache layouts, as tree attention and the accepted nodes' K/V moves read them.

vLLM's CPU backend keeps each layer's cache as ``[num_blocks, Hkv, block_size, 2 * D]``: per
(block, kv head) ``block_size * D`` keys, then ``block_size * D`` values, arranged by the ISA it
picked for the machine (``layer.isa``):

* ``"vec"`` and ``"vec16"`` (float32 everywhere, bf16 without AMX, odd head sizes): keys stored
  transposed as ``[D, block_size]``, values as ``[block_size, D]``.
* ``"amx"`` (bf16 on CPUs with AMX tiles): keys in groups of 16 tokens, each ``[D / 2, 16, 2]``
  (dim pairs of 16 tokens); values in groups of 16 dims, each ``[block_size / 2, 16, 2]``
  (token pairs of 16 dims): the VNNI operands of AMX's bf16 dot products.

vLLM's CUDA FlashAttention / Triton backends keep ``"flash"`` (``[num_blocks, Hkv, block_size,
2 * D]``, each token's key then its value). :func:`kv_cache_views` gives strided ``[num_blocks, Hkv,
block_size, D]`` views of ``"vec"`` and ``"flash"`` caches (what the Triton kernel and its torch
twin read); :func:`read_kv_slots` and :func:`write_kv_slots` read and write tokens by cache slot in
every layout; :func:`check_cpu_kv_layout` proves, through vLLM's own cache-write op, that the
layout read here is the one vLLM writes.
"""

from __future__ import annotations

import torch

__all__ = [
    "CPU_KV_LAYOUTS",
    "CPU_LAYOUT_CODES",
    "KV_LAYOUTS",
    "check_cpu_kv_layout",
    "cpu_layout",
    "kv_cache_views",
    "read_kv_slots",
    "write_kv_slots",
]

#: vLLM's CPU attention ISAs whose cache layout eagle2 reads, and the layout each one writes.
CPU_KV_LAYOUTS = {"vec": "vec", "vec16": "vec", "amx": "amx"}
#: Each CPU layout's code in the C++ kernels (``enum Layout`` of ``csrc/*.cpp``).
CPU_LAYOUT_CODES = {"vec": 0, "amx": 1}
assert set(CPU_KV_LAYOUTS.values()) == set(CPU_LAYOUT_CODES)
#: Layouts understood by :func:`read_kv_slots` (``"vec"`` and ``"flash"`` by :func:`kv_cache_views` too).
KV_LAYOUTS = ("vec", "amx", "flash")


def cpu_layout(isa: str) -> str:
    """The cache layout vLLM's CPU attention ISA ``isa`` writes (``"vec"`` or ``"amx"``).

    Raises:
        ValueError: an ISA whose layout eagle2 does not read (e.g. ``"neon"`` on ARM), naming it
            and the ones it reads.
    """
    if isa not in CPU_KV_LAYOUTS:
        raise ValueError(
            f"eagle2's CPU tree attention cannot read the KV cache of vLLM's {isa!r} attention ISA; "
            f"it reads {sorted(CPU_KV_LAYOUTS)} (x86 CPUs). Serve this machine without eagle2."
        )
    return CPU_KV_LAYOUTS[isa]


def _check_cache(kv_cache: object, layout: str) -> tuple[int, int, int, int]:
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() != 4 or kv_cache.shape[3] % 2 != 0:
        raise ValueError(
            f"kv_cache for layout {layout!r} must be [num_blocks, Hkv, block_size, 2*D], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    nb, hkv, bs, d2 = kv_cache.shape
    if kv_cache.stride(3) != 1 or (bs > 1 and kv_cache.stride(2) != d2):
        raise ValueError(
            f"kv_cache for layout {layout!r} must be contiguous in its last two dims, "
            f"got strides {kv_cache.stride()}"
        )
    if layout == "amx" and (bs % 16 or d2 % 64):
        raise ValueError(
            f"the 'amx' layout needs block_size % 16 == 0 and D % 32 == 0, got {bs} and {d2 // 2}"
        )
    return nb, hkv, bs, d2 // 2


def kv_cache_views(kv_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views ``[num_blocks, Hkv, block_size, D]`` of a ``"vec"`` or ``"flash"`` cache (no copy).

    Raises:
        ValueError: another ``layout`` (``"amx"`` interleaves pairs: no such view exists), or
            ``kv_cache`` of the wrong shape or strides for it.
    """
    if layout not in ("vec", "flash"):
        raise ValueError(f"kv_cache_views reads layouts 'vec' and 'flash', got {layout!r}")
    nb, hkv, bs, d = _check_cache(kv_cache, layout)
    if layout == "flash":
        return kv_cache[..., :d], kv_cache[..., d:]
    s0, s1 = kv_cache.stride(0), kv_cache.stride(1)
    base = kv_cache.storage_offset()
    key = torch.as_strided(kv_cache, (nb, hkv, bs, d), (s0, s1, 1, bs), base)
    value = torch.as_strided(kv_cache, (nb, hkv, bs, d), (s0, s1, d, 1), base + bs * d)
    return key, value


def _amx_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """6-D views of an ``"amx"`` cache: keys ``[nb, Hkv, bs/16, 16 tokens, D/2, 2 dims]`` and values
    ``[nb, Hkv, bs/2, 2 tokens, D/16, 16 dims]``, so that (block, head, token) indexing then a
    reshape of the last two dims gives a token's ``[D]``."""
    nb, hkv, bs, d = _check_cache(kv_cache, "amx")
    s0, s1 = kv_cache.stride(0), kv_cache.stride(1)
    base = kv_cache.storage_offset()
    key = torch.as_strided(kv_cache, (nb, hkv, bs // 16, 16, d // 2, 2), (s0, s1, 16 * d, 2, 32, 1), base)
    value = torch.as_strided(
        kv_cache, (nb, hkv, bs // 2, 2, d // 16, 16), (s0, s1, 32, 1, bs * 16, 2), base + bs * d
    )
    return key, value


def _slot_index(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bs = kv_cache.shape[2]
    slots = slots.to(device=kv_cache.device, dtype=torch.int64)
    return slots // bs, slots % bs


def read_kv_slots(
    kv_cache: torch.Tensor, layout: str, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[n, Hkv, D]`` (copies) of the tokens at cache ``slots`` ``[n]`` (>= 0).

    Raises:
        ValueError: unknown ``layout``, or a cache of the wrong shape for it.
    """
    if layout not in KV_LAYOUTS:
        raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
    blk, off = _slot_index(kv_cache, slots)
    n, hkv, d = slots.numel(), kv_cache.shape[1], kv_cache.shape[3] // 2
    if layout != "amx":
        key, value = kv_cache_views(kv_cache, layout)
        return key[blk, :, off], value[blk, :, off]
    key, value = _amx_views(kv_cache)
    return (
        key[blk, :, off // 16, off % 16].reshape(n, hkv, d),
        value[blk, :, off // 2, off % 2].reshape(n, hkv, d),
    )


def write_kv_slots(
    kv_cache: torch.Tensor, layout: str, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[n, Hkv, D]`` at cache ``slots`` ``[n]``; a slot < 0 writes nothing.

    The torch twin of vLLM's cache writers (``cpu_attn_reshape_and_cache``, FlashAttention's
    ``reshape_and_cache_flash``): the tests write caches of machines vLLM's own writer does not run
    on (the ``"amx"`` layout needs an AMX CPU) with it.
    """
    keep = slots >= 0
    slots, key, value = slots[keep], key[keep], value[keep]
    blk, off = _slot_index(kv_cache, slots)
    n, hkv, d = slots.numel(), kv_cache.shape[1], kv_cache.shape[3] // 2
    if layout != "amx":
        kv, vv = kv_cache_views(kv_cache, layout)
        kv[blk, :, off] = key.to(kv_cache.dtype)
        vv[blk, :, off] = value.to(kv_cache.dtype)
        return
    kv, vv = _amx_views(kv_cache)
    kv[blk, :, off // 16, off % 16] = key.to(kv_cache.dtype).reshape(n, hkv, d // 2, 2)
    vv[blk, :, off // 2, off % 2] = value.to(kv_cache.dtype).reshape(n, hkv, d // 16, 16)


def check_cpu_kv_layout(isa: str, dtype: torch.dtype, head_size: int, block_size: int) -> None:
    """Prove on a scratch cache that vLLM's CPU cache-write op for ``isa`` stores what
    :func:`read_kv_slots` reads for its layout (:func:`cpu_layout`).

    Writes a few random tokens with ``vllm._custom_ops.cpu_attn_reshape_and_cache`` (as vLLM's
    CPU_ATTN backend does) into ``[2, 2, block_size, 2*head_size]`` and reads them back.

    Raises:
        ValueError: an ISA whose layout eagle2 does not read.
        RuntimeError: vLLM is not importable, its op rejects the configuration, or what it wrote is
            not where the reader looks.
    """
    layout = cpu_layout(isa)
    try:
        from vllm import _custom_ops as ops
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(f"check_cpu_kv_layout needs vLLM's custom ops: {exc}") from exc

    what = f"isa={isa!r}, dtype={dtype}, head_size={head_size}, block_size={block_size}"
    nb, hkv = 2, 2
    ntok = min(nb * block_size, 2 * block_size + 3)
    gen = torch.Generator().manual_seed(1234)
    key = torch.randn(ntok, hkv, head_size, generator=gen).to(dtype)
    val = torch.randn(ntok, hkv, head_size, generator=gen).to(dtype)
    slots = torch.randperm(nb * block_size, generator=gen)[:ntok].to(torch.int64)
    kv = torch.zeros(nb, hkv, block_size, 2 * head_size, dtype=dtype)
    k_cache, v_cache = kv.view(nb, hkv, block_size * 2, head_size).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(key, val, k_cache, v_cache, slots, isa)
    except Exception as exc:
        raise RuntimeError(f"vLLM's cpu_attn_reshape_and_cache failed for {what}: {exc}") from exc
    got_k, got_v = read_kv_slots(kv, layout, slots)
    if not (torch.equal(got_k, key) and torch.equal(got_v, val)):
        raise RuntimeError(
            f"vLLM's CPU KV-cache layout for {what} differs from eagle2's {layout!r} layout "
            "(kernels/kv_cache.py); tree attention cannot read this cache"
        )
