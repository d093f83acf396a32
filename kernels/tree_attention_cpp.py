"""C++ CPU backend ("cpp") of paged tree attention, and the choice of CPU backend.

The kernel (``csrc/tree_attention_cpu.cpp``, built on first use by :mod:`._cpp`) reads K/V in
place through the block table and the caches' strides, float32 scores; one work item per
(request, tile of 8 of its queries, kv head), so each K/V block is converted once for the
tile's queries and the group's query heads.  The CPU path inside vLLM; it validates the index
values like the torch twin (:mod:`.tree_attention_torch`), which it is tested against.
Semantics: :mod:`vllm_eagle2.kernels.tree_attention`.
"""

from __future__ import annotations

import logging
import os

import torch

from ._cpp import load_cpu_ops

__all__ = ["CPU_BACKEND_ENV", "cpu_backend", "paged_tree_attention_cpp"]

logger = logging.getLogger("vllm.eagle2")  # under vLLM's logger: its handlers and level

#: Environment variable that picks the CPU backend of ``backend="auto"`` (unset: cpp, else torch).
CPU_BACKEND_ENV = "VLLM_EAGLE2_CPU_ATTENTION"
_cpp_state: dict[str, bool] = {}  # "ok": whether the kernel was built, once tried


def cpu_backend() -> str:
    """The backend ``"auto"`` takes on CPU: ``"cpp"`` (built on the first call), else ``"torch"``.

    ``$VLLM_EAGLE2_CPU_ATTENTION`` = ``cpp`` or ``torch`` forces one (``cpp`` then fails if the
    kernel cannot be built, instead of falling back).

    Raises:
        ValueError: the variable holds another value.
        RuntimeError: it says ``cpp`` and the kernel cannot be built.
    """
    forced = os.environ.get(CPU_BACKEND_ENV, "")
    if forced not in ("", "cpp", "torch"):
        raise ValueError(f"{CPU_BACKEND_ENV} must be 'cpp' or 'torch' (or unset), got {forced!r}")
    if forced == "torch":
        return "torch"
    if forced == "cpp":
        load_cpu_ops()
        return "cpp"
    if "ok" not in _cpp_state:
        try:
            load_cpu_ops()
            _cpp_state["ok"] = True
        except RuntimeError as exc:
            logger.warning("eagle2 tree attention falls back to its slower torch backend: %s", exc)
            _cpp_state["ok"] = False
    return "cpp" if _cpp_state["ok"] else "torch"


def paged_tree_attention_cpp(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    region_lens: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    plan_cache: dict | None = None,
) -> None:
    """Run the C++ kernel; writes ``out`` ``[Q, H, D]``.

    Arguments as :func:`~vllm_eagle2.kernels.paged_tree_attention`, shapes already checked; the
    kernel checks the index values itself, as the torch twin does.

    ``plan_cache`` keeps the index tensors as the kernel takes them (contiguous int64 / int32)
    for every layer of one forward.
    """
    load_cpu_ops()
    key = ("cpp", query.shape[0])
    idx = plan_cache.get(key) if plan_cache is not None else None
    if idx is None:
        lengths = (block_table, query_start_loc, context_lens, region_lens)
        idx = (*(t.to(torch.int64).contiguous() for t in lengths), mask.contiguous())
        if plan_cache is not None:
            plan_cache[key] = idx
    torch.ops.eagle2_cpu.tree_attention(query, key_cache, value_cache, *idx, float(scale), out)
