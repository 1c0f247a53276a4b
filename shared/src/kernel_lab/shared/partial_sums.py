"""The last step of a parameter gradient reduced across rows: partial sums added up.

A backward kernel that needs a per-feature gradient (a norm's dweight and dbias, a bias_gelu's
dbias) cannot sum over every row in one program, so each of its programs writes its own float32
partial sums, which are then added up:

    partials (n_programs, n_cols) float32  ->  gradient (n_cols,) in the parameter's dtype

(or several such slabs at once, one per parameter: (n_slabs, n_programs, n_cols) -> (n_slabs, n_cols)).

Two ways, both in a fixed order (the same result every run):
- `sum_partials`: one more Triton launch after the kernel. It replaces `partial.sum(0).to(dtype)`:
  two torch ops, and on the lent H200 host each op costs about as much host time as a whole
  Triton launch, in a backward whose host path (not the GPU) bounds mid-sized rows under
  `torch.autograd.grad`.
- `sum_if_last` (a `triton.jit` helper) inside the kernel itself: the program that finishes
  last adds the partials up, so the backward is one launch. It needs a zeroed int32 arrival
  counter per group of programs; `workspace` keeps the partials and counters of each CUDA
  stream between launches, so a repeated backward allocates neither. The price is a serial
  tail on the GPU (one program adds all rows of its columns after the others are done): worth it
  where the host, not the GPU, bounds the backward.

Needs triton (a kernel package's dependency); `kernel_lab.shared` itself does not import it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime

# Tiles of the sum: BLOCK_N columns a program, BLOCK_M partial rows a loop step, ELEMENTS a step
# over NUM_WARPS warps (16 values a thread). The partials are a few MB, mostly still in L2 from the
# kernel that wrote them, so the sum is bound by latency, not bytes: its time is the loop steps
# of one program, and every SM should have a program. Columns a program are therefore the widest
# of MAX_BLOCK_N, 32, 16, 8 that still gives each SM one. The partials of a 32768 x 2048 RMSNorm
# backward (528 x 2048 float32) on an H200, one profiler run timing both: 7.2 us with fixed
# 64-column programs (32 of them, 17 serial steps each over the 528 rows), 2.7 with these tiles.
MAX_BLOCK_N = 64
MIN_BLOCK_N = 8
ELEMENTS = 2048
NUM_WARPS = 4


@triton.jit
def _sum_partials_kernel(
    partial_ptr,  # (n_slabs, n_rows, n_cols) float32, contiguous
    out_ptr,  # (n_slabs, n_cols), contiguous
    n_rows, n_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # program (column block, slab): each slab is summed on its own
    slab = tl.program_id(1).to(tl.int64)
    partial_ptr += slab * n_rows * n_cols
    out_ptr += slab * n_cols
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in tl.range(0, n_rows, BLOCK_M, num_stages=3):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        acc += tl.load(partial_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def _sum_tile(n_rows: int, n_cols: int, sms: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the sum: the widest column block leaving no SM without a program
    (MIN_BLOCK_N if none does), ELEMENTS a step, never more rows a step than there are."""
    block_n = MAX_BLOCK_N
    while block_n > MIN_BLOCK_N and runtime.cdiv(n_cols, block_n) < sms:
        block_n //= 2
    return min(ELEMENTS // block_n, runtime.next_power_of_2(max(n_rows, 1))), block_n


def sum_partials(partials: torch.Tensor, dtype: torch.dtype, traced: bool = False) -> torch.Tensor:
    """Column sums of `partials` (float32, contiguous, (n_programs, n_cols)), cast to `dtype`;
    or of each slab of (n_slabs, n_programs, n_cols) partials, in the same launch (a LayerNorm's
    dweight and dbias: one launch instead of two, where host time bounds the backward).

    traced: pass True from inside a `triton_op` body (see `runtime.launchable`).
    Returns a new (n_cols,) tensor of `dtype` on partials' device, or (n_slabs, n_cols).
    """
    if partials.dtype != torch.float32 or not partials.is_contiguous() or partials.ndim not in (2, 3):
        raise ValueError(f"sum_partials: partials must be a contiguous 2-D or 3-D float32 tensor, got "
                         f"{partials.dtype} of shape {tuple(partials.shape)}")
    *slabs, n_rows, n_cols = partials.shape
    out = torch.empty((*slabs, n_cols), dtype=dtype, device=partials.device)
    if out.numel():
        # Launch plan key (runtime.DirectLauncher.planned): the device and the sizes fix the grid
        # and the integer specialisations, the addresses' alignment the pointers'. A backward
        # calls this on the autograd engine's device thread, where host work costs about twice
        # what it costs on the caller's thread.
        # (none when traced: torch.compile traces with fake tensors, which have no address)
        plan = None if traced else (partials.device, partials.shape, dtype, partials.data_ptr() % 16,
                                    out.data_ptr() % 16)
        block_m, block_n = _sum_tile(n_rows, n_cols, runtime.sm_count(partials.device))
        grid = (runtime.cdiv(n_cols, block_n), slabs[0] if slabs else 1)
        runtime.launchable(_sum_partials_kernel, traced, plan)[grid](
            partials, out, n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


@triton.jit
def sum_if_last(partial_ptr, out_ptr, arrivals_ptr, n_parts, n_cols, cols, SUM_ROWS: tl.constexpr):
    """The fused `sum_partials` of one group of columns, for a kernel whose `n_parts` programs
    each write one row of float32 partial sums at `cols` (a vector of column indices) of
    `partial_ptr` ((n_parts, n_cols), contiguous). Every one of those programs calls this after
    storing its row; the one that arrives last (counted on `arrivals_ptr`, an int32 that is zero
    before the launch) adds the n_parts rows, SUM_ROWS at a time in a fixed order, stores the
    sums cast to out_ptr's dtype at out_ptr + cols, and sets the counter back to zero for the
    next launch on the stream.

    Ordering: the barrier puts every thread's partial stores before the arrival, whose release
    (acq_rel, GPU scope) publishes them; the last program's acquire makes them visible to its
    loads, which bypass L1 (.cg) so that no stale line is read."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == n_parts - 1:
        col_mask = cols < n_cols
        acc = tl.zeros([SUM_ROWS, cols.shape[0]], tl.float32)
        for start in tl.range(0, n_parts, SUM_ROWS, num_stages=3):
            rows = start + tl.arange(0, SUM_ROWS)
            mask = (rows < n_parts)[:, None] & col_mask[None, :]
            acc += tl.load(partial_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0,
                           cache_modifier=".cg")
        tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_mask)
        tl.atomic_xchg(arrivals_ptr, 0)


# Per (device, stream): (partials, arrivals). Kernels of one stream run one after another, so
# consecutive launches on it can share one buffer; launches on other streams get their own. At
# most MAX_WORKSPACES are kept (torch's stream pools recycle a few dozen handles per device, but
# external streams are unbounded): past that all are dropped, as launch plans are. A dropped
# buffer still in use by a queued kernel is safe: the caching allocator reuses a freed block only
# for work queued after it on the stream it was allocated on.
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
MAX_WORKSPACES = 64


def workspace(device: torch.device, n_parts: int, n_cols: int, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, arrivals) for one launch of a kernel that calls `sum_if_last`: partials a flat
    float32 tensor of at least n_parts * n_cols elements (contents undefined; the kernel reads
    it as (n_parts, n_cols) rows), arrivals at least n_groups int32 zeros (one counter per group
    of columns).

    On a CUDA device both are buffers kept for the current stream and reused by the next launch
    on it (`sum_if_last` leaves the counters at zero), grown as needed; they stay allocated (a
    few MB at most) until `release_workspaces()`. While the stream captures a CUDA graph they are
    fresh instead (the graph's pool owns them and the zeroing is captured with the kernel), and
    so on the CPU (interpreter)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return (torch.empty(n_parts * n_cols, dtype=torch.float32, device=device),
                torch.zeros(n_groups, dtype=torch.int32, device=device))
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    held = _WORKSPACES.get(key)
    if held is None or held[0].numel() < n_parts * n_cols or held[1].numel() < n_groups:
        size = max(n_parts * n_cols, 0 if held is None else held[0].numel())
        groups = max(n_groups, 0 if held is None else held[1].numel())
        if held is None and len(_WORKSPACES) >= MAX_WORKSPACES:
            _WORKSPACES.clear()
        held = _WORKSPACES[key] = (torch.empty(size, dtype=torch.float32, device=device),
                                   torch.zeros(groups, dtype=torch.int32, device=device))
    return held


def release_workspaces() -> None:
    """Drop the buffers `workspace` keeps (they return to torch's caching allocator)."""
    _WORKSPACES.clear()
