"""adamw_step_: input checks, the multi-tensor launcher, and its torch.library op.

Call path: `adamw_step_(...)` (and `AdamW.step()`) checks its inputs, then
- in eager mode calls `adamw_step_launch` directly (a custom op costs tens of microseconds of
  dispatch per call);
- under torch.compile calls `torch.ops.kernel_lab.adamw_step_`, a `custom_op` that mutates its
  list arguments in place, so the graph has no break.

How one launch covers many tensors: a pointer table (int64 [8, T]: where each tensor's param,
grad, exp_avg, exp_avg_sq, max_exp_avg_sq, master copy and step are, as byte offsets from the
table itself, so that the kernel's pointers keep a known alignment; then a zeroed counter per
tensor, with which the kernel increments the step counts itself) and a work
table (one int64 per program: tensor index << 32 | chunk index) live on the device. Each
program reads its entry, casts the addresses to typed pointers and updates CHUNK elements.
Both tables depend only on the addresses and sizes, so they are cached by those: a training
loop whose gradients come back at the same addresses (the caching allocator's usual
behaviour) copies no table after the first step, and a CUDA graph replays the tables it
captured. One launch per (device, param dtype, grad dtype, state dtype) in a call, nothing else
(torch's fused AdamW adds a `_foreach_add_` launch for the step counts).
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton.language as tl

from kernel_lab.shared import reference, runtime

from ._kernels import (
    NUM_ROWS,
    ROW_EXP_AVG,
    ROW_EXP_AVG_SQ,
    ROW_GRAD,
    ROW_MASTER,
    ROW_MAX_EXP_AVG_SQ,
    ROW_PARAM,
    ROW_STEP,
    _adamw_multi_tensor_kernel,
)

SUPPORTED_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Moments (exp_avg, exp_avg_sq, max_exp_avg_sq). Not float16: v = (1 - beta2) g^2 underflows its
# range (smallest subnormal 6e-8) for |g| below about 8e-3 at beta2 = 0.999, and a zero v turns
# the update into lr * m / eps.
SUPPORTED_STATE_DTYPES = (torch.float32, torch.bfloat16)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

# Elements per program, per loop iteration, warps: measured on an H200 (torch 2.11, triton 3.6)
# over 10M, 100M and 1B parameters in Qwen2.5 / Llama-3 tensor shapes (float32 params; bfloat16
# params with float32 and with bfloat16 moments), among chunks of 2K to 16K elements, blocks of
# 512 to 2K and 4 or 8 warps. With 16-byte accesses, 4096 / 1024 / 8 and 4096 / 512 / 4 were
# the best two (within 1% in geomean; 2-5% apart on single rows, either way); blocks of 2K,
# with 16 elements per thread at 4 warps, ran 10-30% slower. Four loop iterations hide the
# per-program prologue (three dependent table loads and the float64 bias corrections).
CHUNK = 4096
# bfloat16 moments: 14 B per bf16 parameter instead of 22-28, so twice the elements per program
# for about the same bytes, and half the programs (prologues and step-count atomics): 5-7%
# faster than 4096 at 100M and 1B bf16 params (H200), where float32 state ran 2% slower at 8192.
BF16_STATE_CHUNK = 8192
BLOCK = 1024
NUM_WARPS = 8
# The interpreter runs a program at a time on the CPU: small chunks make the small test
# tensors span several programs (multi-chunk tensors and masked tails are exercised).
INTERPRET_CHUNK = 256
INTERPRET_BLOCK = 128

# Tables of recent (addresses, sizes); entries created while a CUDA graph is being captured are
# also kept forever in _CAPTURED, because the graph reads them on every replay.
_TABLE_CACHE_SIZE = 32
_PTR_CACHE: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_WORK_CACHE: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = OrderedDict()
_CAPTURED: list[torch.Tensor] = []
_SPARE_PINNED: list[torch.Tensor] = []
_SPARES_PER_SIZE = 4


@dataclass
class _Bucket:
    """Tensors of one launch: same device, param dtype, grad dtype, state dtype, master or not."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    max_exp_avg_sqs: list[torch.Tensor] | None
    master_params: list[torch.Tensor] | None
    steps: list[torch.Tensor] | None


def _to_device(host: np.ndarray, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """A device copy of a small int64 table (into `out` if given), also inside CUDA graph capture.

    On CUDA the table goes through pinned memory with an asynchronous copy (a pageable copy
    cannot be captured). The pinned buffer stays alive as long as the device table; a copy made
    during capture is replayed by the graph, so its buffers are kept forever (_CAPTURED).
    Allocating pinned memory during capture is not allowed by every torch version (its host
    allocator queries events), so capture draws on spare buffers allocated beforehand (every
    build outside capture makes sure a few of at least that size exist: the usual
    warm-up-then-capture sequence then allocates nothing while capturing).
    """
    cpu = torch.from_numpy(host).reshape(-1)
    out = torch.empty(host.shape, dtype=torch.int64, device=device) if out is None else out
    if device.type != "cuda":
        return out.copy_(cpu.reshape(host.shape))
    n = cpu.numel()
    if torch.cuda.is_current_stream_capturing():
        fits = [i for i, b in enumerate(_SPARE_PINNED) if b.numel() >= n]
        pinned = _SPARE_PINNED.pop(fits[0])[:n] if fits else torch.empty(n, dtype=torch.int64, pin_memory=True)
        pinned.copy_(cpu)
        out.view(-1).copy_(pinned, non_blocking=True)
        _CAPTURED.extend((pinned, out))
        return out
    pinned = torch.empty(n, dtype=torch.int64, pin_memory=True)
    pinned.copy_(cpu)
    out.view(-1).copy_(pinned, non_blocking=True)
    out._kernel_lab_pinned = pinned  # type: ignore[attr-defined]
    # a few spares: one capture may build several tables (one per launch, plus work tables)
    if sum(b.numel() >= n for b in _SPARE_PINNED) < _SPARES_PER_SIZE:
        _SPARE_PINNED.append(torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=True))
    return out


def _cached(cache: OrderedDict, key: tuple, build):
    value = cache.get(key)
    if value is None:
        value = build()
        cache[key] = value
        if len(cache) > _TABLE_CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return value


def _work_tables(numels: tuple[int, ...], chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(numels on device, work table on device, number of programs) for these tensor sizes."""

    def build():
        sizes = np.asarray(numels, dtype=np.int64)
        # an empty tensor gets a program too: it updates nothing but counts the step (_next_step)
        chunks = np.maximum(-(-sizes // chunk), 1)
        tensor_index = np.repeat(np.arange(len(sizes), dtype=np.int64), chunks)
        first = np.repeat(np.cumsum(chunks) - chunks, chunks)
        chunk_index = np.arange(int(chunks.sum()), dtype=np.int64) - first
        work = (tensor_index << 32) | chunk_index
        return _to_device(sizes, device), _to_device(work, device), len(work)

    return _cached(_WORK_CACHE, (device, chunk, numels), build)


def _ptr_table(b: _Bucket, device: torch.device) -> tuple[torch.Tensor, bool]:
    """The int64 [7, T] table of a bucket: each tensor's byte offset from the table's own data
    (absent rows hold 0); and whether every address the kernel walks (all but the step
    counters) and the table are multiples of 16 bytes, for its 16-byte vector accesses."""
    t = len(b.params)
    rows = _rows(b)
    key = (device, *rows)

    def build():
        _check_walk(b)
        _check_overlaps(b, rows)
        table = torch.empty((NUM_ROWS, t), dtype=torch.int64, device=device)
        host = np.zeros((NUM_ROWS, t), dtype=np.int64)
        for i, row in enumerate(rows):
            if row is not None:
                # Python ints: exact whatever the addresses (a uint64 - int64 mix would be float64)
                host[i] = [address - table.data_ptr() for address in row]
        walked = [a for i, row in enumerate(rows) if row is not None and i != ROW_STEP for a in row]
        aligned = all(a % 16 == 0 for a in walked) and table.data_ptr() % 16 == 0
        return _to_device(host, device, table), aligned

    return _cached(_PTR_CACHE, key, build)


def _rows(b: _Bucket) -> list[tuple[int, ...] | None]:
    """The addresses of a bucket's tensors by pointer-table row (None: a row it has not)."""
    rows: list[tuple[int, ...] | None] = [None] * NUM_ROWS
    rows[ROW_PARAM] = tuple(x.data_ptr() for x in b.params)
    rows[ROW_GRAD] = tuple(x.data_ptr() for x in b.grads)
    rows[ROW_EXP_AVG] = tuple(x.data_ptr() for x in b.exp_avgs)
    rows[ROW_EXP_AVG_SQ] = tuple(x.data_ptr() for x in b.exp_avg_sqs)
    if b.max_exp_avg_sqs is not None:
        rows[ROW_MAX_EXP_AVG_SQ] = tuple(x.data_ptr() for x in b.max_exp_avg_sqs)
    if b.master_params is not None:
        rows[ROW_MASTER] = tuple(x.data_ptr() for x in b.master_params)
    if b.steps is not None:
        rows[ROW_STEP] = tuple(x.data_ptr() for x in b.steps)
    return rows


class TensorsChangedError(ValueError):
    """A tensor of a launch no longer has its parameter's shape and memory layout (_check_walk)."""


def _check_walk(b: _Bucket) -> None:
    """TensorsChangedError unless each param covers its memory without gaps and its grad, moments
    and master copy have its shape and memory layout: the kernel walks them all flat, in memory
    order, for the param's numel.

    Run when a pointer table is built (an address changed), so at no cost per cached step: the
    callers check their inputs, but AdamW.step() skips the checks while the grad tensors are the
    ones it checked at the last step, and `p.data = ...` / `p.grad.data = ...` (a resized
    parameter, `module.to(memory_format=torch.channels_last)`) keep those tensor objects. Walking
    a resized param over its old state corrupted memory; a new layout paired wrong elements.
    """
    seqs = [(label, seq) for label, seq in (("grad", b.grads), ("exp_avg", b.exp_avgs),
                                             ("exp_avg_sq", b.exp_avg_sqs), ("max_exp_avg_sq", b.max_exp_avg_sqs),
                                             ("master_param", b.master_params)) if seq is not None]
    for i, p in enumerate(b.params):
        shape, stride = p.shape, p.stride()
        if not is_dense(p):
            raise TensorsChangedError(f"adamw: a parameter of shape {tuple(shape)} has strides {stride}: "
                                      "it must cover its memory without gaps")
        for label, seq in seqs:
            x = seq[i]
            # (the usual case first: same shape and strides, two attribute reads; this runs over
            # every tensor of a bucket whenever its table is rebuilt)
            if x.shape != shape or (x.stride() != stride and not (x.is_contiguous() and p.is_contiguous())):
                raise TensorsChangedError(
                    f"adamw: a parameter of shape {tuple(shape)} (strides {stride}) and its {label} of shape "
                    f"{tuple(x.shape)} (strides {x.stride()}) no longer match: was a tensor's .data replaced?")


# (plain ints: the kernel's row constants are tl.constexpr, which neither hash nor compare as ints)
_PARAM, _GRAD, _MASTER, _STEP = int(ROW_PARAM), int(ROW_GRAD), int(ROW_MASTER), int(ROW_STEP)
_ROW_LABELS = {_PARAM: "param", _GRAD: "grad", int(ROW_EXP_AVG): "exp_avg", int(ROW_EXP_AVG_SQ): "exp_avg_sq",
               int(ROW_MAX_EXP_AVG_SQ): "max_exp_avg_sq", _MASTER: "master_param", _STEP: "step"}


def _check_overlaps(b: _Bucket, rows: list[tuple[int, ...] | None]) -> None:
    """ValueError where tensors of one launch share memory in a way that the kernel cannot update
    as it would separate copies of them. rows: their addresses, by pointer-table row.

    Each element is read and written by one thread of one program, reads first, and the programs
    run at once:
    - two written tensors that overlap (params that are overlapping views of one buffer, an
      exp_avg that is the exp_avg_sq, a master copy that is a moment) keep one of the two values
      written there, or race on a GPU (the interpreter, a program at a time, updated them in
      turn): refused; but for a master copy that is exactly its own param (both get one value);
    - a grad overlapping a tensor written for another param (p1.grad = p0), or one of its own
      param's at another offset or of another dtype, was read after another element's update
      had written there (in program order under the interpreter; a race on a GPU): refused. A
      grad that is exactly a tensor of its own param (p.grad = p; a grad that is its exp_avg) is
      read before it is written, as a copy would be: allowed, as are grads overlapping each
      other (only read).
    The tensors are dense (the callers check it): each spans [address, address + nbytes), and
    each row of a bucket has one dtype. Run where a pointer table is built (an address changed:
    no cost per cached step): one sort of the spans in numpy; a pairwise sweep only when two of
    them overlap.
    """
    numel = np.fromiter((p.numel() for p in b.params), dtype=np.int64, count=len(b.params))
    tensors = {_PARAM: b.params, _GRAD: b.grads, int(ROW_EXP_AVG): b.exp_avgs, int(ROW_EXP_AVG_SQ): b.exp_avg_sqs,
               int(ROW_MAX_EXP_AVG_SQ): b.max_exp_avg_sqs, _MASTER: b.master_params, _STEP: b.steps}
    starts, sizes, kinds = [], [], []
    for r, row in enumerate(rows):
        if row is None:
            continue
        starts.append(np.asarray(row, dtype=np.int64))
        # (a step count is one float32, whatever its param's size)
        sizes.append(tensors[r][0].element_size() * (numel if r != _STEP else np.ones_like(numel)))
        kinds.append(np.full(len(row), r))
    start, size, kind = np.concatenate(starts), np.concatenate(sizes), np.concatenate(kinds)
    index = np.tile(np.arange(len(b.params)), len(starts))
    keep = size > 0  # empty tensors touch no memory (and may all sit at one address)
    start, end, kind, index = start[keep], start[keep] + size[keep], kind[keep], index[keep]
    order = np.argsort(start, kind="stable")
    start, end, kind, index = start[order], end[order], kind[order], index[order]
    if len(start) < 2 or not (np.maximum.accumulate(end)[:-1] > start[1:]).any():
        return  # no two spans overlap: the usual case
    active: list[int] = []
    start, end, kind, index = start.tolist(), end.tolist(), kind.tolist(), index.tolist()
    for j in range(len(start)):
        active = [a for a in active if end[a] > start[j]]
        for a in active:
            if kind[a] == _GRAD and kind[j] == _GRAD:
                continue
            exact = index[a] == index[j] and start[a] == start[j] and end[a] == end[j]
            if exact and (_GRAD in (kind[a], kind[j]) or {kind[a], kind[j]} == {_PARAM, _MASTER}):
                continue
            raise ValueError(
                f"adamw: the {_ROW_LABELS[kind[a]]} of tensor {index[a]} and the {_ROW_LABELS[kind[j]]} of tensor "
                f"{index[j]} of one launch share memory: the update would not be that of separate tensors (params "
                "and their states must not overlap; a grad may share memory only with exactly a tensor of its own "
                "param)")
        active.append(j)


def gpu_chunk(state_dtype: torch.dtype) -> int:
    """Elements per program of a CUDA launch whose moments are `state_dtype`."""
    return BF16_STATE_CHUNK if state_dtype == torch.bfloat16 else CHUNK


def _launch_bucket(
    b: _Bucket, table: tuple[torch.Tensor, bool], *, step: float, lr: float, lr_tensor: torch.Tensor | None,
    beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool,
) -> None:
    device = b.params[0].device
    interpret = device.type != "cuda"
    chunk, block = (INTERPRET_CHUNK, INTERPRET_BLOCK) if interpret else (gpu_chunk(b.exp_avgs[0].dtype), BLOCK)
    numels, work, num_programs = _work_tables(tuple(p.numel() for p in b.params), chunk, device)
    if num_programs == 0:
        return
    ptrs, aligned = table
    runtime.launchable(_adamw_multi_tensor_kernel, False)[(num_programs,)](
        ptrs, numels, work, len(b.params),
        float(lr), lr_tensor if lr_tensor is not None else ptrs, float(step),
        beta1, beta2, 1.0 - beta1, 1.0 - beta2,
        math.log(beta1) if beta1 > 0 else -math.inf, math.log(beta2) if beta2 > 0 else -math.inf,
        eps, weight_decay,
        PARAM_DTYPE=_TL_DTYPES[b.params[0].dtype],
        GRAD_DTYPE=_TL_DTYPES[b.grads[0].dtype],
        STATE_DTYPE=_TL_DTYPES[b.exp_avgs[0].dtype],
        AMSGRAD=b.max_exp_avg_sqs is not None,
        MAXIMIZE=maximize,
        MASTER=b.master_params is not None,
        LR_FROM_PTR=lr_tensor is not None,
        STEP_FROM_PTR=b.steps is not None,
        ALIGNED=aligned,
        CHUNK=chunk,
        BLOCK=block,
        num_warps=NUM_WARPS,
    )


def _reference_step(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, *, step, lr, lr_tensor,
    beta1, beta2, eps, weight_decay, amsgrad, maximize,
) -> None:
    """The CPU fallback: the shared reference in float32, tensor by tensor."""
    lr = float(lr_tensor) if lr_tensor is not None else lr
    for i, p in enumerate(params):
        master = master_params[i] if master_params is not None else None
        vmax = max_exp_avg_sqs[i] if amsgrad else None
        new_p, m, v, new_vmax = reference.adamw_step(
            master if master is not None else p, grads[i], exp_avgs[i], exp_avg_sqs[i],
            step=float(steps[i]) if steps is not None else step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, amsgrad=amsgrad, max_exp_avg_sq=vmax, maximize=maximize,
            compute_dtype=torch.float32,
        )
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        if amsgrad:
            vmax.copy_(new_vmax)
        if master is not None:
            master.copy_(new_p)
        p.copy_(new_p)


def adamw_step_launch(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor] | None,
    master_params: Sequence[torch.Tensor | None] | None,
    steps: Sequence[torch.Tensor] | None,
    *,
    step: float,
    lr: float,
    lr_tensor: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
) -> None:
    """Launcher: one AdamW update of every tensor, in place. Assumes checked inputs.

    `steps` (float32 scalars on the params' device) are incremented first and then used, as
    torch.optim does (by the kernel itself, see _kernels._next_step); without them the 1-based
    `step` is used for every tensor. A `None` entry in `master_params` means "no master copy"
    for that tensor (float32 params).
    """
    if not params:
        return
    if not runtime.uses_triton(params[0]):
        # (the launches' check, made by _ptr_table: here on every call, this is the slow path)
        for b in _buckets(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps):
            _check_overlaps(b, _rows(b))
        if steps is not None:
            torch._foreach_add_(list(steps), 1.0)
        masters = None if master_params is None else list(master_params)
        for i in range(len(params)):
            _reference_step(
                params[i : i + 1], grads[i : i + 1], exp_avgs[i : i + 1], exp_avg_sqs[i : i + 1],
                None if max_exp_avg_sqs is None else max_exp_avg_sqs[i : i + 1],
                None if masters is None or masters[i] is None else masters[i : i + 1],
                None if steps is None else steps[i : i + 1],
                step=step, lr=lr, lr_tensor=lr_tensor, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            )
        return
    buckets = _buckets(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps)
    # every pointer table first: a check failing on a rebuilt one (_check_walk) launches nothing
    tables = [_ptr_table(b, b.params[0].device) for b in buckets]
    for b, table in zip(buckets, tables, strict=True):
        _launch_bucket(
            b, table, step=step, lr=lr, lr_tensor=lr_tensor, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, maximize=maximize,
        )


def _buckets(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps) -> list[_Bucket]:
    """Split the lists into launches of one (device, param dtype, grad dtype, state dtype, master
    or not); the moments of one parameter share a dtype (checked by the callers)."""
    p0, g0, m0 = params[0], grads[0], exp_avgs[0]
    masters = list(master_params) if master_params is not None else None
    if (
        all(p.dtype == p0.dtype and p.device == p0.device for p in params)
        and all(g.dtype == g0.dtype for g in grads)
        and all(m.dtype == m0.dtype for m in exp_avgs)
        and (masters is None or all(m is not None for m in masters))
    ):
        # the common case, one launch: no per-tensor sorting on the host
        return [_Bucket(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                        None if max_exp_avg_sqs is None else list(max_exp_avg_sqs), masters,
                        None if steps is None else list(steps))]
    buckets: dict[tuple, _Bucket] = {}
    for i, p in enumerate(params):
        master = masters[i] if masters is not None else None
        key = (p.device, p.dtype, grads[i].dtype, exp_avgs[i].dtype, master is not None)
        b = buckets.get(key)
        if b is None:
            b = buckets[key] = _Bucket(
                [], [], [], [], [] if max_exp_avg_sqs is not None else None, [] if master is not None else None,
                [] if steps is not None else None,
            )
        b.params.append(p)
        b.grads.append(grads[i])
        b.exp_avgs.append(exp_avgs[i])
        b.exp_avg_sqs.append(exp_avg_sqs[i])
        if max_exp_avg_sqs is not None:
            b.max_exp_avg_sqs.append(max_exp_avg_sqs[i])
        if master is not None:
            b.master_params.append(master)
        if steps is not None:
            b.steps.append(steps[i])
    return list(buckets.values())


# torch.library registration: what torch.compile sees. A custom_op (not a triton_op): the
# launcher reads tensor addresses to build its tables, which a traced (fake) tensor has not.


@torch.library.custom_op(
    "kernel_lab::adamw_step_",
    mutates_args=("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params", "steps"),
)
def _adamw_step_op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],  # empty: no amsgrad
    master_params: list[Optional[torch.Tensor]],  # noqa: UP045 - the schema inference needs typing.Optional
    steps: list[torch.Tensor],  # empty: use `step`
    step: float,
    lr: float,
    lr_tensor: Optional[torch.Tensor],  # noqa: UP045
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
) -> None:
    check_distinct_steps(steps, "adamw_step_")
    adamw_step_launch(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else None, master_params or None,
        steps or None, step=step, lr=lr, lr_tensor=lr_tensor, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
    )


@_adamw_step_op.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, step, lr, lr_tensor,
      beta1, beta2, eps, weight_decay, amsgrad, maximize) -> None:
    return None


def dispatch(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, *, step, lr, lr_tensor,
    beta1, beta2, eps, weight_decay, amsgrad, maximize,
) -> None:
    """Eager: the launcher; under torch.compile: the registered op. Inputs already checked."""
    kwargs = dict(
        step=float(step), lr=float(lr), lr_tensor=lr_tensor, beta1=float(beta1), beta2=float(beta2),
        eps=float(eps), weight_decay=float(weight_decay), amsgrad=bool(amsgrad), maximize=bool(maximize),
    )
    if torch.compiler.is_compiling():
        torch.ops.kernel_lab.adamw_step_(
            list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs or []),
            list(master_params or []), list(steps or []), **kwargs,
        )
        return
    adamw_step_launch(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, master_params, steps, **kwargs)


# Input checks.


def is_dense(t: torch.Tensor) -> bool:
    """True when `t` covers a gap-free block of memory (any dim order): it can be walked flat."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in _sorted_dims(t):
        if stride != expected:
            return False
        expected *= size
    return True


def _sorted_dims(t: torch.Tensor) -> list[tuple[int, int]]:
    """(stride, size) of the dims of size > 1, innermost first."""
    return sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1)


def check_distinct_steps(steps: Sequence[torch.Tensor], name: str) -> None:
    """ValueError when two params share a step tensor: the kernel increments each tensor's count
    once per launch (_kernels._next_step), for its own param."""
    if len({s.data_ptr() for s in steps}) != len(steps):
        raise ValueError(f"{name}: the step tensors must be distinct (one count per param, each incremented once)")


def check_hyperparameters(lr, beta1, beta2, eps, weight_decay, *, name: str) -> None:
    """ValueError/TypeError for hyper-parameters torch.optim.AdamW would also reject."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.dtype.is_floating_point:
            raise ValueError(f"{name}: a tensor lr must be a 1-element floating-point tensor, got {lr.dtype} "
                             f"of shape {tuple(lr.shape)}")
        # (a CUDA lr is not read back: that would synchronize every step; `not >=` also rejects NaN)
        if lr.device.type == "cpu" and not float(lr) >= 0:
            raise ValueError(f"{name}: lr must be >= 0, got {float(lr)}")
    # numbers.Real: numpy scalars too (np.float32(3e-4) from a config), as torch.optim.AdamW takes
    elif not isinstance(lr, numbers.Real) or isinstance(lr, bool):
        raise TypeError(f"{name}: lr must be a float or a 1-element tensor, got {type(lr).__name__}")
    elif not lr >= 0:
        raise ValueError(f"{name}: lr must be >= 0, got {lr}")
    for label, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= _real(beta, label, name) < 1.0:
            raise ValueError(f"{name}: {label} must be in [0, 1), got {float(beta)}")
    if not _real(eps, "eps", name) >= 0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps}")
    if not _real(weight_decay, "weight_decay", name) >= 0:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")


def _real(value, label: str, name: str) -> float:
    """float(value) for a real number or a 1-element tensor; TypeError naming the argument for
    anything else (float() would raise without the name, and would take a string such as "0.9")."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(f"{name}: {label} must be a float, got a tensor of shape {tuple(value.shape)} "
                            f"and dtype {value.dtype}")
        return float(value)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name}: {label} must be a float, got {type(value).__name__}")
    return float(value)


def check_param(p: torch.Tensor, where: str) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(p).__name__}")
    if p.dtype not in SUPPORTED_PARAM_DTYPES:
        raise TypeError(f"{where}: dtype must be float32, float16 or bfloat16, got {p.dtype}")
    if p.layout != torch.strided:
        raise TypeError(f"{where}: must be a dense (strided) tensor, got layout {p.layout}")
    if not is_dense(p):
        raise ValueError(f"{where}: must cover its memory without gaps (a contiguous tensor or a permutation "
                         f"of one), got shape {tuple(p.shape)} with strides {p.stride()}")


def check_grad(g, p: torch.Tensor, where: str) -> None:
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(g).__name__}")
    if g.is_sparse or g.layout != torch.strided:
        raise TypeError(f"{where}: sparse gradients are not supported by AdamW (layout {g.layout}); "
                        "use torch.optim.SparseAdam")
    if g.dtype not in SUPPORTED_PARAM_DTYPES:
        raise TypeError(f"{where}: dtype must be float32, float16 or bfloat16, got {g.dtype}")
    if g.shape != p.shape or g.device != p.device:
        raise ValueError(f"{where}: expected shape {tuple(p.shape)} on {p.device} like its parameter, got "
                         f"{tuple(g.shape)} on {g.device}")


def check_state(s, p: torch.Tensor, where: str, dtypes: tuple[torch.dtype, ...] = SUPPORTED_STATE_DTYPES) -> None:
    """Optimizer state: one of `dtypes`, the parameter's shape, device and memory layout."""
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(s).__name__}")
    if s.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{where}: must be {names}, got {s.dtype}")
    if s.shape != p.shape or s.device != p.device:
        raise ValueError(f"{where}: expected shape {tuple(p.shape)} on {p.device} like its parameter, got "
                         f"{tuple(s.shape)} on {s.device}")
    same_layout(s, p, where)


def same_layout(t: torch.Tensor, p: torch.Tensor, where: str) -> None:
    """The kernel walks param, grad and state in memory order: their strides must agree."""
    if not (t.is_contiguous() and p.is_contiguous()) and (t.stride() != p.stride() or not is_dense(t)):
        raise ValueError(f"{where}: expected the memory layout of its parameter (strides {p.stride()}), "
                         f"got strides {t.stride()}")


def adamw_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int | float | Sequence[torch.Tensor],
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool = False,
    max_exp_avg_sqs: Sequence[torch.Tensor] | None = None,
    maximize: bool = False,
    master_params: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """One AdamW update of every tensor in `params`, in place (torch.optim.AdamW's math).

        g = -grad if maximize else grad;  p *= 1 - lr * weight_decay
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
        v_max = max(v_max, v) (amsgrad: v_max replaces v below)
        p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)

    params: float32, float16 or bfloat16 tensors of any shape (contiguous, or a permutation of
    a contiguous layout); grads: the same shapes, devices and layouts, any of those dtypes;
    exp_avgs, exp_avg_sqs (and max_exp_avg_sqs with amsgrad): float32 or bfloat16 (one dtype per
    parameter: its moments are stored rounded to nearest even, the math stays float32), same
    shapes and layouts. master_params: optional float32 copies of low-precision params (None entries allowed):
    the update reads and writes the master copy and stores its rounding into the param.
    step: the 1-based number of this update for every tensor, or a list of float32 scalar
    tensors on the params' device (one per param, distinct) that is incremented first, then
    used, so the call can be captured in a CUDA graph. lr: a float or a 1-element tensor (read on the
    device at run time, e.g. from a scheduler inside a CUDA graph).

    One Triton launch per (device, param dtype, grad dtype, state dtype); it increments the step
    counters too.
    Raises TypeError for wrong types/dtypes (sparse grads included) and ValueError for
    mismatched lengths, shapes, devices or layouts and for out-of-range hyper-parameters.
    """
    name = "adamw_step_"
    check_hyperparameters(lr, beta1, beta2, eps, weight_decay, name=name)
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if amsgrad:
        if max_exp_avg_sqs is None:
            raise ValueError(f"{name}: max_exp_avg_sqs is required when amsgrad=True")
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    if master_params is not None:
        lists["master_params"] = master_params
    steps = None
    if isinstance(step, (list, tuple)):
        steps = step
        lists["step"] = steps
    elif isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise TypeError(f"{name}: step must be an int or a list of float32 scalar tensors, got {type(step).__name__}")
    elif not step >= 1:
        raise ValueError(f"{name}: step is the 1-based number of this update, got {step}")
    for label, seq in lists.items():
        if len(seq) != n:
            raise ValueError(f"{name}: {label} has {len(seq)} entries, params has {n}")
    if n:
        check_param(params[0], f"{name}: params[0]")  # (before its device is read)
    device = params[0].device if n else None
    for i, p in enumerate(params):
        check_param(p, f"{name}: params[{i}]")
        if p.device != device:
            raise ValueError(f"{name}: params[{i}] is on {p.device}, params[0] on {device}: one device per call")
        check_grad(grads[i], p, f"{name}: grads[{i}]")
        same_layout(grads[i], p, f"{name}: grads[{i}]")
        moments = {"exp_avgs": exp_avgs[i], "exp_avg_sqs": exp_avg_sqs[i]}
        if amsgrad:
            moments["max_exp_avg_sqs"] = max_exp_avg_sqs[i]
        for label, s in moments.items():
            check_state(s, p, f"{name}: {label}[{i}]")
            if s.dtype != exp_avgs[i].dtype:
                raise TypeError(f"{name}: {label}[{i}] is {s.dtype}, exp_avgs[{i}] is {exp_avgs[i].dtype}: the "
                                "moments of a parameter share one dtype")
        if master_params is not None and master_params[i] is not None:
            check_state(master_params[i], p, f"{name}: master_params[{i}]", (torch.float32,))
        if steps is not None:
            s = steps[i]
            if not isinstance(s, torch.Tensor) or s.numel() != 1 or s.dtype != torch.float32 or s.device != device:
                raise ValueError(f"{name}: step[{i}] must be a 1-element float32 tensor on {device}")
    if steps is not None and not torch.compiler.is_compiling():  # (compiled: the op checks, see _adamw_step_op)
        check_distinct_steps(steps, name)
    if isinstance(lr, torch.Tensor) and n and lr.device != device and lr.device.type != "cpu":
        raise ValueError(f"{name}: lr is on {lr.device}, params on {device}")
    lr_value, lr_tensor = _split_lr(lr, device)
    dispatch(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else None, master_params, steps,
        step=1.0 if steps is not None else float(step), lr=lr_value, lr_tensor=lr_tensor, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
    )


def _split_lr(lr, device) -> tuple[float, torch.Tensor | None]:
    """(float lr, None), or (0.0, lr tensor) when the kernel reads lr on the params' device.

    A CPU lr tensor with CUDA params is read on the host (no device sync); an lr tensor on the
    params' device is read by the kernel at run time, so a captured CUDA graph sees updates.
    """
    if isinstance(lr, torch.Tensor):
        if device is not None and lr.device == device:
            return 0.0, lr
        return float(lr), None
    return float(lr), None


__all__ = ["adamw_step_", "adamw_step_launch", "check_hyperparameters"]
