"""`tpfuser check` on every rank of a mesh: the process world, the checks of
check.py for each dtype, every rank's results gathered on rank 0, a table, JSON.

Under a launcher (torchrun, mpirun, or `--share-gpu`'s torchrun) each process
is one rank; alone, the process is the 1x1 mesh. A case that raises on a rank is
reported as failed with its error; the run goes on to the next case.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import torch
import torch.distributed as dist

from tpfuser.verify.commlog import error_line, error_message
from tpfuser.config import BlockConfig, Layout
from tpfuser.dist.sharegpu import SHARED_GPU_MARK
from tpfuser.dist.world import dp_group, init_rank
from tpfuser.outputs import write_json

# Deferred: nvfuser_direct (environment, for its version) and tpfuser.verify.check
# (a case's check: nvFuser), imported when used: the command line imports this
# module for `check` before it knows nvFuser is needed, and bench's report
# (bench/cli.py) for its environment.


def git_commit(folder: str) -> str | None:
    """HEAD of the checkout holding `folder`, with " + changes" where its files
    differ from it anywhere in the tree (tracked files changed, or files it does
    not track nor ignore): a device machine's copy of the tree can carry an older
    .git than its files, so a command there names the commit in
    TPFUSER_COMMIT. None outside a checkout."""
    def git(*args) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=folder, timeout=30)
    try:
        head = git("rev-parse", "--verify", "--quiet", "HEAD")
        if head.returncode != 0:   # not a checkout, or one without a commit
            return None
        status = git("status", "--porcelain", "--", ":/")   # the whole tree, untracked files that git does not ignore
        return head.stdout.strip() + (" + changes" if status.returncode != 0 or status.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment(command: str | None = None, schedule: dict | None = None) -> dict:
    """Where the results come from: date, GPU, versions, command (by default
    `tpfuser` and this process's arguments), commit, and the schedule the
    block ran under (schedules.Schedule.as_dict)."""
    import nvfuser_direct

    commit = os.environ.get("TPFUSER_COMMIT") or git_commit(os.path.dirname(__file__))
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "gpus_shared": int(os.environ.get(SHARED_GPU_MARK, "0")),
            "torch": torch.__version__, "nvfuser": getattr(nvfuser_direct, "__version__", "?"),
            "python": platform.python_version(), "command": command or "tpfuser " + " ".join(sys.argv[1:]),
            "commit": commit, "schedule": schedule}


def _check_case(cfg: BlockConfig, layout: Layout, rank: int, args, dp_group) -> dict:
    from tpfuser.verify.check import Case, check

    def progress(message: str) -> None:   # on stderr as it happens: a run that hangs shows where each rank is
        print(f"rank {rank}: {cfg.dtype}: {message}", file=sys.stderr, flush=True)
    progress("started")
    try:
        report = check(Case(cfg, layout), rank, backward=not args.forward_only, dp_group=dp_group,
                       record_collectives=args.collectives, preset_name=args.preset,
                       graphs=getattr(args, "graphs", False), schedule=args.schedule, progress=progress)
        return report.as_dict()
    except Exception as e:   # reported (at once: the other ranks may then wait for this one), and the next case runs
        line = error_line(e, context=2)
        progress(f"failed: {line}")
        return {"preset": args.preset, "dtype": cfg.dtype, "dropout": cfg.dropout, "rank": rank, "ok": False,
                "error": line, "error_message": error_message(e)}


def run_checks(cfgs: list[BlockConfig], layout: Layout, args) -> int:
    """Check every case on this rank. After each case rank 0 gathers every
    rank's results, prints them and rewrites args.json, so that a run ended at
    its time bound keeps the cases it finished. Exit code 0 when every rank
    passed every case."""
    rank = init_rank(layout)
    group = None
    if layout.world_size > 1:
        if not dist.is_initialized():   # gloo: barriers, gathers and the dp gradient sum, apart from nvFuser's NCCL
            dist.init_process_group("gloo")
        group = dp_group(layout, rank) if layout.dp > 1 else None
    report = {"environment": environment(schedule=args.schedule.as_dict()) if rank == 0 else None,
              "preset": args.preset, "mesh": f"{layout.dp}x{layout.tp}", "sp": layout.sp,
              "config": [cfg.__dict__ for cfg in cfgs], "schedule": args.schedule.name,
              "split_unit_axes": args.schedule.split_unit_axes,
              "cases": [], "ok": False}
    for cfg in cfgs:
        mine = _check_case(cfg, layout, rank, args, group)
        if torch.cuda.is_available():   # this case's blocks back to the GPU before rank 0's next reference
            torch.cuda.empty_cache()
        ranks = [mine]
        if layout.world_size > 1:
            ranks = [None] * layout.world_size
            dist.gather_object(mine, ranks if rank == 0 else None, dst=0)
        if rank == 0:
            report["cases"].append({"dtype": cfg.dtype, "dropout": cfg.dropout, "ranks": ranks})
            report["ok"] = all(r["ok"] for case in report["cases"] for r in case["ranks"])
            report["complete"] = len(report["cases"]) == len(cfgs)
            print(format_checks(report, only_last=True), flush=True)
            if args.json:
                write_json(args.json, report)   # whole or not at all: this rank may be ended as it writes
    ok = report["ok"]
    if layout.world_size > 1:
        flag = [ok]
        dist.broadcast_object_list(flag, src=0)
        ok = flag[0]
        dist.barrier()
    return 0 if ok else 1


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def _rings(rings: dict | None) -> str:
    """A phase's rings in the table: +r lowered/planned, +r?/planned where nvFuser printed none (not rank 0)."""
    if not rings:
        return ""
    planned = rings["planned"] if isinstance(rings["planned"], int) else len(rings["planned"])
    return f"+r{'?' if rings['lowered'] is None else len(rings['lowered'])}/{planned}"


def format_checks(report: dict, only_last: bool = False) -> str:
    """One line a rank and case: errors against tolerances, masks, collectives.
    only_last: the header and the last case only (printed as each case ends)."""
    env = report["environment"]
    lines = [f"check {report['preset']} mesh {report['mesh']}{' +sp' if report['sp'] else ''}"
             + (f", schedule {report['schedule']}" if report.get("schedule") else "") + f" on {env['gpu']}"
             + (f" ({env['gpus_shared']} GPU shared by all ranks: timings here are not speed figures)"
                if env["gpus_shared"] else "")
             + ("; split over a mesh axis of one device too" if report.get("split_unit_axes") else ""),
             f"{'dtype':5} {'p':>4} {'rank':>4} {'out err':>8} {'tol':>7} {'branch':>8} {'wrong-stream':>12} "
             f"{'grad worst':>10} {'tol':>7} {'masks':>6} {'collectives':>11}  verdict"]
    for case in report["cases"][-1:] if only_last else report["cases"]:
        for r in case["ranks"]:
            head = f"{case['dtype']:5} {case['dropout']:4.2f} {r['rank']:4d}"
            if "error" in r:
                lines.append(f"{head} FAILED: {r['error'][:300]}")
                continue
            fwd, bwd, coll = r["forward"], r["backward"], r["collectives"]
            wrong = sum(fwd["mask_mismatches"].values()) + sum((bwd or {}).get("mask_mismatches", {}).values())
            masks = "-" if not fwd["mask_mismatches"] else "equal" if wrong == 0 else f"{wrong} off"
            colls = "-" if coll is None else " ".join(
                f"{len(ph['posted'])}/{len(ph['planned'])}" + _rings(ph.get("rings")) + ("" if ph["matches"] else "!")
                for ph in coll.values())
            graphs = r.get("graphs")
            if graphs is not None:
                colls += " graphs " + ("equal" if all(v for v in graphs.values() if isinstance(v, bool)) else
                                       "NOT: " + ", ".join(k for k, v in graphs.items() if v is False))
            repeats = r.get("repeats")
            if repeats and not all(repeats.values()):
                colls += " second call differs: " + ", ".join(k for k, v in repeats.items() if not v)
            lines.append(f"{head} {_fmt(fwd['rel_err']):>8} {_fmt(fwd['tolerance']):>7} {_fmt(fwd['branch_rel_err']):>8} "
                         f"{_fmt(fwd.get('wrong_stream_branch_rel_err')):>12} "
                         f"{_fmt(bwd and bwd['worst']):>10} {_fmt(bwd and bwd['tolerance']):>7} {masks:>6} {colls:>11}  "
                         + ("ok" if r["ok"] else "FAIL")
                         + (f" (over their bounds: {', '.join(bwd['over_bound'])})" if bwd and bwd.get("over_bound") else ""))
    lines.append("collectives: posted/planned per fusion (forward, training forward, backward); +r lowered/planned: "
                 "the P2P rings (rank 0's: nvFuser prints host IR there alone, ? elsewhere); ! = differs from the plan")
    if not only_last or report.get("complete", True):
        lines.append("all ranks within tolerance" if report["ok"] else "SOME RANK FAILED")
    return "\n".join(lines)
