"""PNG of benchmark reports (tpfuser.bench JSON): median time per implementation,
one panel per report, the compute floor dashed."""

from __future__ import annotations

import json
import sys


def plot_reports(reports: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(4.2 * len(reports), 3.4), squeeze=False)
    for ax, rep in zip(axes[0], reports):
        names = list(rep["results"])
        ms = [rep["results"][n]["median_ms"] for n in names]
        bars = ax.bar(range(len(names)), ms, color=["#76b900" if n.startswith("nvfuser") else "#8c8c8c" for n in names])
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("usage: python -m tpfuser.plot OUT.png REPORT.json [REPORT.json ...]", file=sys.stderr)
        return 2
    from tpfuser.bench import validate_report
    reports = [validate_report(json.load(open(p))) for p in argv[1:]]
    plot_reports(reports, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
