"""Command line: a thin layer over the Python API.

  tpfuser show  [--preset P] [--dtype D] [--dp N --tp N] [--ir|--names] [--backward] [--host-ir]
  tpfuser plan  [--preset P] [--dp N --tp N] [--json F] [--predict ...]   (no GPU)
  tpfuser check [--preset P] [--dtype D ...] [--dp N --tp N] [--share-gpu]  fusions vs the reference
  tpfuser bench [--preset P] [--dp N --tp N] [--train] [--startup] [--json F]
  tpfuser main  the check of every dtype if GPUs exist, else the block, its plan and its fusions in brief

Every command takes --schedule NAME or --schedule-file FILE (parallel/schedules.py).
Every refusal is one line on stderr and exit status 2, before any work.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

import torch

from tpfuser.bench.cli import add_bench_arguments, bench_main
from tpfuser.config import PRESETS, preset
from tpfuser.dist.launch import arm_stack_dumps, check_shared_gpu_fits, relaunch
from tpfuser.dist.world import check_launch, in_launcher
from tpfuser.outputs import ArgParser, Signalled, check_distinct, check_writable, write_json
from tpfuser.parallel.overlap_model import (BUSBW_GBPS, TFLOPS, check_chunks, check_rates, format_overlap,
                                            overlap_model)
from tpfuser.parallel.report import format_plan, plan_report
from tpfuser.parallel.schedule_options import check_schedule, resolve_schedule, schedule_args, schedule_files
from tpfuser.parallel.linear_schedule import graphs_refused
from tpfuser.parallel.schedules import known_failure
from tpfuser.predict.command import add_predict_arguments, check_predict_arguments, predict_command, predict_files
from tpfuser.verify.dtypes import check_side_by_side, side_by_side_refusal
from tpfuser.verify.meshes import run_checks

# Deferred to the commands that run fusions: tpfuser.parallel.passes and
# tpfuser.verify.inspect (show, main), tpfuser.runtime.chunked (check). They
# import nvFuser, which `plan` and every refusal must not: under a launcher
# without CUDA its import aborts the process at exit, and check's
# --collectives sets NVFUSER_DUMP first (nvFuser reads its options once).

NO_GPU = "no CUDA device here: running the fusions needs a CUDA GPU (show and plan work without one)"


def _block_args(p: argparse.ArgumentParser, several_dtypes: bool = False, dtype_default: str = "the preset's") -> None:
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="(default: tiny)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], nargs="+" if several_dtypes else None,
                   help="one or more (check) " * several_dtypes + f"(default: {dtype_default})")
    p.add_argument("--dropout", type=float, default=None, help="default: the preset's")
    p.add_argument("--n-head", type=int, default=None, help="the heads (default: the preset's; n_embd stays)")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="sequence parallelism over the tp axis "
                   "(the default schedule becomes megatron-sp-cut-linears)")
    schedule_args(p)


def _cfg(args):
    """The block, its layout and schedule, checked against each other (before a fusion is defined)."""
    overrides = {k: v for k, v in (("dtype", args.dtype), ("dropout", args.dropout),
                                   ("n_head", getattr(args, "n_head", None))) if v is not None}
    cfg, schedule = preset(args.preset, **overrides), resolve_schedule(args)
    layout = schedule.layout(args.dp, args.tp)
    layout.check(cfg)
    check_schedule(args, schedule, cfg, layout)
    return cfg, layout, schedule


def _check_cfgs(args):
    """One block config per dtype asked for (check takes several), the layout and the schedule."""
    dtypes = args.dtype if isinstance(args.dtype, list) else [args.dtype]
    triples = [_cfg(argparse.Namespace(**{**vars(args), "dtype": dtype})) for dtype in dtypes]
    return [cfg for cfg, _, _ in triples], triples[0][1], triples[0][2]


# Per command: does it run ranks (so a launcher's world must be dp*tp), does it import nvFuser.
_RUNS_RANKS = {"show": False, "plan": False, "check": True, "main": True}
_IMPORTS_NVFUSER = {"show": True, "plan": False, "check": True, "main": True}


def preflight(args) -> None:
    """What can be refused before any work is: the block, layout and schedule,
    output paths, a launch that contradicts itself or the mesh, a launch
    without CUDA (world.check_launch), `check` without a GPU."""
    cfgs, layout, schedule = _check_cfgs(args)
    if args.command == "plan":
        check_rates(args.bandwidth, args.tflops, given=args.predict or args.overlap is not None)
        if args.overlap is not None:
            check_chunks(cfgs[0], layout, args.overlap)
        if args.predict:
            check_predict_arguments(cfgs[0], layout, schedule, args)
    check_distinct({f"--{o}": getattr(args, o, None) for o in ("json", "png")},   # (first: whatever their names)
                   {**schedule_files(args), **predict_files(args)})
    for option in ("json", "png"):
        check_writable(getattr(args, option, None), f"--{option}")
    check_launch(layout if _RUNS_RANKS[args.command] else None, nvfuser=_IMPORTS_NVFUSER[args.command])
    if _RUNS_RANKS[args.command]:
        refused = known_failure(cfgs[0], layout, schedule)
        if refused:
            raise ValueError(refused)
    if getattr(args, "graphs", False) and (refused := graphs_refused(schedule)):
        raise ValueError(f"--graphs: {refused}")
    if args.command == "check" and _cuda_count() == 0:
        raise ValueError(NO_GPU)


def cmd_show(args) -> int:
    from tpfuser.parallel.passes import build_pass
    from tpfuser.verify.inspect import pass_summary, pass_text
    cfg, layout, schedule = _cfg(args)
    kind = "backward" if args.backward else "forward"
    built = build_pass(cfg, schedule.form(), kind, layout, split_unit_axes=schedule.split_unit_axes)
    if args.host_ir:
        from tpfuser.verify.inspect import host_ir_text
        print(host_ir_text(cfg, layout, schedule))
    elif args.ir or args.names:
        print(pass_text(built, names=args.names))
    else:
        from tpfuser.runtime.chunked import chunked_pieces
        phase = "backward" if args.backward else "forward"
        beside = {point: c for (p, point), c in chunked_pieces(schedule, cfg, layout).items() if p == phase}
        print(pass_summary(built, schedule, beside))
    return 0


def cmd_plan(args) -> int:
    cfg, layout, schedule = _cfg(args)
    out = sys.stderr if args.json == "-" else sys.stdout   # `--json -`: the JSON alone on standard output
    rep = plan_report(cfg, layout, args.preset, schedule)
    print(format_plan(rep), file=out)
    if args.overlap is not None:
        rep["overlap"] = overlap_model(cfg, layout, args.overlap, args.bandwidth, args.tflops)
        print(file=out)
        print(format_overlap(rep["overlap"]), file=out)
    if args.predict:
        with contextlib.redirect_stdout(out):
            rep["prediction"] = predict_command(cfg, layout, schedule, args)
    if args.json is not None:
        write_json(args.json, rep)
    return 0


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cmd_check(args) -> int:
    cfgs, layout, schedule = _check_cfgs(args)
    args.schedule = schedule
    if args.collectives:   # before nvFuser is imported: it reads its options once (host_ir: a ring's P2P steps)
        os.environ["NVFUSER_DUMP"] = ",".join(filter(None, [os.environ.get("NVFUSER_DUMP"), "communication",
                                                            "host_ir" if schedule.overlapped("ring") else ""]))
    if layout.world_size > 1 and not in_launcher():
        if args.share_gpu:
            for cfg in cfgs:
                check_shared_gpu_fits(cfg, layout, torch.cuda.mem_get_info(0)[0])
        return relaunch(layout, share_gpu=args.share_gpu, schedule=schedule)
    from tpfuser.runtime.chunked import check_connections
    check_connections(schedule)
    if len(cfgs) > 1 and layout.world_size == 1 and not in_launcher():
        free = torch.cuda.mem_get_info(0)[0] if _cuda_count() > 0 else None
        why = side_by_side_refusal(cfgs, layout, free)
        if why is None:
            return check_side_by_side(cfgs, layout, args)
        print(f"checking {', '.join(cfg.dtype for cfg in cfgs)} one after another: {why}", file=sys.stderr)
    return run_checks(cfgs, layout, args)


def cmd_main(args) -> int:
    """On a GPU: the check of every dtype, as a table. Without one: what a
    newcomer needs first, the block, the plan and the fusions in brief."""
    cfg, layout, schedule = _cfg(args)
    dtypes = ("fp32", "bf16") if args.dtype is None else (args.dtype,)
    if _cuda_count() > 0:
        args.dtype = list(dtypes)
        args.forward_only, args.collectives, args.share_gpu, args.json = False, False, False, None
        args.graphs = False
        return cmd_check(args)
    from tpfuser.parallel.passes import build_forward
    from tpfuser.verify.inspect import pass_summary
    print(f"{args.preset}: one GPT-2 block, batch {cfg.batch}, seq {cfg.seq}, n_embd {cfg.n_embd}, {cfg.n_head} heads "
          f"of {cfg.head_dim}, dropout {cfg.dropout}, {cfg.dtype}; mesh dp {layout.dp} x tp {layout.tp}")
    print()
    print(format_plan(plan_report(cfg, layout, args.preset, schedule)))
    print()
    print(pass_summary(build_forward(cfg, layout, schedule=schedule), schedule))
    print()
    print(f"{NO_GPU}; `tpfuser show --preset {args.preset} --ir` prints the fusions' full IR")
    return 0


def _parser(argv) -> ArgParser:
    parser = ArgParser(prog="tpfuser", description="Megatron-style sharded GPT block in nvFuser")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, hlp in (("show", cmd_show, "print the fusions (a summary; --ir for nvFuser's text)"),
                          ("plan", cmd_plan, "print the sharding plan, its collectives and (--predict) its timeline"),
                          ("check", cmd_check, "check the fusions against the reference on GPU"),
                          ("main", cmd_main, "check on GPUs if any, else show the fusions and plan")):
        p = sub.add_parser(name, help=hlp)
        _block_args(p, several_dtypes=name == "check",
                    dtype_default="fp32 and bf16 on a GPU, the preset's without" if name == "main" else "the preset's")
        p.set_defaults(fn=fn)
        if name == "show":
            p.add_argument("--ir", action="store_true", help="nvFuser's full text of each fusion")
            p.add_argument("--names", action="store_true", help="--ir with the block's tensor names beside nvFuser's")
            p.add_argument("--backward", action="store_true", help="the backward's fusions, not the forward's")
            p.add_argument("--host-ir", action="store_true",
                           help="the host IR nvFuser lowers a stream-chunked linear to (overlap 'streams')")
        if name == "plan":
            p.add_argument("--json", default=None, help="also write the plan as JSON here (- for standard output)")
            p.add_argument("--overlap", type=int, default=None, metavar="N",
                           help="also the forward-only overlap model with every collective in N chunks")
            p.add_argument("--bandwidth", type=float, default=None,
                           help=f"bus bandwidth for --overlap, GB/s (default {BUSBW_GBPS:.0f}, assumed); with "
                                f"--predict it replaces every table by this flat rate, no latency (chunks look free)")
            p.add_argument("--tflops", type=float, default=None,
                           help=f"matmul rate for --overlap, TFLOP/s (default {TFLOPS:.0f}, measured on an H200)")
            add_predict_arguments(p)
        if name == "check":
            p.add_argument("--forward-only", action="store_true", help="skip the training forward and backward")
            p.add_argument("--collectives", action="store_true",
                           help="also compare the collectives nvFuser posts with the plan's (NVFUSER_DUMP=communication)")
            p.add_argument("--share-gpu", action="store_true",
                           help="run dp*tp ranks on fewer GPUs (several ranks per GPU, through NCCL's socket "
                                "transport): for checking a layout, not for timing")
            p.add_argument("--graphs", action="store_true",
                           help="also replay the forward and the training step from CUDA graphs and compare "
                                "them with the called block, bit for bit")
            p.add_argument("--json", default=None, help="also write every rank's results here (rank 0 writes)")
    p = sub.add_parser("bench", help="benchmark against the peers, called and replayed from CUDA graphs")
    add_bench_arguments(p)
    schedule_args(p)
    p.set_defaults(fn=lambda args: bench_main(args, argv[1:]))
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # named by the command they were given to
        parser._subparsers._group_actions[0].choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        arm_stack_dumps()   # where this process (a rank) is: kill -USR1, or before its run's bound
        if args.command == "bench":   # its own refusals and exit codes (bench.cli)
            return args.fn(args)
        preflight(args)
        return args.fn(args)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (SIGINT): every rank started was ended", file=sys.stderr)
        return 128 + signal.SIGINT
    except Signalled as e:   # (launch.Ended too: ranks ended with this process)
        print(e.line, file=sys.stderr)
        return 128 + e.signum
    except BrokenPipeError:   # `tpfuser plan | head`: the reader left; no traceback at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
