"""Which benchmark rows moved by more than their noise between two stored runs (`nox -s compare`).

    python benchmarks/compare.py                                # two newest runs sharing groups
    python benchmarks/compare.py 0008 0009                      # runs by number, name or path
    python benchmarks/compare.py --model nvidia-h200 --fail-above 5

Rows are matched by their pytest id (`fullname`, a renamed benchmark file under its current
name: report.row_id). A row's noise is read from its own spread in both runs: noise % =
max(IQR / median of the old row, IQR / median of the new row) x 100 (each row's rounds are
repeated timings of the same call), never below --noise-floor (default 1%: the spread within one
run underestimates run-to-run drift such as clocks and placement). A row "moved" when |change| >
noise; a kernel_lab row "regressed" when it got slower by more than the noise AND by more than
--fail-above PCT, and then the exit status is 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report


def resolve(model_dir: Path, runs: list[report.Run], spec: str) -> report.Run:
    """A run by path, by number prefix (0009) or by name fragment (bench-kvcache)."""
    p = Path(spec)
    if p.is_file():
        return report.load_run(p.resolve())
    hits = [r for r in runs if r.path.name.startswith(spec + "_") or r.path.name == spec]
    hits = hits or [r for r in runs if spec in r.path.name]
    if len(hits) != 1:
        names = ", ".join(r.path.name for r in runs)
        raise SystemExit(f"run {spec!r} matches {len(hits)} stored runs of {model_dir.name}; stored: {names}")
    return hits[0]


def groups_of(run: report.Run) -> set[str]:
    return {b.get("group") or b["name"] for b in run.data.get("benchmarks", [])}


def default_pair(runs: list[report.Run]) -> tuple[report.Run, report.Run]:
    """The newest run and the newest older run that shares at least one group with it."""
    for i in range(len(runs) - 1, 0, -1):
        new = runs[i]
        for old in reversed(runs[:i]):
            if groups_of(old) & groups_of(new):
                return old, new
    raise SystemExit("no two stored runs share a benchmark group: nothing to compare")


def spread(row: dict) -> float:
    s = row["stats"]
    return s.get("iqr", 0.0) / s["median"] if s.get("median") else 0.0


def compare(old: report.Run, new: report.Run, floor: float = 1.0) -> list[dict]:
    old_rows = {report.row_id(b): b for b in old.data["benchmarks"]}
    out = []
    for b in new.data["benchmarks"]:
        a = old_rows.get(report.row_id(b))
        if a is None:
            continue
        m_old, m_new = a["stats"]["median"], b["stats"]["median"]
        change = 100 * (m_new - m_old) / m_old
        noise = max(100 * spread(a), 100 * spread(b), floor)
        out.append({
            "package": report.package_of(b), "group": b.get("group") or "", "name": b["name"],
            "impl": b["extra_info"].get("impl", b["name"]), "role": b["extra_info"].get("role", "?"),
            "old_ms": m_old * 1e3, "new_ms": m_new * 1e3, "change": change, "noise": noise,
            "moved": abs(change) > noise,
        })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", help="OLD NEW (number, name fragment or path); default: the two newest "
                    "runs of the model that share groups")
    ap.add_argument("--model", help="GPU model folder under benchmarks/history (default: the only one)")
    ap.add_argument("--fail-above", type=float, metavar="PCT",
                    help="exit 1 when a kernel_lab row got slower by more than PCT %% (and more than its noise)")
    ap.add_argument("--noise-floor", type=float, default=1.0, metavar="PCT",
                    help="smallest noise assumed for any row, in %% (default 1)")
    ap.add_argument("--all", action="store_true", help="list every matched row, not only those that moved")
    args = ap.parse_args(argv)

    stored = report.models()
    if args.model:
        model_dir = report.HISTORY / args.model
        if not model_dir.is_dir():
            raise SystemExit(f"no history for {args.model}; stored: {', '.join(p.name for p in stored) or 'none'}")
    elif len(stored) == 1:
        model_dir = stored[0]
    else:
        raise SystemExit(f"name the GPU model: --model <model>; stored: {', '.join(p.name for p in stored) or 'none'}")
    runs = report.load_runs(model_dir)
    if len(args.runs) == 2:
        old, new = (resolve(model_dir, runs, s) for s in args.runs)
    elif not args.runs:
        old, new = default_pair(runs)
    else:
        raise SystemExit("give two runs (OLD NEW) or none")

    rows = compare(old, new, args.noise_floor)
    print(f"{model_dir.name}: {old.label} ({old.when:%Y-%m-%d %H:%M}) -> {new.label} ({new.when:%Y-%m-%d %H:%M})")
    print(f"  old: {old.versions()}; {old.peaks()}")
    print(f"  new: {new.versions()}; {new.peaks()}")
    if not rows:
        print("no rows in common")
        return 0
    moved = [r for r in rows if r["moved"]]
    shown = rows if args.all else moved
    print(f"{len(rows)} rows in common; {len(moved)} moved beyond their noise "
          f"(noise = max of the two rows' IQR/median, at least {args.noise_floor:g}%).\n")
    if shown:
        w = max(len(r["group"]) for r in shown)
        print(f"{'group':<{w}}  {'impl':<20} {'role':<10} {'old ms':>10} {'new ms':>10} {'change':>8} "
              f"{'noise':>7}  verdict")
        for r in sorted(shown, key=lambda r: (r["package"], r["group"], r["impl"])):
            verdict = "" if not r["moved"] else ("slower" if r["change"] > 0 else "faster")
            print(f"{r['group']:<{w}}  {r['impl']:<20} {r['role']:<10} {r['old_ms']:>10.4f} {r['new_ms']:>10.4f} "
                  f"{r['change']:>+7.1f}% {r['noise']:>6.1f}%  {verdict}")
    if args.fail_above is None:
        return 0
    bad = [r for r in moved if r["role"] == "kernel_lab" and r["change"] > args.fail_above]
    if bad:
        print(f"\nFAIL: {len(bad)} kernel_lab row(s) slower by more than {args.fail_above:g}% and their noise:")
        for r in bad:
            print(f"  {r['group']} [{r['impl']}]: {r['change']:+.1f}% (noise {r['noise']:.1f}%)")
        return 1
    print(f"\nOK: no kernel_lab row slower by more than {args.fail_above:g}% beyond its noise.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
