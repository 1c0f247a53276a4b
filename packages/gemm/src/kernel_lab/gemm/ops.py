"""matmul, fp8_matmul, quantized_matmul, rms_norm_linear: checks, launchers, torch.library ops,
autograd.

Call path of every public op: check the inputs (TypeError / ValueError naming the argument),
then
- in eager mode call the launcher directly (a custom op costs tens of microseconds per call,
  as long as a decode GEMM), through `_MatmulFunction` when a gradient is needed;
- under torch.compile call the `torch.ops.kernel_lab.gemm_*` op, a `triton_op` (matmul's
  backward is registered with `register_autograd`), so the graph has no break.

Where a launcher runs (`kernel_lab.shared.runtime.backend`): "triton" on CUDA, the same kernels
under the Triton interpreter for CPU tensors with TRITON_INTERPRET=1 (autotuning bypassed: one
small fixed config), and the shared float32 reference otherwise.

Paths per GEMM:
- prefill (M > SKINNY_MAX_M): large output tiles, autotuned, grouped program order;
- decode (M <= SKINNY_MAX_M): the smallest BLOCK_M covering M, narrow tiles and, where they
  still leave SMs idle, split-K, so that enough programs stream the weight to keep HBM busy;
  partial tiles are summed by a reduce kernel;
- one row (M = 1) against an nn.Linear-layout weight (matmul, rms_norm_linear, int8
  per-channel and int4 weight-only): the GEMV kernels, CUDA-core FMAs and no second launch.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.library import triton_op

from kernel_lab.shared import reference, runtime
from kernel_lab.shared.reference.gemm import ACTIVATIONS

from ._kernels import (
    _gemv_kernel,
    _gemv_kernel_tuned,
    _int4_gemv_kernel,
    _int4_gemv_kernel_tuned,
    _matmul_kernel,
    _matmul_kernel_fp8_prefill,
    _matmul_kernel_prefill,
    _matmul_kernel_skinny,
    _matmul_tma_kernel,
    _matmul_tma_kernel_fp8,
    _matmul_tma_persistent_kernel,
    _quantized_matmul_kernel,
    _rms_norm_linear_kernel,
    _rms_norm_linear_kernel_decode,
    _rms_norm_linear_kernel_prefill,
    _rms_norm_linear_kernel_skinny,
    _rms_norm_rows_kernel,
    _splitk_reduce_kernel,
    _tma_block_shapes,
    _weight_only_decode_kernel,
    skinny_configs_alone_on_an_sm,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
FLOAT32_TINY = torch.finfo(torch.float32).tiny
FLOAT32_MAX = torch.finfo(torch.float32).max
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn,)

# M at or below which the decode path (small BLOCK_M, split-K) runs: up to 64 rows one
# 64-row tile covers M, and the weight read dominates the cost.
SKINNY_MAX_M = 64
# Decode tiles are 64 columns wide, halved (down to 32) while the output tiles would leave more
# than half the SMs idle; K is split only if they still would (split = SMs * 0.5 // tiles).
# Splitting K fills idle SMs but adds the reduce kernel and its dependency (2-4 us); narrower
# tiles fill them without it. H200 sweep (bf16, M in {16, 64}, the four Llama-3-8B
# projections, CUDA-graph replays, 32/64/128-column tiles x splits): no split was fastest on
# every shape, 32 columns at N = 4096 (M = 64, K = 4096: 12.6 us against 15.8 with the earlier
# 128 columns and split 4), 64 at N = 6144 and 14336.
SKINNY_BLOCK_N = 64
SKINNY_MIN_BLOCK_N = 32
SPLIT_PROGRAMS_PER_SM = 0.5
# Decode launches (the skinny GEMM, the one-row GEMVs, rms_norm_linear's rows kernel) are
# programmatic dependent launches on Hopper and newer (see _kernels._pdl_start and _pdl): a
# decode step is a chain of small kernels, each paying a launch and a ramp to full bandwidth
# (about 3.5 us a GEMM in a CUDA graph on the H200: 4096x4096 at M = 16, 33.5 MB, takes 11.8 us
# against 8.2 at the copy bandwidth), and a dependent launch overlaps them with the tail of the
# kernel before. H200, bf16, CUDA-graph replays of one call per rotated weight copy, nine
# alternated rounds (scratch, 2026-11-29), us gained per call at N x K = 4096x4096 / 6144x4096 /
# 14336x4096 / 4096x14336, letting the next kernel launch at the start (1) or after the K loop
# (2):
#   GEMV (M = 1)            1: +0.72 / +0.71 / +0.36 / +0.74   2: +0.62 / +0.70 / +0.58 / +0.73
#   GEMM M = 64             1: +1.17 / +0.76 / -0.20 / +1.15   2: +0.40 / +0.45 / +0.66 / +0.45
#   GEMM M = 16             1: -1.14 / -0.13 / -3.62 / -3.38   2: -0.35 / +0.49 / +0.42 / -0.61
#   rms_norm_linear M = 64  1: +1.68 / +1.56 / +1.30 / +1.52   2: +1.74 / +1.58 / +1.34 / +1.66
#   rms_norm_linear M = 32  1: +1.66 / +1.87 / -1.46 / +1.52   2: +1.39 / +1.69 / -2.06 / +1.66
# (That table was measured before the skinny GEMM kept one program per SM in one wave, see
# _kernels._one_program_per_sm: at M <= 32 two of its programs could share an SM, and a next
# kernel let in at the start landed its programs beside ours, unevenly.) Since then, same
# method (three alternated rounds, scratch, 2026-11-29), us, 1 against 2, the GEMM alone:
#   one wave of 128 programs (4096x4096 / 4096x14336): M = 16 10.66 / 29.47 against 11.53 / 30.26,
#     M = 32 11.36 / 30.61 against 12.33 / 31.35, M = 64 11.62 / 32.72 against 12.29 / 33.54;
#   one wave of 96 programs (6144x4096, 36 SMs idle): M = 16 16.53 against 15.58, M = 32 16.87
#     against 16.16, M = 64 16.90 against 15.80;
#   224 programs (14336x4096): M = 16 40.67 against 30.34 (30.64 without PDL), M = 32 with
#     rms_norm_linear's rows kernel ahead 36.0 / 36.7 against 34.9 without.
# Hence: the GEMV and the rows kernel 1; one wave of programs 1 where it fills PDL_FULL_WAVE of
# the SMs with one program an SM, else 2 (float8 tiles of at most 32 x 64 have no config that
# keeps an SM to one program: they keep 2, as measured for such tiles before, in the table
# above); more programs than SMs 2 for 64-row tiles (1 lost there in history 0098: 33.3
# -> 35.2 us a call at M = 64), no PDL for smaller ones. KERNEL_LAB_GEMM_PDL=0 turns it off.
DECODE_PDL = os.environ.get("KERNEL_LAB_GEMM_PDL", "1") != "0"
PDL_FULL_WAVE = 0.9
# rms_norm_linear at M of 17 to 64 (and at most SKINNY_MAX_M): two launches, the normalised rows
# (_rms_norm_rows_kernel, rounded to x's dtype as the unfused pair rounds them) and then the
# plain decode GEMM (its plan above). The fused kernel there multiplies each x tile by the norm
# weight in registers on its way to the tensor cores, once per output tile: with 64 rows that
# is as much work per step as the weight tile's, and the plain loop streams x by asynchronous
# copies instead. H200, bf16, CUDA-graph replays over rotated weight copies, five alternated
# rounds (scratch, 2026-11-28), us, two launches against the fused split-K path used before
# (128-column tiles, one wave of programs, an x^2 program per split and the reduce), the plain
# GEMM alone and torch.compile of the pair:
#   M = 64: 6144x4096 19.5 / 22.1 / 17.3 / 18.6; 4096x4096 14.6 / 16.0 / 12.6 / 14.1;
#           14336x4096 36.4 / 39.3 / 33.6 / 36.7; 4096x14336 37.8 / 38.0 / 33.8 / 41.3;
#   M = 32: 18.8 / 21.6 / 16.5 / 18.6; 13.6 / 14.7 / 12.2 / 14.6; 35.0 / 38.5 / 32.5 / 35.4;
#           35.5 / 37.3 / 32.0 / 38.3.
# (Tried there and slower: one launch on the GEMM's own decode plan, M more programs summing
# one row's x^2 each and publishing it as kernel_lab.shared.coop's words, the output tiles
# reading them after their K loop: M = 64 23.3 / 20.1 / 41.1 / 49.8 us, M = 32 22.3 / 17.8 /
# 38.6 / 47.0, against the fused path's 22.3 / 16.0 / 39.8 / 38.8 and 21.7 / 14.9 / 38.9 / 37.9
# in that run. The x-times-weight work per output tile stays, and with K = 14336 the x^2
# programs, whose loads queue behind the weight stream, finish after the tiles.)
RMS_NORM_LINEAR_ROWS_MIN_M = 17
# Columns a step of _rms_norm_rows_kernel, which holds rows of at most this many in registers
# (16 warps, 32 values a thread; 14336 fits, Llama-3-8B's down projection).
RMS_NORM_ROWS_MAX_BLOCK_K = 16384
# Both launches are programmatic dependent launches on Hopper (DECODE_PDL): M = 64 at the four
# projections above went 19.66 / 15.14 / 36.15 / 38.01 -> 18.10 / 13.46 / 34.85 / 36.49 us.
# (gemm 0.1.20 measured this and left it out: two torch.compile tests failed in its one GPU run.
# The likely cause: a traced launch must name every kernel argument, and that variant's PDL
# constexprs had defaults the traced launches left out. Here every launch passes PDL, and the
# GPU tier, torch.compile tests included, passed.)
# rms_norm_linear at M of 2 to 16 where the matmul's decode plan does not split K: one launch
# whose programs sum x^2 on the tensor cores (SSQ_BY_DOT in _rms_norm_linear_kernel), no extra
# x^2 program and no reduce kernel.
RMS_NORM_LINEAR_DOT_SSQ_MAX_M = 16
# The weight-only (dequantizing) decode kernel (_weight_only_decode_kernel): 16 weight rows a
# program, its K range cut into slices, one a warp. Its loop's speed follows the instructions that
# turn codes into floats (a few a code; a warp issues one a cycle), not the bytes, so the plan aims for
# warps in flight: slices (powers of two up to a maximum) double while the column tiles x slices
# stay within a number of warps per SM, and K is split across programs (a reduce launch) only
# where tiles x slices leave SMs without a warp (few weight rows, e.g. N = 128). Per (code bits, BLOCK_M):
# (BLOCK_K, warps per SM aimed at, most slices). Each step stages BLOCK_K x BLOCK_M of x in shared
# memory beside the codes, so larger M takes shorter steps and fewer warps; int4 moves half the
# bytes of int8 per code and wants more warps. H100 sweeps (bf16, the Llama-3-8B projections,
# CUDA-graph replays over rotated weight copies; scratch, 2026-11-27; slices 1-8 x BLOCK_K
# 64-256 x 2-4 stages), us at M = 16, N x K = 4096x4096 / 6144x4096 / 14336x4096 / 4096x14336:
#   int8 9.4 / 12.9 / 24.8 / 25.0 against 14.2 / 17.9 / 33.7 / 34.2 for the earlier kernel
#        (64-128 rows a program over 4-8 warps on warpgroup MMAs, split-K with a reduce);
#   int4 9.7 / 12.9 / 24.6 / 26.2 against 14.0 / 18.4 / 29.0 / 29.5;
# at M = 32 (best of the sweep): int8 11.8 / 16.1 / 30.6 / 31.1 against 15.6 / 21.3 / 36.6 / 38.2,
# int4 12.2 / 16.3 / 30.5 / 33.1 against 24.4 / 25.0 / 35.1 / 36.8; at M = 64 int8 16.1 / 22.9 /
# 46.1 / 47.3 against 25.9 / 26.4 / 41.3 / 50.3, int4 17.9 / 24.9 / 54.4 / 51.7 against 55.3 / 55.0 /
# 56.9 / 74.2 (the rules below pick those configurations or ones within 13% of them).
# int4 at M <= 32 since the PTX nibble conversion (gemm 0.1.16), whose loop has a third fewer
# instructions: fewer warps per SM, H100 scratch sweep of the targets (M = 16: 14, 28, 56 with
# up to 4 or 8 slices; M = 32: 4, 8, 16), us as above: M = 16 14336x4096 takes 2 slices, 19.5
# against 21.4 with 4 (8 slices: 10.5 / 15.2 against 8.5 / 10.7 at 4096 / 6144 rows); M = 32
# 6144x4096 takes 4 slices, 14.8 against 18.0 with 2, and 14336x4096 one, 29.4 against 35.6
# with 2. int8 was swept again too (targets 2, 4, 8, 16): 4 stayed the fastest or level.
WEIGHT_ONLY_BLOCK_N = 16
WEIGHT_ONLY_TILES = {
    (8, 16): (256, 4, 8), (8, 32): (128, 8, 8), (8, 64): (128, 4, 8),
    (4, 16): (128, 14, 4), (4, 32): (128, 12, 4), (4, 64): (128, 4, 4),
}
# Pipeline depth: 3 stages, and 4 for int8 at BLOCK_M = 16 while the programs are at most 3 an SM
# (a 1-warp program with 4 stages of 256-column steps holds 48 KB of shared memory: past about 3
# programs an SM the fourth stage cost residency; sweep above: 4096x4096 9.4 us with 4 stages
# against 9.9 with 3, 14336x4096 (896 programs) 30.1 with 4 against 24.8 with 3).
WEIGHT_ONLY_STAGES = 3
WEIGHT_ONLY_DEEP_STAGES = 4
WEIGHT_ONLY_DEEP_MAX_PROGRAMS_PER_SM = 3
# Shared memory a program may take (Triton stages num_stages - 1 copies of each slice's code and x
# tiles; the rest of the SM's 227 KB (Hopper) / 163 KB (A100) / 99 KB (others) is left to the
# slices' final sum): fewer stages, then fewer slices, where a plan would need more.
WEIGHT_ONLY_MAX_SHARED = {9: 200 << 10, 8: 150 << 10}
WEIGHT_ONLY_MAX_SHARED_OTHER = 90 << 10
# The int4 GEMV (M = 1) is a programmatic dependent launch as the other GEMVs (DECODE_PDL: the next
# kernel may launch at its start). H200, bf16 x, group 128, the benchmark's CUDA-graph replays
# (history rows, two processes each, 2026-11-29), us without / with at N x K = 4096x4096,
# 6144x4096, 14336x4096, 4096x14336: 8.3 / 7.8-7.9, 10.5 / 10.9-11.4, 21.3 / 20.6, 23.3 / 22.3:
# faster but at 6144x4096 (not profiled; a likely cause: a grid of more than one wave of resident
# programs, whose last programs then wait for SMs that the next kernel's programs, let in early,
# hold). Letting it in after the K loop instead (PDL 2) was 9.8 us there but 23.3 at 14336x4096 and
# 22.9 at 4096x14336: not taken.
# (Tried and dropped: the dequantizing decode kernel (M >= 2) as a dependent launch that lets the
# next kernel in after its K loop. Timed a replay at a time (synchronized), it was 0.3-0.8 us
# faster at M = 4 and 16 on every projection; in the benchmark's back-to-back replays, in two
# processes each, it was slower: M = 16 int8 8.6 -> 9.8 us (4096x4096), 22.5 -> 25.7
# (4096x14336), int4 8.2 -> 8.6 and 21.8 -> 22.3. Why the two timings disagree was not settled.)
# int4 at M = 1: the GEMV's tile holds whole groups, a power of two of bytes each
INT4_GEMV_GROUP_SIZES = (32, 64, 128, 256)
# Every skinny-config BLOCK_K (64, 128, 256) divides this, so a split boundary is a tile boundary.
SKINNY_K_ALIGN = 256
MAX_SPLIT_K = 16
# Autotune keys bucket M by powers of two up to this: every prefill M >= 4096 shares a tuning.
M_BUCKET_CAP = 4096

# Prefill tiles of _quantized_matmul_kernel (BLOCK_M rows of x, BLOCK_N weight rows, warps), with
# 128-wide K steps (less where the group is smaller) and 3 stages. H200 sweeps at M = 4096
# (scratch, kernels launched back to back, alternated rounds; N x K 4096x4096, 14336x4096 and
# 4096x14336, x cuBLAS bf16 on the dense weight): int8 per channel (128, 64, 4 warps) 0.45-0.52
# against 0.40-0.44 for (128, 128, 8); int4 group 128 (128, 128, 8 warps) 0.43-0.46 against
# 0.39-0.41 for (128, 64, 4). 64- and 256-wide K steps, 2 or 4 stages, 64- and 256-row x tiles
# and 256-row weight tiles were slower.
QUANT_PREFILL_TILES = {8: (128, 64, 4), 4: (128, 128, 8)}

# Under the interpreter: one small config (no autotune); runtime.sm_count's stand-in SM count
# keeps the split-K path exercised on the CPU too.
INTERPRET_BLOCK = 32

REDUCE_BLOCK_N = 128

# Hopper path: TMA loads/stores and a persistent grid (see _matmul_tma_persistent_kernel) for
# prefill shapes whose layouts TMA can address. KERNEL_LAB_GEMM_TMA=0 turns it off (the pointer
# kernel then runs everywhere). Host-side tensor descriptors arrived in triton 3.4; older
# tritons simply do not get this path.
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton < 3.4
    TensorDescriptor = None
USE_TMA = os.environ.get("KERNEL_LAB_GEMM_TMA", "1") != "0" and TensorDescriptor is not None


# ----------------------------------------------------------------------------------------------
# planning helpers


def _m_bucket(m: int) -> int:
    return min(runtime.next_power_of_2(max(m, 1)), M_BUCKET_CAP)


# Eager decode launches and the TMA prefill kernel's are planned launches
# (runtime.DirectLauncher.planned; `_launch_prefill`, the pointer kernels' prefill path, is not
# yet): a repeated call with an equal key skips the autotuner's key, Triton's argument binder
# and its cache key. A key names what the launch follows from: the device, the sizes and strides
# passed (Triton specialises integers equal to 1 or multiples of 16), every flag, and each tensor
# argument's _tensor_key.
# Outputs and workspaces are fresh torch.empty tensors (contiguous, aligned): their shapes follow
# from the sizes, their dtype is in the key. KERNEL_LAB_CHECK_PLANS=1 (tests/conftest.py) checks
# on every call that equal keys launch alike. Traced launches (inside the triton_ops) take no
# key: their tensors may be fake, without a data_ptr.
def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    """A tensor argument's part of a launch-plan key: its dtype and 16-byte alignment (None when
    absent: the launcher then passes a fresh tensor in its place)."""
    return None if t is None else (t.dtype, t.data_ptr() % 16)


def _pdl(device: torch.device, interpret: bool, traced: bool, tile: tuple[int, int, int] | None = None,
         programs: int = 0) -> int:
    """The PDL constexpr of a decode launch on `device` (see DECODE_PDL): 0 for a plain launch,
    1 for a dependent launch that lets the next kernel launch at once, 2 for one that lets it
    launch after the K loop. Eager launches on Hopper and newer only (griddepcontrol is sm_90
    PTX; a traced launch, inside a triton_op, is made by torch's wrapper, which passes no
    launch options; ROCm, whose capability numbers are not NVIDIA's, has no griddepcontrol).
    tile / programs: the skinny GEMM's (BLOCK_M, BLOCK_N, operand itemsize) and grid size
    (tile None: the GEMV or the rows kernel)."""
    if (not DECODE_PDL or interpret or traced or torch.version.hip is not None
            or runtime.device_info(device.index).capability < (9, 0)):
        return 0
    if tile is None:
        return 1
    block_m, block_n, itemsize = tile
    sms = runtime.sm_count(device)
    if programs <= sms:
        full = programs >= PDL_FULL_WAVE * sms and _alone_on_an_sm(device.index, block_m, block_n, itemsize)
        return 1 if full else 2
    return 2 if block_m >= SKINNY_MAX_M else 0


@functools.cache
def _alone_on_an_sm(device_index: int | None, block_m: int, block_n: int, itemsize: int) -> bool:
    """Whether a one-wave skinny GEMM of these tiles runs one program per SM: the autotuner
    keeps only such configs where it has some (_kernels._one_program_per_sm); float8 tiles of at
    most 32 x 64 have none, and two of their programs may share an SM."""
    sm_shared = torch.cuda.get_device_properties(device_index).shared_memory_per_multiprocessor
    configs = _matmul_kernel_skinny.configs
    return bool(skinny_configs_alone_on_an_sm(configs, block_m, block_n, itemsize, sm_shared))


def _pdl_args(pdl: int) -> dict:
    """The PDL constexpr, passed on every launch (a traced launch must name every argument),
    and Triton's launch option when set."""
    return dict(PDL=pdl, launch_pdl=True) if pdl else dict(PDL=0)


@dataclass(frozen=True)
class _SkinnyPlan:
    block_m: int
    block_n: int
    split_k: int
    k_per_split: int

    def grid(self, m: int, n: int) -> tuple[int, int]:
        return (runtime.cdiv(m, self.block_m) * runtime.cdiv(n, self.block_n), self.split_k)


def _skinny_plan(
    m: int, n: int, k: int, device: torch.device, k_align: int, block_n: int | None = None,
    programs_per_sm: float = SPLIT_PROGRAMS_PER_SM,
) -> _SkinnyPlan:
    """BLOCK_M covering M, BLOCK_N (after N unless given), and the K split (see constants);
    programs_per_sm: what the split aims for, at most."""
    interpret = device.type != "cuda"
    block_m = max(16, runtime.next_power_of_2(m))
    sms = runtime.sm_count(device)
    if block_n is None:
        block_n = SKINNY_BLOCK_N
        while block_n > SKINNY_MIN_BLOCK_N and runtime.cdiv(m, block_m) * runtime.cdiv(n, block_n) < sms // 2:
            block_n //= 2
    block_n = INTERPRET_BLOCK if interpret else block_n
    tiles = runtime.cdiv(m, block_m) * runtime.cdiv(n, block_n)
    # integer division by tiles: a symbolic size (torch.compile) stays an integer expression
    split = int(sms * programs_per_sm) // tiles
    split = max(1, min(split, MAX_SPLIT_K, runtime.cdiv(k, k_align)))
    k_per_split = runtime.cdiv(runtime.cdiv(k, split), k_align) * k_align
    return _SkinnyPlan(block_m, block_n, runtime.cdiv(k, k_per_split), k_per_split)


@dataclass(frozen=True)
class _WeightOnlyPlan:
    block_m: int
    block_k: int
    slices: int  # K slices a program, one a warp
    slice_len: int  # columns of a slice, a multiple of block_k
    split_k: int  # programs along K (a reduce launch when above 1)
    num_stages: int

    def grid(self, n: int) -> tuple[int, int]:
        return (runtime.cdiv(n, WEIGHT_ONLY_BLOCK_N), self.split_k)


def _weight_only_plan(m: int, n: int, k: int, bits: int, group_size: int, device: torch.device) -> _WeightOnlyPlan:
    """The weight-only decode kernel's plan (see WEIGHT_ONLY_* above); off CUDA (the
    interpreter) small steps and runtime.sm_count's stand-in, so slices and splits run there too."""
    block_m = max(16, runtime.next_power_of_2(m))
    block_k, warps_per_sm, max_slices = WEIGHT_ONLY_TILES[bits, block_m]
    if device.type != "cuda":
        block_k = INTERPRET_BLOCK
    if group_size < k:
        block_k = min(block_k, group_size & -group_size)
    sms = runtime.sm_count(device)
    target = warps_per_sm * sms
    tiles = runtime.cdiv(n, WEIGHT_ONLY_BLOCK_N)
    steps = runtime.cdiv(k, block_k)
    slices = 1
    while slices < max_slices and tiles * slices * 2 <= target and steps >= slices * 2:
        slices *= 2
    split = 1
    if tiles * slices < sms:
        split = min(target // (tiles * slices), runtime.cdiv(steps, slices), MAX_SPLIT_K)
    deep = bits == 8 and block_m == 16 and tiles * split <= WEIGHT_ONLY_DEEP_MAX_PROGRAMS_PER_SM * sms
    stages = WEIGHT_ONLY_DEEP_STAGES if deep else WEIGHT_ONLY_STAGES
    stage_bytes = WEIGHT_ONLY_BLOCK_N * block_k * bits // 8 + block_k * block_m * 2  # codes and x, a slice
    cap = WEIGHT_ONLY_MAX_SHARED_OTHER
    if device.type == "cuda":
        cap = WEIGHT_ONLY_MAX_SHARED.get(runtime.device_info(device.index).capability[0], cap)
    while stages > 2 and (stages - 1) * slices * stage_bytes > cap:
        stages -= 1
    while slices > 1 and (stages - 1) * slices * stage_bytes > cap:
        slices //= 2
    slice_len = runtime.cdiv(steps, split * slices) * block_k
    split = runtime.cdiv(k, slice_len * slices)
    return _WeightOnlyPlan(block_m, block_k, slices, slice_len, split, stages)


def _reduce(ws, c, *, bias=None, scale_a=None, scale_b=None, ssq=None, k=1, eps=0.0, activation="none",
            traced=False):
    """Launch the split-K reduce: c = epilogue(sum of the (SPLIT, M, N) float32 partials)."""
    n_splits, m, n = ws.shape
    block_m = min(16, max(1, runtime.next_power_of_2(m)))
    # float(): with a symbolic K (torch.compile, dynamic=True) 1 / K is a symbolic float, and
    # inductor's launch of the kernel with it failed (torch 2.11, triton 3.6: "'float' object
    # cannot be interpreted as an integer"). A Python float (the graph then guards on K, the
    # layer's hidden size) launches as in eager mode.
    inv_k = float(1.0 / max(k, 1))
    dummy = c
    key = None if traced else (
        "reduce", c.device, n_splits, m, n, c.dtype, _tensor_key(bias), _tensor_key(scale_a), _tensor_key(scale_b),
        None if scale_a is None else (scale_a.numel() == 1, scale_b.numel() == 1), ssq is not None, activation,
    )
    grid = (runtime.cdiv(m, block_m), runtime.cdiv(n, REDUCE_BLOCK_N))
    runtime.launchable(_splitk_reduce_kernel, traced, key)[grid](
        ws, c, dummy if ssq is None else ssq,
        dummy if bias is None else bias,
        dummy if scale_a is None else scale_a, dummy if scale_b is None else scale_b,
        m, n, n_splits, ws.stride(0), 0 if ssq is None else ssq.stride(0), c.stride(0), c.stride(1),
        0 if scale_a is None or scale_a.numel() == 1 else 1,
        0 if scale_b is None or scale_b.numel() == 1 else 1,
        inv_k, eps,
        HAS_BIAS=bias is not None, HAS_SCALE=scale_a is not None, HAS_RSTD=ssq is not None,
        ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=REDUCE_BLOCK_N, num_warps=4,
    )


def _launch_prefill(
    kernel, tuned_kernel, args: tuple, m: int, n: int, interpret: bool, traced: bool, **constexprs
) -> None:
    """Launch one program per output tile of the (m, n) result, no split-K (grid axis 1 is 1):
    `kernel` with the small fixed config under the interpreter, else `tuned_kernel` (the same
    kernel under @triton.autotune), whose config sets the tile sizes. constexprs: the kernel's
    other constexpr arguments."""
    if interpret:
        grid = (runtime.cdiv(m, INTERPRET_BLOCK) * runtime.cdiv(n, INTERPRET_BLOCK), 1)
        runtime.launchable(kernel, traced)[grid](
            *args, BLOCK_M=INTERPRET_BLOCK, BLOCK_N=INTERPRET_BLOCK, BLOCK_K=INTERPRET_BLOCK, GROUP_M=2, **constexprs
        )
        return

    def grid(meta):
        return (runtime.cdiv(m, meta["BLOCK_M"]) * runtime.cdiv(n, meta["BLOCK_N"]), 1)

    runtime.launchable(tuned_kernel, traced)[grid](*args, **constexprs)


def _tma_layout(t: torch.Tensor) -> str | None:
    """"row" / "col" when TMA can address the 2-D tensor t (unit stride along one dim, the other
    stride and the base 16-byte aligned), else None."""
    if t.data_ptr() % 16:
        return None
    esize = t.element_size()
    if t.stride(1) == 1 and (t.stride(0) * esize) % 16 == 0:
        return "row"
    if t.stride(0) == 1 and (t.stride(1) * esize) % 16 == 0:
        return "col"
    return None


def _use_tma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether the TMA persistent kernel takes this prefill: NVIDIA Hopper (ROCm's capability
    numbers are not NVIDIA's: an MI300 reports 9.4) and layouts TMA can address."""
    return (
        USE_TMA
        and torch.version.hip is None
        and runtime.device_info(a.device.index).capability[0] == 9
        and _tma_layout(a) == "row"
        and _tma_layout(b) is not None
        and _tma_layout(c) == "row"
    )


def _disable_tma(error: Exception) -> None:
    global USE_TMA
    USE_TMA = False
    warnings.warn(
        f"kernel_lab.gemm: the TMA kernel failed ({type(error).__name__}: {error}); the pointer kernel runs "
        "from now on",
        RuntimeWarning,
        stacklevel=3,
    )


def _matmul_tma(a, b, c, bias_arg, sa, sb, stride_sa, stride_sb, common) -> None:
    """Launch the persistent TMA kernel (a row-major, b either layout, c row-major)."""
    m, k = a.shape
    n = b.shape[1]
    b_kmajor = _tma_layout(b) == "col"
    placeholder = [16, 16]  # replaced per config by the autotuner's pre-hook
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], placeholder)
    if b_kmajor:  # b = w.t() of a row-major (N, K) weight: describe w itself
        b_desc = TensorDescriptor(b, [n, k], [b.stride(1), 1], placeholder)
    else:
        b_desc = TensorDescriptor(b, [k, n], [b.stride(0), 1], placeholder)
    c_desc = TensorDescriptor(c, [m, n], [c.stride(0), 1], placeholder)
    sms = runtime.sm_count(a.device)
    args = (a_desc, b_desc, c_desc, bias_arg, sa, sb, m, n, k, _m_bucket(m), stride_sa, stride_sb)
    if a.device.type != "cuda":  # the interpreter (tests): one small config, no autotuning
        meta = dict(BLOCK_M=INTERPRET_BLOCK, BLOCK_N=INTERPRET_BLOCK, BLOCK_K=16, GROUP_M=2, EPILOGUE_SUBTILE=True,
                    FLATTEN=True)
        _tma_block_shapes({"a_desc": a_desc, "b_desc": b_desc, "c_desc": c_desc, "B_KMAJOR": b_kmajor, **meta})
        grid = (min(sms, runtime.cdiv(m, INTERPRET_BLOCK) * runtime.cdiv(n, INTERPRET_BLOCK)),)
        _matmul_tma_persistent_kernel[grid](*args, B_KMAJOR=b_kmajor, NUM_SMS=sms, **meta, **common)
        return
    kernel = _matmul_tma_kernel_fp8 if common["HAS_SCALE"] else _matmul_tma_kernel

    def grid(meta):
        return (min(sms, runtime.cdiv(m, meta["BLOCK_M"]) * runtime.cdiv(n, meta["BLOCK_N"])),)

    # A planned direct launch (runtime.DirectLauncher.planned). Through Autotuner.run and
    # JITFunction.run on every call the eager op took 181-193 us of host time a call, against
    # 113-115 planned (H100 host, M = 2048-4096, one process): a 4096 x 4096 x 4096 product takes
    # about 200 us on the GPU. The key: what picks the config, the specialisation (the
    # descriptors' block shapes follow the config) and the grid.
    plan = (a.device, m, n, k, b_kmajor, a.dtype, a.stride(0), b.stride(0), b.stride(1), c.dtype, c.stride(0),
            a.data_ptr() % 16, b.data_ptr() % 16, c.data_ptr() % 16, runtime.plan_arg_key(bias_arg),
            _tensor_key(sa), _tensor_key(sb), stride_sa, stride_sb, *common.values())
    runtime.launchable(kernel, False, plan)[grid](*args, B_KMAJOR=b_kmajor, NUM_SMS=sms, **common)


# ----------------------------------------------------------------------------------------------
# launchers (inputs already checked; a 2-D)


@runtime.on_tensors_device
def matmul_fwd(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    allow_tma: bool = True,
    traced: bool = False,
) -> torch.Tensor:
    """Launcher: act((a @ b) * scale_a * scale_b + bias) -> (M, N) of out_dtype.

    a: (M, K), b: (K, N), any strides; scale_a: one element or (M, 1); scale_b: one element or
    (1, N) (fp8 only). allow_tma: on Hopper, prefill shapes with TMA-compatible layouts run the
    persistent TMA kernel (host tensor descriptors: eager mode only; the torch.library op
    passes False). traced: True only inside the triton_op bodies (see runtime.launchable).
    """
    m, k = a.shape
    n = b.shape[1]
    bias = _unit_stride(bias)
    be = runtime.backend(a)
    if be == "reference" or k == 0:
        if scale_a is not None:
            y = reference.fp8_matmul(a, b, scale_a, scale_b, bias, compute_dtype=torch.float32)
            return reference.epilogue_activation(y, activation, compute_dtype=torch.float32).to(out_dtype)
        return reference.matmul(a, b, bias, activation, compute_dtype=torch.float32).to(out_dtype)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    interpret = be == "triton-interpret"
    has_scale = scale_a is not None
    sa = scale_a if has_scale else c
    sb = scale_b if has_scale else c
    stride_sa = 0 if not has_scale or scale_a.numel() == 1 else 1
    stride_sb = 0 if not has_scale or scale_b.numel() == 1 else 1
    bias_arg = c if bias is None else bias
    common = dict(HAS_BIAS=bias is not None, HAS_SCALE=has_scale, ACTIVATION=activation)
    if m == 1 and not has_scale and b.stride(0) == 1:  # one row against an nn.Linear weight, b = w.t()
        _gemv(a, b.t(), c, bias=bias, activation=activation, interpret=interpret, traced=traced)
        return c
    if m <= SKINNY_MAX_M:
        k_align = INTERPRET_BLOCK if interpret else SKINNY_K_ALIGN
        plan = _skinny_plan(m, n, k, a.device, k_align)
        ws = c if plan.split_k == 1 else torch.empty((plan.split_k, m, n), dtype=torch.float32, device=a.device)
        kernel = _matmul_kernel if interpret else _matmul_kernel_skinny
        extra = dict(BLOCK_K=INTERPRET_BLOCK, GROUP_M=1) if interpret else {}
        tiles, splits = plan.grid(m, n)
        pdl = _pdl(a.device, interpret, traced, (plan.block_m, plan.block_n, a.element_size()), tiles * splits)
        key = None if traced else (
            "skinny", a.device, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), _tensor_key(a),
            _tensor_key(b), _tensor_key(bias), _tensor_key(scale_a), _tensor_key(scale_b), stride_sa, stride_sb,
            out_dtype, activation, pdl,
        )
        runtime.launchable(kernel, traced, key)[plan.grid(m, n)](
            a, b, ws, bias_arg, sa, sb, m, n, k, _m_bucket(m),
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), ws.stride(-2), ws.stride(-1),
            stride_sa, stride_sb, ws.stride(0) if plan.split_k > 1 else 0, plan.k_per_split,
            WRITE_PARTIAL=plan.split_k > 1, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, **extra, **common,
            **_pdl_args(pdl),
        )
        if plan.split_k > 1:
            _reduce(ws, c, bias=bias, scale_a=scale_a, scale_b=scale_b, activation=activation, traced=traced)
        return c
    args = (
        a, b, c, bias_arg, sa, sb, m, n, k, _m_bucket(m),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        stride_sa, stride_sb, 0, k,
    )
    # The TMA path is CUDA-only: under the interpreter there is no device for _use_tma to ask about.
    if not interpret and allow_tma and _use_tma(a, b, c):
        try:
            _matmul_tma(a, b, c, bias_arg, sa, sb, stride_sa, stride_sb, common)
            return c
        except Exception as e:  # a triton / driver that cannot build it: fall back, once and for good
            _disable_tma(e)
    tuned = _matmul_kernel_fp8_prefill if has_scale else _matmul_kernel_prefill
    _launch_prefill(_matmul_kernel, tuned, args, m, n, interpret, traced, WRITE_PARTIAL=False, PDL=0, **common)
    return c


def _gemv(x, w, c, *, scales=None, zeros=None, norm_weight=None, eps=0.0, bias=None, activation="none",
          interpret: bool, traced: bool) -> None:
    """c (1, N) = act(rms_norm(x) @ dequant(w)^T + bias) for one row x (1, K) and w (N, K) (see
    _gemv_kernel): float16 / bfloat16 values, or int8 codes with per-channel scales (and zero
    points); norm_weight: rms_norm_linear's g. Rows per program, BLOCK_K and warps autotuned on
    a GPU."""
    n, k = w.shape
    if interpret:
        kernel, meta = _gemv_kernel, dict(BLOCK_N=8, BLOCK_K=INTERPRET_BLOCK)
    else:
        kernel, meta = _gemv_kernel_tuned, {}

    def grid(meta):
        return (runtime.cdiv(n, meta["BLOCK_N"]),)

    pdl = _pdl(x.device, interpret, traced)
    key = None if traced else (
        "gemv", x.device, n, k, x.stride(1), w.stride(0), w.stride(1), _tensor_key(x), _tensor_key(w),
        _tensor_key(scales), None if scales is None else scales.stride(0), _tensor_key(zeros),
        _tensor_key(norm_weight), _tensor_key(bias), c.dtype, activation, pdl,
    )
    runtime.launchable(kernel, traced, key)[grid](
        x, w, c if scales is None else scales, c if zeros is None else zeros,
        c if norm_weight is None else norm_weight, c, c if bias is None else bias,
        n, k, x.stride(1), w.stride(0), w.stride(1), 0 if scales is None else scales.stride(0), c.stride(1), eps,
        HAS_SCALES=scales is not None, HAS_ZEROS=zeros is not None, HAS_NORM=norm_weight is not None,
        HAS_BIAS=bias is not None, ACTIVATION=activation, USE_PRMT=not interpret, **meta, **_pdl_args(pdl),
    )


def _int4_gemv(x, qdata, scales, zeros, bias, c, group_size: int, interpret: bool, traced: bool) -> None:
    """c (1, N) = x (1, K) @ dequant(qdata)^T + bias for int4 codes with group-wise scales (see
    _int4_gemv_kernel); rows per program, bytes per step and warps autotuned on a GPU."""
    n, k = qdata.shape[0], x.shape[1]
    if interpret:
        kernel, meta = _int4_gemv_kernel, dict(BLOCK_N=4, ROW_BYTES=max(32, group_size // 2))
    else:
        kernel, meta = _int4_gemv_kernel_tuned, {}

    def grid(meta):
        return (runtime.cdiv(n, meta["BLOCK_N"]),)

    pdl = _pdl(x.device, interpret, traced)
    key = None if traced else (
        "int4_gemv", x.device, n, k, x.stride(1), qdata.stride(0), scales.stride(0), scales.stride(1),
        _tensor_key(x), _tensor_key(qdata), _tensor_key(scales), _tensor_key(zeros), _tensor_key(bias), c.dtype,
        group_size, pdl,
    )
    runtime.launchable(kernel, traced, key)[grid](
        x, qdata, scales, c if zeros is None else zeros, c, c if bias is None else bias,
        n, k, x.stride(1), qdata.stride(0), scales.stride(0), scales.stride(1), c.stride(1),
        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, USE_PRMT=not interpret, GROUP_SIZE=group_size,
        **meta, **_pdl_args(pdl),
    )


@runtime.on_tensors_device
def quantized_matmul_fwd(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
    traced: bool = False,
) -> torch.Tensor:
    """Launcher: x (M, K) @ dequant(qweight)^T + bias -> (M, N) of x.dtype (traced: see matmul_fwd)."""
    m, k = x.shape
    n = qdata.shape[0]
    bias = _unit_stride(bias)
    be = runtime.backend(x)
    if be == "reference" or k == 0:
        y = reference.quantized_matmul(
            x, qdata, scales, zeros, bits=bits, group_size=group_size, bias=bias, compute_dtype=torch.float32
        )
        return y.to(x.dtype)
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return c
    interpret = be == "triton-interpret"
    if m == 1 and bits == 8 and group_size == k:
        _gemv(x, qdata, c, scales=scales, zeros=zeros, bias=bias, interpret=interpret, traced=traced)
        return c
    if m == 1 and bits == 4 and group_size in INT4_GEMV_GROUP_SIZES:
        _int4_gemv(x, qdata, scales, zeros, bias, c, group_size, interpret, traced)
        return c
    key = None if traced else (
        "quantized", x.device, m, n, k, x.stride(0), x.stride(1), qdata.stride(0), qdata.stride(1),
        scales.stride(0), scales.stride(1), _tensor_key(x), _tensor_key(qdata), _tensor_key(scales),
        _tensor_key(zeros), _tensor_key(bias), bits, group_size,
    )
    strides = (x.stride(0), x.stride(1), qdata.stride(0), qdata.stride(1), scales.stride(0), scales.stride(1))
    if m <= SKINNY_MAX_M:
        plan = _weight_only_plan(m, n, k, bits, group_size, x.device)
        ws = c if plan.split_k == 1 else torch.empty((plan.split_k, m, n), dtype=torch.float32, device=x.device)
        launch = {} if interpret else dict(num_warps=plan.slices, num_stages=plan.num_stages)
        # Absent zero points and bias take the scales' place, not the output's: should
        # torch.compile fail to see which tensors the kernel writes (see SLICE_STEPS in the
        # kernel), it clones every argument, and an output passed twice came back unwritten.
        runtime.launchable(_weight_only_decode_kernel, traced, key)[plan.grid(n)](
            x, qdata, scales, scales if zeros is None else zeros, ws, scales if bias is None else bias,
            m, n, k, *strides, ws.stride(-2), ws.stride(-1), ws.stride(0) if plan.split_k > 1 else 0,
            plan.slice_len // plan.block_k, 0 if group_size == k else group_size,
            BITS=bits, HAS_ZEROS=zeros is not None, PER_CHANNEL=group_size == k, HAS_BIAS=bias is not None,
            WRITE_PARTIAL=plan.split_k > 1, USE_PRMT=not interpret, SLICES=plan.slices, K_TAIL=k % plan.block_k != 0,
            MASK_M=m < plan.block_m, BLOCK_M=plan.block_m, BLOCK_N=WEIGHT_ONLY_BLOCK_N, BLOCK_K=plan.block_k, **launch,
        )
        if plan.split_k > 1:
            _reduce(ws, c, bias=bias, traced=traced)
        return c
    if interpret:
        block_m = block_n = block_k = INTERPRET_BLOCK
        launch = {}
    else:
        # One scale per weight row and tile: BLOCK_K (a power of two) must divide the group.
        block_m, block_n, num_warps = QUANT_PREFILL_TILES[bits]
        block_k = min(128, group_size & -group_size) if group_size < k else 128
        launch = dict(num_warps=num_warps, num_stages=3)
    grid = (runtime.cdiv(m, block_m) * runtime.cdiv(n, block_n), 1)
    runtime.launchable(_quantized_matmul_kernel, traced, key)[grid](
        x, qdata, scales, c if zeros is None else zeros, c, c if bias is None else bias, m, n, k, *strides,
        c.stride(0), c.stride(1), group_size,
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, USE_PRMT=not interpret,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, **launch,
    )
    return c


@runtime.on_tensors_device
def rms_norm_linear_fwd(
    x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
    traced: bool = False,
) -> torch.Tensor:
    """Launcher: rms_norm(x, norm_weight, eps) @ weight^T + bias; x (M, K), weight (N, K) (traced: see
    matmul_fwd)."""
    m, k = x.shape
    n = weight.shape[0]
    bias = _unit_stride(bias)
    be = runtime.backend(x)
    if be == "reference" or k == 0:
        return reference.rms_norm_linear(x, norm_weight, weight, eps, bias, compute_dtype=torch.float32).to(x.dtype)
    g = norm_weight.contiguous()
    if RMS_NORM_LINEAR_ROWS_MIN_M <= m <= SKINNY_MAX_M and n > 0:
        normed = torch.empty((m, k), dtype=x.dtype, device=x.device)
        block_k = min(runtime.next_power_of_2(k), RMS_NORM_ROWS_MAX_BLOCK_K)
        pdl = _pdl(x.device, be == "triton-interpret", traced)
        key = None if traced else (
            "norm_rows", x.device, m, k, x.stride(0), x.stride(1), _tensor_key(x), _tensor_key(g), pdl
        )
        runtime.launchable(_rms_norm_rows_kernel, traced, key)[(m,)](
            x, g, normed, k, x.stride(0), x.stride(1), eps,
            BLOCK_K=block_k, ONE_STEP=block_k >= k, num_warps=max(4, min(16, block_k // 1024)), **_pdl_args(pdl),
        )
        return matmul_fwd(normed, weight.t(), bias, "none", x.dtype, allow_tma=False, traced=traced)
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return c
    interpret = be == "triton-interpret"
    b = weight.t()
    bias_arg = c if bias is None else bias
    if m == 1 and weight.stride(1) == 1:
        _gemv(x, weight, c, norm_weight=g, eps=eps, bias=bias, interpret=interpret, traced=traced)
        return c

    def key(path: str) -> tuple | None:  # the launch-plan key of the decode launches below
        return None if traced else (path, x.device, m, n, k, x.stride(0), x.stride(1), weight.stride(0),
                                    weight.stride(1), _tensor_key(x), _tensor_key(g), _tensor_key(weight),
                                    _tensor_key(bias))

    extra = dict(BLOCK_K=INTERPRET_BLOCK, GROUP_M=1) if interpret else {}
    k_align = INTERPRET_BLOCK if interpret else SKINNY_K_ALIGN
    if m <= RMS_NORM_LINEAR_DOT_SSQ_MAX_M:
        plan = _skinny_plan(m, n, k, x.device, k_align)
        if plan.split_k == 1:
            kernel = _rms_norm_linear_kernel if interpret else _rms_norm_linear_kernel_decode
            runtime.launchable(kernel, traced, key("ssq_by_dot"))[plan.grid(m, n)](
                x, g, b, c, c, bias_arg, m, n, k, _m_bucket(m),
                x.stride(0), x.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), 0, 0, k, eps,
                HAS_BIAS=bias is not None, WRITE_PARTIAL=False, SSQ_BY_DOT=True, BLOCK_M=plan.block_m,
                BLOCK_N=plan.block_n, **extra,
            )
            return c
    if m <= SKINNY_MAX_M:
        plan = _skinny_plan(m, n, k, x.device, k_align)
        split = plan.split_k
        # always split-K here, even for a split of 1: the kernel's extra program per split sums
        # x^2 (see _rms_norm_linear_kernel) and the reduce forms rstd
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        ssq = torch.empty((split, m), dtype=torch.float32, device=x.device)
        kernel = _rms_norm_linear_kernel if interpret else _rms_norm_linear_kernel_skinny
        tiles, _ = plan.grid(m, n)
        runtime.launchable(kernel, traced, key("split"))[(tiles + 1, split)](
            x, g, b, ws, ssq, bias_arg, m, n, k, _m_bucket(m),
            x.stride(0), x.stride(1), b.stride(0), b.stride(1), ws.stride(-2), ws.stride(-1),
            ws.stride(0), ssq.stride(0), plan.k_per_split, eps,
            HAS_BIAS=bias is not None, WRITE_PARTIAL=True, SSQ_BY_DOT=False, BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n, **extra,
        )
        _reduce(ws, c, bias=bias, ssq=ssq, k=k, eps=eps, traced=traced)
        return c
    args = (
        x, g, b, c, c, bias_arg, m, n, k, _m_bucket(m),
        x.stride(0), x.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), 0, 0, k, eps,
    )
    _launch_prefill(
        _rms_norm_linear_kernel, _rms_norm_linear_kernel_prefill, args, m, n, interpret, traced,
        HAS_BIAS=bias is not None, WRITE_PARTIAL=False, SSQ_BY_DOT=False,
    )
    return c


def matmul_bwd(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    dy: torch.Tensor,
    gemm: Callable[..., torch.Tensor] = matmul_fwd,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(da, db, dbias) of matmul_fwd, with the same kernels on transposed views (no copies).

    a: (M, K), b: (K, N), bias: (N,) or None, dy: (M, N); returns da (M, K) of a.dtype, db (K, N)
    of b.dtype, dbias (N,) of bias.dtype or None. gemm(a, b, bias, activation, out_dtype) runs
    each product: matmul_fwd in eager mode (`_MatmulFunction`), the kernel_lab::gemm_matmul op in
    the backward registered on that op, so that torch.compile traces the three GEMMs.
    """
    if activation == "none":
        dz32 = dy.float()
    else:
        # The pre-activation is recomputed rather than saved: one more GEMM instead of an
        # (M, N) float32 tensor held from forward to backward.
        z = gemm(a, b, bias, "none", torch.float32)
        dz32 = reference.epilogue_activation_backward(z, dy, activation, compute_dtype=torch.float32)
    # dbias from the float32 gradient: rounding dz first would add one rounding per row to the sum.
    dbias = None if bias is None else dz32.sum(0).to(bias.dtype)
    dz = dz32.to(a.dtype)
    da = gemm(dz, b.t(), None, "none", a.dtype)
    db = gemm(a.t(), dz, None, "none", b.dtype)
    return da, db, dbias


# ----------------------------------------------------------------------------------------------
# torch.library registration: what torch.compile sees.


@triton_op("kernel_lab::gemm_matmul", mutates_args=())
def _matmul_op(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str, out_dtype: torch.dtype
) -> torch.Tensor:
    return matmul_fwd(a, b, bias, activation, out_dtype, allow_tma=False, traced=True)


@triton_op("kernel_lab::gemm_fp8_matmul", mutates_args=())
def _fp8_matmul_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return matmul_fwd(a, b, bias, "none", out_dtype, scale_a, scale_b, allow_tma=False, traced=True)


@triton_op("kernel_lab::gemm_quantized_matmul", mutates_args=())
def _quantized_matmul_op(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    return quantized_matmul_fwd(x, qdata, scales, zeros, bias, bits, group_size, traced=True)


@triton_op("kernel_lab::gemm_rms_norm_linear", mutates_args=())
def _rms_norm_linear_op(
    x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    return rms_norm_linear_fwd(x, norm_weight, weight, bias, eps, traced=True)


def _matmul_setup_context(ctx, inputs, output):
    a, b, bias, activation, _ = inputs
    ctx.activation = activation
    ctx.save_for_backward(a, b, bias)


def _matmul_op_backward(ctx, dy):
    a, b, bias = ctx.saved_tensors
    da, db, dbias = matmul_bwd(a, b, bias, ctx.activation, dy, gemm=torch.ops.kernel_lab.gemm_matmul)
    return da, db, dbias, None, None


_matmul_op.register_autograd(_matmul_op_backward, setup_context=_matmul_setup_context)


class _MatmulFunction(torch.autograd.Function):
    """The eager-mode autograd path: the same launchers without custom-op dispatch."""

    @staticmethod
    def forward(ctx, a, b, bias, activation, out_dtype):
        ctx.activation = activation
        ctx.save_for_backward(a, b, bias)
        return matmul_fwd(a, b, bias, activation, out_dtype)

    @staticmethod
    def backward(ctx, dy):
        runtime.check_first_order_backward("matmul")
        a, b, bias = ctx.saved_tensors
        da, db, dbias = matmul_bwd(a, b, bias, ctx.activation, dy)
        return da, db, dbias, None, None


# ----------------------------------------------------------------------------------------------
# checks


def _check_tensor(t, name: str, op: str, dtypes=None, ndim=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name}.dtype must be one of {names}, got {t.dtype}")
    if ndim is not None and t.ndim not in ndim:
        raise ValueError(f"{op}: {name} must have {' or '.join(map(str, ndim))} dims, got shape {tuple(t.shape)}")


def _check_same_device(op: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the input is on {ref.device}")


def _check_bias(op: str, bias, n: int, dtypes=(*SUPPORTED_DTYPES, torch.float32)) -> None:
    if bias is None:
        return
    _check_tensor(bias, "bias", op, dtypes, ndim=(1,))
    if bias.shape[0] != n:
        raise ValueError(f"{op}: bias must have shape ({n},) (the output columns), got {tuple(bias.shape)}")


def _unit_stride(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias with unit stride: every epilogue reads bias[n] at bias_ptr + n, so a strided view
    (e.g. a slice with a step) is copied; a contiguous bias passes through."""
    return bias if bias is None or bias.stride(0) == 1 or bias.shape[0] <= 1 else bias.contiguous()


def _check_out_dtype(op: str, out_dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float16, bfloat16 or float32, got {out_dtype}")


# ----------------------------------------------------------------------------------------------
# public ops


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """y = act(a @ b + bias), float32 accumulation, one kernel (bias and activation fused).

    a: (..., M, K), b: (K, N), both float16 or both bfloat16, any strides: a transposed view
    (e.g. `weight.t()` of an nn.Linear weight) is read in place. Leading dims of a are
    flattened into M (a view when the layout allows, else one copy). bias: (N,) or None.
    activation: None, "gelu" (erf), "gelu_tanh", "silu" or "relu". out_dtype: float16,
    bfloat16 or float32 (default a.dtype). Returns (..., M, N). Differentiable in a, b, bias.

    backend: None picks by device; "triton" insists on the Triton kernel; "reference" runs the
    PyTorch reference (float32 math).

    Raises TypeError for unsupported or mismatched dtypes, ValueError for shape mismatches
    (K of a vs K of b, bias length), unknown activations or tensors on different devices.
    """
    op = "matmul"
    _check_tensor(a, "a", op, SUPPORTED_DTYPES)
    _check_tensor(b, "b", op, SUPPORTED_DTYPES, ndim=(2,))
    if a.ndim < 2:
        raise ValueError(f"{op}: a must have at least 2 dims (..., M, K), got shape {tuple(a.shape)}")
    if b.dtype != a.dtype:
        raise TypeError(f"{op}: a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(
            f"{op}: K mismatch: a is {tuple(a.shape)} (K={a.shape[-1]}), b is {tuple(b.shape)} (K={b.shape[0]})"
        )
    _check_bias(op, bias, b.shape[1])
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    out_dtype = a.dtype if out_dtype is None else out_dtype
    _check_out_dtype(op, out_dtype)
    _check_same_device(op, a, b=b, bias=bias)
    runtime.check_backend(op, backend, a)
    act = "none" if activation is None else activation
    lead = a.shape[:-1]
    a2 = a.reshape(math.prod(lead), a.shape[-1])
    if backend == "reference":
        y = reference.matmul(a2, b, bias, act, compute_dtype=torch.float32).to(out_dtype)
    elif torch.compiler.is_compiling():
        y = torch.ops.kernel_lab.gemm_matmul(a2, b, bias, act, out_dtype)
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a, b, bias)):
        y = _MatmulFunction.apply(a2, b, bias, act, out_dtype)
    else:
        y = matmul_fwd(a2, b, bias, act, out_dtype)
    return y.reshape(*lead, b.shape[1])


def _fp8_supported(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return runtime.device_info(device.index).capability >= (8, 9)


def fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """y = (a * scale_a) @ (b * scale_b) + bias with float8_e4m3fn a and b (torch._scaled_mm's
    convention), float32 accumulation, scales and bias applied in the epilogue.

    a: (M, K), b: (K, N) float8_e4m3fn, any strides (b column-major, i.e. `w_fp8.t()` of an
    (N, K) weight, is the fast layout on Hopper, as for _scaled_mm); scale_a: float32, one
    element (per-tensor) or (M, 1) (per-token); scale_b: float32, one element or (1, N)
    (per-channel). out_dtype: bfloat16 (default), float16 or float32.

    Needs a GPU of compute capability >= 8.9 (Ada, Hopper): RuntimeError on older CUDA GPUs. On
    the CPU the float32 reference runs (the Triton interpreter has no float8 dot).

    Raises TypeError for non-float8 operands or non-float32 scales, ValueError for mismatched
    shapes.
    """
    op = "fp8_matmul"
    _check_tensor(a, "a", op, FP8_DTYPES, ndim=(2,))
    _check_tensor(b, "b", op, FP8_DTYPES, ndim=(2,))
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: K mismatch: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    m, n = a.shape[0], b.shape[1]
    _check_tensor(scale_a, "scale_a", op, (torch.float32,))
    _check_tensor(scale_b, "scale_b", op, (torch.float32,))
    if not (scale_a.numel() == 1 or tuple(scale_a.shape) == (m, 1)):
        raise ValueError(f"{op}: scale_a must have one element or shape ({m}, 1), got {tuple(scale_a.shape)}")
    if not (scale_b.numel() == 1 or tuple(scale_b.shape) == (1, n)):
        raise ValueError(f"{op}: scale_b must have one element or shape (1, {n}), got {tuple(scale_b.shape)}")
    _check_bias(op, bias, n)
    _check_out_dtype(op, out_dtype)
    _check_same_device(op, a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    runtime.check_backend(op, backend, a)
    if a.device.type == "cuda" and not _fp8_supported(a.device):
        cap = runtime.device_info(a.device.index).capability
        raise RuntimeError(f"{op}: float8 matmul needs compute capability >= 8.9, this GPU has {cap[0]}.{cap[1]}")
    if m == 0 or n == 0:  # an empty (M, 1) / (1, N) scale reads as neither form below (nor the reference's)
        return torch.empty((m, n), dtype=out_dtype, device=a.device)
    scale_a = scale_a.reshape(-1, 1).contiguous() if scale_a.numel() > 1 else scale_a.reshape(1)
    scale_b = scale_b.reshape(1, -1).contiguous() if scale_b.numel() > 1 else scale_b.reshape(1)
    if backend == "reference" or a.device.type != "cuda":
        return reference.fp8_matmul(a, b, scale_a, scale_b, bias, compute_dtype=torch.float32).to(out_dtype)
    if torch.compiler.is_compiling():
        return torch.ops.kernel_lab.gemm_fp8_matmul(a, b, scale_a, scale_b, bias, out_dtype)
    out = matmul_fwd(a, b, bias, "none", out_dtype, scale_a, scale_b)
    return runtime.forward_only(op, out, a, b, scale_a, scale_b, bias)


def quantize_fp8(x: torch.Tensor, granularity: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8, scale) with x ~= x_fp8 * scale, x_fp8 float8_e4m3fn, scale float32.

    granularity "tensor": one scale (shape (1,)); "row": one scale per row of a 2-D x (shape
    (rows, 1)). scale = amax / 448 (the largest e4m3 value), so the largest |x| maps to 448.
    For a weight (N, K) quantized by row, `fp8_matmul(a, w_fp8.t(), sa, scale.t())` is x @ w^T.
    """
    _check_tensor(x, "x", "quantize_fp8", (*SUPPORTED_DTYPES, torch.float32))
    if granularity not in ("tensor", "row"):
        raise ValueError(f"quantize_fp8: granularity must be 'tensor' or 'row', got {granularity!r}")
    if granularity == "row" and x.ndim != 2:
        raise ValueError(f"quantize_fp8: granularity='row' needs a 2-D x, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"quantize_fp8: x is empty (shape {tuple(x.shape)}): there is no amax to scale by")
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True) if granularity == "row" else xf.abs().amax().reshape(1)
    # at least float32's smallest normal: an all-zero x (or row) gets a usable scale, and a tiny
    # one still maps its amax to 448 (a floor of 1e-12 on amax flushed max|x| = 1e-20 to zeros)
    scale = (amax / reference.FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (xf / scale).clamp(-reference.FP8_E4M3_MAX, reference.FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


@dataclass
class QuantizedWeight:
    """A weight-only quantized (N, K) nn.Linear weight (format: `kernel_lab.shared.reference.gemm`).

    qdata: (N, K) int8 / uint8 codes, or (N, K // 2) uint8 for int4 (two codes per byte);
    scales: (N, K // group_size) in the original dtype; zeros: (N, K // group_size) uint8 or None
    (symmetric); bits: 8 or 4; group_size: columns per scale (K for per-channel: one group per
    row, also at K = 0, where group_size is 0 and scales / zeros are (N, 1)).
    """

    qdata: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int
    shape: tuple[int, int]  # (N, K) of the original weight
    dtype: torch.dtype  # the original weight's dtype

    def __post_init__(self) -> None:
        # The kernels index codes, scales and zero points by these fields and trust them: a
        # weight built by hand or from a state dict is checked here, as quantize_weight's are.
        op = "QuantizedWeight"
        if self.bits not in (4, 8):
            raise ValueError(f"{op}: bits must be 4 or 8, got {self.bits!r}")
        if self.dtype not in (*SUPPORTED_DTYPES, torch.float32):
            raise ValueError(f"{op}: dtype (the original weight's) must be float16, bfloat16 or float32, got "
                             f"{self.dtype!r}")
        if not isinstance(self.shape, (tuple, list)) or len(self.shape) != 2:
            raise ValueError(f"{op}: shape must be (N, K) of the original weight, got {self.shape!r}")
        n, k = self.shape
        g = self.group_size
        # per channel (g == K) is one group per row for every K, 0 included (no K // 0)
        per_channel = isinstance(g, int) and g == k
        if not per_channel and (not isinstance(g, int) or g <= 0 or k % g or g % 32):
            raise ValueError(f"{op}: group_size must divide K = {k} and be K (per channel) or a multiple of 32, "
                             f"got {g!r}")
        if self.bits == 4 and k % 2:
            raise ValueError(f"{op}: int4 packs two columns per byte and needs an even K, got K = {k}")
        codes = (n, k) if self.bits == 8 else (n, k // 2)
        code_dtype = torch.int8 if self.bits == 8 and self.zeros is None else torch.uint8
        if tuple(self.qdata.shape) != codes or self.qdata.dtype != code_dtype:
            raise ValueError(f"{op}: qdata must be {code_dtype} of shape {codes} for {self.bits}-bit codes of an "
                             f"{(n, k)} weight ({'symmetric' if self.zeros is None else 'with zero points'}), got "
                             f"{self.qdata.dtype} {tuple(self.qdata.shape)}")
        groups = (n, 1 if per_channel else k // g)
        if tuple(self.scales.shape) != groups or not self.scales.is_floating_point():
            raise ValueError(f"{op}: scales must be floating point of shape {groups} (N, K // group_size), got "
                             f"{self.scales.dtype} {tuple(self.scales.shape)}")
        if self.zeros is not None and (tuple(self.zeros.shape) != groups or self.zeros.dtype != torch.uint8):
            raise ValueError(f"{op}: zeros must be None or uint8 of shape {groups}, got {self.zeros.dtype} "
                             f"{tuple(self.zeros.shape)}")
        # The kernels read the codes row-major and the zero points at the scales' strides: other
        # layouts (a transposed copy's view, say) are made contiguous here (no copy otherwise).
        self.qdata, self.scales = self.qdata.contiguous(), self.scales.contiguous()
        if self.zeros is not None:
            self.zeros = self.zeros.contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in (self.qdata, self.scales, self.zeros) if t is not None)

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the original dense weight."""
        return self.shape[0] * self.shape[1] * torch.empty((), dtype=self.dtype).element_size()

    @property
    def compression(self) -> float:
        """dense_nbytes / nbytes: the memory saving, scales and zero points included (1.0 for an
        empty weight, K = 0 with per-channel scales included)."""
        return self.dense_nbytes / self.nbytes if self.dense_nbytes else 1.0

    def dequantize(self) -> torch.Tensor:
        """The (N, K) weight these codes stand for, in the original dtype (saturated to its finite
        range: a float16 group near 65504 has its scale rounded up, and code x scale can land past
        65504 by less than a step, where the cast would give inf)."""
        w = reference.dequantize_weight(
            self.qdata, self.scales, self.zeros, bits=self.bits, group_size=self.group_size,
            compute_dtype=torch.float32,
        )
        big = torch.finfo(self.dtype).max
        return w.clamp(-big, big).to(self.dtype)


def _stored_scales(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 group scales stored in `dtype`, rounded up (never below the exact quotient) and at
    least `dtype`'s smallest positive subnormal. Codes computed from them never pass the code
    range, so round-to-nearest keeps every weight within half a step; and a group of tiny float16
    weights keeps its codes (a clamp at the smallest normal, 6.1e-5, left a group with max|w| of
    1e-4 the codes 0..2 at int8)."""
    as_int = torch.int32 if dtype == torch.float32 else torch.int16
    stored = scales.clamp_min(torch.tensor(1, dtype=as_int).view(dtype).item()).to(dtype)
    # positive floats order as their bit patterns: +1 is the next representable value up
    return torch.where(stored.float() < scales, (stored.view(as_int) + 1).view(dtype), stored)


def _code_reach(scales: torch.Tensor) -> torch.Tensor:
    """The largest |code - zero| whose product with the group's scale stays within float32's max
    (float64, per group). It binds only for groups reaching float32's max: a rounded-up scale (or
    a rounded zero point) can put the extreme code's value past 3.4e38, where dequantization's
    float32 product is inf; the code below it is within one step of every finite weight."""
    return torch.floor(FLOAT32_MAX / scales.double())


# Columns past K that a masked K tile still addresses (the largest BLOCK_K, with margin).
K_OFFSET_OVERHANG = 1024


def _rows_for_int32_k_offsets(x2: torch.Tensor) -> torch.Tensor:
    """x2 (M, K), copied to rows when its K offsets (column index x column stride, int32 in the
    prefill kernels of quantized_matmul and rms_norm_linear) could reach 2**31: a column-major
    x with M x K >= 2**31 elements. Every other layout is read in place."""
    if (x2.shape[1] + K_OFFSET_OVERHANG) * abs(x2.stride(1)) >= 2**31:
        return x2.contiguous()
    return x2


def quantize_weight(
    w: torch.Tensor, bits: int = 8, group_size: int | None = 128, symmetric: bool = True
) -> QuantizedWeight:
    """Quantize an (N, K) nn.Linear weight to int8 or int4 codes with group-wise scales.

    group_size: columns of K sharing one scale (a multiple of 32 dividing K), or None for one
    scale per output channel. symmetric=True: w ~= code * scale with codes in [-127, 127]
    (int8) or [-7, 7] (int4, stored offset by 8), scale = max|w| / 127 (or 7) per group;
    symmetric=False: w ~= (code - zero) * scale with unsigned codes, the group's [min, max]
    (widened to contain 0) mapped onto [0, 255] (or [0, 15]) and a uint8 zero point per group.
    Round-to-nearest. The scales are stored in w's dtype, rounded up (`_stored_scales`), and the
    codes computed from the stored scales, so a weight of the form code * scale (with exact
    scales) round-trips exactly and no code is clamped by the scale's rounding. Error per weight:
    at most half a step (scale) symmetric, one step asymmetric (the zero point is rounded too) or
    within a step of float32's max, for every finite weight: an asymmetric group's range (up to
    twice float32's max) is taken in float64, and the codes are kept where (code - zero) * scale,
    the float32 product of dequantization, stays finite (`_code_reach`).

    K = 0 (an nn.Linear(0, N)): no codes; per channel, group_size 0 and one scale (and zero point)
    per row, those of an all-zero row; group-wise, (N, 0) scales. quantized_matmul then gives the
    bias (zeros without one).

    Raises TypeError for non-float weights, ValueError for bits not in (4, 8), a group_size that
    does not divide K or is not a multiple of 32, an odd K for int4, or a NaN / inf weight (it
    would make its whole group's scale non-finite; one read-back of the weight, an offline call).
    """
    op = "quantize_weight"
    _check_tensor(w, "w", op, (*SUPPORTED_DTYPES, torch.float32), ndim=(2,))
    if isinstance(bits, bool) or bits not in (4, 8) or not isinstance(bits, int):
        raise ValueError(f"{op}: bits must be 4 or 8, got {bits!r}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{op}: w has NaN or inf values: each would turn its whole group's scale non-finite")
    n, k = w.shape
    if group_size is None or group_size == k:
        group_size = k
    elif not isinstance(group_size, int) or group_size <= 0 or group_size % 32:
        raise ValueError(f"{op}: group_size must be None (per channel) or a positive multiple of 32, got {group_size}")
    elif k % group_size:
        raise ValueError(f"{op}: group_size {group_size} must divide K = {k} (K % group_size = {k % group_size})")
    if bits == 4 and k % 2:
        raise ValueError(f"{op}: int4 packs two columns per byte and needs an even K, got K = {k}")
    groups = 1 if group_size == k else k // group_size  # per channel at K = 0: one empty group per row
    wg = w.detach().float().reshape(n, groups, group_size)
    # a group's statistics (amax / amin) over its columns; an empty group (K = 0) gets those of a
    # zero column, which changes no group (every group's range is widened to contain 0 anyway)
    stats = wg if group_size else wg.new_zeros(n, groups, 1)
    if symmetric:
        qmax = 127 if bits == 8 else 7
        scales = _stored_scales(stats.abs().amax(-1) / qmax, w.dtype)
        reach = _code_reach(scales).clamp(max=qmax).float()[..., None]
        codes = torch.round(wg / scales.float()[..., None]).clamp(-reach, reach).to(torch.int32)
        zeros = None
        if bits == 4:
            codes = codes + 8
    else:
        levels = (1 << bits) - 1
        lo = stats.amin(-1).clamp(max=0.0).double()
        hi = stats.amax(-1).clamp(min=0.0).double()
        # float64: hi - lo reaches twice float32's max (an inf range gave inf scales, NaN weights)
        scales = _stored_scales((hi - lo) / levels, w.dtype)
        s = scales.double()
        zeros_i = torch.round(-lo / s).clamp(0, levels)
        reach = _code_reach(scales)
        code_lo = (zeros_i - reach).clamp(min=0).float()[..., None]
        code_hi = (zeros_i + reach).clamp(max=levels).float()[..., None]
        codes = torch.round(wg / s.float()[..., None] + zeros_i.float()[..., None])
        codes = codes.clamp(code_lo, code_hi).to(torch.int32)
        zeros = zeros_i.to(torch.uint8)
    codes = codes.reshape(n, k)
    if bits == 8:
        qdata = codes.to(torch.int8 if symmetric else torch.uint8)
    else:
        qdata = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return QuantizedWeight(qdata.contiguous(), scales.contiguous(), zeros, bits, group_size, (n, k), w.dtype)


def quantized_matmul(
    x: torch.Tensor, qweight: QuantizedWeight, *, bias: torch.Tensor | None = None, backend: str | None = None
) -> torch.Tensor:
    """y = x @ qweight.dequantize()^T + bias, the weight dequantized tile by tile in the K loop
    (it never exists in memory in float16 / bfloat16).

    x: (..., K) float16 / bfloat16, any strides (flattened to rows like matmul's a); qweight
    from `quantize_weight` (any original dtype); bias: (N,) or None. Returns (..., N) of
    x.dtype. Forward only (inference).

    Raises TypeError for a non-QuantizedWeight or an unsupported x dtype, ValueError for a K
    mismatch or tensors on different devices.
    """
    op = "quantized_matmul"
    _check_tensor(x, "x", op, SUPPORTED_DTYPES)
    if not isinstance(qweight, QuantizedWeight):
        raise TypeError(f"{op}: qweight must be a QuantizedWeight (from quantize_weight), got {type(qweight).__name__}")
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have at least 1 dim (..., K), got a scalar")
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"{op}: K mismatch: x is {tuple(x.shape)} (K={x.shape[-1]}), qweight is (N, K) = {(n, k)}")
    _check_bias(op, bias, n)
    _check_same_device(op, x, qdata=qweight.qdata, scales=qweight.scales, zeros=qweight.zeros, bias=bias)
    runtime.check_backend(op, backend, x)
    lead = x.shape[:-1]
    x2 = _rows_for_int32_k_offsets(x.reshape(math.prod(lead), k))
    args = (qweight.qdata, qweight.scales, qweight.zeros, bias, qweight.bits, qweight.group_size)
    if backend == "reference":
        y = reference.quantized_matmul(
            x2, qweight.qdata, qweight.scales, qweight.zeros, bits=qweight.bits, group_size=qweight.group_size,
            bias=bias, compute_dtype=torch.float32,
        ).to(x.dtype)
    elif torch.compiler.is_compiling():
        y = torch.ops.kernel_lab.gemm_quantized_matmul(x2, *args)
    else:
        y = runtime.forward_only(op, quantized_matmul_fwd(x2, *args), x2, qweight.scales, bias)
    return y.reshape(*lead, n)


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """y = rms_norm(x, norm_weight, eps) @ weight^T + bias, with the RMSNorm fused into the
    GEMM: rstd is accumulated in the same K loop and applied to the accumulator, so the
    normalised activations never touch memory.

    x: (..., K) float16 / bfloat16, any strides; norm_weight: (K,) (any float dtype); weight:
    (N, K) of x's dtype (nn.Linear layout, any strides); bias: (N,) or None. Returns (..., N)
    of x.dtype. Differs from the unfused pair in one rounding: the kernel rounds x * norm_weight
    (not x * rstd * norm_weight) to x.dtype before the tensor-core product: in float16,
    |x * norm_weight| above 65504 overflows there (inf/NaN out) where the unfused pair does not.
    Forward only.

    Raises TypeError for unsupported dtypes, ValueError for shape mismatches or an eps below
    float32's smallest normal.
    """
    op = "rms_norm_linear"
    _check_tensor(x, "x", op, SUPPORTED_DTYPES)
    _check_tensor(norm_weight, "norm_weight", op, (*SUPPORTED_DTYPES, torch.float32), ndim=(1,))
    _check_tensor(weight, "weight", op, SUPPORTED_DTYPES, ndim=(2,))
    if weight.dtype != x.dtype:
        raise TypeError(f"{op}: weight.dtype must equal x.dtype ({x.dtype}), got {weight.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have at least 1 dim (..., K), got a scalar")
    k = x.shape[-1]
    if norm_weight.shape[0] != k or weight.shape[1] != k:
        raise ValueError(
            f"{op}: K mismatch: x is {tuple(x.shape)}, norm_weight {tuple(norm_weight.shape)}, weight "
            f"{tuple(weight.shape)} (expected (K,) and (N, K) with K = {k})"
        )
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) a float argument is
    # symbolic, and dynamo cannot put isfinite's Python bool in a graph (it traces comparisons)
    # at least float32's smallest normal: the kernels take eps as float32, where a smaller value
    # is 0 (or a denormal that may be flushed), and an all-zero row's rstd would be 1 / 0
    if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and FLOAT32_TINY <= eps <= FLOAT32_MAX):
        raise ValueError(f"{op}: eps must be a float32 normal, in [{FLOAT32_TINY}, {FLOAT32_MAX}], got {eps!r}")
    _check_bias(op, bias, weight.shape[0])
    _check_same_device(op, x, norm_weight=norm_weight, weight=weight, bias=bias)
    runtime.check_backend(op, backend, x)
    lead = x.shape[:-1]
    x2 = _rows_for_int32_k_offsets(x.reshape(math.prod(lead), k))
    if backend == "reference":
        y = reference.rms_norm_linear(x2, norm_weight, weight, eps, bias, compute_dtype=torch.float32).to(x.dtype)
    elif torch.compiler.is_compiling():
        y = torch.ops.kernel_lab.gemm_rms_norm_linear(x2, norm_weight, weight, bias, float(eps))
    else:
        y = runtime.forward_only(op, rms_norm_linear_fwd(x2, norm_weight, weight, bias, float(eps)),
                                 x2, norm_weight, weight, bias)
    return y.reshape(*lead, weight.shape[0])
