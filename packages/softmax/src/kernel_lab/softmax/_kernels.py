"""Triton kernels of softmax and log-softmax over the last dim of a (n_rows, n_cols) view.

Four shapes of work, forward and backward alike:

- `*_rows_kernel`: a row fits in registers (n_cols <= MAX_FUSED_COLS in ops.py). One program
  takes BLOCK_M whole rows: one read, one write, the minimum traffic.
- `*_coop_kernel` (CUDA only): a row too long for one program's registers is cut into chunks,
  one program per chunk, and the programs of a row cooperate (`kernel_lab.shared.coop`: tickets,
  forward progress, the statistics exchange): each publishes its chunk's statistics, waits until
  all chunks of its row have, merges them and writes its chunk. The backward holds its chunk in
  registers from load to store; the forward reads its chunk twice, keeping the lines in L2 on
  the first read (evict_last) so that the second read comes from L2: one read of HBM and one
  write, whatever the row length, in one launch. The interpreter, where a wait would never end,
  takes the next two paths instead.
- `*_looped_kernel`: a row too long for the cooperative kernel, many rows. One program per row
  loops over it twice (statistics, then output): the row is read twice, 1.5x the minimum traffic.
  Both directions also take it for rows short enough to stay in L2 between its passes when there
  are many of them (CUDA): the first pass keeps the lines there, so HBM sees one read and one
  write, without the cooperative kernel's synchronisation.
- `*_partial_kernel` + `*_split_kernel`: the same with too few rows to fill the GPU. Each row is
  cut into `n_splits` chunks: the first launch writes each chunk's statistics, the second merges
  a row's statistics and writes its chunk's output.

Rows of odd length or stride (GPT-2's 50257 tokens) share no provable 16-byte vectors with
their neighbours; the long-row kernels read them through aligned windows (WINDOW, `_row_window`)
so that their accesses stay vectors. The rows kernels read them element by element.

All math is float32 whatever the input dtype. A fully masked row (all -inf) has no finite max;
we shift it by 0 instead of -inf so it yields softmax 0 and log-softmax -inf, never NaN.
-inf is written inline as float("-inf"), not as a module global: torch.compile copies these
kernels' sources into its generated code, and a module-level constant does not travel with them.
"""

import triton
import triton.language as tl

from kernel_lab.shared.coop import coop_publish_and_gather, coop_ticket, coop_word_hi, coop_word_lo
from kernel_lab.shared.vector_hints import multiple_of


@triton.jit
def _safe_shift(m):
    """The max to subtract: 0 where the running max is still -inf (nothing finite seen yet)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _row_window(row_offset, n_cols, WINDOW: tl.constexpr, VEC: tl.constexpr):
    """Where a row lies in what its programs read: (first element read, lo, hi, end).

    Without WINDOW, the row itself: reads start at its first element, its columns are [0, n_cols)
    and `end` = n_cols. With WINDOW (rows of odd length or stride, see ops._windowed), reads start
    at the VEC-aligned element at or below the row's first (VEC elements are 16 bytes): the row
    is then columns [lo, hi) = [lead, lead + n_cols) of that window, and every access is a whole
    16-byte vector up to `end`, hi rounded up to a multiple of VEC. The fewer than VEC elements
    read on either side of the row belong to the neighbouring rows, or to the tensor's last
    16-byte segment: read, never used, never written. (Without it no two neighbours of such a
    row can be proven to share a vector, and every access is of one element.)"""
    if WINDOW:
        first = row_offset // VEC * VEC
        lo = row_offset - first
        hi = lo + n_cols
        end = (hi + VEC - 1) // VEC * VEC
    else:
        first = row_offset
        lo = 0
        hi = n_cols
        end = n_cols
    return first, lo, hi, end


@triton.jit
def _in_row(values, cols, lo, hi, fill, WINDOW: tl.constexpr):
    """values with `fill` at the columns outside the row [lo, hi) of a WINDOW read."""
    if WINDOW:
        values = tl.where((cols >= lo) & (cols < hi), values, fill)
    return values


@triton.jit
def _store_row(ptr, cols, values, start, end, lo, hi, EVICTION: tl.constexpr, WINDOW: tl.constexpr,
               VEC: tl.constexpr):
    """Store values (computed at columns `cols` of [start, end)) where they belong to the row.
    WINDOW: only the row's whole 16-byte vectors, so that the store stays vectorized; the partial
    vectors at its two ends are the caller's (_row_end_cols)."""
    if WINDOW:
        mask = (cols >= (lo + VEC - 1) // VEC * VEC) & (cols < hi // VEC * VEC) & (cols < end)
    else:
        mask = cols < end
    tl.store(ptr + cols, values.to(ptr.dtype.element_ty), mask=mask, eviction_policy=EVICTION)


@triton.jit
def _row_end_cols(start, end, lo, hi, VEC: tl.constexpr):
    """(cols, mask) of the columns of [start, end) in the row's partial first and last 16-byte
    vectors, which _store_row leaves out: at most 2 (VEC - 1) of them, handled one by one."""
    lo_up = (lo + VEC - 1) // VEC * VEC
    hi_down = hi // VEC * VEC
    e = tl.arange(0, 2 * VEC)
    cols = tl.where(e < VEC, lo_up - VEC + e, hi_down - VEC + e)
    mask = (cols >= lo) & (cols < hi) & ((cols < lo_up) | (cols >= hi_down)) & (cols >= start) & (cols < end)
    return cols, mask


# (The EVICTION arguments have no default: Triton 3.6 passes a jit helper's default values
# as they are, and a str default is then taken for a tensor argument and fails to compile,
# which the interpreter does not show.)
@triton.jit
def _chunk_max_sumexp(row_ptr, start, end, lo, hi, BLOCK_N: tl.constexpr, EVICTION: tl.constexpr,
                      WINDOW: tl.constexpr):
    """Online (max, sum(exp(x - max))) of the row's columns in row_ptr[start:end], each returned
    with shape [1]. lo, hi, WINDOW: as _row_window gives them.
    EVICTION: the loads' L2 eviction policy ("evict_last": the row is read again soon)."""
    m = tl.full([1], float("-inf"), tl.float32)
    s = tl.zeros([1], tl.float32)
    for off in range(start, end, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        x = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf"), eviction_policy=EVICTION).to(tl.float32)
        x = _in_row(x, cols, lo, hi, float("-inf"), WINDOW)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = _safe_shift(m_new)
        # rescale the sum so far to the new max, then add this chunk
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    return m, s


@triton.jit
def _normalized(x, shift, s, inv_s, log_s, LOG: tl.constexpr):
    """softmax (or log-softmax) of x given the row's shift (max), sum and its 1 / s and log(s)."""
    if LOG:
        return tl.where(s == 0, float("-inf"), x - shift - log_s)
    else:
        return tl.exp(x - shift) * inv_s


@triton.jit
def _write_normalized(
    x_row_ptr, y_row_ptr, start, end, lo, hi, m, s, LOG: tl.constexpr, BLOCK_N: tl.constexpr,
    EVICTION: tl.constexpr, WINDOW: tl.constexpr, VEC: tl.constexpr,
):
    """y[start:end] = softmax (or log-softmax) of x[start:end] given the row's max and sum.
    lo, hi, WINDOW: as _row_window gives them (x and y rows read from equally aligned windows).
    EVICTION: the L2 eviction policy of its loads and stores ("evict_first": last use)."""
    shift = _safe_shift(m)
    # Only a row with no finite entry (all -inf: s == 0) is special-cased, to 0 (log: -inf). A NaN
    # or +inf entry makes s NaN, and NaN must come out as it does from torch: `s > 0` would be
    # False for it and hide it behind the masked-row value.
    inv_s = tl.where(s == 0, 0.0, 1.0 / s)
    log_s = tl.log(s)
    for off in range(start, end, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        x = tl.load(x_row_ptr + cols, mask=cols < end, other=float("-inf"), eviction_policy=EVICTION).to(tl.float32)
        _store_row(y_row_ptr, cols, _normalized(x, shift, s, inv_s, log_s, LOG), start, end, lo, hi, EVICTION,
                   WINDOW, VEC)
    if WINDOW:
        cols, mask = _row_end_cols(start, end, lo, hi, VEC)
        x = tl.load(x_row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        y = _normalized(x, shift, s, inv_s, log_s, LOG)
        tl.store(y_row_ptr + cols, y.to(y_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_fwd_rows_kernel(
    x_ptr, y_ptr, n_rows, n_cols,
    stride_x_row, stride_y_row,
    LOG: tl.constexpr,  # log-softmax instead of softmax
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols: the whole row at once
    ALIGN: tl.constexpr,  # divides n_cols and the row strides (kernel_lab.shared.vector_hints)
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    shift = _safe_shift(tl.max(x, axis=1))[:, None]
    e = tl.exp(x - shift)
    s = tl.sum(e, axis=1)[:, None]
    if LOG:
        y = tl.where(s == 0, float("-inf"), x - shift - tl.log(s))  # s == 0: see _write_normalized
    else:
        y = e * tl.where(s == 0, 0.0, 1.0 / s)
    tl.store(y_ptr + rows[:, None] * stride_y_row + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_row_stats(max_ptr, sum_ptr, row, n_splits, SPLITS_POW2: tl.constexpr):
    """A row's (shift, sum) from its chunks' (max, sum(exp(x - max))): max of maxes, sums rescaled."""
    idx = tl.arange(0, SPLITS_POW2)
    part_m = tl.load(max_ptr + row * n_splits + idx, mask=idx < n_splits, other=float("-inf"))
    part_s = tl.load(sum_ptr + row * n_splits + idx, mask=idx < n_splits, other=0.0)
    return _merge_chunk_stats(part_m, part_s)


@triton.jit
def _merge_chunk_stats(part_m, part_s):
    """(shift, sum) of a row from its chunks' maxima and sums(exp(x - max)) (-inf and 0 for padding)."""
    shift = _safe_shift(tl.max(part_m, axis=0))
    return shift, tl.sum(part_s * tl.exp(part_m - shift), axis=0)


@triton.jit(do_not_specialize=["clear_len"])  # (it varies between calls of one launch plan)
def _softmax_fwd_coop_kernel(
    x_ptr, y_ptr,
    sync_ptr,  # kernel_lab.shared.coop.workspace: the ticket, arrival counts and statistics words
    clear_ptr, clear_len,  # the previous launch's scratch, zeroed here (coop.workspace)
    n_rows, n_cols, stride_x_row, stride_y_row,
    n_splits,
    LOG: tl.constexpr,
    CHUNK: tl.constexpr,  # columns per program
    BLOCK_N: tl.constexpr,  # columns per step of its two passes over them
    SPLITS_POW2: tl.constexpr,  # next power of two >= n_splits
    ALIGN: tl.constexpr,  # as in the rows kernel
    WINDOW: tl.constexpr,  # rows read through 16-byte aligned windows (_row_window): chunks cut the window
    VEC: tl.constexpr,  # elements of a 16-byte vector
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    row, split = coop_ticket(sync_ptr, n_splits, clear_ptr, clear_len)
    x_first, lo, hi, row_end = _row_window(row * stride_x_row, n_cols, WINDOW, VEC)
    y_first, _, _, _ = _row_window(row * stride_y_row, n_cols, WINDOW, VEC)
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, row_end)
    x_row_ptr = x_ptr + x_first
    # The chunk is read twice: the wait between the passes is what the chunk's lines spend in L2
    # (evict_last), and the second pass is their last use (evict_first).
    m, s = _chunk_max_sumexp(x_row_ptr, start, end, lo, hi, BLOCK_N, EVICTION="evict_last", WINDOW=WINDOW)
    # word = (sum bits) << 32 | (max bits), never 0: the sum is >= 1 where the max is finite, and
    # a max of -inf has bits
    words = coop_publish_and_gather(sync_ptr, n_rows, row, split, n_splits, tl.max(m, axis=0),
                                    tl.sum(s, axis=0), SPLITS_POW2)
    chunks = tl.arange(0, SPLITS_POW2) < n_splits
    shift, total = _merge_chunk_stats(tl.where(chunks, coop_word_lo(words), float("-inf")),
                                      tl.where(chunks, coop_word_hi(words), 0.0))
    _write_normalized(x_row_ptr, y_ptr + y_first, start, end, lo, hi, shift, total, LOG, BLOCK_N,
                      EVICTION="evict_first", WINDOW=WINDOW, VEC=VEC)


@triton.jit
def _softmax_fwd_looped_kernel(
    x_ptr, y_ptr, n_cols,
    stride_x_row, stride_y_row,
    LOG: tl.constexpr,
    KEEP_IN_L2: tl.constexpr,  # rows short enough for L2 (ops.L2_LOOP_ROW_BYTES): the second pass reads it
    BLOCK_N: tl.constexpr,  # columns per loop step
    ALIGN: tl.constexpr,  # as in the rows kernel
    WINDOW: tl.constexpr,  # as in the cooperative kernel
    VEC: tl.constexpr,
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    x_first, lo, hi, end = _row_window(row * stride_x_row, n_cols, WINDOW, VEC)
    y_first, _, _, _ = _row_window(row * stride_y_row, n_cols, WINDOW, VEC)
    x_row_ptr = x_ptr + x_first
    m, s = _chunk_max_sumexp(x_row_ptr, 0, end, lo, hi, BLOCK_N, EVICTION="evict_last" if KEEP_IN_L2 else "",
                             WINDOW=WINDOW)
    _write_normalized(x_row_ptr, y_ptr + y_first, 0, end, lo, hi, m, s, LOG, BLOCK_N,
                      EVICTION="evict_first" if KEEP_IN_L2 else "", WINDOW=WINDOW, VEC=VEC)


@triton.jit
def _softmax_fwd_partial_kernel(
    x_ptr, max_ptr, sum_ptr,  # max/sum: (n_rows, n_splits) float32
    n_cols, stride_x_row, chunk,
    n_splits,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,  # as in the rows kernel
    WINDOW: tl.constexpr,  # as in the cooperative kernel
    VEC: tl.constexpr,
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    chunk = multiple_of(chunk, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    x_first, lo, hi, row_end = _row_window(row * stride_x_row, n_cols, WINDOW, VEC)
    start = split * chunk
    end = tl.minimum(start + chunk, row_end)
    m, s = _chunk_max_sumexp(x_ptr + x_first, start, end, lo, hi, BLOCK_N, EVICTION="", WINDOW=WINDOW)
    out = row * n_splits + split + tl.arange(0, 1)
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, s)


@triton.jit
def _softmax_fwd_split_kernel(
    x_ptr, y_ptr, max_ptr, sum_ptr,
    n_cols, stride_x_row, stride_y_row, chunk,
    n_splits,
    LOG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS_POW2: tl.constexpr,  # next power of two >= n_splits
    ALIGN: tl.constexpr,  # as in the rows kernel
    WINDOW: tl.constexpr,  # as in the cooperative kernel
    VEC: tl.constexpr,
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_x_row = multiple_of(stride_x_row, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    chunk = multiple_of(chunk, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    shift, s = _merge_row_stats(max_ptr, sum_ptr, row, n_splits, SPLITS_POW2)
    x_first, lo, hi, row_end = _row_window(row * stride_x_row, n_cols, WINDOW, VEC)
    y_first, _, _, _ = _row_window(row * stride_y_row, n_cols, WINDOW, VEC)
    start = split * chunk
    end = tl.minimum(start + chunk, row_end)
    _write_normalized(x_ptr + x_first, y_ptr + y_first, start, end, lo, hi, shift, s, LOG, BLOCK_N,
                      EVICTION="", WINDOW=WINDOW, VEC=VEC)


# Backward. softmax: dx = y * (dy - sum(y * dy)); log-softmax: dx = dy - exp(y) * sum(dy).
# Both are "one row reduction, then an elementwise pass", so the three work shapes repeat.


@triton.jit
def _chunk_grad_dot(y_row_ptr, dy_row_ptr, start, end, lo, hi, LOG: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVICTION: tl.constexpr, WINDOW: tl.constexpr):
    """sum(dy) (log-softmax) or sum(y * dy) (softmax) over the row's columns in [start, end),
    shape [1]. lo, hi, WINDOW: as _row_window gives them. EVICTION: as in _chunk_max_sumexp."""
    acc = tl.zeros([BLOCK_N], tl.float32)
    for off in range(start, end, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = cols < end
        dy = tl.load(dy_row_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
        dy = _in_row(dy, cols, lo, hi, 0.0, WINDOW)
        if LOG:
            acc += dy
        else:
            y = tl.load(y_row_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
            acc += dy * _in_row(y, cols, lo, hi, 0.0, WINDOW)
    return tl.sum(acc, axis=0) + tl.zeros([1], tl.float32)


@triton.jit
def _grad_from_dot(y, dy, dot, LOG: tl.constexpr):
    if LOG:
        return dy - tl.exp(y) * dot
    else:
        return y * (dy - dot)


@triton.jit
def _write_grad(y_row_ptr, dy_row_ptr, dx_row_ptr, start, end, lo, hi, dot, LOG: tl.constexpr,
                BLOCK_N: tl.constexpr, EVICTION: tl.constexpr, WINDOW: tl.constexpr, VEC: tl.constexpr):
    """dx[start:end] from y, dy and the row's reduction `dot`. lo, hi, WINDOW: as _row_window
    gives them (the three rows read from equally aligned windows). EVICTION: as in
    _write_normalized."""
    for off in range(start, end, BLOCK_N):
        cols = off + tl.arange(0, BLOCK_N)
        mask = cols < end
        y = tl.load(y_row_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
        dy = tl.load(dy_row_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
        _store_row(dx_row_ptr, cols, _grad_from_dot(y, dy, dot, LOG), start, end, lo, hi, EVICTION, WINDOW, VEC)
    if WINDOW:
        _write_grad_row_ends(y_row_ptr, dy_row_ptr, dx_row_ptr, start, end, lo, hi, dot, LOG, VEC)


@triton.jit
def _write_grad_row_ends(y_row_ptr, dy_row_ptr, dx_row_ptr, start, end, lo, hi, dot, LOG: tl.constexpr,
                         VEC: tl.constexpr):
    """dx at the row's partial end vectors within [start, end) (see _row_end_cols)."""
    cols, mask = _row_end_cols(start, end, lo, hi, VEC)
    y = tl.load(y_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_row_ptr + cols, _grad_from_dot(y, dy, dot, LOG).to(dx_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_grad_step(y_row_ptr, dy_row_ptr, off, end, NEED_Y: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVICTION: tl.constexpr):
    """y and dy of columns [off, off + BLOCK_N) below `end`, in their own dtype (masked lanes 0);
    y only where NEED_Y (log-softmax's reduction needs dy alone)."""
    cols = off + tl.arange(0, BLOCK_N)
    mask = cols < end
    dy = tl.load(dy_row_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICTION)
    if NEED_Y:
        y = tl.load(y_row_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICTION)
    else:
        y = dy
    return y, dy


@triton.jit
def _prefetched_grad_dot(y_row_ptr, dy_row_ptr, start, end, LOG: tl.constexpr, BLOCK_N: tl.constexpr,
                         EVICTION: tl.constexpr):
    """_chunk_grad_dot with the next step's loads issued before the current step's math: two
    steps of bytes in flight instead of one (the loop is not pipelined otherwise: one memory
    round trip a step). Needs end > start."""
    acc = tl.zeros([BLOCK_N], tl.float32)
    y_next, dy_next = _load_grad_step(y_row_ptr, dy_row_ptr, start, end, not LOG, BLOCK_N, EVICTION)
    for off in range(start + BLOCK_N, end, BLOCK_N):
        y, dy = y_next, dy_next
        y_next, dy_next = _load_grad_step(y_row_ptr, dy_row_ptr, off, end, not LOG, BLOCK_N, EVICTION)
        acc += dy.to(tl.float32) if LOG else y.to(tl.float32) * dy.to(tl.float32)
    acc += dy_next.to(tl.float32) if LOG else y_next.to(tl.float32) * dy_next.to(tl.float32)
    return tl.sum(acc, axis=0) + tl.zeros([1], tl.float32)


@triton.jit
def _prefetched_write_grad(y_row_ptr, dy_row_ptr, dx_row_ptr, start, end, dot, LOG: tl.constexpr,
                           BLOCK_N: tl.constexpr, EVICTION: tl.constexpr):
    """_write_grad with the next step's loads issued before the current step's math and store.
    Needs end > start (the last step's columns are computed from end)."""
    y_next, dy_next = _load_grad_step(y_row_ptr, dy_row_ptr, start, end, True, BLOCK_N, EVICTION)
    for off in range(start + BLOCK_N, end, BLOCK_N):
        y, dy = y_next, dy_next
        y_next, dy_next = _load_grad_step(y_row_ptr, dy_row_ptr, off, end, True, BLOCK_N, EVICTION)
        cols = off - BLOCK_N + tl.arange(0, BLOCK_N)
        dx = _grad_from_dot(y.to(tl.float32), dy.to(tl.float32), dot, LOG)
        tl.store(dx_row_ptr + cols, dx.to(dx_row_ptr.dtype.element_ty), mask=cols < end, eviction_policy=EVICTION)
    # the last step: the one starting at the last multiple of BLOCK_N past start below end
    cols = start + (end - 1 - start) // BLOCK_N * BLOCK_N + tl.arange(0, BLOCK_N)
    dx = _grad_from_dot(y_next.to(tl.float32), dy_next.to(tl.float32), dot, LOG)
    tl.store(dx_row_ptr + cols, dx.to(dx_row_ptr.dtype.element_ty), mask=cols < end, eviction_policy=EVICTION)


@triton.jit
def _softmax_bwd_rows_kernel(
    y_ptr, dy_ptr, dx_ptr, n_rows, n_cols,
    stride_y_row, stride_dy_row, stride_dx_row,
    LOG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,  # as in the forward
    REREAD: tl.constexpr,  # load y and dy again for dx (from L2) instead of holding them (ops.BWD_REREAD_*)
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    stride_dy_row = multiple_of(stride_dy_row, ALIGN)
    stride_dx_row = multiple_of(stride_dx_row, ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    # masked lanes load 0 (not -inf): they must add nothing to the sums below. y and dy stay in
    # their own dtype between the reduction and the elementwise pass, converted at each use:
    # half the registers of float32 copies for 16-bit rows (up to ops.WIDE_ROWS_MAX_COLS
    # columns), 0.5-1.5% faster on an H100 at 24576-32768 bf16 columns (scratch).
    y = tl.load(y_ptr + rows[:, None] * stride_y_row + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_last" if REREAD else "")
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0,
                 eviction_policy="evict_last" if REREAD else "")
    if LOG:
        dot = tl.sum(dy.to(tl.float32), axis=1)[:, None]
    else:
        dot = tl.sum(y.to(tl.float32) * dy.to(tl.float32), axis=1)[:, None]
    if REREAD:  # the tile's lines were just read: L2 hits, and no registers held across the sum
        y = tl.load(y_ptr + rows[:, None] * stride_y_row + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first")
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0,
                     eviction_policy="evict_first")
    dx = _grad_from_dot(y.to(tl.float32), dy.to(tl.float32), dot, LOG)
    tl.store(dx_ptr + rows[:, None] * stride_dx_row + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["clear_len"])
def _softmax_bwd_coop_kernel(
    y_ptr, dy_ptr, dx_ptr,
    sync_ptr,  # as in the forward; a word holds a chunk's reduction (lo) and 1.0 (hi: never 0)
    clear_ptr, clear_len,  # as in the forward
    n_rows, n_cols, stride_y_row, stride_dy_row, stride_dx_row,
    n_splits,
    LOG: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    ALIGN: tl.constexpr,  # as in the rows kernel
    WINDOW: tl.constexpr,  # as in the forward's cooperative kernel
    VEC: tl.constexpr,
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    stride_dy_row = multiple_of(stride_dy_row, ALIGN)
    stride_dx_row = multiple_of(stride_dx_row, ALIGN)
    row, split = coop_ticket(sync_ptr, n_splits, clear_ptr, clear_len)
    y_first, lo, hi, end = _row_window(row * stride_y_row, n_cols, WINDOW, VEC)
    dy_first, _, _, _ = _row_window(row * stride_dy_row, n_cols, WINDOW, VEC)
    dx_first, _, _, _ = _row_window(row * stride_dx_row, n_cols, WINDOW, VEC)
    cols = split * CHUNK + tl.arange(0, CHUNK)
    mask = cols < end
    y = _in_row(tl.load(y_ptr + y_first + cols, mask=mask, other=0.0).to(tl.float32), cols, lo, hi, 0.0, WINDOW)
    dy = _in_row(tl.load(dy_ptr + dy_first + cols, mask=mask, other=0.0).to(tl.float32), cols, lo, hi, 0.0, WINDOW)
    if LOG:
        part = tl.sum(dy, axis=0)
    else:
        part = tl.sum(y * dy, axis=0)
    words = coop_publish_and_gather(sync_ptr, n_rows, row, split, n_splits, part,
                                    tl.full([], 1.0, tl.float32), SPLITS_POW2)
    dot = tl.sum(tl.where(tl.arange(0, SPLITS_POW2) < n_splits, coop_word_lo(words), 0.0), axis=0)
    chunk_start = split * CHUNK
    _store_row(dx_ptr + dx_first, cols, _grad_from_dot(y, dy, dot, LOG), chunk_start, end, lo, hi, "", WINDOW, VEC)
    if WINDOW:
        _write_grad_row_ends(y_ptr + y_first, dy_ptr + dy_first, dx_ptr + dx_first, chunk_start,
                             tl.minimum(chunk_start + CHUNK, end), lo, hi, dot, LOG, VEC)


@triton.jit
def _softmax_bwd_looped_kernel(
    y_ptr, dy_ptr, dx_ptr, n_cols,
    stride_y_row, stride_dy_row, stride_dx_row,
    LOG: tl.constexpr,
    KEEP_IN_L2: tl.constexpr,  # as in the forward's looped kernel (rows of ops.BWD_L2_LOOP_ROW_BYTES)
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,  # as in the rows kernel
    PREFETCH: tl.constexpr,  # the _prefetched_* loops (ops.BWD_L2_LOOP_LONG; never with WINDOW)
    WINDOW: tl.constexpr,  # as in the forward's cooperative kernel
    VEC: tl.constexpr,
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    stride_dy_row = multiple_of(stride_dy_row, ALIGN)
    stride_dx_row = multiple_of(stride_dx_row, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    y_first, lo, hi, end = _row_window(row * stride_y_row, n_cols, WINDOW, VEC)
    dy_first, _, _, _ = _row_window(row * stride_dy_row, n_cols, WINDOW, VEC)
    dx_first, _, _, _ = _row_window(row * stride_dx_row, n_cols, WINDOW, VEC)
    y_row_ptr = y_ptr + y_first
    dy_row_ptr = dy_ptr + dy_first
    dx_row_ptr = dx_ptr + dx_first
    if PREFETCH:
        dot = _prefetched_grad_dot(y_row_ptr, dy_row_ptr, 0, n_cols, LOG, BLOCK_N,
                                   EVICTION="evict_last" if KEEP_IN_L2 else "")
        _prefetched_write_grad(y_row_ptr, dy_row_ptr, dx_row_ptr, 0, n_cols, dot, LOG, BLOCK_N,
                               EVICTION="evict_first" if KEEP_IN_L2 else "")
    else:
        dot = _chunk_grad_dot(y_row_ptr, dy_row_ptr, 0, end, lo, hi, LOG, BLOCK_N,
                              EVICTION="evict_last" if KEEP_IN_L2 else "", WINDOW=WINDOW)
        _write_grad(y_row_ptr, dy_row_ptr, dx_row_ptr, 0, end, lo, hi, dot, LOG, BLOCK_N,
                    EVICTION="evict_first" if KEEP_IN_L2 else "", WINDOW=WINDOW, VEC=VEC)


@triton.jit
def _softmax_bwd_partial_kernel(
    y_ptr, dy_ptr, dot_ptr,  # dot: (n_rows, n_splits) float32
    n_cols, stride_y_row, stride_dy_row, chunk,
    n_splits,
    LOG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,  # as in the rows kernel
    WINDOW: tl.constexpr,  # as in the forward's cooperative kernel
    VEC: tl.constexpr,
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    stride_dy_row = multiple_of(stride_dy_row, ALIGN)
    chunk = multiple_of(chunk, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    y_first, lo, hi, row_end = _row_window(row * stride_y_row, n_cols, WINDOW, VEC)
    dy_first, _, _, _ = _row_window(row * stride_dy_row, n_cols, WINDOW, VEC)
    start = split * chunk
    end = tl.minimum(start + chunk, row_end)
    dot = _chunk_grad_dot(y_ptr + y_first, dy_ptr + dy_first, start, end, lo, hi, LOG, BLOCK_N, EVICTION="",
                          WINDOW=WINDOW)
    tl.store(dot_ptr + row * n_splits + split + tl.arange(0, 1), dot)


@triton.jit
def _softmax_bwd_split_kernel(
    y_ptr, dy_ptr, dx_ptr, dot_ptr,
    n_cols, stride_y_row, stride_dy_row, stride_dx_row, chunk,
    n_splits,
    LOG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    ALIGN: tl.constexpr,  # as in the rows kernel
    WINDOW: tl.constexpr,  # as in the forward's cooperative kernel
    VEC: tl.constexpr,
):
    n_cols = multiple_of(n_cols, ALIGN)
    stride_y_row = multiple_of(stride_y_row, ALIGN)
    stride_dy_row = multiple_of(stride_dy_row, ALIGN)
    stride_dx_row = multiple_of(stride_dx_row, ALIGN)
    chunk = multiple_of(chunk, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    idx = tl.arange(0, SPLITS_POW2)
    dot = tl.sum(tl.load(dot_ptr + row * n_splits + idx, mask=idx < n_splits, other=0.0), axis=0)
    y_first, lo, hi, row_end = _row_window(row * stride_y_row, n_cols, WINDOW, VEC)
    dy_first, _, _, _ = _row_window(row * stride_dy_row, n_cols, WINDOW, VEC)
    dx_first, _, _, _ = _row_window(row * stride_dx_row, n_cols, WINDOW, VEC)
    start = split * chunk
    end = tl.minimum(start + chunk, row_end)
    _write_grad(y_ptr + y_first, dy_ptr + dy_first, dx_ptr + dx_first, start, end, lo, hi, dot, LOG, BLOCK_N,
                EVICTION="", WINDOW=WINDOW, VEC=VEC)
