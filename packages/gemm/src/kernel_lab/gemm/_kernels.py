"""Triton kernels of kernel_lab.gemm (and their autotune configs); launchers live in ops.py.

Layout conventions: a / x is (M, K), b is (K, N) addressed through explicit strides (so a
transposed view such as `weight.t()` costs nothing), c is (M, N). Accumulation is float32.

Split-K: the grid's second axis splits the K loop (K_PER_SPLIT columns each); with
WRITE_PARTIAL each program writes its raw float32 partial tile to a (splits, M, N) workspace,
and `_splitk_reduce_kernel` sums the partials and applies the epilogue. Decode shapes
(M <= 64) need it: one program per N tile would leave most SMs idle while the weight, the
only large operand, streams from HBM.
"""

import torch
import triton
import triton.language as tl

# FLOAT_ARGUMENTS_NOTE: inductor passes a Python float argument (eps, 1/K) to a user kernel as
# float64, where an eager launch passes float32; a float64 rstd would promote the epilogue's
# per-element math to float64. The kernels cast their float arguments to float32 first.

# Per-tensor / per-row scales and the bias are read through a stride: stride 0 broadcasts one
# value, stride 1 reads one value per row (scale_a) or per column (scale_b, bias).


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    """act(x) on a float32 tile; ACTIVATION is "none", "gelu", "gelu_tanh", "silu" or "relu"."""
    if ACTIVATION == "gelu":
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        # tanh(u) = sign(u) * (1 - e) / (1 + e), e = exp(-2|u|) <= 1: written with exp so that
        # it runs everywhere (the interpreter included) and never overflows.
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = tl.exp(-2.0 * tl.abs(u))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(u < 0, -t, t)
        x = 0.5 * x * (1.0 + t)
    elif ACTIVATION == "silu":
        # sigmoid from e = exp(-|x|) <= 1, which cannot overflow for large negative x.
        e = tl.exp(-tl.abs(x))
        x = x * tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    elif ACTIVATION == "relu":
        # NaN stays NaN, as torch.relu: a plain max (PTX max.f32) returns the non-NaN operand
        x = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
    return x


@triton.jit
def _epilogue_math(
    acc, offs_m, offs_n, M, N, bias_ptr, scale_a_ptr, stride_sa, scale_b_ptr, stride_sb, rstd,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RSTD: tl.constexpr, ACTIVATION: tl.constexpr,
):
    """act(acc * rstd * scale_a * scale_b + bias) on a float32 tile."""
    mask_m = offs_m < M
    mask_n = offs_n < N
    if HAS_RSTD:
        acc = acc * rstd[:, None]
    if HAS_SCALE:
        sa = tl.load(scale_a_ptr + offs_m * stride_sa, mask=mask_m, other=0.0).to(tl.float32)
        sb = tl.load(scale_b_ptr + offs_n * stride_sb, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return _activation(acc, ACTIVATION)


@triton.jit
def _epilogue_store(
    acc, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
    bias_ptr, scale_a_ptr, stride_sa, scale_b_ptr, stride_sb, rstd,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RSTD: tl.constexpr, ACTIVATION: tl.constexpr,
):
    """c = act(acc * rstd * scale_a * scale_b + bias), cast to c's dtype, masked store."""
    acc = _epilogue_math(
        acc, offs_m, offs_n, M, N, bias_ptr, scale_a_ptr, stride_sa, scale_b_ptr, stride_sb, rstd,
        HAS_BIAS, HAS_SCALE, HAS_RSTD, ACTIVATION,
    )
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _pdl_start(w_row_ptrs, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """A decode kernel's start as a programmatic dependent launch (PDL > 0; ops.DECODE_PDL:
    Hopper and newer, launched with launch_pdl=True). PDL = 1 lets the stream's next kernel
    launch now, so that its programs take the SMs ours leave and run their prologue during our
    tail (PDL = 2: the caller lets it after its K loop, see ops._pdl). With PREFETCH, ask L2 for
    the 128-byte line at each of w_row_ptrs (the first line of each weight row the program
    streams; a prefetch reads no values, so a write to them by the kernel before us still
    wins). Then wait until the kernel before us has finished and its writes are visible: every
    program reads and writes only after this, on every path (one that skipped the wait could
    end before that kernel does)."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        if PREFETCH:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [w_row_ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.extra.cuda.gdc_wait()


@triton.jit
def _grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile `tile_id` in grouped order: GROUP_M row tiles walk the N
    tiles together so that the B tiles they share are still in L2 when the next row tile needs
    them."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program (one program per output tile, grouped order)."""
    return _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)


@triton.jit
def _split_k_tile(M, N, K, K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile and K range on a (tiles, splits) grid: (pid_n, pid_k, offs_m,
    offs_n, offs_wm, offs_wn, k_start, k_len).

    offs_m (BLOCK_M,) / offs_n (BLOCK_N,): the tile's rows / columns, for the masked store.
    offs_wm / offs_wn: the same wrapped into [0, M) / [0, N), 64-bit: rows and columns past the
    edge re-read valid ones, so the loads need no M / N mask and the inner loop keeps a single
    mask, the K tail. k_start, k_len: the split's first K column and its length.

    k_len is a scalar bound so that the callers write the K-tail mask `offs_k < k_len - k` (as
    in Triton's matmul tutorial): with K and K_PER_SPLIT multiples of 16 the compiler then knows
    the mask is constant over 16-element runs, so loads stay 16-byte vectors and the loop is
    pipelined with asynchronous copies. The form `k + offs_k < k_end` hides that constancy: the
    compiler then emits 2-byte loads and no pipeline, several times slower on Hopper
    (tests/test_compiled_code.py guards the compiled form).
    """
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wm = (offs_m % M).to(tl.int64)
    offs_wn = (offs_n % N).to(tl.int64)
    k_start = pid_k * K_PER_SPLIT
    k_len = min(K - k_start, K_PER_SPLIT)
    return pid_n, pid_k, offs_m, offs_n, offs_wm, offs_wn, k_start, k_len


@triton.jit
def _store_partial(acc, ws_ptr, pid_k, offs_m, offs_n, M, N, stride_ws, stride_wm):
    """Split-K: store the raw float32 (BLOCK_M, BLOCK_N) tile acc into split pid_k of the
    (splits, M, N) workspace (unit column stride); the reduce kernel applies the epilogue."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    w_ptrs = ws_ptr + pid_k.to(tl.int64) * stride_ws + offs_m.to(tl.int64)[:, None] * stride_wm + offs_n[None, :]
    tl.store(w_ptrs, acc, mask=mask)


# do_not_specialize: M changes from call to call (every batch size); Triton would otherwise
# compile a variant for M == 1 and for M % 16 == 0, for no speed gain (M only wraps row indices
# and masks the store). K_PER_SPLIT stays specialised: its divisibility by 16 is what keeps the
# K-tail mask vectorisable.
_DNS = ["M", "M_BUCKET"]


@triton.jit(do_not_specialize=_DNS)
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr,  # c: the output, or the float32 split-K workspace (WRITE_PARTIAL)
    bias_ptr, scale_a_ptr, scale_b_ptr,
    M, N, K,
    M_BUCKET,  # next power of two of M, capped: an autotune key only (decode vs prefill)
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_sa, stride_sb,
    stride_cs,  # workspace stride between splits (WRITE_PARTIAL)
    K_PER_SPLIT,  # K range of one split, a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, ACTIVATION: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,  # split-K: store the raw float32 partial tile (epilogue in the reduce)
    PDL: tl.constexpr,  # 0, or a programmatic dependent launch (decode; see _pdl_start)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """c = act((a @ b) * scale_a * scale_b + bias) for float16 / bfloat16 / float8 a and b."""
    _, pid_k, offs_m, offs_n, offs_am, offs_bn, k_start, k_len = _split_k_tile(
        M, N, K, K_PER_SPLIT, BLOCK_M, BLOCK_N, GROUP_M
    )
    _pdl_start(b_ptr + k_start.to(tl.int64) * stride_bk + offs_bn * stride_bn, PDL, True)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + (k_start + offs_k)[None, :].to(tl.int64) * stride_ak
    b_ptrs = b_ptr + (k_start + offs_k)[:, None].to(tl.int64) * stride_bk + offs_bn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        k_mask = offs_k < k_len - k  # a scalar bound: see _split_k_tile
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if HAS_SCALE:
            # float8 (the only scaled case): Hopper's wgmma keeps fp8 partial sums in reduced
            # precision unless told to promote them; promoting into the float32 accumulator
            # after every BLOCK_K tile matches torch._scaled_mm's default (no fast accumulation).
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if PDL == 2:  # see _pdl_start
        tl.extra.cuda.gdc_launch_dependents()
    if not WRITE_PARTIAL:
        _epilogue_store(
            acc, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
            bias_ptr, scale_a_ptr, stride_sa, scale_b_ptr, stride_sb, acc,
            HAS_BIAS, HAS_SCALE, False, ACTIVATION,
        )
    else:
        _store_partial(acc, c_ptr, pid_k, offs_m, offs_n, M, N, stride_cs, stride_cm)


@triton.jit(do_not_specialize=["M"])
def _splitk_reduce_kernel(
    ws_ptr, c_ptr, ssq_ptr,  # ssq: (splits, M) partial sums of squares (rms_norm_linear)
    bias_ptr, scale_a_ptr, scale_b_ptr,
    M, N, n_splits, stride_ws, stride_ssq, stride_cm, stride_cn, stride_sa, stride_sb,
    inv_k, eps,  # rms_norm_linear: rstd = rsqrt(sum(ssq) * inv_k + eps)
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RSTD: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """c = epilogue(sum over splits of the float32 partial tiles), in a fixed order
    (deterministic, unlike atomics)."""
    # float32 math under torch.compile too: see FLOAT_ARGUMENTS_NOTE
    inv_k, eps = tl.cast(inv_k, tl.float32), tl.cast(eps, tl.float32)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    ptrs = ws_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for s in range(n_splits):
        acc += tl.load(ptrs + s * stride_ws, mask=mask, other=0.0)
        if HAS_RSTD:
            ssq += tl.load(ssq_ptr + s * stride_ssq + offs_m, mask=mask_m, other=0.0)
    if HAS_RSTD:
        rstd = 1.0 / tl.sqrt(ssq * inv_k + eps)
    else:  # unused: no 1 / sqrt(0) (the interpreter warned of it on every plain split-K reduce)
        rstd = ssq
    _epilogue_store(
        acc, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
        bias_ptr, scale_a_ptr, stride_sa, scale_b_ptr, stride_sb, rstd,
        HAS_BIAS, HAS_SCALE, HAS_RSTD, ACTIVATION,
    )


@triton.jit
def _biased_code_floats(codes, SIGNED: tl.constexpr, USE_PRMT: tl.constexpr):
    """2^23 + byte as float32 for a tile of int8 (SIGNED: byte = code + 128) or uint8 codes,
    without an int -> float conversion: a byte in the low mantissa bits of 2^23 reads as
    2^23 + byte exactly. USE_PRMT (a GPU, not the interpreter): one PTX byte permute per code
    builds the float's bits from the byte and 0x4B (the top byte of 2^23), where the Triton
    expression compiles to two logic ops (ptxas does not fuse the byte extract and the OR)."""
    if USE_PRMT:
        flip: tl.constexpr = "xor.b32 w, $4, 0x80808080;" if SIGNED else "mov.b32 w, $4;"
        return tl.inline_asm_elementwise(
            "{ .reg .b32 w, m; mov.b32 m, 0x4B000000; " + flip
            + " prmt.b32 $0, w, m, 0x7540; prmt.b32 $1, w, m, 0x7541;"
            + " prmt.b32 $2, w, m, 0x7542; prmt.b32 $3, w, m, 0x7543; }",
            "=r,=r,=r,=r,r", [codes], dtype=tl.float32, is_pure=True, pack=4,
        )
    byte = codes.to(tl.uint8, bitcast=True).to(tl.uint32)
    if SIGNED:
        byte ^= 0x80
    return (byte | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _biased_zero(zero, SIGNED: tl.constexpr):
    """What _biased_code_floats adds to a code, plus the zero point: 2^23 + zero (uint8 codes) or
    2^23 + 128 + zero (int8, flipped into a byte), as float32 (exact: below 2^24)."""
    bias: tl.constexpr = 8388736.0 if SIGNED else 8388608.0
    return zero.to(tl.float32) + bias


@triton.jit
def _int8_weights(q, zero, dtype: tl.constexpr, SIGNED: tl.constexpr, USE_PRMT: tl.constexpr):
    """code - zero of an int8 (SIGNED, zero 0) / uint8 code tile as exact `dtype` values
    (|code - zero| <= 255). zero: int32, broadcastable against q.

    Through float32 without an int -> float conversion (_biased_code_floats): 2^23 + byte minus
    2^23 + zero point is exact, and so is its cast (8 significant bits hold |code - zero|). An
    int8 -> bfloat16 cast is one I2F per code, which issues at a quarter of the FMA rate on
    Hopper: at 16 codes per SM per cycle it alone needs as long as an H200 takes to read the codes
    (about 16 bytes per SM per cycle), and it held the M = 16 decode below cuBLAS bf16."""
    return (_biased_code_floats(q, SIGNED, USE_PRMT) - _biased_zero(zero, SIGNED)).to(dtype)


@triton.jit
def _int4_weights(p, zero, dtype: tl.constexpr, USE_PTX: tl.constexpr):
    """(low nibbles, high nibbles) of a packed int4 byte tile p, each as code - zero in exact
    float16 / bfloat16 values. zero: int32, broadcastable against p (8 when symmetric).

    Magic-number dequantization: OR-ing a 4-bit code into the low mantissa bits of 2^7
    (bfloat16 keeps 7 mantissa bits) or 2^10 (float16: 10) gives 2^7 + code exactly, a logic op
    per code where an int -> float conversion costs one plus byte shuffles; subtracting
    2^7 + zero, both small integers, is exact too. Offline sm_90 SASS of the K loop: 9.8
    instructions per weight with conversions, 5.8 with this in Triton.

    USE_PTX (a GPU, not the interpreter): the same bits from PTX, four bytes at a time: a byte
    permute spreads bytes 0 and 1 into the two 16-bit halves of a register, one logic op masks
    their low nibbles and ORs in the magic bits (a shift first for the high nibbles), so each
    register holds two finished values, where Triton's form widens each byte to 16 bits first.
    (See _weight_only_decode_kernel for what it saved there.)"""
    if dtype == tl.bfloat16:
        magic_bits: tl.constexpr = 0x4300  # 128.0
        magic: tl.constexpr = 128
        magic_pair: tl.constexpr = "0x43004300"  # (for the PTX: two halves)
    else:
        magic_bits: tl.constexpr = 0x6400  # 1024.0
        magic: tl.constexpr = 1024
        magic_pair: tl.constexpr = "0x64006400"
    offset = (magic + zero).to(dtype)
    if USE_PTX:
        w_lo, w_hi = tl.inline_asm_elementwise(
            "{ .reg .b32 b01, b23, h01, h23; prmt.b32 b01, $4, 0, 0x4140; prmt.b32 b23, $4, 0, 0x4342;"
            + " shr.b32 h01, b01, 4; shr.b32 h23, b23, 4;"
            + " lop3.b32 $0, b01, 0x000F000F, " + magic_pair + ", 0xea; lop3.b32 $1, b23, 0x000F000F, " + magic_pair
            + ", 0xea; lop3.b32 $2, h01, 0x000F000F, " + magic_pair + ", 0xea; lop3.b32 $3, h23, 0x000F000F, "
            + magic_pair + ", 0xea; }",
            "=r,=r,=r,=r,r", [p], dtype=(tl.int16, tl.int16), is_pure=True, pack=4,
        )
        return w_lo.to(dtype, bitcast=True) - offset, w_hi.to(dtype, bitcast=True) - offset
    p = p.to(tl.int16)
    w_lo = ((p & 0xF) | magic_bits).to(dtype, bitcast=True) - offset
    w_hi = (((p >> 4) & 0xF) | magic_bits).to(dtype, bitcast=True) - offset
    return w_lo, w_hi


@triton.jit(do_not_specialize=["M"])
def _quantized_matmul_kernel(
    x_ptr, q_ptr, scales_ptr, zeros_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_cm, stride_cn,
    GROUP_SIZE,
    BITS: tl.constexpr,  # 8: one int8/uint8 code per byte; 4: two codes per uint8, low nibble first
    HAS_ZEROS: tl.constexpr,  # per-group uint8 zero points; else 0 (int8) or 8 (int4)
    HAS_BIAS: tl.constexpr,
    USE_PRMT: tl.constexpr,  # a GPU: PTX code conversions (_biased_code_floats, _int4_weights)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """c = x @ dequant(q)^T + bias at prefill sizes (M > 64; decode: _weight_only_decode_kernel),
    the weight dequantized tile by tile inside the K loop.

    q is (N, K) codes (or (N, K // 2) bytes for int4), scales / zeros (N, K // GROUP_SIZE).
    A K tile never straddles two groups (the launcher keeps GROUP_SIZE % BLOCK_K == 0), so each
    tile has one scale per weight row: the integer codes minus the zero point are exact in
    float16 / bfloat16 (|code - zero| <= 255), the tile product runs on tensor cores and the
    scale multiplies its float32 result.

    The product is computed transposed, c^T (BLOCK_N, BLOCK_M) = dequant(q) @ x^T. Hopper's
    warpgroup MMA takes its first operand from registers but its second only from shared
    memory: with the dequantized tile first it goes from the conversion straight into the MMA,
    and x^T, which needs no arithmetic, takes the shared-memory side. Written as x @ dequant(q)^T
    (before kernel-lab-gemm 0.1.17) every dequantized tile was stored to shared memory and read
    back each step, and the kernel spilled (offline sm_90 SASS with unit K strides, as launched:
    255 registers, 22 (int8) and 35 (int4) local loads; now 234 and 238 registers, none). Codes
    and x arrive by asynchronous copies either way. H200, M = 4096, the Llama-3-8B projections,
    x cuBLAS bf16 on the dense weight: int8 0.33-0.36 -> 0.45-0.52, int4 0.24-0.25 -> 0.43-0.46
    (scratch, two runs, kernels launched back to back, alternated rounds; H100: 0.33-0.34 ->
    0.47-0.49 and 0.22-0.23 -> 0.42-0.45). Prefetching the next step's tiles into registers was
    slower (0.26-0.33x). What holds the loop at about half of cuBLAS was not profiled.
    """
    # The K-tail masks below are written against the scalar bound k_len: see _split_k_tile.
    _, _, offs_m, offs_n, offs_xm, offs_qn, k_start, k_len = _split_k_tile(M, N, K, K, BLOCK_M, BLOCK_N, GROUP_M)
    dtype = x_ptr.dtype.element_ty
    offs_x = tl.arange(0, BLOCK_K)
    if BITS == 8:
        offs_k = offs_x
        q_cols = k_start + offs_k
    else:
        # Byte j of a row holds columns 2j (low nibble) and 2j + 1 (high nibble): x is loaded as
        # one contiguous tile and split in registers into its even and odd columns, which the two
        # nibble tiles multiply (no interleaving of the unpacked codes).
        offs_k = tl.arange(0, BLOCK_K // 2)
        q_cols = k_start // 2 + offs_k
    q_ptrs = q_ptr + offs_qn[:, None] * stride_qn + q_cols[None, :] * stride_qk  # (BLOCK_N, K) codes
    x_ptrs = x_ptr + offs_xm[:, None] * stride_xm + (k_start + offs_x)[None, :] * stride_xk  # (BLOCK_M, K) of x
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # c^T
    for k in range(0, k_len, BLOCK_K):
        g = (k_start + k) // GROUP_SIZE
        scale = tl.load(scales_ptr + offs_qn * stride_sn + g * stride_sg).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + offs_qn * stride_sn + g * stride_sg).to(tl.int32)
        else:
            zero = tl.zeros((BLOCK_N,), dtype=tl.int32) + (8 if BITS == 4 else 0)
        if BITS == 8:
            k_mask = offs_k < k_len - k
        else:
            k_mask = offs_k < (k_len - k) // 2  # k_len is even: K is
        codes = tl.load(q_ptrs, mask=k_mask[None, :], other=0)
        x = tl.load(x_ptrs, mask=(offs_x < k_len - k)[None, :], other=0.0)
        if BITS == 8:
            part = tl.dot(_int8_weights(codes, zero[:, None], dtype, not HAS_ZEROS, USE_PRMT), tl.trans(x))
        else:
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
            w_lo, w_hi = _int4_weights(codes, zero[:, None], dtype, USE_PRMT)
            part = tl.dot(w_hi, tl.trans(x_odd), tl.dot(w_lo, tl.trans(x_even)))
        acc += part * scale[:, None]
        x_ptrs += BLOCK_K * stride_xk
        q_ptrs += (BLOCK_K if BITS == 8 else BLOCK_K // 2) * stride_qk
    c = tl.trans(acc)
    _epilogue_store(
        c, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
        bias_ptr, bias_ptr, 0, bias_ptr, 0, c,
        HAS_BIAS, False, False, "none",
    )


@triton.jit(do_not_specialize=["M"])
def _weight_only_decode_kernel(
    x_ptr, q_ptr, scales_ptr, zeros_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_cm, stride_cn,
    stride_cs, SLICE_STEPS,
    GROUP_SIZE: tl.constexpr,  # codes per scale (0 when PER_CHANNEL): a constant divisor in the loop
    BITS: tl.constexpr,  # as _quantized_matmul_kernel's
    HAS_ZEROS: tl.constexpr,
    PER_CHANNEL: tl.constexpr,  # one scale (and zero point) per row
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,  # split-K: store the raw float32 partial tile (epilogue in the reduce)
    USE_PRMT: tl.constexpr,  # a GPU: PTX code conversions (_biased_code_floats, _int4_weights)
    SLICES: tl.constexpr,  # K slices of a program, one a warp
    K_TAIL: tl.constexpr,  # K % BLOCK_K != 0: a step may end past K
    MASK_M: tl.constexpr,  # M < BLOCK_M: rows of x past M are masked (see below)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c = x @ dequant(q)^T + bias at decode sizes (M <= BLOCK_M <= 64), formats as
    _quantized_matmul_kernel's.

    Decode moves the weight once and does little math on it, but each code needs a few
    instructions to become a float, and a warp issues at most one instruction a cycle: the
    weight-only decode's speed follows those instructions and the warps issuing them, not the
    bytes (past the plan's warps per SM, more slices were slower again). So a
    program is small (BLOCK_N = 16 weight rows) and cuts its K range into SLICES contiguous
    slices, one per warp: the tiles carry a leading SLICES dimension, tl.dot is a batched
    product (slice s of the codes with slice s of x), and the SLICES partial tiles are summed
    once after the loop. That is split-K inside the program, without a second launch. The
    product is computed transposed, dequant(q) (BLOCK_N, BLOCK_K) @ x^T (BLOCK_K, BLOCK_M), so
    that the dequantized tile, in registers, is the MMA's first operand; 16-row products run
    as mma.sync. H100 sweep (M = 16, bf16, the Llama-3-8B projections, CUDA-graph replays over
    rotated weight copies; scratch): 1.1-1.5x faster than the earlier kernel, which gave each
    program 64-128 rows over 4-8 warps on warpgroup MMAs and split K across programs with a
    reduce launch (its K loop ran at a fraction of the issue rate with one or two programs an SM).

    Program (column tile, split): K columns [pid_k * SLICES * SLICE_LEN, ...) of which slice s
    takes SLICE_LEN = SLICE_STEPS * BLOCK_K (the last slices may be short or empty). A K step
    never straddles two groups (GROUP_SIZE % BLOCK_K == 0 where grouped). x is read as a
    contiguous tile (16-byte asynchronous copies). int4: the low and high nibbles of a byte
    hold columns 2j and 2j + 1. Up to 32 rows of x, x is split in registers into its even and
    odd columns, which the two nibble tiles multiply (two products). Offline sm_90 SASS of the
    loop (16 weight rows, 128-column steps, bf16, group 128): 3.7 instructions per weight, 5.8
    when the nibbles were converted by Triton's form (_int4_weights) and joined back into
    column order instead. H200 scratch run, int4 group 128 with and without zero points, the
    Llama-3-8B projections (CUDA-graph replays, both kernels alternated): 1.14-1.28x faster
    than that at M = 2 and 16, 0.97-1.16x at M = 32. With 64 rows of x the split cost more than
    the join (0.73-0.85x), so there the PTX nibbles are joined (0.94-1.21x).

    What bounds it is neither the bytes nor the SMs' issue rate. Nsight Compute, H200, the
    benchmark's M = 16 6144x4096 rows (2026-11-29): int8, 384 one-warp programs, 4.5% achieved
    occupancy, each warp issuing on 47% of its cycles, DRAM at 36% of its peak; int4, 384
    four-warp programs, 16.7% occupancy, stalls spread over waits and short / long scoreboards,
    DRAM at 23%. Two sweeps at M = 16 on the four Llama-3-8B projections (scratch, CUDA-graph
    replays over rotated weight copies), BLOCK_K x 1-8 slices x 3, 4, 6 or 8 stages with 16-row
    programs, and BLOCK_K x 1-4 slices x 3-4 stages with 16-, 32- and 64-row programs (the wider
    ones re-read x from L2 half or a quarter as often), beat the plan by 0-10%, not enough for
    another rule; deeper pipelines never helped.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_qn = (offs_n % N).to(tl.int64)  # rows past N re-read valid ones (their store is masked)
    offs_m = tl.arange(0, BLOCK_M)
    # Rows of x past M are masked, not wrapped onto valid ones as in the other kernels: every
    # program reads the same x, and at M = 2 eight copies of each row in every request kept the
    # few L2 lines holding it busy (H100, int4, N x K = 14336 x 4096: 53 us against 30 at M = 16).
    # MASK_M: at M = BLOCK_M the mask would only cost instructions in the loop.
    m_mask = (offs_m < M)[None, None, :] if MASK_M else tl.full((1, 1, 1), True, tl.int1)
    # A product with BLOCK_K, so that the compiler knows the slices' int4 byte offsets 16-aligned.
    # (Not tl.multiple_of on a SLICE_LEN argument: torch.compile builds the kernel with its scalar
    # arguments as constants to see which tensors it writes, tl.multiple_of fails on a constant,
    # and torch.compile then takes every argument as written and clones it.)
    SLICE_LEN = SLICE_STEPS * BLOCK_K
    offs_s = tl.arange(0, SLICES)
    slice_start = (pid_k * SLICES + offs_s) * SLICE_LEN  # (SLICES,) first column of each slice
    cols_left = K - slice_start  # from each slice's start to K's end (the loop stops at SLICE_LEN)
    dtype = x_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = (x_ptr + offs_m.to(tl.int64)[None, None, :] * stride_xm
              + (slice_start[:, None, None] + offs_k[None, :, None]) * stride_xk)  # (SLICES, BLOCK_K, BLOCK_M)
    CODES_PER_BYTE: tl.constexpr = 8 // BITS
    offs_q = tl.arange(0, BLOCK_K // CODES_PER_BYTE)  # code bytes of a step
    slice_bytes = SLICE_STEPS * (BLOCK_K // CODES_PER_BYTE)
    q_ptrs = (q_ptr + offs_qn[None, :, None] * stride_qn
              + ((pid_k * SLICES + offs_s) * slice_bytes)[:, None, None] * stride_qk
              + offs_q[None, None, :] * stride_qk)  # (SLICES, BLOCK_N, BLOCK_K // CODES_PER_BYTE)
    if PER_CHANNEL:
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + offs_qn * stride_sn).to(tl.int32)[None, :, None]
        else:
            zero = tl.full((1, 1, 1), 8 if BITS == 4 else 0, tl.int32)
    acc = tl.zeros((SLICES, BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, SLICE_LEN, BLOCK_K):
        # (Tried and dropped: loading the next step's scales and zero points one step ahead. H100,
        # M = 4 and 16, the Llama-3-8B projections, CUDA-graph replays, both kernels alternated in
        # one process (scratch): 0.95-1.06x symmetric, 0.49-0.64x with zero points.)
        if not PER_CHANNEL:  # each slice's group of this step: (SLICES, BLOCK_N) scales and zero points
            live = (k < cols_left)[:, None]  # (slices past K's end have no group)
            s_ptrs = offs_qn[None, :] * stride_sn + ((slice_start + k) // GROUP_SIZE)[:, None] * stride_sg
            scale = tl.load(scales_ptr + s_ptrs, mask=live, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zero = tl.load(zeros_ptr + s_ptrs, mask=live, other=0).to(tl.int32)[:, :, None]
            else:
                zero = tl.full((1, 1, 1), 8 if BITS == 4 else 0, tl.int32)
        # Masks: whole slices past K's end, and with K_TAIL the columns past it. Without a tail a
        # mask is constant along a slice's columns, which keeps the int4 byte loads 16 wide (a
        # column bound halved for bytes is only known to be a multiple of 8). With a tail, K a
        # multiple of 16 keeps the column masks constant over 16-element runs (see _split_k_tile).
        if K_TAIL:
            x_mask = offs_k[None, :, None] < (cols_left - k)[:, None, None]
            q_mask = offs_q[None, None, :] < (cols_left - k)[:, None, None] // CODES_PER_BYTE
        else:
            x_mask = (k < cols_left)[:, None, None]
            q_mask = x_mask
        x = tl.load(x_ptrs, mask=x_mask & m_mask, other=0.0)
        codes = tl.load(q_ptrs, mask=q_mask, other=0)
        if BITS == 8:
            part = tl.dot(_int8_weights(codes, zero, dtype, not HAS_ZEROS, USE_PRMT), x)
        elif BLOCK_M <= 32:
            # The nibbles multiply the even and odd columns of x: x is split in registers.
            x_even, x_odd = tl.split(tl.permute(tl.reshape(x, (SLICES, BLOCK_K // 2, 2, BLOCK_M)), (0, 1, 3, 2)))
            w_lo, w_hi = _int4_weights(codes, zero, dtype, USE_PRMT)
            part = tl.dot(w_hi, x_odd, tl.dot(w_lo, x_even))
        else:
            # Splitting a 64-row x costs more than joining the nibbles in column order.
            w_lo, w_hi = _int4_weights(codes, zero, dtype, USE_PRMT)
            part = tl.dot(tl.reshape(tl.join(w_lo, w_hi), (SLICES, BLOCK_N, BLOCK_K)), x)
        if PER_CHANNEL:
            acc += part
        else:
            acc += part * scale[:, :, None]
        x_ptrs += BLOCK_K * stride_xk
        q_ptrs += BLOCK_K // CODES_PER_BYTE * stride_qk
    acc = tl.sum(acc, axis=0)
    if PER_CHANNEL:
        acc = acc * tl.load(scales_ptr + offs_qn * stride_sn).to(tl.float32)[:, None]
    acc = tl.trans(acc)
    if not WRITE_PARTIAL:
        _epilogue_store(
            acc, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
            bias_ptr, bias_ptr, 0, bias_ptr, 0, acc,
            HAS_BIAS, False, False, "none",
        )
    else:
        _store_partial(acc, c_ptr, pid_k, offs_m, offs_n, M, N, stride_cs, stride_cm)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scales_ptr, zeros_ptr, g_ptr, c_ptr, bias_ptr,
    N, K, stride_xk, stride_wn, stride_wk, stride_sn, stride_cn, eps,
    HAS_SCALES: tl.constexpr,  # int8 codes with one scale per output channel (weight-only)
    HAS_ZEROS: tl.constexpr,  # and one uint8 zero point per channel
    HAS_NORM: tl.constexpr,  # rms_norm_linear: x is RMS-normalised with the weight g first
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    USE_PRMT: tl.constexpr,  # see _biased_code_floats
    PDL: tl.constexpr,  # 0, or 1: a programmatic dependent launch (see _pdl_start)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c (N,) = act(rstd * ((x * g) @ w^T) * scale + bias) for one row x (K,) and a weight w
    (N, K) in the nn.Linear layout: float16 / bfloat16 values (matmul, rms_norm_linear) or int8
    codes (weight-only, per-channel scale and zero point): decode at batch 1.

    A matrix-vector product has no reuse for tensor cores to exploit: each program streams
    BLOCK_N rows of w through CUDA-core FMAs into a (BLOCK_N, BLOCK_K) float32 accumulator
    (no cross-thread reduction inside the K loop), reduces it once, then applies rstd, the
    scale, bias and activation to its BLOCK_N outputs. A few rows per program give every SM
    programs without splitting K, so there is no second launch.

    Layout: x is loaded as a (1, BLOCK_K) row and the weight tile with at most 8 contiguous
    columns per thread (8-byte int8 loads), so that both get the same layout when BLOCK_K is a
    multiple of 8 x 32 x num_warps: every thread converts its 8 x values once per step and
    reuses them for all BLOCK_N rows, with no layout conversion (a (BLOCK_K,) x vector had
    another layout, and converting it cost a shared-memory round trip and barriers per step).

    rms_norm_linear (HAS_NORM): the same loop sums x^2 on the x row: rms_norm(x) @ w^T =
    rstd * ((x * g) @ w^T), so the normalised row never exists in memory and one launch does
    what the unfused pair does in two.

    int8 codes become float32 without an int -> float conversion (I2F issues at a quarter of
    the FMA rate on Hopper, and held the loop to 2.0-2.6 TB/s of codes on an H200): see
    _biased_code_floats; subtracting 2^23 + zero point (integers below 2^24) from 2^23 + byte
    is exact.

    (Tried and dropped: loading the next step's weight tile before the current one is used,
    registers double-buffered. H100, M = 1, the Llama-3-8B projections, rotated weight copies in
    CUDA graphs, eight configs each (scratch): the best was 1-7% slower than the autotuned kernel
    with bf16 weights and 16-23% slower with int8 codes.)
    """
    # float32 math under torch.compile too: see FLOAT_ARGUMENTS_NOTE
    eps = tl.cast(eps, tl.float32)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = (offs_n % N).to(tl.int64)  # rows past N re-read valid ones (their store is masked)
    _pdl_start(w_ptr + offs_wn * stride_wn, PDL, True)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_wn[:, None] * stride_wn + tl.max_contiguous(offs_k, 8)[None, :] * stride_wk
    x_ptrs = x_ptr + offs_k[None, :] * stride_xk
    g_ptrs = g_ptr + offs_k[None, :]
    if HAS_ZEROS:
        code_offset = _biased_zero(tl.load(zeros_ptr + offs_wn * stride_sn), False)
    else:
        code_offset = _biased_zero(tl.zeros((BLOCK_N,), dtype=tl.int32), True)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    ssq = tl.zeros((1, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (offs_k < K - k)[None, :]
        w = tl.load(w_ptrs, mask=k_mask, other=0)
        if HAS_SCALES:
            w = _biased_code_floats(w, not HAS_ZEROS, USE_PRMT) - code_offset[:, None]
        else:
            w = w.to(tl.float32)
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            ssq += x * x
            x *= tl.load(g_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        acc += w * x
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    if HAS_NORM:
        out *= 1.0 / tl.sqrt(tl.sum(tl.sum(ssq, axis=1), axis=0) / K + eps)
    if HAS_SCALES:
        out *= tl.load(scales_ptr + offs_wn * stride_sn).to(tl.float32)
    mask = offs_n < N
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    out = _activation(out, ACTIVATION)
    tl.store(c_ptr + offs_n * stride_cn, out.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nibble_floats(p, USE_PRMT: tl.constexpr):
    """(0.5 + low nibble / 256, 0.5 + high nibble / 256) as float32 for a tile of packed int4
    bytes, without int -> float conversions: a nibble in bits 16-19 of the float 0.5 (bits
    0x3F000000) adds nibble * 2^-8 exactly. USE_PRMT (a GPU, not the interpreter): the nibbles
    of four bytes are masked in one word, then one PTX byte permute per nibble moves it into
    place beside 0x3F: 11 instructions for the 8 codes of a word."""
    if USE_PRMT:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi, m; mov.b32 m, 0x3F000000; and.b32 lo, $8, 0x0F0F0F0F;"
            " shr.u32 hi, $8, 4; and.b32 hi, hi, 0x0F0F0F0F;"
            " prmt.b32 $0, lo, m, 0x7044; prmt.b32 $1, lo, m, 0x7144;"
            " prmt.b32 $2, lo, m, 0x7244; prmt.b32 $3, lo, m, 0x7344;"
            " prmt.b32 $4, hi, m, 0x7044; prmt.b32 $5, hi, m, 0x7144;"
            " prmt.b32 $6, hi, m, 0x7244; prmt.b32 $7, hi, m, 0x7344; }",
            "=r,=r,=r,=r,=r,=r,=r,=r,r", [p], dtype=(tl.float32, tl.float32), is_pure=True, pack=4,
        )
    byte = p.to(tl.uint8, bitcast=True).to(tl.uint32)
    lo = (((byte & 0xF) << 16) | 0x3F000000).to(tl.float32, bitcast=True)
    hi = (((byte >> 4) << 16) | 0x3F000000).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _int4_gemv_kernel(
    x_ptr, q_ptr, scales_ptr, zeros_ptr, c_ptr, bias_ptr,
    N, K, stride_xk, stride_qn, stride_sn, stride_sg, stride_cn,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_PRMT: tl.constexpr,  # see _nibble_floats
    PDL: tl.constexpr,  # 0, or 1: a programmatic dependent launch (see _pdl_start)
    GROUP_SIZE: tl.constexpr,  # a power of two, 32-256
    BLOCK_N: tl.constexpr, ROW_BYTES: tl.constexpr,  # rows per program, bytes of each row per step
):
    """c (N,) = x (K,) @ dequant(q)^T + bias for one row x and int4 codes: q (N, K // 2) bytes
    (column 2j in the low nibble of byte j, 2j + 1 in the high one), scales and optional zero
    points (N, K // GROUP_SIZE): decode at batch 1. The one-row story of _gemv_kernel (CUDA-core
    FMAs into a float32 tile reduced once after the loop) with a group dimension: a step
    covers ROW_BYTES // (GROUP_SIZE // 2) whole groups of BLOCK_N rows, as a (BLOCK_N, groups,
    GROUP_SIZE // 2) tile of bytes whose low and high nibbles meet the even and odd columns of x.

    The even and odd columns of x are loaded with stride-2 pointers, in another layout than the
    bytes': converting them costs a shared-memory round trip per step (offline sm_90 SASS:
    5.2-8 instructions per code in the loop; loading x's groups contiguously and splitting
    them in registers did not remove the conversion). The loop stays well under the code
    bytes' bandwidth (47% of copy bandwidth at N = 14336 on an H100).

    (Tried and dropped, H100, the Llama-3-8B projections, rotated weight copies in CUDA graphs,
    scratch: a nested loop that applies each group's scale once to a per-group dot, 3.2-3.5
    SASS instructions per code (offline sm_90a) against 6.0-6.8 for this kernel's autotuned
    configs, was faster at K = 4096 with N = 6144 and 14336 (11.2 against 11.4 us, 19.5 against
    22.4) but 8% and 18% slower at N = 4096 with K = 4096 and 14336: a second kernel for one
    shape class, and at best 2.2x cuBLAS bf16 there (the issue's target is 3x).
    Loading the next step's bytes before using the current ones (registers double-buffered) was
    10-17% slower on all four, as in _gemv_kernel; a grid of 48 configs (rows, bytes a step,
    warps, 1-2 stages) found nothing 3% faster than the autotuned pick. Neither fewer
    instructions nor more bytes in flight made it faster. Nsight Compute, H200, the benchmark's
    rows (2026-11-29): at 4096x4096 the autotuned tile holds 254 registers a thread, so at most
    two 4-warp programs an SM, 256 programs, 12% achieved occupancy, stalled on memory (long
    scoreboard) 34% of the cycles, DRAM at 19% of its peak; at 14336x4096 a 72-register tile,
    38% occupancy, long scoreboard 39%, DRAM 29%: latency-bound, with too few warps waiting on
    loads. _weight_only_decode_kernel (tensor cores, x padded to 16 rows) in the same sweep at
    M = 1: from 3% more time to 12% less (14336x4096, 32-row programs over 2 slices: 18.8 against
    21.3 us); not taken up.)

    Dequantization is one FMA per code, exact: with a = 0.5 + code / 256 (_nibble_floats),
    a * (256 s) - (128 + zero) * s = (code - zero) * s. 256 s is exact (a power of two times a
    float16 / bfloat16 scale), (128 + zero) * s has at most 8 + 11 significant bits, so exact in
    float32, and the FMA rounds once a value that is representable: (code - zero) * s.
    """
    HALF: tl.constexpr = GROUP_SIZE // 2
    GROUPS: tl.constexpr = ROW_BYTES // HALF
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_qn = (offs_n % N).to(tl.int64)  # rows past N re-read valid ones (their store is masked)
    _pdl_start(q_ptr + offs_qn * stride_qn, PDL, True)
    offs_g = tl.arange(0, GROUPS)
    offs_b = tl.arange(0, HALF)
    q_ptrs = (q_ptr + offs_qn[:, None, None] * stride_qn
              + tl.max_contiguous(offs_g[None, :, None] * HALF + offs_b[None, None, :], [1, 1, 8]))
    x_ptrs = x_ptr + (offs_g[:, None] * GROUP_SIZE + 2 * offs_b[None, :]) * stride_xk  # even columns
    s_ptrs = offs_qn[:, None] * stride_sn + offs_g[None, :] * stride_sg
    # two accumulators, so that each code costs one FMA to dequantize and one to accumulate
    acc_even = tl.zeros((BLOCK_N, GROUPS, HALF), dtype=tl.float32)
    acc_odd = tl.zeros((BLOCK_N, GROUPS, HALF), dtype=tl.float32)
    n_groups = K // GROUP_SIZE
    for g in range(0, n_groups, GROUPS):
        g_mask = offs_g < n_groups - g
        p = tl.load(q_ptrs, mask=g_mask[None, :, None], other=0)
        s = tl.load(scales_ptr + s_ptrs, mask=g_mask[None, :], other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + s_ptrs, mask=g_mask[None, :], other=0).to(tl.float32)
        else:
            zero = 8.0
        a_lo, a_hi = _nibble_floats(p, USE_PRMT)
        step = (s * 256.0)[:, :, None]
        shift = (-(128.0 + zero) * s)[:, :, None]
        x_even = tl.load(x_ptrs, mask=g_mask[:, None], other=0.0).to(tl.float32)[None, :, :]
        x_odd = tl.load(x_ptrs + stride_xk, mask=g_mask[:, None], other=0.0).to(tl.float32)[None, :, :]
        acc_even += (a_lo * step + shift) * x_even
        acc_odd += (a_hi * step + shift) * x_odd
        q_ptrs += ROW_BYTES
        x_ptrs += 2 * ROW_BYTES * stride_xk
        s_ptrs += GROUPS * stride_sg
    out = tl.sum(tl.sum(acc_even + acc_odd, axis=2), axis=1)
    mask = offs_n < N
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs_n * stride_cn, out.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_rows_kernel(x_ptr, g_ptr, y_ptr, K, stride_xm, stride_xk, eps, BLOCK_K: tl.constexpr,
                          ONE_STEP: tl.constexpr, PDL: tl.constexpr):
    """y[row] = x[row] / sqrt(mean(x[row]^2) + eps) * g, float32 math rounded to y's dtype, one
    program a row; y (M, K) contiguous. rms_norm_linear's first launch at M of 17-64 (see
    ops.RMS_NORM_LINEAR_ROWS_MIN_M): the normalised rows, rounded as the unfused pair rounds
    them, then the plain decode GEMM. ONE_STEP (K <= BLOCK_K): the row stays in registers from
    load to store; longer rows are read a second time (from L2) for the store. PDL (0 or 1): see
    _pdl_start."""
    eps = tl.cast(eps, tl.float32)  # see FLOAT_ARGUMENTS_NOTE
    _pdl_start(x_ptr, PDL, False)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * K
    offs = tl.arange(0, BLOCK_K)
    if ONE_STEP:
        mask = offs < K
        v = tl.load(x_row + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / K + eps)
        tl.store(y_row + offs, (v * rstd * g).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            v = tl.load(x_row + (k + offs) * stride_xk, mask=k + offs < K, other=0.0).to(tl.float32)
            acc += v * v
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / K + eps)
        for k in range(0, K, BLOCK_K):
            mask = k + offs < K
            v = tl.load(x_row + (k + offs) * stride_xk, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + k + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + k + offs, (v * rstd * g).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_sum_of_squares(x_ptr, ssq_ptr, M, K, stride_xm, stride_xk, stride_ssq, K_PER_SPLIT,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row ssq_ptr[split] = sum over this split's K range of x^2, for the rows 0..M-1 of x (one
    BLOCK_M tile covers them: the decode path)."""
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_PER_SPLIT
    k_len = min(K - k_start, K_PER_SPLIT)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        mask = (offs_m < M)[:, None] & (offs_k < k_len - k)[None, :]
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        ssq += tl.sum(x * x, axis=1)
        x_ptrs += BLOCK_K * stride_xk
    tl.store(ssq_ptr + pid_k * stride_ssq + offs_m, ssq, mask=offs_m < M)


@triton.jit(do_not_specialize=_DNS)
def _rms_norm_linear_kernel(
    x_ptr, g_ptr, b_ptr, c_ptr, ssq_ptr, bias_ptr,
    M, N, K,
    M_BUCKET,  # autotune key only
    stride_xm, stride_xk, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_cs, stride_ssq, K_PER_SPLIT, eps,
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,  # split-K: store the raw float32 partial tile (epilogue in the reduce)
    SSQ_BY_DOT: tl.constexpr,  # decode without split-K: x^2 sums from the tensor cores (see below)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """c = rms_norm(x, g) @ b + bias, b = weight^T (K, N), in one pass over K.

    rms_norm(x)[m] @ b = rstd[m] * ((x[m] * g) @ b): the K loop multiplies (x * g) with the
    weight tile, and rstd scales the finished accumulator, so the normalised activations never
    exist in memory.
    - Without split-K (prefill) each program also sums x^2 over the x tiles it loads and forms
      its rows' rstd in the epilogue.
    - With split-K (WRITE_PARTIAL: M <= 16 where the decode plan splits K; see
      ops.RMS_NORM_LINEAR_ROWS_MIN_M for larger M) the grid has one more program per split, the
      last of axis 0, which only sums x^2 over the split's K range; the reduce kernel forms
      rstd. Summing x^2 inside every weight-streaming program's loop made the loop 1.7x slower
      on an H200 (M = 16, N = 6144: 26-28 us against 16 without it).
    - SSQ_BY_DOT (decode, M <= 16, no split: ops.RMS_NORM_LINEAR_DOT_SSQ_MAX_M) each program
      sums x^2 on the tensor cores: a second product x @ x^T per K step, whose diagonal is
      the rows' x^2 sums (the products of 16-bit values are exact, the sums float32). x stays
      in the shared-memory tile the pipeline loaded it into, where squaring it on the CUDA
      cores takes it to registers in another layout every step. H100 sweep at M = 16, N = 6144,
      K = 4096, bf16 (CUDA-graph replays over rotated weights, scratch): 22.5 us against 33-53
      for the CUDA-core sums and 21.7 for the loop without any x^2 (the split path: 24.3; the
      unfused pair 30.1). At M = 64 the second product cost more than the split path saves
      (28.2 against 26.7 us).
    """
    # float32 math under torch.compile too: see FLOAT_ARGUMENTS_NOTE
    eps = tl.cast(eps, tl.float32)
    if WRITE_PARTIAL and tl.program_id(0) == tl.num_programs(0) - 1:
        _split_sum_of_squares(x_ptr, ssq_ptr, M, K, stride_xm, stride_xk, stride_ssq, K_PER_SPLIT, BLOCK_M, BLOCK_K)
    else:
        _, pid_k, offs_m, offs_n, offs_xm, offs_bn, k_start, k_len = _split_k_tile(
            M, N, K, K_PER_SPLIT, BLOCK_M, BLOCK_N, GROUP_M
        )
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_xm[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
        b_ptrs = b_ptr + (k_start + offs_k)[:, None].to(tl.int64) * stride_bk + offs_bn[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        gram = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)  # SSQ_BY_DOT: x @ x^T
        for k in range(0, k_len, BLOCK_K):
            k_mask = offs_k < k_len - k  # a scalar bound: see _split_k_tile
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            g = tl.load(g_ptr + k_start + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
            if SSQ_BY_DOT:
                gram = tl.dot(x, tl.trans(x), gram)
            elif not WRITE_PARTIAL:
                ssq += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
            acc = tl.dot((x.to(tl.float32) * g[None, :]).to(b.dtype), b, acc)
            x_ptrs += BLOCK_K * stride_xk
            b_ptrs += BLOCK_K * stride_bk
        if SSQ_BY_DOT:
            diagonal = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, BLOCK_M)[None, :]
            ssq = tl.sum(tl.where(diagonal, gram, 0.0), axis=1)
        if not WRITE_PARTIAL:
            rstd = 1.0 / tl.sqrt(ssq / K + eps)
            _epilogue_store(
                acc, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
                bias_ptr, bias_ptr, 0, bias_ptr, 0, rstd,
                HAS_BIAS, False, True, "none",
            )
        else:
            _store_partial(acc, c_ptr, pid_k, offs_m, offs_n, M, N, stride_cs, stride_cm)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _matmul_tma_persistent_kernel(
    a_desc, b_desc, c_desc,  # host TensorDescriptors: a (M, K), b (N, K) if B_KMAJOR else (K, N), c (M, N)
    bias_ptr, scale_a_ptr, scale_b_ptr,
    M, N, K,
    M_BUCKET,  # autotune key only
    stride_sa, stride_sb,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, ACTIVATION: tl.constexpr,
    B_KMAJOR: tl.constexpr,  # b is a transposed view of an (N, K) row-major weight (nn.Linear)
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,  # store the tile as two halves: less shared memory, one more stage
    FLATTEN: tl.constexpr,  # let the pipeliner flatten the tile and K loops into one (see the configs)
):
    """Hopper: the same product as `_matmul_kernel` with tensor-memory-accelerator (TMA) loads and
    stores and a persistent grid (one program per SM walking the output tiles), so the
    next tile's loads overlap this tile's epilogue and no launch is paid per tile. TMA zero-fills
    out-of-bounds reads and clips out-of-bounds writes: no masks anywhere."""
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    # A second tile counter for the epilogue (as in Triton's persistent tutorial), so that the
    # pipeliner does not carry one value from the prologue to the epilogue.
    tile_id_c = start_pid - NUM_SMS
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            if B_KMAJOR:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            if HAS_SCALE:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)  # see _matmul_kernel
            else:
                acc = tl.dot(a, b, acc)
        tile_id_c += NUM_SMS
        pid_m, pid_n = _grouped_tile(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _epilogue_math(
            acc, offs_m, offs_n, M, N, bias_ptr, scale_a_ptr, stride_sa, scale_b_ptr, stride_sb, acc,
            HAS_BIAS, HAS_SCALE, False, ACTIVATION,
        )
        out = acc.to(c_desc.dtype)
        if EPILOGUE_SUBTILE:
            halves = tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            c0, c1 = tl.split(halves)
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], c0)
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], c1)
        else:
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out)


# Autotune configs. Prefill (M > 64): the large-tile configs that keep Hopper's / Ampere's
# tensor cores fed (128x256x64 over 8 warps is the usual best on H100 for bf16; 128x128 covers
# narrower N and the 4-warp variant smaller GPUs). Each config compiles once per dtype and
# feature set: the lists are short on purpose (compile time is paid on the first call of every
# new shape bucket, and every config is benchmarked there).
def _cfg(bm, bn, bk, stages, warps, group_m=8):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m}, num_stages=stages, num_warps=warps
    )


PREFILL_CONFIGS = [
    _cfg(128, 256, 64, 3, 8),
    _cfg(128, 128, 64, 4, 8),
    _cfg(128, 128, 64, 4, 4),
]
# float8: twice the K per byte, so BLOCK_K = 128 moves the same bytes per stage.
FP8_PREFILL_CONFIGS = [
    _cfg(128, 256, 128, 3, 8),
    _cfg(128, 128, 128, 4, 8),
]


# cache_results: the winners are stored in Triton's cache directory, so a second process (the
# benchmark after the tests) does not re-tune.
def _autotuned(kernel, configs, key, prune=None):
    return triton.autotune(configs=configs, key=key, cache_results=True,
                           prune_configs_by={"early_config_prune": prune} if prune else None)(kernel)


MATMUL_AUTOTUNE_KEY = ["M_BUCKET", "N", "K", "stride_ak", "stride_bk", "HAS_SCALE"]

_matmul_kernel_prefill = _autotuned(_matmul_kernel, PREFILL_CONFIGS, MATMUL_AUTOTUNE_KEY)
_matmul_kernel_fp8_prefill = _autotuned(_matmul_kernel, FP8_PREFILL_CONFIGS, MATMUL_AUTOTUNE_KEY)


# Decode (M <= 64): the launcher fixes BLOCK_M (the smallest tile covering M), BLOCK_N and the
# split of K; what is left to tune is how deep to pipeline the weight stream.
def _skinny_cfg(bk, stages, warps):
    return triton.Config({"BLOCK_K": bk, "GROUP_M": 1}, num_stages=stages, num_warps=warps)


# H200 sweeps at M = 16 and 64 (bf16 and fp8): 4 warps always; BLOCK_K 256 with 4-5 stages
# led with 16-row tiles, 64-128 with 4 stages with 64-row ones (the autotuner skips a config
# that runs out of shared memory, as BLOCK_K 256 with 5 stages does for 64 x 64 tiles).
# BLOCK_N is part of the key: the launcher picks it per shape (see ops.SKINNY_BLOCK_N).
SKINNY_CONFIGS = [
    _skinny_cfg(64, 4, 4),
    _skinny_cfg(128, 4, 4),
    _skinny_cfg(256, 4, 4),
    _skinny_cfg(256, 5, 4),
]
# The plain skinny GEMM (not the fused rms_norm_linear kernels) also tunes over deeper pipelines
# (BLOCK_K 128 with 5 stages, 256 with 6, and 256 with 3 for 64 x 64 tiles), so that every 16-bit
# tile shape has a config that fills more than half an SM's shared memory (_one_program_per_sm).
SKINNY_DEEP_CONFIGS = [_skinny_cfg(128, 5, 4), _skinny_cfg(256, 3, 4), _skinny_cfg(256, 6, 4)]


def _skinny_shared_bytes(config, block_m: int, block_n: int, itemsize: int) -> int:
    """Shared memory of the skinny GEMM's pipeline under `config`: num_stages - 1 staged copies
    of the a and b tiles (Triton's loop pipeliner). A lower bound: the kernels compiled in the
    H200 sweep of gemm 0.1.22 took this or more (epilogue scratch)."""
    block_k = config.kwargs["BLOCK_K"]
    return (config.num_stages - 1) * (block_m + block_n) * block_k * itemsize


def _one_program_per_sm(configs, named_args, **kwargs):
    """Autotuner pruning of the skinny GEMM: a grid of one wave (at most one program per SM)
    keeps only the configs whose pipeline fills more than half an SM's shared memory, so that
    no SM can hold two of its programs.

    Two on one SM share that SM's load bandwidth while other SMs idle. With dependent launches
    (ops._pdl) the next kernel's programs become resident while ours still run, and where two
    fit an SM the block scheduler stacked them unevenly: rms_norm_linear at M = 24, 4096 x 4096,
    took 18.4 us with the 96 KB config (BLOCK_K 256, 4 stages, 32 x 32 tiles) against 13.1 with
    the 128 KB one (5 stages), whose GEMM alone was level (12.5 against 12.3 us); the autotuner,
    timing the GEMM alone, picked either from process to process. Larger grids keep every
    config (two programs an SM there make one wave of two). Sizes that are not plain ints (a
    torch.compile trace with dynamic shapes) keep every config too."""
    a = named_args["a_ptr"]
    m, n, k, k_per_split = (named_args[name] for name in ("M", "N", "K", "K_PER_SPLIT"))
    if not all(type(v) is int for v in (m, n, k, k_per_split)):
        return configs
    block_m, block_n = kwargs["BLOCK_M"], kwargs["BLOCK_N"]
    props = torch.cuda.get_device_properties(a.device)
    if triton.cdiv(m, block_m) * triton.cdiv(n, block_n) * triton.cdiv(k, k_per_split) > props.multi_processor_count:
        return configs
    alone = skinny_configs_alone_on_an_sm(configs, block_m, block_n, a.element_size(),
                                          props.shared_memory_per_multiprocessor)
    return alone or configs


def skinny_configs_alone_on_an_sm(configs, block_m: int, block_n: int, itemsize: int, sm_shared_bytes: int) -> list:
    """The configs of which no SM (of sm_shared_bytes of shared memory) holds two programs with
    these tiles. Empty for float8 tiles of at most 32 x 64 (half the bytes of 16-bit ones)."""
    return [c for c in configs if 2 * _skinny_shared_bytes(c, block_m, block_n, itemsize) > sm_shared_bytes]


SKINNY_KEY = ["M_BUCKET", "N", "K", "K_PER_SPLIT", "BLOCK_N"]

# One-row GEMV (M = 1): BLOCK_K = 256 x num_warps (or twice that) keeps every thread on 8
# columns (see _gemv_kernel). H200 sweep (bf16 weights and int8 codes, the Llama-3-8B
# projections, CUDA-graph replays): 4 rows per program led everywhere, these configs within 2%
# of each other; 16-32 rows and 8 warps were slower, the pipelining depth made no difference.
GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_stages=1, num_warps=w)
    for bn, bk, w in ((4, 512, 2), (4, 1024, 2), (4, 1024, 4), (4, 2048, 4), (8, 1024, 4))
]
_gemv_kernel_tuned = _autotuned(_gemv_kernel, GEMV_CONFIGS, ["N", "K", "HAS_ZEROS", "HAS_NORM"])
# int4 GEMV: rows per program, bytes of each row per step and warps; H200 sweep (group 128,
# the Llama-3-8B projections, CUDA-graph replays; run with one accumulator, before the kernel
# got its two): the leaders of each shape, symmetric or not.
INT4_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "ROW_BYTES": rb}, num_stages=1, num_warps=w)
    for bn, rb, w in ((16, 512, 4), (8, 512, 2), (8, 256, 4), (16, 256, 4), (16, 128, 4))
]
_int4_gemv_kernel_tuned = _autotuned(_int4_gemv_kernel, INT4_GEMV_CONFIGS, ["N", "K", "HAS_ZEROS", "GROUP_SIZE"])
_matmul_kernel_skinny = _autotuned(_matmul_kernel, SKINNY_CONFIGS + SKINNY_DEEP_CONFIGS, [*SKINNY_KEY, "HAS_SCALE"],
                                   _one_program_per_sm)
_rms_norm_linear_kernel_skinny = _autotuned(_rms_norm_linear_kernel, SKINNY_CONFIGS, SKINNY_KEY)
_rms_norm_linear_kernel_decode = _autotuned(_rms_norm_linear_kernel, SKINNY_CONFIGS, SKINNY_KEY)  # SSQ_BY_DOT
_rms_norm_linear_kernel_prefill = _autotuned(_rms_norm_linear_kernel, PREFILL_CONFIGS, ["M_BUCKET", "N", "K"])


# TMA persistent (Hopper). The descriptors' block shapes follow the config: the pre-hook sets them
# before every launch (and every autotuning trial).
def _tma_block_shapes(nargs):
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_KMAJOR"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn // 2 if nargs["EPILOGUE_SUBTILE"] else bn]


def _tma_cfg(bm, bn, bk, stages, warps, subtile, flatten=True):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "EPILOGUE_SUBTILE": subtile, "FLATTEN": flatten},
        num_stages=stages, num_warps=warps, pre_hook=_tma_block_shapes,
    )


# 128x256 tiles over two consumer warpgroups (8 warps) is the shape cuBLAS picks on H100/H200 for
# large bf16 GEMMs; the sub-tiled epilogue frees the shared memory for a 4th stage.
TMA_CONFIGS = [
    _tma_cfg(128, 256, 64, 3, 8, True),
    _tma_cfg(128, 256, 64, 4, 8, True),
    _tma_cfg(128, 128, 64, 4, 8, False),
]
# float8 with the float32 promotion after every BLOCK_K (see _matmul_kernel): the promotion keeps a
# second (BLOCK_M, BLOCK_N) float32 accumulator live and adds it into the first once a tile,
# which 128x256 tiles pay for most. H200 sweeps (M8192 N8192 K8192 and M4096 N14336 K4096, tiles
# {128x256, 256x128, 128x128} x BLOCK_K {64, 128} x stages x warps x sub-tiled epilogue x GROUP_M
# {4, 8, 16} x flattened loops, promotion every 64 or 128): 256x128x128 over 8 warps with 4
# stages, the sub-tiled epilogue (without it 4 stages do not fit) and the loops left unflattened
# led both shapes, 973 / 509 us against 1312 / 760 us for the best of the earlier 128x256 /
# 128x128 list (flattened, as the bf16 configs are); without the promotion (torch's fast
# accumulation, 3x the error) 128x256 tiles took 768 / 399 us.
# The same tiles with 3 stages are gone from the list: never faster, and the autotuner's timings of
# the two are close enough that it picked 3 stages in 6 of 12 tunings, 1.4-8% slower (H200
# scratch, four tunings a shape: 8192^3 1130 against 1047 us, 4096x14336x4096 row-scaled 499
# against 466). Also tried there and dropped: Triton 3.6's warp specialization on Hopper
# (tl.range(..., warp_specialize=True)), 1020 against 1024 us at 8192^3, 465 against 463 at
# 4096x14336x4096; the promotion written out as a fresh product per K tile added in float32,
# 1135-1173 us at 8192^3, or two in flight, out of shared memory past 2 stages.
FP8_TMA_CONFIGS = [
    _tma_cfg(256, 128, 128, 4, 8, True, flatten=False),
    _tma_cfg(128, 256, 128, 3, 8, True),
]
TMA_KEY = ["M_BUCKET", "N", "K", "B_KMAJOR", "HAS_SCALE"]
_matmul_tma_kernel = _autotuned(_matmul_tma_persistent_kernel, TMA_CONFIGS, TMA_KEY)
_matmul_tma_kernel_fp8 = _autotuned(_matmul_tma_persistent_kernel, FP8_TMA_CONFIGS, TMA_KEY)
