"""Decode attention over a KV cache and the cache append: checks, launchers, torch.library ops.

Call path: `flash_decode(...)` (tensor-level) checks its inputs, then
- in eager mode calls the launcher `flash_decode_fwd` directly (a custom op's dispatch costs
  about as much CPU time as a whole decode step at small batch takes on the GPU);
- under torch.compile calls `torch.ops.kernel_lab.kvcache_decode`, a custom op with a fake
  implementation, so the graph has no break.
`kv_append` (used by the caches in `modules`) follows the same pattern with the mutating op
`torch.ops.kernel_lab.kvcache_append`. There is no backward: these are inference ops.
"""

from __future__ import annotations

import math
import os
import threading

import torch
from torch.library import custom_op

from kernel_lab.shared import reference, runtime

from ._kernels import _decode_merge_kernel, _decode_split_kernel, _kv_append_kernel

try:
    from triton import knobs as _knobs
except ImportError:  # Triton < 3.4: no direct launches (see _DirectLaunch)
    _knobs = None

QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPE = torch.float8_e4m3fn
MAX_HEAD_DIM = 256
# tl.dot needs every dimension >= 16: head dims below are zero-padded to it, and the M tile
# (GQA group x query tokens) is at least 16 rows.
MIN_DOT_DIM = 16
# Rows (query heads of a group x query tokens) of one program; larger groups take more tiles.
MAX_BLOCK_M = 64
# Split-K plan: aim for this many programs per SM, splits of at least MIN_SPLIT_LEN keys (below
# that the merge costs more than the parallelism gains, except for the short contexts of
# SHORT_MIN_SPLIT_LEN below), at most MAX_SPLITS.
# Three per SM: in an H200 sweep (scratch run, CUDA-graph replays, 32 query / 8 kv heads, D = 128)
# they were the fastest or within 2% of it at every shape: B=1 T=32k bf16 39.6 us against 40.4
# at four per SM, T=128k 129.8 against 130.9, the fp8 cache at T=128k 85.4 against 95.1; B=8
# T=8k 69.3 against 70.5 (four: the default before kernel-lab-inference-kvcache 0.1.6).
SPLIT_PROGRAMS_PER_SM = 3
MIN_SPLIT_LEN = 256
# Short contexts, where splits of MIN_SPLIT_LEN keys would leave more than half of the SMs
# without a program (a decode of a few tiles a program, bound by latency), may split down to
# SHORT_MIN_SPLIT_LEN keys as long as that makes at most SHORT_MAX_SPLITS splits. H100 scratch
# run (B=1, CUDA-graph replays over the benchmark's layers, 15 rounds, the old plan against
# this one): T=1k 4 -> 8 splits 9.3 -> 7.7 us (contiguous), 9.2 -> 7.2 (fp8), 9.8 -> 7.9 (paged16);
# T=2k 8 -> 16 splits 10.3 -> 9.1, 10.1 -> 8.1, 11.2 -> 9.3. Not past 16: 128-key splits at T=8k
# (49 against 32 splits of 256) were 3-8% slower, at T=4k level but for paged16 (12.3 against
# 13.1 us at 32 splits) and fp8 (11.1 against 10.8). Measured at B=1 only: larger batches keep
# the old plan unless their programs would leave half the SMs idle (B=2 at T=1k).
SHORT_MIN_SPLIT_LEN = 128
SHORT_MAX_SPLITS = 16
MAX_SPLITS = 128
# Fewest head-dim columns a program of the split merge takes (see _DecodePlan).
MERGE_MIN_BLOCK_D = 32
# Programs per SM of the other split counts timed by the first CUDA decode of a class of decodes
# (see _measured_num_splits), in SPLIT_MEASURE_ROUNDS interleaved rounds; one replaces the
# default only when its best time is under SPLIT_MIN_GAIN times the default's. (Timed once each,
# the winner changed from process to process: fp8, B=1, T=128k took 49 splits in one and 128,
# 12% slower, in another.)
# One program per SM (since 0.1.11): H100 scratch run as above, bf16 contiguous cache, one
# program per SM against the default three: B=1 T=32k 53.4 against 54.6 us (16 against 49
# splits), T=128k 180.5 against 186.0, B=8 T=8k 95.7 against 98.9 (2 against 6 splits); the fp8
# cache, bound by its conversions, was 7-16% slower with them, paged caches within 1%.
SPLIT_WAVE_CANDIDATES = (1, 2, 4, 8)
SPLIT_MEASURE_ROUNDS = 3
SPLIT_MIN_GAIN = 0.97

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------
# checks


def _check_tensor(name: str, t, ndim: int | tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if t.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dims, got shape {tuple(t.shape)}")


def _check_index(name: str, t, device: torch.device, ndim: int) -> None:
    _check_tensor(name, t, ndim)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the cache is on {device}")


def _check_cache_pair(k_cache, v_cache) -> None:
    _check_tensor("k_cache", k_cache, 4)
    _check_tensor("v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must have the same shape and strides, got {tuple(k_cache.shape)} "
            f"{k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}"
        )
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError(
            f"k_cache and v_cache must share dtype and device, got {k_cache.dtype} on {k_cache.device} "
            f"and {v_cache.dtype} on {v_cache.device}"
        )
    if k_cache.dtype not in (*QUERY_DTYPES, FP8_DTYPE):
        raise TypeError(f"cache dtype must be float16, bfloat16, float32 or float8_e4m3fn, got {k_cache.dtype}")


def _check_scales(k_cache, k_scale, v_scale) -> None:
    h_kv = k_cache.shape[2]
    if k_cache.dtype == FP8_DTYPE:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None:
                raise ValueError(f"{name} is required for a float8_e4m3fn cache (one scale per kv head)")
            _check_tensor(name, s, 1)
            if s.shape != (h_kv,) or s.dtype != torch.float32 or s.device != k_cache.device:
                raise ValueError(
                    f"{name} must be float32 of shape ({h_kv},) on {k_cache.device}, got {s.dtype} "
                    f"{tuple(s.shape)} on {s.device}"
                )
        # The kernels convert e4m3 with the fp8 instructions of Ada/Hopper and newer.
        info = runtime.device_info(k_cache.device.index) if k_cache.is_cuda else None
        if info is not None and info.capability < (8, 9):
            raise RuntimeError(
                f"float8_e4m3fn caches need a GPU of compute capability 8.9 or newer, {info.name} is "
                f"{info.capability[0]}.{info.capability[1]}"
            )
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale/v_scale apply to float8_e4m3fn caches only, the cache is {k_cache.dtype}")


def _rows_of(k_cache, block_table) -> int:
    """Cache rows (sequences) addressable: block-table rows if paged, batch rows otherwise."""
    return block_table.shape[0] if block_table is not None else k_cache.shape[0]


def _check_index_values(k_cache, lengths, block_table, seq_ids, batch: int, *, t_new: int | None = None,
                        counts=None) -> None:
    """Raise ValueError unless the index tensors' values keep a launch inside the cache.

    The kernels trust the values of seq_ids, lengths, counts and the block table; they are read
    back here with one synchronization. Checked for each of the `batch` entries: its cache row
    (seq_ids[b]; without seq_ids, b, which the callers' shape checks bound) exists; the row's
    length is >= 0 and, after an append of `t_new` tokens (or counts[b], in [0, t_new]), fits the
    row's capacity (T_max, or max_blocks x block_size); every block-table entry covering those
    tokens is a block of the pool; an append's seq_ids are distinct (two entries writing one row
    would race). Entries past a row's tokens are never read and may hold anything. Skipped while
    torch.compile traces or a CUDA graph is captured, where nothing can be read back.
    """
    if batch == 0 or torch.compiler.is_compiling() or (k_cache.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    n_rows = _rows_of(k_cache, block_table)
    if n_rows == 0:
        raise ValueError(f"{batch} sequences but the cache has no rows")
    page = k_cache.shape[1]
    capacity = page * (block_table.shape[1] if block_table is not None else 1)
    rows = torch.arange(batch, device=k_cache.device) if seq_ids is None else seq_ids.long()
    rows_in = rows.clamp(0, n_rows - 1)  # a bad row id is reported below, not dereferenced
    start = lengths.long()[rows_in]
    end = start
    stats = [rows.min(), rows.max(), start.min()]
    if t_new is not None:
        new = torch.full_like(start, t_new) if counts is None else counts.long()
        end = start + new
        sorted_rows = rows.sort().values
        duplicates = (sorted_rows[1:] == sorted_rows[:-1]).sum() if seq_ids is not None else rows.new_zeros(())
        stats += [new.min(), new.max(), duplicates]
    stats.append(end.max())
    if block_table is not None:
        covering = (end.clamp(0, capacity) + page - 1) // page  # block-table entries each row's tokens need
        read = torch.arange(block_table.shape[1], device=k_cache.device)[None, :] < covering[:, None]
        entries = torch.where(read, block_table[rows_in].long(), 0)
        stats += [entries.min(), entries.max()]
    values = torch.stack(stats).tolist()
    row_min, row_max, start_min = values[:3]
    if row_min < 0 or row_max >= n_rows:
        raise ValueError(f"seq_ids must be cache rows in [0, {n_rows}), got values in [{row_min}, {row_max}]")
    if start_min < 0:
        raise ValueError(f"lengths must be >= 0, got {start_min}")
    if t_new is not None:
        new_min, new_max, duplicates = values[3:6]
        if new_min < 0 or new_max > t_new:
            raise ValueError(f"counts must lie in [0, {t_new}] (T_new), got values in [{new_min}, {new_max}]")
        if duplicates:
            raise ValueError("seq_ids of an append must be distinct (two entries would write the same row)")
    end_max = values[6 if t_new is not None else 3]
    if end_max > capacity:
        what = "lengths + new tokens" if t_new is not None else "lengths"
        raise ValueError(f"{what} must be at most {capacity} (the tokens a cache row holds), got {end_max}")
    if block_table is not None and (values[-2] < 0 or values[-1] >= k_cache.shape[0]):
        raise ValueError(f"block_table entries covering the cached tokens must be blocks of the pool, in "
                         f"[0, {k_cache.shape[0]}); got values in [{values[-2]}, {values[-1]}]")


# ----------------------------------------------------------------------------------------
# append


def kv_append(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    *,
    seq_ids: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    check_indices: bool = True,
) -> None:
    """Write k_new/v_new (B, T_new, H_kv, D) into the cache at each sequence's current length.

    Batch entry b writes its first counts[b] (default T_new) tokens to cache row seq_ids[b]
    (default b) at positions lengths[row], lengths[row] + 1, ...; lengths is NOT advanced (the
    caller owns it). k_cache/v_cache: (B_cache, T_max, H_kv, D), or pools
    (num_blocks, block_size, H_kv, D) with block_table (rows, max_blocks). A float8_e4m3fn
    cache stores x / scale per kv head, saturated to +-448. check_indices (default): one
    synchronization reads seq_ids, lengths, counts and the block table back and raises
    ValueError where a write would fall outside the cache (`_check_index_values`); the cache
    classes, which check on the host, pass False.
    """
    _check_cache_pair(k_cache, v_cache)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        _check_tensor(name, t, 4)
        if t.dtype not in QUERY_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if k_cache.dtype != FP8_DTYPE and t.dtype != k_cache.dtype:  # (the store converted silently)
            raise TypeError(f"{name} must be the cache dtype {k_cache.dtype}, got {t.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {k_cache.device}")
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new and v_new must have the same shape, got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
    if k_new.shape[2:] != k_cache.shape[2:]:
        raise ValueError(f"k_new heads/dim {tuple(k_new.shape[2:])} != cache heads/dim {tuple(k_cache.shape[2:])}")
    _check_scales(k_cache, k_scale, v_scale)
    _check_index("lengths", lengths, k_cache.device, 1)
    if lengths.shape[0] != _rows_of(k_cache, block_table):
        raise ValueError(f"lengths must have one entry per cache row ({_rows_of(k_cache, block_table)}), "
                         f"got {lengths.shape[0]}")
    for name, t in (("seq_ids", seq_ids), ("counts", counts)):
        if t is not None:
            _check_index(name, t, k_cache.device, 1)
            if t.shape[0] != k_new.shape[0]:
                raise ValueError(f"{name} must have one entry per batch entry ({k_new.shape[0]}), got {t.shape[0]}")
    if block_table is not None:
        _check_index("block_table", block_table, k_cache.device, 2)
    if seq_ids is None and k_new.shape[0] > _rows_of(k_cache, block_table):
        raise ValueError(f"k_new has {k_new.shape[0]} sequences but the cache has {_rows_of(k_cache, block_table)} "
                         "rows")
    # (fake tensors under tracing have no memory to compare; the cache classes, which pass
    # check_indices=False, allocate their own caches: never one tensor for both, never expanded)
    if check_indices and not torch.compiler.is_compiling():
        # One tensor as both caches: every key would be overwritten by its value, silently (decode
        # then reads V as K). Interleaved halves of one packed buffer start apart and pass.
        if k_cache.numel() and k_cache.data_ptr() == v_cache.data_ptr():
            raise ValueError("k_cache and v_cache must be different tensors (they start at one address: every "
                             "key would be overwritten by its value)")
        # A cache whose rows share memory (an expanded view) keeps only the last row written there,
        # for every row; torch's in-place ops refuse it the same way (1: overlap for sure).
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if torch._debug_has_internal_overlap(t) == 1:
                raise ValueError(f"{name} has elements that share memory (e.g. an expanded view): an append to "
                                 "one row would overwrite the others")
    if check_indices:
        _check_index_values(k_cache, lengths, block_table, seq_ids, k_new.shape[0], t_new=k_new.shape[1],
                            counts=counts)
    if torch.compiler.is_compiling():
        torch.ops.kernel_lab.kvcache_append(
            k_new, v_new, k_cache, v_cache, lengths, seq_ids, counts, block_table, k_scale, v_scale
        )
    else:
        kv_append_fwd(k_new, v_new, k_cache, v_cache, lengths, seq_ids, counts, block_table, k_scale, v_scale)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses of a tensor's elements (torch strides are >= 0)."""
    start = t.data_ptr()
    return start, start + (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _detach_from_caches(k_new, v_new, k_cache, v_cache):
    """k_new / v_new, cloned where they share memory with a cache (both non-empty).

    An append of a view of the cache's own storage (re-appending cached tokens, a prefix copied
    between rows) is legit, but the kernel's programs read k_new / v_new while others write the
    cache: a source token at a position that another token lands on was read after it was
    overwritten (the interpreter, programs in order) or raced with the write (a GPU), and the
    reference backend's index_put refused it. Cloning first reads every source before any write,
    as an append of the values the views held at the call. Usually a storage comparison (a fraction
    of a microsecond each); the spans are compared only for a tensor in a cache's storage."""
    caches = [(c.untyped_storage().data_ptr(), c) for c in (k_cache, v_cache)]
    out = []
    for t in (k_new, v_new):
        store = t.untyped_storage().data_ptr()
        for cache_store, c in caches:
            if store == cache_store:
                (ts, te), (cs, ce) = _span(t), _span(c)
                if ts < ce and cs < te:
                    t = t.clone()
                    break
        out.append(t)
    return out


@runtime.on_tensors_device
def kv_append_fwd(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    seq_ids: torch.Tensor | None,
    counts: torch.Tensor | None,
    block_table: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Launcher of the append (inputs already checked): one Triton launch for the whole batch,
    or the shared reference's torch indexing on the "reference" backend (CPU without the
    interpreter). Also the implementation of the custom op `kernel_lab::kvcache_append`."""
    bsz, t_new, h_kv, d = k_new.shape
    if bsz * t_new == 0:
        return
    k_new, v_new = _detach_from_caches(k_new, v_new, k_cache, v_cache)
    # the kernel reads these at unit stride (block-table rows at unit column stride)
    lengths, seq_ids, counts, block_table, k_scale, v_scale = (
        None if t is None else t.contiguous() for t in (lengths, seq_ids, counts, block_table, k_scale, v_scale))
    if runtime.backend(k_cache) == "reference":
        reference.kv_append(
            k_new, v_new, k_cache, v_cache, lengths, seq_ids=seq_ids, counts=counts, block_table=block_table,
            k_scale=k_scale, v_scale=v_scale,
        )
        return
    dummy = lengths  # stands in for absent optional pointers; never read (constexpr flags)
    _kv_append_kernel[(bsz * t_new,)](
        k_new, v_new, *k_new.stride(), *v_new.stride(),
        k_cache, v_cache, *k_cache.stride(),
        lengths,
        seq_ids if seq_ids is not None else dummy,
        counts if counts is not None else dummy,
        block_table if block_table is not None else dummy,
        block_table.stride(0) if block_table is not None else 0,
        k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy,
        t_new, h_kv, d,
        PAGED=block_table is not None, PAGE_SIZE=k_cache.shape[1],
        HAS_SEQ_IDS=seq_ids is not None, HAS_COUNTS=counts is not None, QUANT=k_scale is not None,
        BLOCK_H=runtime.next_power_of_2(h_kv), BLOCK_D=runtime.next_power_of_2(d),
        num_warps=4,
    )


# ----------------------------------------------------------------------------------------
# decode


def num_splits_for(batch: int, h_kv: int, m_tiles: int, max_len: int, device: torch.device) -> int:
    """Default split-K factor: enough programs to fill the GPU, each split at least
    MIN_SPLIT_LEN keys (SHORT_MIN_SPLIT_LEN, for up to SHORT_MAX_SPLITS splits, where that
    would leave most SMs idle). (On CUDA the
    first decode of a class of decodes times this and a few counts that fill whole waves, and
    keeps the fastest if it beats this one by a margin: `_measured_num_splits`.)

    E.g. B=1, 8 kv heads on 132 SMs: 8 programs without splitting would leave 124 SMs idle,
    so a 128k context is cut into 49 splits (392 programs); B=64 already has 512 programs at
    one split and is not split.
    """
    return _num_splits(batch, h_kv, m_tiles, max_len, runtime.sm_count(device))


def _num_splits(batch: int, h_kv: int, m_tiles: int, max_len: int, sm_count: int,
                programs_per_sm: int = SPLIT_PROGRAMS_PER_SM) -> int:
    programs = max(1, batch * h_kv * m_tiles)
    by_occupancy = (programs_per_sm * sm_count) // programs
    by_length = max_len // MIN_SPLIT_LEN
    if programs * by_length < sm_count // 2:  # most SMs idle: shorter splits (see SHORT_MIN_SPLIT_LEN)
        by_length = max(by_length, min(max_len // SHORT_MIN_SPLIT_LEN, SHORT_MAX_SPLITS))
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


# Programs per SM measured for each class of decodes (see _measured_num_splits).
_MEASURED_PROGRAMS_PER_SM: dict[tuple, int] = {}


def _measured_num_splits(q, c: DecodeCache, seq_ids, scale: float, m_tiles: int, max_len: int) -> int:
    """The split count of this decode: programs per SM measured once per class of decodes.

    A split program's time is nearly fixed, so a decode takes as many program times as it
    has waves: 528 programs where 3 fit an SM of 132 (396 at once) take two, 392 take one. How
    many fit depends on the tile config (its shared memory and registers), which the
    autotuner picks per split count, and an fp8 cache's decode is bound by the SMs, not
    DRAM, so the fraction of a wave shows (H200, B=1, 128k fp8 keys: 49 splits, one wave of 3
    per SM, took 0.92x the time of 66, 4 per SM). The first decode of a class
    (dtypes, head dim, paging, the power of two of its unsplit programs and of max_len) times
    the default and the split counts of SPLIT_WAVE_CANDIDATES programs per SM, each autotuned
    as usual, with triton.testing.do_bench in SPLIT_MEASURE_ROUNDS interleaved rounds (so it
    takes seconds), and keeps the programs per SM of the fastest (best round) if it beats the
    default by the SPLIT_MIN_GAIN margin, else the default's, for the class: later decodes of
    the class (another batch size, a sequence grown by a token) only derive their split count
    from it. Off CUDA, under the interpreter, while a CUDA graph is captured, while
    torch.compile traces, or with KERNEL_LAB_KVCACHE_AUTOTUNE=0, nothing is measured: a class
    measured before keeps its programs per SM, any other takes the default plan
    (SPLIT_PROGRAMS_PER_SM).
    """
    bsz, sms = q.shape[0], c.sm_count()
    programs = max(1, bsz * c.h_kv * m_tiles)
    klass = (q.dtype, c.dtype, c.d, c.paged, c.page_size, seq_ids is not None, programs.bit_length(),
             max_len.bit_length(), c.device)
    per_sm = _MEASURED_PROGRAMS_PER_SM.get(klass)
    if per_sm is not None:
        return _num_splits(bsz, c.h_kv, m_tiles, max_len, sms, per_sm)
    if (not c.is_cuda or runtime.interpret_mode() or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing() or os.environ.get("KERNEL_LAB_KVCACHE_AUTOTUNE", "1") == "0"):
        return _num_splits(bsz, c.h_kv, m_tiles, max_len, sms)
    from triton.testing import do_bench

    by_splits: dict[int, int] = {}  # split count -> the first programs-per-SM giving it
    for p in (SPLIT_PROGRAMS_PER_SM, *SPLIT_WAVE_CANDIDATES):
        by_splits.setdefault(_num_splits(bsz, c.h_kv, m_tiles, max_len, sms, p), p)
    if len(by_splits) == 1:  # every candidate gives the same split count: nothing to time
        (per_sm,) = by_splits.values()
    else:
        best: dict[int, float] = {}
        for _ in range(SPLIT_MEASURE_ROUNDS):
            for n in by_splits:
                t = do_bench(lambda n=n: _decode_launch(q, c, seq_ids, scale, n, keep_scratch=True), warmup=5,
                             rep=20)
                best[n] = min(best.get(n, t), t)
        default = _num_splits(bsz, c.h_kv, m_tiles, max_len, sms)
        fastest = min(best, key=best.get)
        per_sm = by_splits[fastest if best[fastest] < SPLIT_MIN_GAIN * best[default] else default]
    _MEASURED_PROGRAMS_PER_SM[klass] = per_sm
    return _num_splits(bsz, c.h_kv, m_tiles, max_len, sms, per_sm)


def _m_tiling(group: int, t_q: int) -> tuple[int, int]:
    rows = group * t_q
    block_m = min(MAX_BLOCK_M, max(MIN_DOT_DIM, runtime.next_power_of_2(rows)))
    return block_m, runtime.cdiv(rows, block_m)


def _check_query(q) -> None:
    _check_tensor("q", q, (3, 4))
    if q.dtype not in QUERY_DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")


class DecodeCache:
    """The cache side of a decode, checked once: k/v caches (or pools), lengths, block table,
    fp8 scales, and what the launches derive from them.

    `flash_decode` builds one per call; the cache classes build one per layer and reuse it,
    so a decode step re-checks only q and seq_ids (the cache's own tensors do not change).
    `_plans` memoizes the per-shape launch plan (see `_decode_plan`).
    """

    __slots__ = (
        "_launches",
        "_plans",
        "_queries",
        "_sm_count",
        "block_table",
        "bt_stride",
        "capacity",
        "d",
        "device",
        "dtype",
        "h_kv",
        "is_cuda",
        "k_cache",
        "k_scale",
        "k_strides",
        "lengths",
        "page_size",
        "paged",
        "quant",
        "reused",
        "rows",
        "v_cache",
        "v_scale",
    )

    def __init__(self, k_cache, v_cache, lengths, block_table=None, k_scale=None, v_scale=None, *,
                 reused: bool = False) -> None:
        _check_cache_pair(k_cache, v_cache)
        _check_scales(k_cache, k_scale, v_scale)
        device = k_cache.device
        if block_table is not None:
            _check_index("block_table", block_table, device, 2)
        _check_index("lengths", lengths, device, 1)
        rows = _rows_of(k_cache, block_table)
        if lengths.shape[0] != rows:
            raise ValueError(f"lengths must have one entry per cache row ({rows}), got {lengths.shape[0]}")
        # The kernels read int32 indices, lengths at unit stride and block-table rows at unit
        # column stride: anything else is copied (no copy for the caches' own tensors, whose
        # lengths the kernels must see advance).
        lengths = lengths.to(torch.int32).contiguous()
        if block_table is not None:
            block_table = block_table.to(torch.int32).contiguous()
        if k_scale is not None:  # per-head scales too (the caches' own rows are contiguous: no copy)
            k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
        self.k_cache, self.v_cache, self.lengths, self.block_table = k_cache, v_cache, lengths, block_table
        self.k_scale, self.v_scale = k_scale, v_scale
        self.device, self.dtype = device, k_cache.dtype
        self.is_cuda = device.type == "cuda"
        self.h_kv, self.d = k_cache.shape[2], k_cache.shape[3]
        self.rows = rows
        self.paged = block_table is not None
        # Tokens one row can hold: the default max_len of the split plan and the autotune key.
        self.capacity = k_cache.shape[1] * (block_table.shape[1] if self.paged else 1)
        self.k_strides = k_cache.stride()
        self.bt_stride = block_table.stride(0) if self.paged else 0
        self.page_size = k_cache.shape[1]
        self.quant = k_scale is not None
        # Kept across calls (the cache classes' layers): only then are direct launches worth
        # preparing (see _DirectLaunch); a DecodeCache built per call would never reuse one.
        self.reused = reused
        self._sm_count = None  # read when a split plan first needs it (not while torch.compile traces)
        self._plans: dict = {}
        self._launches: dict = {}
        self._queries: dict = {}

    def sm_count(self) -> int:
        """SMs of the cache's device (runtime.sm_count: a stand-in off CUDA), for the split plan."""
        if self._sm_count is None:
            self._sm_count = runtime.sm_count(self.device)
        return self._sm_count


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    max_len: int | None = None,
    check_indices: bool = True,
) -> torch.Tensor:
    """Decode attention of the newest T_q tokens of each sequence over its cached keys/values.

    out[b, t, h] = softmax(q[b, t, h] . K^T * scale) V over the keys of cache row
    r = seq_ids[b] (default b) at positions p < lengths[r] with p <= lengths[r] - T_q + t
    (the queries are the last T_q tokens, already appended); K/V of query head h is kv head
    h // (H_q / H_kv) (GQA/MQA). A query with no key returns zeros.

    q: (B, H_q, D) or (B, T_q, H_q, D), float16/bfloat16/float32, any strides.
    k_cache, v_cache: (B_cache, T_max, H_kv, D) contiguous caches, or with `block_table`
    (rows, max_blocks) int pools (num_blocks, block_size, H_kv, D); the dtype of q, or
    float8_e4m3fn with per-kv-head float32 `k_scale`/`v_scale` (H_kv,).
    lengths: (rows,) int32/int64. scale: default 1/sqrt(D). num_splits: the split-K factor
    (default: chosen from batch, heads, max_len and the SM count). max_len: an upper bound of
    lengths used for that choice (default: the cache capacity; the caches pass their own).
    check_indices (default): one synchronization reads seq_ids, lengths and the block table back
    and raises ValueError where the decode would read outside the cache (`_check_index_values`);
    pass False on a hot path whose indices are known good.
    Returns q's shape and dtype. Raises TypeError/ValueError on mismatched inputs.
    """
    _check_query(q)
    cache = DecodeCache(k_cache, v_cache, lengths, block_table, k_scale, v_scale)
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0):
        raise ValueError(f"max_len must be an int >= 0, got {max_len!r}")
    if check_indices and (seq_ids is not None or q.shape[0] <= cache.rows):  # else decode_checked_cache raises
        if seq_ids is not None:
            _check_index("seq_ids", seq_ids, cache.device, 1)
        # the values as given: the cache's int32 copies would wrap an int64 2**32 + 1 to 1
        _check_index_values(k_cache, lengths, block_table, seq_ids, q.shape[0])
    return decode_checked_cache(q, cache, seq_ids=seq_ids, scale=scale, num_splits=num_splits, max_len=max_len)


def decode_checked_cache(
    q: torch.Tensor,
    cache: DecodeCache,
    *,
    seq_ids: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """`flash_decode` over an already checked `DecodeCache`; q must have passed `_check_query`.
    Checks q against the cache, seq_ids and num_splits, then dispatches (eager launch or the
    custom op under torch.compile)."""
    c = cache
    if q.device != c.device:
        raise ValueError(f"q is on {q.device} but the cache is on {c.device}")
    shape = q.shape
    # What the checks below conclude depends only on q's shape and dtype: once per pair.
    facts = c._queries.get((shape, q.dtype))
    if facts is None:
        if c.dtype != q.dtype and c.dtype != FP8_DTYPE:
            raise TypeError(f"cache dtype {c.dtype} must be q's dtype {q.dtype} or float8_e4m3fn")
        h_q, d = shape[-2:]
        if c.d != d:
            raise ValueError(f"head dim of q ({d}) != head dim of the cache ({c.d})")
        if d > MAX_HEAD_DIM:
            raise ValueError(f"head dim must be <= {MAX_HEAD_DIM}, got {d}")
        if h_q % c.h_kv != 0:
            raise ValueError(f"query heads ({h_q}) must be a multiple of kv heads ({c.h_kv})")
        _, m_tiles = _m_tiling(h_q // c.h_kv, shape[1] if len(shape) == 4 else 1)
        facts = c._queries[(shape, q.dtype)] = (m_tiles, 1.0 / math.sqrt(d))
    m_tiles, default_scale = facts
    bsz = shape[0]
    if seq_ids is not None:
        _check_index("seq_ids", seq_ids, c.device, 1)
        if seq_ids.shape[0] != bsz:
            raise ValueError(f"seq_ids must have one entry per query row ({bsz}), got {seq_ids.shape[0]}")
        seq_ids = seq_ids.to(torch.int32).contiguous()  # read at unit stride
    elif bsz > c.rows:
        raise ValueError(f"q has {bsz} sequences but the cache has {c.rows} rows")
    # a bool is an int to isinstance: num_splits=True reached the kernels as a 1-bit constant
    # (the interpreter raised "itemsize exceeds ... int1"), so bools are refused like max_len's
    if num_splits is not None and (isinstance(num_splits, bool) or not (isinstance(num_splits, int)
                                                                       and num_splits >= 1)):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if scale is None:
        scale = default_scale
    else:
        # (a NaN or infinite scale gave NaN outputs, zeros on the reference backend; a bool,
        # which float() takes, silently ran scale=1.0 or raised as 0.0)
        if isinstance(scale, bool):
            raise TypeError(f"scale must be a float, got {scale!r}")
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            raise TypeError(f"scale must be a float, got {scale!r}") from None
        if not 0.0 < scale < math.inf:
            raise ValueError(f"scale must be positive and finite, got {scale!r}")
    if num_splits is None:
        max_len = c.capacity if max_len is None else max_len
        num_splits = _measured_num_splits(q, c, seq_ids, float(scale), m_tiles, max_len)
    if torch.compiler.is_compiling():
        return torch.ops.kernel_lab.kvcache_decode(
            q, c.k_cache, c.v_cache, c.lengths, c.block_table, seq_ids, c.k_scale, c.v_scale, float(scale),
            num_splits,
        )
    out = _decode_launch(q, c, seq_ids, float(scale), num_splits, keep_scratch=True)
    return runtime.forward_only("flash_decode", out, q, c.k_cache, c.v_cache, c.k_scale, c.v_scale)


def _flash_decode_reference(q, k_cache, v_cache, lengths, block_table, seq_ids, k_scale, v_scale, scale):
    """Gather each query row's cache and run the shared float32 reference."""
    rows = seq_ids.long() if seq_ids is not None else torch.arange(q.shape[0], device=q.device)
    lens = lengths.long()[rows]
    if block_table is not None:
        k = reference.paged_gather(k_cache, block_table[rows], lens, compute_dtype=torch.float32)
        v = reference.paged_gather(v_cache, block_table[rows], lens, compute_dtype=torch.float32)
    else:
        k, v = k_cache[rows], v_cache[rows]
    out = reference.decode_attention(q, k, v, lens, scale=scale, k_scale=k_scale, v_scale=v_scale,
                                     compute_dtype=torch.float32)
    return out.to(q.dtype)


def flash_decode_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    block_table: torch.Tensor | None,
    seq_ids: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    scale: float,
    num_splits: int,
) -> torch.Tensor:
    """Launcher of decode attention (inputs checked, index tensors int32). Output: q's shape.
    Also the implementation of the custom op `kernel_lab::kvcache_decode`: it may run where
    torch.compile's CUDA graphs own the allocations (cudagraph trees warm up outside capture,
    in the graph's memory pool), so it allocates its split scratch per call."""
    cache = DecodeCache(k_cache, v_cache, lengths, block_table, k_scale, v_scale)
    return _decode_launch(q, cache, seq_ids, scale, num_splits, keep_scratch=False)


class _DecodePlan:
    """Everything a launch derives from (q's shape, dtype, seq_ids given, num_splits) and the
    cache: computed once per cache and shape, not per call."""

    __slots__ = (
        "empty",
        "grid",
        "group",
        "h_kv",
        "lse_numel",
        "m_tiles",
        "merge_grid",
        "merge_heads",
        "merge_meta",
        "meta",
        "part_numel",
        "split",
        "t_q",
        "tune_key",
    )

    def __init__(self, c: DecodeCache, shape: tuple[int, ...], dtype: torch.dtype, has_seq_ids: bool,
                 num_splits: int) -> None:
        if len(shape) == 4:
            bsz, t_q, h_q, d = shape
        else:
            (bsz, h_q, d), t_q = shape, 1
        group = h_q // c.h_kv
        block_m, m_tiles = _m_tiling(group, t_q)
        self.h_kv, self.t_q, self.group, self.m_tiles = c.h_kv, t_q, group, m_tiles
        self.merge_heads, self.empty = h_q, math.prod(shape) == 0
        self.split = num_splits > 1
        # The splits' partial outputs (B, H_q, T_q, NUM_SPLITS, D), then their log-sum-exps
        # (B, H_q, T_q, NUM_SPLITS): one flat float32 scratch that the kernels index themselves.
        self.part_numel = bsz * h_q * t_q * num_splits * d
        self.lse_numel = bsz * h_q * t_q * num_splits
        self.grid = (bsz * c.h_kv * m_tiles, num_splits, 1)
        # The merge reads every split's partial output of its query: few queries (B = 1) leave
        # most SMs idle with one program each, so their head dims are cut into chunks of at
        # least MERGE_MIN_BLOCK_D until the programs cover the SMs.
        rows = bsz * h_q * t_q
        merge_block_d = runtime.next_power_of_2(d)
        while merge_block_d > MERGE_MIN_BLOCK_D and rows * (runtime.next_power_of_2(d) // merge_block_d) < c.sm_count():
            merge_block_d //= 2
        self.merge_grid = (rows, runtime.cdiv(d, merge_block_d), 1)
        # (Tried and dropped: programmatic dependent launch, the merge's programs resident and
        # waiting (griddepcontrol) before the split kernel ends and the split kernel's launch
        # overlapping the kernel ahead of it. In CUDA-graph replays on an H200, two alternated
        # processes per variant, it moved a decode by -1.4 to +0.8 us (B=1: T=32k bf16 38.5 vs 38.8,
        # T=128k 129.0 vs 130.3, fp8 87.3 vs 86.5): a graph already issues the merge right behind
        # the split kernel, and the merge's own L2 round trip stays on the critical path.
        # Also dropped: the merge inside the split kernel, done by the last split of each tile
        # to arrive (an acq_rel counter per tile, scratch kept per stream). H100, B=1 T=4k bf16,
        # stored run 0005 against an unstored benchmark run of that version on another host:
        # eager 40.7 -> 29.9 us (host time; SDPA 31.0 and 33.2 in the two runs), CUDA-graph
        # replay 11.1 -> 14.6 us. Profiled in two scratch runs, the fused split kernel took
        # 14.5 us against 9.7 + 1.5 for the split and merge kernels, with one wide read of the
        # tile's partials (a W @ O product) as with a loop over the splits. Serving engines
        # replay graphs, so the two kernels stayed. H100 also: 16 splits (one program per SM) as
        # a measured candidate moved the T=32k graph replay from 53.5 (0005) to 53.3 us in an
        # unstored benchmark run: not kept.)
        # Autotune keys: the split length as a power of two and the number of programs in
        # half-octave steps, so a 128k-token single sequence and a batch of 64 short ones may
        # pick different tiles, and so may 264 and 392 programs (2 and 3 per SM of an H200).
        len_bucket = int(math.log2(max(1, c.capacity // num_splits)))
        work_bucket = int(2 * math.log2(max(1, bsz * c.h_kv * m_tiles * num_splits)))
        self.meta = {
            "len_bucket": len_bucket, "work_bucket": work_bucket,
            "HEAD_DIM": d, "BLOCK_D": max(MIN_DOT_DIM, runtime.next_power_of_2(d)), "BLOCK_M": block_m,
            "PAGED": c.paged, "PAGE_SIZE": c.page_size, "HAS_SEQ_IDS": has_seq_ids,
            "QUANT": c.quant, "FP16_MMA": c.quant and dtype == torch.bfloat16, "SPLIT": self.split,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        }
        self.merge_meta = {"HEAD_DIM": d, "BLOCK_D": merge_block_d,
                           "BLOCK_S": runtime.next_power_of_2(num_splits), "num_warps": 4}
        # Everything the autotuner's key is made of (its key arguments and the dtypes of the
        # tensor arguments), and more: the config it picks for this key is reused (_launch_tuned).
        self.tune_key = (d, block_m, c.paged, c.quant, len_bucket, work_bucket, dtype, c.dtype, has_seq_ids,
                         self.split, c.page_size)


# Autotuned decode configs by plan key (see _DecodePlan.tune_key), filled from the autotuner's
# choice on the first launch of each key.
_TUNED: dict[tuple, dict] = {}


def _launch_tuned(kernel, key: tuple, grid, args, meta: dict):
    """Launch an autotuned kernel, bypassing `Autotuner.run` once it has chosen for `key`.

    Autotuner.run rebuilds a dict of all ~40 arguments and its key on every call (a large part
    of a decode step's CPU time, measured on the host path with the kernel stubbed);
    past the first call for a key it only forwards to the JIT function with the chosen config,
    which is what the second branch does directly. The kernel, config and arguments are the
    same, so the results are bit-identical.
    """
    cfg = _TUNED.get(key)
    if cfg is None:
        ret = kernel[grid](*args, **meta)
        _TUNED[key] = kernel.best_config.all_kwargs()
        return ret
    return kernel.fn[grid](*args, **meta, **cfg)


def _triton_version() -> str:
    import triton

    return triton.__version__


# Direct launches of the compiled kernels (see _DirectLaunch); KERNEL_LAB_DIRECT_LAUNCH=0 turns
# them off (every launch then goes through JITFunction.run). The two decode-test failures once
# suspected on them came from the autotuner (see test_decode_paged_gives_the_contiguous_result)
# and happened with them off as well. Only with the Triton versions whose launcher calling
# convention was checked (runtime.DIRECT_LAUNCH_TRITON, as runtime.DirectLauncher).
DIRECT_LAUNCH = (os.environ.get("KERNEL_LAB_DIRECT_LAUNCH", "1") == "1" and _knobs is not None
                 and hasattr(_knobs.compilation, "instrumentation_mode")
                 and _triton_version().startswith(runtime.DIRECT_LAUNCH_TRITON))


def _compiled(ret):
    """The CompiledKernel a JIT launch returned, or None (the interpreter returns none)."""
    if ret is not None and hasattr(ret, "result") and not hasattr(ret, "packed_metadata"):
        ret = ret.result()  # an asynchronous compilation's future
    if hasattr(ret, "packed_metadata") and hasattr(ret, "function") and callable(getattr(ret, "__getitem__", None)):
        return ret
    return None


def _raw_launch(kernel, grid) -> tuple | None:
    """(launch, grid, leading arguments) of a loaded CompiledKernel: Triton's C launch function
    and what it takes before the kernel's parameters (stream aside). None when the launcher is
    not the CUDA one checked here, or the kernel needs a global or profiling scratch, which only
    the launcher's Python wrapper allocates."""
    launcher = kernel.run  # (the property loads the kernel's handles on first use)
    # (CUDA's launcher only: HIP's takes other leading arguments and has no scratch sizes)
    if not all(hasattr(launcher, a) for a in ("launch", "launch_cooperative_grid", "launch_pdl",
                                              "global_scratch_size", "profile_scratch_size")):
        return None
    if launcher.global_scratch_size or launcher.profile_scratch_size:
        return None
    # launch(gx, gy, gz, stream, function, cooperative, pdl, global_scratch, profile_scratch,
    #        packed_metadata, launch_metadata, enter_hook, exit_hook, *params)
    return launcher.launch, tuple(grid), (kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                                          None, None, kernel.packed_metadata, None, None, None)


class _DirectLaunch:
    """The compiled split (and merge) kernels of one decode fingerprint, launched directly.

    JITFunction.run binds and specializes its ~40 arguments, builds its cache key (str() of
    the options) and reads the device, stream and knobs on every launch: CPU work on the host
    path of every decode step, the argument binder the largest part of it. Within one
    DecodeCache, everything the specialization depends on is fixed by the fingerprint of
    `_decode_launch` (plan: shapes, dtypes, constexprs, config; the cache's own tensors and
    strides; q's strides; the 16-byte alignment of q and seq_ids; current device; Triton's
    debug/instrumentation knobs), so the kernel JITFunction.run picked for the first call of a
    fingerprint is the one it would pick again. `launch` calls Triton's C launch function with
    the same parameters (all of them in signature order, constexprs included), except that
    pointers are passed as addresses: given a tensor, that function calls its data_ptr() and
    asks the driver whether the address is device memory, about 0.35 us a tensor on an H100
    host (10 tensors: split kernel 9.2 against 5.6 us a launch through the launcher's Python
    wrapper, 6.9 against 5.2 from C; scratch run), and the inputs were checked already.
    Everything but q, seq_ids, the output, the split scratch and the scale is the same for
    every call of a fingerprint and is bound once here.
    """

    __slots__ = ("lengths_ptr", "merge", "merge_params", "split", "split_params")

    def __init__(self, plan: _DecodePlan, c: DecodeCache, split_k, merge_k, q_strides, out_strides,
                 split_tail: tuple, merge_tail: tuple) -> None:
        self.split = _raw_launch(split_k, plan.grid)
        self.merge = None if merge_k is None else _raw_launch(merge_k, plan.merge_grid)
        # lengths also stands in for absent pointers, as in _decode_launch
        self.lengths_ptr = lengths = c.lengths.data_ptr()
        # split parameters, in signature order: (q), q strides, cache, (seq_ids), block table and
        # scales, (out), out strides, (part), the rest
        self.split_params = (
            q_strides,
            (c.k_cache.data_ptr(), c.v_cache.data_ptr(), *c.k_strides, lengths),
            (c.block_table.data_ptr() if c.paged else lengths, c.bt_stride,
             c.k_scale.data_ptr() if c.quant else lengths, c.v_scale.data_ptr() if c.quant else lengths),
            out_strides,
            plan.part_numel,
            (plan.h_kv, plan.t_q, plan.group, plan.m_tiles, plan.grid[1], *split_tail),
        )
        self.merge_params = (plan.part_numel, out_strides, (plan.merge_heads, plan.t_q, plan.grid[1], *merge_tail))

    def usable(self, split: bool) -> bool:
        """Whether every kernel of the decode can be launched this way (see _raw_launch)."""
        return self.split is not None and (self.merge is not None or not split)

    def launch(self, stream: int, q_ptr: int, seq_ids_ptr: int | None, out_ptr: int, part_ptr: int,
               qk_scale: float) -> None:
        """The decode's launches on `stream`, given the addresses of its per-call tensors."""
        launch, grid, lead = self.split
        q_strides, cache, tables, out_strides, part_numel, rest = self.split_params
        launch(*grid, stream, *lead, q_ptr, *q_strides, *cache,
               self.lengths_ptr if seq_ids_ptr is None else seq_ids_ptr, *tables, out_ptr, *out_strides,
               part_ptr, part_numel, qk_scale, *rest)
        if self.merge is not None:
            launch, grid, lead = self.merge
            part_numel, out_strides, rest = self.merge_params
            launch(*grid, stream, *lead, part_ptr, part_numel, out_ptr, *out_strides, *rest)


def _current_raw_stream(device: int) -> int:
    """The current CUDA stream of `device` as Triton's launcher takes it."""
    return torch._C._cuda_getCurrentRawStream(device)


def _tail(jit_fn, n_args: int, values: dict) -> tuple:
    """The values of jit_fn's parameters after its first n_args, in signature order."""
    return tuple(values[name] for name in jit_fn.arg_names[n_args:])


# Split scratch of eager decodes, per thread (a dict by (device, stream) in each); see _split_scratch.
_SPLIT_SCRATCH = threading.local()


def _split_scratch(numel: int, device: int, stream: int) -> torch.Tensor:
    """float32 scratch of at least `numel` elements for the split partials of an eager decode.

    An allocation costs about 4 us of CPU on an H100 host (scratch run), a tenth of a small
    decode's host path. The buffer is kept per stream, so decodes on other streams never share
    it, and per thread: a decode's merge reads what its split kernel wrote, and two threads
    launching on one stream could queue one decode's split kernel between another's split and
    merge. It grows to the largest decode's partials (B x H_q x T_q x splits x (D + 1) floats)
    and is freed with its thread. Only eager decodes outside CUDA-graph capture use it: a
    captured decode, and the custom op that torch.compile calls, allocate their own, so that a
    graph's memory pool owns its scratch.
    """
    held_by_stream = getattr(_SPLIT_SCRATCH, "by_stream", None)
    if held_by_stream is None:
        held_by_stream = _SPLIT_SCRATCH.by_stream = {}
    held = held_by_stream.get((device, stream))
    if held is None or held.numel() < numel:
        held = held_by_stream[device, stream] = torch.empty(numel, dtype=torch.float32, device=f"cuda:{device}")
    return held


@runtime.on_tensors_device
def _decode_launch(q, c: DecodeCache, seq_ids, scale: float, num_splits: int, *, keep_scratch: bool) -> torch.Tensor:
    """The launches of one decode over a checked cache (seq_ids int32 or None). keep_scratch:
    an eager call, which may use the kept split scratch (_split_scratch) unless a CUDA graph is
    being captured."""
    if runtime.backend(q) == "reference":
        return _flash_decode_reference(q, c.k_cache, c.v_cache, c.lengths, c.block_table, seq_ids, c.k_scale,
                                       c.v_scale, scale)
    shape = q.shape
    key = (shape, q.dtype, seq_ids is not None, num_splits)
    plan = c._plans.get(key)
    if plan is None:
        plan = c._plans[key] = _DecodePlan(c, tuple(shape), q.dtype, seq_ids is not None, num_splits)
    out = torch.empty(shape, dtype=q.dtype, device=c.device)
    if plan.empty:
        return out
    # A 3-D q is one token per sequence: T_q = 1 and a zero token stride, no reshape needed.
    if q.dim() == 4:
        q_strides, out_strides = q.stride(), out.stride()
    else:
        sq, so = q.stride(), out.stride()
        q_strides = (sq[0], 0, sq[1], sq[2])
        out_strides = (so[0], 0, so[1], so[2])
    keep_scratch = keep_scratch and c.is_cuda and not torch.cuda.is_current_stream_capturing()
    hooks = DIRECT_LAUNCH and (_knobs.runtime.launch_enter_hook.calls or _knobs.runtime.launch_exit_hook.calls)
    fingerprint = None
    if DIRECT_LAUNCH and c.is_cuda and c.reused and not hooks:  # (with launch hooks, JITFunction.run calls them)
        device = q.get_device()  # the current device (runtime.on_tensors_device)
        q_ptr = q.data_ptr()
        seq_ids_ptr = seq_ids.data_ptr() if seq_ids is not None else None
        # (out and the split scratch are fresh allocations or the kept scratch: 256-byte aligned)
        fingerprint = (plan, device, q_strides, q_ptr & 15, -1 if seq_ids_ptr is None else seq_ids_ptr & 15,
                       _knobs.runtime.debug, _knobs.compilation.instrumentation_mode)
        direct = c._launches.get(fingerprint)
        if direct is not None:
            stream = _current_raw_stream(device)
            part_ptr = 0  # (never read without splits: SPLIT is a constexpr)
            if plan.split:
                n = plan.part_numel + plan.lse_numel
                part = (_split_scratch(n, device, stream) if keep_scratch
                        else torch.empty(n, dtype=torch.float32, device=c.device))
                part_ptr = part.data_ptr()
            direct.launch(stream, q_ptr, seq_ids_ptr, out.data_ptr(), part_ptr, scale * LOG2E)
            return out
    # The split partials (see _split_scratch). Without splits `out` stands in, never touched:
    # SPLIT is a constexpr.
    part = out
    if plan.split:
        n = plan.part_numel + plan.lse_numel
        part = (_split_scratch(n, q.get_device(), _current_raw_stream(q.get_device())) if keep_scratch
                else torch.empty(n, dtype=torch.float32, device=c.device))
    dummy = c.lengths  # stands in for absent optional pointers; never read (constexpr flags)
    args = (
        q, *q_strides,
        c.k_cache, c.v_cache, *c.k_strides,
        c.lengths,
        seq_ids if seq_ids is not None else dummy,
        c.block_table if c.paged else dummy,
        c.bt_stride,
        c.k_scale if c.quant else dummy,
        c.v_scale if c.quant else dummy,
        out, *out_strides,
        part, plan.part_numel,
        scale * LOG2E,
        plan.h_kv, plan.t_q, plan.group, plan.m_tiles, num_splits,
    )
    merge_args = (part, plan.part_numel, out, *out_strides, plan.merge_heads, plan.t_q, num_splits)
    split_k = _compiled(_launch_tuned(_decode_split_kernel, plan.tune_key, plan.grid, args, plan.meta))
    merge_k = None
    if plan.split:
        merge_k = _compiled(_decode_merge_kernel[plan.merge_grid](*merge_args, **plan.merge_meta))
    if fingerprint is not None and split_k is not None and (merge_k is not None or not plan.split):
        jit_split = _decode_split_kernel.fn
        if not jit_split.pre_run_hooks and not _decode_merge_kernel.pre_run_hooks:
            split_tail = _tail(jit_split, len(args), {**plan.meta, **_TUNED[plan.tune_key]})
            merge_tail = _tail(_decode_merge_kernel, len(merge_args), plan.merge_meta) if plan.split else ()
            direct = _DirectLaunch(plan, c, split_k, merge_k, q_strides, out_strides, split_tail, merge_tail)
            if direct.usable(plan.split):
                c._launches[fingerprint] = direct
    return out


# ----------------------------------------------------------------------------------------
# torch.library registration: what torch.compile sees. Opaque custom ops with fake (shape-only)
# implementations rather than triton_op: the launchers make host decisions (split plan,
# autotune keys, the reference fallback reads lengths) that must not be traced, and the
# compiled graph gains nothing from seeing inside a decode kernel.


# The launchers are the ops' implementations: their annotated signatures are the schemas.
_kvcache_decode_op = custom_op("kernel_lab::kvcache_decode", flash_decode_fwd, mutates_args=())
_kvcache_append_op = custom_op("kernel_lab::kvcache_append", kv_append_fwd, mutates_args={"k_cache", "v_cache"})


@_kvcache_decode_op.register_fake
def _kvcache_decode_fake(q, k_cache, v_cache, lengths, block_table, seq_ids, k_scale, v_scale, scale, num_splits):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@_kvcache_append_op.register_fake
def _kvcache_append_fake(k_new, v_new, k_cache, v_cache, lengths, seq_ids, counts, block_table, k_scale, v_scale):
    return None
