"""Triton kernels of the MLP activations over (n_rows, n_cols) views with unit column stride.

Every kernel here is element-wise (plus one column reduction for the bias gradient), so each
is bound by memory traffic: the only goal is to read every input once and write every output
once, in wide vector accesses. One program covers a BLOCK_M x BLOCK_N tile; row offsets are
64-bit so tensors beyond 2**31 elements cannot wrap (the bias_gelu forward's only where they
must be). Rows have their own stride per tensor, which is how padded rows and the two halves
of a packed [gate | up] tensor are read in place; contiguous tensors come as one row of numel
elements (the launcher's flat tiles).

Math is float32 whatever the storage dtype, with a single rounding on the store.

ACTIVATION selects the gate's activation at compile time (the other branches are removed):
SILU, GELU (exact erf form) or GELU_TANH (the tanh approximation).
"""

import triton
import triton.language as tl

from kernel_lab.shared.partial_sums import sum_if_last

SILU: tl.constexpr = tl.constexpr(0)
GELU: tl.constexpr = tl.constexpr(1)
GELU_TANH: tl.constexpr = tl.constexpr(2)

RSQRT_2PI: tl.constexpr = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi), the normal density's scale
SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)
TANH_COEF: tl.constexpr = tl.constexpr(0.044715)
HALF_RSQRT_2: tl.constexpr = tl.constexpr(0.3535533905932738)  # 1 / (2 sqrt(2))
HALF_LOG2E: tl.constexpr = tl.constexpr(0.7213475204444817)  # log2(e) / 2
# The Chebyshev-fitted erfc of Numerical Recipes (Press et al., 2nd ed., section 6.2):
# erfc(z) ~= t * exp(P(t) - z^2), t = 1 / (1 + z / 2), P(t) = sum c_i t^i, with a fractional
# error below 1.2e-7 for every z >= 0.
ERFC_P = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
          0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)  # fmt: skip
# The same form with a degree-5 P, for results stored in 16 bits: a minimax fit (numpy, for
# this package) over t in [0.17, 1], i.e. every z whose tail is a normal float32, with an error
# below 7.7e-6 in P, so Phi's relative error is below 2e-5 in float32 arithmetic, 1/25 of
# float16's half ulp and 1/100 of bfloat16's. Four FMAs fewer per element than ERFC_P.
ERFC16_P = (-1.26654174, 1.01801332, 0.25444411, 0.47449145, -0.70918931, 0.22878978)


def _tail_form(p: tuple) -> tl.constexpr:
    """Q = P * log2(e) - 1, so that t * exp2(Q(t) - z^2 log2(e)) is erfc(z) / 2, the normal
    tail, with no multiply around the exp2. One tuple constexpr, not one global per coefficient:
    each launch checks every constexpr global its kernel reads for changes, about a microsecond
    of host time apiece."""
    return tl.constexpr(tuple(c * 1.4426950408889634 - (1.0 if i == 0 else 0.0) for i, c in enumerate(p)))


ERFC_Q, ERFC16_Q = _tail_form(ERFC_P), _tail_form(ERFC16_P)


@triton.jit
def _normal_cdf(x, FLOAT32_OUT: tl.constexpr):
    """Phi(x) = 0.5 * (1 + erf(x / sqrt(2))) in float32, from the upper tail 0.5 * erfc(|x| / sqrt(2)).
    FLOAT32_OUT: the result is stored in float32 and needs ERFC_P's accuracy; otherwise it is
    rounded to 16 bits and the cheaper ERFC16_P is far below that rounding.

    Why not tl.erf: libdevice's erff (two polynomials and a select) made bias_gelu's forward
    compile to more SASS instructions per element than an H200 can issue per element while
    moving its 4 bytes at copy bandwidth, so the kernel was bound by instruction issue, not
    memory (tests/test_compiled_code.py counts them). ERFC_P instead: one reciprocal, one exp2
    and nine FMAs, fractional error below 1.2e-7 (the float32 evaluation adds the rounding of
    the exponent x^2 * log2(e) / 2, a relative error growing with x^2 below x = -2: about 1e-6
    at x = -4, 9e-6 at x = -12). Taking the tail directly also avoids the cancellation of
    1 + erf(x) for negative x, so Phi keeps its value down the left tail, where
    0.5 * (1 + erf) is 0.
    """
    # erfc(z) ~= t * exp(P(t) - z^2), t = 1 / (1 + z / 2), z = |x| / sqrt(2); evaluated as
    # t * exp2(Q(t) - x^2 * log2(e) / 2), Q = P * log2(e) - 1 (see ERFC_Q).
    # t as rsqrt(d * d) rather than 1 / d: `/` compiles to a reciprocal guarded by range checks
    # and rescaling (8 SASS instructions), rsqrt to one MUFU.RSQ; d >= 1, so the guards were
    # dead, and rsqrt's relative error (about 2**-23) is below the fit's. For |x| > 5e19, d * d
    # overflows to inf and t to 0, which is the right limit (the tail is 0 there anyway).
    d = 1.0 + tl.abs(x) * HALF_RSQRT_2
    t = tl.math.rsqrt(d * d)
    if FLOAT32_OUT:
        q = ERFC_Q[9] * t + ERFC_Q[8]
        q = q * t + ERFC_Q[7]
        q = q * t + ERFC_Q[6]
        q = q * t + ERFC_Q[5]
        q = q * t + ERFC_Q[4]
        q = q * t + ERFC_Q[3]
        q = q * t + ERFC_Q[2]
        q = q * t + ERFC_Q[1]
        q = q * t + ERFC_Q[0]
    else:
        q = ERFC16_Q[5] * t + ERFC16_Q[4]
        q = q * t + ERFC16_Q[3]
        q = q * t + ERFC16_Q[2]
        q = q * t + ERFC16_Q[1]
        q = q * t + ERFC16_Q[0]
    tail = t * tl.math.exp2(q - x * x * HALF_LOG2E)  # P(N(0, 1) > |x|)
    return tl.where(x >= 0.0, 1.0 - tail, tail)


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr, FLOAT32_OUT: tl.constexpr):
    """act(x) in float32; FLOAT32_OUT as in _normal_cdf."""
    if ACTIVATION == SILU:
        return x * tl.sigmoid(x)
    elif ACTIVATION == GELU:
        return x * _normal_cdf(x, FLOAT32_OUT)
    else:
        # 0.5 * (1 + tanh(z)) == sigmoid(2 z): no tanh needed, and no cancellation near z = 0
        z = SQRT_2_OVER_PI * (x + TANH_COEF * x * x * x)
        return x * tl.sigmoid(2.0 * z)


@triton.jit
def _activation_and_grad(x, ACTIVATION: tl.constexpr, FLOAT32_OUT: tl.constexpr):
    """(act(x), act'(x)) in float32, sharing the transcendental between the two; FLOAT32_OUT as
    in _normal_cdf."""
    if ACTIVATION == SILU:
        s = tl.sigmoid(x)
        act = x * s
        grad = s + act * (1.0 - s)
    elif ACTIVATION == GELU:
        cdf = _normal_cdf(x, FLOAT32_OUT)
        act = x * cdf
        grad = cdf + x * RSQRT_2PI * tl.math.exp2(-HALF_LOG2E * x * x)  # phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
    else:
        z = SQRT_2_OVER_PI * (x + TANH_COEF * x * x * x)
        s = tl.sigmoid(2.0 * z)  # = 0.5 * (1 + tanh(z))
        act = x * s
        # d/dx [x * sigmoid(2z)] = s + x * 2 s (1 - s) * dz/dx
        grad = s + 2.0 * act * (1.0 - s) * SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_COEF * x * x)
    return act, grad


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row indices (int64), column indices and the in-bounds mask of this program's tile, on a
    1-D grid over the tiles in row-major order (one grid axis: no 65535 limit on either count)."""
    col_blocks = tl.cdiv(N, BLOCK_N)
    rows = (tl.program_id(0) // col_blocks).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tl.program_id(0) % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows, cols, mask


@triton.jit
def _gated_fwd_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    M,
    N,
    stride_gate,  # row strides in elements, one per tensor
    stride_up,
    stride_out,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out = act(gate) * up."""
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    g = tl.load(gate_ptr + rows[:, None] * stride_gate + cols[None, :], mask=mask).to(tl.float32)
    u = tl.load(up_ptr + rows[:, None] * stride_up + cols[None, :], mask=mask).to(tl.float32)
    y = _activation(g, ACTIVATION, out_ptr.dtype.element_ty == tl.float32) * u
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(
    gate_ptr,
    up_ptr,
    dy_ptr,
    dgate_ptr,
    dup_ptr,
    M,
    N,
    stride_gate,  # row strides in elements, one per tensor
    stride_up,
    stride_dy,
    stride_dgate,
    stride_dup,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dgate = dy * up * act'(gate), dup = dy * act(gate).

    The activation is recomputed from gate rather than saved by the forward: one fewer
    tensor to keep alive and no extra traffic (gate is read here anyway).
    """
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    g = tl.load(gate_ptr + rows[:, None] * stride_gate + cols[None, :], mask=mask).to(tl.float32)
    u = tl.load(up_ptr + rows[:, None] * stride_up + cols[None, :], mask=mask).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask).to(tl.float32)
    act, grad = _activation_and_grad(g, ACTIVATION, dgate_ptr.dtype.element_ty == tl.float32)
    dg = dy * u * grad
    du = dy * act
    tl.store(dgate_ptr + rows[:, None] * stride_dgate + cols[None, :], dg.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + rows[:, None] * stride_dup + cols[None, :], du.to(dup_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_fwd_kernel(
    x_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_x,  # row strides in elements, one per tensor
    stride_out,
    ACTIVATION: tl.constexpr,  # GELU or GELU_TANH
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OFFSETS_64: tl.constexpr,  # some element lies 2**31 or more elements past its tensor's start
):
    """out = gelu(x + bias); bias is one row, broadcast over the BLOCK_M rows of the tile.

    Grid: axis 0 the column blocks, axes 1 and 2 the row blocks (row block = axis 2 x the
    programs of axis 1 + axis 1, so more than axis 1's 65535 fit). Unlike `_tile`: no division
    of the program id, and 32-bit offsets unless OFFSETS_64. The exact GELU leaves this kernel
    few spare issue slots per element, and 64-bit offsets (per element or only for the tile's
    first row alike) cost 5-7% of its bandwidth on an H200 (bf16, 4096 x 11008 and
    16384 x 14336: 49.2 / 237.3 us against 45.9 / 223.6 with 32-bit offsets).
    """
    row_block = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    if OFFSETS_64:
        rows = row_block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    else:
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    b = tl.load(bias_ptr + cols, mask=cols < N).to(tl.float32)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask).to(tl.float32)
    y = _activation(x + b[None, :], ACTIVATION, out_ptr.dtype.element_ty == tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    x_ptr,
    bias_ptr,
    dy_ptr,
    dx_ptr,
    dbias_part_ptr,
    dbias_ptr,  # FUSED_SUM only, as is arrivals_ptr
    arrivals_ptr,
    M,
    N,
    stride_x,  # row strides in elements, one per tensor
    stride_dy,
    stride_dx,
    ROWS_PER_PROGRAM,  # rows of one program's chunk, a multiple of BLOCK_M
    ACTIVATION: tl.constexpr,  # GELU or GELU_TANH
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipelining depth of the row loop
    FUSED_SUM: tl.constexpr,
    SUM_ROWS: tl.constexpr,  # partial rows per step of the fused sum
):
    """dx = dy * gelu'(x + bias) and this chunk's column sums of dx.

    Program (i, j) walks rows [i * ROWS_PER_PROGRAM, (i + 1) * ROWS_PER_PROGRAM) of column
    block j, keeping the running column sum in float32 registers, and writes it to row i of
    the (n_chunks, N) float32 partials. Then either the launcher adds the partial rows
    (sum_partials), or, FUSED_SUM, the chunk of column block j that finishes last adds them and
    writes dbias[block j] (sum_if_last; arrivals_ptr holds one zeroed counter per column
    block). Either way in a fixed order: dbias is deterministic.
    """
    row_start = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    b = tl.load(bias_ptr + cols, mask=col_mask).to(tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for off in tl.range(0, ROWS_PER_PROGRAM, BLOCK_M, num_stages=STAGES):
        rows = row_start + off + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask).to(tl.float32)
        _, grad = _activation_and_grad(x + b[None, :], ACTIVATION, dx_ptr.dtype.element_ty == tl.float32)
        dx = tl.where(mask, dy * grad, 0.0)  # masked lanes hold garbage: keep them out of the sum
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        acc += tl.sum(dx, axis=0)
    tl.store(dbias_part_ptr + tl.program_id(0).to(tl.int64) * N + cols, acc, mask=col_mask)
    if FUSED_SUM:
        sum_if_last(dbias_part_ptr, dbias_ptr, arrivals_ptr + tl.program_id(1), tl.num_programs(0), N, cols, SUM_ROWS)
