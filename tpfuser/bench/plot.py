"""PNG of benchmark reports (tpfuser.bench JSON): median time per implementation,
one panel per report, the compute floor dashed, the block's work timed alone
(gemms, gemms+attention) hatched; or, when the reports are of
several meshes, time against tp, a line per implementation, a panel per
(preset, pass).

    python -m tpfuser.bench.plot OUT.png REPORT.json [REPORT.json ...]   (REPORT "-": standard input)

Its refusals are the command line's: one line naming the thing, exit status 2,
before anything is read or written (the output path is checked first); a
figure is written whole or not at all (outputs.replacing). OUT "-" is refused:
a PNG is no text for a terminal.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import stat
import sys

from tpfuser.outputs import ArgParser, Signalled, check_writable, save_figure
from tpfuser.strict_json import MAX_BYTES, Refused, strict_loads

MESH = re.compile(r"^[1-9][0-9]*x[1-9][0-9]*$")


def plot_reports(reports: list[dict], path: str, option: str = "--png") -> None:
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
    save_figure(fig, path, option)


def plot_scaling(reports: list[dict], path: str, option: str = "--png") -> None:
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
    save_figure(fig, path, option)


def _cut_short(text: str) -> str | None:
    """Whether JSON text stops before its end (a file cut short: a copy or a
    write interrupted): "string" inside a string, "bracket" with an object or
    list still open, else None."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
    return "string" if in_string else "bracket" if depth > 0 else None


def read_report(path: str) -> dict:
    """One bench report, refused in one line naming the file for every way it can
    be wrong: missing, not a regular file (never opened: a named pipe would
    block), unreadable, not UTF-8, not JSON or cut short, JSON of another kind
    (validate_report names the field)."""
    from tpfuser.bench.report import validate_report
    where = "REPORT='-' (standard input)" if path == "-" else f"REPORT={path!r}"
    if path == "-":
        try:
            text = sys.stdin.buffer.read(MAX_BYTES + 1)
        except (OSError, AttributeError, ValueError) as e:
            raise ValueError(f"{where}: standard input could not be read ({e})") from None
    else:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            raise ValueError(f"{where}: no such file" + (" (a symbolic link to a file that does not exist)"
                                                         if os.path.islink(path) else "")) from None
        except OSError as e:
            raise ValueError(f"{where}: cannot be looked at ({e.strerror or e})") from None
        if stat.S_ISDIR(info.st_mode):
            raise ValueError(f"{where}: is a directory; expected a bench report (tpfuser bench --json)")
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where}: not a regular file (a pipe, socket or device); give a report's file "
                             f"(or - for standard input)")
        if info.st_size > MAX_BYTES:   # (refused unread)
            raise ValueError(f"{where}: {info.st_size} bytes; expected at most {MAX_BYTES} (a bench report)")
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"{where}: cannot be read ({e.strerror or e})") from None
    if len(text) > MAX_BYTES:
        raise ValueError(f"{where}: more than {MAX_BYTES} bytes; expected at most that (a bench report)")
    if not text.strip():
        raise ValueError(f"{where}: empty; expected a bench report's JSON (tpfuser bench --json)")
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not text (byte {e.start} is not UTF-8); expected a bench report's JSON") from None
    try:
        rep = strict_loads(decoded)
    except Refused as e:
        raise ValueError(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        if _cut_short(decoded):
            raise ValueError(f"{where}: cut short (its JSON ends inside an unclosed "
                             f"{'string' if _cut_short(decoded) == 'string' else 'object or list'}, after "
                             f"{len(text)} bytes); expected a whole bench report (tpfuser bench --json)") from None
        raise ValueError(f"{where}: not JSON ({e.msg}: line {e.lineno} column {e.colno}); "
                         f"expected a bench report (tpfuser bench --json)") from None
    if not isinstance(rep, dict):
        raise ValueError(f"{where}: JSON of another kind (a {type(rep).__name__}); expected a bench report, "
                         f"an object (tpfuser bench --json)")
    if "collectives" in rep and "results" not in rep:
        raise ValueError(f"{where}: a plan (tpfuser plan --json), not a bench report (tpfuser bench --json)")
    if "rows" in rep and "results" not in rep:
        raise ValueError(f"{where}: a start-up report (tpfuser bench --startup), which is not plotted; "
                         f"expected a bench report (tpfuser bench --json)")
    try:
        validate_report(rep)
        if not MESH.match(rep["mesh"]):
            raise ValueError(f"report.mesh: expected DPxTP (e.g. '1x8'), got {rep['mesh']!r}")
        if not rep["compute_floor_ms"] > 0:   # (what is drawn: a time, a ratio of times, is positive)
            raise ValueError(f"report.compute_floor_ms: expected a positive time in ms, got {rep['compute_floor_ms']!r}")
        for name, row in rep["results"].items():
            ratio = row.get("ratio_to_eager")
            if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))):
                raise ValueError(f"report.results[{name!r}].ratio_to_eager: expected float, got {type(ratio).__name__}")
            for key in ("min_ms", "median_ms", "max_ms", "ratio_to_eager"):
                if row.get(key) is not None and not row[key] > 0:
                    raise ValueError(f"report.results[{name!r}].{key}: expected a positive "
                                     f"{'ratio' if key.startswith('ratio') else 'time in ms'}, got {row[key]!r}")
        if "gpu" in rep and not isinstance(rep["gpu"], str):
            raise ValueError(f"report.gpu: expected str, got {type(rep['gpu']).__name__}")
    except (ValueError, TypeError, AttributeError, KeyError) as e:   # (the last: a shape no check foresaw)
        raise ValueError(f"{where}: not a bench report: {e}") from None
    return rep


def _parser() -> ArgParser:
    p = ArgParser(prog="python -m tpfuser.bench.plot",
                  description="Plot bench reports (tpfuser bench --json): a panel per report, or time against tp "
                              "when the reports are of several meshes.")
    p.add_argument("out", metavar="OUT.png", help="the figure (its suffix picks the format: .png, .pdf, .svg, ...)")
    p.add_argument("reports", metavar="REPORT.json", nargs="+", help="bench reports (- for standard input, once)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    try:
        if args.reports.count("-") > 1:
            raise ValueError("REPORT='-': standard input given more than once; it holds one report")
        check_writable(args.out, "OUT", stdout=False, kind="figure")   # before anything is read: the user's first mistake
        reports = [read_report(p) for p in args.reports]
        several_meshes = len({r["mesh"] for r in reports}) > 1
        (plot_scaling if several_meshes else plot_reports)(reports, args.out, "OUT")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (SIGINT): nothing was written", file=sys.stderr)
        return 128 + signal.SIGINT
    except Signalled as e:
        print(e.line, file=sys.stderr)
        return 128 + e.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
