"""A prediction's timeline as a figure (a PNG, or the format its name asks
for): for each pass, one rank's two lanes (compute above, communication
below), each op a bar from its start to its end in ms; GEMMs, attention, the
other compute and the collectives in their own colours; time the compute
lane waits on a collective shaded. matplotlib is an optional dependency:
imported here and in outputs.save_figure only."""

from __future__ import annotations

from tpfuser.outputs import save_figure

# Deferred: matplotlib (an optional dependency, pyproject's test extra), imported
# in plot_timeline when a --png is asked for: `plan --predict` runs without it.

COLOURS = {"gemm": "#76b900", "attention": "#1f77b4", "pointwise": "#b0b0b0", "collective": "#ff7f0e"}
LANES = (("compute", 1.0), ("comm", 0.0))


def plot_timeline(rep: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    passes = [k for k in ("forward", "backward") if k in rep]
    fig, axes = plt.subplots(len(passes), 1, figsize=(13, 1.9 * len(passes) + 0.8), squeeze=False)
    for ax, kind in zip(axes[:, 0], passes):
        s = rep[kind]
        wall = s["pass_ms"] or 1.0
        for lane, y in LANES:
            events = [e for e in s["events"] if e["lane"] == lane]
            ax.broken_barh([(e["start_ms"], e["end_ms"] - e["start_ms"]) for e in events], (y - 0.4, 0.8),
                           facecolors=[COLOURS[e["kind"]] for e in events], edgecolor="white", linewidth=0.5)
            for e in events:
                width = e["end_ms"] - e["start_ms"]
                if width > 0.045 * wall:   # labels where they fit
                    label = e["name"].replace("allreduce", "AR").replace("allgather", "AG").replace("reducescatter", "RS")
                    ax.text(e["start_ms"] + width / 2, y, label, ha="center", va="center", fontsize=6, clip_on=True)
        busy = sorted((e["start_ms"], e["end_ms"]) for e in s["events"] if e["lane"] == "compute")
        edges = [0.0] + [x for span in busy for x in span] + [wall]
        for a, b in zip(edges[::2], edges[1::2]):
            if b > a:
                ax.axvspan(a, b, color="#ff7f0e", alpha=0.12, lw=0)
        ax.set_yticks([y for _, y in LANES], [lane for lane, _ in LANES], fontsize=8)
        ax.set_xlim(0, wall * 1.01)
        ax.set_ylim(-0.6, 1.6)
        ax.set_xlabel("ms", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(f"{kind}: {s['pass_ms']:.3f} ms = compute {s['compute_ms']:.3f} + beside-comm slowdown "
                     f"{s['slowdown_ms']:.3f} + exposed communication {s['exposed_ms']:.3f} "
                     f"(communication {s['comm_ms']:.3f})", fontsize=8)
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()] + [
        Patch(color="#ff7f0e", alpha=0.12, label="compute waits")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    stand_in = "STAND-IN calibration, not measured" if rep["calibration"].get("stand_in") else rep["calibration"].get("gpu")
    fig.suptitle(f"{rep['preset']} tp {rep['tp']} ({rep['parallelism']}), {rep['schedule']}: one rank, predicted "
                 f"({stand_in}, {rep['interconnect']['name']})", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    save_figure(fig, path, "--png", dpi=130)   # in the format its name asks for, whole or not at all
