"""One benchmark case under Nsight Compute, then the metrics that matter (`nox -s profile`).

    python benchmarks/ncu_profile.py softmax -k "131072x1024 and kernel_lab"
    python benchmarks/ncu_profile.py gemm -k "decode and M1-" --launch-count 20
    python benchmarks/ncu_profile.py --import profiles/softmax-....ncu-rep     # print an existing report

Steps:
1. collects benchmarks/test_<package>.py with pytest's -k (default: the first case of the file
   whose id names kernel_lab) and refuses more than --max-cases cases;
2. runs them under `ncu --clock-control none --set full --profile-from-start off`, with the
   plugin benchmarks/_ncu_plugin.py opening the profiler range around ONE call of the timed
   function, after the benchmark's own warm-up (so compilation and autotuning are not profiled);
3. writes profiles/<package>-<case>.ncu-rep (git-ignored) and prints, per kernel launch, the
   key metrics read back with `ncu --import <file> --page raw --csv` (docs/profiling.md says
   how to read each one). `--details` also prints ncu's own details page.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles"
FILES = {"kvcache": "test_decode.py", "inference-kvcache": "test_decode.py", "optim-adamw": "test_adamw.py",
         "adamw": "test_adamw.py"}

# (label, candidate raw metric names in order of preference, how to show the value)
METRICS: list[tuple[str, list[str], str]] = [
    ("duration", ["gpu__time_duration.sum"], "time"),
    ("achieved occupancy", ["sm__warps_active.avg.pct_of_peak_sustained_active"], "pct"),
    ("theoretical occupancy", ["sm__maximum_warps_per_active_cycle_pct"], "pct"),
    ("DRAM throughput, % of peak", ["gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                                    "dram__throughput.avg.pct_of_peak_sustained_elapsed"], "pct"),
    ("DRAM bandwidth", ["dram__bytes.sum.per_second"], "bw"),
    ("memory throughput (SOL), %", ["gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"], "pct"),
    ("compute (SM) throughput (SOL), %", ["sm__throughput.avg.pct_of_peak_sustained_elapsed"], "pct"),
    ("L2 hit rate", ["lts__t_sector_hit_rate.pct"], "pct"),
    ("L1/TEX hit rate", ["l1tex__t_sector_hit_rate.pct"], "pct"),
    ("tensor pipe (wgmma), % of peak", ["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                                        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"], "pct"),
    ("tensor pipe (mma), % of peak", ["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                                      "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active"], "pct"),
    ("registers / thread", ["launch__registers_per_thread"], "int"),
    ("threads / block", ["launch__block_size"], "int"),
    ("grid size (blocks)", ["launch__grid_size"], "int"),
    ("static shared mem / block", ["launch__shared_mem_per_block_static"], "bytes"),
    ("dynamic shared mem / block", ["launch__shared_mem_per_block_dynamic"], "bytes"),
    ("waves / SM", ["launch__waves_per_multiprocessor"], "float"),
    ("occupancy limit: registers (blocks)", ["launch__occupancy_limit_registers"], "int"),
    ("occupancy limit: shared mem (blocks)", ["launch__occupancy_limit_shared_mem"], "int"),
    ("local (spill) loads, sectors", ["l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum",
                                      "smsp__inst_executed_op_local_ld.sum"], "int"),
    ("local (spill) stores, sectors", ["l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum",
                                       "smsp__inst_executed_op_local_st.sum"], "int"),
]
STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
STALL_ALT = re.compile(r"^smsp__average_warp_latency_issue_stalled_(\w+?)\.ratio$")


def bench_file(package: str) -> Path:
    name = FILES.get(package, f"test_{package.replace('-', '_')}.py")
    path = ROOT / "benchmarks" / name
    if not path.is_file():
        known = sorted(p.stem.removeprefix("test_") for p in (ROOT / "benchmarks").glob("test_*.py"))
        raise SystemExit(f"no benchmark file for package {package!r}; known: {', '.join(known)}")
    return path


def collect(path: Path, k: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "--import-mode=importlib", str(path)]
    if k:
        cmd += ["-k", k]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no benchmark case matches -k {k!r} in {path.name}:\n{out.stdout}{out.stderr}")
    if k is None:  # default: the first kernel_lab case
        ours = [i for i in ids if "kernel_lab" in i]
        ids = (ours or ids)[:1]
    return ids


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80]


def parse_raw_csv(text: str) -> list[dict[str, str]]:
    """ncu --page raw --csv: a header of metric names, a row of units, one row per kernel launch."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 2:
        return []
    names, units, data = rows[0], rows[1], rows[2:]
    out = []
    for r in data:
        d = dict(zip(names, r, strict=False))
        d["__units__"] = dict(zip(names, units, strict=False))  # type: ignore[assignment]
        out.append(d)
    return out


def _num(v: str) -> float | None:
    try:
        return float(v.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def show(value: float | None, unit: str, kind: str) -> str:
    if value is None:
        return "n/a (not collected by this ncu/GPU)"
    if kind == "pct":
        return f"{value:.1f} %"
    if kind == "int":
        return f"{value:.0f}"
    if kind == "float":
        return f"{value:.2f}"
    if kind == "bytes":
        return f"{value:.0f} B" if unit in ("", "byte") else f"{value:g} {unit}"
    if kind in ("time", "bw"):
        return f"{value:g} {unit}".strip()
    return f"{value:g} {unit}".strip()


def summarize(rows: list[dict[str, str]], top_stalls: int = 5) -> str:
    out = []
    for r in rows:
        units = r.get("__units__", {})
        out.append(f"== launch {r.get('ID', '?')}: {r.get('Kernel Name', '?')}  "
                   f"grid {r.get('Grid Size', '?')} block {r.get('Block Size', '?')}")
        for label, candidates, kind in METRICS:
            name = next((c for c in candidates if _num(r.get(c, "")) is not None), None)
            val = _num(r[name]) if name else None
            out.append(f"   {label:<38} {show(val, units.get(name, '') if name else '', kind)}")
        stalls = []
        for key, v in r.items():
            m = STALL.match(key) or STALL_ALT.match(key)
            if m and not key.endswith("_not_issued.ratio") and _num(v) is not None:
                stalls.append((_num(v), m.group(1)))
        stalls.sort(reverse=True)
        if stalls:
            total = sum(s for s, _ in stalls) or 1.0
            top = ", ".join(f"{name} {val:.2f} ({100 * val / total:.0f}%)" for val, name in stalls[:top_stalls])
            out.append(f"   {'top warp stalls (cycles per issue)':<38} {top}")
        else:
            out.append(f"   {'top warp stalls':<38} n/a (WarpStateStats not collected)")
    return "\n".join(out)


def print_report(ncu: str, rep: Path, details: bool) -> None:
    raw = subprocess.run([ncu, "--import", str(rep), "--page", "raw", "--csv", "--print-units", "base"],
                         capture_output=True, text=True, check=True).stdout
    rows = parse_raw_csv(raw)
    if not rows:
        raise SystemExit(f"{rep} holds no kernel launch: did the -k selection run on CUDA? (see the output above)")
    print(f"\n{len(rows)} kernel launch(es) in {rep.relative_to(ROOT) if rep.is_relative_to(ROOT) else rep}")
    print(summarize(rows))
    if details:
        subprocess.run([ncu, "--import", str(rep), "--page", "details", "--csv"], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", nargs="?", help="package (softmax, gemm, attention, kvcache, norms, mlp, adamw)")
    ap.add_argument("-k", help="pytest -k expression selecting the case (default: first kernel_lab case)")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="ncu binary")
    ap.add_argument("--set", default="full", help="ncu section set (default: full)")
    ap.add_argument("--launch-count", type=int, default=50, help="most kernel launches to profile (default 50)")
    ap.add_argument("--max-cases", type=int, default=4, help="refuse a -k matching more cases (default 4)")
    ap.add_argument("--details", action="store_true", help="also print ncu's details page (CSV)")
    ap.add_argument("--import", dest="import_", type=Path, help="only print the metrics of an existing .ncu-rep")
    args = ap.parse_args(argv)

    if args.import_:
        print_report(args.ncu, args.import_.resolve(), args.details)
        return 0
    if not args.package:
        ap.error("name a package, e.g. `nox -s profile -- softmax -k 131072x1024`")
    path = bench_file(args.package)
    ids = collect(path, args.k)
    if len(ids) > args.max_cases:
        shown = "\n  ".join(ids[:20])
        raise SystemExit(f"-k {args.k!r} selects {len(ids)} cases (more than --max-cases {args.max_cases}); "
                         f"narrow it, e.g. with 'and kernel_lab':\n  {shown}")
    PROFILES.mkdir(exist_ok=True)
    rep = PROFILES / f"{slug(args.package)}-{slug(ids[0].split('::')[-1]) if len(ids) == 1 else slug(args.k)}"
    print("profiling:\n  " + "\n  ".join(ids))
    cmd = [
        args.ncu, "--clock-control", "none", "--set", args.set, "--profile-from-start", "off",
        "--launch-count", str(args.launch_count), "--target-processes", "all", "-f", "-o", str(rep),
        sys.executable, "-m", "pytest", "-q", "--import-mode=importlib", "-p", "no:cacheprovider",
        "-p", "_ncu_plugin", "--benchmark-timer", "kernel_lab.shared.bench.cuda_timer",
        "--benchmark-disable-gc", *ids,
    ]
    print("$ " + " ".join(cmd), flush=True)
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run(cmd, cwd=ROOT, env=env)
    rep_file = rep.with_suffix(".ncu-rep")
    if not rep_file.is_file():
        print(f"ncu wrote no report (exit {res.returncode})", file=sys.stderr)
        return res.returncode or 1
    print_report(args.ncu, rep_file, args.details)
    print(f"\nOpen in the GUI: ncu-ui {rep_file}")
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
