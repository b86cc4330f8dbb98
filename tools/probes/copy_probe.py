"""Which op launches each copy kernel of the training step? Run 29's nanogpt
bf16 step had 5 strided-copy kernels (ATen's `direct_copy` elementwise_kernel,
0.057 ms a step, the largest GPU work compile-reduce-overhead does not do).
Inferred from nvFuser's and ATen's source, never probed: backward_inputs'
`.contiguous()` of q, k, v and attention's output (nvFuser wrote them as
flash attention holds them) and flash attention's backward making its output
contiguous in its own layout again. Since aef3010 the block keeps all four in
flash attention's layout, and the probe's first run (run 31) found none.

    python3 tools/probes/copy_probe.py [--preset nanogpt] [--dtype bf16]   (on a GPU; a minute or two)

Profiles one called training step (forward_train, then backward; the kernels a
CUDA graph of it replays) with shapes and Python stacks, and prints, for every
op that launched a copy kernel: the kernel, the op, its input shapes, and the
innermost frames of ours (tpfuser/) that led to it: backward_inputs' line
for its `.contiguous()`, the line calling execute for a copy made inside
nvFuser (flash attention's backward among its ATen calls).
"""
from __future__ import annotations

import argparse
import os

import torch

from tpfuser.config import preset
from tpfuser.verify.reference import make_block, make_input
from tpfuser.runtime.block import ShardedBlock

COPY_KERNELS = ("direct_copy", "copy_kernel")


def copy_launches(events) -> list[dict]:
    """From a profile's CPU ops (FunctionEvent-like: name, kernels, input_shapes,
    stack, cpu_children), those that launched a copy kernel themselves (not
    through a child op), innermost first: kernel, op, input shapes, our frames."""
    found = []
    for e in events:
        kernels = [k.name for k in getattr(e, "kernels", [])]
        children = {k.name for c in getattr(e, "cpu_children", []) for k in getattr(c, "kernels", [])}
        for name in kernels:
            if any(tag in name for tag in COPY_KERNELS) and name not in children:
                op = e
                while op.name.startswith("cuda") and getattr(op, "cpu_parent", None) is not None:
                    op = op.cpu_parent   # a kernel tied to the launch call: name the ATen op around it
                ours = [f for f in (getattr(op, "stack", None) or []) if f"tpfuser{os.sep}" in f]
                found.append({"kernel": name[:80], "op": op.name, "shapes": getattr(op, "input_shapes", None),
                              "ours": ours[:3]})
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="nanogpt")
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    cfg = preset(args.preset, dtype=args.dtype, dropout=0.1)
    block = ShardedBlock(cfg).load(make_block(cfg).state_dict())
    x = block.shard_input(make_input(cfg))
    grad_out = torch.randn_like(x)

    def step(offset):
        named, saved = block.forward_train(x, 1, offset)
        block.backward(grad_out, x, saved)
    for i in range(2):   # compile, warm up
        step(i)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as prof:
        step(2)
        torch.cuda.synchronize()
    found = copy_launches(prof.events())
    print(f"copy_probe {args.preset} {args.dtype}: {len(found)} copy kernel launches in one training step")
    for f in found:
        print(f"  {f['op']} {f['shapes']} -> {f['kernel']}\n    ours: {' <- '.join(f['ours']) or 'none (inside execute)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
