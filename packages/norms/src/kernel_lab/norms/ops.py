"""rms_norm / layer_norm / residual_rms_norm / rms_norm_gated: input checks, launchers,
torch.library ops and autograd.

Call path: a public op checks its inputs, then
- in eager mode calls the launchers directly (no custom-op dispatch: a custom op costs tens of
  microseconds per call, longer than the kernel on small inputs), through an
  `autograd.Function` when a gradient is needed;
- under torch.compile calls `torch.ops.kernel_lab.rms_norm_fwd` / `layer_norm_fwd`,
  `triton_op`s whose backward (`rms_norm_bwd` / `layer_norm_bwd`) is registered with
  `register_autograd`, so the graph has no break.
Both paths run the same launchers. The three RMSNorm variants share one forward and one
backward launcher (flags select residual and gate), LayerNorm has its own pair.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass

import torch
from torch.library import triton_op

from kernel_lab.shared import coop, partial_sums, reference, runtime
from kernel_lab.shared.runtime import plan_arg_key
from kernel_lab.shared.vector_hints import vector_alignment

from ._kernels import (
    _layer_norm_bwd_coop_kernel,
    _layer_norm_bwd_kernel,
    _layer_norm_bwd_wide_kernel,
    _layer_norm_fwd_coop_kernel,
    _layer_norm_fwd_kernel,
    _rms_norm_bwd_coop_kernel,
    _rms_norm_bwd_kernel,
    _rms_norm_bwd_wide_kernel,
    _rms_norm_fwd_coop_kernel,
    _rms_norm_fwd_kernel,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT32_TINY = torch.finfo(torch.float32).tiny
FLOAT32_MAX = torch.finfo(torch.float32).max

# Longest row held in registers in one pass. 16384 float32 values over 32 warps is 16 values
# per thread; longer rows loop over the row twice (second read from L2).
FWD_MAX_FUSED_COLS = 16384
# Longest row of the one-tile backward, whose program keeps a dweight accumulator of the row's
# width. RMSNorm's reads each tile twice instead of holding x and dy across the row reduction
# and fits 16384 columns without spilling (16 warps, 128 registers): faster than the wide kernel
# there on an H200 (bf16, 4096 rows). LayerNorm's prefetching loop also holds the next block's
# tiles and the dbias accumulator: past 8192 columns it spills. There the LayerNorm kernel
# touches each tile twice as RMSNorm's does (REREAD, plan LAYER_NORM_BWD_REREAD), which was
# faster than the wide kernel at 16384 columns and slower than prefetching at 2048-8192 (H200
# sweep). H100, bf16 4096 x 16384, kernel only, CUDA-graph replays alternated over nine rounds
# (scratch): 196 us with 8 warps and one program per SM, against 253 us for the wide kernel
# with its partial sums (203-212 us at 2-3 programs per SM; 253 at 16 warps, 417 at 32: the
# dweight and dbias accumulators of a 16384-column row fill half an SM's registers, and an
# offline sm_90a compile, ptxas -v, still spills 200 bytes a thread at 8 warps (255 registers)
# and 220 at 16 (128 registers)). Since kernel-lab-norms 0.1.16 the cooperative backward takes
# those LayerNorm rows on CUDA (LAYER_NORM_BWD_COOP): the rereading kernel runs where it does not
# (the interpreter, non-CUDA devices).
BWD_MAX_FUSED_COLS = 16384
LAYER_NORM_BWD_MAX_FUSED_COLS = 16384
LAYER_NORM_BWD_PREFETCH_MAX_COLS = 8192
# (Tried and dropped: adding dweight up inside the one-tile RMSNorm backward, in two levels (the
# last program of each group of about sqrt(programs) adds its group's partial rows, the last
# group adds the group sums) to save the sum_partials launch, whose host time counts under
# autograd. One program reads the partials from L2 at about 30-40 GB/s, so the tail cost 11, 21
# and 96 us of GPU time at 2048, 4096 and 8192 columns (H200, 2**26 bf16 elements) against 3 us
# for sum_partials: a loss wherever the GPU, not the host, bounds the backward.)
# (Tried and dropped: software-pipelining the one-tile backward's row loop, tl.range with
# num_stages=2, which stages the next row block in shared memory. On an H200 it was slower for
# rms_norm and layer_norm at every width from 2048 to 16384 columns. The LayerNorm kernel's
# prefetch into registers is what won.)
# Elements one program of a one-tile forward handles: short rows are batched BLOCK_M at a time
# so that each program still moves enough bytes to hide its reduction latency. 2048 (4096
# before) changes the tiles of rows up to 2048 columns only (wider rows take one row a program
# either way): a 2048-column row runs one a program over 4 warps instead of two over 8, and
# narrower rows half as many a program as before. H200, bf16, 32768 x 2048, CUDA-graph replays
# alternated, two trials, the launcher before and after (scratch): LayerNorm 67.5-67.7 ->
# 64.3-64.8 us (Liger 74.0-74.5), RMSNorm 64.5-66.0 -> 63.6-63.7 (Liger 68.4-69.4). Rows
# narrower than 2048 columns were not measured.
ROWS_TILE = 2048


@dataclass(frozen=True)
class _BwdPlan:
    """How a one-tile backward covers the rows: programs of about `tile_elements` elements
    (BLOCK_M rows), `values_per_thread` of them a thread, at most `warps_per_sm` warps of
    persistent programs per SM (more only queue: registers cap what is resident)."""

    values_per_thread: int
    tile_elements: int
    warps_per_sm: int


# The fastest per kernel variant in H200 sweeps (bf16, 2**26 elements, 2048 to 16384 columns;
# values a thread x elements a program x warps per SM): the variants that read more tensors
# hold more per value, and fewer values a thread keep them from spilling.
RMS_BWD = _BwdPlan(32, 4096, 16)
RESIDUAL_RMS_BWD = _BwdPlan(8, 4096, 32)  # + du
# + gate, dgate: one 2048-column row a program (2 before) and up to 32 warps per SM (16 before).
# A later H200 sweep of nine plans (kernel launches back to back, bf16, 2**26 elements): 215 against
# 246 us at 32768 x 2048, level at 16384 x 4096 (248 us) and 8192 x 8192 (300-303 us), where the
# kernel stays at about 2.2-2.7 TB/s whatever the plan (not profiled further: it is the one
# variant that evaluates a sigmoid per element, on both of its passes over the row). Tried and
# dropped: one pass, its terms held in registers across the row's dot (no second load of the three
# tiles, no second sigmoid): level (H200, CUDA-graph replays of the launcher alternated over five
# rounds, scratch, 2026-11-28: 208.3 / 211.4 / 218.9 us against 208.4 / 211.6 / 218.9 at 2048 /
# 4096 / 8192 columns, 3.1-3.2 TB/s), so that work is not what holds the kernel below the copy rate.
GATED_RMS_BWD = _BwdPlan(16, 2048, 32)
# Long rows of the residual and gated variants: 32 values a thread in 16384-element programs (two
# 8192-column rows, or one 16384-column row, over 16 warps), 16 warps per SM. H200 sweep (scratch
# run, kernel launches back to back, bf16, 2**26 elements): residual 162.2 -> 128.7 us at 8192
# columns and 142.9 -> 124.0 at 16384 (136.2 -> 133.5 at 4096, kept); gated 425.2 -> 324.8 at
# 16384 (301.0 against 315.0 at 8192, so from 16384 only). Plain RMSNorm kept RMS_BWD at every
# width (107.8 against 118.8 us at 8192).
LONG_ROW_RMS_BWD = _BwdPlan(32, 16384, 16)
RESIDUAL_RMS_BWD_LONG_FROM = 8192
GATED_RMS_BWD_LONG_FROM = 16384
LAYER_NORM_BWD = _BwdPlan(16, 2048, 16)
# ... except LayerNorm rows of exactly 4096 columns: two rows a program were 9% faster than one
# (H200 sweep). Keyed by the row length, not its power-of-two block: rows of 2049-4095 columns
# were 21-29% slower with two rows than with one on an H100 (bf16, 2**26 elements, launcher-
# equivalent calls with the partial sums, five alternated rounds, scratch, 2026-11-27), us, one
# row against two: 2560 173.0 / 244.2, 3072 161.5 / 222.4, 3584 155.2 / 206.2, 4000 155.5 / 196.8.
LAYER_NORM_BWD_TILE_ELEMENTS = {4096: 8192}
# LayerNorm rows past LAYER_NORM_BWD_PREFETCH_MAX_COLS (the rereading kernel, where the
# cooperative one does not run): 8 warps, one program per SM (H100 sweep: see
# LAYER_NORM_BWD_MAX_FUSED_COLS).
LAYER_NORM_BWD_REREAD = _BwdPlan(64, 16384, 8)
# (Tried and dropped: each row block's columns split over 2-8 programs, every one taking the
# row's two dots over the whole row in 4096-column steps and then dx and the accumulators of its
# own slice only (no spills: 112 registers at 16 warps for 8192-column slices, offline sm_90a).
# H100, kernel only, graph replays alternated over nine rounds (scratch): 288-481 us at 4096 x
# 16384 against 195 for this plan; at 8192 x 8192, 214-379 against 171 for the rereading kernel
# with 16 warps (the launcher prefetches there instead). The siblings' repeated reads of each
# row did not come from L2 fast enough.)
# Warps of the one-tile LayerNorm forward, at most. At 16384 columns the row-tile heuristic's
# 32 warps take 46 registers each (offline sm_90 compile), so only one 1024-thread program fits
# per SM (two need at most 32 registers a thread) and nothing overlaps its load, reduce and
# store phases; 8 warps take 128 registers, and two 256-thread programs fit. In an A/B on an
# H200 (bf16, 2**26 elements) 8 warps were faster than 16 and 32 at both 16384 and 8192
# columns. RMSNorm, with fewer live values (32 registers at 32 warps), keeps the heuristic.
LAYER_NORM_FWD_MAX_WARPS = 8
# Values a thread of the one-tile RMSNorm forward (no residual, no gate) at rows of at least
# RMS_FWD_WIDE_COLS columns: 64, i.e. 4 warps at 8192 columns and 8 at 16384, where the row-tile
# heuristic gives 16 (16 and 32 warps). Sweep on an H200 (bf16, 2**26 elements, 4 to 64 values a
# thread, 1 to 16 rows a program): 67.0 against 68.5 us at 8192 x 8192 and 68.9 against 70.7 us
# at 4096 x 16384; at 2048 and 4096 columns the heuristic's tiles were already the fastest.
RMS_FWD_WIDE_COLS = 8192
RMS_FWD_WIDE_VALUES_PER_THREAD = 64
# The gated forward (reads x and gate) at rows of 4096 to 8192 columns: two rows a program over
# 16 warps. Same sweep: 100.4 against 110.7 us at 16384 x 4096 (the heuristic's one row over 8
# warps) and 103.1 against 107.7 us at 8192 x 8192 (one row, 16 warps). The residual variant's
# tiles were within 1% of the best there and keep the heuristic.
GATED_FWD_TWO_ROW_COLS = (4096, 8192)
GATED_FWD_TWO_ROW_WARPS = 16


@dataclass(frozen=True)
class _Loop:
    """How a kernel walks rows too long for registers: BLOCK_N columns a step over num_warps,
    programs_per_sm programs per SM (the looped forward strides rows over them; the wide
    backward gives each a contiguous block of rows)."""

    block_n: int
    num_warps: int
    programs_per_sm: int


# The fastest of (8192 | 16384 columns a step) x (8 | 16 | 32 warps) x (1 | 2 | 4 programs per
# SM), per kernel, on an H200 at 1024 x 65536 bf16. Fewer programs keep the rows in flight (read
# twice, the second time from L2) within the L2.
RMS_LOOP = _Loop(16384, 32, 1)
LAYER_NORM_LOOP = _Loop(16384, 16, 4)
RMS_WIDE = _Loop(16384, 16, 1)
LAYER_NORM_WIDE = _Loop(8192, 16, 1)
# (A first cooperative RMSNorm backward, tried in scratch and never released, was slower than the
# wide kernel on an H200 (215 against 186 us at 1024 x 65536): its programs held their chunk
# across every row's wait, so few fit an SM. The one now used (RMS_BWD_COOP below) holds nothing
# across the wait and runs as many small programs as fit.)


@dataclass(frozen=True)
class _Coop:
    """The cooperative forward (CUDA, rows past FWD_MAX_FUSED_COLS): `chunk` columns a program,
    read in `block_n`-column steps twice (the second time from L2), over num_warps."""

    chunk: int
    block_n: int
    num_warps: int


# One tile for both families and every variant: the best or within 2% of it in an H200 sweep
# (bf16 1024 x 65536, chunks {8K, 16K, 32K} x steps {4K, 8K} x {2, 4, 8} warps against the
# looped kernel in the same process). Confirming A/B, five rounds: rms_norm 86.4 against 90.4
# us looped, residual 161.4 against 195.8, LayerNorm 93.1 against 103.7; the gated variant 134.3
# against 136.7 (it reads the gate from HBM in its second pass).
# On an H100 (scratch, 2026-11-26) no tile reached 90% of copy bandwidth at 1024 x 65536: the
# best of the same sweep (plus 16K chunks) ran at 84-85% (rms_norm, this tile and 8K x 8K) and 81%
# (LayerNorm, this tile); the looped kernels with L2 hints (first pass evict_last, second
# evict_first, as softmax's looped forward) at {8K, 16K} steps x {8, 16, 32} warps x {1, 2, 3}
# programs per SM drew level at best (rms_norm 108.6 against 110.1 us, LayerNorm 119.5 against
# 110.3).
RMS_FWD_COOP = _Coop(8192, 4096, 4)
LAYER_NORM_FWD_COOP = _Coop(8192, 4096, 4)


@dataclass(frozen=True)
class _CoopBwd:
    """The cooperative backward of one kernel variant (CUDA, rows longer than `above_cols`):
    `chunk` columns a program over num_warps, programs_per_sm programs per SM in all, for 2-byte
    and for float32 inputs (groups of one program per chunk, each group walking a block of rows)."""

    above_cols: int
    chunk: int
    num_warps: int
    programs_per_sm: tuple[int, int]


# The backward of rows past the one-tile kernels' reach reads x and dy once (the wide kernel
# reads them twice: 10 bytes a bf16 element instead of 6). Small chunks, many programs: a program
# waits on its row's other chunks once a row, and the SM keeps DRAM busy with the others'
# loads. H200 sweep, scratch (bf16, kernel + sum_partials as CUDA-graph replays alternated with
# the launcher's kernel of the time in each of seven rounds; chunks {1024, 2048, 4096} x {2, 4,
# 8} warps x {8, 16, 32} programs per SM x the chunk held across the wait, read again after it,
# or held with the next row's prefetched): RMSNorm 142.5 against 184.6 us (wide kernel) at 1024 x
# 65536 and 139.4 against 172.9 at 2048 x 32768, reading again; LayerNorm, prefetching, 171.4
# against 220.9, 167.2 against 205.4 and, past its one-tile kernel's prefetch limit, 163.1
# against 182.5 at 4096 x 16384.
# Programs per SM: what fits the SM's registers at once (a group that must wait for an SM runs
# after the others, a second wave), counted offline (ptxas -v, sm_90a, triton 3.6, aligned bf16
# rows: 128 registers a thread for RMSNorm, as the GPU reported, 168 with du, 255 for LayerNorm,
# at 2 warps: 8, 6 and 4 programs; rows whose length is not a multiple of 16 compile to more),
# then checked through the launchers (same method, scratch). H200: LayerNorm at 4 against 8, 169.8 /
# 162.4 / 158.5 against 173.6 / 169.4 / 164.6 us at the three shapes above; residual RMSNorm at
# 1024 x 65536, 188.4 us at 6 against 248.0 at 8 (wide kernel 236.7). H100: residual 220.7
# against 309.5 (wide) at 1024 x 65536, 232.6 against 297.2 at 2048 x 32768; float32 inputs (more
# registers) at 1024 x 65536, RMSNorm 280.3 us at 8 against 370.6 at 6 (wide 501.6), LayerNorm
# 291.3 at 4 with the 2048-column tile (one-tile 505.9). Float32 residual rows keep 6, and
# float32 LayerNorm rows the tile below, not measured.
# LayerNorm's tile, later: 1024-column chunks over 1 warp (254 registers, 8 programs per SM; it
# spills about 50 bytes a thread, offline) against 2048 over 2 (4 per SM), H200, 1024 x 65536
# bf16, two runs: 146.2 / 147.3 against 168.2 / 166.3 us (4096 columns over 4 warps, 2 per SM:
# 144.6 / 147.0; 1024 over 2 warps at 6 per SM, 193.0). H100, benchmark bwd-graph rows (the
# launcher's kernels as one CUDA graph), 2048 over 2 (history 0026) against this tile (0027), two
# machines: 185.8 against 189.1 us at 1024 x 65536, 184.5 against 180.4 at 4096 x 16384: level.
# The gated variant stays on the wide kernel: cooperative at 4 programs per SM (249 registers),
# 2 or 4 warps, it lost at 1024 x 65536 (H100: 487.6 against 407.9 us) and tied at 2048 x 32768.
RMS_BWD_COOP = _CoopBwd(BWD_MAX_FUSED_COLS, 2048, 2, (8, 8))
RESIDUAL_RMS_BWD_COOP = _CoopBwd(BWD_MAX_FUSED_COLS, 2048, 2, (6, 6))
LAYER_NORM_BWD_COOP = _CoopBwd(LAYER_NORM_BWD_PREFETCH_MAX_COLS, 1024, 1, (8, 8))
# LayerNorm rows of 4097-8192 columns that fill at most LAYER_NORM_BWD_COOP_MAX_FILL of their
# power-of-two block (4608 Gemma-2-27B, 5120 Qwen2.5-14B, 6144) take the cooperative kernel too:
# the one-tile kernel's 8192-column tile holds them and its dweight / dbias accumulators at that
# width, masked lanes included, one program an SM. H100 sweep as above, us, cooperative against
# one tile: 4608 191.2 / 221.1 (185.8 / 216.4 in a first run), 5120 185.2 / 207.7 (179.0 /
# 208.2), 6144 180.8 / 190.7 (178.7 / 189.7); but 7168 188.8 / 182.4, 7680 201.2 / 170.9, 8000
# 187.9 / 170.8, and 8192 192.6 / 171.7. Rows of 2049-4095 columns stay on one tile (2560:
# 189.8 against 173.0). 16-bit rows only: float32 ones were not measured.
LAYER_NORM_BWD_COOP_FROM = 4096
LAYER_NORM_BWD_COOP_MAX_FILL = 0.75


def _bwd_coop_groups(n_rows: int, n_cols: int, element_size: int, device: torch.device,
                     c: _CoopBwd) -> tuple[int, int, int]:
    """(n_splits, n_groups, rows_per_group) of the cooperative backward, n_splits 0 where another
    kernel runs: rows of at most c.above_cols, the interpreter (a wait there never ends), more
    chunks than the GPU keeps running at once."""
    if n_cols <= c.above_cols or device.type != "cuda" or runtime.interpret_mode():
        return 0, 0, 0
    n_splits = runtime.cdiv(n_cols, c.chunk)
    if n_splits > coop.max_chunks(device):
        return 0, 0, 0
    programs = runtime.sm_count(device) * c.programs_per_sm[element_size == 4]
    n_groups = max(1, min(n_rows, programs // n_splits))
    rows_per_group = runtime.cdiv(n_rows, n_groups)
    return n_splits, runtime.cdiv(n_rows, rows_per_group), rows_per_group


def _fwd_coop_splits(n_cols: int, device: torch.device, c: _Coop) -> int:
    """Chunks per row of the cooperative forward, or 0 where the looped kernel runs instead: rows
    that fit one tile, the interpreter (a wait there never ends), more chunks than the GPU can
    keep running at once (kernel_lab.shared.coop)."""
    if n_cols <= FWD_MAX_FUSED_COLS or device.type != "cuda" or runtime.interpret_mode():
        return 0
    splits = runtime.cdiv(n_cols, c.chunk)
    return splits if splits <= coop.max_chunks(device) else 0


@dataclass(frozen=True)
class _Tile:
    """How a kernel covers the rows: one tile (BLOCK_M rows of BLOCK_N >= n_cols columns per
    program) or a loop over BLOCK_N-column steps, one row at a time."""

    one_tile: bool
    block_m: int
    block_n: int
    num_warps: int


def _fwd_tile(n_rows: int, n_cols: int, loop: _Loop) -> _Tile:
    if n_cols > FWD_MAX_FUSED_COLS:
        return _Tile(False, 1, loop.block_n, loop.num_warps)
    return _Tile(True, *runtime.row_tile(n_rows, n_cols, ROWS_TILE))


def _bwd_tile(n_rows: int, n_cols: int, max_fused_cols: int, wide: _Loop, plan: _BwdPlan,
              tile_elements: int | None = None) -> _Tile:
    """The one-tile backward's tile after `plan` (tile_elements overrides the plan's), or the
    wide kernel's loop past `max_fused_cols`."""
    if n_cols > max_fused_cols:
        return _Tile(False, 1, wide.block_n, wide.num_warps)
    block_n = runtime.next_power_of_2(n_cols)
    block_m = max(1, min((tile_elements or plan.tile_elements) // block_n, runtime.next_power_of_2(n_rows)))
    num_warps = min(32, max(1, block_m * block_n // (32 * plan.values_per_thread)))
    return _Tile(True, block_m, block_n, num_warps)


def _fwd_grid(t: _Tile, n_rows: int, device: torch.device, loop: _Loop) -> tuple[int]:
    """Grid of a forward kernel: one program per BLOCK_M rows (one tile), or
    loop.programs_per_sm programs per SM striding over the rows."""
    if t.one_tile:
        return (runtime.cdiv(n_rows, t.block_m),)
    return (min(n_rows, runtime.sm_count(device) * loop.programs_per_sm),)


def _bwd_programs(t: _Tile, n_rows: int, device: torch.device, wide: _Loop, plan: _BwdPlan) -> tuple[int, int]:
    """(n_programs, rows_per_program) of a backward kernel. One tile: a persistent grid of at most
    plan.warps_per_sm warps per SM striding over BLOCK_M-row blocks (rows_per_program is 0,
    unused); never more programs than blocks (the prefetching LayerNorm kernel loads its
    first block before its loop). Wide: wide.programs_per_sm programs per SM, each owning rows_per_program
    contiguous rows (the last program fewer)."""
    sms = runtime.sm_count(device)
    if t.one_tile:
        return min(runtime.cdiv(n_rows, t.block_m), sms * max(1, plan.warps_per_sm // t.num_warps)), 0
    rows_per_program = runtime.cdiv(n_rows, sms * wide.programs_per_sm)
    return runtime.cdiv(n_rows, rows_per_program), rows_per_program


# ---------------------------------------------------------------------------------------------
# Launchers
#
# Under autograd the backward launchers run on the engine's CUDA device thread, where host work
# costs about twice what it does on the caller's thread (H200 host: per allocation and per
# launch), and at mid-sized rows the backward's host time was longer than its GPU time. So an
# eager launcher works out what follows from the shapes (tile, grid, integer arguments,
# constexprs) once per launch-plan key and keeps it as a recipe; a repeated call allocates,
# builds its key, looks the recipe up and launches. Traced launches (via_op, inside the
# triton_ops) work it out on every call: torch.compile traces them once, sizes maybe symbolic.
# ---------------------------------------------------------------------------------------------

# Recipes (`_rms_fwd_recipe`, ...) by launch-plan key (its first item names the launcher),
# dropped when MAX_PLANS are held: a workload of ever-new shapes works each out once. The module
# constants the recipes read (tiles, _BwdPlan, _Loop, *_MAX_FUSED_COLS,
# LAYER_NORM_BWD_PREFETCH_MAX_COLS) are not in the keys: code that changes them empties _RECIPES.
_RECIPES: dict[tuple, tuple] = {}


def _row_alignment(n_cols: int, strides: tuple, *rows: torch.Tensor | None) -> int:
    """The ALIGN constexpr of a launch over these (rows, n_cols) tensors (None: absent): the power
    of two dividing the row length and every row stride, up to one 16-byte vector of the narrowest
    dtype (kernel_lab.shared.vector_hints). Without it rows whose length is not a multiple of 16
    compile to 2-byte accesses: on an H100, rms_norm forward at 4096 x 17000 bf16 took 321.2 us
    without against 107.5 with it, torch.compile 108.6 (scratch, 2026-11-27; CHANGELOG 0.1.18)."""
    return vector_alignment(min(t.element_size() for t in rows if t is not None), n_cols, *strides)


def _remember(key: tuple, recipe: tuple) -> tuple:
    if len(_RECIPES) >= runtime.MAX_PLANS:
        _RECIPES.clear()
    _RECIPES[key] = recipe
    return recipe


def rms_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    *,
    via_op: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Launcher of the RMSNorm family. Returns (y, u, rstd): y like x; u = x + residual (None
    without residual); rstd of each row, float32 (x.numel() // hidden,). Assumes checked inputs
    (a contiguous weight: see `_dense`).
    """
    if runtime.backend(x) == "reference":
        xf = x.float() if residual is None else x.float() + residual.float()
        rstd = reference.rms_norm_rstd(xf, eps, compute_dtype=torch.float32).reshape(-1)
        if gate is not None:
            y = reference.rms_norm_gated(xf, gate, weight, eps, compute_dtype=torch.float32)
        else:
            y = reference.rms_norm(xf, weight, eps, offset=offset, compute_dtype=torch.float32)
        return y.to(x.dtype), None if residual is None else xf.to(x.dtype), rstd
    device = x.device
    x2 = runtime.rows_view(x)
    n_rows, n_cols = x2.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=device)
    u = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=device)
    if y.numel() == 0:
        return y, u, rstd.fill_(1 / math.sqrt(eps))
    r2 = None if residual is None else runtime.rows_view(residual)
    z2 = None if gate is None else runtime.rows_view(gate)
    if via_op:
        launch, strides, splits = _rms_fwd_recipe(x2, r2, z2, weight, traced=True)
    else:
        key = ("rms_norm_fwd", device, x2.shape, *map(plan_arg_key, (x2, r2, z2, weight)))
        launch, strides, splits = _RECIPES.get(key) or _remember(key, _rms_fwd_recipe(x2, r2, z2, weight, plan=key))
    y2 = runtime.rows_view(y)
    # absent inputs and u stand in as x and y: their flags keep the kernel from touching them
    coop.launch(launch, x2, x2 if r2 is None else r2, x2 if z2 is None else z2, x2 if weight is None else weight,
                y2, y2 if u is None else runtime.rows_view(u), rstd, n_rows, n_cols, eps, offset, *strides,
                *_coop_arguments(n_rows, splits, device, via_op))
    return y, u, rstd


def _rms_fwd_one_tile(t: _Tile, n_rows: int, gated: bool, residual: bool) -> _Tile:
    """The one-tile RMSNorm forward's tile: the row-tile heuristic's, except where H200 sweeps
    found faster ones (RMS_FWD_WIDE_* for the plain variant, GATED_FWD_TWO_ROW_* for the gated)."""
    if gated:
        lo, hi = GATED_FWD_TWO_ROW_COLS
        if lo <= t.block_n <= hi and n_rows >= 2:
            return _Tile(True, 2, t.block_n, GATED_FWD_TWO_ROW_WARPS)
    elif not residual and t.block_n >= RMS_FWD_WIDE_COLS:
        return _Tile(True, t.block_m, t.block_n,
                     max(4, t.block_m * t.block_n // (32 * RMS_FWD_WIDE_VALUES_PER_THREAD)))
    return t


def _coop_arguments(n_rows: int, splits: int, device: torch.device, traced: bool) -> tuple:
    """The trailing arguments of a cooperative launch (coop.workspace's scratch, and the chunks
    per row), or none. The launch goes through coop.launch (the forwards' plain ones too: it
    passes them through)."""
    return (*coop.workspace(n_rows, splits, device, traced), splits) if splits else ()


def _rms_fwd_recipe(x2, r2, z2, weight, *, traced: bool = False, plan: tuple | None = None) -> tuple:
    """What `rms_norm_fwd` launches for these shapes: (launch, row strides, chunks per row of the
    cooperative kernel or 0). The launch is the kernel indexed with its grid, its constexprs
    bound; a call passes the tensors, n_rows, n_cols, eps, offset, the strides, then
    `_coop_arguments`."""
    n_rows, n_cols = x2.shape
    # y and u are fresh and contiguous: rows n_cols apart
    strides = (x2.stride(0), (x2 if r2 is None else r2).stride(0), (x2 if z2 is None else z2).stride(0),
               n_cols, n_cols)
    flags = dict(HAS_WEIGHT=weight is not None, HAS_RESIDUAL=r2 is not None, HAS_GATE=z2 is not None,
                 ALIGN=_row_alignment(n_cols, strides, x2, r2, z2))
    splits = _fwd_coop_splits(n_cols, x2.device, RMS_FWD_COOP)
    if splits:
        c = RMS_FWD_COOP
        launch = functools.partial(
            runtime.launchable(_rms_norm_fwd_coop_kernel, traced, plan)[(n_rows * splits,)], **flags,
            CHUNK=c.chunk, BLOCK_N=c.block_n, SPLITS_POW2=runtime.next_power_of_2(splits), num_warps=c.num_warps,
        )
        return launch, strides, splits
    t = _fwd_tile(n_rows, n_cols, RMS_LOOP)
    if t.one_tile:
        t = _rms_fwd_one_tile(t, n_rows, gated=z2 is not None, residual=r2 is not None)
    grid = _fwd_grid(t, n_rows, x2.device, RMS_LOOP)
    launch = functools.partial(
        runtime.launchable(_rms_norm_fwd_kernel, traced, plan)[grid], **flags,
        ONE_TILE=t.one_tile, BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps,
    )
    return launch, strides, 0


def rms_norm_bwd(
    dy: torch.Tensor,
    du: torch.Tensor | None,
    xn: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    eps: float,
    offset: float,
    *,
    via_op: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward launcher of the RMSNorm family. xn: the normalized input (x, or u = x +
    residual); du: the gradient of u (residual variant, None if u was unused).
    Returns (dxn, dgate, dweight); dxn is the gradient of x and of residual alike."""
    if runtime.backend(xn) == "reference":
        dgate = None
        if gate is not None:
            dx, dgate, dw = reference.rms_norm_gated_backward(dy, xn, gate, weight, eps,
                                                              compute_dtype=torch.float32)
            dgate = dgate.to(gate.dtype)
        else:
            dx, dw = reference.rms_norm_backward(dy, xn, weight, eps, offset=offset, compute_dtype=torch.float32)
        if du is not None:
            dx = dx + du.float()
        return dx.to(xn.dtype), dgate, None if dw is None else dw.to(weight.dtype)
    device = xn.device
    dx = torch.empty(xn.shape, dtype=xn.dtype, device=device)
    dgate = None if gate is None else torch.empty(gate.shape, dtype=gate.dtype, device=device)
    if dx.numel() == 0:
        return dx, dgate, None if weight is None else torch.zeros_like(weight)
    x2, dy2 = runtime.rows_view(xn), runtime.rows_view(dy)
    n_rows, n_cols = x2.shape
    z2 = None if gate is None else runtime.rows_view(gate)
    du2 = None if du is None else runtime.rows_view(du)
    if via_op:
        launch, n_programs, ints, kind = _rms_bwd_recipe(dy2, x2, z2, weight, du2, traced=True)
    else:
        key = ("rms_norm_bwd", device, x2.shape, *map(plan_arg_key, (dy2, x2, z2, weight, rstd, du2)))
        launch, n_programs, ints, kind = _RECIPES.get(key) or _remember(
            key, _rms_bwd_recipe(dy2, x2, z2, weight, du2, plan=key))
    dx2 = runtime.rows_view(dx)
    # dweight's partial sums, a row per program; without a weight the kernel writes none and dx
    # stands in, as it does for absent du and dgate (and x for the gate and the weight)
    partial = dx2 if weight is None else torch.empty((n_programs, n_cols), dtype=torch.float32, device=device)
    tensors = (dy2, x2, x2 if z2 is None else z2, x2 if weight is None else weight, rstd,
               dx2 if du2 is None else du2, dx2, dx2 if dgate is None else runtime.rows_view(dgate), partial)
    if kind == "wide":  # + each row's dot, float32 scratch
        launch(*tensors, torch.empty(n_rows, dtype=torch.float32, device=device), n_rows, n_cols, offset, *ints)
    elif kind == "coop":  # ints: rows a group, the strides, then the chunks a row
        coop.launch(launch, *tensors, n_rows, n_cols, offset, *ints[:-1],
                    *_coop_arguments(n_rows, ints[-1], device, via_op))
    else:
        launch(*tensors, n_rows, n_cols, offset, *ints)
    return dx, dgate, None if weight is None else partial_sums.sum_partials(partial, weight.dtype, via_op)


def _rms_bwd_recipe(dy2, x2, z2, weight, du2, *, traced: bool = False, plan: tuple | None = None) -> tuple:
    """What `rms_norm_bwd` launches for these shapes: (launch, n_programs, integer arguments
    after offset, kind). The launch is the kernel indexed with its grid, its constexprs bound;
    n_programs is the rows of the partial sums. kind: "tile" (the one-tile kernel), "coop"
    (the cooperative kernel: the integers end with the chunks a row, which follow its
    workspace) or "wide" (the wide kernel: it also takes a dot buffer after the partial sums)."""
    n_rows, n_cols = x2.shape
    if z2 is not None:
        bwd = LONG_ROW_RMS_BWD if n_cols >= GATED_RMS_BWD_LONG_FROM else GATED_RMS_BWD
    elif du2 is not None:
        bwd = LONG_ROW_RMS_BWD if n_cols >= RESIDUAL_RMS_BWD_LONG_FROM else RESIDUAL_RMS_BWD
    else:
        bwd = RMS_BWD
    flags = dict(HAS_WEIGHT=weight is not None, HAS_GATE=z2 is not None, HAS_DU=du2 is not None)
    # dx and dgate are fresh and contiguous (rows n_cols apart); absent gate and du stand in as x and dx
    strides = (dy2.stride(0), x2.stride(0), (x2 if z2 is None else z2).stride(0),
               n_cols if du2 is None else du2.stride(0), n_cols, n_cols)
    flags["ALIGN"] = _row_alignment(n_cols, strides, dy2, x2, z2, du2)
    n_splits = 0
    if z2 is None:  # (the gated variant stays on the wide kernel: see RMS_BWD_COOP)
        c = RESIDUAL_RMS_BWD_COOP if du2 is not None else RMS_BWD_COOP
        n_splits, n_groups, rows_per_group = _bwd_coop_groups(n_rows, n_cols, x2.element_size(), x2.device, c)
    if n_splits:
        launch = functools.partial(
            runtime.launchable(_rms_norm_bwd_coop_kernel, traced, plan)[(n_groups * n_splits,)], **flags,
            CHUNK=c.chunk, SPLITS_POW2=runtime.next_power_of_2(n_splits), num_warps=c.num_warps,
        )
        return launch, n_groups, (rows_per_group, *strides, n_splits), "coop"
    t = _bwd_tile(n_rows, n_cols, BWD_MAX_FUSED_COLS, RMS_WIDE, bwd)
    n_programs, rows_per_program = _bwd_programs(t, n_rows, x2.device, RMS_WIDE, bwd)
    if t.one_tile:
        launch = functools.partial(runtime.launchable(_rms_norm_bwd_kernel, traced, plan)[(n_programs,)],
                                   **flags, BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps)
        return launch, n_programs, strides, "tile"
    launch = functools.partial(runtime.launchable(_rms_norm_bwd_wide_kernel, traced, plan)[(n_programs,)],
                               **flags, BLOCK_N=t.block_n, num_warps=t.num_warps)
    return launch, n_programs, (rows_per_program, *strides), "wide"


def layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *, via_op: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher of LayerNorm. Returns (y, mean, rstd); mean and rstd per row, float32. Assumes
    checked inputs (contiguous weight and bias: see `_dense`)."""
    if runtime.backend(x) == "reference":
        xf = x.float()
        mean, rstd = reference.layer_norm_stats(xf, eps, compute_dtype=torch.float32)
        y = reference.layer_norm(xf, weight, bias, eps, compute_dtype=torch.float32)
        return y.to(x.dtype), mean.reshape(-1), rstd.reshape(-1)
    device = x.device
    x2 = runtime.rows_view(x)
    n_rows, n_cols = x2.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=device)
    if y.numel() == 0:
        return y, mean.zero_(), rstd.fill_(1 / math.sqrt(eps))
    if via_op:
        launch, strides, splits = _layer_norm_fwd_recipe(x2, weight, bias, traced=True)
    else:
        key = ("layer_norm_fwd", device, x2.shape, *map(plan_arg_key, (x2, weight, bias)))
        launch, strides, splits = _RECIPES.get(key) or _remember(
            key, _layer_norm_fwd_recipe(x2, weight, bias, plan=key))
    coop.launch(launch, x2, x2 if weight is None else weight, x2 if bias is None else bias, runtime.rows_view(y),
                mean, rstd, n_rows, n_cols, eps, *strides, *_coop_arguments(n_rows, splits, device, via_op))
    return y, mean, rstd


def _layer_norm_fwd_recipe(x2, weight, bias, *, traced: bool = False, plan: tuple | None = None) -> tuple:
    """What `layer_norm_fwd` launches for these shapes: (launch, row strides of x and y, chunks
    per row of the cooperative kernel or 0). The launch is the kernel indexed with its grid, its
    constexprs bound; a call passes the tensors, n_rows, n_cols, eps, the strides, then
    `_coop_arguments`."""
    n_rows, n_cols = x2.shape
    strides = (x2.stride(0), n_cols)  # y: fresh and contiguous
    flags = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ALIGN=_row_alignment(n_cols, strides, x2))
    splits = _fwd_coop_splits(n_cols, x2.device, LAYER_NORM_FWD_COOP)
    if splits:
        c = LAYER_NORM_FWD_COOP
        launch = functools.partial(
            runtime.launchable(_layer_norm_fwd_coop_kernel, traced, plan)[(n_rows * splits,)], **flags,
            CHUNK=c.chunk, BLOCK_N=c.block_n,
            SPLITS_POW2=runtime.next_power_of_2(splits), num_warps=c.num_warps,
        )
        return launch, strides, splits
    t = _fwd_tile(n_rows, n_cols, LAYER_NORM_LOOP)
    grid = _fwd_grid(t, n_rows, x2.device, LAYER_NORM_LOOP)
    launch = functools.partial(
        runtime.launchable(_layer_norm_fwd_kernel, traced, plan)[grid], **flags,
        ONE_TILE=t.one_tile, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, num_warps=min(t.num_warps, LAYER_NORM_FWD_MAX_WARPS) if t.one_tile else t.num_warps,
    )
    return launch, strides, 0


def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    *,
    via_op: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Backward launcher of LayerNorm: (dx, dweight, dbias); `bias` only says whether dbias is
    wanted (its values are not needed)."""
    if runtime.backend(x) == "reference":
        dx, dw, db = reference.layer_norm_backward(dy, x, weight, bias, eps, compute_dtype=torch.float32)
        return (dx.to(x.dtype), None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype))
    device = x.device
    dx = torch.empty(x.shape, dtype=x.dtype, device=device)
    if dx.numel() == 0:
        zeros = lambda p: None if p is None else torch.zeros_like(p)
        return dx, zeros(weight), zeros(bias)
    x2, dy2 = runtime.rows_view(x), runtime.rows_view(dy)
    n_rows, n_cols = x2.shape
    if via_op:
        launch, partial_shape, ints, kind = _layer_norm_bwd_recipe(dy2, x2, weight, bias is not None, traced=True)
    else:
        key = ("layer_norm_bwd", device, x2.shape, bias is None, *map(plan_arg_key, (dy2, x2, weight, mean, rstd)))
        launch, partial_shape, ints, kind = _RECIPES.get(key) or _remember(
            key, _layer_norm_bwd_recipe(dy2, x2, weight, bias is not None, plan=key))
    dx2 = runtime.rows_view(dx)
    # without a weight or bias the kernel writes no partial sums, and dx stands in
    partial = dx2 if partial_shape is None else torch.empty(partial_shape, dtype=torch.float32, device=device)
    tensors = (dy2, x2, x2 if weight is None else weight, mean, rstd, dx2, partial)
    if kind == "wide":  # + each row's two dots, float32 scratch
        launch(*tensors, torch.empty((n_rows, 2), dtype=torch.float32, device=device), n_rows, n_cols, *ints)
    elif kind == "coop":  # ints: rows a group, the strides, then the chunks a row
        coop.launch(launch, *tensors, n_rows, n_cols, *ints[:-1], *_coop_arguments(n_rows, ints[-1], device, via_op))
    else:
        launch(*tensors, n_rows, n_cols, *ints)
    if weight is not None and bias is not None and weight.dtype == bias.dtype and not via_op:
        # both slabs in one launch (dweight's first): the two gradients are rows of one (2, n_cols)
        # tensor. (Not in the custom op, whose outputs may not alias each other.)
        dw, db = partial_sums.sum_partials(partial, weight.dtype).unbind(0)
        return dx, dw, db
    dw_partial = db_partial = partial
    if weight is not None and bias is not None:
        dw_partial, db_partial = partial.unbind(0)  # one slab each, dweight's first
    dw = None if weight is None else partial_sums.sum_partials(dw_partial, weight.dtype, via_op)
    db = None if bias is None else partial_sums.sum_partials(db_partial, bias.dtype, via_op)
    return dx, dw, db


def _layer_norm_bwd_tile_elements(n_cols) -> int | None:
    """LAYER_NORM_BWD_TILE_ELEMENTS' entry for this row length, or None. By comparison, not a
    dict lookup: under torch.compile with dynamic shapes n_cols is a SymInt, which is unhashable
    (a comparison only adds a guard)."""
    return next((tile for cols, tile in LAYER_NORM_BWD_TILE_ELEMENTS.items() if n_cols == cols), None)


def _layer_norm_bwd_coop_plan(n_cols: int, element_size: int) -> _CoopBwd:
    """LAYER_NORM_BWD_COOP, taking rows from LAYER_NORM_BWD_COOP_FROM columns where they fill at
    most LAYER_NORM_BWD_COOP_MAX_FILL of their power-of-two block (16-bit rows: float32 ones
    were not measured)."""
    c = LAYER_NORM_BWD_COOP
    if element_size <= 2 and n_cols <= LAYER_NORM_BWD_COOP_MAX_FILL * runtime.next_power_of_2(n_cols):
        c = dataclasses.replace(c, above_cols=min(c.above_cols, LAYER_NORM_BWD_COOP_FROM))
    return c


def _layer_norm_bwd_recipe(dy2, x2, weight, has_bias: bool, *, traced: bool = False,
                           plan: tuple | None = None) -> tuple:
    """What `layer_norm_bwd` launches for these shapes: (launch, shape of the partial sums or
    None without parameters, integer arguments after n_cols, kind), kind as in `_rms_bwd_recipe`.
    On CUDA the cooperative kernel takes the rows that the one-tile kernel would reread
    (LAYER_NORM_BWD_COOP.above_cols = LAYER_NORM_BWD_PREFETCH_MAX_COLS) and longer ones, and rows
    past LAYER_NORM_BWD_COOP_FROM that fill at most LAYER_NORM_BWD_COOP_MAX_FILL of their block."""
    n_rows, n_cols = x2.shape
    # one (n_programs, n_cols) slab of partial sums per parameter present, dweight's first
    n_params = (weight is not None) + has_bias

    def partial_shape(n_programs: int) -> tuple | None:
        return None if n_params == 0 else (n_programs, n_cols) if n_params == 1 else (2, n_programs, n_cols)

    strides = (dy2.stride(0), x2.stride(0), n_cols)  # dx: fresh and contiguous
    flags = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=has_bias, ALIGN=_row_alignment(n_cols, strides, dy2, x2))
    c = _layer_norm_bwd_coop_plan(n_cols, max(x2.element_size(), dy2.element_size()))
    n_splits, n_groups, rows_per_group = _bwd_coop_groups(n_rows, n_cols, x2.element_size(), x2.device, c)
    if n_splits:
        launch = functools.partial(
            runtime.launchable(_layer_norm_bwd_coop_kernel, traced, plan)[(n_groups * n_splits,)], **flags,
            CHUNK=c.chunk, SPLITS_POW2=runtime.next_power_of_2(n_splits), num_warps=c.num_warps,
        )
        return launch, partial_shape(n_groups), (rows_per_group, *strides, n_splits), "coop"
    reread = runtime.next_power_of_2(n_cols) > LAYER_NORM_BWD_PREFETCH_MAX_COLS
    bwd_plan = LAYER_NORM_BWD_REREAD if reread else LAYER_NORM_BWD
    t = _bwd_tile(n_rows, n_cols, LAYER_NORM_BWD_MAX_FUSED_COLS, LAYER_NORM_WIDE, bwd_plan,
                  _layer_norm_bwd_tile_elements(n_cols))
    n_programs, rows_per_program = _bwd_programs(t, n_rows, x2.device, LAYER_NORM_WIDE, bwd_plan)
    if t.one_tile:
        launch = functools.partial(runtime.launchable(_layer_norm_bwd_kernel, traced, plan)[(n_programs,)],
                                   **flags, REREAD=reread, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                                   num_warps=t.num_warps)
        return launch, partial_shape(n_programs), strides, "tile"
    launch = functools.partial(runtime.launchable(_layer_norm_bwd_wide_kernel, traced, plan)[(n_programs,)],
                               **flags, BLOCK_N=t.block_n, num_warps=t.num_warps)
    return launch, partial_shape(n_programs), (rows_per_program, *strides), "wide"


# ---------------------------------------------------------------------------------------------
# torch.library registration: what torch.compile sees. Custom ops cannot return None, so an
# absent output (u without residual, dgate without gate, ...) is an empty tensor.
# ---------------------------------------------------------------------------------------------


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=like.dtype, device=like.device) if t is None else t


def _or_none(t: torch.Tensor, wanted: bool) -> torch.Tensor | None:
    return t if wanted else None


@triton_op("kernel_lab::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, u, rstd = rms_norm_fwd(x, residual, gate, weight, eps, offset, via_op=True)
    return y, _or_empty(u, x), rstd


@triton_op("kernel_lab::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(
    dy: torch.Tensor,
    du: torch.Tensor | None,
    xn: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    eps: float,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dgate, dw = rms_norm_bwd(dy, du, xn, gate, weight, rstd, eps, offset, via_op=True)
    return dx, _or_empty(dgate, xn), _or_empty(dw, xn)


def _rms_setup_context(ctx, inputs, output):
    x, residual, gate, weight, ctx.eps, ctx.offset = inputs
    _, u, rstd = output
    ctx.has_residual, ctx.has_gate, ctx.has_weight = residual is not None, gate is not None, weight is not None
    ctx.save_for_backward(u if ctx.has_residual else x, gate, weight, rstd)


def _rms_op_backward(ctx, dy, du, _drstd):
    xn, gate, weight, rstd = ctx.saved_tensors
    du = du if ctx.has_residual else None
    dx, dgate, dw = torch.ops.kernel_lab.rms_norm_bwd(dy, du, xn, gate, weight, rstd, ctx.eps, ctx.offset)
    return (dx, _or_none(dx, ctx.has_residual), _or_none(dgate, ctx.has_gate),
            _or_none(dw, ctx.has_weight), None, None)


_rms_norm_fwd_op.register_autograd(_rms_op_backward, setup_context=_rms_setup_context)


@triton_op("kernel_lab::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd_op(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer_norm_fwd(x, weight, bias, eps, via_op=True)


@triton_op("kernel_lab::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = layer_norm_bwd(dy, x, weight, bias, mean, rstd, eps, via_op=True)
    return dx, _or_empty(dw, x), _or_empty(db, x)


def _layer_norm_setup_context(ctx, inputs, output):
    x, weight, bias, ctx.eps = inputs
    _, mean, rstd = output
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _layer_norm_op_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = torch.ops.kernel_lab.layer_norm_bwd(dy, x, weight, bias, mean, rstd, ctx.eps)
    return dx, _or_none(dw, ctx.has_weight), _or_none(db, ctx.has_bias), None


_layer_norm_fwd_op.register_autograd(_layer_norm_op_backward, setup_context=_layer_norm_setup_context)


# ---------------------------------------------------------------------------------------------
# Eager autograd: the same launchers without custom-op dispatch
# ---------------------------------------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, gate, weight, eps, offset):
        y, u, rstd = rms_norm_fwd(x, residual, gate, weight, eps, offset)
        ctx.eps, ctx.offset = eps, offset
        ctx.has_residual = residual is not None
        ctx.save_for_backward(u if ctx.has_residual else x, gate, weight, rstd)
        # gradients of unused outputs arrive as None instead of zero tensors: no extra read
        ctx.set_materialize_grads(False)
        return y, _or_empty(u, x)

    @staticmethod
    def backward(ctx, dy, du):
        runtime.check_first_order_backward("rms_norm")
        xn, gate, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(xn)
        du = du if ctx.has_residual else None
        dx, dgate, dw = rms_norm_bwd(dy, du, xn, gate, weight, rstd, ctx.eps, ctx.offset)
        return dx, (dx if ctx.has_residual else None), dgate, dw, None, None


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = layer_norm_fwd(x, weight, bias, eps)
        ctx.eps = eps
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        runtime.check_first_order_backward("layer_norm")
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_bwd(dy, x, weight, bias, mean, rstd, ctx.eps)
        return dx, dw, db, None


# ---------------------------------------------------------------------------------------------
# Input checks and the public ops
# ---------------------------------------------------------------------------------------------


def _check_float_tensor(t, arg: str, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: {arg}.dtype must be float16, bfloat16 or float32, got {t.dtype}")


def _check(
    name: str,
    x: torch.Tensor,
    params: dict[str, torch.Tensor | None],
    same_as_x: dict[str, torch.Tensor],
    eps,
    backend: str | None,
    offset=0.0,
) -> tuple[float, float]:
    """Validate a norm's arguments; return (eps, offset) as floats.

    params: per-feature tensors (weight, bias) that must be None or of shape (hidden,);
    same_as_x: tensors (residual, gate) that must match x's shape, dtype and device."""
    _check_float_tensor(x, "x", name)
    if x.ndim == 0:
        raise ValueError(f"{name}: x must have at least one dim (..., hidden), got a 0-d tensor")
    hidden = x.shape[-1]
    for arg, p in params.items():
        if p is None:
            continue
        _check_float_tensor(p, arg, name)
        if p.shape != (hidden,):
            raise ValueError(f"{name}: {arg} must have shape ({hidden},) to match x's last dim, "
                             f"got {tuple(p.shape)}")
        if p.device != x.device:
            raise ValueError(f"{name}: {arg} is on {p.device} but x is on {x.device}")
    for arg, t in same_as_x.items():
        _check_float_tensor(t, arg, name)
        if t.shape != x.shape:
            raise ValueError(f"{name}: {arg} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: {arg}.dtype must equal x.dtype ({x.dtype}), got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but x is on {x.device}")
    eps, offset = check_eps_offset(name, eps, offset)
    runtime.check_backend(name, backend, x, "x")
    return float(eps), float(offset)


def _real_scalar(name: str, arg: str, v):
    """v if it is a Python int or float (not a bool), a NumPy real scalar (np.float32, np.int64, ...:
    Hugging Face configs hold such values) as a Python float; TypeError for anything else, tensors
    included (a 0-d tensor would cost a device sync, and under torch.compile a graph break)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        # numbers.Real: NumPy registers its floating and integer scalars there (np.bool_ is not)
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            hint = " (pass float(t) for a 0-d tensor)" if isinstance(v, torch.Tensor) else ""
            raise TypeError(f"{name}: {arg} must be a float (a Python or NumPy real scalar), "
                            f"got {type(v).__name__}{hint}")
        v = float(v)
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) a float argument is
    # symbolic, and dynamo cannot put isfinite's Python bool in a graph (it traces comparisons)
    if not -math.inf < v < math.inf:
        raise ValueError(f"{name}: {arg} must be finite, got {v}")
    return v


def check_eps_offset(name: str, eps, offset=0.0) -> tuple:
    """(eps, offset) checked: real scalars (`_real_scalar`), finite, eps a float32 normal. NumPy
    scalars other than np.float64 (a float subclass) come back as Python floats, Python ints and
    floats as given (symbolic under torch.compile(dynamic=True)): callers convert with float()."""
    eps, offset = _real_scalar(name, "eps", eps), _real_scalar(name, "offset", offset)
    # at least float32's smallest normal: the kernels take eps as float32, where a smaller value
    # is 0 (or a denormal that may be flushed), and an all-zero row's rstd would be 1 / 0
    if not FLOAT32_TINY <= eps <= FLOAT32_MAX:
        raise ValueError(f"{name}: eps must be a float32 normal, in [{FLOAT32_TINY}, {FLOAT32_MAX}] (it keeps "
                         f"1/sqrt(. + eps) finite and non-zero), got {eps}")
    return eps, offset


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _dense(p: torch.Tensor | None) -> torch.Tensor | None:
    """A per-feature parameter as the kernels read it (at w_ptr + column): contiguous. A strided
    one (e.g. w[::2]) is copied, under autograd, so its gradient still reaches it."""
    return p if p is None or p.is_contiguous() else p.contiguous()


def _rms_dispatch(x, residual, gate, weight, eps, offset):
    """(y, u) of the RMSNorm family through the compile-, autograd- or plain launcher path."""
    weight = _dense(weight)
    if torch.compiler.is_compiling():
        y, u, _ = torch.ops.kernel_lab.rms_norm_fwd(x, residual, gate, weight, eps, offset)
        return y, u
    if _needs_grad(x, residual, gate, weight):
        return _RMSNormFunction.apply(x, residual, gate, weight, eps, offset)
    y, u, _ = rms_norm_fwd(x, residual, gate, weight, eps, offset)
    return y, u


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    backend: str | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim: y = x / sqrt(mean(x^2) + eps) * (offset + weight).

    x: (..., hidden), float16 / bfloat16 / float32; rows may be strided (unit stride along
    hidden is read in place, other layouts are copied once). weight: (hidden,) of any supported
    float dtype (e.g. float32 weights with bf16 activations), or None for no affine.
    offset=1.0 is the Gemma convention (weights stored as w - 1). Returns a tensor of x's shape
    and dtype; statistics and math in float32. Differentiable w.r.t. x and weight.

    Differs from torch.nn.functional.rms_norm: the output dtype is x's (not the promotion of x
    and weight), the weight is applied in float32 before the one rounding to x's dtype.

    backend: None picks by device (`kernel_lab.shared.runtime.backend`); "triton" insists on
    the Triton kernel; "reference" runs the PyTorch reference (float32, differentiable).

    eps, offset: Python floats or ints, or NumPy real scalars (np.float32 / np.float64, as some
    Hugging Face configs hold), converted to a Python float; not bools, strings or tensors.

    Raises TypeError for non-float tensors or non-numeric eps/offset, ValueError for a weight
    whose shape is not (hidden,), mismatched devices, eps <= 0, or an unusable backend.
    """
    eps, offset = _check("rms_norm", x, {"weight": weight}, {}, eps, backend, offset)
    if backend == "reference":
        return reference.rms_norm(x, weight, eps, offset=offset, compute_dtype=torch.float32).to(x.dtype)
    return _rms_dispatch(x, None, None, weight, eps, offset)[0]


def residual_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: u = x + residual, y = rms_norm(u, weight, eps, offset).

    Returns (y, u) (the flash-attn / vLLM convention: u is the next block's residual), both of
    x's shape and dtype, from one kernel that reads x and residual once. The norm is taken of
    the float32 sum (u is rounded to x's dtype only when stored). residual must match x's shape,
    dtype and device. Differentiable w.r.t. x, residual and weight (through y and u).
    Other inputs, errors and `backend` as `rms_norm`.
    """
    eps, offset = _check("residual_rms_norm", x, {"weight": weight}, {"residual": residual}, eps, backend, offset)
    if backend == "reference":
        y, u = reference.residual_rms_norm(x, residual, weight, eps, offset=offset, compute_dtype=torch.float32)
        return y.to(x.dtype), u.to(x.dtype)
    return _rms_dispatch(x, residual, None, weight, eps, offset)


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Gated RMSNorm: y = rms_norm(x, weight, eps) * silu(gate), silu(z) = z * sigmoid(z).

    The norm-before-gate form of Mamba-2 and Qwen3-Next, in one kernel. gate must match x's
    shape, dtype and device. Differentiable w.r.t. x, gate and weight.
    Other inputs, errors and `backend` as `rms_norm`.
    """
    eps, _ = _check("rms_norm_gated", x, {"weight": weight}, {"gate": gate}, eps, backend)
    if backend == "reference":
        return reference.rms_norm_gated(x, gate, weight, eps, compute_dtype=torch.float32).to(x.dtype)
    return _rms_dispatch(x, None, gate, weight, eps, 0.0)[0]


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """LayerNorm over the last dim: y = (x - mean) / sqrt(var + eps) * weight + bias, with the
    biased variance (as torch.nn.functional.layer_norm).

    Mean and variance are float32 and numerically stable: the variance is taken of centred
    values (rows held in registers), or merged chunk by chunk with Welford/Chan updates (long
    rows), never as E[x^2] - E[x]^2. weight and bias: (hidden,) or None, any supported float
    dtype. Returns x's shape and dtype. Differentiable w.r.t. x, weight and bias.
    Other inputs, errors and `backend` as `rms_norm`.
    """
    eps, _ = _check("layer_norm", x, {"weight": weight, "bias": bias}, {}, eps, backend)
    if backend == "reference":
        return reference.layer_norm(x, weight, bias, eps, compute_dtype=torch.float32).to(x.dtype)
    weight, bias = _dense(weight), _dense(bias)
    if torch.compiler.is_compiling():
        return torch.ops.kernel_lab.layer_norm_fwd(x, weight, bias, eps)[0]
    if _needs_grad(x, weight, bias):
        return _LayerNormFunction.apply(x, weight, bias, eps)
    return layer_norm_fwd(x, weight, bias, eps)[0]
