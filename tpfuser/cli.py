"""Command line: a thin layer over the Python API.

  tpfuser show  [--preset P] [--dtype D] [--dp N --tp N]   print the fusion (no GPU)
  tpfuser plan  [--preset P] [--dp N --tp N] [--json F]    shardings, collectives, FLOPs (no GPU)
  tpfuser check [--preset P] [--dtype D] [--dp N --tp N]   fusion vs reference on GPUs
  tpfuser bench [--preset P] [--dp N --tp N] [--train] [--json F]   nvFuser vs eager, torch.compile, DTensor
  tpfuser main                                              check if GPUs exist, else a summary of
                                                            the block, the plan and the fusion

Every refusal is one line on stderr and exit status 2, before any work.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from tpfuser.config import PRESETS, Layout, preset

NO_GPU = "no CUDA device here: running the fusion needs a CUDA GPU (show and plan work without one)"


class ArgParser(argparse.ArgumentParser):
    """argparse with its refusals in one line, as every other refusal (no usage block)."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (--help lists the options)\n")


def check_writable(path: str | None, option: str) -> None:
    """Refuse now, not after the work, an output file that cannot be written.
    Trying is the only sure test (permissions say yes to root, /proc says no);
    a file made by trying is removed."""
    if path is None:
        return
    if not path.strip():
        raise ValueError(f"{option}={path!r}: an empty path; give a file name")
    if os.path.isdir(path):
        raise ValueError(f"{option}={path!r}: is a directory; give a file name")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{option}={path!r}: cannot be written ({e.strerror})") from None
    if not existed:
        os.remove(path)


def _block_args(p: argparse.ArgumentParser, several_dtypes: bool = False) -> None:
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], nargs="+" if several_dtypes else None,
                   help="one or more (check) " * several_dtypes + "(default: the preset's)")
    p.add_argument("--dropout", type=float, default=None, help="default: the preset's")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="add sequence parallelism over the tp axis")


def _cfg(args):
    """The block and its layout, checked against each other (before a fusion is defined)."""
    overrides = {k: v for k, v in (("dtype", args.dtype), ("dropout", args.dropout)) if v is not None}
    cfg, layout = preset(args.preset, **overrides), Layout(args.dp, args.tp, args.sp)
    layout.check(cfg)
    return cfg, layout


# Per command: does it run ranks (so a launcher's world must be dp*tp), does it import nvFuser.
_RUNS_RANKS = {"show": False, "plan": False, "check": True, "main": True}
_IMPORTS_NVFUSER = {"show": True, "plan": False, "check": True, "main": True}


def preflight(args) -> None:
    """What can be refused before any work is: the block and layout, output
    paths, a launch that contradicts itself or the mesh, a launch without CUDA
    (world.check_launch), `check` without a GPU."""
    from tpfuser.world import check_launch
    cfgs, layout = _check_cfgs(args)
    if getattr(args, "overlap", None) is not None:
        from tpfuser.overlap import check_chunks, check_rates
        check_chunks(cfgs[0], layout, args.overlap)
        check_rates(args.bandwidth, args.tflops)
    for option in ("json", "png"):
        check_writable(getattr(args, option, None), f"--{option}")
    check_launch(layout if _RUNS_RANKS[args.command] else None, nvfuser=_IMPORTS_NVFUSER[args.command])
    if args.command == "check" and _cuda_count() == 0:
        raise ValueError(NO_GPU)


def cmd_show(args) -> int:
    cfg, layout = _cfg(args)
    from tpfuser.fusion import build_forward, fusion_text
    print(fusion_text(build_forward(cfg, layout)))
    return 0


def cmd_plan(args) -> int:
    from tpfuser.report import format_plan, plan_report
    cfg, layout = _cfg(args)
    rep = plan_report(cfg, layout, args.preset)
    print(format_plan(rep))
    if args.overlap is not None:
        from tpfuser.overlap import format_overlap, overlap_model
        rep["overlap"] = overlap_model(cfg, layout, args.overlap, args.bandwidth, args.tflops)
        print()
        print(format_overlap(rep["overlap"]))
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 0


def _cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_cfgs(args):
    """One block config per dtype asked for (check takes several), and the layout."""
    dtypes = args.dtype if isinstance(args.dtype, list) else [args.dtype]
    pairs = [_cfg(argparse.Namespace(**{**vars(args), "dtype": dtype})) for dtype in dtypes]
    return [cfg for cfg, _ in pairs], pairs[0][1]


def cmd_check(args) -> int:
    cfgs, layout = _check_cfgs(args)
    if args.collectives:   # before nvFuser is imported: it reads its options once
        os.environ["NVFUSER_DUMP"] = ",".join(filter(None, [os.environ.get("NVFUSER_DUMP"), "communication"]))
    from tpfuser.launch import relaunch
    from tpfuser.world import in_launcher
    if layout.world_size > 1 and not in_launcher():
        if args.share_gpu:
            import torch
            from tpfuser.launch import check_shared_gpu_fits
            for cfg in cfgs:
                check_shared_gpu_fits(cfg, layout, torch.cuda.mem_get_info(0)[0])
        return relaunch(layout, share_gpu=args.share_gpu)
    from tpfuser.meshcheck import run_checks
    return run_checks(cfgs, layout, args)


def fusion_summary(ff) -> str:
    """The forward fusion in a few lines: what goes in and out, and which of its
    operations nvFuser hands to ATen (the GEMMs and flash attention), cutting it
    into segments, and which it fuses into kernels of its own between them."""
    from tpfuser.fusion import rng_input_names
    text = ff.fd.fusion.print_math()
    body = text[text.index("%kernel_math"):] if "%kernel_math" in text else text
    def count(pattern):
        return len(re.findall(pattern, body))
    aten = {"linear": count(r"= linear\("), "matmul": count(r"= matmul\("), "flash attention": count(r"= sdpa")}
    n_aten, scalars = sum(aten.values()), len(rng_input_names(ff.cfg))
    reductions = [f"{count(r'= Welford')} LayerNorm statistics (Welford)"] + (
        [f"{count(r'= reduction')} softmax reductions"] if count(r"= reduction") else [])
    return "\n".join([
        f"fusion (forward, {ff.cfg.dtype}): in x and the 12 parameters" + (f", {scalars} dropout scalars" if scalars else "")
        + f"; returns {', '.join(ff.outputs)}; {count(r'(?m)^T[0-9]+_l')} tensor expressions "
        f"({len(text.splitlines())} lines of nvFuser IR)",
        "  run by ATen: " + ", ".join(f"{n} {k}" for k, n in aten.items() if n),
        f"  fused by nvFuser: {', '.join(reductions)}, casts, GELU, dropout hash, residuals, in the "
        f"{n_aten + 1} gaps around the {n_aten} ATen calls (how many kernels each takes, nvFuser decides at the first run on a GPU)",
    ])


def cmd_main(args) -> int:
    """On a GPU: the check of every dtype, as a table. Without one: what a
    newcomer needs first, the block, the plan and the fusion in brief."""
    cfg, layout = _cfg(args)
    dtypes = ("fp32", "bf16") if args.dtype is None else (args.dtype,)
    if _cuda_count() > 0:
        args.dtype = list(dtypes)
        args.forward_only, args.collectives, args.share_gpu, args.json = False, False, False, None
        args.graphs, args.split_unit_axes = False, False
        return cmd_check(args)
    from tpfuser.fusion import build_forward
    from tpfuser.report import format_plan, plan_report
    print(f"{args.preset}: one GPT-2 block, batch {cfg.batch}, seq {cfg.seq}, n_embd {cfg.n_embd}, {cfg.n_head} heads "
          f"of {cfg.head_dim}, dropout {cfg.dropout}, {cfg.dtype}; mesh dp {layout.dp} x tp {layout.tp}")
    print()
    print(format_plan(plan_report(cfg, layout, args.preset)))
    print()
    print(fusion_summary(build_forward(cfg, layout)))
    print()
    print(f"{NO_GPU}; `tpfuser show --preset {args.preset}` prints the fusion's full IR")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from tpfuser.launch import arm_stack_dumps
    arm_stack_dumps()   # where this process (a rank) is: kill -USR1, or before its run's bound
    parser = ArgParser(prog="tpfuser", description="Megatron-style sharded GPT block in nvFuser")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, hlp in (("show", cmd_show, "print the fusion definition"),
                          ("plan", cmd_plan, "print the sharding plan"),
                          ("check", cmd_check, "check the fusion against the reference on GPU"),
                          ("main", cmd_main, "check on GPUs if any, else show the fusion and plan")):
        p = sub.add_parser(name, help=hlp)
        _block_args(p, several_dtypes=name == "check")
        if name == "plan":
            from tpfuser.overlap import BUSBW_GBPS, TFLOPS
            p.add_argument("--json", default=None, help="also write the plan as JSON here")
            p.add_argument("--overlap", type=int, default=None, metavar="N",
                           help="also model each collective overlapped with its GEMM in N chunks of the sequence")
            p.add_argument("--bandwidth", type=float, default=BUSBW_GBPS,
                           help=f"bus bandwidth for --overlap, GB/s (default {BUSBW_GBPS:.0f}, assumed)")
            p.add_argument("--tflops", type=float, default=TFLOPS,
                           help=f"matmul rate for --overlap, TFLOP/s (default {TFLOPS:.0f}, measured on an H200)")
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
            p.add_argument("--unit-splits", dest="split_unit_axes", action="store_true",
                           help="also split over a mesh axis of one device, where nvFuser then posts collectives "
                                "over a team of one (fusion.schedule's split_unit_axes=True; the default until run 30)")
            p.add_argument("--json", default=None, help="also write every rank's results here (rank 0 writes)")
        p.set_defaults(fn=fn)
    from tpfuser import bench
    p = sub.add_parser("bench", help="benchmark against the peers, called and replayed from CUDA graphs")
    bench.add_arguments(p)
    p.set_defaults(fn=lambda args: bench.run(args, argv[1:]))
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # named by the command they were given to
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "bench":   # its own refusals and exit codes (bench.run)
        return args.fn(args)
    try:
        preflight(args)
        return args.fn(args)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
