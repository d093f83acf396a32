"""Views of vLLM's paged KV caches as the ``[num_blocks, Hkv, block_size, D]`` tensors tree attention reads.

:func:`kv_cache_views` makes key and value views of vLLM's CPU (``"cpu"``) and CUDA
FlashAttention/Triton (``"flash"``) cache layouts without copying; :func:`check_cpu_kv_layout`
proves on a scratch cache that vLLM's CPU cache-write op stores what the ``"cpu"`` views read
(the layout depends on vLLM's ISA choice, so it is checked rather than assumed).
"""

from __future__ import annotations

import torch

__all__ = ["KV_LAYOUTS", "check_cpu_kv_layout", "kv_cache_views"]

#: Layouts understood by :func:`kv_cache_views`.
KV_LAYOUTS = ("cpu", "flash")


def kv_cache_views(kv_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views ``[num_blocks, Hkv, block_size, D]`` of a vLLM KV cache (no copy).

    Args:
        kv_cache: one layer's cache tensor.

            * ``layout="cpu"`` (vLLM CPU_ATTN backend, ISAs ``"vec"`` /
              ``"vec16"``): shape ``[num_blocks, Hkv, block_size, 2*D]``.  Per
              (block, kv head) the contiguous ``block_size * 2D`` elements hold
              first the keys stored transposed as ``[D, block_size]``
              (element ``(d, t)`` at offset ``d * block_size + t``), then the
              values as ``[block_size, D]`` (offset
              ``block_size * D + t * D + d``).  The last two dims must be
              contiguous; block and head strides are taken from the tensor.
            * ``layout="flash"`` (vLLM 0.32 CUDA FlashAttention / Triton attention
              backends, "LBHNC"): shape ``[num_blocks, Hkv, block_size, 2*D]`` with
              each token's key in ``[..., :D]`` and its value in ``[..., D:]``.

        layout: ``"cpu"`` or ``"flash"``.

    Returns:
        ``(key_cache, value_cache)``, each ``[num_blocks, Hkv, block_size, D]``
        sharing storage with ``kv_cache``.

    Raises:
        ValueError: unknown ``layout`` or ``kv_cache`` of the wrong shape /
            strides for it.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if layout == "cpu":
        if kv_cache.dim() != 4 or kv_cache.shape[3] % 2 != 0:
            raise ValueError(
                f"kv_cache for layout 'cpu' must be [num_blocks, Hkv, block_size, 2*D], "
                f"got shape {tuple(kv_cache.shape)}"
            )
        nb, hkv, bs, d2 = kv_cache.shape
        d = d2 // 2
        if kv_cache.stride(3) != 1 or (bs > 1 and kv_cache.stride(2) != d2):
            raise ValueError(
                "kv_cache for layout 'cpu' must be contiguous in its last two dims, "
                f"got strides {kv_cache.stride()}"
            )
        s0, s1 = kv_cache.stride(0), kv_cache.stride(1)
        base = kv_cache.storage_offset()
        key = torch.as_strided(kv_cache, (nb, hkv, bs, d), (s0, s1, 1, bs), base)
        value = torch.as_strided(kv_cache, (nb, hkv, bs, d), (s0, s1, d, 1), base + bs * d)
        return key, value
    if layout == "flash":
        if kv_cache.dim() != 4 or kv_cache.shape[3] % 2 != 0:
            raise ValueError(
                "kv_cache for layout 'flash' must be [num_blocks, Hkv, block_size, 2*D], "
                f"got shape {tuple(kv_cache.shape)}"
            )
        d = kv_cache.shape[3] // 2
        return kv_cache[..., :d], kv_cache[..., d:]
    raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")


def check_cpu_kv_layout(isa: str, dtype: torch.dtype, head_size: int, block_size: int) -> None:
    """Verify that vLLM's CPU cache-write op uses the ``"cpu"`` layout of :func:`kv_cache_views`.

    Writes a few random tokens with ``vllm._custom_ops.cpu_attn_reshape_and_cache``
    (exactly as vLLM's CPU_ATTN backend does) into a small scratch cache
    ``[2, 2, block_size, 2*head_size]`` and reads them back through the views.

    Args:
        isa: the CPU attention ISA vLLM selected (``"vec"``, ``"vec16"``, ...).
        dtype: KV-cache dtype.
        head_size: ``D``.
        block_size: tokens per cache block.

    Raises:
        RuntimeError: vLLM is not importable, its op rejects the
            configuration, or the data it wrote is not where the views expect
            it (e.g. the ``"amx"`` layout).
    """
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
    k_view, v_view = kv_cache_views(kv, "cpu")
    blk, off = slots // block_size, slots % block_size
    if not (torch.equal(k_view[blk, :, off], key) and torch.equal(v_view[blk, :, off], val)):
        raise RuntimeError(
            f"vLLM's CPU KV-cache layout for {what} differs from the one paged_tree_attention "
            "assumes (per block and kv head: keys transposed as [D, block_size], then values "
            "as [block_size, D]); tree attention cannot read this cache"
        )
