"""Charts from the stored pytest-benchmark histories, per GPU model and package (`nox -s docs`).

    python benchmarks/plots.py     # docs/img/<model>-<package>-{speedup,roofline}.png

Uses the same selection as benchmarks/report.py (each group from the newest run holding it):
- speedup: kernel_lab's speedup over the baseline and over the best peer, per case (log scale);
- roofline: kernel_lab and the best peer as % of the run's measured copy bandwidth
  (memory-bound cases) or measured bf16 matmul rate (compute-bound cases).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report

IMG = report.ROOT / "docs" / "img"
BAR = 0.38


def _subtitle(res: report.PackageResult) -> str:
    runs = res.runs
    versions = sorted({r.versions() for r in runs})
    peaks = "; ".join(f"{r.label}: {r.peaks()}" for r in runs)
    return f"{'; '.join(versions)}\n{peaks}"


def _figure(n: int, title: str, res: report.PackageResult, extra: float = 0.0):
    """A figure for n bars pairs (extra: inches added at the bottom, e.g. for a legend)."""
    height = 2.0 + 0.42 * n + extra
    fig, ax = plt.subplots(figsize=(11, height))
    fig.suptitle(title, fontsize=12, fontweight="bold", x=0.01, y=1 - 0.12 / height, ha="left", va="top")
    ax.set_title(_subtitle(res), fontsize=8, loc="left", color="0.3")
    fig._kl_top = 1 - 0.28 / height  # room for the suptitle, kept by tight_layout
    return fig, ax


def _finish(fig, ax, groups, path: Path) -> None:
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels([g.group for g in groups], fontsize=8)
    ax.invert_yaxis()
    ax.grid(axis="x", color="0.88")
    ax.set_axisbelow(True)
    fig.tight_layout(rect=(0, 0, 1, getattr(fig, "_kl_top", 1)))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_chart(res: report.PackageResult, path: Path) -> None:
    groups = res.groups
    fig, ax = _figure(len(groups), f"{res.package}: kernel_lab speedup per case ({res.model})", res)
    ys = range(len(groups))
    for offset, attr, label, color in ((-BAR / 2, "x_baseline", "x baseline", "#8fb3d9"),
                                       (BAR / 2, "x_peer", "x best peer", "#1f5f99")):
        vals = [getattr(g, attr) or float("nan") for g in groups]
        ax.barh([y + offset for y in ys], vals, height=BAR, label=label, color=color)
        for y, v in zip(ys, vals, strict=True):
            if v == v:  # not NaN
                ax.text(v, y + offset, f" {v:.2f}", va="center", fontsize=6.5)
    ax.axvline(1.0, color="#c0392b", lw=1.2, ls="--", label="parity (1x)")
    ax.set_xscale("log")
    ticks = FuncFormatter(lambda v, _: f"{v:g}x")
    ax.xaxis.set_major_formatter(ticks)
    ax.xaxis.set_minor_formatter(ticks)
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("speedup = other implementation's median time / kernel_lab's (log scale; > 1: kernel_lab faster)")
    lo = min([v for g in groups for v in (g.x_baseline, g.x_peer) if v] + [1.0])
    hi = max([v for g in groups for v in (g.x_baseline, g.x_peer) if v] + [1.0])
    ax.set_xlim(lo / 1.6, hi * 1.9)
    peers = sorted({g.peer_impl for g in groups if g.peer_impl})
    ax.legend(loc="best", fontsize=8, title=f"best peer among: {', '.join(peers)}", title_fontsize=7)
    _finish(fig, ax, groups, path)


def roofline_chart(res: report.PackageResult, path: Path) -> None:
    groups = [g for g in res.groups if g.bound]
    if not groups:
        return
    fig, ax = _figure(len(groups), f"{res.package}: % of measured peak per case ({res.model})", res, extra=0.5)
    ax_inches = 0.42 * len(groups) + 0.6  # about the axes' height: places the legend below it
    colors = {"memory": ("#2e8b57", "#a8d5ba"), "compute": ("#b9770e", "#f5cba7")}
    for i, g in enumerate(groups):
        dark, light = colors[g.bound]
        ours = g.pct_peak()
        peer = g.pct_peak(g.best_peer) if g.best_peer else None
        if ours is not None:
            ax.barh(i - BAR / 2, ours, height=BAR, color=dark)
            ax.text(ours, i - BAR / 2, f" {ours:.0f}% {g.ours_impl}", va="center", fontsize=6.5)
        if peer is not None:
            ax.barh(i + BAR / 2, peer, height=BAR, color=light)
            ax.text(peer, i + BAR / 2, f" {peer:.0f}% {g.peer_impl}", va="center", fontsize=6.5, color="0.35")
    ax.axvline(100, color="0.3", lw=1, ls=":")
    xmax = max([g.pct_peak() or 0 for g in groups] + [g.pct_peak(g.best_peer) or 0 for g in groups if g.best_peer])
    ax.set_xlim(0, max(165, xmax * 1.45))
    ax.set_xlabel("% of the run's measured peak: copy bandwidth (memory-bound) or bf16 matmul rate (compute-bound)")
    ax.legend(handles=[
        Patch(color=colors["memory"][0], label="kernel_lab, memory-bound: % of measured copy bandwidth"),
        Patch(color=colors["memory"][1], label="best peer, memory-bound"),
        Patch(color=colors["compute"][0], label="kernel_lab, compute-bound: % of measured bf16 matmul rate"),
        Patch(color=colors["compute"][1], label="best peer, compute-bound"),
    ], loc="upper left", bbox_to_anchor=(0.0, -0.75 / ax_inches), ncol=2, fontsize=7)  # under the x label
    _finish(fig, ax, groups, path)


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    written = []
    for model_dir in report.models():
        for pkg, res in report.collect(model_dir).items():
            for kind, fn in (("speedup", speedup_chart), ("roofline", roofline_chart)):
                path = IMG / f"{model_dir.name}-{pkg}-{kind}.png"
                fn(res, path)
                if path.is_file():
                    written.append(path)
    for p in written:
        print(p.relative_to(report.ROOT))
    if not written:
        print("No GPU benchmark history stored yet: no charts.")


if __name__ == "__main__":
    main()
