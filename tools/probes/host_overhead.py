"""Our own host time per call: ShardedBlock's Python around nvFuser, with the
fusions' execute faked (no GPU needed; nvFuser's own host time is not in it).

    python3 tools/probes/host_overhead.py [--preset tiny] [--calls 2000] [--profile]

Prints microseconds per forward call and per training step (forward_train and
backward) with dropout on, fp32 (bf16's flash-attention generator calls need a
GPU). The figure moves with the CPU: compare before and after on one machine.
"""
from __future__ import annotations

import argparse
import time

import torch

from tpfuser.config import Layout, preset
from tpfuser.verify.reference import make_block
from tpfuser.runtime.block import ShardedBlock
from tpfuser.runtime.shared import forget_fusions


def faked_block(name: str, layout: Layout = Layout(), schedule=None) -> ShardedBlock:
    """A block on the CPU (under `schedule`, default the layout's) whose fusions return zeros at once."""
    cfg = preset(name, dtype="fp32")
    forget_fusions()   # its passes its own: faked here, they must not be another block's (runtime/shared.py shares them)
    block = ShardedBlock(cfg, layout, 0, device=torch.device("cpu"), schedule=schedule)
    block._validate = lambda *args: None   # it asks for a CUDA device
    block.load(make_block(cfg).state_dict())
    for kind in ("forward", "train", "backward"):
        for piece in block.pass_of(kind, True).pieces:
            outs = [torch.zeros(1) for _ in piece.outputs]
            piece.execute = (lambda o: lambda inputs, *args, **kwargs: o)(outs)
    forget_fusions()   # nor another block's later
    return block


def per_call_us(block: ShardedBlock, calls: int) -> dict[str, float]:
    cfg = block.cfg
    x = torch.zeros(cfg.batch, cfg.seq, cfg.n_embd)
    start = time.perf_counter()
    for i in range(calls):
        block(x, 0, i)
    forward = (time.perf_counter() - start) / calls * 1e6
    start = time.perf_counter()
    for i in range(calls):
        _, saved = block.forward_train(x, 0, i)
        block.backward(x, x, saved)
    step = (time.perf_counter() - start) / calls * 1e6
    return {"forward_us": round(forward, 1), "train_step_us": round(step, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="also the heaviest functions of the forward calls")
    args = ap.parse_args(argv)
    block = faked_block(args.preset)
    per_call_us(block, 50)   # warm
    print(f"{args.preset} fp32, dropout {block.cfg.dropout}: {per_call_us(block, args.calls)}")
    if args.profile:
        import cProfile
        import pstats
        x = torch.zeros(block.cfg.batch, block.cfg.seq, block.cfg.n_embd)
        profile = cProfile.Profile()
        profile.runcall(lambda: [block(x, 0, i) for i in range(args.calls)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
