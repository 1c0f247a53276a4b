"""Benchmark helpers for pytest-benchmark: a synchronizing timer, byte/FLOP models, roofline.

Usage in a benchmark (one group per (shape, dtype), one row per implementation):

    def test_softmax(benchmark, impl, shape):
        fn = ...                                    # one call of the implementation
        run_cuda(benchmark, fn)                     # warm-up, rounds, synchronized timing
        annotate(benchmark, impl=impl, role="baseline" if impl == "torch" else "peer",
                 bytes_moved=..., max_error=...)

`pytest --benchmark-timer kernel_lab.shared.bench.cuda_timer` makes every round wait for the
GPU. The speedup of each row over its group's baseline is filled in by `add_speedups` (called
from the benchmarks' conftest when the JSON is written and for the terminal table).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import runtime, testing

__all__ = [
    "add_speedups",
    "annotate",
    "attention_flops",
    "bytes_of",
    "cuda_timer",
    "format_table",
    "matmul_flops",
    "max_error",
    "per_call",
    "run_cuda",
]


def cuda_timer() -> float:
    """perf_counter() after torch.cuda.synchronize(): a round ends when the GPU work does."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def bytes_of(*tensors: torch.Tensor | None) -> int:
    """Bytes of the given tensors' elements (None ignored): one read or one write of each."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of an (m, k) @ (k, n) product: one multiply and one add per term."""
    return 2 * m * n * k


def attention_flops(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, *, causal: bool = False,
    backward: bool = False,
) -> float:
    """FLOPs of attention: QK^T and PV (4*B*H*Tq*Tk*D); the backward does 2.5x the forward's
    matmuls. Causal: halved when Tq == Tk (FlashAttention's counting convention); otherwise the
    (query, key) pairs a bottom-right-aligned mask keeps (a decode step, Tq = 1, keeps all Tk)."""
    pairs = float(seqlen_q * seqlen_k)
    if causal:
        if seqlen_q == seqlen_k:
            pairs /= 2
        else:  # query i sees keys j <= i + Tk - Tq
            pairs = float(sum(min(max(seqlen_k - seqlen_q + i + 1, 0), seqlen_k) for i in range(seqlen_q)))
    return 4.0 * batch * heads * pairs * head_dim * (2.5 if backward else 1.0)


def run_cuda(benchmark, fn, *, min_round_seconds: float = 20e-3, rounds: int = 30, warmup_rounds: int = 3):
    """Time `fn` with pytest-benchmark: warm-up (compilation, autotune), then `rounds` rounds of
    enough back-to-back calls to last `min_round_seconds`, so launch gaps do not dominate.

    Each round starts on an idle GPU (the timer synchronizes), so the host work of its first call
    is not overlapped with any kernel. Rounds of ~20 ms keep that near 1% of the round (the call
    count comes from one synchronized call, which overestimates a call: stored rounds are
    10-20 ms). With 2 ms rounds an AdamW step over 62 tensors (0.2 ms of host work, 0.70 ms
    kernel) read 0.765 ms per call at 3 calls per round against 0.709 ms at 30 (H200, torch
    2.11, triton 3.6), an 8% artefact.
    """
    for _ in range(warmup_rounds):
        fn()
    start = cuda_timer()
    fn()
    one_call = max(cuda_timer() - start, 1e-6)
    iterations = max(1, math.ceil(min_round_seconds / one_call))
    return benchmark.pedantic(fn, rounds=rounds, iterations=iterations, warmup_rounds=1)


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """A benchmark row's max_error: max |out - ref| over finite positions (testing.error_report),
    NaN when out and ref differ in where they hold NaN or inf."""
    report = testing.error_report(out, ref)
    return float("nan") if report.nonfinite_mismatches else report.max_abs_error


def annotate(
    benchmark,
    *,
    impl: str,
    role: str = "peer",
    bytes_moved: int | None = None,
    flops: float | None = None,
    max_error: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Fill `benchmark.extra_info` after the run: GB/s, TFLOP/s, % of measured peak, error.

    impl: the row's implementation name; role: "baseline" for the row speedups are taken
    against (one per group), "kernel_lab" for ours, "peer" for the rest.
    bytes_moved: the fewest bytes the op must move (each input read once, each output written
    once); flops: its floating-point operations.
    """
    seconds = benchmark.stats.stats.median
    info: dict[str, Any] = {"impl": impl, "role": role, "median_ms": seconds * 1e3}
    if bytes_moved is not None:
        gbps = bytes_moved / seconds / 1e9
        info["bytes"] = int(bytes_moved)
        info["gbps"] = gbps
        if runtime.cuda_available():
            info["pct_peak_bw"] = 100 * gbps * 1e9 / runtime.measured_copy_bandwidth()
    if flops is not None:
        tflops = flops / seconds / 1e12
        info["flops"] = float(flops)
        info["tflops"] = tflops
        if runtime.cuda_available():
            info["pct_peak_flops"] = 100 * tflops * 1e12 / runtime.measured_matmul_flops()
    if max_error is not None:
        info["max_error"] = float(max_error)
    info.update(extra)
    benchmark.extra_info.update(info)
    return info


def per_call(row: dict[str, Any]) -> float:
    """A benchmark row's median seconds per call: pytest-benchmark times the callable, which
    replays a CUDA graph of extra_info["calls_per_round"] calls on rows that say so."""
    return row["stats"]["median"] / row["extra_info"].get("calls_per_round", 1)


def add_speedups(rows: Sequence[dict[str, Any]]) -> None:
    """Set extra_info["speedup"] = baseline median / row median within each group, in place.

    rows: pytest-benchmark JSON benchmark entries (dicts with "group", "stats", "extra_info").
    Also sets "vs_best_peer" on kernel_lab rows: best peer median / our median. Medians are per
    call: a row whose timed callable replays a CUDA graph of several calls says how many in
    extra_info["calls_per_round"].
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r.get("group") or "", []).append(r)
    for members in groups.values():
        base = [r for r in members if r["extra_info"].get("role") == "baseline"]
        peers = [r for r in members if r["extra_info"].get("role") in ("baseline", "peer")]
        best_peer = min((per_call(r) for r in peers), default=None)
        for r in members:
            median = per_call(r)
            if base:
                r["extra_info"]["speedup"] = per_call(base[0]) / median
            if best_peer is not None and r["extra_info"].get("role") == "kernel_lab":
                r["extra_info"]["vs_best_peer"] = best_peer / median


def geomean(values: Iterable[float]) -> float:
    vals = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of benchmark rows (after `add_speedups`), grouped, plus geomeans."""

    def cell(info: dict[str, Any], key: str, fmt: str) -> str:
        """info[key] in format `fmt` ("8.0f": width 8), or "-" in the same width."""
        return format(info[key], fmt) if key in info else "-".rjust(int(fmt.split(".")[0]))

    # impl names in full: "kernel_lab paged16" and "kernel_lab paged64" must stay apart
    iw = max([16, *(len(r["extra_info"].get("impl", r["name"])) for r in rows)])
    header = f"{'group':<44} {'impl':<{iw}} {'ms':>9} {'GB/s':>8} {'%bw':>6} {'TFLOP/s':>8} " \
             f"{'x base':>7} {'x peer':>7} {'max err':>9}"
    lines = [header, "-" * len(header)]
    for r in sorted(rows, key=lambda r: (r.get("group") or "", per_call(r))):
        info = r["extra_info"]
        lines.append(
            f"{(r.get('group') or '')[:44]:<44} {info.get('impl', r['name']):<{iw}} "
            f"{per_call(r) * 1e3:>9.4f} {cell(info, 'gbps', '8.0f')} "
            f"{cell(info, 'pct_peak_bw', '6.1f')} {cell(info, 'tflops', '8.1f')} "
            f"{cell(info, 'speedup', '7.2f')} {cell(info, 'vs_best_peer', '7.2f')} "
            f"{cell(info, 'max_error', '9.2e')}"
        )
    ours = [r["extra_info"] for r in rows if r["extra_info"].get("role") == "kernel_lab"]
    if ours:
        lines.append(
            f"kernel_lab rows: {len(ours)}; geomean speedup over baseline "
            f"{geomean(i.get('speedup', 0) for i in ours):.2f}x; geomean vs best peer "
            f"{geomean(i.get('vs_best_peer', 0) for i in ours):.2f}x; "
            f"worst vs best peer {min(i.get('vs_best_peer', float('inf')) for i in ours):.2f}x"
        )
    return "\n".join(lines)
