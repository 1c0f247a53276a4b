"""softmax / log_softmax against the float64 reference, with the FlashAttention tolerance rule.

Tiers (see kernel_lab.shared.pytest_plugin): unmarked tests check input validation and the
reference backend; `interpret` tests run the real Triton kernels on small shapes (CPU under
TRITON_INTERPRET=1, or CUDA); `gpu` tests run LLM-sized shapes and torch.compile.
"""

import numpy as np
import pytest
import torch

import kernel_lab.softmax.ops as ops
from kernel_lab.shared import reference, runtime, testing
from kernel_lab.shared.vector_hints import vector_alignment
from kernel_lab.softmax import LogSoftmax, Softmax, log_softmax, softmax

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = {
    "softmax": (softmax, torch.softmax, reference.softmax, reference.softmax_backward),
    "log_softmax": (log_softmax, torch.log_softmax, reference.log_softmax, reference.log_softmax_backward),
}
# Factor 2 of the tolerance rule (docs/correctness.md) on the forward. The backward's reduction sum(y * dy) over a row
# accumulates in a different order than PyTorch's, and its cancellation error scales with the row
# length; factor 3 covers that (docs/correctness.md).
FWD_FACTOR, BWD_FACTOR = 2.0, 3.0


@pytest.fixture
def small_blocks(monkeypatch):
    """Shrink the thresholds so tiny inputs take the long-row paths: looped and split in the
    interpreter, the cooperative kernel (with many chunks per row) on CUDA."""

    def shrink(max_fused: int, loop_block: int) -> None:
        monkeypatch.setattr(ops, "_PLANS", {})  # plans made with the other thresholds
        monkeypatch.setattr(ops, "_EAGER_ROWS", {})  # and launches remembered from them
        testing.fresh_launch_plans(monkeypatch)  # and the launch plans keyed without them
        monkeypatch.setattr(ops, "FWD_MAX_FUSED_COLS", max_fused)
        monkeypatch.setattr(ops, "BWD_MAX_FUSED_COLS", max_fused)
        monkeypatch.setattr(ops, "WIDE_ROWS_MAX_COLS", max_fused)  # no rows kernel past max_fused either
        for name in ("LOOP_BLOCK_N", "BWD_LOOP_BLOCK_N", "SPLIT_BLOCK_N", "COOP_CHUNK", "BWD_COOP_CHUNK",
                     "LOG_BWD_COOP_CHUNK", "ODD_COOP_CHUNK", "BWD_ODD_COOP_CHUNK"):
            monkeypatch.setattr(ops, name, loop_block)

    return shrink


def check_forward_and_backward(op_name, x, dim=-1, *, grad=True, seed=0):
    """Run the kernel forward (and backward) on x and assert the rule against the reference."""
    ours, torch_op, ref_fwd, ref_bwd = OPS[op_name]
    xg = x.detach().clone().requires_grad_(grad)
    y = ours(xg, dim, backend="triton")
    assert y.dtype == x.dtype and y.shape == x.shape
    ref = ref_fwd(x, dim)
    baseline = torch_op(x.detach(), dim)
    testing.assert_close_to_reference(y, ref, baseline, factor=FWD_FACTOR, name=f"{op_name} forward")
    if not grad:
        return
    dy = testing.randn(*x.shape, dtype=x.dtype, device=x.device, seed=seed + 1)
    (dx,) = torch.autograd.grad(y, xg, dy)
    ref_dx = ref_bwd(ref, dy, dim)
    xb = x.detach().clone().requires_grad_(True)
    (baseline_dx,) = torch.autograd.grad(torch_op(xb, dim), xb, dy)
    testing.assert_close_to_reference(dx, ref_dx, baseline_dx, factor=BWD_FACTOR, name=f"{op_name} backward")


def check_forward_in_place_and_strided(op_name, x, what):
    """The forward of x (row 0 fully masked) and of a copy of x in NaN-padded rows (a read past
    a row would show) against the reference; torch's NaN on the masked row is not its budget."""
    n_rows, n_cols = x.shape
    base = torch.full((n_rows, n_cols + 13), float("nan"), dtype=x.dtype, device=x.device)
    base[:, :n_cols] = x
    ours, torch_op, ref_fwd, _ = OPS[op_name]
    ref = ref_fwd(x)
    baseline = torch_op(x, -1)
    baseline[0] = ref[0].to(x.dtype)  # torch gives NaN on the fully masked row (see the README)
    for inp in (x, base[:, :n_cols]):
        y = ours(inp, backend="triton")
        testing.assert_close_to_reference(y, ref, baseline, factor=FWD_FACTOR, name=f"{op_name} {what}")


# --- reference tier: validation and the reference backend --------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.float64])
def test_unsupported_dtype_raises_type_error(dtype):
    with pytest.raises(TypeError, match=r"x\.dtype must be float16, bfloat16 or float32"):
        softmax(torch.zeros(3, 4, dtype=dtype))


@pytest.mark.parametrize("dim", [2, -3, 10])
def test_dim_out_of_range_raises_value_error(dim):
    with pytest.raises(ValueError, match="out of range"):
        log_softmax(torch.zeros(3, 4), dim)


def test_non_int_dim_and_non_tensor_raise_type_error():
    with pytest.raises(TypeError, match="dim must be an int"):
        softmax(torch.zeros(3), 0.0)
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        softmax([1.0, 2.0])


@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("dim", [np.int64(0), np.int32(-1), torch.tensor(1)], ids=["np.int64", "np.int32", "tensor"])
def test_integer_like_dim_is_accepted_as_in_torch(op_name, dim, seed):
    """torch.softmax takes any integer with __index__ (a numpy int from a shape computation, a
    0-d integer tensor); it used to raise TypeError here. bool and float stay TypeError."""
    ours, torch_op, ref_fwd, _ = OPS[op_name]
    x = testing.randn(4, 7, seed=seed)
    y = ours(x, dim)
    testing.assert_close_to_reference(y, ref_fwd(x, int(dim)), torch_op(x, dim), name=op_name)
    for bad in (True, 1.0, torch.tensor(1.0)):
        with pytest.raises(TypeError, match="dim must be an int"):
            ours(x, bad)


@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("backend", [None, "reference"])
@pytest.mark.parametrize("shape, dim", [((4, 0), -1), ((0, 3), 0), ((3, 0, 2), 1)])
def test_zero_length_dim_on_the_reference_path(op_name, backend, shape, dim, monkeypatch):
    """The CPU fallback (and backend="reference") on a zero-length softmax dim: an empty result
    and an empty gradient, as torch gives; it raised the reference's IndexError from amax."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # backend=None: the CPU fallback, not the kernel
    ours, torch_op, _, _ = OPS[op_name]
    x = torch.zeros(shape, requires_grad=True)
    y = ours(x, dim, backend=backend)
    assert y.shape == torch_op(x.detach(), dim).shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1"):
        softmax(torch.zeros(3, 4), backend="triton")
    with pytest.raises(ValueError, match="backend must be"):
        softmax(torch.zeros(3, 4), backend="cuda")


@pytest.mark.parametrize("op_name", list(OPS))
def test_reference_backend_matches_reference_with_grad(op_name, seed):
    ours, torch_op, ref_fwd, ref_bwd = OPS[op_name]
    x = testing.randn(6, 33, seed=seed, requires_grad=True)
    y = ours(x, 0, backend="reference")
    ref = ref_fwd(x.detach(), 0)
    testing.assert_close_to_reference(y, ref, torch_op(x.detach(), 0))
    # differentiable through the reference path too
    dy = testing.randn(6, 33, seed=seed + 1)
    (dx,) = torch.autograd.grad(y, x, dy)
    xb = x.detach().clone().requires_grad_(True)
    (baseline_dx,) = torch.autograd.grad(torch_op(xb, 0), xb, dy)
    testing.assert_close_to_reference(dx, ref_bwd(ref, dy, 0), baseline_dx, factor=BWD_FACTOR)


def test_modules_wrap_the_ops(seed):
    x = testing.randn(4, 9, seed=seed)
    m = Softmax(dim=0)
    assert "dim=0" in repr(m)
    testing.assert_close_to_reference(m(x), reference.softmax(x, 0), torch.softmax(x, 0))
    testing.assert_close_to_reference(LogSoftmax(-1)(x), reference.log_softmax(x), torch.log_softmax(x, -1))


def test_registered_ops_pass_opcheck(seed, monkeypatch, kernel_device):
    # Fake-tensor tracing cannot run the interpreter (it reads real data): on the CPU this checks
    # the registration around the reference backend; on CUDA, around the Triton kernel.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = testing.randn(3, 17, device=kernel_device, seed=seed, requires_grad=True)
    torch.library.opcheck(torch.ops.kernel_lab.softmax_fwd.default, (x, 1, False))
    torch.library.opcheck(torch.ops.kernel_lab.softmax_fwd.default, (x, 0, True))
    y = torch.softmax(x.detach(), 1)
    torch.library.opcheck(torch.ops.kernel_lab.softmax_bwd.default, (y, torch.randn_like(y), 1, False))


# --- interpret tier: the real kernels on small shapes -------------------------------------------


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (17, 1000), (2, 3, 130)])
def test_rows_kernel_matches_reference(op_name, dtype, shape, kernel_device, seed):
    x = testing.randn(*shape, dtype=dtype, device=kernel_device, seed=seed, scale=3.0)
    check_forward_and_backward(op_name, x, seed=seed)


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
def test_repeated_call_takes_remembered_rows_launch(op_name, kernel_device, seed, monkeypatch):
    """A call on a contiguous input of a shape, dtype, device and 16-byte alignment seen before
    launches the remembered rows-kernel launch (ops._EAGER_ROWS) without planning; other
    layouts, another dim, another alignment and the other op plan. Every result on fresh values
    against the reference."""
    monkeypatch.setattr(ops, "_EAGER_ROWS", {})
    planned = []
    plan = ops._plan
    monkeypatch.setattr(ops, "_plan", lambda *args: planned.append(args) or plan(*args))
    ours, torch_op, ref_fwd, _ = OPS[op_name]
    shape = (3, 5, 130)

    def check(x, dim=-1, *, plans: bool):
        before = len(planned)
        y = ours(x, dim, backend="triton")
        assert (len(planned) > before) == plans
        testing.assert_close_to_reference(y, ref_fwd(x, dim), torch_op(x, dim), factor=FWD_FACTOR,
                                          name=f"{op_name} remembered launch")

    def fresh(scale):
        return testing.randn(*shape, dtype=torch.float16, device=kernel_device, seed=seed + int(scale), scale=scale)

    check(fresh(2.0), plans=True)
    assert len(ops._EAGER_ROWS) == 1
    check(fresh(3.0), plans=False)
    check(fresh(4.0).requires_grad_(True), plans=False)  # the autograd forward launches it too
    padded = torch.full((*shape[:-1], 144), float("nan"), dtype=torch.float16, device=kernel_device)
    padded[..., :130] = fresh(5.0)
    check(padded[..., :130], plans=True)  # rows 144 apart: not contiguous
    check(fresh(6.0), 1, plans=True)
    flat = torch.full((3 * 5 * 130 + 1,), float("nan"), dtype=torch.float16, device=kernel_device)
    flat[1:] = fresh(7.0).flatten()
    check(flat[1:].view(shape), plans=True)  # 2 bytes past a 16-byte boundary
    other = "log_softmax" if op_name == "softmax" else "softmax"
    before = len(planned)
    OPS[other][0](fresh(8.0))
    assert len(planned) > before


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("dim", [0, 1])
def test_non_last_dim_matches_reference(op_name, dim, kernel_device, seed):
    x = testing.randn(5, 67, 3, dtype=torch.float16, device=kernel_device, seed=seed)
    check_forward_and_backward(op_name, x, dim, seed=seed)


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize(
    "n_rows, n_cols, path",
    [(40, 300, "looped"), (3, 300, "split"), (2, 77, "split"), (1, 1001, "split")],
)
def test_long_row_paths_match_reference(op_name, n_rows, n_cols, path, small_blocks, kernel_device, seed):
    # max fused 64 and 32-column steps: rows of 300 columns loop 10 times, masked tails included
    small_blocks(64, 32)
    plan = ops._plan(n_rows, n_cols, 64, ops.FWD_ROWS_TILE, torch.device("cpu"), 32, 32, 4)
    assert plan.kind == path or kernel_device == "cuda"
    x = testing.randn(n_rows, n_cols, dtype=torch.bfloat16, device=kernel_device, seed=seed, scale=4.0)
    check_forward_and_backward(op_name, x, seed=seed)


@pytest.mark.interpret
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("n_cols, block_n, pad", [(300, 64, 0), (256, 64, 0), (40, 64, 0), (64, 64, 0),
                                                  (300, 64, 13)])
def test_prefetching_looped_backward_matches_reference(log, n_cols, block_n, pad, kernel_device, seed):
    """The backward's looped kernel with one step of prefetch (ops.BWD_L2_LOOP_LONG's rows, which
    only CUDA plans): several steps with a masked tail (300), whole steps (256), one step (64),
    and a row shorter than a step (40), launched directly; pad: y and dy as views of NaN-padded
    rows (a read past a row's end would show)."""
    from kernel_lab.softmax._kernels import _softmax_bwd_looped_kernel

    n_rows = 3
    x = testing.randn(n_rows, n_cols, dtype=torch.float16, device=kernel_device, seed=seed, scale=4.0)
    ref_fwd, ref_bwd = (reference.log_softmax, reference.log_softmax_backward) if log else (
        reference.softmax, reference.softmax_backward)
    y_buf = torch.full((n_rows, n_cols + pad), float("nan"), dtype=x.dtype, device=kernel_device)
    dy_buf = torch.full_like(y_buf, float("nan"))
    y, dy = y_buf[:, :n_cols], dy_buf[:, :n_cols]
    y.copy_(ref_fwd(x))
    dy.copy_(testing.randn(n_rows, n_cols, dtype=x.dtype, device=kernel_device, seed=seed + 1))
    dx = torch.full((n_rows, n_cols), float("nan"), dtype=x.dtype, device=kernel_device)
    _softmax_bwd_looped_kernel[(n_rows,)](
        y, dy, dx, n_cols, y.stride(0), dy.stride(0), n_cols, LOG=log, KEEP_IN_L2=True, BLOCK_N=block_n, ALIGN=1,
        PREFETCH=True, WINDOW=False, VEC=8,
    )
    torch_bwd = torch._softmax_backward_data if not log else torch._log_softmax_backward_data
    baseline = torch_bwd(dy, y, -1, y.dtype)
    testing.assert_close_to_reference(dx, ref_bwd(y, dy, -1), baseline, factor=BWD_FACTOR,
                                      name=f"prefetching looped backward (log={log})")


def check_wide_rows(op_name, x, seed):
    """Forward and backward of x with -inf entries in row 1, then the forward in place and
    strided with row 0 fully masked too (the wide rows tests)."""
    x[1, ::3] = float("-inf")
    check_forward_and_backward(op_name, x, seed=seed)
    x[0] = float("-inf")  # fully masked row
    check_forward_in_place_and_strided(op_name, x, "wide rows forward")


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
def test_wide_rows_past_the_fused_limits_match_reference(op_name, kernel_device, seed):
    """Few rows just past both directions' fused limits: one program a row, the whole row in one
    block of ops.WIDE_ROWS_MAX_COLS (a masked tail of 16381 columns), not cut across programs."""
    n_rows, n_cols = 3, ops.FWD_MAX_FUSED_COLS + 3
    for max_fused, tile, wide_warps in ((ops.FWD_MAX_FUSED_COLS, ops.FWD_ROWS_TILE, ops.FWD_WIDE_ROWS_NUM_WARPS),
                                        (ops.BWD_MAX_FUSED_COLS, ops.BWD_ROWS_TILE, ops.BWD_WIDE_ROWS_NUM_WARPS)):
        plan = ops._plan(n_rows, n_cols, max_fused, tile, torch.device(kernel_device), 1024, 1024, 4, None, 0,
                         wide_warps)
        assert (plan.kind, plan.block_m, plan.block_n, plan.num_warps) == ("rows", 1, ops.WIDE_ROWS_MAX_COLS,
                                                                           wide_warps)
    check_wide_rows(op_name, testing.randn(n_rows, n_cols, dtype=torch.float16, device=kernel_device, seed=seed,
                                           scale=4.0), seed)


def _bwd_plan(n_rows, n_cols, dtype, device):
    """The backward's plan as softmax_bwd makes it for contiguous rows of even length."""
    return ops._plan(n_rows, n_cols, ops.BWD_MAX_FUSED_COLS, ops.BWD_ROWS_TILE, device, ops.BWD_LOOP_BLOCK_N,
                     ops.BWD_COOP_CHUNK, ops.BWD_COOP_NUM_WARPS, ops._bwd_l2_loop(n_cols, 2 * dtype.itemsize), 0,
                     ops.BWD_WIDE_ROWS_NUM_WARPS, dtype.itemsize <= 2)


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
def test_backward_rows_kernel_rereading_its_rows_matches_reference(op_name, kernel_device, seed, monkeypatch):
    """Many 16-bit rows past the backward's fused limit that fill their block: the rows kernel
    loads y and dy again for dx (ops.BWD_REREAD_*), here with the limits shrunk to 32 / 64
    columns. Rows that fill part of their block, fewer rows and float32 rows hold theirs."""
    monkeypatch.setattr(ops, "_PLANS", {})
    monkeypatch.setattr(ops, "_EAGER_ROWS", {})
    testing.fresh_launch_plans(monkeypatch)
    monkeypatch.setattr(ops, "BWD_MAX_FUSED_COLS", 32)
    monkeypatch.setattr(ops, "WIDE_ROWS_MAX_COLS", 64)
    monkeypatch.setattr(ops, "BWD_REREAD_MIN_ROWS_PER_SM", 2)
    device = torch.device(kernel_device)
    n_rows = 2 * runtime.sm_count(device)
    for rows, cols, dtype, reread in ((n_rows, 64, torch.float16, True), (n_rows, 48, torch.float16, False),
                                      (n_rows - 1, 64, torch.bfloat16, False), (n_rows, 64, torch.float32, False)):
        plan = _bwd_plan(rows, cols, dtype, device)
        assert (plan.kind, plan.block_n, plan.reread) == ("rows", 64, reread), (rows, cols, dtype, plan)
    for dtype in (torch.float16, torch.bfloat16):
        x = testing.randn(n_rows, 64, dtype=dtype, device=kernel_device, seed=seed, scale=4.0)
        x[1, ::3] = float("-inf")
        check_forward_and_backward(op_name, x, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("n_cols, dtype", [(32768, torch.bfloat16), (16384, torch.float16)])
def test_backward_rereading_rows_on_gpu_match_reference(op_name, n_cols, dtype, seed):
    """The rereading backward rows kernel at its own sizes: as many rows as the plan asks for."""
    n_rows = ops.BWD_REREAD_MIN_ROWS_PER_SM * torch.cuda.get_device_properties(0).multi_processor_count
    plan = _bwd_plan(n_rows, n_cols, dtype, torch.device("cuda"))
    assert plan.kind == "rows" and plan.reread and plan.num_warps == ops.BWD_REREAD_NUM_WARPS
    assert not _bwd_plan(n_rows - 1, n_cols, dtype, torch.device("cuda")).reread
    check_forward_and_backward(op_name, testing.randn(n_rows, n_cols, dtype=dtype, device="cuda", seed=seed,
                                                      scale=4.0), seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("n_rows, n_cols, dtype", [(7, 32768, torch.float32), (300, 20000, torch.bfloat16),
                                                  (64, 24568, torch.float16)])
def test_wide_rows_on_gpu_match_reference(op_name, n_rows, n_cols, dtype, seed):
    """The rows kernel at up to ops.WIDE_ROWS_MAX_COLS columns (few rows of even length: masked
    tails of 12768 and 8200 columns), float32 rows included (the backward holds two of them in
    registers: a spill would be slow, not wrong, but a row the compiler cannot place would fail
    to compile)."""
    check_wide_rows(op_name, testing.randn(n_rows, n_cols, dtype=dtype, device="cuda", seed=seed, scale=4.0), seed)


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("long_rows", [False, True])
def test_neg_inf_entries_and_fully_masked_rows(op_name, long_rows, small_blocks, kernel_device, seed):
    """-inf entries get probability 0; fully masked rows give 0 (softmax) / -inf (log_softmax)."""
    if long_rows:
        small_blocks(16, 16)
    x = testing.randn(6, 50, device=kernel_device, seed=seed)
    x[0] = float("-inf")  # fully masked row
    x[1, ::3] = float("-inf")
    x[2, 0] = float("-inf")
    x[3, :49] = float("-inf")  # a single live column
    y = OPS[op_name][0](x, backend="triton")
    testing.assert_close_to_reference(y, OPS[op_name][2](x), name=op_name)
    if op_name == "softmax":
        assert torch.equal(y[0], torch.zeros_like(y[0])) and (y[1, ::3] == 0).all()
        assert y[3, 49] == 1.0
    else:
        assert torch.isneginf(y[0]).all() and torch.isneginf(y[1, ::3]).all()


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("long_rows", [False, True])
def test_nan_and_inf_entries_propagate_as_in_torch(op_name, long_rows, small_blocks, kernel_device, seed):
    """A NaN or +inf entry makes its row NaN, as in torch (x - max is NaN at +inf): the
    fully-masked-row rule (0 / -inf) must not hide it. Other rows are untouched."""
    if long_rows:
        small_blocks(16, 16)
    x = testing.randn(4, 50, device=kernel_device, seed=seed)
    x[0, 7] = float("nan")
    x[1, 33] = float("inf")
    x[2, 3] = float("nan")
    x[2, :3] = float("-inf")
    y = OPS[op_name][0](x, backend="triton")
    expected = OPS[op_name][1](x, -1)
    assert torch.isnan(y[:3]).all() and torch.isnan(expected[:3]).all()
    assert torch.isnan(OPS[op_name][0](x.cpu(), backend="reference")[:3]).all()  # the CPU fallback too
    testing.assert_close_to_reference(y[3:], OPS[op_name][2](x[3:]), name=op_name)


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
def test_strided_rows_are_read_in_place(op_name, kernel_device, seed):
    base = testing.randn(9, 45, dtype=torch.float16, device=kernel_device, seed=seed)
    x = testing.strided_rows(base, pad=11)  # NaN padding: a read past the row would show
    assert ops._as_rows(x, 1).data_ptr() == x.data_ptr()  # no copy
    check_forward_and_backward(op_name, x, seed=seed)


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize(
    "n_cols, row_stride, offset, align",
    [(1000, 1008, 0, 8), (1004, 1008, 0, 4), (1002, 1008, 0, 2), (1001, 1001, 0, 1), (1000, 1008, 1, 8)],
    ids=["align8", "align4", "align2", "align1", "align8-misaligned-pointer"],
)
@pytest.mark.parametrize("long_rows", [False, True])
def test_every_vector_alignment(op_name, n_cols, row_stride, offset, align, long_rows, small_blocks, kernel_device,
                                seed):
    """The kernels tell the compiler which power of two divides the row length, strides and
    chunks (kernel_lab.shared.vector_hints): bf16 rows in each class, one a view whose first
    element is 2 bytes past a 16-byte boundary (strides aligned, the pointer not), padded with
    NaN; the rows kernels, then (long_rows) the long-row paths with 32-column chunks."""
    if long_rows:
        small_blocks(64, 32)
    base = torch.full((5, row_stride), float("nan"), dtype=torch.bfloat16, device=kernel_device)
    x = base[:, offset:offset + n_cols]
    x.copy_(testing.randn(5, n_cols, dtype=torch.bfloat16, device=kernel_device, seed=seed, scale=3.0))
    assert vector_alignment(x.element_size(), n_cols, x.stride(0)) == align
    assert ops._as_rows(x, 1).data_ptr() == x.data_ptr()  # read in place, not copied
    check_forward_and_backward(op_name, x, seed=seed)


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_rows, n_cols, path", [(40, 301, "looped"), (5, 301, "split"), (5, 77, "split")])
def test_odd_rows_read_through_windows_ignore_their_neighbours(op_name, dtype, n_rows, n_cols, path, small_blocks,
                                                              kernel_device, seed):
    """Contiguous rows of odd length: each starts at another place within a 16-byte vector, and
    the long-row kernels read it through an aligned window (ops._windowed), taking in up to a
    vector's worth of its neighbours' elements on either side. Row 1 is large (60: it would
    dominate a neighbour's max) and row 3 holds a NaN (it would poison a neighbour's sums):
    the other rows must match the reference, row 3 be NaN as in torch, and the writes must
    stop at each row's ends (the partial end vectors are written element by element)."""
    small_blocks(64, 32)
    plan = ops._plan(n_rows, n_cols, 64, ops.FWD_ROWS_TILE, torch.device("cpu"), 32, 32, 4)
    assert plan.kind == path or kernel_device == "cuda"
    x = testing.randn(n_rows, n_cols, dtype=dtype, device=kernel_device, seed=seed, scale=3.0)
    x[1] = 60.0
    x[3, n_cols // 2] = float("nan")
    assert ops._windowed(16 // x.element_size(), x, x)
    check_forward_and_backward(op_name, x, seed=seed)


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("n_rows, path", [(40, "looped"), (5, "split")])
def test_odd_rows_in_padded_views_share_windows_with_their_outputs(op_name, n_rows, path, small_blocks,
                                                                    kernel_device, seed):
    """Windows need every tensor's rows to start at the same place within a vector, not equal
    strides: bf16 rows of 301 columns read in place from rows padded by 8 (one vector) and by
    13 elements, the padding NaN. Padded by 8 the input's row r starts r * 309 elements in, its
    output's r * 301: both take windows, at different first elements (ops._windowed); padded
    by 13 they do not and are read element by element. Forward, then the backward launcher
    with y and dy in such views."""
    small_blocks(64, 32)
    n_cols = 301
    plan = ops._plan(n_rows, n_cols, 64, ops.FWD_ROWS_TILE, torch.device("cpu"), 32, 32, 4)
    assert plan.kind == path or kernel_device == "cuda"
    ours, torch_op, ref_fwd, ref_bwd = OPS[op_name]
    log = op_name == "log_softmax"
    x = testing.randn(n_rows, n_cols, dtype=torch.bfloat16, device=kernel_device, seed=seed, scale=3.0)
    dy = testing.randn(n_rows, n_cols, dtype=torch.bfloat16, device=kernel_device, seed=seed + 1)
    ref = ref_fwd(x)
    for pad, windowed in ((8, True), (13, False)):
        def padded(t, pad=pad):
            base = torch.full((n_rows, n_cols + pad), float("nan"), dtype=t.dtype, device=t.device)
            base[:, :n_cols] = t
            return base[:, :n_cols]

        xp = padded(x)
        assert ops._windowed(8, xp, x) == windowed
        testing.assert_close_to_reference(ours(xp, backend="triton"), ref, torch_op(x, -1), factor=FWD_FACTOR,
                                          name=f"{op_name} forward, rows padded by {pad}")
        y = ref.to(x.dtype)
        dx = ops.softmax_bwd(padded(y), padded(dy), 1, log)
        torch_bwd = torch._log_softmax_backward_data if log else torch._softmax_backward_data
        testing.assert_close_to_reference(dx, ref_bwd(y, dy), torch_bwd(dy, y, -1, y.dtype), factor=BWD_FACTOR,
                                          name=f"{op_name} backward, rows padded by {pad}")


@pytest.mark.interpret
def test_transposed_input_matches_reference(kernel_device, seed):
    x = testing.transposed_copy(testing.randn(33, 20, device=kernel_device, seed=seed))
    check_forward_and_backward("softmax", x, seed=seed)


@pytest.mark.interpret
@pytest.mark.parametrize("shape, dim", [((0, 5), -1), ((4, 0), -1), ((3, 0, 2), 0), ((), 0)])
def test_zero_size_and_scalar_inputs(shape, dim, kernel_device):
    x = torch.randn(shape, device=kernel_device)
    y = softmax(x, dim)
    assert y.shape == x.shape
    if x.numel():  # an empty output has nothing but its shape to check
        testing.assert_close_to_reference(y, reference.softmax(x, dim), torch.softmax(x, dim))


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize(
    "in_dtype, dtype",
    [(torch.float16, torch.float32), (torch.float32, torch.bfloat16), (torch.int64, torch.float32)],
    ids=["fp16->fp32", "fp32->bf16", "int64->fp32"],
)
def test_dtype_keyword_casts_the_input_first_as_torch_does(op_name, in_dtype, dtype, kernel_device, seed):
    """`dtype=` as in torch.softmax(x, dim, dtype=...): x cast to dtype, then the op; the result
    has dtype and the gradient x's dtype. It used to be an unexpected keyword argument."""
    ours, torch_op, ref_fwd, ref_bwd = OPS[op_name]
    x = testing.randn(5, 37, device=kernel_device, seed=seed, scale=3.0).to(in_dtype)
    y = ours(x, -1, dtype=dtype, backend="triton")
    assert y.dtype == dtype
    testing.assert_close_to_reference(y, ref_fwd(x.to(dtype)), torch_op(x, -1, dtype=dtype), factor=FWD_FACTOR)
    if not in_dtype.is_floating_point:
        return
    xg = x.clone().requires_grad_(True)
    dy = testing.randn(5, 37, dtype=dtype, device=kernel_device, seed=seed + 1)
    (dx,) = torch.autograd.grad(ours(xg, -1, dtype=dtype, backend="triton"), xg, dy)
    xb = x.clone().requires_grad_(True)
    (baseline_dx,) = torch.autograd.grad(torch_op(xb, -1, dtype=dtype), xb, dy)
    assert dx.dtype == in_dtype == baseline_dx.dtype
    ref_dx = ref_bwd(ref_fwd(x.to(dtype)), dy)
    testing.assert_close_to_reference(dx, ref_dx, baseline_dx, factor=BWD_FACTOR, name=f"{op_name} backward")
    with pytest.raises(TypeError, match="dtype must be None, float16, bfloat16 or float32"):
        ours(x, -1, dtype=torch.float64)


# --- gpu tier ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [(1024, 128256), (2, 32768), (8192, 1024), (16, 4096, 4099), (3, 1 << 20)],
    ids=["llama3-vocab", "few-mid-rows", "attn-rows", "odd-3d", "1M-cols"],
)
def test_llm_shapes_match_reference(op_name, dtype, shape, seed):
    x = testing.randn(*shape, dtype=dtype, device="cuda", seed=seed, scale=4.0)
    check_forward_and_backward(op_name, x, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", list(OPS))
# dynamic=None is torch.compile's default: static sizes first, then (after a size change) the
# changed dims become symbolic; dynamic=True traces symbolic sizes from the first call.
@pytest.mark.parametrize("dynamic", [None, True], ids=["auto-dynamic", "dynamic"])
def test_torch_compile_fullgraph_forward_and_backward(op_name, dynamic, seed):
    ours, torch_op, ref_fwd, ref_bwd = OPS[op_name]
    torch._dynamo.reset()
    fn = torch.compile(lambda t: ours(t * 2.0, -1) * 1.0, fullgraph=True, dynamic=dynamic)
    # new row counts and row lengths, one row longer than the fused limit (another launch plan)
    for i, shape in enumerate([(64, 5000), (37, 5000), (100, 3001), (3, ops.FWD_MAX_FUSED_COLS + 9)]):
        x = testing.randn(*shape, dtype=torch.bfloat16, device="cuda", seed=seed + i, requires_grad=True)
        y = fn(x)
        ref = ref_fwd(x.detach() * 2.0)
        testing.assert_close_to_reference(y, ref, torch_op(x.detach() * 2.0, -1))
        dy = testing.randn(*shape, dtype=torch.bfloat16, device="cuda", seed=seed + 100 + i)
        (dx,) = torch.autograd.grad(y, x, dy)
        xb = x.detach().clone().requires_grad_(True)
        (baseline_dx,) = torch.autograd.grad(torch_op(xb * 2.0, -1), xb, dy)
        # d/dx of op(2x) is 2 * op'(2x)
        testing.assert_close_to_reference(dx, 2.0 * ref_bwd(ref, dy, -1), baseline_dx, factor=BWD_FACTOR)


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize(
    "n_rows, n_cols, dtype",
    [(1000, 50001, torch.bfloat16), (7, 32769, torch.float32), (300, 131071, torch.float16)],
    ids=["many-rows-odd", "fp32-just-past-wide-rows", "vocab-odd"],
)
def test_cooperative_kernel_matches_reference(op_name, n_rows, n_cols, dtype, seed):
    """Rows cut into chunks across programs, with far more programs than fit on the GPU at once
    (1000 rows x 7 chunks): every row's merge must wait for exactly its own chunks."""
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    plan = ops._plan(n_rows, n_cols, ops.FWD_MAX_FUSED_COLS, ops.FWD_ROWS_TILE, torch.device("cuda"), ops.LOOP_BLOCK_N,
                     ops.COOP_CHUNK, ops.COOP_NUM_WARPS)
    assert plan.kind == "coop" or ops.COOP_CHUNK * sm_count < n_cols
    x = testing.randn(n_rows, n_cols, dtype=dtype, device="cuda", seed=seed, scale=4.0)
    x[0] = float("-inf")  # fully masked row
    x[1, : ops.COOP_CHUNK] = float("-inf")  # a chunk with no finite entry
    x[2, ::7] = float("-inf")
    x[3] = -200.0  # all finite entries far below 0: exp of the chunk shift must not overflow
    x[3, -1] = float("-inf")
    check_forward_in_place_and_strided(op_name, x, "coop forward")
    check_forward_and_backward(op_name, testing.randn(n_rows, n_cols, dtype=dtype, device="cuda", seed=seed), seed=seed)


@pytest.mark.gpu
def test_cooperative_plan_never_cuts_a_row_into_more_chunks_than_sms():
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    def plan(n_cols):
        return ops._plan(2, n_cols, ops.FWD_MAX_FUSED_COLS, ops.FWD_ROWS_TILE, torch.device("cuda"), ops.LOOP_BLOCK_N,
                         ops.COOP_CHUNK, ops.COOP_NUM_WARPS)

    at_limit = plan(sm_count * ops.COOP_CHUNK)
    assert at_limit.kind == "coop" and at_limit.n_splits == sm_count
    past = plan(sm_count * ops.COOP_CHUNK + 1)
    assert past.kind == "split"
    x = testing.randn(2, sm_count * ops.COOP_CHUNK, dtype=torch.bfloat16, device="cuda", seed=3)
    testing.assert_close_to_reference(softmax(x), reference.softmax(x), torch.softmax(x, -1), factor=FWD_FACTOR)
    # and past it, both directions of both ops on the split kernels (until 0.2.13 their jit
    # helpers' str defaults failed to compile there; the interpreter does not compile)
    x = testing.randn(2, sm_count * ops.COOP_CHUNK + 8, dtype=torch.bfloat16, device="cuda", seed=4)
    for op_name in OPS:
        check_forward_and_backward(op_name, x, seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("n_cols, dtype, kind", [
    (8200, torch.bfloat16, "looped"), (20000, torch.float32, "looped"), (50264, torch.bfloat16, "looped"),
    (24576, torch.bfloat16, "rows"),
])
def test_looped_backward_keeping_rows_in_l2_matches_reference(op_name, n_cols, dtype, kind, seed):
    """Many rows whose y and dy fit ops.BWD_L2_LOOP_ROW_BYTES: the backward's looped kernel with
    its L2 hints, in short steps (8200: an 8-column masked tail) and long ones, except 16-bit rows
    of at most ops.WIDE_ROWS_MAX_COLS that fill most of their block (the rows kernel); rows past
    the limit, and odd rows (ops.ODD_*), stay cooperative."""
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    n_rows = ops.L2_LOOP_MIN_ROWS_PER_SM * sm_count
    plan = _bwd_plan(n_rows, n_cols, dtype, torch.device("cuda"))
    assert plan.kind == kind and plan.keep_in_l2 == (kind == "looped")
    assert ops._bwd_l2_loop(65536, 2 * torch.bfloat16.itemsize) is None  # 256 KB of y and dy a row
    assert ops._odd_rows(n_cols + 1, n_cols + 1) and not ops._odd_rows(n_cols, n_cols)
    x = testing.randn(n_rows, n_cols, dtype=dtype, device="cuda", seed=seed, scale=4.0)
    check_forward_and_backward(op_name, x, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", list(OPS))
@pytest.mark.parametrize("n_cols, dtype", [(20001, torch.bfloat16), (32768, torch.float16)])
def test_looped_forward_keeping_rows_in_l2_matches_reference(op_name, n_cols, dtype, seed):
    """Many rows of at most ops.L2_LOOP_ROW_BYTES: one program a row reads it twice, the second
    time from L2 (odd length: a masked tail in its last step); fewer rows take the rows kernel."""
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    n_rows = ops.L2_LOOP_MIN_ROWS_PER_SM * sm_count

    def plan(rows):
        return ops._plan(rows, n_cols, ops.FWD_MAX_FUSED_COLS, ops.FWD_ROWS_TILE, torch.device("cuda"),
                         ops.LOOP_BLOCK_N, ops.COOP_CHUNK, ops.COOP_NUM_WARPS, ops._fwd_l2_loop(n_cols, dtype.itemsize),
                         ops.COOP_BLOCK_N, ops.FWD_WIDE_ROWS_NUM_WARPS)

    assert plan(n_rows).kind == "looped" and plan(n_rows).keep_in_l2
    assert plan(n_rows - 1).kind == "rows"
    x = testing.randn(n_rows, n_cols, dtype=dtype, device="cuda", seed=seed, scale=4.0)
    x[0] = float("-inf")  # fully masked row
    x[1, ::5] = float("-inf")
    check_forward_in_place_and_strided(op_name, x, "L2 looped forward")
    ours, torch_op, ref_fwd, _ = OPS[op_name]
    # the custom op that torch.compile calls plans the same launch, but for the odd rows' windows
    # (ops._windowed: eager calls only), which sum each step in another order
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: ours(t, -1), fullgraph=True)
    if ops._odd_rows(n_cols, n_cols):
        baseline = torch_op(x, -1)
        baseline[0] = ref_fwd(x[:1]).to(x.dtype)  # torch's NaN on the masked row
        testing.assert_close_to_reference(compiled(x), ref_fwd(x), baseline, factor=FWD_FACTOR,
                                          name=f"{op_name} L2 looped forward, compiled")
    else:
        torch.testing.assert_close(compiled(x), ours(x, -1), rtol=0, atol=0)


@pytest.mark.interpret
@pytest.mark.parametrize("op_name", list(OPS))
def test_double_backward_raises_instead_of_dropping_second_order_terms(op_name, kernel_device, seed):
    ours = OPS[op_name][0]
    x = testing.randn(3, 40, device=kernel_device, seed=seed, requires_grad=True)
    testing.assert_double_backward_raises(lambda t: ours(t, -1), x)
