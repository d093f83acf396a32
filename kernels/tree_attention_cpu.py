"""Tree rows of one attention layer on CPU, read in place from vLLM's paged KV cache.

Inside vLLM, each request's rows of a forward are its root and leading chain, which vLLM's own
causal kernel computes, then its tree rows, a suffix of its rows, which only this kernel computes.
The kernel reads queries and K/V where vLLM keeps them (the cache in the layout vLLM chose,
:mod:`.kv_cache`) and writes its rows into the layer's output in place. Semantics, for request
``r`` of a plan: its queries are rows ``first_row .. first_row + q - 1`` of ``query``, the last ``q``
of a region of ``T`` tokens stored after ``C`` context tokens; query ``i`` attends to every context
token and to region token ``j`` iff bit ``j % 32`` of ``mask[r, i, j // 32]`` is set.

One plan serves every layer of a forward: :func:`plan_cpu_tree_attention` validates the index
values once; a layer's :func:`cpu_tree_attention` only checks what differs between layers (shapes,
dtypes, the cache's geometry). Two backends: the C++ kernel (``csrc/tree_attention_cpu.cpp``) and
its torch twin (:mod:`.tree_attention_cpu_torch`), which is the reference and the fallback where
the kernel cannot be built.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ._cpp import load_cpu_ops
from .kv_cache import CPU_LAYOUT_CODES, cpu_layout
from .tree_attention_cpu_torch import cpu_tree_attention_torch, plan_torch

__all__ = ["CPU_BACKEND_ENV", "CpuTreePlan", "cpu_backend", "cpu_tree_attention", "plan_cpu_tree_attention"]

logger = logging.getLogger("vllm.eagle2")  # under vLLM's logger: its handlers and level

#: Environment variable that picks the CPU backend of ``backend="auto"`` (unset: cpp, else torch).
CPU_BACKEND_ENV = "VLLM_EAGLE2_CPU_ATTENTION"
_cpp_state: dict[str, bool] = {}  # "ok": whether the kernel was built, once tried


@dataclass(frozen=True)
class CpuTreePlan:
    """One forward's tree rows, validated, as both backends read them.

    plan: [R + 1, 4] int64; row 0 is (R, num_blocks, block_size, num_rows) it was validated
        against, row r + 1 is request r's (first_row, queries, context C, region T).
    block_table: [R, max_blocks] int32, contiguous.
    mask: [R, max_q, W] int32, contiguous.
    """

    plan: torch.Tensor
    block_table: torch.Tensor
    mask: torch.Tensor

    @property
    def requests(self) -> torch.Tensor:
        """[R, 4] int64: (first_row, queries, context, region) per request."""
        return self.plan[1:]


def cpu_backend() -> str:
    """The backend ``"auto"`` takes: ``"cpp"`` (built on the first call), else ``"torch"``.

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


def _int(name: str, x: object, ndim: int, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != ndim or x.is_floating_point() or x.is_complex():
        raise ValueError(f"{name} must be a {ndim}-D integer torch.Tensor, got {x!r:.80}")
    return x.to(device="cpu", dtype=dtype).contiguous()


def plan_cpu_tree_attention(
    rows: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    region_lens: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_blocks: int,
    block_size: int,
    num_rows: int,
) -> CpuTreePlan:
    """Validate one forward's tree rows and pack them for :func:`cpu_tree_attention` (in C++, a
    few microseconds; with the torch backend, its twin).

    Args:
        rows: [Q] int, the tree rows of the forward's flattened batch, grouped by request; each
            request's are consecutive.
        query_start_loc: [R + 1] int, cumulative tree rows per request.
        block_table: [R, max_blocks] int, the requests' rows of vLLM's block table.
        context_lens: [R] int, ``C``; region_lens: [R] int, ``T`` (>= the request's queries).
        mask: [R, max_q, W] int32 packed bits (:func:`~vllm_eagle2.kernels.pack_tree_mask`).
        num_blocks, block_size: the KV cache's; num_rows: the forward's rows.

    Raises:
        ValueError: a shape, a length or an index out of range, naming which.
    """
    table = _int("block_table", block_table, 2, torch.int32)
    mask = _int("mask", mask, 3, torch.int32)
    index = (
        _int("rows", rows, 1, torch.int64),
        _int("query_start_loc", query_start_loc, 1, torch.int64),
        table,
        _int("context_lens", context_lens, 1, torch.int64),
        _int("region_lens", region_lens, 1, torch.int64),
        mask,
    )
    if cpu_backend() == "cpp":
        plan = torch.ops.eagle2_cpu.tree_attention_plan(*index, num_blocks, block_size, num_rows)
    else:
        plan = plan_torch(*index, num_blocks, block_size, num_rows)
    return CpuTreePlan(plan, table, mask)


def cpu_tree_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    isa: str,
    plan: CpuTreePlan,
    scale: float,
    out: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Write the plan's rows of ``out`` ``[N, H, D]`` (any strides) with their tree attention.

    Args:
        query: [N, H, D] the layer's queries (any strides), N >= the plan's rows.
        kv_cache: the layer's vLLM CPU cache ``[num_blocks, Hkv, block_size, 2 * D]``, the
            plan's ``num_blocks`` and ``block_size``.
        isa: the layer's ``isa`` (vLLM's choice: ``"vec"``, ``"vec16"``, ``"amx"``).
        plan: from :func:`plan_cpu_tree_attention`, for this forward.
        backend: ``"cpp"``, ``"torch"`` or ``"auto"`` (:func:`cpu_backend`).

    Raises:
        ValueError: an ISA whose layout is not read here, an unknown backend.
        RuntimeError: (cpp) shapes, dtypes or the cache disagree with the plan.
    """
    layout = cpu_layout(isa)
    if backend == "auto":
        backend = cpu_backend()
    if backend == "torch":
        cpu_tree_attention_torch(query, kv_cache, layout, plan.plan, plan.block_table, plan.mask, scale, out)
    elif backend == "cpp":
        load_cpu_ops()
        torch.ops.eagle2_cpu.tree_attention(
            query,
            kv_cache,
            CPU_LAYOUT_CODES[layout],
            plan.block_table,
            plan.plan,
            plan.mask,
            float(scale),
            out,
        )
    else:
        raise ValueError(f"backend must be 'auto', 'cpp' or 'torch', got {backend!r}")
