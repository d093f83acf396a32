"""Tree-attention masks for EAGLE-2 draft trees.

A draft tree for one sequence is described by a ``parents`` row of length
``N`` (the number of draft nodes, i.e. tokens that will be verified in one
target-model forward pass):

* ``parents[b, i] == -1``  node ``i`` is a child of the root.  The root is the
  last verified token of the sequence; it is *not* one of the ``N`` nodes.
* ``parents[b, i] == j``   with ``0 <= j < i``: node ``j`` is the parent of
  node ``i`` (parents always precede their children, i.e. the nodes are in a
  topological order).
* ``parents[b, i] == -2``  padding: there is no node ``i``.  Its mask row is
  all ``False``, its depth is 0, and no valid node may list it as parent.

From this we derive, per batch row ``b``:

* ``dense[b, i, j]``  -- ``True`` iff node ``j`` is an ancestor of node ``i``
  or ``j == i`` (the "ancestor-or-self" tree-attention mask; the root and the
  rest of the context are always visible and are not part of this mask).
* ``packed[b, i, w]`` -- the same mask as ``int32`` bit words: bit ``j % 32``
  of word ``j // 32`` of row ``i`` is ``dense[b, i, j]`` (little-endian bit
  order inside a word; bit 31 is the sign bit of the ``int32``).
* ``depths[b, i]``    -- 1 for a child of the root, ``1 + depths[parent]``
  otherwise, 0 for padding.  Equals the number of ``True`` entries in
  ``dense[b, i]``.
* ``positions[b, i]`` -- ``context_lens[b] - 1 + depths[b, i]`` where
  ``context_lens[b]`` counts the tokens of the sequence *including* the
  root, so the root sits at ``context_lens[b] - 1``.  Padding nodes get the
  root position (depth 0).

Two interchangeable backends compute these:

* ``"torch"``  -- vectorised pure torch (pointer jumping, ``ceil(log2 N)``
  iterations; no Python loop over batch rows or nodes).  CPU path and test
  oracle.  Also validates the parent values.
* ``"triton"`` -- a Triton kernel, one program per (batch row, block of
  nodes), that walks up the parent chains and sets the packed bits and
  depths.  Does no value validation (that would need a host sync); bad
  parent indices cannot cause out-of-bounds accesses but give unspecified
  masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import HAS_TRITON, tl, triton

__all__ = [
    "HAS_TRITON",
    "PAD_PARENT",
    "ROOT_PARENT",
    "TreeMasks",
    "build_tree_masks",
    "pack_tree_mask",
]

#: ``parents`` value of a child of the root.
ROOT_PARENT = -1
#: ``parents`` value of a padding slot (no node).
PAD_PARENT = -2

_BITS = 32
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass
class TreeMasks:
    """Masks and metadata of a batch of draft trees.

    Attributes:
        packed: ``[B, N, W]`` int32 with ``W = ceil(N / 32)``; bit
            ``j % 32`` of word ``j // 32`` of row ``i`` is True iff node ``j``
            is an ancestor of node ``i`` or ``j == i``.  Bits for ``j >= N``
            and padding rows are 0.
        depths: ``[B, N]`` int64; 1 for children of the root, parent depth
            + 1 otherwise, 0 for padding.
        positions: ``[B, N]`` int64 ``context_lens[:, None] - 1 + depths``
            when ``context_lens`` was given, else None.
    """

    packed: torch.Tensor
    depths: torch.Tensor
    positions: torch.Tensor | None


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #


def _check_parents(parents: torch.Tensor) -> None:
    """Shape/dtype checks (no device sync)."""
    shape = tuple(parents.shape) if isinstance(parents, torch.Tensor) else None
    if shape is None or len(shape) != 2:
        got = f"shape {shape}" if shape is not None else type(parents).__name__
        raise ValueError(f"parents must be a 2-D [B, N] torch.Tensor, got {got}")
    if parents.dtype not in _INT_DTYPES:
        raise ValueError(f"parents must have an integer dtype, got {parents.dtype}")


def _check_parent_values(parents: torch.Tensor) -> None:
    """Value checks (vectorised; syncs with the device once).

    ``parents`` must already be int64.
    """
    n = parents.shape[1]
    if parents.numel() == 0:
        return
    idx = torch.arange(n, device=parents.device)
    bad_low = parents < PAD_PARENT
    bad_order = parents >= idx  # also catches parents >= N
    # A valid node must not hang below a padding slot.
    has_parent = parents >= 0
    safe = parents.clamp(min=0, max=n - 1)
    grand = torch.gather(parents, 1, safe)
    bad_pad = has_parent & (grand == PAD_PARENT)
    if bool((bad_low | bad_order | bad_pad).any()):
        raise ValueError(
            "invalid parents: every entry must be -2 (padding), -1 (child of the "
            "root) or the index j < i of a non-padding parent node"
        )


def _check_context_lens(context_lens: torch.Tensor, batch: int) -> None:
    shape = tuple(context_lens.shape) if isinstance(context_lens, torch.Tensor) else None
    if shape != (batch,):
        got = f"shape {shape}" if shape is not None else type(context_lens).__name__
        raise ValueError(f"context_lens must be a [{batch}] torch.Tensor, got {got}")
    if context_lens.dtype not in _INT_DTYPES:
        raise ValueError(f"context_lens must have an integer dtype, got {context_lens.dtype}")


# --------------------------------------------------------------------------- #
# Bit packing helpers (torch)
# --------------------------------------------------------------------------- #


def pack_tree_mask(dense: torch.Tensor) -> torch.Tensor:
    """Pack a boolean mask ``[..., N]`` into int32 words ``[..., ceil(N/32)]``.

    Bit ``j % 32`` of word ``j // 32`` holds ``dense[..., j]``; unused high
    bits of the last word are 0.  Bit 31 is the int32 sign bit (values are
    the two's-complement reinterpretation of the unsigned 32-bit word).
    """
    n = dense.shape[-1]
    w = (n + _BITS - 1) // _BITS
    lead = dense.shape[:-1]
    bits = torch.zeros(*lead, w * _BITS, dtype=torch.int64, device=dense.device)
    bits[..., :n] = dense.to(torch.int64)
    weights = torch.ones(_BITS, dtype=torch.int64, device=dense.device) << torch.arange(
        _BITS, dtype=torch.int64, device=dense.device
    )
    words = (bits.view(*lead, w, _BITS) * weights).sum(-1)  # in [0, 2**32)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


# --------------------------------------------------------------------------- #
# Torch backend
# --------------------------------------------------------------------------- #


def ancestor_tables(parents: torch.Tensor) -> list[torch.Tensor]:
    """Pointer-jumping tables of a batch of trees: table r, [B, N + 1] int64, holds every node's
    ancestor 2**r hops up.

    parents: [B, N] int64, < 0 = child of the root (or padding). The root is an extra node N
    that points to itself, so jumping past it needs no masking. ``max(1, ceil(log2 N))``
    tables: enough to cover the longest chain (N - 1 hops).
    """
    n = parents.shape[1]
    up = torch.nn.functional.pad(torch.where(parents < 0, n, parents), (0, 1), value=n)
    tables = [up]
    for _ in range(max(0, n - 1).bit_length() - 1):
        tables.append(tables[-1].gather(1, tables[-1]))
    return tables


def _dense_depths_torch(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-or-self mask and depths by pointer jumping (:func:`ancestor_tables`).

    Invariant after round r: ``anc[b, i]`` = ancestors of ``i`` at distance ``< 2**(r + 1)``
    (self included); the root row N is all False.
    """
    b, n = parents.shape
    anc = torch.zeros(b, n + 1, n, dtype=torch.bool, device=parents.device)
    valid = parents != PAD_PARENT
    anc[:, :n] = torch.eye(n, dtype=torch.bool, device=parents.device).unsqueeze(0) & valid[:, :, None]
    for up in ancestor_tables(parents):
        anc = anc | torch.gather(anc, 1, up[:, :, None].expand(b, n + 1, n))
    dense = anc[:, :n]
    depths = dense.sum(-1, dtype=torch.int64)
    return dense, depths


# --------------------------------------------------------------------------- #
# Triton backend
# --------------------------------------------------------------------------- #

if HAS_TRITON:
    # N and W follow the tree width: kept out of specialisation, the blocks alone pick the variant.
    @triton.jit(do_not_specialize=["N", "W"])
    def _tree_mask_kernel(
        parents_ptr,  # [B, N] any integer dtype, contiguous
        packed_ptr,  # [B, N, W] int32, contiguous (output)
        depths_ptr,  # [B, N] int64, contiguous (output)
        N,
        W,
        BLOCK_N: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        """One program per (batch row, block of BLOCK_N nodes).

        Every node walks up its parent chain (at most N steps), OR-ing the
        bit of each visited node (itself first) into its packed row held in
        registers and counting the steps as its depth.
        """
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_w = tl.arange(0, BLOCK_W)
        in_range = offs_n < N
        row_base = pid_b.to(tl.int64) * N
        par = tl.load(parents_ptr + row_base + offs_n, mask=in_range, other=-2).to(tl.int64)

        cur = offs_n.to(tl.int64)
        alive = in_range & (par != -2)
        words = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
        depth = tl.zeros([BLOCK_N], dtype=tl.int64)
        one = tl.full([BLOCK_N], 1, dtype=tl.int32)
        for _ in range(N):
            word_idx = (cur // 32).to(tl.int32)
            bit = one << (cur % 32).to(tl.int32)
            hit = alive[:, None] & (offs_w[None, :] == word_idx[:, None])
            words = words | tl.where(hit, bit[:, None], 0)
            depth = depth + alive.to(tl.int64)
            nxt = tl.load(parents_ptr + row_base + cur, mask=alive, other=-1).to(tl.int64)
            alive = alive & (nxt >= 0) & (nxt < N)
            cur = tl.where(alive, nxt, 0)

        out_rows = row_base + offs_n
        tl.store(depths_ptr + out_rows, depth, mask=in_range)
        w_mask = in_range[:, None] & (offs_w[None, :] < W)
        tl.store(
            packed_ptr + out_rows[:, None] * W + offs_w[None, :],
            words,
            mask=w_mask,
        )


def mask_blocks(n: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_W) of the mask kernel for trees of ``n`` nodes: its only constexprs."""
    block_w = max(1, _next_pow2((n + _BITS - 1) // _BITS))
    # Keep the [BLOCK_N, BLOCK_W] register tile small.
    return max(1, min(_next_pow2(n), max(1, 2048 // block_w), 64)), block_w


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _packed_depths_triton(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' requested but triton is not importable")
    b, n = parents.shape
    w = (n + _BITS - 1) // _BITS
    # The kernel writes every word and depth of every row (padding rows: 0), so no zero fill:
    # with the dtype read in-kernel this is the call's only launch.
    packed = torch.empty(b, n, w, dtype=torch.int32, device=parents.device)
    depths = torch.empty(b, n, dtype=torch.int64, device=parents.device)
    if b == 0 or n == 0:
        return packed, depths
    block_n, block_w = mask_blocks(n)
    grid = (b, triton.cdiv(n, block_n))
    _tree_mask_kernel[grid](parents.contiguous(), packed, depths, n, w, BLOCK_N=block_n, BLOCK_W=block_w)
    return packed, depths


# --------------------------------------------------------------------------- #
# Public entry point
# --------------------------------------------------------------------------- #


def build_tree_masks(
    parents: torch.Tensor,
    context_lens: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    check_values: bool = True,
) -> TreeMasks:
    """Build tree-attention masks, depths and positions for a batch of trees.

    Args:
        parents: ``[B, N]`` integer tensor; ``parents[b, i]`` is ``-1`` for a
            child of the root, ``-2`` for padding, otherwise the index
            ``j < i`` of the parent node.
        context_lens: optional ``[B]`` integer tensor, number of tokens of each
            sequence *including* the root token.
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton when
            ``parents`` is on CUDA and Triton is importable, else torch).
        check_values: (torch backend) validate the parent indices, one host
            sync; the per-step caller, whose trees are valid by construction,
            passes False so the call never syncs.

    Returns:
        :class:`TreeMasks` with ``dense`` ``[B, N, N]`` bool, ``packed``
        ``[B, N, ceil(N/32)]`` int32, ``depths`` ``[B, N]`` int64 and
        ``positions`` ``[B, N]`` int64 (or None without ``context_lens``).

    Raises:
        ValueError: ``parents`` is not a 2-D integer tensor, or (torch
            backend only) holds an invalid parent index; ``context_lens`` has
            the wrong shape/dtype; unknown ``backend``.
    """
    _check_parents(parents)
    if backend == "auto":
        backend = "triton" if (parents.is_cuda and HAS_TRITON) else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if context_lens is not None:
        _check_context_lens(context_lens, parents.shape[0])

    if backend == "torch":
        parents = parents.to(torch.int64)
        if check_values:
            _check_parent_values(parents)
        dense, depths = _dense_depths_torch(parents)
        packed = pack_tree_mask(dense)
    else:
        packed, depths = _packed_depths_triton(parents)

    positions = None
    if context_lens is not None:
        ctx = context_lens.to(device=parents.device, dtype=torch.int64)
        positions = ctx[:, None] - 1 + depths
    masks = TreeMasks(packed=packed, depths=depths, positions=positions)
    if backend == "torch":
        masks.__dict__["dense"] = dense  # already built: seed the cached property
    return masks
