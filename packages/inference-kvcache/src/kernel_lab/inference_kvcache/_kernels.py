"""Triton kernels of kernel_lab.inference_kvcache: cache append, split-K decode, split merge.

One addressing scheme serves both caches. A paged pool is (num_blocks, PAGE_SIZE, H, D) and
token t of a sequence lives in block block_table[row, t // PAGE_SIZE] at slot t % PAGE_SIZE.
A contiguous cache (B, T_max, H, D) is the same thing with one block per sequence: block
`row`, slot t. The PAGED flag picks the block lookup, so the if is compiled out.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from kernel_lab.shared import runtime
from kernel_lab.shared.reference.kvcache import FP8_E4M3_MAX

# Largest finite float8 e4m3fn value (the shared reference's constant): the append saturates
# to it instead of producing NaN. A kernel may only read globals that are tl.constexpr, hence
# the second name.
_FP8_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)
_INTERPRET = tl.constexpr(runtime.interpret_mode())


@triton.jit
def _round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest float8 e4m3 value, ties to even, as float32.

    The cast to float8 would do this on the GPU, but the Triton interpreter's cast loses the
    carry into the exponent (127.4 -> 64) and rounds ties away from zero; after this rounding
    the cast is exact everywhere, so CPU tests and GPU runs store the same bytes as torch.
    """
    # Spacing of e4m3 values around x: 2^(exponent - 3) for 3 mantissa bits, and the
    # subnormal spacing 2^-9 below the smallest normal 2^-6.
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    # Adding and removing 1.5 * 2^23 rounds |x / ulp| < 2^22 to an integer, ties to even.
    magic = 12582912.0
    r = ((x / ulp + magic) - magic) * ulp
    # The trick returns +0 for small negatives; keep x's sign as the cast would (x * 0).
    return tl.where(r == 0.0, x * 0.0, r)


@triton.jit
def _kv_append_kernel(
    k_new_ptr, v_new_ptr,  # (B, T_new, H, D) new keys / values, any strides
    stride_nb, stride_nt, stride_nh, stride_nd,  # strides of k_new
    stride_vb, stride_vt, stride_vh, stride_vd,  # strides of v_new
    k_cache_ptr, v_cache_ptr,  # pools (num_blocks, PAGE_SIZE, H, D); k and v share strides
    stride_cblk, stride_ct, stride_ch, stride_cd,
    lengths_ptr,  # (rows,) int32 tokens already cached per row, read before this append
    seq_ids_ptr,  # (B,) int32 cache row of each batch entry (HAS_SEQ_IDS)
    counts_ptr,  # (B,) int32 new tokens of each batch entry (HAS_COUNTS), else all T_new
    block_table_ptr, stride_bt,  # (rows, max_blocks) int32 (PAGED)
    k_scale_ptr, v_scale_ptr,  # (H,) float32 per-head dequantization scales (QUANT)
    T_NEW, H, D,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_SEQ_IDS: tl.constexpr, HAS_COUNTS: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program writes one token of one batch entry, all heads: H*D contiguous-ish values,
    # so each program issues a few wide loads and stores.
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T_NEW
    t = pid % T_NEW
    if HAS_COUNTS:
        count = tl.load(counts_ptr + b)
    else:
        count = T_NEW
    if t >= count:
        return
    if HAS_SEQ_IDS:
        row = tl.load(seq_ids_ptr + b).to(tl.int64)
    else:
        row = b
    pos = tl.load(lengths_ptr + row).to(tl.int64) + t
    if PAGED:
        blk = tl.load(block_table_ptr + row * stride_bt + pos // PAGE_SIZE).to(tl.int64)
        dst = blk * stride_cblk + (pos % PAGE_SIZE) * stride_ct
    else:
        dst = row * stride_cblk + pos * stride_ct

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    k = tl.load(k_new_ptr + b * stride_nb + t * stride_nt + offs_h[:, None] * stride_nh
                + offs_d[None, :] * stride_nd, mask=mask, other=0.0)
    v = tl.load(v_new_ptr + b * stride_vb + t * stride_vt + offs_h[:, None] * stride_vh
                + offs_d[None, :] * stride_vd, mask=mask, other=0.0)
    if QUANT:
        # Stored value = x / scale, saturated to the e4m3 range (an out-of-range value becomes
        # +-448 instead of NaN), rounded to nearest even.
        k_scale = tl.load(k_scale_ptr + offs_h, mask=offs_h < H, other=1.0)
        v_scale = tl.load(v_scale_ptr + offs_h, mask=offs_h < H, other=1.0)
        # div_rn, IEEE division: Triton's `/` on float32 is approximate (div.full.f32), which put
        # values near an e4m3 rounding boundary on the other side of it from torch's x / scale.
        # A NaN stays NaN (as torch.clamp and the reference): a plain clamp's min/max would store
        # it as -448 on a GPU.
        k = _round_to_e4m3(tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale[:, None]), -_FP8_E4M3_MAX,
                                    _FP8_E4M3_MAX, propagate_nan=tl.PropagateNan.ALL))
        v = _round_to_e4m3(tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale[:, None]), -_FP8_E4M3_MAX,
                                    _FP8_E4M3_MAX, propagate_nan=tl.PropagateNan.ALL))
    cache_offs = dst + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _e4m3_to_float16_in_registers(x):
    """float8 e4m3 values -> float16 (exact), converted where x was loaded, 4 per instruction pair.

    V is the B operand of P.V, contracted over its tokens, which are its strided dimension:
    the MMA wants two consecutive tokens per register, and only 16-bit data has a transposing
    shared-memory load. Given `x.to(tl.float16)`, Triton moves the conversion after the
    shared-memory read of the fp8 tile and gathers it byte by byte (an LDS.U8 per value).
    An opaque conversion (is_pure=False: it must stay where it is written) makes it convert
    in registers, store float16 and read that back transposed with ldmatrix, about a third
    fewer instructions per key step (tests/test_compile_sm90.py checks that no byte gathers
    are left). The interpreter cannot run PTX and takes the plain cast.
    """
    if _INTERPRET:
        return x.to(tl.float16)
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.int8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4,
    )


@triton.jit
def _token_offsets(block_table_ptr, stride_bt, stride_kblk, stride_kt, row, n0, end,
                   PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_N,) int64 element offsets in the pool of keys n0 .. n0 + BLOCK_N of cache row
    `row` (the same for values). Paged: keys at or past `end` are not looked up and get block
    0's offsets; the caller masks them."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if PAGED:
        blk = tl.load(block_table_ptr + row * stride_bt + offs_n // PAGE_SIZE, mask=offs_n < end, other=0)
        return blk.to(tl.int64) * stride_kblk + (offs_n % PAGE_SIZE) * stride_kt
    return row * stride_kblk + offs_n.to(tl.int64) * stride_kt


@triton.jit
def _decode_tile(
    q, k_ptr, v_ptr, kv_head, tok, n0, end, last_pos,
    row_scale, m_i, l_i, acc, mask_d,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One BLOCK_N-key step of the online softmax: keys n0 .. n0 + BLOCK_N, at element offsets
    `tok` of the pools (_token_offsets).

    q: (BLOCK_M, BLOCK_D) in the MMA dtype; m_i, l_i: (BLOCK_M,) running max (log2 units) and
    sum; acc: (BLOCK_M, BLOCK_D) float32. MASKED: drop keys at or past `end` and keys after
    each query's `last_pos`; unmasked steps must lie wholly inside both.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < end
    else:
        mask_n = tl.full([BLOCK_N], True, tl.int1)
    kv_mask = mask_n[:, None] & mask_d[None, :]
    # (Tried and dropped: evict_first on these loads, each tile being read once, so that block
    # tables and lengths stay in L2 across launches. H100, both kernels in one process, graph
    # replays over the benchmark's layers alternated over 15 rounds (scratch): 0.988-1.006x at
    # B = 1 T = 4k / 32k / 128k and B = 8 T = 8k on every cache. Runs in separate processes had
    # shown 1-7%: drift between processes, not the policy.)
    k = tl.load(k_ptr + tok[:, None] + kv_head, mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(v_ptr + tok[:, None] + kv_head, mask=kv_mask, other=0.0)
    if v.dtype == tl.float8e4nv and q.dtype == tl.float16:
        v = _e4m3_to_float16_in_registers(v)
    else:
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * row_scale[:, None]
    if MASKED:
        s = tl.where(mask_n[None, :] & (offs_n[None, :] <= last_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0,
    # not NaN from (-inf) - (-inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


def _decode_configs():
    # Under the interpreter every config would run at every call: keep one.
    if runtime.interpret_mode():
        return [triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1)]
    # KERNEL_LAB_KVCACHE_AUTOTUNE=0 keeps one config: test suites with many shapes then compile each
    # specialization once instead of once per config.
    if os.environ.get("KERNEL_LAB_KVCACHE_AUTOTUNE", "1") == "0":
        return [triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2)]
    return [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bn, w, s in ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 3))
    ]


@triton.autotune(configs=_decode_configs(), key=["HEAD_DIM", "BLOCK_M", "PAGED", "QUANT", "len_bucket",
                                                 "work_bucket"])
@triton.jit
def _decode_split_kernel(
    q_ptr,  # (B, T_q, H_q, D)
    stride_qb, stride_qt, stride_qh, stride_qd,
    k_ptr, v_ptr,  # pools (num_blocks, PAGE_SIZE, H_kv, D); k and v share strides
    stride_kblk, stride_kt, stride_kh, stride_kd,
    lengths_ptr,  # (rows,) int32 valid tokens per cache row (the T_q queries included)
    seq_ids_ptr,  # (B,) int32 cache row of each batch entry (HAS_SEQ_IDS)
    block_table_ptr, stride_bt,  # (rows, max_blocks) int32 (PAGED)
    k_scale_ptr, v_scale_ptr,  # (H_kv,) float32 (QUANT)
    out_ptr,  # (B, T_q, H_q, D) final output, written when NUM_SPLITS == 1
    stride_ob, stride_ot, stride_oh, stride_od,
    part_ptr, lse_offset,  # SPLIT: float32 scratch, the partial outputs (B, H_q, T_q, NUM_SPLITS, D),
    # then from element lse_offset their log2-sum-exps (B, H_q, T_q, NUM_SPLITS)
    qk_scale,  # softmax scale * log2(e): exp2 below instead of exp
    H_KV, T_Q, GROUP, NUM_M_TILES, NUM_SPLITS,
    len_bucket, work_bucket,  # autotune keys only: log2 of the split length, 2 log2 of the programs
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SEQ_IDS: tl.constexpr,
    QUANT: tl.constexpr, FP16_MMA: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Program (b, kv head, m tile) x split. The M rows of the tile are the GROUP query heads
    # that share this kv head times the T_q query tokens, so every K/V tile is read once per
    # group (GQA packing) and tl.dot gets an M of at least 16.
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    m_tile = pid % NUM_M_TILES
    kvh = (pid // NUM_M_TILES) % H_KV
    b = pid // (NUM_M_TILES * H_KV)
    if HAS_SEQ_IDS:
        row = tl.load(seq_ids_ptr + b).to(tl.int64)
    else:
        row = b
    length = tl.load(lengths_ptr + row)

    # Flash-decoding: this split covers [start, end) of the sequence, chunk rounded up to
    # BLOCK_N so only the last tile of the last split is partial.
    chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    g = offs_m // T_Q
    t = offs_m % T_Q
    mask_m = offs_m < GROUP * T_Q
    h = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    # Query t is the (T_q - t)-th newest token: it sees keys at positions <= length - T_q + t.
    last_pos = length - T_Q + t

    scale = qk_scale
    if QUANT:
        # Per-head dequantization folds into the scalars: s = (q . k8) * k_scale * scale and
        # o = (p . v8) * v_scale, so the fp8 tiles are only converted, never multiplied.
        scale = scale * tl.load(k_scale_ptr + kvh)
    row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * scale
    if FP16_MMA:
        # A bfloat16 q over an fp8 cache: the tiles go to a float16 MMA, because e4m3 ->
        # float16 is one exact conversion per two values while e4m3 -> bfloat16 costs another
        # per value, and those conversions, not the bytes, bounded this loop. q is scaled per
        # row by a power of two so its largest |q| lands in [2^14, 2^15): exact (float16 keeps
        # 11 significant bits, bfloat16 8) and never overflows. Only entries 2^28 times smaller
        # than the row's largest become float16 subnormals and lose bits: their share of the
        # dot product is far under bfloat16's own rounding (2^-9) of its largest term.
        q32 = q.to(tl.float32)
        amax = tl.max(tl.abs(q32), 1)
        exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        shift = tl.minimum(tl.maximum(14 - exponent, -100), 100)
        q = (q32 * ((shift + 127) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
        row_scale = row_scale * ((127 - shift) << 23).to(tl.float32, bitcast=True)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_head = kvh * stride_kh + offs_d[None, :] * stride_kd
    # Tiles wholly inside [start, end) and visible to every query of the tile (for T_q = 1,
    # all but the last) run without the key masks; the rest, at most a few, with them.
    full_end = start + tl.maximum(tl.minimum(end, length - T_Q + 1) - start, 0) // BLOCK_N * BLOCK_N
    # A paged tile's addresses come from a block-table load: each step looks up the next tile's
    # blocks, so that its K and V loads do not wait on a lookup of their own. A split of a few
    # tiles otherwise waited on one extra memory latency per tile (H100, B = 1, 4096 keys,
    # 16-token pages: 13.0 us a decode against 10.7 for the contiguous cache in history 0012,
    # 12.0 against 10.8 with the lookup ahead in 0015).
    tok = _token_offsets(block_table_ptr, stride_bt, stride_kblk, stride_kt, row, start, end,
                         PAGED, PAGE_SIZE, BLOCK_N)
    for n0 in range(start, full_end, BLOCK_N):
        tok_next = _token_offsets(block_table_ptr, stride_bt, stride_kblk, stride_kt, row, n0 + BLOCK_N, end,
                                  PAGED, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc = _decode_tile(
            q, k_ptr, v_ptr, kv_head, tok, n0, end, last_pos, row_scale, m_i, l_i, acc, mask_d,
            MASKED=False, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        tok = tok_next
    for n0 in range(full_end, end, BLOCK_N):
        tok_next = _token_offsets(block_table_ptr, stride_bt, stride_kblk, stride_kt, row, n0 + BLOCK_N, end,
                                  PAGED, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc = _decode_tile(
            q, k_ptr, v_ptr, kv_head, tok, n0, end, last_pos, row_scale, m_i, l_i, acc, mask_d,
            MASKED=True, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        tok = tok_next

    # A query with no key (empty sequence or split) returns 0 and has lse = -inf.
    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if QUANT:
        o = o * tl.load(v_scale_ptr + kvh)
    if SPLIT:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        part = ((b * (H_KV * GROUP) + h) * T_Q + t) * NUM_SPLITS + split
        tl.store(part_ptr + lse_offset + part, lse, mask=mask_m)
        tl.store(part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=mask_m[:, None] & mask_d[None, :])
    else:
        tl.store(out_ptr + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh
                 + offs_d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _decode_merge_kernel(
    part_ptr, lse_offset,  # the split kernel's scratch: partial outputs, then from lse_offset their lse
    out_ptr, stride_ob, stride_ot, stride_oh, stride_od,  # (B, T_q, H_q, D)
    H_Q, T_Q, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # One program per (b, head, query token) and BLOCK_D columns of the head: the
    # logsumexp-weighted mean of its splits, o = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max).
    pid = tl.program_id(0).to(tl.int64)
    t = pid % T_Q
    h = (pid // T_Q) % H_Q
    b = pid // (T_Q * H_Q)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    lse = tl.load(part_ptr + lse_offset + pid * NUM_SPLITS + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # all -inf (no keys): all 0
    denom = tl.sum(w, 0)
    o = tl.load(part_ptr + (pid * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=mask_s[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + t * stride_ot + h * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
