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


def _launch_tiles(
    kernel, args: tuple, n_rows: int, n_cols: int, activation: str, traced: bool,
    tile_elements: int = TILE_ELEMENTS, flat: bool = False,
) -> None:  # fmt: skip
    """Launch an element-wise kernel over (n_rows, n_cols) on a 1-D grid of BLOCK_M x BLOCK_N
    tiles. args: the kernel's arguments before its constexprs (pointers, sizes, row strides).
    flat: the caller passed a (1, numel) view of contiguous tensors; FLAT_BLOCK tiles."""
    if n_rows * n_cols == 0:
        return
    if flat:
        block_m, block_n, num_warps = 1, FLAT_BLOCK, FLAT_NUM_WARPS
    else:
        (block_m, block_n), num_warps = _blocks(n_rows, n_cols, tile_elements), NUM_WARPS
    grid = (runtime.cdiv(n_rows, block_m) * runtime.cdiv(n_cols, block_n),)
    runtime.launchable(kernel, traced)[grid](
        *args, ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps
    )


def _flat(*tensors: torch.Tensor) -> bool:
    """Whether (rows, cols) views are all contiguous, so the kernels may treat them as one row
    of numel elements (the kernels' column indices are int32, so the last tile must end below
    2**31)."""
    n_rows, n_cols = tensors[0].shape
    return n_rows * n_cols + FLAT_BLOCK < 2**31 and all(t.stride(0) == n_cols for t in tensors)


def _launch_gated_fwd(
    g2: torch.Tensor, u2: torch.Tensor, out2: torch.Tensor, activation: str, traced: bool = False
) -> None:
    n_rows, n_cols = out2.shape
    flat = _flat(g2, u2, out2)
    if flat:
        n_rows, n_cols = 1, n_rows * n_cols
    args = (g2, u2, out2, n_rows, n_cols, g2.stride(0), u2.stride(0), out2.stride(0))
    _launch_tiles(_gated_fwd_kernel, args, n_rows, n_cols, activation, traced, flat=flat)


def _launch_gated_bwd(
    g2: torch.Tensor,
    u2: torch.Tensor,
    dy2: torch.Tensor,
    dg2: torch.Tensor,
    du2: torch.Tensor,
    activation: str,
    traced: bool = False,
) -> None:
    n_rows, n_cols = dy2.shape
    flat = _flat(g2, u2, dy2, dg2, du2)
    if flat:
        n_rows, n_cols = 1, n_rows * n_cols
    args = (
        g2, u2, dy2, dg2, du2, n_rows, n_cols,
        g2.stride(0), u2.stride(0), dy2.stride(0), dg2.stride(0), du2.stride(0),
    )  # fmt: skip
    _launch_tiles(_gated_bwd_kernel, args, n_rows, n_cols, activation, traced, flat=flat)


def gated_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str, traced: bool = False) -> torch.Tensor:
    """Launcher: act(gate) * up for same-shape gate and up (..., d); output contiguous."""
    if runtime.backend(gate) == "reference":
        return _reference_gated_fwd(gate, up, activation)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        _launch_gated_fwd(rows_view(gate), rows_view(up), out.view(-1, out.shape[-1]), activation, traced)
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
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    if dgate.numel():
        n = gate.shape[-1]
        _launch_gated_bwd(
            rows_view(gate), rows_view(up), rows_view(dy), dgate.view(-1, n), dup.view(-1, n), activation, traced
        )
    return dgate, dup


def gated_packed_fwd(x: torch.Tensor, activation: str, traced: bool = False) -> torch.Tensor:
    """Launcher: act(x[..., :d]) * x[..., d:] for x of shape (..., 2 * d), read in place."""
    return gated_fwd(*_split(x), activation, traced)


def gated_packed_bwd(x: torch.Tensor, dy: torch.Tensor, activation: str, traced: bool = False) -> torch.Tensor:
    """Launcher: dx (..., 2 * d) = [dgate | dup], both halves written into one buffer."""
    if runtime.backend(x) == "reference":
        return torch.cat(gated_bwd(*_split(x), dy, activation), dim=-1)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dx.numel():
        gate, up = _split(x)
        dgate, dup = _split(dx.view(-1, x.shape[-1]))
        _launch_gated_bwd(rows_view(gate), rows_view(up), rows_view(dy), dgate, dup, activation, traced)
    return dx


def _launch_bias_gelu_fwd(
    x2: torch.Tensor, bias: torch.Tensor, out2: torch.Tensor, activation: str, traced: bool = False
) -> None:
    n_rows, n_cols = out2.shape
    args = (x2, bias, out2, n_rows, n_cols, x2.stride(0), out2.stride(0))
    _launch_tiles(_bias_gelu_fwd_kernel, args, n_rows, n_cols, activation, traced, BIAS_GELU_TILE_ELEMENTS)


def _launch_bias_gelu_bwd(
    x2: torch.Tensor, bias: torch.Tensor, dy2: torch.Tensor, dx2: torch.Tensor, activation: str, traced: bool = False
) -> torch.Tensor:
    """Writes dx2 and returns dbias (bias.dtype), the float32 column sums of dx."""
    n_rows, n_cols = dx2.shape
    if dx2.numel() == 0:
        return torch.zeros_like(bias)
    block_m, block_n = _blocks(n_rows, n_cols, BIAS_GRAD_TILE_ELEMENTS)
    col_blocks = runtime.cdiv(n_cols, block_n)
    device = dx2.device
    chunks = runtime.cdiv(BIAS_GRAD_PROGRAMS_PER_SM * runtime.sm_count(device), col_blocks)
    chunks = max(1, min(chunks, runtime.cdiv(n_rows, block_m)))
    rows_per_program = runtime.cdiv(runtime.cdiv(n_rows, chunks), block_m) * block_m
    chunks = runtime.cdiv(n_rows, rows_per_program)
    partials = torch.empty((chunks, n_cols), dtype=torch.float32, device=device)
    runtime.launchable(_bias_gelu_bwd_kernel, traced)[(chunks, col_blocks)](
        x2, bias, dy2, dx2, partials, n_rows, n_cols, x2.stride(0), dy2.stride(0), dx2.stride(0),
        rows_per_program,
        ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_N=block_n, STAGES=BIAS_GRAD_STAGES,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return partial_sums.sum_partials(partials, bias.dtype, traced)


def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor, activation: str, traced: bool = False) -> torch.Tensor:
    """Launcher: gelu(x + bias), x (..., N), bias (N,); activation "gelu" or "gelu_tanh"."""
    if runtime.backend(x) == "reference":
        return reference.bias_gelu(x, bias, _approx(activation), compute_dtype=torch.float32).to(x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        _launch_bias_gelu_fwd(rows_view(x), bias, out.view(-1, x.shape[-1]), activation, traced)
    return out


def bias_gelu_bwd(
    x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor, activation: str, traced: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: (dx, dbias) of gelu(x + bias) given dy; dbias sums dx over all rows in float32."""
    if runtime.backend(x) == "reference":
        dx, db = reference.bias_gelu_backward(x, bias, dy, _approx(activation), compute_dtype=torch.float32)
        return dx.to(x.dtype), db.to(bias.dtype)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        return dx, torch.zeros_like(bias)
    n = x.shape[-1]
    return dx, _launch_bias_gelu_bwd(rows_view(x), bias, rows_view(dy), dx.view(-1, n), activation, traced)


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

    apply(fwd, bwd, *tensors, activation): the output of fwd(*tensors, activation); backward
    through bwd(*tensors, dy, activation) (see `_input_grads`).
    """

    @staticmethod
    def forward(ctx, fwd, bwd, *inputs):
        ctx.bwd = bwd
        _save_inputs(ctx, inputs, None)
        return fwd(*inputs)

    @staticmethod
    def backward(ctx, dy):
        runtime.check_first_order_backward("kernel_lab.mlp")
        return None, None, *_input_grads(ctx.bwd, ctx, dy)


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
        return _LauncherFunction.apply(gated_fwd, gated_bwd, gate, up, activation)
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
        return _LauncherFunction.apply(gated_packed_fwd, gated_packed_bwd, x, activation)
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
        return _LauncherFunction.apply(bias_gelu_fwd, bias_gelu_bwd, x, bias, activation)
    return bias_gelu_fwd(x, bias, activation)
