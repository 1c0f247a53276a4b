"""Render results tables from the stored pytest-benchmark histories (never typed by hand).

    python benchmarks/report.py            # print the Markdown
    python benchmarks/report.py --write    # also rewrite README.md's results section,
                                           # docs/results/<gpu-model>.md (with the issues'
                                           # targets, benchmarks/targets.py) and the generated
                                           # tables inside docs/tradeoffs.md

Selection: per GPU model (benchmarks/history/<model>/) and per package (the benchmark file of
each row's `fullname`: benchmarks/test_softmax.py -> softmax), every benchmark group is taken
from the NEWEST run (the JSON's `datetime`) that contains it. A later `nox -s bench -- -k gemm`
thus replaces the gemm groups it re-measured and leaves every other group where it was.

One row per group: kernel_lab's fastest row, the fastest peer (a row a user would otherwise
pick: role baseline or peer, not one of our own entry points) and its time, kernel_lab's
speedup over the baseline and over the best peer, and where it sits on the roofline: % of the
run's measured copy bandwidth for memory-bound groups, % of its measured bf16 matmul rate for
compute-bound ones (a group is compute-bound when its FLOP/byte is above the ridge point
matmul rate / copy bandwidth, or when only FLOPs are recorded).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HISTORY = ROOT / "benchmarks" / "history"
README = ROOT / "README.md"
RESULTS_DIR = ROOT / "docs" / "results"
TRADEOFFS = ROOT / "docs" / "tradeoffs.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
PEER_ROLES = ("baseline", "peer")


# ---------------------------------------------------------------------------------------------
# loading


@dataclass
class Run:
    path: Path
    data: dict
    when: datetime

    @property
    def machine(self) -> dict:
        return self.data.get("machine_info", {}).get("kernel_lab", {})

    @property
    def label(self) -> str:
        return self.path.name

    def versions(self) -> str:
        m = self.machine
        return (f"{m.get('device', '?')}, driver {m.get('driver', '?')}, CUDA {m.get('cuda', '?')}, "
                f"torch {m.get('torch', '?')}, triton {m.get('triton', '?')}")

    def round_ms(self) -> float:
        """Median over rows of one timed round (calls per round x time per call), in ms."""
        rounds = sorted(b["stats"]["iterations"] * b["stats"]["median"] * 1e3 for b in self.data["benchmarks"])
        return rounds[len(rounds) // 2] if rounds else float("nan")

    def peaks(self) -> str:
        m = self.machine
        return (f"measured copy {_fmt(m.get('copy_bandwidth_gbps'), '.0f')} GB/s, "
                f"bf16 matmul {_fmt(m.get('bf16_matmul_tflops'), '.0f')} TFLOP/s")


def load_run(path: Path) -> Run:
    data = json.loads(path.read_text())
    when = datetime.fromisoformat(data["datetime"].replace("Z", "+00:00"))
    return Run(path, data, when)


def load_runs(model_dir: Path) -> list[Run]:
    """Every stored run of one GPU model, oldest first (by the JSON's datetime)."""
    return sorted((load_run(f) for f in model_dir.glob("*/*.json")), key=lambda r: r.when)


def models() -> list[Path]:
    return sorted(p for p in HISTORY.iterdir() if p.is_dir()) if HISTORY.is_dir() else []


# Benchmark files named after what they time, not after their package, and files renamed since
# older histories were stored: the package each reports under. benchmarks/test_decode.py (the name
# its issue gives it) was benchmarks/test_kvcache.py in the histories stored before 2026-11-27.
FILE_PACKAGE = {"decode": "kvcache"}
RENAMED_FILES = {"benchmarks/test_kvcache.py": "benchmarks/test_decode.py"}


def package_of(bench_row: dict) -> str:
    """benchmarks/test_softmax.py::test_x[...] -> softmax (FILE_PACKAGE for the exceptions)."""
    stem = Path(bench_row.get("fullname", "").split("::")[0]).stem.removeprefix("test_")
    return FILE_PACKAGE.get(stem, stem) or "?"


def row_id(bench_row: dict) -> str:
    """A row's identity across stored runs: its pytest id (`fullname`), with a renamed benchmark
    file (RENAMED_FILES) under its current name."""
    path, sep, rest = bench_row["fullname"].partition("::")
    return RENAMED_FILES.get(path, path) + sep + rest


# ---------------------------------------------------------------------------------------------
# selection and per-group summary


@dataclass
class GroupResult:
    package: str
    group: str
    run: Run
    rows: list[dict]
    ours: dict
    best_peer: dict | None
    baseline: dict | None

    @staticmethod
    def median(row: dict) -> float:
        return row["stats"]["median"]

    @staticmethod
    def ms_per_call(row: dict) -> float:
        """Median ms of one call: a row replaying a CUDA graph of several calls per timed call
        says how many in extra_info["calls_per_round"]."""
        return row["stats"]["median"] * 1e3 / row["extra_info"].get("calls_per_round", 1)

    @property
    def ours_ms(self) -> float:
        return self.ms_per_call(self.ours)

    @property
    def ours_impl(self) -> str:
        return self.ours["extra_info"].get("impl", self.ours["name"])

    @property
    def peer_impl(self) -> str | None:
        return self.best_peer["extra_info"].get("impl", self.best_peer["name"]) if self.best_peer else None

    @property
    def peer_ms(self) -> float | None:
        return self.ms_per_call(self.best_peer) if self.best_peer else None

    @property
    def x_baseline(self) -> float | None:
        return self.ms_per_call(self.baseline) / self.ours_ms if self.baseline else None

    @property
    def x_peer(self) -> float | None:
        return self.peer_ms / self.ours_ms if self.best_peer else None

    @property
    def bound(self) -> str | None:
        """"compute" or "memory" (roofline side of the group), None without a byte/FLOP model."""
        info = self.ours["extra_info"]
        flops, nbytes = info.get("flops"), info.get("bytes")
        if flops and nbytes:
            m = self.run.machine
            bw, mm = m.get("copy_bandwidth_gbps"), m.get("bf16_matmul_tflops")
            ridge = (mm * 1e12) / (bw * 1e9) if bw and mm else 100.0
            return "compute" if flops / nbytes > ridge else "memory"
        if flops:
            return "compute"
        if nbytes:
            return "memory"
        return None

    def pct_peak(self, row: dict | None = None) -> float | None:
        """% of the run's measured copy bandwidth (memory-bound) or matmul rate (compute-bound)."""
        row = row or self.ours
        info, m = row["extra_info"], self.run.machine
        if self.bound == "compute" and info.get("tflops") is not None:
            peak = m.get("bf16_matmul_tflops")
            return 100 * info["tflops"] / peak if peak else info.get("pct_peak_flops")
        if self.bound == "memory" and info.get("gbps") is not None:
            peak = m.get("copy_bandwidth_gbps")
            return 100 * info["gbps"] / peak if peak else info.get("pct_peak_bw")
        return None

    def rate(self, row: dict | None = None) -> str:
        info = (row or self.ours)["extra_info"]
        if self.bound == "compute" and info.get("tflops") is not None:
            return f"{info['tflops']:.0f} TFLOP/s"
        if self.bound == "memory" and info.get("gbps") is not None:
            return f"{info['gbps']:.0f} GB/s"
        return "-"


@dataclass
class PackageResult:
    model: str
    package: str
    groups: list[GroupResult] = field(default_factory=list)

    @property
    def runs(self) -> list[Run]:
        seen: dict[Path, Run] = {}
        for g in self.groups:
            seen.setdefault(g.run.path, g.run)
        return sorted(seen.values(), key=lambda r: r.when)

    def geomean(self, attr: str) -> float | None:
        vals = [getattr(g, attr) for g in self.groups]
        vals = [v for v in vals if v]
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None

    @property
    def worst(self) -> GroupResult | None:
        rated = [g for g in self.groups if g.x_peer]
        return min(rated, key=lambda g: g.x_peer) if rated else None


def _is_our_entry_point(row: dict) -> bool:
    # e.g. softmax's "kernel_lab custom op" row is stored as a peer (to time the torch.library
    # dispatch), but it is our own kernel: never "the best peer" a user would otherwise pick.
    return str(row["extra_info"].get("impl", "")).startswith("kernel_lab")


def summarize_group(package: str, group: str, run: Run, rows: list[dict]) -> GroupResult | None:
    ours = [r for r in rows if r["extra_info"].get("role") == "kernel_lab"]
    if not ours:
        return None
    peers = [r for r in rows if r["extra_info"].get("role") in PEER_ROLES and not _is_our_entry_point(r)]
    base = [r for r in rows if r["extra_info"].get("role") == "baseline"]
    return GroupResult(
        package=package, group=group, run=run, rows=rows,
        ours=min(ours, key=GroupResult.ms_per_call),
        best_peer=min(peers, key=GroupResult.ms_per_call) if peers else None,
        baseline=base[0] if base else None,
    )


def select_latest(runs: list[Run]) -> dict[str, dict[str, tuple[Run, list[dict]]]]:
    """package -> group -> (newest run holding that group, its rows in that run)."""
    chosen: dict[str, dict[str, tuple[Run, list[dict]]]] = {}
    for run in sorted(runs, key=lambda r: r.when):  # later runs overwrite earlier ones
        per_run: dict[tuple[str, str], list[dict]] = {}
        for b in run.data.get("benchmarks", []):
            per_run.setdefault((package_of(b), b.get("group") or b["name"]), []).append(b)
        for (pkg, group), rows in per_run.items():
            chosen.setdefault(pkg, {})[group] = (run, rows)
    return chosen


def collect(model_dir: Path) -> dict[str, PackageResult]:
    """package -> its results on one GPU model (groups in the order the benchmark file runs them)."""
    out: dict[str, PackageResult] = {}
    for pkg, groups in sorted(select_latest(load_runs(model_dir)).items()):
        res = PackageResult(model_dir.name, pkg)
        for group, (run, rows) in groups.items():
            g = summarize_group(pkg, group, run, rows)
            if g is not None:
                res.groups.append(g)
        if res.groups:
            out[pkg] = res
    return out


# ---------------------------------------------------------------------------------------------
# Markdown


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4f}" if v < 1 else f"{v:.3f}"


TABLE_HEAD = [
    "| case | kernel_lab | ms | best peer | ms | x baseline | x best peer | bound | % of measured peak |",
    "|---|---|---:|---|---:|---:|---:|---|---:|",
]


def group_line(g: GroupResult) -> str:
    pct = g.pct_peak()
    peak = "-" if pct is None else f"{pct:.0f}% {'BW' if g.bound == 'memory' else 'MM'} ({g.rate()})"
    return (f"| {g.group} | {g.ours_impl} | {_ms(g.ours_ms)} | {g.peer_impl or '-'} | {_ms(g.peer_ms)} | "
            f"{_fmt(g.x_baseline, '.2f')} | {_fmt(g.x_peer, '.2f')} | {g.bound or '-'} | {peak} |")


def table(groups: list[GroupResult]) -> list[str]:
    return [*TABLE_HEAD, *(group_line(g) for g in groups)]


VARIANTS_HEAD = [
    "| case | kernel_lab variant | ms | x baseline | % of measured peak |",
    "|---|---|---:|---:|---:|",
]


def variants_table(groups: list[GroupResult]) -> list[str]:
    """Every kernel_lab row of the groups that hold more than one (e.g. bf16 / paged / fp8 caches,
    bf16 / int8 / int4 weights): the main table shows only the fastest, which can hide how the
    others compare with the baseline."""
    lines = []
    for g in groups:
        ours = [r for r in g.rows if r["extra_info"].get("role") == "kernel_lab"]
        if len(ours) < 2:
            continue
        base = g.ms_per_call(g.baseline) if g.baseline else None
        for r in sorted(ours, key=lambda r: str(r["extra_info"].get("impl", r["name"]))):
            ms, pct = g.ms_per_call(r), g.pct_peak(r)
            peak = "-" if pct is None else f"{pct:.0f}% {'BW' if g.bound == 'memory' else 'MM'} ({g.rate(r)})"
            lines.append(f"| {g.group} | {r['extra_info'].get('impl', r['name'])} | {_ms(ms)} | "
                         f"{_fmt(base / ms if base else None, '.2f')} | {peak} |")
    return [*VARIANTS_HEAD, *lines] if lines else []


def summary_line(res: PackageResult) -> str:
    w = res.worst
    worst = f"worst: {w.group} at {w.x_peer:.2f}x the best peer ({w.peer_impl})" if w else "no peer rows"
    return (f"{len(res.groups)} cases; geomean {_fmt(res.geomean('x_baseline'), '.2f')}x the baseline, "
            f"{_fmt(res.geomean('x_peer'), '.2f')}x the best peer; {worst}.")


def provenance(res: PackageResult) -> list[str]:
    lines = []
    for run in res.runs:
        rel = run.path.relative_to(ROOT) if run.path.is_relative_to(ROOT) else run.path
        n = sum(1 for g in res.groups if g.run is run)
        lines.append(f"- `{rel}` ({run.when:%Y-%m-%d %H:%M} UTC, {n} cases): {run.versions()}; {run.peaks()}; "
                     f"rounds of {run.round_ms():.0f} ms")
    return lines


def package_section(res: PackageResult, level: str = "####", img_prefix: str | None = None) -> list[str]:
    lines = [f"{level} {res.package}", "", summary_line(res), "", "From:", *provenance(res), ""]
    if img_prefix is not None:
        for kind, alt in (("speedup", "speedup vs peers"), ("roofline", "% of measured peak")):
            img = ROOT / "docs" / "img" / f"{res.model}-{res.package}-{kind}.png"
            if img.is_file():
                lines.append(f"![{res.package}: {alt}]({img_prefix}{img.name})")
        if lines[-1] != "":
            lines.append("")
    lines += [*table(res.groups), ""]
    variants = variants_table(res.groups) if img_prefix is not None else []  # the results pages only
    if variants:
        lines += ["Every kernel_lab variant of the cases above that have several:", "", *variants, ""]
    return lines


LEGEND = (
    "x baseline / x best peer: the other row's median time over kernel_lab's (above 1: we are "
    "faster). Best peer: fastest of the baseline and the peers in the same run. bound: the "
    "roofline side of the case (FLOP/byte above or below the run's measured matmul rate / copy "
    "bandwidth); % of measured peak: achieved GB/s over the measured copy bandwidth (BW) or "
    "TFLOP/s over the measured bf16 matmul rate (MM) of that run (fp8 rows too, so they can pass "
    "100%). ms: per call (rows timed as replays of a CUDA graph of several calls, e.g. decode, "
    "divide by the calls in it). Rounds: the median length of one timed round of back-to-back calls; a round starts on "
    "an idle GPU, so with rounds of about 2 ms (runs before kernel-lab-shared 0.1.1) the host work "
    "of each round's first call reads as slower kernels on ops with much host work per call."
)


def render_model(model: str, results: dict[str, PackageResult], img_prefix: str | None = None,
                 level: str = "####") -> str:
    lines = [f"{level[:-1]} {model}", "", LEGEND, ""]
    for res in results.values():
        lines += package_section(res, level=level, img_prefix=img_prefix)
    return "\n".join(lines)


def render() -> dict[str, str]:
    """GPU model -> Markdown section for README (no images)."""
    return {m.name: render_model(m.name, collect(m)) for m in models() if collect(m)}


# ---------------------------------------------------------------------------------------------
# generated excerpts for docs/tradeoffs.md: <!-- report:NAME:start --> ... <!-- report:NAME:end -->

EXCERPTS: dict[str, tuple[str, str, str]] = {
    # name: (package, regex on the group, what it shows)
    "gemm-prefill": ("gemm", r"^gemm (prefill|fp8 tensor-scaled M8192)", "large-M GEMMs (prefill)"),
    "gemm-decode": ("gemm", r"^gemm (decode|fp8 .* M16 )", "small-M GEMMs (decode), split-K"),
    "gemm-fused": ("gemm", r"^(gemm\+bias|rms_norm_linear)", "fused epilogue / prologue GEMMs"),
    "attention-prefill": ("attention", r"^attn-", "prefill attention, forward and backward"),
    "decode-attention": ("kvcache", r"^decode", "decode attention over the KV cache (split-K)"),
    "fusion-memory": ("mlp", r".", "fused element-wise / norm kernels (memory-bound)"),
    "norms": ("norms", r".", "norms"),
    "softmax": ("softmax", r".", "softmax"),
    "adamw": ("adamw", r".", "optimizer step"),
}


def excerpt(name: str, model_results: dict[str, dict[str, PackageResult]]) -> str:
    pkg, pattern, _ = EXCERPTS[name]
    parts = []
    for model, results in model_results.items():
        res = results.get(pkg)
        if res is None:
            continue
        groups = [g for g in res.groups if re.search(pattern, g.group)]
        if not groups:
            continue
        runs = sorted({g.run.path.name: g.run for g in groups}.values(), key=lambda r: r.when)
        src = "; ".join(f"`{r.label}`: {r.versions()}, {r.peaks()}" for r in runs)
        parts += [f"*{model}* — {src}", "", *table(groups), ""]
    if not parts:
        return "_No stored history for this yet._\n"
    return "\n".join(parts)


def fill_markers(text: str, model_results: dict[str, dict[str, PackageResult]]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in EXCERPTS:
            raise SystemExit(f"docs marker report:{name} names no excerpt; known: {', '.join(EXCERPTS)}")
        return (f"<!-- report:{name}:start -->\n<!-- generated by benchmarks/report.py --write; do not edit -->\n\n"
                f"{excerpt(name, model_results)}\n<!-- report:{name}:end -->")

    return re.sub(r"<!-- report:([\w-]+):start -->.*?<!-- report:\1:end -->", sub, text, flags=re.S)


# ---------------------------------------------------------------------------------------------


def write_all() -> None:
    all_results = {m.name: collect(m) for m in models()}
    all_results = {k: v for k, v in all_results.items() if v}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    import targets  # (imports this module: not at the top)

    for model, results in all_results.items():
        header = (f"# Results on {model}\n\nGenerated by `python benchmarks/report.py --write` (run by "
                  "`nox -s docs`) from benchmarks/history; do not edit. Charts: `nox -s docs`.\n\n")
        goals = ["## The issues' targets", "", targets.EXPLAINER, "",
                 *targets.table(results), ""]
        body = render_model(model, results, img_prefix="../img/", level="##")
        (RESULTS_DIR / f"{model}.md").write_text(
            header + "\n".join(goals) + "\n" + body.split("\n", 1)[1].lstrip("\n") + "\n")
    body = "\n".join(render_model(m, r) for m, r in all_results.items()) or "No GPU benchmark history stored yet.\n"
    links = ", ".join(f"[{m}](docs/results/{m}.md)" for m in all_results)
    readme = README.read_text()
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} section to fill")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    note = "<!-- generated by `python benchmarks/report.py --write` from benchmarks/history; do not edit -->"
    charts = f"Per-package charts and tables, and where each issue's targets stand: {links}.\n\n" if links else ""
    README.write_text(f"{head}{START}\n{note}\n\n{charts}{body}\n{END}{tail}")
    if TRADEOFFS.is_file():
        TRADEOFFS.write_text(fill_markers(TRADEOFFS.read_text(), all_results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite README.md's results section, docs/results/ and docs/tradeoffs.md's tables")
    args = parser.parse_args()
    sections = render()
    print("\n".join(sections.values()) if sections else "No GPU benchmark history stored yet.")
    if args.write:
        write_all()


if __name__ == "__main__":
    main()
