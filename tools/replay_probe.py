"""Does a bf16 training step replayed from a CUDA graph still equal the called
block after other work ran in the process? Run 27 had two such GPU tests fail
(dropout 0.1, a few bf16 ulps apart at the first step), each after a nanogpt
bf16 check with dropout in the same pytest process; they passed in run 22,
where no such check came before them.

    python3 tools/replay_probe.py        (on a GPU; about 2 minutes)

Trials of tiny bf16 (dropout 0.1): a fresh block called, then its train step
replayed, at offsets 3 and 4; first in a fresh process, then after each
suspect in turn: the check's reference at tiny (float32 and eager bf16, flash
replayed), the nanogpt reference's forward, a called nanogpt bf16 block with
dropout. Each line says whether the replay equals the call, whether the call
repeats, and whether it equals the fresh process's call (which side moved)."""

from __future__ import annotations

import time

import torch

from tpfuser.check import Case, reference
from tpfuser.config import preset
from tpfuser.graphs import GraphedTrainStep
from tpfuser.reference import make_block, make_input
from tpfuser.runtime import ShardedBlock

CFG = preset("tiny", dtype="bf16", dropout=0.1)


def trial(tag: str, state: dict, fresh: dict, start: float) -> bool:
    """One fresh block's calls against its graph; True when every one is equal."""
    called = ShardedBlock(CFG, keys_on_device=True).load(state)
    step = GraphedTrainStep(called)
    x = called.shard_input(make_input(CFG))
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(x)
    ok = True
    for offset in (3, 4):
        named, saved = called.forward_train(x, 2, offset)
        out = named["out"].clone()
        grad_x, _ = called.backward(grad_out, x, saved)
        again = called.forward_train(x, 2, offset)[0]["out"].clone()
        out_r, grad_x_r, _ = step(x, grad_out, 2, offset)
        diff = (out.float() - out_r.float()).abs()
        first = fresh.setdefault(offset, out)
        equal = torch.equal(out, out_r) and torch.equal(grad_x, grad_x_r)
        ok &= equal
        print(f"[{time.time() - start:4.0f} s] {tag}, offset {offset}: replay equals call {equal} "
              f"(out max diff {diff.max().item():.3g}, {(diff > 0).float().mean().item():.1%} differ); "
              f"call repeats {torch.equal(out, again)}; call equals the fresh process's {torch.equal(out, first)}",
              flush=True)
    return ok


def main() -> int:
    start, fresh = time.time(), {}
    state = make_block(CFG).state_dict()
    device = torch.device("cuda", torch.cuda.current_device())
    results = {"fresh process": trial("fresh process", state, fresh, start)}
    reference(Case(CFG), device, backward=True)
    results["after tiny's reference"] = trial("after tiny's reference", state, fresh, start)
    nanogpt = preset("nanogpt", dtype="bf16", dropout=0.1)
    reference(Case(nanogpt), device, backward=False)
    results["after nanogpt's reference"] = trial("after nanogpt's reference", state, fresh, start)
    block = ShardedBlock(nanogpt).load(make_block(nanogpt).state_dict())
    block(block.shard_input(make_input(nanogpt)), 1234, 0)
    results["after a called nanogpt block"] = trial("after a called nanogpt block", state, fresh, start)
    print("replay_probe: " + "; ".join(f"{k}: {'equal' if v else 'DIFFERS'}" for k, v in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
