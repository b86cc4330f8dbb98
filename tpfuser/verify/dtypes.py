"""`tpfuser check` of several dtypes on one GPU (a 1x1 mesh): each dtype in a
process of its own, side by side, where the GPU holds them all. A dtype's
fusions are its own, so its check compiles apart from the other's; compiling
is CPU work (nvFuser's segmenter, NVRTC), and two processes do it at once on
a machine with the cores. The table and JSON are those of a check in one
process (meshes.run_checks), the cases in the order asked.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from tpfuser.config import BlockConfig, Layout
from tpfuser.dist.launch import TIMEOUT_VAR, run_bounded_all, run_timeout_s, shared_gpu_bytes
from tpfuser.outputs import write_json
from tpfuser.verify.meshes import environment, format_checks


def side_by_side_refusal(cfgs: list[BlockConfig], layout: Layout, free_bytes: int | None) -> str | None:
    """Why these checks run one after another in this process, or None (side by side)."""
    if len(cfgs) < 2 or layout.world_size != 1:
        return "one dtype" if len(cfgs) < 2 else "a mesh of several ranks"
    need = sum(shared_gpu_bytes(cfg, layout) for cfg in cfgs)
    if free_bytes is None or need > free_bytes:
        free = "unknown" if free_bytes is None else f"{free_bytes / 2**30:.1f} GiB"
        return f"together they need about {need / 2**30:.1f} GiB of GPU memory, free: {free}"
    return None


def child_command(args, cfg: BlockConfig, schedule_file: str, json_file: str) -> list[str]:
    """`tpfuser check` of one dtype, everything else as this check: the block as
    resolved here (dtype, dropout, heads), the schedule as resolved here (a file)."""
    cmd = [sys.executable, "-m", "tpfuser.cli", "check", "--preset", args.preset, "--dtype", cfg.dtype,
           "--dropout", repr(cfg.dropout), "--n-head", str(cfg.n_head), "--schedule-file", schedule_file,
           "--json", json_file]
    return cmd + [flag for flag, on in (("--forward-only", args.forward_only), ("--collectives", args.collectives),
                                        ("--graphs", getattr(args, "graphs", False))) if on]


def check_side_by_side(cfgs: list[BlockConfig], layout: Layout, args) -> int:
    """Each dtype's check in a process of its own, at once; one table and JSON of
    them all. Exit code 0 when every case passed."""
    schedule = args.schedule
    names = ", ".join(cfg.dtype for cfg in cfgs)
    print(f"checking {names} side by side, a process each", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="tpfuser-check-") as folder:
        schedule_file = os.path.join(folder, "schedule.json")
        with open(schedule_file, "w") as f:
            json.dump(schedule.as_dict(), f)
        files = [os.path.join(folder, f"{cfg.dtype}.json") for cfg in cfgs]
        logs = [open(os.path.join(folder, f"{cfg.dtype}.out"), "w") for cfg in cfgs]   # their own tables: ours is last
        bound_s = run_timeout_s()
        try:
            codes = run_bounded_all([child_command(args, cfg, schedule_file, out) for cfg, out in zip(cfgs, files)],
                                    dict(os.environ), bound_s, stdouts=logs)
        finally:
            for log in logs:
                log.close()
        reports = []
        for cfg, out, code in zip(cfgs, files, codes):
            try:
                with open(out) as f:
                    reports.append(json.load(f))
            except (OSError, ValueError):
                why = (f"did not finish in {bound_s:g} s ({TIMEOUT_VAR} sets the bound)" if code is None
                       else f"exit {code}, no result written")
                reports.append(_failed(cfg, args, why))
    report = merge(reports, cfgs, args, layout)
    print(format_checks(report), flush=True)
    if args.json:
        write_json(args.json, report)
    return 0 if report["ok"] and all(code == 0 for code in codes) else 1


def _failed(cfg: BlockConfig, args, why: str) -> dict:
    rank = {"preset": args.preset, "dtype": cfg.dtype, "dropout": cfg.dropout, "rank": 0, "ok": False,
            "error": f"its check's process: {why}"}
    return {"cases": [{"dtype": cfg.dtype, "dropout": cfg.dropout, "ranks": [rank]}]}


def merge(reports: list[dict], cfgs: list[BlockConfig], args, layout: Layout) -> dict:
    """One check's report from one report per dtype (meshes.run_checks' form)."""
    schedule = args.schedule
    cases = [case for rep in reports for case in rep["cases"]]
    return {"environment": environment(schedule=schedule.as_dict()), "preset": args.preset,
            "mesh": f"{layout.dp}x{layout.tp}", "sp": layout.sp, "config": [cfg.__dict__ for cfg in cfgs],
            "schedule": schedule.name, "split_unit_axes": schedule.split_unit_axes, "cases": cases,
            "ok": bool(cases) and all(r["ok"] for case in cases for r in case["ranks"]),
            "complete": len(cases) == len(cfgs), "side_by_side": True}
