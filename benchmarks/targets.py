"""The issues' speed targets, checked against the stored histories of one GPU model.

Used by `benchmarks/report.py --write`, which puts the table at the top of each
docs/results/<gpu-model>.md; `python benchmarks/targets.py` prints it. Each target reads the
groups that report.py selects (the newest run holding each group), so rows measured in different
runs can meet in one check; the provenance lists in the results files say which runs those are.
The targets' wording follows the issues; where an issue leaves a choice open (which rows, which
peers) the line says what was taken.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from compare import spread
from report import GroupResult, PackageResult, collect, models

# What the results files say above the table.
EXPLAINER = (
    "Each issue's speed targets, checked by benchmarks/targets.py against the rows below: every "
    "group from the newest run that holds it, so one check may read rows of several runs (the "
    "provenance lists say which). Where an issue leaves a choice open (which rows, which peers), "
    "the target's line says what was taken."
)


@dataclass
class Target:
    issue: int
    what: str
    measured: str  # the figure the check reads and where it comes from
    met: bool | None  # None: no stored rows for it


def _row(g: GroupResult, impl: str) -> dict | None:
    """The group's row of implementation `impl`, None if absent."""
    rows = [r for r in g.rows if r["extra_info"].get("impl") == impl]
    return rows[0] if rows else None


def _ms(g: GroupResult, impl: str) -> float | None:
    """Median ms per call of the group's row of implementation `impl`, None if absent."""
    row = _row(g, impl)
    return GroupResult.ms_per_call(row) if row else None


def _ours(g: GroupResult) -> list[dict]:
    return [r for r in g.rows if r["extra_info"].get("role") == "kernel_lab"]


def _geomean(values: Iterable[float]) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _noise(*rows: dict) -> float:
    """The larger spread of two rows compared as a ratio, in %: IQR / median of each row's rounds
    (compare.spread), a lower bound on how far two timings of one call land apart."""
    return 100 * max(spread(r) for r in rows)


def _at_least(issue: int, what: str, pairs: list[tuple], bound: float, unit: str = "x",
              how: str = "min") -> Target:
    """A target that every (value, where) pair must meet (how="min"), or their geomean must.

    A pair may carry a third item, the noise of a ratio of two rows (_noise): a lowest value that
    misses the bound by less than it says so. The verdict does not change (the issues set no
    tolerance); the note says that another run may rank those two rows the other way."""
    if not pairs:
        return Target(issue, what, "no stored rows", None)
    if how == "geomean":
        value = _geomean(p[0] for p in pairs)
        return Target(issue, what, f"geomean {_fmt(value, bound, unit)} over {len(pairs)} rows", value >= bound)
    value, where, *noise = min(pairs)
    note = ""
    if noise and value < bound <= value * (1 + noise[0] / 100):
        note = f"; a miss within the two rows' own spread, IQR/median up to {noise[0]:.1f}%"
    return Target(issue, what, f"lowest {_fmt(value, bound, unit)} ({where}; {len(pairs)} rows{note})",
                  value >= bound)


def _fmt(value: float, bound: float, unit: str) -> str:
    """`value` rounded as the tables round it, with one more digit where that rounding would
    make a miss read as the bound (0.996x as "1.00x")."""
    digits = 0 if unit == "%" else 2
    if round(value, digits) >= bound > value:
        digits += 1
    return f"{value:.{digits}f}{unit}"


def _groups(results: dict[str, PackageResult], package: str, pattern: str) -> list[GroupResult]:
    res = results.get(package)
    return [g for g in res.groups if re.search(pattern, g.group)] if res else []


# ---------------------------------------------------------------------------------------------
# per issue


def softmax_targets(results: dict[str, PackageResult]) -> list[Target]:
    """Issue 2: rows of N = 1k to 128k above the L2 (not the few-rows and dispatch rows); peers
    torch.softmax eager and torch.compile (the issue's; Liger is in the tables too)."""
    rows = _groups(results, "softmax", r"^softmax-(fwd|bwd) \S+ \d+x\d+$")
    vs_torch = [(g.x_baseline, g.group) for g in rows if g.x_baseline]
    vs_peers = []
    for g in rows:
        peers = [r for r in (_row(g, "torch"), _row(g, "torch.compile")) if r]
        if peers:
            best = min(peers, key=GroupResult.ms_per_call)
            vs_peers.append((GroupResult.ms_per_call(best) / g.ours_ms, g.group, _noise(best, g.ours)))
    bandwidth = [(g.pct_peak(), g.group) for g in rows if g.pct_peak() is not None]
    return [
        _at_least(2, "at least 1.3x torch eager, geomean", vs_torch, 1.3, how="geomean"),
        _at_least(2, "never slower than torch eager or torch.compile on any row", vs_peers, 1.0),
        _at_least(2, "at least 85% of copy bandwidth on the large rows", bandwidth, 85, unit="%"),
    ]


def norms_targets(results: dict[str, PackageResult]) -> list[Target]:
    """Issue 3: backward targets read both the eager `bwd` rows and the CUDA-graph `bwd-graph`
    rows, separately."""
    fwd = _groups(results, "norms", r" fwd ")
    out = [
        _at_least(3, "forward: at least 90% of copy bandwidth on every row",
                  [(g.pct_peak(), g.group) for g in fwd if g.pct_peak() is not None], 90, unit="%"),
        _at_least(3, "forward: at least 1.0x the best peer on every row",
                  [(g.x_peer, g.group, _noise(g.best_peer, g.ours)) for g in fwd if g.x_peer], 1.0),
    ]
    for kind in ("bwd", "bwd-graph"):
        bwd = _groups(results, "norms", rf" {kind} ")
        vs_liger = [(_ms(g, "liger") / g.ours_ms, g.group) for g in bwd if _ms(g, "liger")]
        out += [
            _at_least(3, f"backward ({kind} rows): at least 1.1x Liger, geomean", vs_liger, 1.1, how="geomean"),
            _at_least(3, f"backward ({kind} rows): at least 75% of copy bandwidth",
                      [(g.pct_peak(), g.group) for g in bwd if g.pct_peak() is not None], 75, unit="%"),
        ]
    residual = _groups(results, "norms", r"^residual_rms_norm fwd ")
    out.append(_at_least(3, "residual_rms_norm forward: at least 1.3x the unfused pair (torch)",
                         [(g.x_baseline, g.group) for g in residual if g.x_baseline], 1.3))
    return out


def gemm_targets(results: dict[str, PackageResult]) -> list[Target]:
    """Issue 6: the kernel_lab rows by variant (the plain GEMM for prefill and decode, the
    quantized ones for their own targets); cuBLAS is the `torch` row."""

    def vs_torch(groups: list[GroupResult], impl: str | Callable[[GroupResult], float | None],
                 base: str = "torch") -> list[tuple[float, str]]:
        out = []
        for g in groups:
            ours = impl(g) if callable(impl) else _ms(g, impl)
            if ours and _ms(g, base):
                out.append((_ms(g, base) / ours, g.group))
        return out

    def fastest_ours(g: GroupResult) -> float:
        return min(GroupResult.ms_per_call(r) for r in _ours(g))

    prefill = _groups(results, "gemm", r"^gemm prefill ")
    decode = _groups(results, "gemm", r"^gemm decode M(1|16) ")
    decode_bf16 = [g for g in decode if g.group.endswith(" bf16")]
    decode_bw = [(g.pct_peak(_row(g, "kernel_lab")), g.group) for g in decode
                 if _row(g, "kernel_lab") and g.pct_peak(_row(g, "kernel_lab")) is not None]
    return [
        _at_least(6, "bf16/fp16 prefill: at least 0.95x cuBLAS, geomean (fastest kernel_lab variant)",
                  vs_torch(prefill, fastest_ours), 0.95, how="geomean"),
        _at_least(6, "decode M <= 16: at least 1.1x cuBLAS (bf16/fp16 GEMM)", vs_torch(decode, "kernel_lab"), 1.1),
        _at_least(6, "decode M <= 16: at least 85% of copy bandwidth (bytes as the benchmark counts them)",
                  decode_bw, 85, unit="%"),
        _at_least(6, "fp8: at least 0.9x torch._scaled_mm (fastest kernel_lab variant)",
                  vs_torch(_groups(results, "gemm", r"^gemm fp8 "), fastest_ours, base="torch._scaled_mm"), 0.9),
        _at_least(6, "weight-only int8 at M in {1, 16}: at least 1.8x cuBLAS bf16",
                  vs_torch(decode_bf16, "kernel_lab-int8"), 1.8),
        _at_least(6, "weight-only int4 at M in {1, 16}: at least 3.0x cuBLAS bf16",
                  vs_torch(decode_bf16, "kernel_lab-int4"), 3.0),
        _at_least(6, "rms_norm_linear at M <= 64: at least 1.3x the unfused pair (torch)",
                  vs_torch(_groups(results, "gemm", r"^rms_norm_linear M\d+ "), "kernel_lab"), 1.3),
    ]


def kvcache_targets(results: dict[str, PackageResult]) -> list[Target]:
    """Issue 8: eager (`decode`) and CUDA-graph (`decode-graph`) rows both; every kernel_lab
    variant (contiguous, paged16, paged64, fp8) is a row of its own against SDPA, the bandwidth
    target reads the bf16 variants (the fp8 cache reads half the bytes), the paged target each
    paged variant against the contiguous one of its group."""
    groups = _groups(results, "kvcache", r"^decode")

    def bt(g: GroupResult) -> tuple[int, int]:
        m = re.search(r"B=(\d+) T=(\d+)", g.group)
        return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

    every, best_at_4k, bandwidth, paged, fp8 = [], [], [], [], []
    for g in groups:
        sdpa = _ms(g, "sdpa")
        for r in _ours(g):
            impl, ms = r["extra_info"]["impl"], GroupResult.ms_per_call(r)
            if sdpa:
                every.append((sdpa / ms, f"{g.group}, {impl}", _noise(_row(g, "sdpa"), r)))
            b, t = bt(g)
            if "fp8" not in impl and (t >= 32768 or b >= 8) and g.pct_peak(r) is not None:
                bandwidth.append((g.pct_peak(r), f"{g.group}, {impl}"))
            if "paged" in impl and _ms(g, "kernel_lab"):
                paged.append((_ms(g, "kernel_lab") / ms, f"{g.group}, {impl}"))
        if bt(g) == (1, 4096) and sdpa:
            best_at_4k.append((sdpa / g.ours_ms, g.group))
        if bt(g) == (1, 131072) and _ms(g, "kernel_lab fp8") and _ms(g, "kernel_lab"):
            fp8.append((_ms(g, "kernel_lab") / _ms(g, "kernel_lab fp8"), g.group))
    return [
        _at_least(8, "at least 1.0x SDPA on every row (every variant)", every, 1.0),
        _at_least(8, "at least 2x SDPA at (1, 4k) (fastest variant)", best_at_4k, 2.0),
        _at_least(8, "at least 90% of copy bandwidth when T >= 32k or B >= 8 (bf16 variants)", bandwidth, 90,
                  unit="%"),
        _at_least(8, "paged at least 0.95x contiguous", paged, 0.95),
        _at_least(8, "fp8 cache at least 1.7x the bf16 cache at (1, 128k)", fp8, 1.7),
    ]


def check(results: dict[str, PackageResult]) -> list[Target]:
    return softmax_targets(results) + norms_targets(results) + gemm_targets(results) + kvcache_targets(results)


def table(results: dict[str, PackageResult]) -> list[str]:
    """Markdown lines: one row per target."""
    verdict = {True: "met", False: "**not met**", None: "no data"}
    lines = ["| issue | target | measured (from the stored rows) | |", "|---:|---|---|---|"]
    lines += [f"| #{t.issue} | {t.what} | {t.measured} | {verdict[t.met]} |" for t in check(results)]
    return lines


def main() -> None:
    for model_dir in models():
        results = collect(model_dir)
        if results:
            print(f"## {model_dir.name}\n", *table(results), "", sep="\n")


if __name__ == "__main__":
    main()
