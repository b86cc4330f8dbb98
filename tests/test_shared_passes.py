"""Blocks that define the same fusions share them in a process (runtime/block.py
shared_pass), so nvFuser compiles them once; anything that changes a fusion or
how it is compiled gives a pass of its own. Built on the CPU, nothing run."""
import torch

from tpfuser.config import Layout, preset
from tpfuser.parallel.schedules import SCHEDULES
from tpfuser.runtime.block import ShardedBlock
from tpfuser.runtime.shared import forget_fusions

CPU = torch.device("cpu")


def test_blocks_defining_the_same_fusions_share_them():
    cfg = preset("tiny", dtype="fp32")
    a, b = (ShardedBlock(cfg, Layout(1, 2), rank, device=CPU) for rank in (0, 1))   # tp ranks: one definition
    for kind in ("forward", "train", "backward"):
        assert a.pass_of(kind) is b.pass_of(kind)
    assert a.pass_of("forward", dropout=False) is b.pass_of("forward", dropout=False)
    assert a.pass_of("forward", dropout=False) is not a.pass_of("forward")


def test_whatever_changes_a_fusion_or_its_compile_gives_its_own():
    cfg = preset("tiny", dtype="fp32")
    base = ShardedBlock(cfg, Layout(1, 2), device=CPU).pass_of("forward")
    default = SCHEDULES["megatron-cut-linears"]   # the layout's default schedule (what base is built under)
    others = {
        "dtype": ShardedBlock(preset("tiny", dtype="bf16"), Layout(1, 2), device=CPU),
        "check": ShardedBlock(cfg, Layout(1, 2), check=True, device=CPU),
        "mesh": ShardedBlock(cfg, Layout(2, 2), device=CPU),
        "cuts": ShardedBlock(cfg, Layout(1, 2), device=CPU, schedule="megatron"),
        "keys": ShardedBlock(cfg, Layout(1, 2), device=CPU, schedule=default.replace(keys_on_device=True)),
        "options": ShardedBlock(cfg, Layout(1, 2), device=CPU,
                                schedule=default.replace(disable_options=("infer_contiguity",))),
        "one fusion's options": ShardedBlock(cfg, Layout(1, 2), device=CPU, schedule=default.replace(
            fusion_options={"mlp.c_fc.out": {"disable_options": ["infer_contiguity"]}})),
        "device": ShardedBlock(cfg, Layout(1, 2), device=torch.device("cuda", 1)),
    }
    for why, block in others.items():
        assert block.pass_of("forward") is not base, why
    # the backward of another dp rank runs on its own rows of the mesh
    rank0, rank2 = (ShardedBlock(cfg, Layout(2, 2), rank, device=CPU) for rank in (0, 2))
    assert rank0.pass_of("backward") is not rank2.pass_of("backward")
    assert rank0.pass_of("forward") is rank2.pass_of("forward")   # the whole mesh's, the same text
    assert rank0.pass_of("forward").text() == rank2.pass_of("forward").text()


def test_forget_fusions_drops_them():
    cfg = preset("tiny", dtype="fp32")
    first = ShardedBlock(cfg, Layout(1, 2), device=CPU).pass_of("forward")
    assert forget_fusions() >= 1
    again = ShardedBlock(cfg, Layout(1, 2), device=CPU).pass_of("forward")
    assert again is not first and again.text() == first.text()
