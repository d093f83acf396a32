"""Top-k of each row's log-softmax without materialising the log-softmax.

``vocab_topk(logits, k)`` returns, for every row of ``logits`` [R, V], the ``k`` largest
log-probabilities ``logit - logsumexp(row)`` (sorted descending, float32) and their
vocabulary indices (int64). With ``scale`` [R], row ``r`` is first multiplied by
``scale[r]`` (float32), so ``scale = 1 / T`` gives the top-k of
``log_softmax(logits / T)``. Only the ``k`` winners are ever normalised: the draft tree
needs ``k`` (≈10) log-probs out of V (≈128k) per row, so writing [R, V] float32
log-probs first and running ``torch.topk`` over them costs several times the one read
of the logits that is really needed.

Conventions shared by both backends (no host synchronisation anywhere):

* The scale (if any) is applied first, in float32; everything below is about the scaled
  values. A product that overflows to +inf is thereby treated as -inf.
* NaN and +inf logits count as -inf: they never outrank a real logit and add nothing
  to the log-sum-exp. A row whose logits are all -inf/NaN/+inf yields ``k`` values of
  -inf with valid (but otherwise arbitrary) indices in ``[0, V)``.
* Ties: the Triton kernel orders by (value descending, index ascending), so among equal
  values the lower vocabulary index wins and an all -inf row yields indices ``0..k-1``.
  The torch twin uses ``torch.topk``, whose order among equal values is unspecified.
  Values always agree; indices agree wherever the values are distinct.

Backends:

* ``"torch"``: the twin, ``nan_to_num`` + ``topk`` + ``logsumexp`` (CPU path and
  test oracle; it does make one float32 copy of the logits, two with a scale).
* ``"triton"``: two kernels. Stage 1, grid (R, C): each program streams one chunk of a
  row in tiles (scaled right after the load: no extra pass), keeps the chunk's running
  max and sum of exponentials (online softmax, float32) and a list of the chunk's ``k``
  best candidates; a tile enters the (rarely taken) insertion loop of ``k`` rounds only
  when its max beats the current k-th candidate, so after the first tiles of a chunk
  the cost is that of reading it. C is chosen so that even a few rows give every SM
  some chunks. Stage 2, grid (R,): merges the C candidate lists into the final sorted
  top-k and the C partial sums into the row's log-sum-exp, and normalises the winners.
* ``"auto"``: Triton for CUDA tensors when Triton imports, else torch.

Measured on an H200 (bf16, V = 128256, k = 10, CUDA-graph replay): R = 10 rows 17 us
(float32 log_softmax + torch.topk: 100 us), R = 640 rows ~170 us (1576 us; one read of
the logits ~40 us). At large R the insertion rounds, not the read, bound the kernel.
With ``k = 1`` an insertion is one round, taken only when a tile raises its chunk's
maximum: each row's argmax (lowest index among equal maxima, torch.argmax's first-maximum
rule) and, as ``x[argmax] - logprob``, its log-sum-exp. Verification uses it that way: on
the H200, greedy verification of 64 trees of 60 nodes (3,904 rows of 128,256 bf16
logits) takes 530 us of GPU time in all, the kernel included.
"""

from __future__ import annotations

import math

import torch

from ._triton import HAS_TRITON, tl, triton

__all__ = ["vocab_topk"]

_BACKENDS = ("auto", "torch", "triton")
# Indices of empty candidate slots: they lose every tie to a real index (< V < 2**30).
_EMPTY_INDEX = 1 << 30
# Index of an element already taken out of a tile: loses even to an empty slot.
_TAKEN_INDEX = (1 << 31) - 1
_TILE = 2048  # H200 sweep: 2048 x 4 warps best or near it for R = 10 and R = 640
_NUM_WARPS = 4


def vocab_topk(
    logits: torch.Tensor,
    k: int,
    *,
    scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` log-softmax values of each row, without [R, V] float32 log-probs.

    Args:
        logits: [R, V] float16/bfloat16/float32, unnormalised scores (log-probs work
            too: the log-softmax is idempotent). NaN and +inf count as -inf.
        k: number of winners per row, ``1 <= k <= V``.
        scale: optional [R] float multipliers (> 0; not checked, that would sync): row
            ``r`` is ``logits[r].float() * scale[r]`` before everything else, e.g.
            ``1 / temperature``. Cast to float32.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see the module docstring).

    Returns:
        (logprobs, indices): logprobs [R, k] float32, ``x - logsumexp(row)`` of the
        winners (x the scaled logit), sorted descending; indices [R, k] int64 in
        ``[0, V)``, their vocabulary positions. A row with no finite value gives -inf
        values.

    Raises:
        ValueError: ``logits`` is not a 2-D float tensor, ``k`` is out of range,
            ``scale`` is not [R], or ``backend`` is unknown.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [R, V]; got {tuple(logits.shape)} {logits.dtype}")
    vocab = logits.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an integer in [1, V={vocab}]; got {k!r}")
    if scale is not None:
        if scale.shape != logits.shape[:1] or not scale.is_floating_point():
            raise ValueError(f"scale must be a float tensor [R={logits.shape[0]}]; got {tuple(scale.shape)}")
        scale = scale.float()
    if backend == "auto":
        backend = "triton" if (logits.is_cuda and HAS_TRITON) else "torch"
    if backend == "torch":
        return _vocab_topk_torch(logits, k, scale)
    if backend == "triton":
        return _vocab_topk_triton(logits, k, scale=scale)
    raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}; got {backend!r}")


# ---------------------------------------------------------------------------
# Torch twin
# ---------------------------------------------------------------------------


def _vocab_topk_torch(
    logits: torch.Tensor, k: int, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    if scale is not None:  # before the NaN/+inf filter, as in the kernel
        x = x * scale.unsqueeze(1)
    x = x.nan_to_num(nan=-math.inf, posinf=-math.inf, neginf=-math.inf)
    values, indices = x.topk(k, dim=-1)
    # An all -inf row has lse = -inf; clamping it to the most negative finite float keeps
    # its values at -inf (instead of -inf - -inf = NaN) and changes no other row.
    lse = x.logsumexp(-1, keepdim=True).clamp(min=-torch.finfo(torch.float32).max)
    return values - lse, indices


# ---------------------------------------------------------------------------
# Triton backend
# ---------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _chunk_topk_kernel(
        logits_ptr,
        scale_ptr,  # [R] float32 (unused unless HAS_SCALE)
        stride_row,
        vocab,
        chunk_len,
        cand_val_ptr,  # [R, C, K] float32
        cand_idx_ptr,  # [R, C, K] int32
        part_max_ptr,  # [R, C] float32
        part_sum_ptr,  # [R, C] float32
        K: tl.constexpr,
        KP: tl.constexpr,
        TILE: tl.constexpr,
        EMPTY_INDEX: tl.constexpr,
        TAKEN_INDEX: tl.constexpr,
        HAS_SCALE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        num_chunks = tl.num_programs(1)
        start = chunk * chunk_len
        end = tl.minimum(start + chunk_len, vocab)

        slots = tl.arange(0, KP)
        # Padding slots (>= K) hold +inf so they are never the worst candidate.
        cand_v = tl.where(slots < K, float("-inf"), float("inf")).to(tl.float32)
        cand_i = EMPTY_INDEX + slots
        worst_v = tl.min(cand_v, axis=0)
        worst_i = tl.max(tl.where(cand_v == worst_v, cand_i, -1), axis=0)
        run_max = tl.full((), float("-inf"), tl.float32)
        run_sum = tl.full((), 0.0, tl.float32)
        if HAS_SCALE:
            row_scale = tl.load(scale_ptr + row)

        row_ptr = logits_ptr + row * stride_row
        for tile_start in range(start, end, TILE):
            offs = tile_start + tl.arange(0, TILE)
            in_range = offs < end
            x = tl.load(row_ptr + offs, mask=in_range, other=float("-inf")).to(tl.float32)
            if HAS_SCALE:  # in registers, before the filter: an overflow to +inf counts as -inf
                x = x * row_scale
            x = tl.where((x == x) & (x != float("inf")), x, float("-inf"))
            idx = tl.where(in_range, offs, TAKEN_INDEX)

            # Online softmax; a -inf running max is replaced by 0 so that exp never sees
            # -inf - -inf.
            tile_max = tl.max(x, axis=0)
            new_max = tl.maximum(run_max, tile_max)
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe_max) + tl.sum(tl.exp(x - safe_max), axis=0)
            run_max = new_max

            # Candidates are kept under the order (value desc, index asc). Tiles come in
            # index order, so a tile can only matter if its max beats the K-th candidate's
            # value or the list still has an empty slot; usually neither holds and the tile
            # costs just its read. A tile inserts at most K elements (then the list is its
            # own top K), best first, one per round; once the tile's best no longer beats
            # the K-th candidate, a round costs one comparison. (A data-dependent `while`
            # instead of the bounded loop crashes Triton 3.6's layout pass.)
            if (tile_max > worst_v) | (worst_i >= EMPTY_INDEX):
                best_v = tile_max
                best_i = tl.min(tl.where(x == best_v, idx, TAKEN_INDEX), axis=0)
                for _ in range(K):
                    if (best_v > worst_v) | ((best_v == worst_v) & (best_i < worst_i)):
                        is_worst = (cand_v == worst_v) & (cand_i == worst_i)
                        cand_v = tl.where(is_worst, best_v, cand_v)
                        cand_i = tl.where(is_worst, best_i, cand_i)
                        taken = idx == best_i
                        x = tl.where(taken, float("-inf"), x)
                        idx = tl.where(taken, TAKEN_INDEX, idx)
                        worst_v = tl.min(cand_v, axis=0)
                        worst_i = tl.max(tl.where(cand_v == worst_v, cand_i, -1), axis=0)
                        best_v = tl.max(x, axis=0)
                        best_i = tl.min(tl.where(x == best_v, idx, TAKEN_INDEX), axis=0)

        out = (row * num_chunks + chunk) * K
        tl.store(cand_val_ptr + out + slots, cand_v, mask=slots < K)
        tl.store(cand_idx_ptr + out + slots, cand_i, mask=slots < K)
        tl.store(part_max_ptr + row * num_chunks + chunk, run_max)
        tl.store(part_sum_ptr + row * num_chunks + chunk, run_sum)

    # Row-dependent ints stay out of Triton's specialisation (one variant per chunk count).
    @triton.jit(do_not_specialize=["num_cand", "num_chunks"])
    def _merge_topk_kernel(
        cand_val_ptr,  # [R, C*K] float32
        cand_idx_ptr,  # [R, C*K] int32
        part_max_ptr,  # [R, C] float32
        part_sum_ptr,  # [R, C] float32
        out_val_ptr,  # [R, K] float32
        out_idx_ptr,  # [R, K] int64
        num_cand,
        num_chunks,
        K: tl.constexpr,
        CP: tl.constexpr,
        CHP: tl.constexpr,
        TAKEN_INDEX: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, CHP)
        m = tl.load(part_max_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
        s = tl.load(part_sum_ptr + row * num_chunks + c, mask=c < num_chunks, other=0.0)
        row_max = tl.max(m, axis=0)
        safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        lse = safe_max + tl.log(tl.sum(s * tl.exp(m - safe_max), axis=0))

        j = tl.arange(0, CP)
        v = tl.load(cand_val_ptr + row * num_cand + j, mask=j < num_cand, other=float("-inf"))
        i = tl.load(cand_idx_ptr + row * num_cand + j, mask=j < num_cand, other=TAKEN_INDEX)
        for r in tl.static_range(K):
            best_v = tl.max(v, axis=0)
            best_i = tl.min(tl.where(v == best_v, i, TAKEN_INDEX), axis=0)
            # A finite winner implies a finite lse (its own term is in the sum).
            lp = tl.where(best_v == float("-inf"), float("-inf"), best_v - lse)
            tl.store(out_val_ptr + row * K + r, lp)
            tl.store(out_idx_ptr + row * K + r, best_i.to(tl.int64))
            taken = i == best_i
            v = tl.where(taken, float("-inf"), v)
            i = tl.where(taken, TAKEN_INDEX, i)


def _num_programs_target(device: torch.device) -> int:
    """Programs to aim for in stage 1: a few per SM (a small number off-GPU)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def chunk_plan(rows: int, vocab: int, device: torch.device, tile: int = _TILE) -> tuple[int, int]:
    """(num_chunks, chunk_len) of stage 1 for ``rows`` rows: whole tiles per chunk, no empty chunk.

    The count is a power of two (at most cdiv(V, tile)) so that the merge kernel's constexprs
    (``CP``, ``CHP``) take a handful of values over every row count: :mod:`.warmup` compiles them
    all at engine start.
    """
    want = max(1, min(triton.cdiv(vocab, tile), triton.cdiv(_num_programs_target(device), max(rows, 1))))
    num_chunks = 1 << (want.bit_length() - 1)
    chunk_len = triton.cdiv(triton.cdiv(vocab, num_chunks), tile) * tile
    return triton.cdiv(vocab, chunk_len), chunk_len


def _vocab_topk_triton(
    logits: torch.Tensor,
    k: int,
    *,
    scale: torch.Tensor | None = None,
    num_chunks: int | None = None,
    tile: int = _TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-stage Triton top-k; scale: [R] float32 or None (see :func:`vocab_topk`);
    ``num_chunks``/``tile`` override the defaults (tests)."""
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' requested but triton is not importable")
    rows, vocab = logits.shape
    if vocab >= _EMPTY_INDEX:
        raise ValueError(f"vocabulary too large for the Triton top-k: {vocab}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if num_chunks is None:
        num_chunks, chunk_len = chunk_plan(rows, vocab, logits.device, tile)
    else:
        chunk_len = triton.cdiv(triton.cdiv(vocab, num_chunks), tile) * tile
        num_chunks = triton.cdiv(vocab, chunk_len)

    device = logits.device
    cand_val = torch.empty(rows, num_chunks, k, dtype=torch.float32, device=device)
    cand_idx = torch.empty(rows, num_chunks, k, dtype=torch.int32, device=device)
    part_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    part_sum = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    out_val = torch.empty(rows, k, dtype=torch.float32, device=device)
    out_idx = torch.empty(rows, k, dtype=torch.int64, device=device)
    if rows == 0:
        return out_val, out_idx
    if scale is not None:
        scale = scale.float().contiguous()
    _chunk_topk_kernel[(rows, num_chunks)](
        logits,
        logits if scale is None else scale,  # any pointer when unused
        logits.stride(0),
        vocab,
        chunk_len,
        cand_val,
        cand_idx,
        part_max,
        part_sum,
        K=k,
        # At least 16 slots: Triton 3.6 fails to lay out loop-carried 1-element vectors.
        KP=max(16, triton.next_power_of_2(k)),
        TILE=tile,
        EMPTY_INDEX=_EMPTY_INDEX,
        TAKEN_INDEX=_TAKEN_INDEX,
        HAS_SCALE=scale is not None,
        num_warps=_NUM_WARPS,
    )
    _merge_topk_kernel[(rows,)](
        cand_val,
        cand_idx,
        part_max,
        part_sum,
        out_val,
        out_idx,
        num_chunks * k,
        num_chunks,
        K=k,
        CP=triton.next_power_of_2(num_chunks * k),
        CHP=triton.next_power_of_2(num_chunks),
        TAKEN_INDEX=_TAKEN_INDEX,
    )
    return out_val, out_idx
