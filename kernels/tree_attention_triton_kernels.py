"""The two Triton kernels of tree attention: context splits, then region + merge.

What they compute and how the work is cut (tiles, splits, the tile table ``tiles_ptr``) is in
:mod:`vllm_eagle2.kernels.tree_attention_triton`, which plans and launches them; their shared
device functions are in :mod:`vllm_eagle2.kernels.tree_attention_triton_steps`.  Only defined
when Triton is importable.
"""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from .tree_attention_triton_steps import _context_loop, _load_query_tile, _split_chunk

    # Ints that follow the batch (split count, block-table and mask widths) stay out of Triton's
    # specialisation: the constexprs alone pick the variant (see .warmup).
    @triton.jit(do_not_specialize=["num_splits", "stride_btr", "max_blocks"])
    def _ctx_split_kernel(
        q_ptr,  # [Q, H, D] strided
        k_ptr,  # [num_blocks, Hkv, block_size, D] strided
        v_ptr,  # [num_blocks, Hkv, block_size, D] strided
        bt_ptr,  # [R, max_blocks] int32/int64 strided
        tiles_ptr,  # [n_tiles, 6] int32: req (-1: no tile), row0, q_start, q_len, C, T
        acc_ptr,  # [n_tiles, Hkv, num_splits, BLOCK_M, BLOCK_D] float32 scratch (output)
        ml_ptr,  # [n_tiles, Hkv, num_splits, 2, BLOCK_M] float32 scratch (output): m, l
        qk_scale,  # scale * log2(e)
        num_splits,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_vd,
        stride_btr,
        stride_btb,
        max_blocks,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        D: tl.constexpr,  # head size
        G: tl.constexpr,  # query heads per kv head
        BLOCK_Q: tl.constexpr,  # query tokens per tile
        BLOCK_G: tl.constexpr,  # next_power_of_2(G)
        BLOCK_N: tl.constexpr,  # kv positions per inner iteration
        BLOCK_D: tl.constexpr,  # next_power_of_2(D), >= 16
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs
        UPCAST: tl.constexpr,  # dots in float32 (the interpreter's bf16 tl.dot is wrong)
    ):
        """Partial attention of one tile x kv head over one chunk of its request's context."""
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        tile_ptr = tiles_ptr + tile * 6
        req = tl.load(tile_ptr)
        if req < 0:
            return
        ctx = tl.load(tile_ptr + 4)
        chunk = _split_chunk(ctx, num_splits, BLOCK_N)
        lo = split * chunk
        if lo >= ctx:  # an empty chunk: the region kernel will not read this split
            return
        hi = tl.minimum(lo + chunk, ctx)

        q, qrow, tok, head, row_ok = _load_query_tile(
            q_ptr, tile_ptr, kvh, stride_qt, stride_qh, stride_qd, G, D, BLOCK_Q, BLOCK_G, BLOCK_D, UPCAST
        )
        BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        acc, m_i, l_i = _context_loop(
            q,
            acc,
            m_i,
            l_i,
            k_ptr + kvh.to(tl.int64) * stride_kh,
            v_ptr + kvh.to(tl.int64) * stride_vh,
            bt_ptr + req.to(tl.int64) * stride_btr,
            lo,
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
            BLOCK_SIZE,
            D,
            BLOCK_N,
            BLOCK_D,
            DOT_PRECISION,
        )
        # Scratch is padded to BLOCK_M x BLOCK_D, so the stores need no masks.
        part = (tile * tl.num_programs(1) + kvh).to(tl.int64) * num_splits + split
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(acc_ptr + part * (BLOCK_M * BLOCK_D) + offs_m[:, None] * BLOCK_D + offs_d[None, :], acc)
        tl.store(ml_ptr + part * (2 * BLOCK_M) + offs_m, m_i)
        tl.store(ml_ptr + part * (2 * BLOCK_M) + BLOCK_M + offs_m, l_i)

    @triton.jit(
        do_not_specialize=["num_splits", "stride_btr", "stride_mr", "stride_mq", "max_blocks", "max_q", "W"]
    )
    def _region_merge_kernel(
        q_ptr,  # [Q, H, D] strided
        k_ptr,  # [num_blocks, Hkv, block_size, D] strided
        v_ptr,  # [num_blocks, Hkv, block_size, D] strided
        o_ptr,  # [Q, H, D] strided (output)
        bt_ptr,  # [R, max_blocks] int32/int64 strided
        mask_ptr,  # [R, max_q, W] int32 strided
        tiles_ptr,  # [n_tiles, 6] int32: req (-1: no tile), row0, q_start, q_len, C, T
        acc_ptr,  # [n_tiles, Hkv, num_splits, BLOCK_M, BLOCK_D] float32 (unused if CONTEXT_INLINE)
        ml_ptr,  # [n_tiles, Hkv, num_splits, 2, BLOCK_M] float32 (unused if CONTEXT_INLINE)
        qk_scale,  # scale * log2(e)
        num_splits,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_vd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_btr,
        stride_btb,
        stride_mr,
        stride_mq,
        stride_mw,
        max_blocks,
        max_q,
        W,
        BLOCK_SIZE: tl.constexpr,
        D: tl.constexpr,
        G: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        CONTEXT_INLINE: tl.constexpr,  # walk the context here (no split kernel ran)
    ):
        """Masked region attention of one tile x kv head, merged with the context partials; writes out."""
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        tile_ptr = tiles_ptr + tile * 6
        req = tl.load(tile_ptr)
        if req < 0:
            return
        ctx = tl.load(tile_ptr + 4)
        reg = tl.load(tile_ptr + 5)
        q, qrow, tok, head, row_ok = _load_query_tile(
            q_ptr, tile_ptr, kvh, stride_qt, stride_qh, stride_qd, G, D, BLOCK_Q, BLOCK_G, BLOCK_D, UPCAST
        )
        BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        k_base = k_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + kvh.to(tl.int64) * stride_vh
        bt_row = bt_ptr + req.to(tl.int64) * stride_btr

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if CONTEXT_INLINE:
            acc, m_i, l_i = _context_loop(
                q,
                acc,
                m_i,
                l_i,
                k_base,
                v_base,
                bt_row,
                0,
                ctx,
                qk_scale,
                stride_kb,
                stride_kt,
                stride_kd,
                stride_vb,
                stride_vt,
                stride_vd,
                stride_btb,
                max_blocks,
                BLOCK_SIZE,
                D,
                BLOCK_N,
                BLOCK_D,
                DOT_PRECISION,
            )

        # Region: region token j (storage position C + j) is visible iff its mask bit is set.
        mask_row_ok = row_ok & (qrow < max_q)  # rows past max_q must not read the mask
        mask_rows = mask_ptr + req.to(tl.int64) * stride_mr + qrow.to(tl.int64) * stride_mq
        for start in range(0, reg, BLOCK_N):
            rel = start + tl.arange(0, BLOCK_N)
            r_ok = rel < reg
            pos = ctx + rel
            bcol = pos // BLOCK_SIZE
            blk = tl.load(bt_row + bcol * stride_btb, mask=r_ok & (bcol < max_blocks), other=0)
            blk = blk.to(tl.int64)
            toff = pos % BLOCK_SIZE
            kv_ok = r_ok[:, None] & d_ok[None, :]
            k = tl.load(
                k_base + blk[:, None] * stride_kb + toff[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                mask=kv_ok,
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
            widx = rel // 32
            words = tl.load(
                mask_rows[:, None] + widx[None, :] * stride_mw,
                mask=mask_row_ok[:, None] & (r_ok & (widx < W))[None, :],
                other=0,
            )
            bits = (words >> (rel % 32)[None, :]) & 1
            s = tl.where(bits != 0, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row may have seen nothing yet (C = 0, bits unset): keep exp2 off -inf - -inf.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + blk[:, None] * stride_vb + toff[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                mask=kv_ok,
                other=0.0,
            )
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
            m_i = m_new

        if not CONTEXT_INLINE:
            # Log-sum-exp merge with the partials of the non-empty context chunks.  Each has a
            # finite max on every row (its chunk is all visible), so m_new is finite here.
            n_used = tl.cdiv(ctx, _split_chunk(ctx, num_splits, BLOCK_N))
            part0 = (tile * tl.num_programs(1) + kvh).to(tl.int64) * num_splits
            for sp in range(0, n_used):
                ml = ml_ptr + (part0 + sp) * (2 * BLOCK_M)
                m_s = tl.load(ml + offs_m)
                l_s = tl.load(ml + BLOCK_M + offs_m)
                a_s = tl.load(
                    acc_ptr + (part0 + sp) * (BLOCK_M * BLOCK_D) + offs_m[:, None] * BLOCK_D + offs_d[None, :]
                )
                m_new = tl.maximum(m_i, m_s)
                alpha = tl.exp2(m_i - m_new)
                beta = tl.exp2(m_s - m_new)
                acc = acc * alpha[:, None] + a_s * beta[:, None]
                l_i = l_i * alpha + l_s * beta
                m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # rows that saw nothing: acc is 0, so out is 0
        acc = acc / l_safe[:, None]
        tl.store(
            o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            acc.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
