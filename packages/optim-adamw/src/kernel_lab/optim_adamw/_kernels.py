"""Triton kernels of the multi-tensor AdamW step (one launch updates a whole list of tensors)."""

import triton
import triton.language as tl

# Rows of the pointer table: per tensor and row, the int64 byte offset of the tensor's data from
# the table's own first byte (see _tensor_pointer and ops._ptr_table); the last row is not an
# address but a counter per tensor (see _next_step), zero between launches.
# (constexpr globals: a @triton.jit function may only read globals that are tl.constexpr).
ROW_PARAM = tl.constexpr(0)
ROW_GRAD = tl.constexpr(1)
ROW_EXP_AVG = tl.constexpr(2)
ROW_EXP_AVG_SQ = tl.constexpr(3)
ROW_MAX_EXP_AVG_SQ = tl.constexpr(4)
ROW_MASTER = tl.constexpr(5)
ROW_STEP = tl.constexpr(6)
ROW_ARRIVALS = tl.constexpr(7)
NUM_ROWS = 8


@triton.jit
def _round_to_bfloat16(x):
    """fp32 -> bf16 with round-to-nearest-even done on the bits.

    The Triton interpreter truncates fp32 -> bf16 casts (numpy has no bfloat16), so the
    explicit rounding keeps the CPU tests and the GPU kernel bit-identical. NaN stays NaN
    (adding the rounding bias to a NaN's mantissa could carry it into infinity).
    """
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_storage(x, DTYPE: tl.constexpr):
    """A float32 result rounded to nearest even in the storage dtype of a param or moment."""
    if DTYPE == tl.bfloat16:
        return _round_to_bfloat16(x)
    else:
        return x.to(DTYPE)


@triton.jit
def _tensor_pointer(ptr_table, row, num_tensors, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Tensor t's address, from `row` of the table, as a pointer to DTYPE.

    The table holds byte offsets from its own first byte, not addresses: the compiler knows the
    alignment of a pointer argument (16 bytes when the launcher's tensor is), but not of an
    address loaded from memory and cast to a pointer, and without a known alignment it issues
    every access element by element (LDG.E.U16 for bfloat16: 2 bytes per instruction).
    ALIGNED: the host checked that every address of the launch is a multiple of 16 bytes.
    """
    offset = tl.load(ptr_table + row * num_tensors + t)
    if ALIGNED:
        offset = tl.multiple_of(offset, 16)
    return (ptr_table.to(tl.pointer_type(tl.int8)) + offset).to(tl.pointer_type(DTYPE))


@triton.jit
def _next_step(ptr_table, num_tensors, t, num_chunks):
    """Tensor t's step number for this update: its stored count + 1, as float32 (torch.optim
    increments the count, then updates); the count in memory is incremented too, in this launch.

    Every program of tensor t reads the count, so only the last of them may write it: each
    counts itself in on the tensor's counter after its read (release: the read happens before
    the count), and the program that completes the count re-arms the counter to zero for the
    next launch (acquire: it has seen every count, so every read, before its write) and stores
    count + 1. Only that program pays for the acquire (an L1 invalidation; acq_rel on every
    program's count cost up to 10% of a 1B-parameter bfloat16-state step on an H200). This
    replaces a separate increment launch (torch's fused AdamW runs a `_foreach_add_` first).
    """
    step_ptr = _tensor_pointer(ptr_table, ROW_STEP, num_tensors, t, tl.float32, False)
    step = tl.load(step_ptr) + 1.0
    arrivals = ptr_table + ROW_ARRIVALS * num_tensors + t
    if tl.atomic_add(arrivals, 1, sem="release") == num_chunks - 1:
        tl.atomic_xchg(arrivals, 0, sem="acquire")
        tl.store(step_ptr, step)
    return step


@triton.jit
def _update_block(
    p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, master_ptr, offs, end,
    step_size, bias_correction2_sqrt, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps,
    PARAM_DTYPE: tl.constexpr, STATE_DTYPE: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    MASTER: tl.constexpr, MASKED: tl.constexpr,
):
    """The update of the elements `offs` (BLOCK of them, contiguous). MASKED: only those below
    `end` (the tensor's last block); unmasked blocks keep their 16-byte vector accesses, which a
    mask whose bound has unknown alignment would break up."""
    if MASKED:
        mask = offs < end
    else:
        mask = None
    if MASTER:
        p = tl.load(master_ptr + offs, mask=mask)
    else:
        p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    if MAXIMIZE:
        g = -g
    p = p * decay
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    if AMSGRAD:
        # NaN propagates as in torch.maximum (a plain max would keep the old, finite v_max)
        v_max = tl.maximum(tl.load(vmax_ptr + offs, mask=mask).to(tl.float32), v, propagate_nan=tl.PropagateNan.ALL)
        tl.store(vmax_ptr + offs, _to_storage(v_max, STATE_DTYPE), mask=mask)
        denom = tl.div_rn(tl.sqrt_rn(v_max), bias_correction2_sqrt) + eps
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    # IEEE sqrt and division (tl.sqrt / '/' may lower to approximate PTX): the same
    # rounding as torch's kernels, so float32 results agree to an ulp or two.
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(m_ptr + offs, _to_storage(m, STATE_DTYPE), mask=mask)
    tl.store(v_ptr + offs, _to_storage(v, STATE_DTYPE), mask=mask)
    if MASTER:
        tl.store(master_ptr + offs, p, mask=mask)
    tl.store(p_ptr + offs, _to_storage(p, PARAM_DTYPE), mask=mask)


@triton.jit
def _adamw_multi_tensor_kernel(
    ptr_table,  # int64 [8, num_tensors]: byte offsets from ptr_table of param, grad, exp_avg, exp_avg_sq,
    #             max_exp_avg_sq, master, step; then the step counters' arrival counts (zeros)
    numels,  # int64 [num_tensors]
    work_table,  # int64 [num_programs]: (tensor index << 32) | chunk index within that tensor
    num_tensors,
    lr,  # float learning rate (LR_FROM_PTR=False)
    lr_ptr,  # 1-element tensor holding the learning rate (LR_FROM_PTR=True)
    step,  # float 1-based step number (STEP_FROM_PTR=False); else each tensor's step count is
    #        read from ROW_STEP, and incremented (_next_step)
    beta1,
    beta2,
    one_minus_beta1,  # 1 - beta1 computed in float64 on the host: fp32(1 - fp32(beta)) loses ~1e-5 for beta2=0.999
    one_minus_beta2,
    log_beta1,  # log(beta1) from the host (float64 -> fp32), -inf for beta1 == 0
    log_beta2,
    eps,
    weight_decay,
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    STATE_DTYPE: tl.constexpr,  # exp_avg, exp_avg_sq (and max_exp_avg_sq): float32 or bfloat16
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    MASTER: tl.constexpr,  # float32 master weights: read/write master, also write the rounded param
    LR_FROM_PTR: tl.constexpr,
    STEP_FROM_PTR: tl.constexpr,
    ALIGNED: tl.constexpr,  # every tensor address is a multiple of 16 bytes
    CHUNK: tl.constexpr,  # elements per program
    BLOCK: tl.constexpr,  # elements per loop iteration
):
    """One AdamW update of CHUNK elements of one tensor (see kernel_lab.shared.reference.adamw_step).

    Every element is read once (param or master, grad, exp_avg, exp_avg_sq[, max_exp_avg_sq])
    and written once; the math is float32 whatever the storage dtypes, the scalars float64.
    """
    work = tl.load(work_table + tl.program_id(0))
    t = work >> 32
    start = (work & 0xFFFFFFFF) * CHUNK  # int64: a tensor may exceed 2**31 elements
    numel = tl.load(numels + t)
    end = tl.minimum(start + CHUNK, numel)

    p_ptr = _tensor_pointer(ptr_table, ROW_PARAM, num_tensors, t, PARAM_DTYPE, ALIGNED)
    g_ptr = _tensor_pointer(ptr_table, ROW_GRAD, num_tensors, t, GRAD_DTYPE, ALIGNED)
    m_ptr = _tensor_pointer(ptr_table, ROW_EXP_AVG, num_tensors, t, STATE_DTYPE, ALIGNED)
    v_ptr = _tensor_pointer(ptr_table, ROW_EXP_AVG_SQ, num_tensors, t, STATE_DTYPE, ALIGNED)

    if STEP_FROM_PTR:
        num_chunks = tl.maximum(tl.cdiv(numel, CHUNK), 1)  # an empty tensor has one program (ops._work_tables)
        step64 = _next_step(ptr_table, num_tensors, t, num_chunks).to(tl.float64)
    else:
        step64 = tl.cast(step, tl.float64)
    if LR_FROM_PTR:
        lr64 = tl.load(lr_ptr).to(tl.float64)
    else:
        lr64 = tl.cast(lr, tl.float64)
    # Scalars once per program in float64, as torch's fused kernel does: 1 - beta2**step is
    # 1e-3 at step 1, and float32 would cost it five significant digits.
    bias_correction1 = 1.0 - tl.exp(step64 * tl.cast(log_beta1, tl.float64))
    bias_correction2 = 1.0 - tl.exp(step64 * tl.cast(log_beta2, tl.float64))
    step_size = (lr64 / bias_correction1).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(bias_correction2).to(tl.float32)
    decay = (1.0 - lr64 * tl.cast(weight_decay, tl.float64)).to(tl.float32)

    vmax_ptr = m_ptr  # placeholders, unused without AMSGRAD / MASTER
    master_ptr = m_ptr
    if AMSGRAD:
        vmax_ptr = _tensor_pointer(ptr_table, ROW_MAX_EXP_AVG_SQ, num_tensors, t, STATE_DTYPE, ALIGNED)
    if MASTER:
        master_ptr = _tensor_pointer(ptr_table, ROW_MASTER, num_tensors, t, tl.float32, ALIGNED)
    full_end = start + (end - start) // BLOCK * BLOCK
    for off in range(start, full_end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        if ALIGNED:  # off is a multiple of BLOCK: chunks are, and blocks step through them
            offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
        _update_block(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, master_ptr, offs, end, step_size, bias_correction2_sqrt,
                      decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps,
                      PARAM_DTYPE, STATE_DTYPE, AMSGRAD, MAXIMIZE, MASTER, MASKED=False)
    if full_end < end:
        _update_block(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, master_ptr, full_end + tl.arange(0, BLOCK), end,
                      step_size, bias_correction2_sqrt, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps,
                      PARAM_DTYPE, STATE_DTYPE, AMSGRAD, MAXIMIZE, MASTER, MASKED=True)
