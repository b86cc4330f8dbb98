"""Command line: a thin layer over the Python API.

  tpfuser show  [--preset P] [--dtype D] [--dp N --tp N]   print the fusion (no GPU)
  tpfuser plan  [--preset P] [--dp N --tp N] [--json F]    shardings, collectives, FLOPs (no GPU)
  tpfuser check [--preset P] [--dtype D] [--dp N --tp N]   fusion vs reference on GPUs
  tpfuser bench [--preset P] [--dp N --tp N] [--train] [--json F]   nvFuser vs eager, torch.compile, DTensor
  tpfuser main                                              check if GPUs exist, else show + plan
"""

from __future__ import annotations

import argparse
import json
import sys

from tpfuser.config import PRESETS, Layout, preset

NO_GPU = "no CUDA device here: running the fusion needs a CUDA GPU (show and plan work without one)"


def _block_args(p: argparse.ArgumentParser, several_dtypes: bool = False) -> None:
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], nargs="+" if several_dtypes else None,
                   help="one or more (check) " * several_dtypes + "(default: the preset's)")
    p.add_argument("--dropout", type=float, default=None, help="default: the preset's")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sp", action="store_true", help="add sequence parallelism over the tp axis")


def _cfg(args):
    overrides = {k: v for k, v in (("dtype", args.dtype), ("dropout", args.dropout)) if v is not None}
    return preset(args.preset, **overrides), Layout(args.dp, args.tp, args.sp)


def cmd_show(args) -> int:
    from tpfuser.fusion import build_forward, fusion_text
    cfg, layout = _cfg(args)
    print(fusion_text(build_forward(cfg, layout)))
    return 0


def cmd_plan(args) -> int:
    from tpfuser.report import format_plan, plan_report
    cfg, layout = _cfg(args)
    rep = plan_report(cfg, layout, args.preset)
    print(format_plan(rep))
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 0


def _cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_cfgs(args):
    """One block config per dtype asked for (check takes several), and the layout."""
    pairs = [_cfg(argparse.Namespace(**{**vars(args), "dtype": dtype})) for dtype in args.dtype or [None]]
    return [cfg for cfg, _ in pairs], pairs[0][1]


def cmd_check(args) -> int:
    cfgs, layout = _check_cfgs(args)
    for cfg in cfgs:
        layout.check(cfg)
    if args.collectives:   # before nvFuser is imported: it reads its options once
        import os
        os.environ["NVFUSER_DUMP"] = ",".join(filter(None, [os.environ.get("NVFUSER_DUMP"), "communication"]))
    if _cuda_count() == 0:
        print(NO_GPU, file=sys.stderr)
        return 2
    from tpfuser.launch import in_launcher, relaunch
    if layout.world_size > 1 and not in_launcher():
        if args.share_gpu:
            import torch
            from tpfuser.launch import check_shared_gpu_fits
            for cfg in cfgs:
                check_shared_gpu_fits(cfg, layout, torch.cuda.mem_get_info(0)[0])
        return relaunch(layout, share_gpu=args.share_gpu)
    from tpfuser.meshcheck import run_checks
    return run_checks(cfgs, layout, args)


def cmd_main(args) -> int:
    if _cuda_count() > 0:
        args.dtype = ["fp32", "bf16"]
        args.forward_only, args.collectives, args.share_gpu, args.json = False, False, False, None
        return cmd_check(args)
    cmd_show(args)
    print()
    cmd_plan(args)
    print()
    print(NO_GPU)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from tpfuser.bench import main as bench_main
        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="tpfuser", description="Megatron-style sharded GPT block in nvFuser")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, hlp in (("show", cmd_show, "print the fusion definition"),
                          ("plan", cmd_plan, "print the sharding plan"),
                          ("check", cmd_check, "check the fusion against the reference on GPU"),
                          ("main", cmd_main, "check on GPUs if any, else show the fusion and plan")):
        p = sub.add_parser(name, help=hlp)
        _block_args(p, several_dtypes=name in ("check", "main"))
        if name == "plan":
            p.add_argument("--json", default=None, help="also write the plan as JSON here")
        if name == "check":
            p.add_argument("--forward-only", action="store_true", help="skip the training forward and backward")
            p.add_argument("--collectives", action="store_true",
                           help="also compare the collectives nvFuser posts with the plan's (NVFUSER_DUMP=communication)")
            p.add_argument("--share-gpu", action="store_true",
                           help="run dp*tp ranks on fewer GPUs (several ranks per GPU, through NCCL's socket "
                                "transport): for checking a layout, not for timing")
            p.add_argument("--json", default=None, help="also write every rank's results here (rank 0 writes)")
        p.set_defaults(fn=fn)
    # Listed for --help only: `bench` is dispatched above, with its own options.
    sub.add_parser("bench", help="benchmark against the peers (see: tpfuser bench --help)")
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
