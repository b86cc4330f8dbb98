"""`tpfuser plan --predict`: the timeline model's command-line face.

Prints, for the schedule given, one rank's forward and backward per piece and
in total (compute, its slowdown beside collectives, communication, exposed
communication, the pass), the goal and what stands in its way, the anchors
beside it, the calibration's own check, and that the communication is not
checked; returns it all as a dict (`plan --json` keeps it under
"prediction"). --compare adds every named schedule; --png the timeline.
"""

from __future__ import annotations

import argparse
import os

from tpfuser.parallel.schedules import SCHEDULES
from tpfuser.predict import comm
from tpfuser.predict.calibration import CalibrationError, check_sums, default_path, read_calibration
from tpfuser.predict.plot import plot_timeline
from tpfuser.predict.timeline import COMM, COMM_SLOWDOWN_BESIDE_COMPUTE, SLOWDOWN_BESIDE_COMM, predict

# The goal of issue 32: one gpt3 layer at tp 8, per rank, ms.
GOALS = {("gpt3", 8): {"forward": 1.9, "backward": 4.0}}
# One GPT-3 layer (12288 wide, 96 heads, 2048 tokens, bf16) on 8xH100, ms (issue 32's anchors).
ANCHORS = {("gpt3", 8): [
    ("TransformerEngine, TP+SP, overlapped", 2.26, 4.42, "github.com/NVIDIA/Fuser/pull/3546, /pull/3591"),
    ("TransformerEngine, TP", 2.39, 4.46, "github.com/NVIDIA/Fuser/pull/3546"),
    ("TransformerEngine, TP+SP, no overlap", 2.5, 4.58, "github.com/NVIDIA/Fuser/pull/5560, /pull/5667"),
    ("nvFuser, TP+SP", 2.1, 5.27, "github.com/NVIDIA/Fuser/pull/5560, /pull/5667"),
    ("nvFuser, TP (backward)", None, 4.37, "github.com/NVIDIA/Fuser/pull/4873"),
]}
PASSES = ("forward", "backward")


class _AndPredict(argparse.Action):
    """An option that also turns --predict on."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.nargs == 0:
            values = True
        elif isinstance(getattr(namespace, self.dest, None), list) or self.default == []:
            values = (getattr(namespace, self.dest, None) or []) + [values]
        setattr(namespace, self.dest, values)
        namespace.predict = True



def _clock(c: dict) -> str:
    """The SM clock the calibration read: after its timing where it has it (before, the GPU may idle)."""
    if c.get("sm_clock_mhz_after"):
        peak = f" of {c['max_sm_clock_mhz']:g}" if c.get("max_sm_clock_mhz") else ""
        return f"SM clock {c['sm_clock_mhz_after']:g}{peak} MHz after its timing"
    return f"SM clock {c['sm_clock_mhz']:g} MHz before its timing" if c.get("sm_clock_mhz") else "SM clock unknown"

def add_predict_arguments(p) -> None:
    p.add_argument("--predict", action="store_true",
                   help="also predict one rank's forward and backward on a timeline (compute and communication)")
    p.add_argument("--calibration", default=None, metavar="FILE", action=_AndPredict,
                   help="the pieces' times (default: the first of results/calibration/h200.json, h100.json "
                        "that holds the preset)")
    p.add_argument("--interconnect", default="h200-nvlink", choices=sorted(comm.INTERCONNECTS), action=_AndPredict,
                   help="the bus bandwidth tables the collectives are timed from (default h200-nvlink)")
    p.add_argument("--comm-table", default=[], metavar="[KIND=]FILE", action=_AndPredict,
                   help="nccl-tests output (or JSON) replacing the interconnect's table for its collective; repeatable")
    p.add_argument("--png", default=None, metavar="FILE", action=_AndPredict,
                   help="draw the timeline (both lanes, both passes) here")
    p.add_argument("--compare", nargs=0, default=False, action=_AndPredict,
                   help="also every named schedule's forward and backward at this preset and mesh, the fastest marked")


def predict_files(args) -> dict:
    """The files --predict reads, by option (an output must not be one of them)."""
    if not getattr(args, "predict", False):
        return {}
    return {"--calibration": args.calibration or default_path(getattr(args, "preset", None)),
            "--comm-table": [comm.comm_table_spec(spec)[1] for spec in args.comm_table or ()]}


def check_predict_arguments(cfg, layout, schedule, args) -> None:
    """What --predict can refuse before any work (the calibration, the tables,
    the options, a chunk count the calibration did not time): the prediction
    itself is made once here, a blink."""
    cal, net = _inputs(cfg, layout, args)
    try:
        _one(cfg, layout, schedule, cal, net, args.preset)
    except CalibrationError as e:
        if getattr(args, "chunks", None) is not None and "was timed at chunks" in str(e):
            raise CalibrationError(f"--chunks={args.chunks}: {e}") from None
        raise


def _inputs(cfg, layout, args):
    if layout.dp != 1:
        raise ValueError(f"--predict: dp={layout.dp}: the model is one rank of a tp team (dp 1)")
    if getattr(args, "tflops", None) is not None and getattr(args, "overlap", None) is None:
        raise ValueError(f"--tflops={args.tflops}: --predict takes the GEMMs' times from the calibration, not a "
                         f"rate (--tflops is for --overlap)")
    path = args.calibration or default_path(getattr(args, "preset", None))
    if args.calibration is None and not os.path.isfile(path):
        raise ValueError(f"--predict: the committed calibration {os.path.relpath(path)} is missing: make it on "
                         f"the GPU with tools/calibrate.py (or pass --calibration FILE)")
    cal = read_calibration(path)
    cal.check_config(args.preset, {k: getattr(cfg, k) for k in ("batch", "seq", "n_embd", "n_head", "dropout", "dtype")})
    cal.pieces(args.preset, layout.tp, layout.sp)   # refused now (no preset, tp or SP pieces), not after the plan
    if getattr(args, "bandwidth", None) and args.comm_table:
        raise ValueError(f"--bandwidth={args.bandwidth:g} and --comm-table: give one (the flat rate replaces every "
                         f"table)")
    net = comm.flat(args.bandwidth) if getattr(args, "bandwidth", None) else comm.interconnect(args.interconnect)
    for spec in args.comm_table or ():
        net = net.replace(comm.read_comm_table(spec))
    return cal, net


def _one(cfg, layout, schedule, cal, net, preset) -> dict:
    layout.check(cfg)
    schedule.check(cfg, layout)
    return predict(cfg, layout, schedule, cal.pieces(preset, layout.tp, layout.sp), net)


def in_the_way(summary: dict, goal_ms: float) -> dict | None:
    """Where a pass misses its goal: by how much, its largest exposed collective
    and compute piece, and whether hiding all communication would be enough
    (the compute, its slowdown, and the slowdown the now-exposed collectives
    would add beside it: SLOWDOWN_BESIDE_COMM over their time)."""
    miss = summary["pass_ms"] - goal_ms
    if miss <= 0:
        return None
    pieces = summary["pieces"]
    comm_piece = max(pieces, key=lambda r: r["exposed_ms"])
    compute_piece = max(pieces, key=lambda r: r["compute_ms"] + r["slowdown_ms"])
    busy = summary["compute_ms"] + summary["slowdown_ms"] + (SLOWDOWN_BESIDE_COMM - 1) * summary["exposed_ms"]
    chunked = sum(e["alone_ms"] for e in summary["events"] if e["lane"] == COMM)   # each chunk alone
    return {"miss_ms": miss, "chunks_alone_ms": chunked, "chunking_cost_ms": chunked - summary["comm_whole_ms"],
            "largest_exposed": [comm_piece["piece"], comm_piece["exposed_ms"]],
            "largest_compute": [compute_piece["piece"], compute_piece["compute_ms"] + compute_piece["slowdown_ms"]],
            "compute_alone_meets_goal": busy <= goal_ms,
            "stands_in_the_way": comm_piece["piece"] if busy <= goal_ms and comm_piece["exposed_ms"] > 0
            else compute_piece["piece"]}


def _scaled_to_whole(cfg, layout, schedule, cal, net, preset, check: list[dict], goal: dict) -> dict:
    """The prediction again with each pass's pieces scaled by the calibration check's
    measured whole over their sum at this tp: the goal's verdict within the check's own error."""
    rows = {r["pass"]: r for r in check if r["tp"] == layout.tp}
    if set(rows) != set(PASSES):
        return {}
    factor = {k: 1 / (1 + rows[k]["error"]) for k in PASSES}
    again = predict(cfg, layout, schedule, cal.pieces(preset, layout.tp, layout.sp).scaled(factor), net)
    return {k: {"error": rows[k]["error"], "pass_ms": again[k]["pass_ms"], "met": again[k]["pass_ms"] <= goal[k]}
            for k in PASSES}


def _table(kind: str, s: dict, title: str) -> list[str]:
    lines = [f"{kind} ({title})", f"  {'piece':<58}{'compute':>9}{'beside':>9}{'comm':>9}{'exposed':>9}"]
    cell = lambda v, show: f"{v:9.3f}" if show else " " * 9   # noqa: E731
    for r in s["pieces"]:
        on = r["kind"] != "collective"
        name = r["piece"].replace(" (partial sums over the sequence shards)", " (SP: summed over tp)")
        lines.append(f"  {name[:58]:<58}{cell(r['compute_ms'], on)}"
                     f"{cell(r['slowdown_ms'], on and r['slowdown_ms'] > 5e-4)}"
                     f"{cell(r['comm_ms'], not on)}{cell(r['exposed_ms'], not on)}")
    lines.append(f"  {'total':<58}{s['compute_ms']:9.3f}{s['slowdown_ms']:9.3f}{s['comm_ms']:9.3f}{s['exposed_ms']:9.3f}"
                 f"   {kind} {s['pass_ms']:.3f} ms")
    return lines


def _format(rep: dict) -> str:
    out = []
    c = rep["calibration"]
    if c["stand_in"]:
        out.append("STAND-IN calibration (made up for the tests, not measured on a GPU): every time below is a placeholder")
    out.append(f"prediction, one rank: {rep['preset']} at tp {rep['tp']} ({rep['parallelism']}), schedule "
               f"{rep['schedule']}; pieces from {c['path']} ({c['gpu']}, {_clock(c)}, "
               f"commit {c['commit']}, {c['date']}); collectives from {rep['interconnect']['name']}")
    for kind in PASSES:
        out += [""] + _table(kind, rep[kind], f"ms; 'beside': the slowdown beside a collective, "
                             f"{rep[kind]['slowdown_source']}")
    goal = rep.get("goal")
    if goal:
        out.append("")
        for kind in PASSES:
            g, way, scaled = goal[kind], goal["in_the_way"][kind], goal["scaled_to_whole"].get(kind)
            if way is None:
                out.append(f"goal: {kind} {rep[kind]['pass_ms']:.3f} ms <= {g} ms: met")
            else:
                fix = ("hiding all communication would meet it" if way["compute_alone_meets_goal"]
                       else "compute alone is over it")
                out.append(f"goal: {kind} {rep[kind]['pass_ms']:.3f} ms misses {g} ms by {way['miss_ms']:.3f}: "
                           f"{fix}; in the way: {way['stands_in_the_way']} (largest exposed collective "
                           f"{way['largest_exposed'][0]} {way['largest_exposed'][1]:.3f} ms, largest compute piece "
                           f"{way['largest_compute'][0]} {way['largest_compute'][1]:.3f} ms)")
                if way["chunking_cost_ms"] > 5e-4:
                    out.append(f"      chunking the collectives costs {way['chunking_cost_ms']:.3f} ms of "
                               f"communication ({way['chunks_alone_ms']:.3f} ms in chunks against "
                               f"{rep[kind]['comm_whole_ms']:.3f} whole: smaller messages run at less busbw)")
            if scaled:
                out.append(f"      the calibration's pieces add up to {100 * scaled['error']:+.1f} % against the "
                           f"measured whole {kind} at tp {rep['tp']}; scaled to it, {scaled['pass_ms']:.3f} ms: "
                           f"{'met' if scaled['met'] else 'missed'}")
    if rep["anchors"]:
        out += ["", "anchors, one GPT-3 layer on 8xH100 (ms; theirs ran on H100, these pieces on the calibration's GPU):",
                f"  {'':<46}{'forward':>9}{'backward':>9}"]
        for name, f, b, src in rep["anchors"]:
            out.append(f"  {name + ' (' + src + ')':<46}{f if f is not None else '-':>9}{b:>9}")
        out.append(f"  {'this prediction: ' + rep['schedule']:<46}{rep['forward']['pass_ms']:9.3f}"
                   f"{rep['backward']['pass_ms']:9.3f}")
    out += ["", _check_line(rep["calibration_check"]), rep["communication_note"]]
    if rep.get("compare"):
        out += ["", *_compare_lines(rep)]
    return "\n".join(out)


def _check_line(rows: list[dict]) -> str:
    if not rows:
        return "calibration check: no tp of this preset calibrated"
    parts = [f"tp {r['tp']} {r['pass']} {100 * r['error']:+.1f} %" for r in rows]
    off = [r for r in rows if not r["within"]]
    verdict = "all within 10 %" if not off else "off: " + "; ".join(
        f"tp {r['tp']} {r['pass']} (largest pieces " + ", ".join(f"{p} {ms:.3f}" for p, ms in r["largest"]) + ")"
        for r in off)
    return (f"calibration check (the pieces' sum against the measured whole pass, TP local shapes, no "
            f"communication): {', '.join(parts)}: {verdict}")


def _compare(cfg, layout, cal, net, preset) -> list[dict]:
    rows = []
    for name, sched in SCHEDULES.items():
        lay = sched.layout(layout.dp, layout.tp)
        try:
            r = _one(cfg, lay, sched, cal, net, preset)
        except ValueError as e:
            rows.append({"schedule": name, "error": str(e)})
            continue
        rows.append({"schedule": name, "parallelism": "tp+sp" if lay.sp else "tp",
                     **{f"{k}_ms": r[k]["pass_ms"] for k in PASSES},
                     **{f"{k}_exposed_ms": r[k]["exposed_ms"] for k in PASSES},
                     "step_ms": r["forward"]["pass_ms"] + r["backward"]["pass_ms"]})
    for key in ("forward_ms", "backward_ms", "step_ms"):
        ok = [r for r in rows if key in r]
        if ok:
            min(ok, key=lambda r: r[key])[f"fastest_{key.removesuffix('_ms')}"] = True
    return rows


def _compare_lines(rep: dict) -> list[str]:
    lines = [f"every named schedule, {rep['preset']} at tp {rep['tp']} (ms per rank; * the fastest; schedules that "
             f"differ only in fusion cuts, masks or options predict the same: the model sees styles and chunks):",
             f"  {'schedule':<30}{'':<6}{'forward':>10}{'backward':>10}{'step':>10}{'exposed fwd / bwd':>20}"]
    for r in rep["compare"]:
        if "error" in r:
            lines.append(f"  {r['schedule']:<30}n/a: {r['error']}")
            continue
        mark = lambda k: "*" if r.get(f"fastest_{k}") else " "   # noqa: E731
        lines.append(f"  {r['schedule']:<30}{r['parallelism']:<6}{r['forward_ms']:9.3f}{mark('forward')}"
                     f"{r['backward_ms']:9.3f}{mark('backward')}{r['step_ms']:9.3f}{mark('step')}"
                     f"{r['forward_exposed_ms']:10.3f} / {r['backward_exposed_ms']:.3f}")
    for name, f, b, src in rep["anchors"]:
        lines.append(f"  anchor: {name:<42}{f if f is not None else '-':>9} {b:>9}")
    return lines


def predict_command(cfg, layout, schedule, args) -> dict:
    cal, net = _inputs(cfg, layout, args)
    result = _one(cfg, layout, schedule, cal, net, args.preset)
    key = (args.preset, layout.tp)
    rep = {"preset": args.preset, "tp": layout.tp, "parallelism": "tp+sp" if layout.sp else "tp",
           "schedule": schedule.name, "calibration": cal.summary(),
           "interconnect": {"name": net.name, "source": net.source,
                            "tables": {k: {"sizes": list(t.sizes), "busbw_gbps": list(t.busbw_gbps),
                                           "ranks": t.ranks, "source": t.source} for k, t in net.tables.items()}},
           "assumptions": {"slowdown_beside_comm_default": SLOWDOWN_BESIDE_COMM,
                           "comm_slowdown_beside_compute": COMM_SLOWDOWN_BESIDE_COMPUTE,
                           "model": "tpfuser/predict/timeline.py's docstring", "interpolation": "log(busbw) linear in "
                           "log(size), time held below the smallest size, busbw held above the largest"},
           **result, "anchors": ANCHORS.get(key, []), "calibration_check": check_sums(cal, args.preset),
           "communication_checked": False,
           "communication_note": f"communication: not checked (one GPU cannot run a collective over tp); its "
                                 f"times come from {net.name}: {net.source}"}
    if key in GOALS:
        goal = GOALS[key]
        rep["goal"] = {**goal, "in_the_way": {k: in_the_way(result[k], goal[k]) for k in PASSES},
                       "scaled_to_whole": _scaled_to_whole(cfg, layout, schedule, cal, net, args.preset,
                                                           rep["calibration_check"], goal)}
    if args.compare:
        rep["compare"] = _compare(cfg, layout, cal, net, args.preset)
    print()
    print(_format(rep))
    if args.png:
        plot_timeline(rep, args.png)
        print(f"timeline: {args.png}")
    return rep
