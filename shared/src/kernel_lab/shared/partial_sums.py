"""sum_partials: the last step of a parameter gradient reduced across rows, as one Triton launch.

A backward kernel that needs a per-feature gradient (a norm's dweight and dbias, a bias_gelu's
dbias) cannot sum over every row in one program, so each of its programs writes its own float32
partial sums and this kernel adds them up:

    partials (k, n_programs, n_cols) float32  ->  k gradients (n_cols,), each in its own dtype

One launch for all k gradients, the sum and the cast in one pass, in a fixed order (the same
result every run). It replaces `partial.sum(0).to(dtype)` per gradient: two torch ops each, and
on the lent H200 host each op costs about as much host time as a whole Triton launch, in a
backward whose host path (not the GPU) bounds mid-sized rows under `torch.autograd.grad`.

Needs triton (a kernel package's dependency); `kernel_lab.shared` itself does not import it.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    partial_ptr,  # (k, n_rows, n_cols) float32, contiguous
    out0_ptr, out1_ptr,  # (n_cols,) each: gradient 0, gradient 1 (k == 2 only)
    n_rows, n_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    which = tl.program_id(1)  # the gradient this program sums
    slab = partial_ptr + which.to(tl.int64) * n_rows * n_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, n_rows, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        acc += tl.load(slab + rows[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(out0_ptr + cols, total.to(out0_ptr.dtype.element_ty), mask=cols < n_cols)
    else:
        tl.store(out1_ptr + cols, total.to(out1_ptr.dtype.element_ty), mask=cols < n_cols)


def sum_partials(partials: torch.Tensor, dtypes: Sequence[torch.dtype], traced: bool = False) -> list[torch.Tensor]:
    """Column sums of each (n_programs, n_cols) slab of `partials`, the i-th cast to dtypes[i].

    partials: float32, contiguous, shape (len(dtypes), n_programs, n_cols) with 1 or 2 slabs.
    traced: pass True from inside a `triton_op` body (see `runtime.launchable`).
    Returns one (n_cols,) tensor per dtype, on partials' device.
    """
    k, n_rows, n_cols = partials.shape
    if k != len(dtypes) or k not in (1, 2):
        raise ValueError(f"sum_partials: {k} slabs of partials for {len(dtypes)} dtypes (1 or 2 supported)")
    if partials.dtype != torch.float32 or not partials.is_contiguous():
        raise ValueError("sum_partials: partials must be a contiguous float32 tensor")
    outs = [torch.empty(n_cols, dtype=dtype, device=partials.device) for dtype in dtypes]
    if n_cols:
        runtime.launchable(_sum_partials_kernel, traced)[(runtime.cdiv(n_cols, BLOCK_N), k)](
            partials, outs[0], outs[-1], n_rows, n_cols, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
        )  # fmt: skip
    return outs
