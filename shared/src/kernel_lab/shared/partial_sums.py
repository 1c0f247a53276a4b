"""sum_partials: the last step of a parameter gradient reduced across rows, as one Triton launch.

A backward kernel that needs a per-feature gradient (a norm's dweight and dbias, a bias_gelu's
dbias) cannot sum over every row in one program, so each of its programs writes its own float32
partial sums and this kernel adds them up:

    partials (n_programs, n_cols) float32  ->  gradient (n_cols,) in the parameter's dtype

The sum and the cast in one pass, in a fixed order (the same result every run). It replaces
`partial.sum(0).to(dtype)`: two torch ops, and on the lent H200 host each op costs about as
much host time as a whole Triton launch, in a backward whose host path (not the GPU) bounds
mid-sized rows under `torch.autograd.grad`.

Needs triton (a kernel package's dependency); `kernel_lab.shared` itself does not import it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime

# Columns per program and partial rows per loop step: a 32 x 64 float32 tile over 4 warps is 16
# values a thread; 4096 columns make 64 programs, enough to spread a few MB of partials (e.g.
# 528 x 4096 x 4 bytes) over as many SMs.
BLOCK_N = 64
BLOCK_M = 32
NUM_WARPS = 4


@triton.jit
def _sum_partials_kernel(
    partial_ptr,  # (n_rows, n_cols) float32, contiguous
    out_ptr,  # (n_cols,)
    n_rows, n_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, n_rows, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        acc += tl.load(partial_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype, traced: bool = False) -> torch.Tensor:
    """Column sums of `partials` (float32, contiguous, (n_programs, n_cols)), cast to `dtype`.

    traced: pass True from inside a `triton_op` body (see `runtime.launchable`).
    Returns a new (n_cols,) tensor of `dtype` on partials' device.
    """
    if partials.dtype != torch.float32 or not partials.is_contiguous() or partials.ndim != 2:
        raise ValueError(f"sum_partials: partials must be a contiguous 2-D float32 tensor, got "
                         f"{partials.dtype} of shape {tuple(partials.shape)}")
    n_rows, n_cols = partials.shape
    out = torch.empty(n_cols, dtype=dtype, device=partials.device)
    if n_cols:
        # Launch plan key (runtime.DirectLauncher.planned): the device and the sizes fix the grid
        # and the integer specialisations, the addresses' alignment the pointers'. A backward
        # calls this on the autograd engine's device thread, where host work costs about twice
        # what it costs on the caller's thread.
        # (none when traced: torch.compile traces with fake tensors, which have no address)
        plan = None if traced else (partials.device, partials.shape, dtype, partials.data_ptr() % 16,
                                    out.data_ptr() % 16)
        runtime.launchable(_sum_partials_kernel, traced, plan)[(runtime.cdiv(n_cols, BLOCK_N),)](
            partials, out, n_rows, n_cols, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out
