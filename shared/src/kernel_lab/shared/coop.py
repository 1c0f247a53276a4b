"""Cooperative rows: a row too long for one program is cut into chunks, one program per chunk,
and the programs of a row exchange per-chunk statistics through global memory in one launch.

A kernel using it (softmax's and the norms' long-row kernels) runs, in each program:

    row, split = coop_ticket(sync_ptr, n_splits, clear_ptr, clear_len)  # which chunk of which row
    ... first pass over the chunk: its two float32 statistics lo, hi ...
    words = coop_publish_and_gather(sync_ptr, n_rows, row, split, n_splits, lo, hi, SPLITS_POW2)
    ... merge coop_word_lo(words), coop_word_hi(words) over the chunks, second pass, write ...

Forward progress. Waiting on another program is only safe if that program is running or will
surely run. Programs take their (row, chunk) from a ticket counter (an atomic increment at
start), so every ticket below ours belongs to a program already running, and a row's chunks are
consecutive tickets. Rows whose chunks all hold tickets finish and free their SMs, so the one
partly started row always gets the rest of its programs as long as a row has no more chunks
than the GPU has SMs: the launcher must keep n_splits <= the SM count (`max_chunks`). Every
program publishes before it waits, and publishing never waits. The Triton interpreter runs
programs one after another, where a wait would never end: launchers use other kernels there.

Exchange. A chunk's two statistics travel as one 64-bit word written by one relaxed atomic
exchange, (hi bits) << 32 | (lo bits), which the caller keeps non-zero (e.g. a flag of 1.0 in
hi), so a word that reads non-zero is that chunk's whole: no memory fence orders it and no load
of the statistics follows the wait (the earlier protocol, a release per program and that load,
made softmax's forward 5-10% slower on an H200: see kernel-lab-softmax's ops.py). A waiting
program spins on its row's arrival count with one thread's relaxed atomic, not on the words:
every warp polling the words (8 warps, 16 words) took softmax's backward at 1024 x 131072 from
234 to 273 us; the count may arrive before a word does, hence the words' own loop.

Scratch. The launch's counters and words start at zero. Rather than a zero-filled allocation
per launch, eager launches take turns on two kept buffers, and each launch's programs zero the
other one, which the launch before left dirty (`workspace`): one launch on a stream finishes
before the next starts, so nothing reads a buffer while it is being cleared.

Kernels import the helpers by name (`from kernel_lab.shared.coop import coop_ticket, ...`), as
mlp's kernels import partial_sums.sum_if_last.

Needs triton (a kernel package's dependency); `kernel_lab.shared` itself does not import it.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from . import runtime


def max_chunks(device: torch.device) -> int:
    """The most chunks a row may be cut into on `device` (see the module docstring)."""
    return runtime.sm_count(device)


def workspace_size(n_rows: int, n_splits: int) -> int:
    """int32 words of a launch's scratch: the ticket counter and a padding word, an arrival count
    per row (n_rows rounded up to even, so that what follows is 8-byte aligned), then one int64
    word per chunk (n_rows x n_splits); the kernel slices it itself (no view ops on the host)."""
    return 2 + (n_rows + 1) // 2 * 2 + 2 * n_rows * n_splits


class _Pair:
    """Two scratch buffers used by turns on one stream: a launch takes the clean one and zeroes
    the `dirty` words the launch before it left in the other (see `workspace`)."""

    __slots__ = ("buffers", "dirty", "turn")

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.dirty = [0, 0]
        self.turn = 0

    def take(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        i, other = self.turn, 1 - self.turn
        work = self.buffers[i]
        if work is None or work.numel() < size:  # (buffers[i] is clean: the last launch zeroed it)
            work = self.buffers[i] = torch.zeros(size, dtype=torch.int32, device=device)
        clear = self.buffers[other]
        clear_len = self.dirty[other]
        self.dirty[i], self.dirty[other], self.turn = size, 0, other
        return work, work if clear is None else clear, clear_len


# Per (device, stream, thread): the _Pair of the launches one thread queues on one stream. The
# scheme needs the launches to run in the order `workspace` handed out their buffers: true for
# one thread's launches on one stream, not for two threads sharing a stream. At most
# MAX_WORKSPACES are kept; past that all are dropped (a dropped buffer still in use by a queued
# kernel is safe: the caching allocator reuses a freed block only for work queued after it on
# the stream it was allocated on, and a new _Pair starts from zeroed buffers).
_PAIRS: dict[tuple, _Pair] = {}
MAX_WORKSPACES = 64


def workspace(
    n_rows: int, n_splits: int, device: torch.device, traced: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(work, clear, clear_len) for one cooperative launch: `work` the zeroed int32 scratch of
    `workspace_size(n_rows, n_splits)` words (or more), and the first `clear_len` words of
    `clear` the ones its programs must zero (`coop_ticket` does, each program a share).

    Eager launches on a CUDA device take turns on two buffers kept for the current stream and
    thread: each launch zeroes what the launch before it left in the other buffer, so a repeated
    call costs no allocation and no zero-fill launch (`torch.zeros` was about 12 us of an eager
    call's host time on a lent H100 host). Traced launches (`traced`: inside a triton_op), CUDA
    graph captures and other devices get a fresh `torch.zeros` and nothing to clear (the graph
    then replays its own zero-fill). The buffers stay allocated until `release_workspaces()`."""
    size = workspace_size(n_rows, n_splits)
    if traced or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        work = torch.zeros(size, dtype=torch.int32, device=device)
        return work, work, 0
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), threading.get_ident())
    pair = _PAIRS.get(key)
    if pair is None:
        if len(_PAIRS) >= MAX_WORKSPACES:
            _PAIRS.clear()
        pair = _PAIRS[key] = _Pair()
    return pair.take(size, device)


def release_workspaces() -> None:
    """Drop the buffers `workspace` keeps (they return to torch's caching allocator)."""
    _PAIRS.clear()


def launch(run, *args, **kwargs):
    """run(*args, **kwargs): a kernel launch whose arguments may hold `workspace`'s buffers. If it
    raises (a failed launch, a KeyboardInterrupt), the kept buffers are dropped: whether the
    kernel was queued, and so which buffer is clean, is then unknown, and a launch that takes a
    dirty buffer would wait forever. (An exception between `workspace` and this call, a few
    bytecodes, is not covered.)"""
    try:
        return run(*args, **kwargs)
    except BaseException:
        release_workspaces()
        raise


@triton.jit
def _clear_share(clear_ptr, clear_len):
    """Zero this program's share of clear_ptr[:clear_len] (the programs of a 1-D grid split it)."""
    share = tl.cdiv(clear_len, tl.num_programs(0))
    start = tl.program_id(0) * share
    end = tl.minimum(start + share, clear_len)
    for off in range(start, end, 1024):
        idx = off + tl.arange(0, 1024)
        tl.store(clear_ptr + idx, tl.zeros([1024], tl.int32), mask=idx < end)


@triton.jit
def coop_ticket(sync_ptr, n_splits, clear_ptr, clear_len):
    """(row, split) of this program, in the order programs started: row int64. First zeroes the
    program's share of clear_ptr[:clear_len], the previous launch's scratch (`workspace`): no
    program of this launch reads it."""
    _clear_share(clear_ptr, clear_len)
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    return (t // n_splits).to(tl.int64), t % n_splits


@triton.jit
def coop_publish_and_gather(sync_ptr, n_rows, row, split, n_splits, lo, hi, SPLITS_POW2: tl.constexpr):
    """Publish this chunk's float32 scalars `lo` and `hi` (not both +0.0) and return its row's
    words once all n_splits chunks have published: int64 [SPLITS_POW2], 1 in the padding."""
    words_ptr = (sync_ptr + 2 + (n_rows + 1) // 2 * 2).to(tl.pointer_type(tl.int64)) + row * n_splits
    lo_bits = lo.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    word = (hi.to(tl.int32, bitcast=True).to(tl.int64) << 32) | lo_bits
    tl.atomic_xchg(words_ptr + split, word, sem="relaxed")
    count_ptr = sync_ptr + 2 + row
    arrived = tl.atomic_add(count_ptr, 1, sem="relaxed") + 1
    while arrived < n_splits:
        arrived = tl.atomic_add(count_ptr, 0, sem="relaxed")
    idx = tl.arange(0, SPLITS_POW2)
    words = tl.load(words_ptr + idx, mask=idx < n_splits, other=1, volatile=True)
    while tl.min(tl.where(words != 0, 1, 0), axis=0) == 0:
        words = tl.load(words_ptr + idx, mask=idx < n_splits, other=1, volatile=True)
    return words


@triton.jit
def coop_word_lo(words):
    """The `lo` statistics of `words` (float32, same shape)."""
    return (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def coop_word_hi(words):
    """The `hi` statistics of `words` (float32, same shape)."""
    return (words >> 32).to(tl.int32).to(tl.float32, bitcast=True)
