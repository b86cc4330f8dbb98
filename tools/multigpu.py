"""Every named schedule timed on a machine with a GPU per rank, at tp 2, 4 and 8
(5 for nanogpt's 25 heads), and `tpfuser plan --predict` held against it:

    python3 tools/multigpu.py [--out results/tmp/multigpu] [--send DIR] [--deadline-s S] [--gpus N] [--dry-run]
        [--share-gpu] [--presets gpt3 nanogpt] [--schedules A,B] [--jobs GLOB ...] [--skip KIND ...]

A job is a preset at a tp (up to the GPUs) under a named schedule that takes
it there (Layout.check, Schedule.check, known_failure), widest tp first; its
steps, each a process run alone (timings need the machine alone), are
`check --dtype bf16 --collectives` (every rank against the reference), then
`bench --profile` forward and `--train` (nvfuser, and nvfuser-graph where the
schedule can be captured) if the check passed, then `plan --predict` on the
machine's calibration and curves where they came. Before a tp's first job:
`comm/tp<t>` (tools/comm_curves.py under torchrun, t ranks) and
`calibrate/tp<t>` (tools/calibrate.py on one GPU); beside the jobs, for each
preset and tp, torch's peers (`bench --impl dtensor`, and under SP
`dtensor,dtensor-async`). Everything lands in OUT (<job>/check.json,
bench.json, bench_train.json, plan.json; comm/; calibration_tp<t>.json); each
step's record (exit status, seconds, command, log) in OUT/steps.jsonl as it
ends. A recorded step is not run again (--redo: it is), so a later call goes
on where one stopped. A step is bounded by --step-s (every rank it started
ended past it), cut to what --deadline-s leaves: every step ends by then.
Last, OUT/table.txt and table.json (tpfuser/bench/predicted.py: each pass
measured against predicted, past 10 % flagged; the checks; the peers; date,
GPUs, versions, command, commit); --send DIR packs OUT into
DIR/multigpu.tar.gz beside them (a device call returns eight files at most).

Every process runs with NVLink multicast off (comm_curves.MULTICAST_OFF,
asserted). --share-gpu: --gpus N ranks share the GPUs there are (a dry run on
one GPU: its table says its times are not speed figures). --dry-run prints the steps.
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import shlex
import sys
import tarfile
import time
from dataclasses import dataclass, field

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
from comm_curves import MULTICAST_OFF, keep_kinds, multicast_left_on  # noqa: E402
from tpfuser.bench.predicted import compare, format_rows  # noqa: E402
from tpfuser.config import Layout, preset  # noqa: E402
from tpfuser.dist.launch import run_bounded_all  # noqa: E402
from tpfuser.outputs import read_json, write_json, write_output  # noqa: E402
from tpfuser.parallel.linear_schedule import graphs_refused  # noqa: E402
from tpfuser.parallel.schedules import SCHEDULES, default_schedule, known_failure  # noqa: E402
from tpfuser.predict import comm  # noqa: E402
from tpfuser.predict.calibration import read_calibration  # noqa: E402
from tpfuser.verify.meshes import git_commit  # noqa: E402

CANDIDATE_TPS = (2, 4, 5, 8)
STEP_KINDS = ("comm", "calibrate", "check", "fwd", "train", "predict", "peers")
# Within a preset and tp: the defaults first, megatron's, the overlapped, streams, ring forms; -whole last.
FIRST = ("megatron-cut-linears", "megatron-sp-cut-linears", "megatron", "megatron-sp", "megatron-overlap",
         "megatron-sp-overlap", "megatron-overlap-streams", "megatron-sp-overlap-streams", "megatron-sp-ring",
         "megatron-sp-ring-ce")
PY = sys.executable


@dataclass(frozen=True)
class Job:
    preset: str
    tp: int
    schedule: str | None   # None: torch's peers
    sp: bool = False

    @property
    def name(self) -> str:
        return f"{self.preset}_tp{self.tp}_{self.schedule or ('peers-sp' if self.sp else 'peers')}"


@dataclass
class Step:
    id: str                 # "comm/tp<t>", "calibrate/tp<t>", "<job>/<kind>"
    kind: str               # STEP_KINDS
    cmd: list[str]
    bound_s: float
    env: dict = field(repr=False, default_factory=dict)
    after: str | None = None   # the step that must have passed first (a job's check)
    job: Job | None = None
    optional: dict = field(default_factory=dict)   # option -> file: left out where the file did not come


def refusal(preset_name: str, layout: Layout, schedule) -> str | None:
    """Why the schedule cannot run the preset's block (bf16) on the layout, or None."""
    cfg = preset(preset_name, dtype="bf16")
    try:
        layout.check(cfg)
        schedule.check(cfg, layout)
    except ValueError as e:
        return str(e)
    return known_failure(cfg, layout, schedule)


def plan_jobs(gpus: int, presets, schedules) -> tuple[list[Job], list[tuple[str, str]]]:
    """The jobs a machine of `gpus` GPUs runs, widest tp first, and those left out with why."""
    order = sorted(schedules, key=lambda s: (FIRST.index(s) if s in FIRST else len(FIRST), list(SCHEDULES).index(s)))
    jobs, left = [], []
    for tp in sorted((t for t in CANDIDATE_TPS if t <= gpus), reverse=True):
        for name in presets:
            if why := refusal(name, Layout(1, tp), SCHEDULES["megatron"]):   # (the heads: no schedule runs)
                left.append((f"{name}_tp{tp}_*", why))
                continue
            for s in order:
                why = refusal(name, SCHEDULES[s].layout(1, tp), SCHEDULES[s])
                (left.append((Job(name, tp, s).name, why)) if why else jobs.append(Job(name, tp, s)))
            for sp in (False, True):   # the peers where the default schedule of that parallelism runs
                if not refusal(name, Layout(1, tp, sp), default_schedule(Layout(1, tp, sp))):
                    jobs.append(Job(name, tp, None, sp))
    return jobs, left


def run_env(environ: dict, bound_s: float, out: str, kernel_cache: bool = True) -> dict:
    """Every step's environment: NVLink multicast off, this checkout first on the path, its bound, and
    nvFuser's kernels kept across the steps (a job's check compiles what its benches run), beside OUT
    (neither packed nor carried with it)."""
    env = {**environ, **MULTICAST_OFF, "PYTHONUNBUFFERED": "1", "TPFUSER_TIMEOUT_S": str(int(bound_s))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, environ.get("PYTHONPATH")) if p)
    env.pop("NVFUSER_MASTER_PORT", None)   # each run's own (tpfuser/dist/launch.py)
    if kernel_cache:
        env["TPFUSER_KERNEL_CACHE"] = os.path.join(ROOT, f"{out}-kernels")
    assert not multicast_left_on(env), multicast_left_on(env)
    return env


def plan_steps(jobs, out: str, args, environ) -> list[Step]:
    share, bound = (["--share-gpu"] if args.share_gpu else []), args.step_s
    env = run_env(environ, bound, out, not args.cold)
    steps = []
    for job in jobs:
        tp = job.tp
        if not any(s.id.endswith(f"/tp{tp}") for s in steps):   # before a tp's first job, its curves and pieces
            if not args.share_gpu:   # (ranks sharing a GPU have no link between GPUs to measure)
                steps.append(Step(f"comm/tp{tp}", "comm", [PY, "-m", "torch.distributed.run", "--standalone",
                                                           f"--nproc-per-node={tp}", "tools/comm_curves.py", "--out",
                                                           f"{out}/comm", "--teams", str(tp)], bound, env))
            presets = sorted({j.preset for j in jobs if j.tp == tp})
            steps.append(Step(f"calibrate/tp{tp}", "calibrate", [PY, "tools/calibrate.py", "--preset", *presets,
                                                                 "--tp", str(tp), "--json",
                                                                 f"{out}/calibration_tp{tp}.json"], bound, env))
        d, block = f"{out}/{job.name}", ["--preset", job.preset, "--tp", str(tp)]
        if job.schedule is None:
            bench = [PY, "-m", "tpfuser.bench", *block, *(["--sp"] if job.sp else []), "--impl",
                     "dtensor,dtensor-async" if job.sp else "dtensor", "--profile", "--iters", str(args.iters), *share]
            steps += [Step(f"{job.name}/fwd", "peers", [*bench, "--json", f"{d}/bench.json"], bound, env),
                      Step(f"{job.name}/train", "peers", [*bench, "--train", "--json", f"{d}/bench_train.json"],
                           bound, env)]
            continue
        block += ["--schedule", job.schedule]
        check = f"{job.name}/check"
        impls = "nvfuser" if graphs_refused(SCHEDULES[job.schedule]) else "nvfuser,nvfuser-graph"
        bench = [PY, "-m", "tpfuser.bench", *block, "--impl", impls, "--profile", "--iters", str(args.iters), *share]
        steps += [Step(check, "check", [PY, "-m", "tpfuser.cli", "check", *block, "--dtype", "bf16", "--collectives",
                                        "--json", f"{d}/check.json", *share], bound, env),
                  Step(f"{job.name}/fwd", "fwd", [*bench, "--json", f"{d}/bench.json"], bound, env, check),
                  Step(f"{job.name}/train", "train", [*bench, "--train", "--json", f"{d}/bench_train.json"],
                       bound, env, check),
                  Step(f"{job.name}/predict", "predict", [PY, "-m", "tpfuser.cli", "plan", *block, "--predict",
                                                          "--json", f"{d}/plan.json"], 120, env, job=job,
                       optional={"--calibration": f"{out}/calibration_tp{tp}.json",
                                 "--comm-table": f"{out}/comm/plan_tp{tp}.json"})]
    return [s for s in steps if s.kind not in args.skip]


def command(step: Step) -> list[str]:
    """The step's command as it runs now: an optional input that did not come, or a calibration without
    the job's pieces, left out (plan then reads the committed calibration, or the default interconnect's tables)."""
    cmd = list(step.cmd)
    for option, path in step.optional.items():
        if option == "--comm-table":
            keep_kinds(path.replace("/plan_tp", "/comm_table_tp"), path, comm.ALL_KINDS)
        if option == "--calibration" and os.path.isfile(path):
            try:
                job = step.job
                read_calibration(path).pieces(job.preset, job.tp, SCHEDULES[job.schedule].sequence_parallel)
            except ValueError:
                continue
        if os.path.isfile(path):
            cmd += [option, path]
    return cmd


def run_steps(steps, out: str, args) -> None:
    log_path, planned = f"{out}/steps.jsonl", {s.id for s in steps}
    done = {} if args.redo else read_records(log_path)
    end = time.monotonic() + args.deadline_s - 30   # (the table's time)
    for step in steps:
        left = end - time.monotonic() - 50   # (a step past its bound: 30 s more, then up to 15 s to end it)
        if step.id in done or left < 60:
            print(f"== {step.id}: " + ("recorded before" if step.id in done else "not started, past --deadline-s"))
            continue
        record = {"step": step.id}
        if step.after in planned and done.get(step.after, {}).get("rc") != 0:
            record["skipped"] = f"{step.after} did not pass"
        else:
            bound = min(step.bound_s, left)
            cmd = command(step)
            log = f"{out}/{step.id}.log"
            os.makedirs(os.path.dirname(log), exist_ok=True)
            print(f"== {step.id} (bound {bound:.0f} s): {shlex.join(cmd)}", flush=True)
            began = time.monotonic()
            with open(log, "w") as f:   # (past its bound a tpfuser launch ends its ranks; 30 s later, this ends it)
                rc = run_bounded_all([cmd], {**step.env, "TPFUSER_TIMEOUT_S": str(int(bound))}, bound + 30,
                                     stdouts=[f], merge_stderr=True)[0]
            record.update(rc=rc, seconds=round(time.monotonic() - began, 1), command=shlex.join(cmd), log=log)
            print(f"   exit {rc} after {record['seconds']} s", flush=True)
        done[step.id] = record
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_records(path: str) -> dict:
    """step -> its last record in OUT/steps.jsonl."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return {r["step"]: r for r in map(json.loads, filter(str.strip, f))}


def _load(path: str) -> dict | None:
    try:
        return read_json(path, "report")
    except ValueError:   # not there (the step did not run, or failed before writing it)
        return None


def table(jobs, left, out: str, environment: dict) -> tuple[dict, str]:
    """Measured against predicted for every job that ran (bench/predicted.py), the checks, torch's
    peers, the steps that failed or were skipped, and the jobs left out: (JSON, text)."""
    rows, checks, peers = [], {}, []
    for job in jobs:
        d = f"{out}/{job.name}"
        forward, train = _load(f"{d}/bench.json"), _load(f"{d}/bench_train.json")
        environment.update({k: v for k, v in ((forward or train or {}).get("environment") or {}).items()
                            if k in ("gpu", "torch", "nvfuser") and environment.get(k) is None})
        if job.schedule is None:
            peers += [{"job": job.name, "pass": rep["pass"], "failed": rep.get("failed", {}),
                       "median_ms": {i: r["median_ms"] for i, r in rep["results"].items()}} for rep in (forward, train)
                      if rep]
            continue
        check = _load(f"{d}/check.json")
        checks[job.name] = None if check is None else bool(check.get("ok"))
        prediction = (_load(f"{d}/plan.json") or {}).get("prediction")
        if forward or train or prediction:
            rows.append({**compare({"preset": job.preset, "tp": job.tp, "schedule": job.schedule}, forward, train,
                                   prediction), "check": checks[job.name],
                         "calibration": (prediction or {}).get("calibration", {}).get("path"),
                         "interconnect": (prediction or {}).get("interconnect", {}).get("name")})
    failed = [r for r in read_records(f"{out}/steps.jsonl").values() if "skipped" in r or r.get("rc") != 0]
    data = {"environment": environment, "rows": rows, "checks": checks, "peers": peers, "failed_steps": failed,
            "left_out": [{"job": n, "why": w} for n, w in left]}
    ran = {n: ok for n, ok in checks.items() if ok is not None}
    lines = [f"{environment['date']}: {environment['gpus']} x {environment['gpu']}, torch {environment['torch']}, "
             f"nvFuser {environment['nvfuser']}, commit {environment['commit']}", f"command: {environment['command']}",
             "", format_rows(rows) if rows else "nothing measured", "",
             f"checks (bf16, every rank against the reference, collectives as planned): {sum(ran.values())} of "
             f"{len(ran)} passed" + "".join(f"; FAILED {n}" for n, ok in ran.items() if not ok)]
    lines += [f"peers {p['job']} {p['pass']}: " + ", ".join(f"{i} {ms:.3f} ms" for i, ms in p["median_ms"].items())
              + "".join(f"; {i} failed: {why[:160]}" for i, why in p["failed"].items()) for p in peers]
    lines += [f"step {r['step']}: " + (r.get("skipped") or f"exit {r['rc']} ({r['log']})") for r in failed]
    return data, "\n".join(lines + [f"left out: {n}: {w}" for n, w in left])


def environment(gpus: int, argv) -> dict:
    """Date, GPUs, command, commit; the GPU's name and the versions come from the reports (table)."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "gpus": gpus,
            "gpu": None, "torch": None, "nvfuser": None, "command": shlex.join(["python3", "tools/multigpu.py", *argv]),
            "commit": os.environ.get("TPFUSER_COMMIT") or git_commit(ROOT), "environment": dict(MULTICAST_OFF)}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/tmp/multigpu", help="inside the checkout (default results/tmp/multigpu)")
    ap.add_argument("--send", default=None, metavar="DIR", help="also DIR/multigpu.tar.gz (OUT) and the table there")
    ap.add_argument("--gpus", type=int, default=None, help="plan for N GPUs (default: the machine's)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run none")
    ap.add_argument("--share-gpu", action="store_true", help="the ranks share the GPUs there are (not for speed)")
    ap.add_argument("--presets", nargs="+", default=["gpt3", "nanogpt"], choices=["gpt3", "nanogpt", "tiny"])
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default: every named one)")
    ap.add_argument("--jobs", nargs="+", default=["*"], metavar="GLOB", help="job names to run, e.g. 'gpt3_tp8_*'")
    ap.add_argument("--skip", nargs="+", default=[], choices=STEP_KINDS, help="kinds of step not to run")
    ap.add_argument("--step-s", type=float, default=420, help="each step's bound, s (default 420)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="every step ends within this many s")
    ap.add_argument("--iters", type=int, default=30, help="the bench's samples per implementation (default 30)")
    ap.add_argument("--redo", action="store_true", help="run the steps OUT/steps.jsonl records again")
    ap.add_argument("--cold", action="store_true", help="no kernel cache across the steps (TPFUSER_KERNEL_CACHE)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.send = args.send and os.path.abspath(args.send)   # (the steps run in the checkout)
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = here if args.gpus is None else args.gpus
    schedules = [s for s in args.schedules.split(",") if s]
    out = os.path.relpath(os.path.abspath(args.out), ROOT)
    why = (f"--schedules: {', '.join(s for s in schedules if s not in SCHEDULES)}: not among {', '.join(SCHEDULES)}"
           if not set(schedules) <= set(SCHEDULES) else
           f"--out {args.out}: expected a folder inside the checkout {ROOT}" if out.startswith("..") else
           f"--gpus {gpus}: a tp of 2 or more needs 2 GPUs or more" if gpus < 2 and args.gpus is not None else
           f"this machine has {here} GPU(s), a tp of 2 or more needs 2 (--gpus N --dry-run: the steps for N)"
           if gpus < 2 else
           f"--gpus {gpus}: this machine has {here}; --share-gpu runs the ranks on them (not for speed), --dry-run "
           f"prints the steps" if gpus > here and not (args.share_gpu and here) and not args.dry_run else
           f"--step-s {args.step_s:g}, --iters {args.iters}: expected positive" if min(args.step_s, args.iters) <= 0
           else None)
    if why:
        print(f"error: multigpu: {why}", file=sys.stderr)
        return 2
    jobs, left = plan_jobs(gpus, args.presets, schedules)
    jobs = [j for j in jobs if any(fnmatch.fnmatch(j.name, g) for g in args.jobs)]
    steps = plan_steps(jobs, out, args, os.environ)
    print(f"multigpu: {gpus} GPUs, {len(jobs)} jobs, {len(steps)} steps, tp {sorted({j.tp for j in jobs})}"
          + (f"; ranks share {here or 'the'} GPU(s): no time here is a speed figure" if args.share_gpu else "")
          + f"; every step's environment: {' '.join(f'{k}={v}' for k, v in MULTICAST_OFF.items())}", flush=True)
    if args.dry_run:   # (each command as it runs where its optional inputs came)
        for step in steps:
            cmd = step.cmd + [x for option, path in step.optional.items() for x in (option, path)]
            print(f"{step.id} (bound {step.bound_s:g} s{', after ' + step.after if step.after else ''}): "
                  f"{shlex.join(cmd)}")
        print("\n".join(f"left out: {name}: {w}" for name, w in left))
        return 0
    os.chdir(ROOT)
    os.makedirs(out, exist_ok=True)
    run_steps(steps, out, args)
    data, text = table(jobs, left, out, environment(gpus, argv))
    print(text)
    for folder in filter(None, (out, args.send)):
        os.makedirs(folder, exist_ok=True)
        write_json(f"{folder}/table.json", data)
        write_output(f"{folder}/table.txt", text + "\n")
    if args.send:
        with tarfile.open(os.path.join(args.send, "multigpu.tar.gz"), "w:gz") as tar:
            tar.add(out, arcname=os.path.basename(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
