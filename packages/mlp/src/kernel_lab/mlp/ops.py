"""MLP activations: input checks, launchers, torch.library ops and autograd.

Public ops: `bias_gelu`, `swiglu`, `geglu`, `silu_and_mul`, `gelu_and_mul`. Call path of each:
checks, then
- in eager mode the launchers directly (no custom-op dispatch: a custom op costs tens of
  microseconds per call, longer than the kernel on small inputs), through an
  autograd.Function when a gradient is needed;
- under torch.compile `torch.ops.kernel_lab.mlp_*`, `triton_op`s whose backward is registered
  with `register_autograd`, so the graph has no break.
Both paths run the same launchers: `gated_fwd` / `gated_bwd` (swiglu, geglu and the packed
forms) and `bias_gelu_fwd` / `bias_gelu_bwd`.

Activation names used throughout: "silu", "gelu" (exact, erf) and "gelu_tanh".
"""

from __future__ import annotations

from functools import partial

import torch
from torch.library import triton_op

from kernel_lab.shared import partial_sums, reference, runtime
from kernel_lab.shared.runtime import rows_view

from ._kernels import (
    GELU,
    GELU_TANH,
    SILU,
    _bias_gelu_bwd_kernel,
    _bias_gelu_fwd_kernel,
    _gated_bwd_kernel,
    _gated_fwd_kernel,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = {"silu": SILU.value, "gelu": GELU.value, "gelu_tanh": GELU_TANH.value}

# Tiles. Each kernel streams its tensors once, so what sets its speed is how many bytes each
# program keeps in flight and how little of each tile is masked off. The settings below are the
# fastest of tile sweeps on an H200 (bf16, 4096-16384 rows x 11008-18944 columns).
#
# Row-structured (2-D) tiles: 2048 elements over 4 warps, 16 per thread per tensor (two 16-byte
# loads of bf16); the largest tiles were clearly slower.
TILE_ELEMENTS = 2048
NUM_WARPS = 4
# Widest column block: 1024 bf16 columns are 2 KiB per row, long enough for full 128-byte
# transactions. (Narrower blocks that pad rows less, 256 columns at 11008 and 512 at 18944, were
# slower on an H200, the bias-gradient backward by 2-3x: a program then streams narrow strips.)
MAX_BLOCK_N = 1024
# Contiguous gate, up and outputs are one flat array: 1-D blocks of FLAT_BLOCK elements (8 warps,
# 16 per thread), no row structure and no padding. Faster than any 2-D tile, forward and
# backward, and level with Liger's one-row-per-program swiglu forward at 14336 and 11008 columns.
FLAT_BLOCK, FLAT_NUM_WARPS = 4096, 8
# bias_gelu forward: 2048 elements over 4 warps, 16 per thread. Re-swept with direct launches
# (H200, bf16, 4096 x 11008 to 16384 x 14336; tiles of 2048-16384 elements, 4-16 warps): the
# fastest at all three shapes, 4-8% ahead of the 4096-element tiles used before.
BIAS_GELU_TILE_ELEMENTS = 2048
# Programs a launch may have along grid axis 1 (CUDA's limit; axis 0's is 2**31 - 1).
MAX_GRID_Y = 65535
# Offsets from a tensor's start up to which the bias_gelu forward computes them in 32 bits.
MAX_OFFSET_32 = 2**31
# bias_gelu backward: BIAS_GRAD_PROGRAMS_PER_SM programs per SM, each walking a chunk of rows
# in steps of BIAS_GRAD_TILE_ELEMENTS (two rows of 1024 columns) with a float32 column sum live,
# the loop software-pipelined BIAS_GRAD_STAGES deep so that each program keeps the next steps'
# loads in flight (unpipelined, these small programs left DRAM idle: 9-12% slower). Of an H200
# sweep (bf16, 4096 x 11008 to 16384 x 14336; 1024-4096 elements, 4-16 programs per SM, 1-4
# stages), 16 / 2048 / 2 was 5-7% faster than 8 / 1024 / 3 at the two larger shapes and 6%
# slower at 4096 x 11008 (whose autograd backward is bound by host work, not by this kernel).
BIAS_GRAD_TILE_ELEMENTS = 2048
BIAS_GRAD_PROGRAMS_PER_SM = 16
BIAS_GRAD_STAGES = 2
# Eager bias_gelu backwards of up to BIAS_GRAD_FUSED_MAX_ELEMENTS add their partial sums up in
# the kernel (partial_sums.sum_if_last) and take the partials from partial_sums.workspace: one
# launch and one allocation fewer than kernel + sum_partials. Under autograd that host work runs
# on the engine's device thread, and at these sizes it, not the GPU, set the time (H200, bf16
# 4096 x 11008: kernel + sum about 82 us of GPU time against about 130 us per call back to
# back). The fused sum has a serial tail (the last chunk of a column block adds all its
# partials), shortest with few chunks: BIAS_GRAD_FUSED_PROGRAMS_PER_SM programs per SM,
# BIAS_GRAD_FUSED_STAGES deep (76 us of GPU time at 4096 x 11008 against 82 for the unfused
# pair; at 8192 x 18944 and 16384 x 14336, where the GPU sets the time, it was 4-5% slower than
# the pair, which therefore stays above the threshold and under torch.compile).
BIAS_GRAD_FUSED_MAX_ELEMENTS = 1 << 26
BIAS_GRAD_FUSED_PROGRAMS_PER_SM = 4
BIAS_GRAD_FUSED_STAGES = 3
# Partial elements per step of the fused sum: 4096 float32 over 4 warps, 32 per thread.
BIAS_GRAD_SUM_ELEMENTS = 4096


def _blocks(n_rows: int, n_cols: int, tile_elements: int = TILE_ELEMENTS) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of a 2-D tile of about `tile_elements`: as many columns as MAX_BLOCK_N
    allows, then the rows that fill the tile (no more than there are). The kernels run
    NUM_WARPS warps whatever the tile, so the heuristic's warp count is not used."""
    block_m, block_n, _ = runtime.row_tile(n_rows, n_cols, tile_elements, MAX_BLOCK_N)
    return block_m, block_n


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a packed (..., 2 * d) tensor, as views."""
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def _approx(activation: str) -> str:
    return "tanh" if activation == "gelu_tanh" else "none"


def _reference_gated_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The shared reference in float32, cast back: the CPU fallback (differentiable by torch)."""
    if activation == "silu":
        return reference.swiglu(gate, up, compute_dtype=torch.float32).to(gate.dtype)
    return reference.geglu(gate, up, _approx(activation), compute_dtype=torch.float32).to(gate.dtype)


# Launchers. They assume checked inputs (see the public ops below).
#
# Every kernel here takes its tensors, then integers (sizes, row strides), then compile-time
# arguments. It reads each (..., N) tensor as a (rows, N) matrix with unit column stride, a pointer
# and a row stride (`rows_view`); the bias as one such row.
#
# Recipes of eager launches by launch-plan key (runtime.DirectLauncher.planned). Under autograd the
# backward runs on the engine's CUDA device thread, where host work measured about twice as
# expensive as on the caller's thread (H200 host), and at LLM sizes the backward's host time
# exceeded its GPU time: so what follows from the shapes is worked out once per key, and a
# repeated call allocates, builds its key and launches. The key: the recipe's maker (which names
# the kernel), the activation, the device, the shape, and each tensor argument's dtype, strides
# and address modulo 16 (`_layout`). Tensors allocated after the lookup (partial sums, copies)
# come from torch's allocators, aligned to 64 bytes or more. Module constants (tiles) are not in
# the key: code that changes them clears _RECIPES. Entries: (which tensors are copied or None,
# the recipe), all dropped when MAX_PLANS are held.
_RECIPES: dict[tuple, tuple] = {}


def _layout(t: torch.Tensor) -> tuple:
    """A tensor argument's part of a launch-plan key: dtype, strides and address modulo 16
    (Triton specialises pointers on 16-byte alignment; gate and up may be halves of a packed
    tensor, offset by d elements)."""
    return t.dtype, t.stride(), t.data_ptr() % 16


def _recipe(make, tensors: tuple, activation: str, traced: bool) -> tuple:
    """(the tensors to pass, their recipe) for a launch over `tensors`, none empty, all of the
    first one's shape but the bias (N,). The recipe is make(read, activation, traced, plan): the
    launch (`kernel[grid]`, compile-time arguments bound), the integers to pass after the tensors,
    and whatever else the caller needs, worked out from the tensors read as rows.

    Traced (torch.compile: symbolic sizes, no addresses), every call works it out and passes the
    row views. Eager calls do so once per launch-plan key (see `_RECIPES`) and pass their tensors
    as they are: a row view has its tensor's address, and its row stride follows from the key.
    A layout that no view reads as rows (the stride-0 dy of `y.sum().backward()`, a strided bias)
    is copied on every call, as `rows_view` would."""
    if traced:
        read = tuple(map(rows_view, tensors))
        return read, make(read, activation, True, None)
    first = tensors[0]
    key = (make, activation, first.device, first.shape, *map(_layout, tensors))
    entry = _RECIPES.get(key)
    if entry is None:
        if len(_RECIPES) >= runtime.MAX_PLANS:
            _RECIPES.clear()
        read = tuple(map(rows_view, tensors))
        copies = tuple(r.data_ptr() != t.data_ptr() for r, t in zip(read, tensors, strict=True))
        entry = _RECIPES[key] = (copies if any(copies) else None, make(read, activation, False, key))
    copies, recipe = entry
    if copies:
        tensors = tuple(t.contiguous() if copy else t for t, copy in zip(tensors, copies, strict=True))
    return tensors, recipe


def _tiles(
    kernel, n_rows: int, n_cols: int, strides: tuple, activation: str, traced: bool, plan,
    flat: bool = False, tile_elements: int = TILE_ELEMENTS,
) -> tuple:  # fmt: skip
    """(launch, integers) of an element-wise kernel over (n_rows, n_cols) on a 1-D grid of
    BLOCK_M x BLOCK_N tiles; the integers are n_rows, n_cols and the tensors' row `strides`.
    flat: the tensors are contiguous, read as one row of numel elements in FLAT_BLOCK tiles."""
    if flat:
        n_rows, n_cols = 1, n_rows * n_cols
        block_m, block_n, num_warps = 1, FLAT_BLOCK, FLAT_NUM_WARPS
    else:
        (block_m, block_n), num_warps = _blocks(n_rows, n_cols, tile_elements), NUM_WARPS
    grid = (runtime.cdiv(n_rows, block_m) * runtime.cdiv(n_cols, block_n),)
    launch = partial(
        runtime.launchable(kernel, traced, plan)[grid],
        ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip
    return launch, (n_rows, n_cols, *strides)


def _gated_tiles(kernel, read: tuple, activation: str, traced: bool, plan) -> tuple:
    """`_tiles` of a gated kernel over same-shape (rows, N) tensors: flat when all are
    contiguous (the kernels' column indices are int32, so the last flat tile must end below
    2**31)."""
    n_rows, n_cols = read[0].shape
    strides = tuple(t.stride(0) for t in read)
    flat = n_rows * n_cols + FLAT_BLOCK < 2**31 and all(s == n_cols for s in strides)
    return _tiles(kernel, n_rows, n_cols, strides, activation, traced, plan, flat=flat)


def _gated_fwd_recipe(read: tuple, activation: str, traced: bool, plan) -> tuple:
    return _gated_tiles(_gated_fwd_kernel, read, activation, traced, plan)


def _gated_bwd_recipe(read: tuple, activation: str, traced: bool, plan) -> tuple:
    return _gated_tiles(_gated_bwd_kernel, read, activation, traced, plan)


def _bias_gelu_fwd_recipe(read: tuple, activation: str, traced: bool, plan) -> tuple:
    """(launch, integers) over BLOCK_M x BLOCK_N tiles: column blocks on grid axis 0, row blocks
    on axes 1 and 2 (axis 1 holds at most MAX_GRID_Y); 64-bit offsets only for tensors that
    need them."""
    x2, _, out2 = read
    n_rows, n_cols = x2.shape
    strides = (x2.stride(0), out2.stride(0))
    block_m, block_n = _blocks(n_rows, n_cols, BIAS_GELU_TILE_ELEMENTS)
    row_blocks = runtime.cdiv(n_rows, block_m)
    grid_z = runtime.cdiv(row_blocks, MAX_GRID_Y)
    grid = (runtime.cdiv(n_cols, block_n), runtime.cdiv(row_blocks, grid_z), grid_z)
    # bounds every offset computed, the masked rows of the last tile's included
    offsets_64 = (row_blocks * block_m - 1) * max(strides) + n_cols >= MAX_OFFSET_32
    launch = partial(
        runtime.launchable(_bias_gelu_fwd_kernel, traced, plan)[grid],
        ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_N=block_n, OFFSETS_64=offsets_64,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return launch, (n_rows, n_cols, *strides)


def _bias_gelu_bwd_recipe(read: tuple, activation: str, traced: bool, plan) -> tuple:
    """(launch, integers, (chunks, N), counters), passed the tensors, the float32 partial sums,
    dbias and the arrival counters (the last two unused unless fused), then the integers:
    programs over chunks of rows x column blocks, each writing its chunk's column sums of dx to
    its row of the partials. Fused (eager, at most BIAS_GRAD_FUSED_MAX_ELEMENTS), the kernel also
    adds them up, with one arrival counter per column block: counters is their number, 0 when
    the sum is left to sum_partials."""
    x2, _, dy2, dx2 = read
    n_rows, n_cols = x2.shape
    fused = not traced and n_rows * n_cols <= BIAS_GRAD_FUSED_MAX_ELEMENTS
    per_sm, stages = ((BIAS_GRAD_FUSED_PROGRAMS_PER_SM, BIAS_GRAD_FUSED_STAGES) if fused
                      else (BIAS_GRAD_PROGRAMS_PER_SM, BIAS_GRAD_STAGES))
    block_m, block_n = _blocks(n_rows, n_cols, BIAS_GRAD_TILE_ELEMENTS)
    col_blocks = runtime.cdiv(n_cols, block_n)
    chunks = runtime.cdiv(per_sm * runtime.sm_count(x2.device), col_blocks)
    chunks = max(1, min(chunks, runtime.cdiv(n_rows, block_m)))
    rows_per_program = runtime.cdiv(runtime.cdiv(n_rows, chunks), block_m) * block_m
    chunks = runtime.cdiv(n_rows, rows_per_program)
    launch = partial(
        runtime.launchable(_bias_gelu_bwd_kernel, traced, plan)[(chunks, col_blocks)],
        ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, FUSED_SUM=fused,
        SUM_ROWS=max(1, BIAS_GRAD_SUM_ELEMENTS // block_n), num_warps=NUM_WARPS,
    )  # fmt: skip
    ints = (n_rows, n_cols, x2.stride(0), dy2.stride(0), dx2.stride(0), rows_per_program)
    return launch, ints, (chunks, n_cols), col_blocks if fused else 0


def _launch_gated_fwd(
    gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, activation: str, traced: bool = False
) -> None:
    """out = act(gate) * up; all (..., N) of one shape and dtype, not empty."""
    tensors, (launch, ints) = _recipe(_gated_fwd_recipe, (gate, up, out), activation, traced)
    launch(*tensors, *ints)


def _launch_gated_bwd(
    gate: torch.Tensor,
    up: torch.Tensor,
    dy: torch.Tensor,
    dgate: torch.Tensor,
    dup: torch.Tensor,
    activation: str,
    traced: bool = False,
) -> None:
    """dgate, dup of act(gate) * up given dy; all (..., N) of one shape and dtype, not empty."""
    tensors, (launch, ints) = _recipe(_gated_bwd_recipe, (gate, up, dy, dgate, dup), activation, traced)
    launch(*tensors, *ints)


def gated_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str, traced: bool = False) -> torch.Tensor:
    """Launcher: act(gate) * up for same-shape gate and up (..., d); output contiguous."""
    if runtime.backend(gate) == "reference":
        return _reference_gated_fwd(gate, up, activation)
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    if out.numel():
        _launch_gated_fwd(gate, up, out, activation, traced)
    return out


def gated_bwd(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, activation: str, traced: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: (dgate, dup) of act(gate) * up given dy, all of one shape."""
    if runtime.backend(gate) == "reference":
        if activation == "silu":
            dg, du = reference.swiglu_backward(gate, up, dy, compute_dtype=torch.float32)
        else:
            dg, du = reference.geglu_backward(gate, up, dy, _approx(activation), compute_dtype=torch.float32)
        return dg.to(gate.dtype), du.to(up.dtype)
    dgate = torch.empty_like(gate, memory_format=torch.contiguous_format)
    dup = torch.empty_like(up, memory_format=torch.contiguous_format)
    if dgate.numel():
        _launch_gated_bwd(gate, up, dy, dgate, dup, activation, traced)
    return dgate, dup


def gated_packed_fwd(x: torch.Tensor, activation: str, traced: bool = False) -> torch.Tensor:
    """Launcher: act(x[..., :d]) * x[..., d:] for x of shape (..., 2 * d), read in place."""
    return gated_fwd(*_split(x), activation, traced)


def gated_packed_bwd(x: torch.Tensor, dy: torch.Tensor, activation: str, traced: bool = False) -> torch.Tensor:
    """Launcher: dx (..., 2 * d) = [dgate | dup], both halves written into one buffer."""
    if runtime.backend(x) == "reference":
        return torch.cat(gated_bwd(*_split(x), dy, activation), dim=-1)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if dx.numel():
        _launch_gated_bwd(*_split(x), dy, *_split(dx), activation, traced)
    return dx


def _launch_bias_gelu_fwd(
    x: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, activation: str, traced: bool = False
) -> None:
    """out = gelu(x + bias); x and out (..., N), bias (N,), one dtype, not empty."""
    tensors, (launch, ints) = _recipe(_bias_gelu_fwd_recipe, (x, bias, out), activation, traced)
    launch(*tensors, *ints)


def _launch_bias_gelu_bwd(
    x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, activation: str, traced: bool = False
) -> torch.Tensor:
    """Writes dx (..., N) and returns dbias (bias.dtype), the float32 column sums of dx."""
    if dx.numel() == 0:
        return torch.zeros_like(bias)
    tensors, (launch, ints, (chunks, n_cols), counters) = _recipe(
        _bias_gelu_bwd_recipe, (x, bias, dy, dx), activation, traced)
    if counters:
        dbias = torch.empty(n_cols, dtype=bias.dtype, device=dx.device)
        partials, arrivals = partial_sums.workspace(dx.device, chunks, n_cols, counters)
        launch(*tensors, partials, dbias, arrivals, *ints)
        return dbias
    partials = torch.empty((chunks, n_cols), dtype=torch.float32, device=dx.device)
    launch(*tensors, partials, partials, partials, *ints)  # partials stand in for the unused dbias and counters
    return partial_sums.sum_partials(partials, bias.dtype, traced)


def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor, activation: str, traced: bool = False) -> torch.Tensor:
    """Launcher: gelu(x + bias), x (..., N), bias (N,); activation "gelu" or "gelu_tanh"."""
    if runtime.backend(x) == "reference":
        return reference.bias_gelu(x, bias, _approx(activation), compute_dtype=torch.float32).to(x.dtype)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.numel():
        _launch_bias_gelu_fwd(x, bias, out, activation, traced)
    return out


def bias_gelu_bwd(
    x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor, activation: str, traced: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: (dx, dbias) of gelu(x + bias) given dy; dbias sums dx over all rows in float32."""
    if runtime.backend(x) == "reference":
        dx, db = reference.bias_gelu_backward(x, bias, dy, _approx(activation), compute_dtype=torch.float32)
        return dx.to(x.dtype), db.to(bias.dtype)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, _launch_bias_gelu_bwd(x, bias, dy, dx, activation, traced)


# torch.library registration: what torch.compile sees.


@triton_op("kernel_lab::mlp_gated_fwd", mutates_args=())
def _gated_fwd_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_fwd(gate, up, activation, traced=True)


@triton_op("kernel_lab::mlp_gated_bwd", mutates_args=())
def _gated_bwd_op(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_bwd(gate, up, dy, activation, traced=True)


@triton_op("kernel_lab::mlp_gated_packed_fwd", mutates_args=())
def _gated_packed_fwd_op(x: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_packed_fwd(x, activation, traced=True)


@triton_op("kernel_lab::mlp_gated_packed_bwd", mutates_args=())
def _gated_packed_bwd_op(x: torch.Tensor, dy: torch.Tensor, activation: str) -> torch.Tensor:
    return gated_packed_bwd(x, dy, activation, traced=True)


@triton_op("kernel_lab::mlp_bias_gelu_fwd", mutates_args=())
def _bias_gelu_fwd_op(x: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    return bias_gelu_fwd(x, bias, activation, traced=True)


@triton_op("kernel_lab::mlp_bias_gelu_bwd", mutates_args=())
def _bias_gelu_bwd_op(
    x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return bias_gelu_bwd(x, bias, dy, activation, traced=True)


def _save_inputs(ctx, inputs, output):
    """setup_context of an op over (*tensors, activation): saves the tensors for its backward."""
    *tensors, ctx.activation = inputs
    ctx.save_for_backward(*tensors)


def _input_grads(bwd, ctx, dy) -> tuple:
    """Gradients of the inputs (*tensors, activation) saved by `_save_inputs`, from
    bwd(*tensors, dy, activation), a backward launcher or op that returns the tensors' gradients
    (one tensor, or a tuple when there are several); the activation string gets None."""
    grads = bwd(*ctx.saved_tensors, dy, ctx.activation)
    return (*grads, None) if isinstance(grads, tuple) else (grads, None)


# Each forward op differentiates through its backward op (the graph torch.compile builds calls it).
_gated_fwd_op.register_autograd(partial(_input_grads, torch.ops.kernel_lab.mlp_gated_bwd), setup_context=_save_inputs)
_gated_packed_fwd_op.register_autograd(
    partial(_input_grads, torch.ops.kernel_lab.mlp_gated_packed_bwd), setup_context=_save_inputs
)
_bias_gelu_fwd_op.register_autograd(
    partial(_input_grads, torch.ops.kernel_lab.mlp_bias_gelu_bwd), setup_context=_save_inputs
)


class _LauncherFunction(torch.autograd.Function):
    """Eager autograd: the launchers the registered ops run, without custom-op dispatch.

    apply(fwd, bwd, activation, *tensors): the output of fwd(*tensors, activation); backward
    through bwd(*tensors, dy, activation), which returns the tensors' gradients (one tensor, or
    a tuple when there are several). The activation comes first so that the tensors are saved
    and their gradients returned without repacking (the backward's host time bounds mid-sized
    calls).
    """

    @staticmethod
    def forward(ctx, fwd, bwd, activation, *tensors):
        ctx.bwd, ctx.activation = bwd, activation
        ctx.save_for_backward(*tensors)
        return fwd(*tensors, activation)

    @staticmethod
    def backward(ctx, dy):
        runtime.check_first_order_backward("kernel_lab.mlp")
        grads = ctx.bwd(*ctx.saved_tensors, dy, ctx.activation)
        return (None, None, None, *grads) if type(grads) is tuple else (None, None, None, grads)


# Checks and public ops.


def _check_tensor(name: str, arg: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: {arg}.dtype must be float16, bfloat16 or float32, got {t.dtype}")
    if t.ndim == 0:
        raise ValueError(f"{name}: {arg} must have at least 1 dim (..., N), got a 0-dim tensor")


def _check_like(name: str, arg: str, t: torch.Tensor, ref_arg: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: {arg}.dtype {t.dtype} must match {ref_arg}.dtype {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name}: {arg} is on {t.device} but {ref_arg} is on {ref.device}; expected one device")


def _check_approximate(name: str, approximate: str) -> str:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{name}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return "gelu_tanh" if approximate == "tanh" else "gelu"


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _gated(name: str, gate, up, activation: str, backend: str | None) -> torch.Tensor:
    _check_tensor(name, "gate", gate)
    _check_tensor(name, "up", up)
    _check_like(name, "up", up, "gate", gate)
    if gate.shape != up.shape:
        raise ValueError(f"{name}: gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    runtime.check_backend(name, backend, gate)
    if backend == "reference":
        return _reference_gated_fwd(gate, up, activation)
    if torch.compiler.is_compiling():
        return torch.ops.kernel_lab.mlp_gated_fwd(gate, up, activation)
    if _needs_grad(gate, up):
        return _LauncherFunction.apply(gated_fwd, gated_bwd, activation, gate, up)
    return gated_fwd(gate, up, activation)


def _gated_packed(name: str, x, activation: str, backend: str | None) -> torch.Tensor:
    _check_tensor(name, "x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"{name}: x must have an even last dim (..., 2 * d), got shape {tuple(x.shape)}")
    runtime.check_backend(name, backend, x)
    if backend == "reference":
        return _reference_gated_fwd(*_split(x), activation)
    if torch.compiler.is_compiling():
        return torch.ops.kernel_lab.mlp_gated_packed_fwd(x, activation)
    if _needs_grad(x):
        return _LauncherFunction.apply(gated_packed_fwd, gated_packed_bwd, activation, x)
    return gated_packed_fwd(x, activation)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """SwiGLU: y = silu(gate) * up = gate * sigmoid(gate) * up, element-wise.

    gate, up: one shape (..., d), one dtype (float16, bfloat16, float32), one device. Any
    leading shape and width; rows may be strided (unit stride along the last dim is read in
    place, other layouts are copied once). Returns a contiguous tensor of that shape and dtype,
    computed in float32 and rounded once (torch's `F.silu(gate) * up` rounds twice).
    Differentiable w.r.t. gate and up.

    backend: None picks by device (`kernel_lab.shared.runtime.backend`); "triton" insists on
    the Triton kernel (ValueError if it cannot run: a CPU tensor without TRITON_INTERPRET=1);
    "reference" runs the PyTorch reference in float32.

    Raises TypeError for a non-tensor or an unsupported / mismatched dtype, ValueError for
    mismatched shapes or devices.
    """
    return _gated("swiglu", gate, up, "silu", backend)


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "none", *, backend: str | None = None
) -> torch.Tensor:
    """GeGLU: y = gelu(gate) * up, exact (erf) GELU or approximate="tanh" (as F.gelu).

    Inputs, layouts, dtypes, errors and `backend` as `swiglu`; ValueError for an unknown
    `approximate`.
    """
    return _gated("geglu", gate, up, _check_approximate("geglu", approximate), backend)


def silu_and_mul(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Packed SwiGLU: y = silu(x[..., :d]) * x[..., d:] for x of shape (..., 2 * d).

    The layout of vLLM's `silu_and_mul` and of a fused gate_up projection's output. Both
    halves are read in place (no split copies); the gradient is one packed (..., 2 * d) tensor.
    Returns (..., d). Dtypes, errors and `backend` as `swiglu`; ValueError for an odd last dim.
    """
    return _gated_packed("silu_and_mul", x, "silu", backend)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", *, backend: str | None = None) -> torch.Tensor:
    """Packed GeGLU: y = gelu(x[..., :d]) * x[..., d:] for x of shape (..., 2 * d).

    As `silu_and_mul` with the GELU of `geglu` (approximate "none" or "tanh").
    """
    return _gated_packed("gelu_and_mul", x, _check_approximate("gelu_and_mul", approximate), backend)


def bias_gelu(
    x: torch.Tensor, bias: torch.Tensor, approximate: str = "none", *, backend: str | None = None
) -> torch.Tensor:
    """Fused bias + GELU: y = gelu(x + bias), one read of x and one write of y.

    x: (..., N); bias: (N,), same dtype (float16, bfloat16, float32) and device. The sum and
    the GELU are computed in float32 and rounded once (torch's `F.gelu(x + bias)` rounds the
    sum first). approximate: "none" (erf) or "tanh", as F.gelu. Differentiable w.r.t. x and
    bias (the bias gradient is the float32 sum of dx over all rows, deterministic).

    `backend` as `swiglu`. Raises TypeError for non-tensors or unsupported / mismatched dtypes,
    ValueError for a bias that is not (N,), mismatched devices or an unknown `approximate`.
    """
    name = "bias_gelu"
    _check_tensor(name, "x", x)
    _check_tensor(name, "bias", bias)
    _check_like(name, "bias", bias, "x", x)
    if bias.ndim != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: bias must have shape ({x.shape[-1]},) to match x.shape[-1], got {tuple(bias.shape)}")
    activation = _check_approximate(name, approximate)
    runtime.check_backend(name, backend, x)
    if backend == "reference":
        return reference.bias_gelu(x, bias, approximate, compute_dtype=torch.float32).to(x.dtype)
    if torch.compiler.is_compiling():
        return torch.ops.kernel_lab.mlp_bias_gelu_fwd(x, bias, activation)
    if _needs_grad(x, bias):
        return _LauncherFunction.apply(bias_gelu_fwd, bias_gelu_bwd, activation, x, bias)
    return bias_gelu_fwd(x, bias, activation)
