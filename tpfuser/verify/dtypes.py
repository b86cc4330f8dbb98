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
from tpfuser.dist.launch import TIMEOUT_VAR, Ended, run_bounded_all, run_timeout_s, shared_gpu_bytes
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


def child_environment(args) -> dict[str, str]:
    """This process's environment for a dtype's check, less what would make two
    of them collide or say a thing twice: a fixed port for nvFuser's store
    (each then picks a free one) and the communication dump check adds itself."""
    env = {k: v for k, v in os.environ.items() if k != "NVFUSER_MASTER_PORT"}
    if args.collectives and "NVFUSER_DUMP" in env:
        dumps = [d for d in env["NVFUSER_DUMP"].split(",") if d and d != "communication"]
        env.pop("NVFUSER_DUMP")
        if dumps:
            env["NVFUSER_DUMP"] = ",".join(dumps)
    return env


def check_side_by_side(cfgs: list[BlockConfig], layout: Layout, args) -> int:
    """Each dtype's check in a process of its own, at once; one table and JSON of
    them all, also when this process is told to end (what finished is kept).
    Exit code 0 when every case passed, 124 when a process ran past the bound."""
    schedule = args.schedule
    print(f"checking {', '.join(cfg.dtype for cfg in cfgs)} side by side, a process each", file=sys.stderr, flush=True)
    bound_s, codes = run_timeout_s(), None
    with tempfile.TemporaryDirectory(prefix="tpfuser-check-") as folder:
        schedule_file = os.path.join(folder, "schedule.json")
        with open(schedule_file, "w") as f:
            json.dump(schedule.as_dict(), f)
        files = [os.path.join(folder, f"{i}-{cfg.dtype}.json") for i, cfg in enumerate(cfgs)]
        logs = [open(os.path.join(folder, f"{i}-{cfg.dtype}.out"), "w") for i, cfg in enumerate(cfgs)]   # their tables
        try:
            codes = run_bounded_all([child_command(args, cfg, schedule_file, out) for cfg, out in zip(cfgs, files)],
                                    child_environment(args), bound_s, stdouts=logs, labels=[c.dtype for c in cfgs])
        finally:   # ended by a signal too: the table and JSON of what finished, then the signal goes on
            for log in logs:
                log.close()
            pending = sys.exc_info()[1]
            if pending is None:
                fates = [f"did not finish in {bound_s:g} s ({TIMEOUT_VAR} sets the bound)" if code is None else
                         None if code == 0 else f"exited {code}" for code in codes]
            else:
                said = "was ended with this check" if isinstance(pending, (Ended, KeyboardInterrupt)) else \
                    f"did not run to its end ({type(pending).__name__} here)"
                fates = [said] * len(cfgs)
            try:
                report = merge([_read(out, cfg, args, fate) for cfg, out, fate in zip(cfgs, files, fates)],
                               cfgs, args, layout)
                print(format_checks(report), flush=True)
                if args.json:
                    write_json(args.json, report)
            except Exception as e:
                if pending is None:
                    raise
                print(f"the dtypes' results could not be gathered ({type(e).__name__}: {e})", file=sys.stderr)
    if any(code is None for code in codes):
        return 124
    return 0 if report["ok"] and all(code == 0 for code in codes) else 1


def _read(path: str, cfg: BlockConfig, args, fate: str | None) -> dict:
    """A dtype's report as its process wrote it, or a failed case saying why
    there is none. fate: what became of its process, None if it exited 0."""
    try:
        with open(path) as f:
            report = json.load(f)
        report["cases"][0]["ranks"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return _failed(cfg, args, f"{fate or 'exited 0'}, no result written")
    if fate and all(r.get("ok") for case in report["cases"] for r in case["ranks"]):
        print(f"{cfg.dtype}: its process {fate} after writing a passing result", file=sys.stderr)
    return report


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
