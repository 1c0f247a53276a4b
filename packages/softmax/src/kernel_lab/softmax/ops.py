"""softmax / log_softmax: input checks, launchers, torch.library ops and autograd.

Call path: `softmax(x)` checks its inputs, then
- in eager mode calls the launcher directly (no custom-op dispatch: a custom op costs tens of
  microseconds per call, longer than the kernel on small inputs), through `_SoftmaxFunction`
  when a gradient is needed;
- under torch.compile calls `torch.ops.kernel_lab.softmax_fwd`, a `triton_op` whose backward is
  registered with `register_autograd`, so the graph has no break.
Both paths run the same launchers, `softmax_fwd` and `softmax_bwd`.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
from torch.library import triton_op

from kernel_lab.shared import coop, reference, runtime
from kernel_lab.shared.runtime import plan_arg_key
from kernel_lab.shared.vector_hints import vector_alignment

from ._kernels import (
    _softmax_bwd_coop_kernel,
    _softmax_bwd_looped_kernel,
    _softmax_bwd_partial_kernel,
    _softmax_bwd_rows_kernel,
    _softmax_bwd_split_kernel,
    _softmax_fwd_coop_kernel,
    _softmax_fwd_looped_kernel,
    _softmax_fwd_partial_kernel,
    _softmax_fwd_rows_kernel,
    _softmax_fwd_split_kernel,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Longest row held in registers in one pass. 16384 float32 values over 32 warps is 16 values
# per thread. 32768 columns also compile without spills (triton 3.6, sm_90: 56 registers at 32
# warps), but then one 1024-thread program fills an SM and nothing overlaps its load, reduce and
# store phases: 172 us against the cooperative kernel's 168 us at 4096 x 32768 bf16 on an H200.
# The backward holds two rows (y and dy), hence half.
FWD_MAX_FUSED_COLS = 16384
BWD_MAX_FUSED_COLS = 8192
# Elements one program of the rows kernels handles: short rows are batched BLOCK_M at a time
# so that each program still moves enough bytes to hide its launch and reduction latency.
# Forward, H200 sweep of 1024, 2048 and 4096 (2**27 bf16 elements, the kernel launched directly,
# CUDA-graph replays alternated over nine rounds, two fresh inputs a width; scratch): 2048 was
# the fastest or level at every width from 64 to 8192 columns, 7% faster than 1024 at 512 and
# 1024 columns (128.0 against 137.9 us at 131072 x 1024, where torch.compile took 128); only
# ragged 1000-column rows preferred one row a program (151.8 against 157.4 us). An earlier H100
# sweep of 512 to 4096 had 1024 level with 2048 at 1024 columns (179.2 against 180.0 us) and
# 1-1.5 us faster at 64 to 256 columns; in the H100 benchmark 131072 x 1024 bf16 took 183.3 us
# with 2048 (history 0021, 0.99x Liger) against 180.2 with 1024 (0017, 1.00x): 2048 costs the
# H100 about 1-2% there and gains the H200 7%.
# The backward (three tensors) was level from 512 to 4096 at 1024 columns and more (bf16
# 131072 x 1024 on an H100: 266.3 us at 512 against 265.9 at 2048), 1-1.5% faster at 512 with
# 64 to 128 columns (bf16 and float32) and with 256 to 512 bf16 columns: it keeps 2048 until a
# second run confirms that short-row gain (one sweep so far, no stored history).
# A backward tile of 8192 (H100, same method, later): 0.6-0.8% faster on 2**27 bf16 elements
# at 512-4096 columns (131072 x 1024: 264.2 against 265.8 us), but 11-14% slower on small or
# ragged inputs (1024 x 1024, 256 x 4096, 32768 x 1000: fewer, larger programs): kept at 2048.
# (Tried and dropped, H100, scratch, 2026-11-27: a persistent rows forward, a grid of 4-16
# programs per SM striding over row tiles with `tl.range(num_stages=1..3)` prefetching the next
# tile, 1-2 rows a tile over 4-16 warps: 3-10% slower than this kernel at every shape tried
# (131072 x 1024 bf16 / fp16, 65536 x 2048, 32768 x 4096, 16384 x 8192, 131072 x 1000), seven
# rounds of back-to-back launches alternated in one process. Same run: one row a program beat
# this tile by 1.0% at 131072 x 1024 (180.8 against 182.7 us) and lost by 1.6% at 131072 x 1000.)
FWD_ROWS_TILE = 2048
BWD_ROWS_TILE = 2048
# Large backward inputs (at least BWD_LARGE_TILE_MIN_ELEMENTS, i.e. dozens of programs an SM at
# this tile) take 8192-element tiles: H100, bf16, the rows kernel at each (BLOCK_M, warps)
# alternated over seven rounds with torch.compile in one process (scratch, 2026-11-27), us:
# 131072 x 1024 263.5 (8 rows over 8-16 warps) against 265.3 (2 rows over 4), torch.compile
# 265.8; 32768 x 4096 263.5 (2 rows over 16) against 265.2 (1 over 8), torch.compile 263.1;
# 131072 x 1000 257.6 against 260.3, torch.compile 261.1. Smaller inputs keep 2048 (above:
# 32768 x 1000 was 11-14% slower at 8192).
BWD_LARGE_ROWS_TILE = 8192
BWD_LARGE_TILE_MIN_ELEMENTS = 1 << 26
# Rows past the fused limits but of at most WIDE_ROWS_MAX_COLS, too few of them for the
# L2-looped kernels below: one program a row still holds the whole row, the forward over 32
# warps, the backward (two rows in registers) over 16. Cutting such rows across cooperating
# programs cost more in synchronisation than it gained in parallelism. H100, bf16, alternated
# over five rounds (scratch, 2026-11-27), us, this kernel against the cooperative plan,
# torch.softmax and torch.compile: forward 512 x 32768 31.5 against 72.6, 39.1, 74.0; 2048 x
# 32768 97.7 against 102.1, 138.2, 141.1; 1024 x 24576 45.8 against 75.9, 56.6, 70.4. Backward
# (16 warps; 8 were up to 1% faster in bf16 but would spill float32 rows): 512 x 32768 38.3
# against 87.7, torch.compile 76.2; 2048 x 32768 135.1 against 168.6, 135.6.
# The backward of 16-bit rows takes it before the L2-looped kernel too, with many rows, where the
# row fills at least WIDE_ROWS_MIN_FILL of its power-of-two block. Same method, us, against the
# looped kernel at its best tile and torch.compile: 4096 x 32768 271.8 against 279.4, 265.2
# (fp16 271.2, 280.6, 264.8); 8192 x 16384 263.4, 264.6, 264.8; 2560 x 24576 126.0, 128.3,
# 133.2; 6400 x 20000 (61% full) 256.1, 259.5, 284.6; 8192 x 12288 198.6,
# 201.1, 199.3; but 16384 x 8200 (50% full) 298.6 against 264.9, 263.3. float32 4096 x 32768:
# 570.6 against 544.1 (32768-column steps over 32 warps), 544.7: float32 keeps its plan.
# torch.compile's kernel at 4096 x 32768 is the looped one, 16384-column steps over 32 warps,
# with the row length a compile-time constant; ours at that tile took 280-282 us in bf16.
# Rows of odd length or stride (ODD_* below) keep their plans: not measured with this kernel.
WIDE_ROWS_MAX_COLS = 32768
WIDE_ROWS_MIN_FILL = 0.6
FWD_WIDE_ROWS_NUM_WARPS = 32
BWD_WIDE_ROWS_NUM_WARPS = 16
# ... except that many such backward rows which fill their block exactly (16384 or 32768 columns,
# e.g. Mistral's 32768-token vocabulary) load y and dy again for dx (REREAD: from L2, which
# still holds the row just summed) instead of holding them across the row's sum, over 32 warps:
# a program then holds no row while it reduces, and two fit an SM. H100, bf16 unless said, the
# rows kernel launched directly, alternated over seven rounds, two runs (scratch, 2026-11-28),
# us, reread over 32 warps against held over 16 (the plan before) and the best other tile:
# 4096 x 32768 266.6-267.1 against 271.8-272.6 (held over 8: 269.4-270.1; a looped kernel with
# four unrolled, unmasked 8192-column steps over 32 warps 265.8-266.4), fp16 266.3-266.6 against
# 271.5-271.8; 8192 x 16384 265.4-266.0 against 264.3-264.6 (level); fewer rows, 2048 x 32768
# (15.5 an SM): 137.0-137.8 against 136.7-137.2 (held over 8: 135.3-135.7), and 512 x 32768 40.4
# against 37.2. Rows that fill part of their block lost: 2560 x 24576 132.2-132.9 against
# 127.4-127.9, 6400 x 20000 297.9 against 256.5. (Rows of at most 8192 columns gained 0.6-0.8%
# with it at 16384 x 8192 and 32768 x 4096: not taken.) torch.compile's kernel at 4096 x 32768
# took 274.0 us in the benchmark (history 0038).
BWD_REREAD_MIN_ROWS_PER_SM = 24
BWD_REREAD_NUM_WARPS = 32
# Columns per program and warps of the cooperative kernels (CUDA; rows longer than the fused
# limit). A row may be cut into at most as many chunks as the GPU has SMs (kernel_lab.shared.coop),
# e.g. 2M columns on 132 SMs in the forward. What bounds them is the synchronisation, not the
# bytes: a timeline of the forward (globaltimer per phase, H200, bf16 1024 x 131072, 8192-column
# chunks in registers) had each program live 6.8 us, of which its load took 1.9 and publishing
# its statistics (a release atomic after the stores) 2.7, the wait 0.8 and the merge 0.6: a
# program's registers hold its chunk through all of it, 4 to 6 programs fit an SM, and the GPU
# ran at about 73% of copy bandwidth. The forward therefore holds no chunk: it reads its
# COOP_CHUNK columns in COOP_BLOCK_N steps twice, the second time from L2, so a program moves
# twice the bytes per wait in the same registers: 164 against 174 us at 1024 x 131072 bf16 and
# 161 against 173 in fp16, level at 4096 x 32768 (H200, both kernels alternated, five rounds).
# The price is latency on inputs of one wave of programs (4 x 1M, 32 x 128k, 64 x 64k): 10.0 to
# 10.7 us of GPU time against 8.9 to 9.6 (CUDA-graph replays), where an eager call took 27 us
# (4 x 1M and 32 x 128k in history 0063: host time, not the kernel, sets that).
# Since 0.2.5 the statistics travel as one 64-bit word per chunk, written by a relaxed atomic
# exchange, with a relaxed per-row arrival count to spin on (kernel_lab.shared.coop): no
# release fence, no load of the statistics after the wait. H200 bf16, both protocols' kernels
# alternated in one process (five rounds): forward 4096 x 32768 166.1 -> 151.0 us, 1024 x 131072
# 164.5 -> 156.0 (fp16 163.0 -> 147.8 and 161.5 -> 153.2); backward 1024 x 131072 227.3 -> 219.8,
# log-softmax 242.2 -> 228.7 (the new one's figures from a second run on the same lease; 4 warps
# instead of 8 were level on softmax and 11% slower on log-softmax). What the synchronisation
# still costs: without any wait (wrong results, same bytes) the forward took 141.5 us at 1024 x
# 131072, against 139.8 for one read and one write without the second pass.
# Tried there and slower: spinning on the words from every warp instead of on a count; a
# persistent grid (with or without taking the next ticket before the wait); the second pass of
# a chunk done by the program `lag` tickets later (no wait; slower at lags of 64 to 2048
# chunks); an L2 prefetch of the chunk at start, or during the wait of the chunk 128 to 1200
# tickets ahead (level at best); two rows' chunks a program, both published before either wait;
# pipelined loads (tl.range num_stages 2-4); a register cap (maxnreg 56-72: spills);
# chunks held in bfloat16 (the compiler keeps the float32 copy), or only their second step
# (reading the first again); 32768-column chunks.
# Thread-block clusters (num_ctas > 1) do not compile with these reductions (triton 3.6).
# The backward (y and dy: twice the bytes per column) keeps its chunk in registers from load to
# store; reading it twice was slower there (81.7% of copy bandwidth against 83.0% at 1024 x
# 131072; with the 64-bit words 78.7% against 87.1%). Tiles, H200 bf16 sweeps: the forward's
# the best of chunks {8K .. 64K} x steps {4K, 8K} x {4, 8} warps at 32k and 128k columns, the
# backward's of chunks {4K, 8K, 16K} x {4, 8} warps (and 16 with the release/acquire protocol).
COOP_CHUNK = 16384
COOP_BLOCK_N = 8192
COOP_NUM_WARPS = 4
BWD_COOP_CHUNK = 8192
BWD_COOP_NUM_WARPS = 8
# log-softmax's backward (dx = dy - exp(y) * sum(dy)) is faster in smaller programs: 4096-column
# chunks over 4 warps against 8192 over 8, H200 bf16, both alternated over five rounds through
# softmax_bwd: 215.9 against 232.9 us at 1024 x 131072, 217.0 against 221.6 at 4096 x 32768
# (softmax's own backward was 1-2% slower so).
LOG_BWD_COOP_CHUNK = 4096
LOG_BWD_COOP_NUM_WARPS = 4
# Rows with an odd length or stride (GPT-2's 50257-token vocabulary) have no two neighbours that
# can be proven to share a 16-byte vector (kernel_lab.shared.vector_hints). Until 0.2.15 every
# access was then of one element; since, the long-row kernels read such rows through 16-byte
# aligned windows (_windowed; the kernels' _row_window), whole vectors but for each row's two
# partial end vectors, where the tensors allow it (16-byte aligned, row strides equal modulo a
# vector: contiguous inputs). The tiles stay their own. Element by element, H200, bf16, the
# kernels alternated over five rounds (scratch, 2026-11-27), in us: forward 4096 x 50257:
# cooperative with 8192-column chunks in 1024-column steps over 4 warps 416, (16384, 8192, 4) as
# above 959, torch.softmax 360; 1024 x 131071: 265 against 512 (torch 311); 8192 x 20001 (many
# rows of at most 64 KB): the L2-looped kernel in 4096-column steps over 4 warps 246, in
# 16384-column steps over 8 (as above) slower than any cooperative tile (331 at the best).
# Backward 4096 x 50257: cooperative 4096-column chunks over 4 warps 466, (8192, 8) as above 517,
# the L2-looped kernel 602 (its tile above), torch.compile 621; 1024 x 131071: 297 against 326
# (torch.compile 477); 8192 x 20001: the L2-looped kernel 328 at its best, cooperative (4096, 4)
# 344: the backward's odd rows are always cooperative.
# Through windows, H100, bf16, same method (scratch, 2026-11-27, two runs), us, element by
# element -> windows at the tiles below: forward 4096 x 50257 429 -> 348 (torch.softmax 393; the
# even 4096 x 50264 takes 295), 1024 x 131071 286 -> 227, 8192 x 20001 342 -> 263; backward
# 565 -> 481, 359 -> 292, 414 -> 344 (torch 951, 651, 737); fp16 alike. Other tiles through
# windows, forward: 1024-column steps (the earlier tile) 372 / 249, (16384, 1024) 425 / 292,
# (16384, 2048) 371 / 252, 8 warps 533 / 338, the even rows' (16384, 8192, 4) 440 / 292;
# backward (8192, 4) 481 / 300, (4096, 2 warps) 493 / 300. H200, same method, element by element
# -> windows at these tiles: forward 433 -> 328 (torch.softmax 360; the even 4096 x 50264: 254),
# 273 -> 214, 246 -> 231; backward 469 -> 391, 299 -> 238, 346 -> 274; no other tile tried there
# was more than 3% faster (2 warps: 319 us at 4096 x 50257, level at 1024 x 131071).
ODD_COOP_CHUNK = 8192
ODD_COOP_BLOCK_N = 2048
ODD_COOP_NUM_WARPS = 4
ODD_L2_LOOP = (4096, 4)  # (BLOCK_N, num_warps) of the forward's L2-looped kernel
BWD_ODD_COOP_CHUNK = 4096
BWD_ODD_COOP_NUM_WARPS = 4
# Forward rows of at most L2_LOOP_ROW_BYTES (32768 bf16 columns), with at least
# L2_LOOP_MIN_ROWS_PER_SM rows an SM: the looped kernel, one program a row, its first pass
# keeping the row's lines in L2 (evict_last) and its second reading them from there
# (evict_first): one read of HBM and one write, with no synchronisation between programs. A
# program's row stays in L2 from its first pass to its second: at three 256-thread programs an SM
# (80 registers a thread, offline sm_90 compile) at most 132 x 3 x 64 KB = 26 MB of the 50 MB L2
# of an H100 / H200. Longer rows spill from it (H100, 1024 x 131072 bf16: the looped kernel ran
# at 70-75% of copy bandwidth, the cooperative one at 94%). Many rows, so that the last, partly
# filled wave of programs is a small part of the launch. H100 sweep (bf16 unless said, 2**27
# elements, both kernels alternated in one process, CUDA-graph replays, scratch; % of copy
# bandwidth, cooperative against looped with 16384-column steps over 8 warps): 4096 x 32768 95
# against 101, log-softmax 96 against 101, fp16 96 against 101; 5461 x 24576 97 against 99. At
# 49152 and 65536 columns (96 and 128 KB rows) the looped kernel needed 16 warps to draw level
# and lost with 8: they stay cooperative. Not yet measured on an H200, where the cooperative
# kernel ran at 85-86% at 4096 x 32768 (history 0074).
L2_LOOP_ROW_BYTES = 65536
L2_LOOP_MIN_ROWS_PER_SM = 16
L2_LOOP_BLOCK_N = 16384
L2_LOOP_NUM_WARPS = 8
# The backward's looped kernel the same way (y and dy kept in L2, dx written in the second pass).
# Until kernel-lab-softmax 0.2.13 the plan sent every backward of more than BWD_MAX_FUSED_COLS
# columns and L2_LOOP_MIN_ROWS_PER_SM rows an SM there, but with no eviction hints: 287 us at
# 4096 x 32768 bf16 on an H200, where torch.compile took 192. H200 sweep (bf16 unless said; the
# kernels launched directly, alternated over five rounds; scratch, 2026-11-27), in us, the
# looped kernel with the hints at (BLOCK_N, warps) against the cooperative kernel and
# torch.compile: 4096 x 32768: 199 at (16384, 8), 215 at (8192, 16), coop 267, compile 192 (fp16
# 197 / 265 / 192); 8192 x 16384: 189 at (16384, 8), 197 at (4096, 16), coop 259, compile 186;
# 2560 x 24576: 98 at (16384, 8), coop 127, compile 112; 8192 x 12288: 145 at (4096, 16), 178 at
# (16384, 8), coop 224, compile 149; 16384 x 8200: 199 at (2048, 8), 203 at (4096, 16), 215 at
# (16384, 8), coop 366, compile 210; 4096 x 50264 (196 KB of y and dy a row): 397 at (16384, 8),
# coop 438, compile 523; 4096 x 65536 (256 KB): coop 533, 562 at (16384, 8), compile 612; float32
# 4096 x 32768 (256 KB): coop 377, 453 at (16384, 8), compile 380. Hence rows of up to 224 KB of
# y and dy, in 16384-column steps over 8 warps, or 4096 over 16 for rows shorter than 16384.
BWD_L2_LOOP_ROW_BYTES = 224 * 1024
BWD_L2_LOOP_BLOCK_N = 16384
BWD_L2_LOOP_NUM_WARPS = 8
BWD_L2_LOOP_SHORT_BLOCK_N = 4096
BWD_L2_LOOP_SHORT_NUM_WARPS = 16
# Rows past WIDE_ROWS_MAX_COLS (fp16 / bf16 only: float32 rows that long exceed the L2 budget)
# take the looped kernel with one step of prefetch (_prefetched_grad_dot / _prefetched_write_grad:
# the next step's loads issued before the current step's math), in 8192-column steps over 16
# warps. H100, bf16, the kernels alternated over five rounds (scratch, 2026-11-27), us: 4096 x
# 50264 480.7 against 563.6 for the plain loop at (16384, 8), 564.2 at (16384, 16), torch.compile
# 724.0. Shorter rows were level or slower with it (16384 x 8200: 267.4 at (4096, 8) against
# 266.7; 4096 x 32768: 282.7 at (16384, 16) against 286.1, and the rows kernel's 271.3 ahead
# of both); several steps of 8192 to 16384 columns over 8-16 warps were much slower (368 to
# 430 us at 16384 x 8200: two steps of registers).
BWD_L2_LOOP_LONG = (8192, 16)
# Columns per loop step and warps of the looped kernels: the best of {2048..16384} x {4, 8, 16}
# for 32k- to 128k-column bf16 rows on an H200 (the backward loads two rows per step: half).
LOOP_BLOCK_N = 16384
BWD_LOOP_BLOCK_N = 8192
LOOP_NUM_WARPS = 16
# The split kernels: many short chunks, so smaller steps (best of the same sweep on 4 x 1M and
# 32 x 128k bf16 inputs).
SPLIT_BLOCK_N = 4096
SPLIT_NUM_WARPS = 8
# Programs per SM that the split path aims for when there are too few rows to fill the GPU.
SPLIT_PROGRAMS_PER_SM = 4


@dataclass(slots=True)  # (not frozen: a frozen dataclass costs about a microsecond more to build)
class _Plan:
    """How one launch covers an (n_rows, n_cols) problem."""

    kind: str  # "rows" | "coop" | "looped" | "split"
    block_n: int
    block_m: int = 1
    num_warps: int = 8
    n_splits: int = 1
    chunk: int = 0
    keep_in_l2: bool = False  # looped forward: the first pass keeps the row in L2 for the second
    reread: bool = False  # backward rows kernel: y and dy loaded again for dx (BWD_REREAD_*)


# Plans by their arguments: building one costs a few microseconds of host arithmetic and device
# queries, a lookup well under one (a small call's latency is its host path). The module
# constants _make_plan reads (SPLIT_*, LOOP_NUM_WARPS, L2_LOOP_*) are not in the key: code that
# changes them (the tests' small_blocks fixture) clears _PLANS (and _EAGER_ROWS below). Plans are
# never modified.
_PLANS: dict[tuple, _Plan] = {}
_PLANS_MAX = 4096


def _plan(
    n_rows: int, n_cols: int, max_fused_cols: int, rows_tile: int, device: torch.device, loop_block_n: int,
    coop_chunk: int, coop_num_warps: int, l2_loop: tuple[int, int] | None = None, coop_block_n: int = 0,
    wide_rows_warps: int = 0, wide_rows_first: bool = False,
) -> _Plan:
    """The launch plan of one direction's kernels for (n_rows, n_cols) rows on `device`.

    rows_tile: elements a program of the rows kernel holds (FWD_ROWS_TILE / BWD_ROWS_TILE).
    l2_loop: (BLOCK_N, num_warps) of the looped kernel that keeps its row in L2 between its two
    passes, where the direction allows it for rows of this length (`_fwd_l2_loop`,
    `_bwd_l2_loop`); None: never.
    coop_block_n: the steps of the forward's cooperative kernel through its chunk (0: one step).
    wide_rows_warps: warps of the rows kernel on rows of up to WIDE_ROWS_MAX_COLS, too few of
    them for the L2 loop (0: none; they are cut across programs); wide_rows_first: also with many
    rows, before the L2 loop, where a row fills WIDE_ROWS_MIN_FILL of its block (the backward of
    16-bit rows: rows that fill it all read again, BWD_REREAD_*)."""
    key = (n_rows, n_cols, max_fused_cols, rows_tile, device, loop_block_n, coop_chunk, coop_num_warps, l2_loop,
           coop_block_n, wide_rows_warps, wide_rows_first)
    if type(n_rows) is not int or type(n_cols) is not int:  # symbolic sizes (tracing): not cached
        return _make_plan(*key)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = _make_plan(*key)
    return plan


def _odd_rows(*ints: int) -> bool:
    """Whether rows of this length and strides are accessed element by element (ODD_*): one of
    them odd. False for symbolic sizes (tracing), where Triton still specialises the values."""
    bits = 0
    for n in ints:  # (a loop, not all() / any(): this runs on every eager call)
        if type(n) is not int:
            return False
        bits |= n
    return bool(bits & 1)


def _windowed(vec: int, *tensors: torch.Tensor) -> bool:
    """Whether odd rows (_odd_rows) of these (rows, cols) tensors can be read through 16-byte
    aligned windows (the kernels' _row_window): each tensor 16-byte aligned, with row strides
    equal modulo a vector of `vec` elements, so that a row starts at the same place within a
    vector in all of them. Only the long-row kernels take windows; false while tracing
    (torch.compile), where addresses are unknown."""
    first = tensors[0].stride(0) % vec
    for t in tensors:
        if type(t.stride(0)) is not int or t.stride(0) % vec != first or t.data_ptr() % 16:
            return False
    return True


def _fwd_l2_loop(n_cols: int, element_size: int, odd: bool = False) -> tuple[int, int] | None:
    """(BLOCK_N, num_warps) of the forward's L2-looped kernel for rows of this length, None where
    a row does not fit L2_LOOP_ROW_BYTES; odd: rows of odd length or stride (ODD_L2_LOOP)."""
    if n_cols * element_size > L2_LOOP_ROW_BYTES:
        return None
    return ODD_L2_LOOP if odd else (L2_LOOP_BLOCK_N, L2_LOOP_NUM_WARPS)


def _bwd_l2_loop(n_cols: int, bytes_per_col: int) -> tuple[int, int] | None:
    """The same for the backward, whose rows of y and dy together (bytes_per_col) must fit
    BWD_L2_LOOP_ROW_BYTES; its odd rows never take it (the caller passes None for them)."""
    if n_cols * bytes_per_col > BWD_L2_LOOP_ROW_BYTES:
        return None
    if n_cols > WIDE_ROWS_MAX_COLS:
        return BWD_L2_LOOP_LONG  # (the launcher prefetches on these rows: _bwd_prefetch)
    return (BWD_L2_LOOP_BLOCK_N, BWD_L2_LOOP_NUM_WARPS) if n_cols >= BWD_L2_LOOP_BLOCK_N else (
        BWD_L2_LOOP_SHORT_BLOCK_N, BWD_L2_LOOP_SHORT_NUM_WARPS)


def _bwd_prefetch(plan: _Plan, n_cols: int) -> bool:
    """Whether the backward's looped launch prefetches (BWD_L2_LOOP_LONG's rows)."""
    return plan.keep_in_l2 and n_cols > WIDE_ROWS_MAX_COLS


def _window_splits(plan: _Plan, window: bool, n_cols: int, vec: int, device: torch.device) -> tuple[bool, int]:
    """(window, n_splits) of a launch with this plan: windows (_windowed) on the long-row kernels
    only, whose chunks then cut a window up to vec - 1 columns longer than the row (at most one
    more chunk); none where that chunk would take a cooperative row past coop.max_chunks. (The
    rows kernels read odd rows element by element: through windows, with per-row offsets and
    each row's end vectors apart, they took 1.1-2.3x as long, H200, 131072 x 1001 to
    16384 x 777 bf16, scratch.)"""
    if not window or plan.kind == "rows":
        return False, plan.n_splits
    if plan.kind == "looped":
        return True, 1
    n_splits = runtime.cdiv(n_cols + vec - 1, plan.chunk)
    if plan.kind == "coop" and n_splits > coop.max_chunks(device):
        return False, plan.n_splits
    return True, n_splits


def _make_plan(
    n_rows: int, n_cols: int, max_fused_cols: int, rows_tile: int, device: torch.device, loop_block_n: int,
    coop_chunk: int, coop_num_warps: int, l2_loop: tuple[int, int] | None, coop_block_n: int,
    wide_rows_warps: int, wide_rows_first: bool,
) -> _Plan:
    if n_cols <= max_fused_cols:
        block_m, block_n, num_warps = runtime.row_tile(n_rows, n_cols, rows_tile)
        return _Plan("rows", block_n=block_n, block_m=block_m, num_warps=num_warps)
    on_gpu = device.type == "cuda" and not runtime.interpret_mode()
    sm_count = runtime.sm_count(device)
    few_rows = n_rows < L2_LOOP_MIN_ROWS_PER_SM * sm_count
    wide_block_n = runtime.next_power_of_2(n_cols)
    if wide_rows_warps and n_cols <= WIDE_ROWS_MAX_COLS and (
            few_rows or (wide_rows_first and n_cols >= WIDE_ROWS_MIN_FILL * wide_block_n)):
        if wide_rows_first and n_cols == wide_block_n and n_rows >= BWD_REREAD_MIN_ROWS_PER_SM * sm_count:
            return _Plan("rows", block_n=wide_block_n, num_warps=BWD_REREAD_NUM_WARPS, reread=True)
        return _Plan("rows", block_n=wide_block_n, num_warps=wide_rows_warps)
    if on_gpu and l2_loop is not None and not few_rows:
        return _Plan("looped", block_n=l2_loop[0], num_warps=l2_loop[1], keep_in_l2=True)
    n_chunks = runtime.cdiv(n_cols, coop_chunk)
    if on_gpu and n_chunks <= coop.max_chunks(device):  # more could wait forever (kernel_lab.shared.coop)
        return _Plan("coop", block_n=coop_block_n or coop_chunk, num_warps=coop_num_warps, n_splits=n_chunks,
                     chunk=coop_chunk)
    n_splits = min(runtime.cdiv(SPLIT_PROGRAMS_PER_SM * sm_count, n_rows), runtime.cdiv(n_cols, SPLIT_BLOCK_N))
    if n_splits <= 1:
        return _Plan("looped", block_n=loop_block_n, num_warps=LOOP_NUM_WARPS)
    chunk = runtime.cdiv(runtime.cdiv(n_cols, n_splits), SPLIT_BLOCK_N) * SPLIT_BLOCK_N
    n_splits = runtime.cdiv(n_cols, chunk)
    return _Plan("split", block_n=SPLIT_BLOCK_N, num_warps=SPLIT_NUM_WARPS, n_splits=n_splits, chunk=chunk)


def _reference_fwd(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """The PyTorch reference (the CPU fallback and backend="reference") in x's dtype."""
    if x.numel() == 0:
        # The reference's amax raises IndexError on a zero-length `dim`; torch.softmax returns an
        # empty tensor. (A clone, not empty_like, keeps the autograd graph of an x requiring grad.)
        return x.clone()
    fn = reference.log_softmax if log else reference.softmax
    return fn(x, dim, compute_dtype=torch.float32).to(x.dtype)


def _as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` with `dim` moved last, viewed as (rows, cols) with unit column stride.

    A view whenever the layout allows one (e.g. padded rows), a copy otherwise.
    """
    if t.ndim == 0:
        return t.reshape(1, 1)
    if dim != t.ndim - 1:  # (movedim costs microseconds of host time: skip it when it is a no-op)
        t = t.movedim(dim, -1)
    return runtime.rows_view(t)


def _from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `_as_rows` for a freshly allocated contiguous result."""
    if like.ndim == 2 and dim == 1:  # already like's shape (view() costs microseconds of host time)
        return rows
    if like.ndim == 0:
        return rows.reshape(())
    if dim == like.ndim - 1:
        return rows.view(like.shape)
    return rows.view(like.movedim(dim, -1).shape).movedim(-1, dim)


# Eager forward launches of the rows kernel on contiguous inputs along their last dim, by what
# the launch depends on besides that layout: (shape, dtype, device, log, address modulo 16) ->
# (the launch with its grid and constexprs bound, n_rows, n_cols). A repeated small call (a
# decode step's softmax, the benchmark's 8 x 128 dispatch row) then skips the planning below
# and its helpers, whose Python cost on a slow host is of the order of the launch's. H100 host,
# eager calls back to back, with and without it alternated over seven rounds in one process
# (scratch, 2026-11-28), us a call: 8 x 128 float32 24.5 against 32.2, 4 x 4096 bf16 25.6
# against 36.5 (torch.softmax 10.7 and 11.2). Filled by softmax_fwd after a planned launch;
# cleared with _PLANS by code changing the module constants (the tests).
_EAGER_ROWS: dict[tuple, tuple] = {}


def softmax_fwd(x: torch.Tensor, dim: int, log: bool, traceable: bool = False) -> torch.Tensor:
    """Launcher: softmax (log=False) or log-softmax (log=True) of `x` along `dim`.

    Assumes checked inputs. Output: same shape and dtype as x. `traceable`: see `runtime.launchable`.
    """
    if not traceable and dim == x.ndim - 1:
        known = _EAGER_ROWS.get((x.shape, x.dtype, x.device, log, x.data_ptr() % 16))
        if known is not None and x.is_contiguous():
            launch, n_rows, n_cols = known
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            launch(x, y, n_rows, n_cols, n_cols, n_cols)
            return y
    if runtime.backend(x) == "reference":
        return _reference_fwd(x, dim, log)
    x2 = _as_rows(x, dim)
    n_rows, n_cols = x2.shape
    y2 = torch.empty_like(x2, memory_format=torch.contiguous_format)
    if y2.numel() == 0:
        return _from_rows(y2, x, dim)
    vec = 16 // x2.element_size()
    odd = _odd_rows(n_cols, x2.stride(0))
    window = odd and not traceable and _windowed(vec, x2, y2)
    if odd:
        plan = _plan(n_rows, n_cols, FWD_MAX_FUSED_COLS, FWD_ROWS_TILE, x.device, LOOP_BLOCK_N, ODD_COOP_CHUNK,
                     ODD_COOP_NUM_WARPS, _fwd_l2_loop(n_cols, x.element_size(), odd=True), ODD_COOP_BLOCK_N)
    else:
        plan = _plan(n_rows, n_cols, FWD_MAX_FUSED_COLS, FWD_ROWS_TILE, x.device, LOOP_BLOCK_N, COOP_CHUNK,
                     COOP_NUM_WARPS, _fwd_l2_loop(n_cols, x.element_size()), COOP_BLOCK_N, FWD_WIDE_ROWS_NUM_WARPS)
    window, n_splits = _window_splits(plan, window, n_cols, vec, x.device)
    # A planned launch (runtime.DirectLauncher.planned) skips Triton's argument binder and its
    # cache key: host time of one launch of the rows kernel on an 8 x 128 float32 input, 2000
    # calls, lent H100 hosts (scratch timing): 10.8-17.7 us direct against 7.0-7.1 planned on one
    # host (where a whole eager softmax call then took 15.8-16.1 us and torch.softmax 6.5-6.9),
    # 11.8-13.5 against 8.0-9.4 on another. The outputs and scratch are fresh and contiguous.
    key = None if traceable else ("fwd", log, x2.shape, plan_arg_key(x2), x.device)
    # The power of two dividing the row length, strides and chunk, for the kernels' vector
    # accesses (kernel_lab.shared.vector_hints; y2's stride is n_cols): at 131072 x 1000 bf16 on
    # an H200, 126 us against 143 without it, the backward 182 against 207 (rows kernels).
    align = vector_alignment(x2.element_size(), n_cols, x2.stride(0), plan.chunk)
    if plan.kind == "rows":
        launch = functools.partial(
            runtime.launchable(_softmax_fwd_rows_kernel, traceable, key)[(runtime.cdiv(n_rows, plan.block_m),)],
            LOG=log, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, ALIGN=align, num_warps=plan.num_warps,
        )
        launch(x2, y2, n_rows, n_cols, x2.stride(0), y2.stride(0))
        if not traceable and x.ndim and dim == x.ndim - 1 and x.is_contiguous():
            if len(_EAGER_ROWS) >= _PLANS_MAX:
                _EAGER_ROWS.clear()
            _EAGER_ROWS[x.shape, x.dtype, x.device, log, x.data_ptr() % 16] = (launch, n_rows, n_cols)
    elif plan.kind == "coop":
        coop.launch(  # (which drops the kept scratch if the launch raises)
            runtime.launchable(_softmax_fwd_coop_kernel, traceable, key)[(n_rows * n_splits,)],
            x2, y2, *coop.workspace(n_rows, n_splits, x.device, traceable),
            n_rows, n_cols, x2.stride(0), y2.stride(0), n_splits,
            LOG=log, CHUNK=plan.chunk, BLOCK_N=min(plan.block_n, plan.chunk),
            SPLITS_POW2=runtime.next_power_of_2(n_splits), ALIGN=align, WINDOW=window, VEC=vec,
            num_warps=plan.num_warps,
        )
    elif plan.kind == "looped":
        runtime.launchable(_softmax_fwd_looped_kernel, traceable, key)[(n_rows,)](
            x2, y2, n_cols, x2.stride(0), y2.stride(0),
            LOG=log, KEEP_IN_L2=plan.keep_in_l2, BLOCK_N=plan.block_n, ALIGN=align, WINDOW=window, VEC=vec,
            num_warps=plan.num_warps,
        )
    else:
        part_max = torch.empty((n_rows, n_splits), dtype=torch.float32, device=x.device)
        part_sum = torch.empty_like(part_max)
        grid = (n_rows, n_splits)
        runtime.launchable(_softmax_fwd_partial_kernel, traceable, key)[grid](
            x2, part_max, part_sum, n_cols, x2.stride(0), plan.chunk, n_splits,
            BLOCK_N=plan.block_n, ALIGN=align, WINDOW=window, VEC=vec, num_warps=plan.num_warps,
        )
        runtime.launchable(_softmax_fwd_split_kernel, traceable, key)[grid](
            x2, y2, part_max, part_sum, n_cols, x2.stride(0), y2.stride(0), plan.chunk, n_splits,
            LOG=log, BLOCK_N=plan.block_n, SPLITS_POW2=runtime.next_power_of_2(n_splits),
            ALIGN=align, WINDOW=window, VEC=vec, num_warps=plan.num_warps,
        )
    return _from_rows(y2, x, dim)


def softmax_bwd(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool, traceable: bool = False) -> torch.Tensor:
    """Launcher: dx from the forward output `y` and the incoming gradient `dy` (same shape)."""
    if runtime.backend(y) == "reference":
        fn = reference.log_softmax_backward if log else reference.softmax_backward
        return fn(y, dy, dim, compute_dtype=torch.float32).to(dy.dtype)
    y2, dy2 = _as_rows(y, dim), _as_rows(dy, dim)
    n_rows, n_cols = y2.shape
    dx2 = torch.empty_like(dy2, memory_format=torch.contiguous_format)
    if dx2.numel() == 0:
        return _from_rows(dx2, dy, dim)
    vec = 16 // dy2.element_size()
    odd = _odd_rows(n_cols, y2.stride(0), dy2.stride(0))
    window = (odd and not traceable and y2.element_size() == dy2.element_size()
              and _windowed(vec, y2, dy2, dx2))
    coop_chunk, coop_num_warps = (
        (BWD_ODD_COOP_CHUNK, BWD_ODD_COOP_NUM_WARPS) if odd
        else (LOG_BWD_COOP_CHUNK, LOG_BWD_COOP_NUM_WARPS) if log
        else (BWD_COOP_CHUNK, BWD_COOP_NUM_WARPS)
    )
    l2_loop = None if odd else _bwd_l2_loop(n_cols, y2.element_size() + dy2.element_size())
    rows_tile = BWD_LARGE_ROWS_TILE if n_rows * n_cols >= BWD_LARGE_TILE_MIN_ELEMENTS else BWD_ROWS_TILE
    plan = _plan(n_rows, n_cols, BWD_MAX_FUSED_COLS, rows_tile, y.device, BWD_LOOP_BLOCK_N, coop_chunk,
                 coop_num_warps, l2_loop, 0, 0 if odd else BWD_WIDE_ROWS_NUM_WARPS,
                 max(y2.element_size(), dy2.element_size()) <= 2)
    window, n_splits = _window_splits(plan, window, n_cols, vec, y.device)
    key = None if traceable else ("bwd", log, y2.shape, plan_arg_key(y2), plan_arg_key(dy2), y.device)
    align = vector_alignment(min(y2.element_size(), dy2.element_size()), n_cols, y2.stride(0), dy2.stride(0),
                             plan.chunk)  # as in softmax_fwd (dx2's stride is n_cols)
    if plan.kind == "rows":
        runtime.launchable(_softmax_bwd_rows_kernel, traceable, key)[(runtime.cdiv(n_rows, plan.block_m),)](
            y2, dy2, dx2, n_rows, n_cols, y2.stride(0), dy2.stride(0), dx2.stride(0),
            LOG=log, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, ALIGN=align, REREAD=plan.reread,
            num_warps=plan.num_warps,
        )
    elif plan.kind == "coop":
        coop.launch(
            runtime.launchable(_softmax_bwd_coop_kernel, traceable, key)[(n_rows * n_splits,)],
            y2, dy2, dx2, *coop.workspace(n_rows, n_splits, y.device, traceable),
            n_rows, n_cols, y2.stride(0), dy2.stride(0), dx2.stride(0), n_splits,
            LOG=log, CHUNK=plan.chunk, SPLITS_POW2=runtime.next_power_of_2(n_splits),
            ALIGN=align, WINDOW=window, VEC=vec, num_warps=plan.num_warps,
        )
    elif plan.kind == "looped":
        runtime.launchable(_softmax_bwd_looped_kernel, traceable, key)[(n_rows,)](
            y2, dy2, dx2, n_cols, y2.stride(0), dy2.stride(0), dx2.stride(0),
            LOG=log, KEEP_IN_L2=plan.keep_in_l2, BLOCK_N=plan.block_n, ALIGN=align,
            PREFETCH=_bwd_prefetch(plan, n_cols), WINDOW=window, VEC=vec, num_warps=plan.num_warps,
        )
    else:
        part_dot = torch.empty((n_rows, n_splits), dtype=torch.float32, device=y.device)
        grid = (n_rows, n_splits)
        runtime.launchable(_softmax_bwd_partial_kernel, traceable, key)[grid](
            y2, dy2, part_dot, n_cols, y2.stride(0), dy2.stride(0), plan.chunk, n_splits,
            LOG=log, BLOCK_N=plan.block_n, ALIGN=align, WINDOW=window, VEC=vec, num_warps=plan.num_warps,
        )
        runtime.launchable(_softmax_bwd_split_kernel, traceable, key)[grid](
            y2, dy2, dx2, part_dot, n_cols, y2.stride(0), dy2.stride(0), dx2.stride(0),
            plan.chunk, n_splits,
            LOG=log, BLOCK_N=plan.block_n, SPLITS_POW2=runtime.next_power_of_2(n_splits),
            ALIGN=align, WINDOW=window, VEC=vec, num_warps=plan.num_warps,
        )
    return _from_rows(dx2, dy, dim)


# torch.library registration: what torch.compile sees.


@triton_op("kernel_lab::softmax_fwd", mutates_args=())
def _softmax_fwd_op(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return softmax_fwd(x, dim, log, traceable=True)


@triton_op("kernel_lab::softmax_bwd", mutates_args=())
def _softmax_bwd_op(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return softmax_bwd(y, dy, dim, log, traceable=True)


def _setup_context(ctx, inputs, output):
    _, ctx.dim, ctx.log = inputs
    ctx.save_for_backward(output)


def _op_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return torch.ops.kernel_lab.softmax_bwd(y, dy, ctx.dim, ctx.log), None, None


_softmax_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


class _SoftmaxFunction(torch.autograd.Function):
    """The eager-mode autograd path: the same launchers without custom-op dispatch."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
        y = softmax_fwd(x, dim, log)
        ctx.dim, ctx.log = dim, log
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        runtime.check_first_order_backward("softmax")
        (y,) = ctx.saved_tensors
        return softmax_bwd(y, dy, ctx.dim, ctx.log), None, None


def _index(dim, name: str) -> int:
    """`dim` as an int where it is an integer of another type (numpy.int64, a 0-d integer tensor:
    what torch.softmax accepts through __index__); TypeError for anything else, bool included."""
    if not isinstance(dim, bool):
        try:
            return operator.index(dim)
        except TypeError:
            pass
    raise TypeError(f"{name}: dim must be an int, got {type(dim).__name__}")


def _cast(x: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """x cast to `dtype` before the op, as torch.softmax's `dtype=` does (differentiable)."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: dtype must be None, float16, bfloat16 or float32, got {dtype}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    return x.to(dtype)


def _check(x: torch.Tensor, dim: int, backend: str | None, name: str) -> int:
    """Validate the public op's arguments; return `dim` normalised to [0, ndim)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: x.dtype must be float16, bfloat16 or float32, got {x.dtype}")
    if type(dim) is not int:
        dim = _index(dim, name)
    ndim = max(x.ndim, 1)
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}: dim {dim} is out of range for a tensor of {x.ndim} dims")
    runtime.check_backend(name, backend, x, "x")
    return dim % ndim


def _dispatch(x: torch.Tensor, dim: int, log: bool, backend: str | None) -> torch.Tensor:
    if backend == "reference":
        return _reference_fwd(x, dim, log)
    if torch.compiler.is_compiling():
        return torch.ops.kernel_lab.softmax_fwd(x, dim, log)
    if torch.is_grad_enabled() and x.requires_grad:
        return _SoftmaxFunction.apply(x, dim, log)
    return softmax_fwd(x, dim, log)


def softmax(
    x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None, backend: str | None = None
) -> torch.Tensor:
    """Softmax along `dim`: y = exp(x - max(x)) / sum(exp(x - max(x))).

    x: any shape, float16 / bfloat16 / float32, any strides (a row-strided view with unit
    stride along `dim` is read in place; other layouts are copied once). Returns a tensor of
    x's shape and dtype; statistics are computed in float32. Differentiable.

    Differs from torch.softmax on one point: a row that is entirely -inf gives 0, not NaN.

    dtype: as in torch.softmax, x is cast to it before the op (so the result has it); float16,
    bfloat16 or float32. It also lets an integer x through (torch.softmax(x, dim, dtype=...)).

    backend: None picks by device (`kernel_lab.shared.runtime.backend`); "triton" insists on
    the Triton kernel (ValueError if it cannot run: a CPU tensor without TRITON_INTERPRET=1);
    "reference" runs the PyTorch reference.

    Raises TypeError for non-float dtypes (of x, or `dtype`) or a non-integer dim, ValueError for
    dim out of range.
    """
    if dtype is not None:
        x = _cast(x, dtype, "softmax")
    dim = _check(x, dim, backend, "softmax")
    return _dispatch(x, dim, False, backend)


def log_softmax(
    x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None, backend: str | None = None
) -> torch.Tensor:
    """Log-softmax along `dim`: y = x - max(x) - log(sum(exp(x - max(x)))).

    Same inputs, dtypes, layouts, errors, `dtype` and `backend` choice as `softmax`. A row that
    is entirely -inf gives -inf everywhere (torch.log_softmax gives NaN).
    """
    if dtype is not None:
        x = _cast(x, dtype, "log_softmax")
    dim = _check(x, dim, backend, "log_softmax")
    return _dispatch(x, dim, True, backend)
