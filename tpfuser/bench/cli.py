"""`tpfuser bench` (also `python3 -m tpfuser.bench`): its options, its refusals
before any work, its launch over ranks, and its report (table and JSON)."""

from __future__ import annotations

import os
import sys

import torch

from tpfuser.bench.impls import (IMPLS, NVFUSER_GRAPHED, check_impls, default_impls, split_impl,
                                 schedule_files as impl_schedule_files)
from tpfuser.bench.plot import plot_reports
from tpfuser.bench.report import format_table, validate_report
from tpfuser.bench.run import bench
from tpfuser.bench.startup import format_startup, run_startup
from tpfuser.config import PRESETS, preset
from tpfuser.dist.launch import relaunch
from tpfuser.dist.sharegpu import SHARED_GPU_MARK
from tpfuser.dist.world import check_launch, in_launcher, init_rank, rank_groups
from tpfuser.outputs import check_distinct, check_writable, write_json
from tpfuser.parallel.schedule_options import check_schedule, resolve_schedule, schedule_files
from tpfuser.parallel.linear_schedule import graphs_refused
from tpfuser.parallel.schedules import known_failure
from tpfuser.verify.meshes import environment
# None of these imports nvFuser (bench.impls imports the runtime where a block
# is made): bench's options and refusals come before any nvFuser import.


def add_bench_arguments(ap) -> None:
    """bench's options, on its own parser (python -m tpfuser.bench) or tpfuser's subparser."""
    ap.add_argument("--preset", default="nanogpt", choices=sorted(PRESETS), help="(default: nanogpt)")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (the default schedule: megatron-sp-cut-linears)")
    ap.add_argument("--impl", default=None, help=f"comma-separated, of {','.join(IMPLS)} (default: what the mesh allows); "
                    "an nvFuser one may run a schedule of its own beside the bench's: nvfuser-graph@megatron-cut-linears")
    ap.add_argument("--iters", type=int, default=None, help=f"samples per implementation (default {ITERS})")
    ap.add_argument("--dropout", type=float, default=None)
    ap.add_argument("--train", action="store_true", help="forward+backward (a training step) instead of forward")
    ap.add_argument("--profile", action="store_true", help="also what each call's time goes to (GPU kernels, idle)")
    ap.add_argument("--startup", action="store_true",
                    help="time each implementation's first call instead, each in a fresh process "
                         "(nvFuser's time split into segmenting, compiling kernels and the rest)")
    ap.add_argument("--json", default=None, help="also write the report as JSON here (- for standard output)")
    ap.add_argument("--png", default=None, help="also plot the report here")
    ap.add_argument("--share-gpu", action="store_true",
                    help="run dp*tp ranks on fewer GPUs: to see it run, not for speed (the ranks time-share a GPU)")


def bench_command(argv: list[str]) -> str:
    """The command line that ran this process, as its user typed it: `python3 -m
    tpfuser.bench ...` when the bench package was run, else `tpfuser ...` (the CLI)."""
    if argv and os.path.basename(os.path.dirname(argv[0])) == "bench" and argv[0].endswith("__main__.py"):
        return "python3 -m tpfuser.bench " + " ".join(argv[1:])
    return "tpfuser " + " ".join(argv[1:])


ITERS = 100   # samples per implementation, by default


RING_NOTE = ("note: a ring on one GPU (tp 1, or ranks sharing it) moves nothing between GPUs: its figure is what "
             "the ring's form costs (the GEMM cut into tp steps, nvFuser's host IR, the runner's copies), not what "
             "it overlaps")
RING_NOTE_TP = "note: the ring schedules run called (nvFuser 0.2.36 cannot capture them in a CUDA graph)"


def bench_main(args, argv) -> int:
    """The benchmark of parsed options; argv, bench's own, is what ranks relaunch with."""
    rank, groups = 0, None
    impls = args.impl.split(",") if args.impl else None
    try:
        # Everything that can be refused, before the benchmark: its results must not be lost to a bad path.
        schedule = resolve_schedule(args)
        layout = schedule.layout(args.dp, args.tp)
        if args.startup:   # one first call per fresh process: none of these means anything there
            given = [o for o, v in (("--iters", args.iters is not None), ("--png", args.png),
                                    ("--profile", args.profile)) if v]
            if given:
                raise ValueError(f"{given[0]}: not taken with --startup (one first call per fresh process: no "
                                 f"samples, no plot, no profile)")
        iters = ITERS if args.iters is None else args.iters
        if iters < 1:
            raise ValueError(f"--iters={args.iters}: expected a positive int (samples per implementation)")
        cfg = preset(args.preset, dtype="bf16", **({} if args.dropout is None else {"dropout": args.dropout}))
        layout.check(cfg)
        check_schedule(args, schedule, cfg, layout)
        if known_failure(cfg, layout, schedule):
            raise ValueError(known_failure(cfg, layout, schedule))
        if refused := graphs_refused(schedule):   # its linears run called only: no graph of nvFuser's block
            graphed = [i for i in impls or () if split_impl(i)[0] in NVFUSER_GRAPHED]
            if graphed:
                raise ValueError(f"implementation {graphed[0]!r}: {refused}")
            impls = impls or [i for i in default_impls(layout) if i not in NVFUSER_GRAPHED]
        check_impls(impls or (), layout, args.train, schedule, cfg)
        check_writable(args.json, "--json")
        check_writable(args.png, "--png")
        check_distinct({"--json": args.json, "--png": args.png},
                       {**schedule_files(args), "--impl": impl_schedule_files(impls or ())})
        if args.startup:
            if not torch.cuda.is_available():   # (its processes would each fail on it, one after another)
                raise RuntimeError("benchmarking needs a CUDA GPU (--startup's fresh processes each run on it)")
            rep = run_startup(args.preset, cfg, layout, schedule, impls, train=args.train)
            status = _report(rep, args, startup=True)
            return 1 if all("error" in row for row in rep["rows"]) else status   # nothing measured
        check_launch(layout)
        if layout.world_size > 1:
            if not in_launcher():   # one rank per GPU under torchrun, or a clear refusal
                return relaunch(layout, ["bench", *argv], share_gpu=args.share_gpu, schedule=schedule)
            rank = init_rank(layout)
            groups = rank_groups(layout, rank)
        if rank == 0 and schedule.overlapped("ring"):
            print(RING_NOTE if layout.tp == 1 or args.share_gpu else RING_NOTE_TP, file=sys.stderr)
        rep = bench(args.preset, impls, iters, dropout=args.dropout, train=args.train, layout=layout,
                    rank=rank, groups=groups, progress=rank == 0, profile=args.profile, schedule=schedule)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rank != 0:   # every rank timed; rank 0 holds the slowest rank's samples and reports
        return 0
    return _report(rep, args)


def _report(rep: dict, args, startup: bool = False) -> int:
    rep["gpus_shared"] = int(os.environ.get(SHARED_GPU_MARK, "0"))   # > 0: timings are not speed figures
    rep["environment"] = environment(bench_command(sys.argv), rep.get("schedule"))   # date, versions, command, commit
    if startup:
        text = format_startup(rep)
    else:
        validate_report(rep)
        text = format_table(rep)
    if args.json:
        write_json(args.json, rep)
    if args.png and not startup:
        plot_reports([rep], args.png)
    print(text, file=sys.stderr if args.json == "-" else sys.stdout)   # the JSON alone on standard output
    return 0
