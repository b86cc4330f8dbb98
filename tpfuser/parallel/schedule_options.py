"""The command line's options naming a schedule (--schedule, --schedule-file,
--chunks; with --sp), shared by `tpfuser` and `tpfuser bench`, and the
schedule they give (resolve_schedule), refused in one line where they disagree."""

from __future__ import annotations

import argparse
import os

from tpfuser.config import Layout
from tpfuser.parallel.linear_schedule import ChunksRefused
from tpfuser.parallel.schedules import SCHEDULES, default_schedule, load_schedule


def schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default=None, metavar="NAME",
                   help=f"a named schedule: {', '.join(SCHEDULES)} (default: megatron-cut-linears, or megatron-sp-cut-linears with --sp)")
    p.add_argument("--schedule-file", default=None, metavar="FILE", help="a schedule as JSON (README: Schedules)")
    p.add_argument("--chunks", type=int, default=None, metavar="N",
                   help="stream chunks for every linear the schedule chunks (overrides its count; 1 runs them whole)")


def resolve_schedule(args):
    """The schedule the options name (at most one of --schedule, --schedule-file),
    and --sp and --chunks applied to it; refused in one line where they disagree."""
    if args.schedule and args.schedule_file:
        raise ValueError("--schedule and --schedule-file: give one of them")
    spec = args.schedule or args.schedule_file or default_schedule(Layout(sp=bool(getattr(args, "sp", False)))).name
    if args.schedule_file:
        check_readable(args.schedule_file, "--schedule-file")
    schedule = load_schedule(spec)
    if getattr(args, "sp", False) and not schedule.sequence_parallel:
        given = f"--schedule-file={args.schedule_file!r}" if args.schedule_file else f"--schedule {schedule.name!r}"
        raise ValueError(f"--sp with {given}, which is not sequence-parallel: "
                         f"drop --sp or name a sequence-parallel schedule (megatron-sp-cut-linears)")
    if args.chunks is not None:
        if isinstance(args.chunks, bool) or not isinstance(args.chunks, int) or args.chunks < 1:
            raise ValueError(f"--chunks: expected a positive int (stream chunks along the tokens), got {args.chunks!r}")
        if not schedule.chunked():
            raise ValueError(f"--chunks={args.chunks}: schedule {schedule.name!r} chunks no linear "
                             f"(an overlapped schedule does: megatron-overlap, megatron-sp-overlap)")
        if rings := schedule.overlapped("ring"):
            raise ValueError(f"--chunks={args.chunks}: schedule {schedule.name!r} runs {', '.join(rings)} as rings, "
                             f"a step per rank of tp; --chunks sets the chunks of overlap 'fusions' or 'streams'")
        given = {"chunks": args.chunks, **({"overlap": "none"} if args.chunks == 1 else {})}   # 1: run them whole
        linears = {name: plan.__class__(**{**plan.__dict__, **given}) if plan.chunks > 1 else plan
                   for name, plan in schedule.linears.items()}
        schedule = schedule.replace(name=f"{schedule.name}/{args.chunks}", linears=linears)
    return schedule


def check_schedule(args, schedule, cfg, layout) -> None:
    """schedule.check, its chunks refused as --chunks where that option set them."""
    try:
        schedule.check(cfg, layout)
    except ChunksRefused as e:
        if getattr(args, "chunks", None) is None:
            raise
        raise ValueError(f"--chunks={args.chunks}: expected a divisor of {e.what} = {e.rows}") from None


def check_readable(path: str, option: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"{option}={path!r}: not a file")


def schedule_files(args) -> dict:
    """The schedule file the options read, by option (an output must not be it)."""
    return {"--schedule-file": getattr(args, "schedule_file", None)}

