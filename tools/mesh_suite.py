"""Every mesh checked to the end on the GPUs there are: `tpfuser check --share-gpu
--collectives` for each (preset, mesh, sp) below, several at once, forward and
backward, each case's ranks against slices of the one reference, with the
collectives nvFuser posted compared with the plan's.

    python3 tools/mesh_suite.py OUT_DIR [GROUP ...]     (groups: tiny nanogpt gpt3, or job names; default all)
                                                        (a job name with :DTYPE runs that dtype only: tiny_2x4_sp:bf16)
    python3 tools/mesh_suite.py --table DIR [DIR ...]   the Markdown table of the reports there (README)

Writes OUT_DIR/<preset>_<dp>x<tp>[_sp].json (tpfuser check --json) and .log per
job, then OUT_DIR/mesh_summary.json and a table. Jobs run at once while their
ranks fit in RANKS_AT_ONCE and their estimated GPU memory (launch.shared_gpu_bytes)
in the GPU's free memory, in the order named (groups: widest first); each is
bounded by JOB_S seconds, and by DEADLINE_S for the whole suite: no job starts
with less than MIN_JOB_S left, and a job still running then is ended (all its
ranks: launch.run_bounded) and reported as such.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tpfuser.config import Layout, preset
from tpfuser.dist.launch import shared_gpu_bytes

TINY_MESHES = [(2, 1), (1, 2), (2, 2), (1, 4), (2, 4), (1, 8)]
JOBS = {
    "tiny": [("tiny", dp, tp, sp, ["fp32", "bf16"]) for dp, tp in TINY_MESHES for sp in (False, True)],
    "nanogpt": [("nanogpt", 1, 5, False, ["fp32", "bf16"]), ("nanogpt", 2, 1, False, ["fp32", "bf16"])],
    "gpt3": [("gpt3", 1, 8, False, ["bf16"]), ("gpt3", 1, 8, True, ["bf16"])],
}
# Each rank compiles its own fusions (nvFuser's compile is CPU-bound): on an H200
# machine's 16 cores (NOTES-history.md), 57 ranks at once finished none in
# 280 s; 24 at once finished 2-rank tiny jobs in 270-350 s.
RANKS_AT_ONCE = int(os.environ.get("RANKS_AT_ONCE", str(os.cpu_count() or 8)))
JOB_S = int(os.environ.get("JOB_S", "480"))
DEADLINE_S = int(os.environ.get("DEADLINE_S", "100000"))
MIN_JOB_S = int(os.environ.get("MIN_JOB_S", "120"))


def job_name(name, dp, tp, sp) -> str:
    return f"{name}_{dp}x{tp}{'_sp' if sp else ''}"


def pick_jobs(groups: list[str]) -> list[tuple]:
    """The jobs named, in the order named, a group's widest first; `job:dtype`
    keeps that one of the job's dtypes."""
    todo = []
    for want in groups:
        want, _, dtype = want.partition(":")
        jobs = JOBS.get(want) or [j for jobs in JOBS.values() for j in jobs if job_name(*j[:4]) == want]
        if not jobs:
            raise SystemExit(f"{want!r}: neither a group ({', '.join(JOBS)}) nor a job")
        if dtype:
            if len(jobs) > 1 or dtype not in jobs[0][4]:
                raise SystemExit(f"{want}:{dtype}: a dtype picks one of a single job's "
                                 f"({'a group has several jobs' if len(jobs) > 1 else ', '.join(jobs[0][4])})")
            jobs = [(*jobs[0][:4], [dtype])]
        todo += sorted((j for j in jobs if j not in todo), key=lambda j: -j[1] * j[2])
    return todo


def main(out: str, groups: list[str]) -> int:
    import torch
    todo = pick_jobs(groups)
    if not torch.cuda.is_available():
        raise SystemExit("mesh_suite: the ranks run on a GPU, and torch sees none")
    os.makedirs(out, exist_ok=True)
    free = torch.cuda.mem_get_info(0)[0] * 0.9
    running, done = [], {}
    start = time.time()
    while todo or running:
        left = DEADLINE_S - (time.time() - start)
        if left < MIN_JOB_S:
            for job in todo:
                done[job_name(*job[:4])] = {"rc": None, "seconds": 0, "not_started": True}
            todo = []
        for job in list(todo):
            name, dp, tp, sp, dtypes = job
            need = max(shared_gpu_bytes(preset(name, dtype=d), Layout(dp, tp, sp)) for d in dtypes)
            ranks = sum(j[0][1] * j[0][2] for j in running)
            used = sum(j[2] for j in running)
            if running and (ranks + dp * tp > RANKS_AT_ONCE or used + need > free):
                continue
            tag = job_name(name, dp, tp, sp)
            cmd = [sys.executable, "-m", "tpfuser.cli", "check", "--preset", name, "--dp", str(dp), "--tp", str(tp),
                   "--dtype", *dtypes, "--collectives", "--share-gpu", "--json", os.path.join(out, tag + ".json")]
            if sp:
                cmd.append("--sp")
            log = open(os.path.join(out, tag + ".log"), "w")
            env = {**os.environ, "TPFUSER_TIMEOUT_S": str(int(min(JOB_S, left - 10)))}
            env.pop("NVFUSER_MASTER_PORT", None)   # each job's own, next to its torchrun port
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((job, proc, need, time.time(), log))
            todo.remove(job)
            print(f"[{time.time() - start:5.0f} s] started {tag} ({dp * tp} ranks)", flush=True)
        time.sleep(2)
        for entry in list(running):
            job, proc, _, t0, log = entry
            if proc.poll() is None:
                continue
            log.close()
            running.remove(entry)
            tag = job_name(*job[:4])
            done[tag] = {"rc": proc.returncode, "seconds": round(time.time() - t0, 1),
                         "estimate_gib": round(entry[2] / 2**30, 1)}
            print(f"[{time.time() - start:5.0f} s] {tag}: exit {proc.returncode} after {done[tag]['seconds']} s",
                  flush=True)
    summary = {}
    for tag, status in done.items():
        path = os.path.join(out, tag + ".json")
        report = json.load(open(path)) if os.path.exists(path) else None
        why = ("not started: too little time left" if status.get("not_started")
               else "ended at its time bound" if status["rc"] == 124 else f"no report (exit {status['rc']})")
        summary[tag] = {**status, **(summarize(report) if report else {"ok": False, "error": why})}
    with open(os.path.join(out, "mesh_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(format_summary(summary))
    return 0 if all(s["ok"] for s in summary.values()) else 1


def run_name(folder: str) -> str:
    """A results folder's run: its own name, or its parent's for the suite's `mesh` folder (run19/mesh)."""
    parts = os.path.normpath(folder).split(os.sep)
    return "/".join(parts[-2:]) if parts[-1] == "mesh" and len(parts) > 1 else parts[-1]


def recompared(rank: dict, split_unit_axes: bool = True) -> dict | None:
    """The rank's stored posted collectives compared with today's plan (a report
    written before a plan's fix is judged by the fixed plan, not its own verdict)
    for the schedule the rank ran (reports from before the key: megatron's) and
    the fusions it ran: split over a mesh axis of one device or not (its
    split_unit_axes; reports without the key, written before it existed, ran split)."""
    from tpfuser.parallel.schedules import load_schedule
    from tpfuser.verify.check import compare_with_plan
    if not rank.get("collectives"):
        return rank.get("collectives")
    dp, tp = map(int, rank["mesh"].split("x"))
    cfg = preset(rank["preset"], dtype=rank["dtype"], dropout=rank["dropout"])
    posted = {phase: c["posted"] for phase, c in rank["collectives"].items()}
    name = rank.get("schedule") or ("megatron-sp" if rank["sp"] else "megatron")
    schedule = load_schedule(name).replace(split_unit_axes=split_unit_axes)
    return compare_with_plan(posted, cfg, Layout(dp, tp, rank["sp"]), rank["rank"], schedule)


def passed(rank: dict, split_unit_axes: bool = True) -> bool:
    """A rank's verdict under today's rules (check.RankReport.ok) and plan, from its stored figures."""
    from tpfuser.verify.check import RankReport
    if "error" in rank:
        return False
    fields = ("preset", "dtype", "dropout", "mesh", "sp", "rank", "forward", "backward")
    return RankReport(**{k: rank[k] for k in fields}, collectives=recompared(rank, split_unit_axes),
                      graphs=rank.get("graphs"), repeats=rank.get("repeats")).ok


def summarize(report: dict) -> dict:
    """Per dtype: ranks passed, worst output and gradient errors, masks,
    collectives; `missing`, the dtypes asked for that never ran (a job ended at
    its time bound), which fail the job."""
    ran = {case["dtype"] for case in report["cases"]}
    unit = report.get("split_unit_axes", True)   # absent: a report from before the key, which ran split
    missing = [cfg["dtype"] for cfg in report.get("config", []) if cfg["dtype"] not in ran]
    out = {"ok": not missing and all(passed(r, unit) for case in report["cases"] for r in case["ranks"]),
           "environment": report["environment"], "cases": {}, "missing": missing}
    for case in report["cases"]:
        ranks = case["ranks"]
        fine = [r for r in ranks if "error" not in r]
        seconds = {}   # the slowest rank's seconds per phase (first calls: compile included)
        for r in fine:
            for phase, t in r.get("seconds", {}).items():
                seconds[phase] = max(seconds.get(phase, t), t)
        out["cases"][case["dtype"]] = {
            "ranks_ok": sum(passed(r, unit) for r in ranks), "ranks": len(ranks),
            "worst_out": max((r["forward"]["rel_err"] for r in fine), default=None),
            "worst_grad": max((r["backward"]["worst"] for r in fine if r["backward"]), default=None),
            # how many times the right replay's branch error the wrong streams' is, on the worst rank
            "wrong_stream_factor": min((r["forward"]["wrong_stream_branch_rel_err"] / r["forward"]["branch_rel_err"]
                                        for r in fine if "wrong_stream_branch_rel_err" in r["forward"]), default=None),
            "masks_equal": all(not any({**r["forward"]["mask_mismatches"],
                                        **(r["backward"] or {}).get("mask_mismatches", {})}.values()) for r in fine)
                           if fine else None,   # None: no rank got that far
            "collectives_match": all(all(p["matches"] for p in (recompared(r, unit) or {}).values()) for r in fine)
                                 if fine else None,
            "errors": sorted({r["error"][:200] for r in ranks if "error" in r}),
            "seconds": seconds,
            "peak_gib": phase_peak(fine),
        }
    return out


def phase_peak(ranks: list[dict]) -> float | None:
    """What the ranks' allocators held at once at most (check.RankReport.peak_gib), the larger
    phase's: what launch.shared_gpu_bytes estimates, less the ranks' CUDA contexts. The
    reference is one rank's (the others wait at a barrier, then load their slices, which
    their block's peak counts); the blocks run side by side. None without per-phase peaks."""
    if not ranks or not all(isinstance(r.get("peak_gib"), dict) for r in ranks):
        return None
    return round(max(max(r["peak_gib"]["reference"] for r in ranks), sum(r["peak_gib"]["block"] for r in ranks)), 1)


def yes_no(flag, yes: str) -> str:
    return "-" if flag is None else yes if flag else "DIFF"


def format_summary(summary: dict) -> str:
    lines = [f"{'job':18} {'dtype':5} {'ranks ok':>8} {'out err':>8} {'grad err':>8} {'masks':>6} {'colls':>5} {'s':>5} "
             f"{'GiB est/peak':>12}"]
    for tag, s in sorted(summary.items()):
        if "cases" not in s:
            lines.append(f"{tag:18} exit {s['rc']}: {s.get('error')}")
            continue
        for dtype in s.get("missing", []):
            lines.append(f"{tag:18} {dtype:5} not run: the job ended first")
        for dtype, c in s["cases"].items():
            def f(x):
                return "-" if x is None else f"{x:.1e}"
            lines.append(f"{tag:18} {dtype:5} {c['ranks_ok']:>3}/{c['ranks']:<4} {f(c['worst_out']):>8} "
                         f"{f(c['worst_grad']):>8} {yes_no(c['masks_equal'], 'equal'):>6} "
                         f"{yes_no(c['collectives_match'], 'plan'):>5} {s['seconds']:5.0f} "
                         f"{s.get('estimate_gib', '-'):>5}/{'-' if c.get('peak_gib') is None else c['peak_gib']:<6}"
                         + (f"  {c['errors'][0][:120]}" if c["errors"] else ""))
    return "\n".join(lines)


def markdown_table(folders: list[str]) -> str:
    """One row per report and dtype found in the folders (later folders win)."""
    import glob
    rows = {}
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
            report = json.load(open(path))
            if "cases" not in report:
                continue
            tag = os.path.basename(path)[:-5]
            for dtype, c in summarize(report)["cases"].items():
                rows[(tag, dtype)] = (c, report["environment"].get("commit") or "?", run_name(folder))

    def f(x):
        return "-" if x is None else f"{x:.1e}"
    lines = ["| mesh | dtype | ranks passed | out rel L2 (worst) | gradients (worst) | wrong streams tell (x) | "
             "masks | collectives | run | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (tag, dtype), (c, commit, run) in sorted(rows.items()):
        lines.append(f"| {tag} | {dtype} | {c['ranks_ok']}/{c['ranks']} | {f(c['worst_out'])} | {f(c['worst_grad'])} | "
                     f"{'-' if c['wrong_stream_factor'] is None else format(c['wrong_stream_factor'], '.1f')} | "
                     f"{yes_no(c['masks_equal'], 'bit-exact')} | {yes_no(c['collectives_match'], 'as planned')} | "
                     f"{run} ({commit[:7]}) | {c['errors'][0][:70] if c['errors'] else ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] in ([], ["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0 if sys.argv[1:] else 2)
    if sys.argv[1:2] == ["--table"]:
        print(markdown_table(sys.argv[2:]))
        sys.exit(0)
    sys.exit(main(sys.argv[1], sys.argv[2:] or list(JOBS)))
