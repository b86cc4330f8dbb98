"""Which outputs of a pass differ between two calls with the same inputs
(the check's repeats), bit for bit: tiny at 1x1 on one GPU, each pass of the
schedule called three times; prints, per output, whether call 2 and call 3
equal call 1, the largest difference and the share of elements that differ.

    python3 tools/probes/repeat_probe.py [--schedule megatron] [--dtype bf16] [--preset tiny]
"""
import argparse
import json

import torch

from tpfuser.block.tensors import BY_NAME
from tpfuser.config import preset
from tpfuser.runtime.block import ShardedBlock
from tpfuser.verify.check import deterministic_attention
from tpfuser.verify.reference import make_block, make_input


def compare(first: dict, again: dict) -> dict:
    out = {}
    for name, a in first.items():
        b = again[name]
        if torch.equal(a, b):
            out[name] = "equal"
            continue
        if name in BY_NAME and BY_NAME[name].unwritten:
            out[name] = "differs (never written: tensors.py)"
            continue
        diff = (a.double() - b.double()).abs() if a.is_floating_point() else (a != b).double()
        out[name] = f"DIFFERS max {diff.max().item():.3g}, {(diff > 0).double().mean().item():.3%} of elements"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="megatron")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--preset", default="tiny")
    args = ap.parse_args()
    cfg = preset(args.preset, dtype=args.dtype)
    ref = make_block(cfg)
    block = ShardedBlock(cfg, schedule=args.schedule).load(ref.state_dict())
    x = block.shard_input(make_input(cfg))
    grad = torch.randn_like(x)
    report = {"schedule": args.schedule, "dtype": args.dtype}
    calls = [block(x, 1234, 0) for _ in range(3)]
    report["forward"] = [compare(calls[0], c) for c in calls[1:]]
    trains = []
    for _ in range(3):
        named, saved = block.forward_train(x, 1234, 0)
        trains.append({**{k: v.clone() for k, v in named.items()},
                       **{n: t.clone() for n, t in zip(block.saved_names(), saved)}})
    report["train"] = [compare(trains[0], t) for t in trains[1:]]
    grads = []
    for _ in range(3):
        named, saved = block.forward_train(x, 1234, 0)
        with deterministic_attention():
            gx, gs = block.backward(grad, x, saved)
        grads.append({"grad_x": gx, **{f"g{i}": g for i, g in enumerate(gs)}})
    report["backward"] = [compare(grads[0], g) for g in grads[1:]]
    print(json.dumps(report, indent=1), flush=True)


if __name__ == "__main__":
    main()
