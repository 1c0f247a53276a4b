"""Triton kernels of RMSNorm (plain, residual-fused, gated) and LayerNorm over the last dim of
a (n_rows, n_cols) view whose columns have unit stride and rows any stride.

Forward, one kernel per family:
- `_rms_norm_fwd_kernel`: y = x * rstd * (offset + w) [* silu(gate)], with u = x + residual
  written on the way when HAS_RESIDUAL; rstd per row is saved for the backward.
- `_layer_norm_fwd_kernel`: y = (x - mean) * rstd * w + b; mean and rstd saved.
Each runs in one of two shapes (ONE_TILE): a row that fits in registers is read once, BLOCK_M
rows per program; a longer row is looped over twice (statistics, then output), one row at a
time per program, the rows strided over a grid the launcher may cap at a few programs per SM
so that the second read of the rows in flight is served from L2. On CUDA a longer row takes
the third shape instead, `*_fwd_coop_kernel`: the row is cut into chunks across programs that
exchange their statistics (kernel_lab.shared.coop) and each read their chunk twice, the second
time from L2, so that many programs share each row.

Backward, three kernels per family:
- `*_bwd_kernel`: a row fits in registers. A persistent grid (a few programs per SM) walks
  row blocks; each program keeps its share of dweight (and dbias) in registers and writes one
  row of a (n_programs, n_cols) float32 buffer of partial sums at the end, which the launcher
  reduces with one sum: no atomics, and the buffer is small next to the inputs. What keeps
  DRAM busy across each row block's reduction differs: RMSNorm reads its tile twice (the
  second read from L1/L2) so that few values live across the reduction; LayerNorm, which
  holds more per row, loads the next row block before reducing the current one.
- `*_bwd_wide_kernel`: a row too long for registers. Each program owns a contiguous block of
  rows. Phase 1 computes each row's reductions (the "dot" terms of the dx formula) into a
  small float32 buffer; phase 2 walks column chunks and, within a chunk, the block's rows, so
  that chunk's dweight partial stays in registers. x and dy are read twice (10 instead of 6
  bytes per bf16 element): the price of a dweight without atomics or L2-sized scratch. It runs
  where the third does not: the interpreter, the gated RMSNorm (slower there), rows of more
  chunks than SMs.
- `*_bwd_coop_kernel` (CUDA): a row too long for registers (for LayerNorm, also one its
  one-tile kernel would read twice), read once. Groups of programs, one
  per column chunk, walk blocks of rows together, exchanging each row's dot terms
  (kernel_lab.shared.coop); each program keeps its chunk's dweight in registers across its rows.

All statistics and sums are float32 whatever the input dtype; masked lanes load 0 so that they
add nothing to any sum.
"""

import triton
import triton.language as tl

from kernel_lab.shared.coop import coop_publish_and_gather, coop_ticket, coop_word_hi, coop_word_lo
from kernel_lab.shared.vector_hints import multiple_of

# FLOAT_ARGUMENTS_NOTE: inductor passes a Python float argument (eps, offset) to a user kernel
# as float64, where an eager launch passes float32; float64 scalars would promote the per-element
# math to float64 (offline sm_90 compile of the RMSNorm forward: 100 f64 PTX instructions
# against none). Each kernel casts its float arguments to float32 first.

# ---------------------------------------------------------------------------------------------
# RMSNorm family: y = x * rstd * (offset + w) [* silu(gate)], rstd = 1 / sqrt(mean(x^2) + eps)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rms_load_input(
    x_ptr, res_ptr, u_ptr, rows, cols, mask,
    stride_x_row, stride_res_row, stride_u_row,
    HAS_RESIDUAL: tl.constexpr,
    STORE_U: tl.constexpr,  # write u = x + residual (the first pass over the row only)
    EVICTION: tl.constexpr,  # L2 eviction policy of the loads ("": the default)
):
    """The [BLOCK_M, BLOCK_N] tile the norm is taken of, in float32: x, or x + residual."""
    x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0,
                eviction_policy=EVICTION).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_res_row + cols[None, :], mask=mask, other=0.0,
                    eviction_policy=EVICTION)
        x += r.to(tl.float32)
        if STORE_U:
            u_ptrs = u_ptr + rows[:, None] * stride_u_row + cols[None, :]
            tl.store(u_ptrs, x.to(u_ptr.dtype.element_ty), mask=mask)
    return x


@triton.jit
def _rms_weight_values(ptr, cols, n_cols, PRESENT: tl.constexpr):
    """RMSNorm's weight of these columns in float32, 0.0 where absent (the caller's flag then
    leaves it unused)."""
    if PRESENT:
        return tl.load(ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    else:
        return 0.0


@triton.jit
def _rms_store_output(
    x, rstd, w, gate_ptr, y_ptr, rows, cols, mask, offset,
    stride_gate_row, stride_y_row,
    HAS_WEIGHT: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    """y = x * rstd * (offset + w) * silu(gate), stored in y's dtype; w: `_rms_weight_values`."""
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * (offset + w)[None, :]
    if HAS_GATE:
        z = tl.load(gate_ptr + rows[:, None] * stride_gate_row + cols[None, :], mask=mask, other=0.0)
        z = z.to(tl.float32)
        y = y * (z * tl.sigmoid(z))
    tl.store(y_ptr + rows[:, None] * stride_y_row + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, res_ptr, gate_ptr, w_ptr,  # inputs; res/gate/w are unused unless their flag is set
    y_ptr, u_ptr, rstd_ptr,  # outputs: y, u = x + residual (HAS_RESIDUAL), rstd (n_rows,) f32
    n_rows, n_cols, eps, offset,
    stride_x_row, stride_res_row, stride_gate_row, stride_y_row, stride_u_row,
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_GATE: tl.constexpr,
    ONE_TILE: tl.constexpr,  # BLOCK_N >= n_cols: the row is held in registers, read once
    BLOCK_M: tl.constexpr,  # rows per program (ONE_TILE only)
    BLOCK_N: tl.constexpr,  # columns per tile: next power of two >= n_cols, or the loop step
    ALIGN: tl.constexpr,  # divides n_cols and the row strides (kernel_lab.shared.vector_hints)
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_res_row = multiple_of(stride_res_row, ALIGN)
    stride_gate_row = multiple_of(stride_gate_row, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    stride_u_row = multiple_of(stride_u_row, ALIGN)
    # float32 math under torch.compile too: see FLOAT_ARGUMENTS_NOTE
    eps, offset = tl.cast(eps, tl.float32), tl.cast(offset, tl.float32)
    if ONE_TILE:
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        # The weight is loaded before the row reduction, not after: its load's latency (an L2
        # hit) then overlaps the tile's instead of following the reduction. H200, bf16, 2**26
        # elements, CUDA-graph replays alternated, one run before and two after (scratch):
        # 16384 x 4096 66.2-66.5 -> 64.4-65.4 us (Liger 64.6-65.4), 8192 x 8192 65.8-66.2 ->
        # 64.4-65.1 (torch.compile 65.2-66.0), 4096 x 16384 68.0-68.1 -> 66.0-66.6 (Liger
        # 66.5-67.2). Not with a gate, which the tile also holds: the gated forward at
        # 16384 x 4096 went from 101.1 to 107.0 us so (H200 histories 0081, 0082).
        if HAS_GATE:
            w = 0.0  # (loaded below; Triton wants the name bound on both branches)
        else:
            w = _rms_weight_values(w_ptr, cols, n_cols, HAS_WEIGHT)
        x = _rms_load_input(x_ptr, res_ptr, u_ptr, rows, cols, mask,
                            stride_x_row, stride_res_row, stride_u_row, HAS_RESIDUAL, True, EVICTION="")
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        if HAS_GATE:
            w = _rms_weight_values(w_ptr, cols, n_cols, HAS_WEIGHT)
        _rms_store_output(x, rstd, w, gate_ptr, y_ptr, rows, cols, mask, offset,
                          stride_gate_row, stride_y_row, HAS_WEIGHT, HAS_GATE)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    else:
        # rows strided over the grid: the launcher may cap the grid at a few programs per SM so
        # that the rows in flight (re-read by the second pass) fit in L2
        for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
            rows = (row + tl.arange(0, 1)).to(tl.int64)
            # elementwise accumulation, one tree reduction at the end: better rounding than
            # reducing each chunk to a scalar and adding scalars
            acc = tl.zeros([1, BLOCK_N], tl.float32)
            for off in range(0, n_cols, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                mask = (cols < n_cols)[None, :]
                x = _rms_load_input(x_ptr, res_ptr, u_ptr, rows, cols, mask,
                                    stride_x_row, stride_res_row, stride_u_row, HAS_RESIDUAL, True, EVICTION="")
                acc += x * x
            rstd = tl.rsqrt(tl.sum(acc, axis=1) / n_cols + eps)
            for off in range(0, n_cols, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                mask = (cols < n_cols)[None, :]
                # re-add x + residual rather than re-read the rounded u: the same float32 values
                # as the one-tile path, so the result does not depend on the row length
                x = _rms_load_input(x_ptr, res_ptr, u_ptr, rows, cols, mask,
                                    stride_x_row, stride_res_row, stride_u_row, HAS_RESIDUAL, False, EVICTION="")
                w = _rms_weight_values(w_ptr, cols, n_cols, HAS_WEIGHT)
                _rms_store_output(x, rstd, w, gate_ptr, y_ptr, rows, cols, mask, offset,
                                  stride_gate_row, stride_y_row, HAS_WEIGHT, HAS_GATE)
            tl.store(rstd_ptr + rows, rstd)


@triton.jit(do_not_specialize=["clear_len"])  # (it varies between calls of one launch plan)
def _rms_norm_fwd_coop_kernel(
    x_ptr, res_ptr, gate_ptr, w_ptr, y_ptr, u_ptr, rstd_ptr,  # as _rms_norm_fwd_kernel's
    n_rows, n_cols, eps, offset,
    stride_x_row, stride_res_row, stride_gate_row, stride_y_row, stride_u_row,
    sync_ptr,  # kernel_lab.shared.coop.workspace
    clear_ptr, clear_len,  # the previous launch's scratch, zeroed here (coop.workspace)
    n_splits,  # chunks per row
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_GATE: tl.constexpr,
    CHUNK: tl.constexpr,  # columns per program
    BLOCK_N: tl.constexpr,  # columns per step of its two passes over them
    SPLITS_POW2: tl.constexpr,  # next power of two >= n_splits
    ALIGN: tl.constexpr,  # divides n_cols and the row strides (kernel_lab.shared.vector_hints)
):
    """The forward of a row too long for one program, in one launch (CUDA only): each program
    takes one CHUNK of a row (kernel_lab.shared.coop), sums its squares, publishes the sum,
    waits for the row's other chunks and writes its chunk. It reads the chunk twice, the first
    time keeping the lines in L2 (evict_last) so that the second read comes from there: x (and
    the residual) leave HBM once."""
    n_cols = multiple_of(n_cols, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_res_row = multiple_of(stride_res_row, ALIGN)
    stride_gate_row = multiple_of(stride_gate_row, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    stride_u_row = multiple_of(stride_u_row, ALIGN)
    # float32 math under torch.compile too: see FLOAT_ARGUMENTS_NOTE
    eps, offset = tl.cast(eps, tl.float32), tl.cast(offset, tl.float32)
    row, split = coop_ticket(sync_ptr, n_splits, clear_ptr, clear_len)
    rows = row + tl.arange(0, 1)
    start = split * CHUNK
    tl.static_assert(CHUNK % ALIGN == 0)
    end = multiple_of(tl.minimum(start + CHUNK, n_cols), ALIGN)
    # each step's sum of squares reduced at once (the looped kernel's elementwise accumulator
    # would hold BLOCK_N more float32 values a program: fewer programs per SM; a scratch H200
    # sweep of this design at 1024 x 65536: 92.2 against 83.7 us)
    sum_sq = tl.zeros([1], tl.float32)
    for off in range(start, end, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = (cols < end)[None, :]
        x = _rms_load_input(x_ptr, res_ptr, u_ptr, rows, cols, mask, stride_x_row, stride_res_row, stride_u_row,
                            HAS_RESIDUAL, True, EVICTION="evict_last")
        sum_sq += tl.sum(x * x, axis=1)
    # hi = 1.0 keeps the word non-zero whatever the chunk's sum
    words = coop_publish_and_gather(sync_ptr, n_rows, row, split, n_splits, tl.sum(sum_sq, axis=0),
                                    tl.full([], 1.0, tl.float32), SPLITS_POW2)
    row_sum_sq = tl.sum(tl.where(tl.arange(0, SPLITS_POW2) < n_splits, coop_word_lo(words), 0.0), axis=0)
    rstd = tl.rsqrt(row_sum_sq / n_cols + eps) + tl.zeros([1], tl.float32)
    for off in range(start, end, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = (cols < end)[None, :]
        x = _rms_load_input(x_ptr, res_ptr, u_ptr, rows, cols, mask, stride_x_row, stride_res_row, stride_u_row,
                            HAS_RESIDUAL, False, EVICTION="evict_first")
        w = _rms_weight_values(w_ptr, cols, n_cols, HAS_WEIGHT)
        _rms_store_output(x, rstd, w, gate_ptr, y_ptr, rows, cols, mask, offset,
                          stride_gate_row, stride_y_row, HAS_WEIGHT, HAS_GATE)
    if split == 0:
        tl.store(rstd_ptr + rows, rstd)


@triton.jit
def _rms_bwd_terms(
    dy_ptr, x_ptr, gate_ptr, dgate_ptr, w_ptr, rows, cols, mask, rstd, n_cols, offset,
    stride_dy_row, stride_x_row, stride_gate_row, stride_dgate_row,
    HAS_WEIGHT: tl.constexpr,
    HAS_GATE: tl.constexpr,
    STORE_DGATE: tl.constexpr,  # write dgate (one of the passes over the row only)
    EVICTION: tl.constexpr,  # eviction policy of the tile loads ("": the default)
):
    """(xhat, dn, g) of one tile: xhat = x * rstd, dn = the gradient reaching the normalized
    value before the weight (dy, times silu(gate) when gated), g = dn * (offset + w).
    Gated: dgate = dy * xhat * (offset + w) * s * (1 + z * (1 - s)), s = sigmoid(z)."""
    x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0,
                eviction_policy=EVICTION).to(tl.float32)
    dn = tl.load(dy_ptr + rows[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0,
                 eviction_policy=EVICTION)
    dn = dn.to(tl.float32)
    xhat = x * rstd[:, None]
    if HAS_WEIGHT:
        w = (offset + tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32))[None, :]
    else:
        w = tl.full([1, 1], 1.0, tl.float32)
    if HAS_GATE:
        z = tl.load(gate_ptr + rows[:, None] * stride_gate_row + cols[None, :], mask=mask, other=0.0,
                    eviction_policy=EVICTION)
        z = z.to(tl.float32)
        s = tl.sigmoid(z)
        if STORE_DGATE:
            dz = dn * xhat * w * s * (1.0 + z * (1.0 - s))
            tl.store(dgate_ptr + rows[:, None] * stride_dgate_row + cols[None, :],
                     dz.to(dgate_ptr.dtype.element_ty), mask=mask)
        dn = dn * z * s
    return xhat, dn, dn * w


@triton.jit
def _rms_store_dx(
    xhat, g, dot, rstd, du_ptr, dx_ptr, rows, cols, mask,
    stride_du_row, stride_dx_row,
    HAS_DU: tl.constexpr,
):
    """dx = rstd * (g - xhat * dot) [+ du], dot = mean(g * xhat) over the row."""
    dx = (g - xhat * dot[:, None]) * rstd[:, None]
    if HAS_DU:
        du = tl.load(du_ptr + rows[:, None] * stride_du_row + cols[None, :], mask=mask, other=0.0)
        dx += du.to(tl.float32)
    tl.store(dx_ptr + rows[:, None] * stride_dx_row + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, gate_ptr, w_ptr, rstd_ptr, du_ptr,  # x: the normalized input (u if residual)
    dx_ptr, dgate_ptr, dw_partial_ptr,  # dw_partial: (n_programs, n_cols) float32
    n_rows, n_cols, offset,
    stride_dy_row, stride_x_row, stride_gate_row, stride_du_row, stride_dx_row, stride_dgate_row,
    HAS_WEIGHT: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_DU: tl.constexpr,  # add the incoming gradient of u = x + residual to dx
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols
    ALIGN: tl.constexpr,  # divides n_cols and the row strides (kernel_lab.shared.vector_hints)
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_dy_row = multiple_of(stride_dy_row, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_gate_row = multiple_of(stride_gate_row, ALIGN)
    stride_du_row = multiple_of(stride_du_row, ALIGN)
    stride_dx_row = multiple_of(stride_dx_row, ALIGN)
    stride_dgate_row = multiple_of(stride_dgate_row, ALIGN)
    # float32 math under torch.compile too: see FLOAT_ARGUMENTS_NOTE
    offset = tl.cast(offset, tl.float32)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for block in tl.range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        # int32 is enough for a row index; the int64 cast keeps rows * stride from wrapping
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        # Two touches of the tile: the first only for the row's dot, the second (served by L1/L2,
        # DRAM is read once) for dx and dweight. Re-reading instead of keeping x and dy in
        # registers across the row reduction lowers the registers a thread needs, so more rows
        # are in flight per SM and wide rows do not spill (H200 sweep: faster from 2048 to 16384
        # columns, most at 8192 and 16384). The two eviction policies keep the loads distinct.
        xhat, dn, g = _rms_bwd_terms(dy_ptr, x_ptr, gate_ptr, dgate_ptr, w_ptr, rows, cols, mask, rstd,
                                     n_cols, offset, stride_dy_row, stride_x_row, stride_gate_row,
                                     stride_dgate_row, HAS_WEIGHT, HAS_GATE, False, "evict_last")
        dot = tl.sum(g * xhat, axis=1) / n_cols
        xhat, dn, g = _rms_bwd_terms(dy_ptr, x_ptr, gate_ptr, dgate_ptr, w_ptr, rows, cols, mask, rstd,
                                     n_cols, offset, stride_dy_row, stride_x_row, stride_gate_row,
                                     stride_dgate_row, HAS_WEIGHT, HAS_GATE, True, "evict_first")
        _rms_store_dx(xhat, g, dot, rstd, du_ptr, dx_ptr, rows, cols, mask, stride_du_row, stride_dx_row, HAS_DU)
        if HAS_WEIGHT:
            dw_acc += dn * xhat
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0), mask=cols < n_cols)


@triton.jit
def _rms_norm_bwd_wide_kernel(
    dy_ptr, x_ptr, gate_ptr, w_ptr, rstd_ptr, du_ptr,
    dx_ptr, dgate_ptr, dw_partial_ptr, dot_ptr,  # dot: (n_rows,) float32 scratch
    n_rows, n_cols, offset, rows_per_program,
    stride_dy_row, stride_x_row, stride_gate_row, stride_du_row, stride_dx_row, stride_dgate_row,
    HAS_WEIGHT: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_DU: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns per loop step
    ALIGN: tl.constexpr,  # divides n_cols and the row strides (kernel_lab.shared.vector_hints)
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_dy_row = multiple_of(stride_dy_row, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_gate_row = multiple_of(stride_gate_row, ALIGN)
    stride_du_row = multiple_of(stride_du_row, ALIGN)
    stride_dx_row = multiple_of(stride_dx_row, ALIGN)
    stride_dgate_row = multiple_of(stride_dgate_row, ALIGN)
    # float32 math under torch.compile too: see FLOAT_ARGUMENTS_NOTE
    offset = tl.cast(offset, tl.float32)
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    # phase 1: each row's dot = mean(g * xhat); dgate needs no dot and is written here
    for row in tl.range(row_start, row_end):
        rows = row + tl.arange(0, 1)
        rstd = tl.load(rstd_ptr + rows)
        acc = tl.zeros([1, BLOCK_N], tl.float32)
        for off in tl.range(0, n_cols, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            mask = (cols < n_cols)[None, :]
            xhat, dn, g = _rms_bwd_terms(dy_ptr, x_ptr, gate_ptr, dgate_ptr, w_ptr, rows, cols, mask, rstd,
                                         n_cols, offset, stride_dy_row, stride_x_row, stride_gate_row,
                                         stride_dgate_row, HAS_WEIGHT, HAS_GATE, True, "")
            acc += g * xhat
        tl.store(dot_ptr + rows, tl.sum(acc, axis=1) / n_cols)
    # One thread stored each row's dot; every thread reads them below. Without a barrier a warp
    # that runs ahead reads a dot before it is written (compute-sanitizer initcheck caught it).
    tl.debug_barrier()
    # phase 2: column chunks outside, the block's rows inside: dweight of a chunk in registers
    for off in tl.range(0, n_cols, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = (cols < n_cols)[None, :]
        dw_acc = tl.zeros([1, BLOCK_N], tl.float32)
        for row in tl.range(row_start, row_end):
            rows = row + tl.arange(0, 1)
            rstd = tl.load(rstd_ptr + rows)
            xhat, dn, g = _rms_bwd_terms(dy_ptr, x_ptr, gate_ptr, dgate_ptr, w_ptr, rows, cols, mask, rstd,
                                         n_cols, offset, stride_dy_row, stride_x_row, stride_gate_row,
                                         stride_dgate_row, HAS_WEIGHT, HAS_GATE, False, "")
            dot = tl.load(dot_ptr + rows)
            _rms_store_dx(xhat, g, dot, rstd, du_ptr, dx_ptr, rows, cols, mask,
                          stride_du_row, stride_dx_row, HAS_DU)
            if HAS_WEIGHT:
                dw_acc += dn * xhat
        if HAS_WEIGHT:
            tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0),
                     mask=cols < n_cols)


@triton.jit(do_not_specialize=["clear_len"])  # (it varies between calls of one launch plan)
def _rms_norm_bwd_coop_kernel(
    dy_ptr, x_ptr, gate_ptr, w_ptr, rstd_ptr, du_ptr,  # as _rms_norm_bwd_kernel's
    dx_ptr, dgate_ptr, dw_partial_ptr,  # dw_partial: (n_groups, n_cols) float32
    n_rows, n_cols, offset, rows_per_group,
    stride_dy_row, stride_x_row, stride_gate_row, stride_du_row, stride_dx_row, stride_dgate_row,
    sync_ptr,  # kernel_lab.shared.coop.workspace
    clear_ptr, clear_len,  # the previous launch's scratch, zeroed here (coop.workspace)
    n_splits,  # chunks per row
    HAS_WEIGHT: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_DU: tl.constexpr,
    CHUNK: tl.constexpr,  # columns per program
    SPLITS_POW2: tl.constexpr,  # next power of two >= n_splits
    ALIGN: tl.constexpr,  # divides n_cols and the row strides (kernel_lab.shared.vector_hints)
):
    """The backward of rows too long for one program, x and dy read from HBM once (CUDA only).

    Programs come in groups of n_splits, one per CHUNK of the columns (kernel_lab.shared.coop:
    the ticket's "row" is the group), and a group walks rows_per_group consecutive rows. For
    each row a program reads its chunk, publishes the chunk's part of the row's dot, waits for
    the other chunks' parts and writes its chunk of dx, reading the chunk again for that (from
    L2: the first read keeps its lines there); dweight of its columns stays in registers across
    the rows and is written once, a row of the (n_groups, n_cols) partial sums."""
    n_cols = multiple_of(n_cols, ALIGN)
    stride_dy_row = multiple_of(stride_dy_row, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_gate_row = multiple_of(stride_gate_row, ALIGN)
    stride_du_row = multiple_of(stride_du_row, ALIGN)
    stride_dx_row = multiple_of(stride_dx_row, ALIGN)
    stride_dgate_row = multiple_of(stride_dgate_row, ALIGN)
    # float32 math under torch.compile too: see FLOAT_ARGUMENTS_NOTE
    offset = tl.cast(offset, tl.float32)
    group, split = coop_ticket(sync_ptr, n_splits, clear_ptr, clear_len)
    cols = split * CHUNK + tl.arange(0, CHUNK)
    mask = (cols < n_cols)[None, :]
    row_start = group * rows_per_group
    row_end = tl.minimum(row_start + rows_per_group, n_rows)
    dw_acc = tl.zeros([1, CHUNK], tl.float32)
    for row in tl.range(row_start, row_end):
        rows = row + tl.arange(0, 1)
        rstd = tl.load(rstd_ptr + rows)
        # Read twice rather than held across the wait: fewer registers, so more programs an SM
        # keep DRAM busy while others wait (H200 sweep, 1024 x 65536 bf16: 142.5 against 161-185
        # us holding it)
        xhat, dn, g = _rms_bwd_terms(dy_ptr, x_ptr, gate_ptr, dgate_ptr, w_ptr, rows, cols, mask, rstd,
                                     n_cols, offset, stride_dy_row, stride_x_row, stride_gate_row,
                                     stride_dgate_row, HAS_WEIGHT, HAS_GATE, False, "evict_last")
        # hi = 1.0 keeps the word non-zero whatever the chunk's part
        words = coop_publish_and_gather(sync_ptr, n_rows, row, split, n_splits, tl.sum(g * xhat),
                                        tl.full([], 1.0, tl.float32), SPLITS_POW2)
        dot = tl.sum(tl.where(tl.arange(0, SPLITS_POW2) < n_splits, coop_word_lo(words), 0.0)) / n_cols
        xhat, dn, g = _rms_bwd_terms(dy_ptr, x_ptr, gate_ptr, dgate_ptr, w_ptr, rows, cols, mask, rstd,
                                     n_cols, offset, stride_dy_row, stride_x_row, stride_gate_row,
                                     stride_dgate_row, HAS_WEIGHT, HAS_GATE, True, "evict_first")
        _rms_store_dx(xhat, g, dot + tl.zeros([1], tl.float32), rstd, du_ptr, dx_ptr, rows, cols, mask,
                      stride_du_row, stride_dx_row, HAS_DU)
        if HAS_WEIGHT:
            dw_acc += dn * xhat
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + group * n_cols + cols, tl.sum(dw_acc, axis=0), mask=cols < n_cols)


# ---------------------------------------------------------------------------------------------
# LayerNorm: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var + eps), biased variance
# ---------------------------------------------------------------------------------------------


@triton.jit
def _layer_norm_store_output(
    x, mean, rstd, w_ptr, b_ptr, y_ptr, rows, cols, mask, n_cols, stride_y_row,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # (w and b are loaded here, after the row reductions, unlike RMSNorm's weight: LayerNorm's
    # tile holds x and x - mean, and two more preloaded rows made the one-tile kernel spill: on an
    # H200, 8192 x 8192 bf16 took 93.8 against 67.8 us, 4096 x 16384 110.8 against 71.1)
    y = (x - mean[:, None]) * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y_row + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_range_stats(x_ptr, rows, start, end, stride_x_row, BLOCK_N: tl.constexpr, EVICTION: tl.constexpr):
    """(mean, m2) of x[row, start:end] (rows: [1]), each [1]: one pass of BLOCK_N-column steps
    merged with Chan et al.'s parallel Welford update, each step contributing its own mean and
    centred sum of squares (m2)."""
    mean = tl.zeros([1], tl.float32)
    m2 = tl.zeros([1], tl.float32)
    for off in range(start, end, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = (cols < end)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0,
                    eviction_policy=EVICTION).to(tl.float32)
        n_seen = (off - start) * 1.0  # every earlier step was full
        n_step = tl.minimum(end - off, BLOCK_N) * 1.0
        step_mean = tl.sum(x, axis=1) / n_step
        xc = tl.where(mask, x - step_mean[:, None], 0.0)
        delta = step_mean - mean
        n_total = n_seen + n_step
        mean += delta * (n_step / n_total)
        m2 += tl.sum(xc * xc, axis=1) + delta * delta * (n_seen * n_step / n_total)
    return mean, m2


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr, w_ptr, b_ptr,
    y_ptr, mean_ptr, rstd_ptr,  # mean, rstd: (n_rows,) float32
    n_rows, n_cols, eps,
    stride_x_row, stride_y_row,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ONE_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,  # divides n_cols and the row strides (kernel_lab.shared.vector_hints)
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    # float32 math under torch.compile too: see FLOAT_ARGUMENTS_NOTE
    eps = tl.cast(eps, tl.float32)
    if ONE_TILE:
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        # two passes over registers: the variance of the centred values, never E[x^2] - E[x]^2
        # (which cancels catastrophically when |mean| >> std)
        mean = tl.sum(x, axis=1) / n_cols
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / n_cols
        rstd = tl.rsqrt(var + eps)
        _layer_norm_store_output(x, mean, rstd, w_ptr, b_ptr, y_ptr, rows, cols, mask, n_cols,
                                 stride_y_row, HAS_WEIGHT, HAS_BIAS)
        tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    else:
        for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
            rows = (row + tl.arange(0, 1)).to(tl.int64)
            mean, m2 = _layer_norm_range_stats(x_ptr, rows, 0, n_cols, stride_x_row, BLOCK_N, "")
            rstd = tl.rsqrt(m2 / n_cols + eps)
            for off in range(0, n_cols, BLOCK_N):
                cols = off + tl.arange(0, BLOCK_N)
                mask = (cols < n_cols)[None, :]
                x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
                _layer_norm_store_output(x.to(tl.float32), mean, rstd, w_ptr, b_ptr, y_ptr, rows, cols, mask,
                                         n_cols, stride_y_row, HAS_WEIGHT, HAS_BIAS)
            tl.store(mean_ptr + rows, mean)
            tl.store(rstd_ptr + rows, rstd)


@triton.jit(do_not_specialize=["clear_len"])  # (it varies between calls of one launch plan)
def _layer_norm_fwd_coop_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,  # as _layer_norm_fwd_kernel's
    n_rows, n_cols, eps,
    stride_x_row, stride_y_row,
    sync_ptr,  # kernel_lab.shared.coop.workspace
    clear_ptr, clear_len,  # the previous launch's scratch, zeroed here (coop.workspace)
    n_splits,  # chunks per row
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    ALIGN: tl.constexpr,  # divides n_cols and the row strides (kernel_lab.shared.vector_hints)
):
    """As _rms_norm_fwd_coop_kernel, for LayerNorm: a chunk publishes its mean and m2, merged
    over the row's chunks with the parallel Welford formula."""
    n_cols = multiple_of(n_cols, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    # float32 math under torch.compile too: see FLOAT_ARGUMENTS_NOTE
    eps = tl.cast(eps, tl.float32)
    row, split = coop_ticket(sync_ptr, n_splits, clear_ptr, clear_len)
    rows = row + tl.arange(0, 1)
    start = split * CHUNK
    tl.static_assert(CHUNK % ALIGN == 0)
    end = multiple_of(tl.minimum(start + CHUNK, n_cols), ALIGN)
    chunk_mean, chunk_m2 = _layer_norm_range_stats(x_ptr, rows, start, end, stride_x_row, BLOCK_N, "evict_last")
    # m2 (>= 0) goes with its sign bit set, which keeps the word non-zero where the chunk's mean
    # and m2 are both +0.0 (a bit operation: -m2 would be 0.0 - m2, +0.0 again)
    m2_bits = tl.sum(chunk_m2, axis=0).to(tl.int32, bitcast=True) | -2147483648
    words = coop_publish_and_gather(sync_ptr, n_rows, row, split, n_splits, tl.sum(chunk_mean, axis=0),
                                    m2_bits.to(tl.float32, bitcast=True), SPLITS_POW2)
    idx = tl.arange(0, SPLITS_POW2)
    n_chunk = tl.where(idx < n_splits, tl.minimum(n_cols - idx * CHUNK, CHUNK), 0) * 1.0
    means = coop_word_lo(words)
    mean = tl.sum(n_chunk * means, axis=0) / n_cols
    delta = tl.where(idx < n_splits, means - mean, 0.0)
    m2 = tl.sum(tl.where(idx < n_splits, tl.abs(coop_word_hi(words)), 0.0) + n_chunk * delta * delta, axis=0)
    mean = mean + tl.zeros([1], tl.float32)
    rstd = tl.rsqrt(m2 / n_cols + eps) + tl.zeros([1], tl.float32)
    for off in range(start, end, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = (cols < end)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first")
        _layer_norm_store_output(x.to(tl.float32), mean, rstd, w_ptr, b_ptr, y_ptr, rows, cols, mask, n_cols,
                                 stride_y_row, HAS_WEIGHT, HAS_BIAS)
    if split == 0:
        tl.store(mean_ptr + rows, mean)
        tl.store(rstd_ptr + rows, rstd)


@triton.jit
def _layer_norm_bwd_load(dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, cols, n_rows, n_cols, stride_dy_row, stride_x_row,
                         EVICTION: tl.constexpr):
    """What the backward reads of rows `rows`: (x, dy, mean, rstd, mask), the tiles as stored
    (no conversion: a prefetched tile stays compact in registers). EVICTION: the tile loads'
    L2 eviction policy ("": the default; a re-read with another policy than the first read
    stays a separate load)."""
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICTION)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0,
                 eviction_policy=EVICTION)
    mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    return x, dy, mean, rstd, mask


@triton.jit
def _layer_norm_bwd_terms(x, dy, w_ptr, cols, mask, mean, rstd, n_cols, HAS_WEIGHT: tl.constexpr):
    """(xhat, dy, g) of one loaded tile, in float32: xhat = (x - mean) * rstd (0 on masked
    lanes), g = dy * w."""
    dy = dy.to(tl.float32)
    xhat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
    if HAS_WEIGHT:
        g = dy * tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    else:
        g = dy
    return xhat, dy, g


@triton.jit
def _layer_norm_store_dx(xhat, g, dot_g, dot_gx, rstd, dx_ptr, rows, cols, mask, stride_dx_row):
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat))."""
    dx = (g - dot_g[:, None] - xhat * dot_gx[:, None]) * rstd[:, None]
    tl.store(dx_ptr + rows[:, None] * stride_dx_row + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_accumulate(dw_acc, db_acc, xhat, dy, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(dw_acc + dy * xhat, db_acc + dy): one more tile of the dweight / dbias accumulators."""
    if HAS_WEIGHT:
        dw_acc += dy * xhat
    if HAS_BIAS:
        db_acc += dy
    return dw_acc, db_acc


@triton.jit
def _layer_norm_store_partials(
    dw_acc, db_acc, partial_ptr, pid, n_programs, cols, n_cols,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Columns `cols` of row `pid` of the float32 partials, one (n_programs, n_cols) slab per
    parameter present (dweight's first): the column sums of this program's accumulators."""
    out = pid.to(tl.int64) * n_cols + cols
    if HAS_WEIGHT:
        tl.store(partial_ptr + out, tl.sum(dw_acc, axis=0), mask=cols < n_cols)
    if HAS_BIAS:
        db_slab = partial_ptr
        if HAS_WEIGHT:
            db_slab += n_programs.to(tl.int64) * n_cols
        tl.store(db_slab + out, tl.sum(db_acc, axis=0), mask=cols < n_cols)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr,
    dx_ptr, partial_ptr,  # partials: (n_params, n_programs, n_cols) float32, see _layer_norm_store_partials
    n_rows, n_cols,
    stride_dy_row, stride_x_row, stride_dx_row,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    REREAD: tl.constexpr,  # touch each tile twice (wide rows, off CUDA) instead of prefetching the next
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,  # divides n_cols and the row strides (kernel_lab.shared.vector_hints)
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_dy_row = multiple_of(stride_dy_row, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_dx_row = multiple_of(stride_dx_row, ALIGN)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if REREAD:
        # Rows too wide to hold x, dy, the next block's tiles and both accumulators without
        # spilling: RMSNorm's way (_rms_norm_bwd_kernel), the first touch of the tile for the
        # row's dots only, the second (from L2) for dx and the accumulators. The two eviction
        # policies keep the loads distinct: with the same policy the compiler merged them into
        # one, holding the tile across the row reduction (464 bytes of spills a thread at 16384
        # columns and 8 warps, offline sm_90a compile, against 200).
        for block in tl.range(pid, tl.cdiv(n_rows, BLOCK_M), n_programs):
            rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            x, dy, mean, rstd, mask = _layer_norm_bwd_load(dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, cols, n_rows,
                                                           n_cols, stride_dy_row, stride_x_row, "evict_last")
            xhat, dy_f32, g = _layer_norm_bwd_terms(x, dy, w_ptr, cols, mask, mean, rstd, n_cols, HAS_WEIGHT)
            dot_g = tl.sum(g, axis=1) / n_cols
            dot_gx = tl.sum(g * xhat, axis=1) / n_cols
            x, dy, mean, rstd, mask = _layer_norm_bwd_load(dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, cols, n_rows,
                                                           n_cols, stride_dy_row, stride_x_row, "evict_first")
            xhat, dy_f32, g = _layer_norm_bwd_terms(x, dy, w_ptr, cols, mask, mean, rstd, n_cols, HAS_WEIGHT)
            _layer_norm_store_dx(xhat, g, dot_g, dot_gx, rstd, dx_ptr, rows, cols, mask, stride_dx_row)
            dw_acc, db_acc = _layer_norm_accumulate(dw_acc, db_acc, xhat, dy_f32, HAS_WEIGHT, HAS_BIAS)
    else:
        # Software prefetch: the loop carries the next row block's tiles, loaded before the current
        # block's row reductions (whose barrier would otherwise leave DRAM idle while the SM
        # reduces). On an H200 this beat reading each block twice (the RMSNorm way) from 2048 to
        # 8192 columns, and the plain loop at 2048 and 4096 (a tie at 8192). The launcher keeps the
        # grid <= the number of row blocks.
        # int32 is enough for a row index; the int64 cast keeps rows * stride from wrapping
        rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        x, dy, mean, rstd, mask = _layer_norm_bwd_load(dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, cols, n_rows, n_cols,
                                                       stride_dy_row, stride_x_row, "")
        for block in tl.range(pid, tl.cdiv(n_rows, BLOCK_M), n_programs):
            next_rows = ((block + n_programs) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            next_x, next_dy, next_mean, next_rstd, next_mask = _layer_norm_bwd_load(
                dy_ptr, x_ptr, mean_ptr, rstd_ptr, next_rows, cols, n_rows, n_cols, stride_dy_row, stride_x_row, "")
            xhat, dy_f32, g = _layer_norm_bwd_terms(x, dy, w_ptr, cols, mask, mean, rstd, n_cols, HAS_WEIGHT)
            dot_g = tl.sum(g, axis=1) / n_cols
            dot_gx = tl.sum(g * xhat, axis=1) / n_cols
            _layer_norm_store_dx(xhat, g, dot_g, dot_gx, rstd, dx_ptr, rows, cols, mask, stride_dx_row)
            dw_acc, db_acc = _layer_norm_accumulate(dw_acc, db_acc, xhat, dy_f32, HAS_WEIGHT, HAS_BIAS)
            rows, x, dy, mean, rstd, mask = next_rows, next_x, next_dy, next_mean, next_rstd, next_mask
    _layer_norm_store_partials(dw_acc, db_acc, partial_ptr, pid, n_programs, cols, n_cols, HAS_WEIGHT, HAS_BIAS)


@triton.jit
def _layer_norm_bwd_wide_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr,
    dx_ptr, partial_ptr, dot_ptr,  # dot: (n_rows, 2) float32 scratch
    n_rows, n_cols, rows_per_program,
    stride_dy_row, stride_x_row, stride_dx_row,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,  # divides n_cols and the row strides (kernel_lab.shared.vector_hints)
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_dy_row = multiple_of(stride_dy_row, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_dx_row = multiple_of(stride_dx_row, ALIGN)
    pid = tl.program_id(0)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    # phase 1: each row's mean(g) and mean(g * xhat) (its mean and rstd are re-read per chunk: L1 hits)
    for row in tl.range(row_start, row_end):
        rows = row + tl.arange(0, 1)
        acc_g = tl.zeros([1, BLOCK_N], tl.float32)
        acc_gx = tl.zeros([1, BLOCK_N], tl.float32)
        for off in tl.range(0, n_cols, BLOCK_N):
            cols = off + tl.arange(0, BLOCK_N)
            x, dy, mean, rstd, mask = _layer_norm_bwd_load(dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, cols, n_rows,
                                                           n_cols, stride_dy_row, stride_x_row, "")
            xhat, dy, g = _layer_norm_bwd_terms(x, dy, w_ptr, cols, mask, mean, rstd, n_cols, HAS_WEIGHT)
            acc_g += g
            acc_gx += g * xhat
        tl.store(dot_ptr + 2 * rows, tl.sum(acc_g, axis=1) / n_cols)
        tl.store(dot_ptr + 2 * rows + 1, tl.sum(acc_gx, axis=1) / n_cols)
    tl.debug_barrier()  # the stores above before any thread's loads below (as in the RMSNorm kernel)
    # phase 2: column chunks outside, rows inside
    for off in tl.range(0, n_cols, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        dw_acc = tl.zeros([1, BLOCK_N], tl.float32)
        db_acc = tl.zeros([1, BLOCK_N], tl.float32)
        for row in tl.range(row_start, row_end):
            rows = row + tl.arange(0, 1)
            x, dy, mean, rstd, mask = _layer_norm_bwd_load(dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, cols, n_rows,
                                                           n_cols, stride_dy_row, stride_x_row, "")
            xhat, dy, g = _layer_norm_bwd_terms(x, dy, w_ptr, cols, mask, mean, rstd, n_cols, HAS_WEIGHT)
            dot_g = tl.load(dot_ptr + 2 * rows)
            dot_gx = tl.load(dot_ptr + 2 * rows + 1)
            _layer_norm_store_dx(xhat, g, dot_g, dot_gx, rstd, dx_ptr, rows, cols, mask, stride_dx_row)
            dw_acc, db_acc = _layer_norm_accumulate(dw_acc, db_acc, xhat, dy, HAS_WEIGHT, HAS_BIAS)
        _layer_norm_store_partials(dw_acc, db_acc, partial_ptr, pid, tl.num_programs(0), cols, n_cols,
                                   HAS_WEIGHT, HAS_BIAS)


@triton.jit(do_not_specialize=["clear_len"])  # (it varies between calls of one launch plan)
def _layer_norm_bwd_coop_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr,
    dx_ptr, partial_ptr,  # partials: (n_params, n_groups, n_cols) float32, see _layer_norm_store_partials
    n_rows, n_cols, rows_per_group,
    stride_dy_row, stride_x_row, stride_dx_row,
    sync_ptr,  # kernel_lab.shared.coop.workspace
    clear_ptr, clear_len,  # the previous launch's scratch, zeroed here (coop.workspace)
    n_splits,  # chunks per row
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CHUNK: tl.constexpr,  # columns per program
    SPLITS_POW2: tl.constexpr,  # next power of two >= n_splits
    ALIGN: tl.constexpr,  # divides n_cols and the row strides (kernel_lab.shared.vector_hints)
):
    """LayerNorm's backward of rows too long for one program, as _rms_norm_bwd_coop_kernel's
    except in two points: a chunk's word carries two parts, sum(g * xhat) (lo) and sum(g) (hi),
    and the loop holds its chunk and loads the next row's before the wait (the one-tile kernel's
    prefetch) instead of reading it twice (H200 sweep at 2048-column chunks over 2 warps, 1024 x
    65536 bf16: 171 against 242-284 us rereading)."""
    n_cols = multiple_of(n_cols, ALIGN)
    stride_dy_row = multiple_of(stride_dy_row, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_dx_row = multiple_of(stride_dx_row, ALIGN)
    group, split = coop_ticket(sync_ptr, n_splits, clear_ptr, clear_len)
    cols = split * CHUNK + tl.arange(0, CHUNK)
    row_start = group * rows_per_group
    row_end = tl.minimum(row_start + rows_per_group, n_rows)
    dw_acc = tl.zeros([1, CHUNK], tl.float32)
    db_acc = tl.zeros([1, CHUNK], tl.float32)
    rows = row_start + tl.arange(0, 1)
    x, dy, mean, rstd, mask = _layer_norm_bwd_load(dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows, cols, row_end,
                                                   n_cols, stride_dy_row, stride_x_row, "")
    for row in tl.range(row_start, row_end):
        rows = row + tl.arange(0, 1)
        next_x, next_dy, next_mean, next_rstd, next_mask = _layer_norm_bwd_load(
            dy_ptr, x_ptr, mean_ptr, rstd_ptr, rows + 1, cols, row_end, n_cols, stride_dy_row, stride_x_row, "")
        xhat, dy_f32, g = _layer_norm_bwd_terms(x, dy, w_ptr, cols, mask, mean, rstd, n_cols, HAS_WEIGHT)
        # a sum of +0.0 travels as -0.0, whose sign bit keeps the word non-zero and which adds
        # nothing (set through the bits: a -0.0 literal compiles to +0.0)
        part_g = tl.sum(g).to(tl.int32, bitcast=True)
        part_g = tl.where(part_g == 0, tl.full([], -2147483648, tl.int32), part_g).to(tl.float32, bitcast=True)
        words = coop_publish_and_gather(sync_ptr, n_rows, row, split, n_splits, tl.sum(g * xhat), part_g,
                                        SPLITS_POW2)
        in_row = tl.arange(0, SPLITS_POW2) < n_splits
        dot_gx = tl.sum(tl.where(in_row, coop_word_lo(words), 0.0)) / n_cols + tl.zeros([1], tl.float32)
        dot_g = tl.sum(tl.where(in_row, coop_word_hi(words), 0.0)) / n_cols + tl.zeros([1], tl.float32)
        _layer_norm_store_dx(xhat, g, dot_g, dot_gx, rstd, dx_ptr, rows, cols, mask, stride_dx_row)
        dw_acc, db_acc = _layer_norm_accumulate(dw_acc, db_acc, xhat, dy_f32, HAS_WEIGHT, HAS_BIAS)
        x, dy, mean, rstd, mask = next_x, next_dy, next_mean, next_rstd, next_mask
    _layer_norm_store_partials(dw_acc, db_acc, partial_ptr, group, tl.cdiv(n_rows, rows_per_group), cols, n_cols,
                               HAS_WEIGHT, HAS_BIAS)
