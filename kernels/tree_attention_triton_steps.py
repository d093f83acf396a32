"""Device functions shared by the two Triton tree-attention kernels (``tree_attention_triton_kernels``).

Query rows are a tile's ``BLOCK_M = BLOCK_Q * BLOCK_G`` (query token, query head) pairs, as
laid out in :mod:`vllm_eagle2.kernels.tree_attention_triton`; scores are in base 2
(``qk_scale = scale * log2(e)``).  Only defined when Triton is importable.
"""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _split_chunk(ctx, num_splits, BLOCK_N: tl.constexpr):
        """Context tokens per split of a request with ``ctx`` of them: a multiple of BLOCK_N, >= BLOCK_N.

        Both kernels compute it, so the region kernel knows which splits wrote a partial
        (the first ``cdiv(ctx, chunk)``) without reading anything back.
        """
        chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
        return tl.maximum(chunk, BLOCK_N)

    @triton.jit
    def _context_step(
        q,
        acc,
        m_i,
        l_i,
        k_base,
        v_base,
        bt_row,
        start,
        hi,
        qk_scale,
        stride_kb,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vt,
        stride_vd,
        stride_btb,
        max_blocks,
        BLOCK_SIZE: tl.constexpr,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        TAIL: tl.constexpr,  # positions >= hi in this tile: mask them (else all are < hi)
    ):
        """One BLOCK_N tile of context positions from ``start``: online-softmax update, all visible."""
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = start + tl.arange(0, BLOCK_N)
        bcol = offs_n // BLOCK_SIZE
        toff = offs_n % BLOCK_SIZE
        # bcol < max_blocks: bad lengths must not read past the block-table row.
        bt_ok = bcol < max_blocks
        kv_ok = (offs_d < D)[None, :]  # folds away when D == BLOCK_D
        if TAIL:
            n_ok = offs_n < hi
            bt_ok = bt_ok & n_ok
            kv_ok = kv_ok & n_ok[:, None]
        blk = tl.load(bt_row + bcol * stride_btb, mask=bt_ok, other=0).to(tl.int64)
        k = tl.load(
            k_base + blk[:, None] * stride_kb + toff[:, None] * stride_kt + offs_d[None, :] * stride_kd,
            mask=kv_ok,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        if TAIL:
            s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + blk[:, None] * stride_vb + toff[:, None] * stride_vt + offs_d[None, :] * stride_vd,
            mask=kv_ok,
            other=0.0,
        )
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _context_loop(
        q,  # [BLOCK_M, BLOCK_D] query rows (input dtype, or float32 with UPCAST)
        acc,  # [BLOCK_M, BLOCK_D] float32, unnormalised output so far
        m_i,  # [BLOCK_M] float32 running max (base 2, scaled)
        l_i,  # [BLOCK_M] float32 running sum
        k_base,  # key cache at this kv head
        v_base,
        bt_row,  # block-table row of the request
        lo,  # first context position (inclusive)
        hi,  # last context position (exclusive), > lo or nothing is done
        qk_scale,
        stride_kb,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vt,
        stride_vd,
        stride_btb,
        max_blocks,
        BLOCK_SIZE: tl.constexpr,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Online softmax of ``q`` over context positions ``[lo, hi)``: every one is visible.

        Whole tiles run without any position mask; only a last partial tile masks positions
        ``>= hi``.  Every tile has a visible position, so the running max is finite after the
        first one and needs no guard against ``-inf - -inf``.  Returns ``(acc, m_i, l_i)``.
        """
        full_hi = lo + (hi - lo) // BLOCK_N * BLOCK_N
        for start in range(lo, full_hi, BLOCK_N):
            acc, m_i, l_i = _context_step(
                q, acc, m_i, l_i, k_base, v_base, bt_row, start, hi, qk_scale,
                stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, stride_btb, max_blocks,
                BLOCK_SIZE, D, BLOCK_N, BLOCK_D, DOT_PRECISION, False,
            )  # fmt: skip
        if full_hi < hi:
            acc, m_i, l_i = _context_step(
                q, acc, m_i, l_i, k_base, v_base, bt_row, full_hi, hi, qk_scale,
                stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, stride_btb, max_blocks,
                BLOCK_SIZE, D, BLOCK_N, BLOCK_D, DOT_PRECISION, True,
            )  # fmt: skip
        return acc, m_i, l_i

    @triton.jit
    def _load_query_tile(
        q_ptr,
        tile_ptr,
        kvh,
        stride_qt,
        stride_qh,
        stride_qd,
        G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """The tile's query rows ``[BLOCK_M, BLOCK_D]`` (zeros in padding rows / columns).

        Returns ``(q, qrow, tok, head, row_ok)``: per row, its query index within the request,
        its token in ``query``, its query head, and whether it is a real (token, head) pair.
        """
        row0 = tl.load(tile_ptr + 1)
        q_start = tl.load(tile_ptr + 2)
        q_len = tl.load(tile_ptr + 3)
        BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
        offs_m = tl.arange(0, BLOCK_M)
        qrow = row0 + offs_m // BLOCK_G
        grp = offs_m % BLOCK_G
        row_ok = (qrow < q_len) & (grp < G)
        tok = (q_start + qrow).to(tl.int64)
        head = kvh * G + grp
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & (offs_d < D)[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        return q, qrow, tok, head, row_ok
