"""Triton kernels of kernel_lab.attention: FlashAttention-2 forward/backward and RoPE.

Notation: a program owns BLOCK_M query rows (forward, dq) or BLOCK_N key rows (dk/dv) of one
(sequence, head). Scores are kept in log2 units (scale * log2(e) folded into one multiply) so
the softmax uses exp2; the logsumexp handed to the caller and the backward is in natural-log
units. Query row i sees key j iff  i + diag - left <= j <= i + diag + right, diag = Tk - Tq
(bottom-right alignment); the launcher passes "unbounded" as a large number and causal as
right = 0. Each kernel splits its loop into blocks that need that mask (window edges, the
diagonal, the key tail) and blocks that do not, so most blocks run without any masking.
"""

import triton
import triton.language as tl


@triton.jit
def _seq_bounds(pid_b, CU_SEQLENS, seqlen, IS_VARLEN: tl.constexpr):
    """(start, length) of sequence pid_b: packed (cu_seqlens) or fixed-length."""
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + pid_b)
        end = tl.load(CU_SEQLENS + pid_b + 1)
        return start, end - start
    else:
        # A tensor zero (not the literal 0) so callers can widen it with .to(tl.int64).
        return pid_b * 0, seqlen


@triton.jit
def _key_ranges(m0, seqlen_q, seqlen_k, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks seen by query rows [m0, m0 + BLOCK_M): [lo, hi) holds every key any row may see;
    [full_lo, full_hi) (BLOCK_N-aligned) holds the keys every row sees, which need no mask."""
    diag = seqlen_k - seqlen_q
    lo = tl.maximum(m0 + diag - left, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(m0 + BLOCK_M + diag + right, seqlen_k)
    hi = tl.maximum(hi, lo)
    full_lo = tl.maximum(m0 + BLOCK_M - 1 + diag - left, 0)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.maximum(tl.minimum(m0 + diag + right + 1, seqlen_k), 0)
    full_hi = tl.maximum((full_hi // BLOCK_N) * BLOCK_N, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_ranges(n0, seqlen_q, seqlen_k, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks that see key rows [n0, n0 + BLOCK_N), split like `_key_ranges`."""
    diag = seqlen_k - seqlen_q
    lo = tl.maximum(n0 - diag - right, 0)
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = tl.minimum(n0 + BLOCK_N - diag + left, seqlen_q)
    hi = tl.maximum(hi, lo)
    full_lo = tl.maximum(n0 + BLOCK_N - 1 - diag - right, 0)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_M) * BLOCK_M, lo), hi)
    full_hi = tl.maximum(tl.minimum(n0 - diag + left + 1, seqlen_q), 0)
    full_hi = tl.maximum((full_hi // BLOCK_M) * BLOCK_M, full_lo)
    if n0 + BLOCK_N > seqlen_k:
        # A key tail block needs its mask in every query block.
        full_hi = full_lo
    return lo, full_lo, full_hi, hi


@triton.jit
def _allowed(offs_m, offs_n, seqlen_q, seqlen_k, left, right):
    """(M, N) mask of the (query, key) pairs that attend, inside both sequences."""
    rel = offs_n[None, :] - (offs_m[:, None] + (seqlen_k - seqlen_q))
    return (rel <= right) & (rel >= -left) & (offs_n[None, :] < seqlen_k) & (offs_m[:, None] < seqlen_q)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _token_offsets(offs, OFFSETS_64: tl.constexpr):
    """Row offsets about to be multiplied by a token stride: int64 when the launcher found that
    rows x token stride can pass 2**31 (e.g. a (B, T, H, D) layout with T x H x D >= 2**31, a
    1M-token Llama-3-8B prefill), else as they are (int32 math, the usual shapes' code)."""
    if OFFSETS_64:
        offs = offs.to(tl.int64)
    return offs


@triton.jit
def _tma_rows(desc, b, h, t0, BSHD: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(ROWS, BLOCK_D) block of rows [t0, t0 + ROWS) of head h of sequence b, through a 4-D
    tensor descriptor over (B, H, T, D), or (B, T, H, D) when BSHD; zeros past T and D."""
    if BSHD:
        block = desc.load([b, t0, h, 0])
    else:
        block = desc.load([b, h, t0, 0])
    return block.reshape(ROWS, BLOCK_D)


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, pid_b, kv_h, offs_m, offs_d,
    n_lo, n_hi, seqlen_q, seqlen_k, left, right, qk_scale,
    MASK: tl.constexpr, USE_TMA: tl.constexpr, BSHD: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, OFFSETS_64: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) over key blocks [n_lo, n_hi). k_src / v_src:
    tensor descriptors (USE_TMA, addressed by pid_b and kv_h) or this head's base pointers."""
    arange_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + arange_n
        if USE_TMA:
            kt = _tma_rows(k_src, pid_b, kv_h, n0, BSHD, BLOCK_N, BLOCK_D).T
            v = _tma_rows(v_src, pid_b, kv_h, n0, BSHD, BLOCK_N, BLOCK_D)
        else:
            # K is read transposed, (D, N), so QK^T is a plain (M, D) @ (D, N) dot.
            tok_n = _token_offsets(offs_n, OFFSETS_64)
            kt_ptrs = k_src + tok_n[None, :] * stride_kt + offs_d[:, None]
            v_ptrs = v_src + tok_n[:, None] * stride_vt + offs_d[None, :]
            if MASK:
                kt = tl.load(kt_ptrs, mask=d_ok[:, None] & (offs_n[None, :] < seqlen_k), other=0.0)
                v = tl.load(v_ptrs, mask=(offs_n[:, None] < seqlen_k) & d_ok[None, :], other=0.0)
            elif HEAD_DIM == BLOCK_D:
                kt = tl.load(kt_ptrs)
                v = tl.load(v_ptrs)
            else:
                kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
        if MASK:
            s = tl.where(_allowed(offs_m, offs_n, seqlen_q, seqlen_k, left, right), qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key yet keeps m = -inf: shift by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_shift[:, None])
        else:
            # The scores stay unscaled until the exponent: max(qk) * scale is max(qk * scale)
            # (the launcher makes the scale non-negative), and qk * scale - m is one FMA per score.
            # Against scaling first: 926 -> 695 us at B4 H32 T4096 D64 causal on an H200.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_shift = m_new
            p = tl.math.exp2(qk * qk_scale - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Lengths and window bounds are not specialised on divisibility by 16 (they do not align any
# address): a new sequence length must not trigger a recompile.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "rows_q", "left", "right"])
def _attn_fwd_kernel(
    Q, K, V,  # pointers, or with USE_TMA 4-D tensor descriptors (see _tma_rows)
    Out, LSE, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    stride_lb, stride_lh,  # LSE is (B, H, Tq) or, varlen, (H, total_q): the row stride is 1
    n_heads, group,  # query heads, query heads per kv head
    seqlen_q, seqlen_k,  # fixed-length sequences only (varlen reads cu_seqlens)
    rows_q,  # query rows per (sequence, head) in the grid: seqlen_q, or max_seqlen_q (varlen)
    left, right,  # window bounds, already capped/unbounded by the launcher
    qk_scale,  # softmax scale * log2(e), >= 0
    IS_VARLEN: tl.constexpr,
    USE_TMA: tl.constexpr,  # Hopper: q, k, v through TMA (fixed-length only)
    BSHD: tl.constexpr,  # the descriptors' dim order (USE_TMA)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OFFSETS_64: tl.constexpr,  # token offsets in int64 (see _token_offsets)
):
    # One flat grid axis (2**31 programs, where axis 1 stops at 65535), query blocks fastest:
    # programs running together share one head's K/V in L2. Last query blocks first: under a
    # causal mask they are the longest, and starting them early shortens the tail.
    n_m = tl.cdiv(rows_q, BLOCK_M)
    pid_bh = tl.program_id(0) // n_m
    pid_m = n_m - 1 - tl.program_id(0) % n_m
    # torch.compile may pass Python floats as fp64 scalars: keep the softmax math in fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid_b = pid_bh // n_heads
    pid_h = pid_bh % n_heads
    q_start, seqlen_q = _seq_bounds(pid_b, CU_SEQLENS_Q, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = _seq_bounds(pid_b, CU_SEQLENS_K, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return  # varlen: this sequence is shorter than the longest one
    kv_h = pid_h // group
    # 64-bit bases: B * H * T * D can exceed 2**31 elements.
    o_base = Out + pid_b.to(tl.int64) * stride_ob + pid_h.to(tl.int64) * stride_oh + q_start.to(tl.int64) * stride_ot
    lse_base = LSE + pid_b.to(tl.int64) * stride_lb + pid_h.to(tl.int64) * stride_lh + q_start.to(tl.int64)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    tok_m = _token_offsets(offs_m, OFFSETS_64)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if USE_TMA:
        q = _tma_rows(Q, pid_b, pid_h, m0, BSHD, BLOCK_M, BLOCK_D)
        k_src = K
        v_src = V
    else:
        q_base = Q + pid_b.to(tl.int64) * stride_qb + pid_h.to(tl.int64) * stride_qh + q_start.to(tl.int64) * stride_qt
        q = tl.load(q_base + tok_m[:, None] * stride_qt + offs_d[None, :], mask=io_mask, other=0.0)
        k_src = K + pid_b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kt
        v_src = V + pid_b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vt

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_ranges(m0, seqlen_q, seqlen_k, left, right, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, pid_b, kv_h, offs_m, offs_d,
                               lo, full_lo, seqlen_q, seqlen_k, left, right, qk_scale,
                               True, USE_TMA, BSHD, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, OFFSETS_64)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, pid_b, kv_h, offs_m, offs_d,
                               full_lo, full_hi, seqlen_q, seqlen_k, left, right, qk_scale,
                               False, USE_TMA, BSHD, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, OFFSETS_64)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, pid_b, kv_h, offs_m, offs_d,
                               full_hi, hi, seqlen_q, seqlen_k, left, right, qk_scale,
                               True, USE_TMA, BSHD, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, OFFSETS_64)

    # A row that saw no key has l = 0: its output is 0 and its logsumexp -inf.
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(o_base + tok_m[:, None] * stride_ot + offs_d[None, :], out.to(Out.dtype.element_ty), mask=io_mask)
    tl.store(lse_base + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# Backward: delta = rowsum(dO * O), then dK/dV per key block and dQ per query block (no atomics)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
    offs_n, offs_d, m_lo, m_hi, seqlen_q, seqlen_k, left, right, qk_scale,
    MASK: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, OFFSETS_64: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks [m_lo, m_hi), all transposed:
    S^T = K Q^T (N, M), so P^T is used as is in dV += P^T dO and dK += dS^T Q."""
    arange_m = tl.arange(0, BLOCK_M)
    d_ok = offs_d < HEAD_DIM
    for m0 in range(m_lo, m_hi, BLOCK_M):
        offs_m = m0 + arange_m
        tok_m = _token_offsets(offs_m, OFFSETS_64)
        qt_ptrs = q_base + tok_m[None, :] * stride_qt + offs_d[:, None]
        do_ptrs = do_base + tok_m[:, None] * stride_dot + offs_d[None, :]
        if MASK:
            row_ok = offs_m < seqlen_q
            qt = tl.load(qt_ptrs, mask=d_ok[:, None] & row_ok[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            if HEAD_DIM == BLOCK_D:
                qt = tl.load(qt_ptrs)
                do = tl.load(do_ptrs)
            else:
                qt = tl.load(qt_ptrs, mask=d_ok[:, None], other=0.0)
                do = tl.load(do_ptrs, mask=d_ok[None, :], other=0.0)
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        # lse = -inf marks a row without keys; +inf makes its P exactly 0.
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        st = tl.dot(k, qt, input_precision=DOT_PRECISION) * qk_scale
        pt = tl.math.exp2(st - lse2[None, :])
        if MASK:
            allowed_t = tl.trans(_allowed(offs_m, offs_n, seqlen_q, seqlen_k, left, right))
            pt = tl.where(allowed_t, pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "rows_k", "left", "right"])
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dkb, stride_dkh, stride_dkt,
    stride_dvb, stride_dvh, stride_dvt,
    stride_lb, stride_lh,
    n_kv_heads, group,
    seqlen_q, seqlen_k, rows_k, left, right,
    sm_scale, qk_scale,
    IS_VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OFFSETS_64: tl.constexpr,  # token offsets in int64 (see _token_offsets)
):
    # Flat grid, key blocks fastest (see the forward). Under a causal mask the first key
    # blocks are read by the most queries, and they already come first.
    n_n = tl.cdiv(rows_k, BLOCK_N)
    pid_bh = tl.program_id(0) // n_n
    pid_n = tl.program_id(0) % n_n
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 under torch.compile otherwise (see the forward)
    sm_scale = tl.cast(sm_scale, tl.float32)
    pid_b = pid_bh // n_kv_heads
    kv_h = pid_bh % n_kv_heads
    q_start, seqlen_q = _seq_bounds(pid_b, CU_SEQLENS_Q, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = _seq_bounds(pid_b, CU_SEQLENS_K, seqlen_k, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    rows_k = (k_start + offs_n).to(tl.int64)
    k = tl.load(K + pid_b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh + rows_k[:, None] * stride_kt
                + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + pid_b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh + rows_k[:, None] * stride_vt
                + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _query_ranges(n0, seqlen_q, seqlen_k, left, right, BLOCK_M, BLOCK_N)
    # GQA: the query heads that share this kv head all add into one dK/dV, in registers.
    for g in range(0, group):
        h = (kv_h * group + g).to(tl.int64)
        q_base = Q + pid_b.to(tl.int64) * stride_qb + h * stride_qh + q_start.to(tl.int64) * stride_qt
        do_base = DO + pid_b.to(tl.int64) * stride_dob + h * stride_doh + q_start.to(tl.int64) * stride_dot
        lse_base = LSE + pid_b.to(tl.int64) * stride_lb + h * stride_lh + q_start.to(tl.int64)
        delta_base = DELTA + pid_b.to(tl.int64) * stride_lb + h * stride_lh + q_start.to(tl.int64)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                 offs_n, offs_d, lo, full_lo, seqlen_q, seqlen_k, left, right, qk_scale,
                                 True, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, OFFSETS_64)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                 offs_n, offs_d, full_lo, full_hi, seqlen_q, seqlen_k, left, right, qk_scale,
                                 False, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, OFFSETS_64)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                 offs_n, offs_d, full_hi, hi, seqlen_q, seqlen_k, left, right, qk_scale,
                                 True, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, OFFSETS_64)
    dk = dk * sm_scale
    tl.store(DK + pid_b.to(tl.int64) * stride_dkb + kv_h.to(tl.int64) * stride_dkh + rows_k[:, None] * stride_dkt
             + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + pid_b.to(tl.int64) * stride_dvb + kv_h.to(tl.int64) * stride_dvh + rows_k[:, None] * stride_dvt
             + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
    n_lo, n_hi, seqlen_q, seqlen_k, left, right, qk_scale,
    MASK: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, OFFSETS_64: tl.constexpr,
):
    """Accumulate dQ of one query block over key blocks [n_lo, n_hi): dQ += dS K."""
    arange_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + arange_n
        tok_n = _token_offsets(offs_n, OFFSETS_64)
        kt_ptrs = k_base + tok_n[None, :] * stride_kt + offs_d[:, None]
        vt_ptrs = v_base + tok_n[None, :] * stride_vt + offs_d[:, None]
        if MASK:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None] & (offs_n[None, :] < seqlen_k), other=0.0)
            vt = tl.load(vt_ptrs, mask=d_ok[:, None] & (offs_n[None, :] < seqlen_k), other=0.0)
        elif HEAD_DIM == BLOCK_D:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
            vt = tl.load(vt_ptrs, mask=d_ok[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASK:
            p = tl.where(_allowed(offs_m, offs_n, seqlen_q, seqlen_k, left, right), p, 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "rows_q", "left", "right"])
def _attn_bwd_dq_kernel(
    Q, K, V, DO, Out, LSE, DLSE, DELTA, DQ, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_ob, stride_oh, stride_ot,
    stride_dqb, stride_dqh, stride_dqt,
    stride_lb, stride_lh,
    n_heads, group,
    seqlen_q, seqlen_k, rows_q, left, right,
    sm_scale, qk_scale,
    IS_VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OFFSETS_64: tl.constexpr,  # token offsets in int64 (see _token_offsets)
):
    """dQ of BLOCK_M query rows, and their delta = rowsum(dO * O) (minus dlse, the logsumexp's
    gradient, when the caller used it): the softmax-Jacobian term that this kernel uses and
    stores for the dK/dV kernel, which runs after it (one launch fewer than a separate pass)."""
    n_m = tl.cdiv(rows_q, BLOCK_M)
    pid_bh = tl.program_id(0) // n_m
    pid_m = n_m - 1 - tl.program_id(0) % n_m  # longest (causal) query blocks first
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp64 under torch.compile otherwise (see the forward)
    sm_scale = tl.cast(sm_scale, tl.float32)
    pid_b = pid_bh // n_heads
    pid_h = pid_bh % n_heads
    q_start, seqlen_q = _seq_bounds(pid_b, CU_SEQLENS_Q, seqlen_q, IS_VARLEN)
    k_start, seqlen_k = _seq_bounds(pid_b, CU_SEQLENS_K, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    kv_h = pid_h // group
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = (q_start + offs_m).to(tl.int64)
    bh_q = pid_b.to(tl.int64) * stride_qb + pid_h.to(tl.int64) * stride_qh
    q = tl.load(Q + bh_q + rows[:, None] * stride_qt + offs_d[None, :], mask=io_mask, other=0.0)
    do = tl.load(DO + pid_b.to(tl.int64) * stride_dob + pid_h.to(tl.int64) * stride_doh + rows[:, None] * stride_dot
                 + offs_d[None, :], mask=io_mask, other=0.0)
    l_off = pid_b.to(tl.int64) * stride_lb + pid_h.to(tl.int64) * stride_lh + rows
    lse = tl.load(LSE + l_off, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    o = tl.load(Out + pid_b.to(tl.int64) * stride_ob + pid_h.to(tl.int64) * stride_oh + rows[:, None] * stride_ot
                + offs_d[None, :], mask=io_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        # d lse / d s = P, so a logsumexp gradient enters dS = P * (dP - delta) as -dlse.
        delta -= tl.load(DLSE + l_off, mask=row_ok, other=0.0)
    tl.store(DELTA + l_off, delta, mask=row_ok)
    k_base = K + pid_b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_kt
    v_base = V + pid_b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vt
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_ranges(m0, seqlen_q, seqlen_k, left, right, BLOCK_M, BLOCK_N)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
                       lo, full_lo, seqlen_q, seqlen_k, left, right, qk_scale,
                       True, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, OFFSETS_64)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
                       full_lo, full_hi, seqlen_q, seqlen_k, left, right, qk_scale,
                       False, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, OFFSETS_64)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
                       full_hi, hi, seqlen_q, seqlen_k, left, right, qk_scale,
                       True, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, OFFSETS_64)
    dq = dq * sm_scale
    tl.store(DQ + pid_b.to(tl.int64) * stride_dqb + pid_h.to(tl.int64) * stride_dqh + rows[:, None] * stride_dqt
             + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=io_mask)


# ----------------------------------------------------------------------------------------------
# Rotary embedding: one program per (BLOCK_T positions, batch, HEADS_PER_PROGRAM heads of q and k)
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["seqlen"])
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, POS,
    seqlen, n_q_heads, n_k_heads,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_qob, stride_qot, stride_qoh,
    stride_kob, stride_kot, stride_koh,
    stride_cb, stride_ct,  # cos/sin: (B or 1, T, R) by position, or the (max_pos, R) table
    stride_pb, stride_pt,  # position_ids (B, T)
    HAS_POSITION_IDS: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    COPY_TAIL: tl.constexpr,  # write dims R..D too (not in place and R < D)
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
):
    """Each rotated pair (x1, x2) is (x[j], x[j + R/2]) (rotate_half) or (x[2j], x[2j + 1])
    (interleaved); both halves are loaded once, as two tiles, so nothing is read twice:
        forward  y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2
        backward the transposed rotation: dx1 = dy1 c1 + dy2 s2,  dx2 = dy2 c2 - dy1 s1.
    The four cos/sin tiles of the program's positions are loaded once and used for all its
    heads: per head they are twice the bytes of x itself, and reloading them for every head
    made the L2 carry three times the DRAM read traffic."""
    n_t = tl.cdiv(seqlen, BLOCK_T)
    b = (tl.program_id(0) // n_t).to(tl.int64)
    pid_t = tl.program_id(0) % n_t
    n_heads = n_q_heads + n_k_heads
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < seqlen
    offs_j = tl.arange(0, BLOCK_HALF)
    if INTERLEAVED:
        idx1 = 2 * offs_j
        idx2 = 2 * offs_j + 1
    else:
        idx1 = offs_j
        idx2 = offs_j + ROTARY_DIM // 2
    mask = t_ok[:, None] & (offs_j[None, :] < ROTARY_DIM // 2)
    if HAS_POSITION_IDS:
        pos = tl.load(POS + b * stride_pb + offs_t * stride_pt, mask=t_ok, other=0).to(tl.int64)
        cs_row = pos * stride_ct
    else:
        cs_row = b * stride_cb + offs_t.to(tl.int64) * stride_ct
    c1 = tl.load(COS + cs_row[:, None] + idx1[None, :], mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs_row[:, None] + idx2[None, :], mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs_row[:, None] + idx1[None, :], mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs_row[:, None] + idx2[None, :], mask=mask, other=0.0).to(tl.float32)
    if COPY_TAIL:
        offs_p = ROTARY_DIM + tl.arange(0, BLOCK_TAIL)
        tail_mask = t_ok[:, None] & (offs_p[None, :] < HEAD_DIM)
    # One launch for both tensors: heads [0, n_q_heads) are q's, the rest k's.
    for i in range(HEADS_PER_PROGRAM):
        h = tl.program_id(1) * HEADS_PER_PROGRAM + i
        if h < n_heads:  # (the last program's share of heads may be short)
            if h < n_q_heads:
                x_base = Q + b * stride_qb + h.to(tl.int64) * stride_qh
                o_base = QO + b * stride_qob + h.to(tl.int64) * stride_qoh
                stride_xt = stride_qt
                stride_ot = stride_qot
            else:
                x_base = K + b * stride_kb + (h - n_q_heads).to(tl.int64) * stride_kh
                o_base = KO + b * stride_kob + (h - n_q_heads).to(tl.int64) * stride_koh
                stride_xt = stride_kt
                stride_ot = stride_kot
            x_rows = x_base + offs_t.to(tl.int64)[:, None] * stride_xt
            o_rows = o_base + offs_t.to(tl.int64)[:, None] * stride_ot
            x1 = tl.load(x_rows + idx1[None, :], mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_rows + idx2[None, :], mask=mask, other=0.0).to(tl.float32)
            if BACKWARD:
                y1 = x1 * c1 + x2 * s2
                y2 = x2 * c2 - x1 * s1
            else:
                y1 = x1 * c1 - x2 * s1
                y2 = x2 * c2 + x1 * s2
            tl.store(o_rows + idx1[None, :], y1.to(o_base.dtype.element_ty), mask=mask)
            tl.store(o_rows + idx2[None, :], y2.to(o_base.dtype.element_ty), mask=mask)
            if COPY_TAIL:
                tail = tl.load(x_rows + offs_p[None, :], mask=tail_mask, other=0.0)
                tl.store(o_rows + offs_p[None, :], tail, mask=tail_mask)
