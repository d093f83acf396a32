"""Triton, when installed: the kernels' torch twins work without it (the CPU path)."""

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "tl", "triton"]
