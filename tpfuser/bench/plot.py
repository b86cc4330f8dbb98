"""PNG of benchmark reports (tpfuser.bench JSON): median time per implementation,
one panel per report, the compute floor dashed, the block's work timed alone
(gemms, gemms+attention) hatched; or, when the reports are of
several meshes, time against tp, a line per implementation, a panel per
(preset, pass)."""

from __future__ import annotations

import itertools

import json
import sys


def plot_reports(reports: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tpfuser.bench.report import WORK_ONLY

    fig, axes = plt.subplots(1, len(reports), figsize=(4.2 * len(reports), 3.4), squeeze=False)
    for ax, rep in zip(axes[0], reports):
        names = list(rep["results"])
        ms = [rep["results"][n]["median_ms"] for n in names]
        bars = ax.bar(range(len(names)), ms, color=["#76b900" if n.startswith("nvfuser") else "white" if n in WORK_ONLY
                                                    else "#8c8c8c" for n in names],
                      edgecolor="#8c8c8c", hatch=["//" if n in WORK_ONLY else "" for n in names])   # parts, not peers
        for bar, n in zip(bars, names):
            ratio = rep["results"][n].get("ratio_to_eager")
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
        ax.axhline(rep["compute_floor_ms"], ls="--", color="k", lw=1, label="compute floor")
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("median ms")
        ax.margins(y=0.12)
        ax.set_title(f"{rep['preset']} {rep['pass']}, mesh {rep['mesh']}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{reports[0].get('gpu', '')}: time per call (labels: ratio to eager)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(reports: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict = {}
    for rep in reports:
        panels.setdefault((rep["preset"], rep["pass"]), []).append(rep)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.4), squeeze=False)
    for ax, ((name, what), reps) in zip(axes[0], panels.items()):
        reps = sorted(reps, key=lambda r: int(r["mesh"].split("x")[1]))
        tps = [int(r["mesh"].split("x")[1]) for r in reps]
        others = itertools.cycle(["#1f77b4", "#ff7f0e", "#7f7f7f", "#9467bd", "#8c564b", "#17becf", "#bcbd22"])
        for impl in dict.fromkeys(i for r in reps for i in r["results"]):
            pts = [(tp, r["results"][impl]["median_ms"]) for tp, r in zip(tps, reps) if impl in r["results"]]
            ax.plot(*zip(*pts), marker="o", label=impl, color="#76b900" if impl == "nvfuser" else next(others))
        ax.plot(tps, [r["compute_floor_ms"] for r in reps], ls="--", color="k", lw=1, label="compute floor")
        ax.set_xscale("log", base=2)
        ax.set_xticks(tps, [str(t) for t in tps])
        ax.set_xlabel("tp")
        ax.set_ylabel("median ms")
        ax.set_title(f"{name} {what}, dp {reps[0]['mesh'].split('x')[0]}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{reports[0].get('gpu', '')}: time against tp", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("usage: python -m tpfuser.bench.plot OUT.png REPORT.json [REPORT.json ...]", file=sys.stderr)
        return 2
    from tpfuser.bench.report import validate_report
    reports = [validate_report(json.load(open(p))) for p in argv[1:]]
    several_meshes = len({r["mesh"] for r in reports}) > 1
    (plot_scaling if several_meshes else plot_reports)(reports, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
