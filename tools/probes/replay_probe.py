"""Does a bf16 training step replayed from a CUDA graph still equal the called
block after other work ran in its process? Run 27 had two such GPU tests fail
(tiny, dropout 0.1: most output elements 1-3 bf16 ulps apart at the first
step), each after a nanogpt bf16 check with dropout in the same pytest process;
they passed in run 22, where no such check came before them. Run 28 ran this
probe (then on the default block, with the splits) and nothing reproduced it.
Run 30: the tiny bf16 check with graphs failed its replays with the unit-axis
splits, right after the same check without them (test_gpu.py), which passed.
So the trial's block has the splits (split_unit_axes=True), and suspect
`unsplit_check` is run 30's predecessor.

    python3 tools/probes/replay_probe.py SUSPECT [--after-only]   (on a GPU; a few minutes; SUSPECTS below)

In a fresh process: the trial (test_train_step_replay_equals_the_called_block's
steps on a block with the unit-axis splits: a block called, then its train
step replayed, at offsets 3 and 4), then the suspect, then the trial again on
a new block; --after-only leaves out the first trial (as in run 30, where the
split block's first replay came after the suspect). The last line says
whether the replay equalled the call before and after, and whether the call
after equalled the call before (if it did, the replay is what moved). Run
each suspect in its own process (gpu_suite step `replay` runs them side by
side, REPLAY_ARGS=--after-only passing the flag to each)."""

from __future__ import annotations

import sys
import time

import torch

import tpfuser.verify.check as check_mod
import tpfuser.verify.oracle as oracle_mod
from tpfuser.config import Layout, preset
from tpfuser.runtime.graphs import GraphedTrainStep
from tpfuser.verify.reference import make_block, make_input
from tpfuser.parallel.schedules import SCHEDULES
from tpfuser.runtime.block import ShardedBlock

TINY = preset("tiny", dtype="bf16", dropout=0.1)
NANOGPT = preset("nanogpt", dtype="bf16", dropout=0.1)


def _reference_without_eager():
    oracle_mod.eager_errors = lambda *args: {}   # the reference as before d5759b8: float32, flash replayed
    oracle_mod.reference(oracle_mod.Case(NANOGPT), torch.device("cuda"), backward=False)


def _called_nanogpt_block():
    block = ShardedBlock(NANOGPT, check=True).load(make_block(NANOGPT).state_dict())
    block(block.shard_input(make_input(NANOGPT)), 1234, 0)


SUSPECTS = {
    "nothing": lambda: None,   # the control: a second trial in the same process
    "check_forward": lambda: check_mod.check_forward(NANOGPT, Layout(1, 1), preset_name="nanogpt"),   # run 27's
    "reference": lambda: oracle_mod.reference(oracle_mod.Case(NANOGPT), torch.device("cuda"), backward=False),
    "reference_without_eager": _reference_without_eager,
    "called_block": _called_nanogpt_block,
    "manual_seed": lambda: torch.cuda.manual_seed(99),   # as test_masks_reproducible_and_offset_sensitive does
    # run 30's: the tiny bf16 check with graphs, without the unit-axis splits (the default)
    "unsplit_check": lambda: check_mod.check(oracle_mod.Case(TINY, Layout(1, 1)), preset_name="tiny", graphs=True),
}


def trial(state: dict) -> tuple[bool, list[torch.Tensor], str]:
    """(replay equals call at both offsets, the calls' outputs, a description of the differences)."""
    # the form that failed: the single fusion (as before the schedules), device keys, unit axes split
    called = ShardedBlock(TINY, schedule=SCHEDULES["megatron-whole"].replace(keys_on_device=True, split_unit_axes=True))
    called.load(state)
    step = GraphedTrainStep(called)
    x = called.shard_input(make_input(TINY))
    grad_out = torch.randn_like(x)
    equal, outs, notes = True, [], []
    for offset in (3, 4):
        named, saved = called.forward_train(x, 2, offset)
        grad_x, grads = called.backward(grad_out, x, saved)
        out_r, grad_x_r, grads_r = step(x, grad_out, 2, offset)
        same = {"out": torch.equal(named["out"], out_r), "grad_x": torch.equal(grad_x, grad_x_r),
                "grads": all(torch.equal(a, b) for a, b in zip(grads, grads_r))}
        diff = (named["out"].float() - out_r.float()).abs()
        equal &= all(same.values())
        outs.append(named["out"].clone())
        notes.append(f"offset {offset}: " + ", ".join(f"{k} {'equal' if v else 'DIFFERS'}" for k, v in same.items())
                     + f" (out: {(diff > 0).float().mean().item():.0%} of elements differ, max {diff.max().item():.3g})")
    return equal, outs, "; ".join(notes)


def main(argv: list[str]) -> int:
    after_only = "--after-only" in argv
    args = [a for a in argv if a != "--after-only"]
    if len(args) != 1 or args[0] not in SUSPECTS:
        raise SystemExit(f"usage: replay_probe.py SUSPECT [--after-only], SUSPECT one of: {', '.join(SUSPECTS)} "
                         f"(got {argv})")
    name, start = args[0], time.time()
    state = make_block(TINY).state_dict()
    before, outs_before = None, None
    if not after_only:
        before, outs_before, notes = trial(state)
        print(f"[{time.time() - start:4.0f} s] {name}: before: {notes}", flush=True)
    SUSPECTS[name]()
    print(f"[{time.time() - start:4.0f} s] {name}: the suspect ran", flush=True)
    after, outs_after, notes = trial(state)
    print(f"[{time.time() - start:4.0f} s] {name}: after: {notes}", flush=True)
    if after_only:
        print(f"replay_probe {name}: replay equals call after it {after} (no trial before)")
        return 0 if after else 1
    call_moved = not all(torch.equal(a, b) for a, b in zip(outs_before, outs_after))
    print(f"replay_probe {name}: replay equals call before {before}, after {after}; "
          f"the call {'moved' if call_moved else 'did not move'}")
    return 0 if before and after else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
