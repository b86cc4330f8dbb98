"""The parameter gradients' sum over dp, after the backward fusion
(ShardedBlock.sum_over_dp, world.dp_group), on the CPU: four gloo ranks of
a 2x2 layout, each summing with the rank holding its tp shard in the other dp
row; and the benchmark's per-sample slowest rank (bench/run.py's _slowest_rank) of
every rank's samples (bench/run.py's _every_rank)."""
import os
import tempfile

import torch
import torch.multiprocessing as mp

from tpfuser.config import Layout, preset


def _rank(rank, world, init_file, results):
    import torch.distributed as dist
    from tpfuser.dist.world import dp_group
    from tpfuser.runtime.block import ShardedBlock
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        layout = Layout(2, 2)
        block = ShardedBlock(preset("tiny", dtype="bf16"), layout, rank, device=torch.device("cpu"),
                             dp_group=dp_group(layout, rank))
        grads = [torch.full((3, 2), float(rank), dtype=torch.bfloat16), torch.arange(4.0) * (rank + 1)]
        summed = block.sum_over_dp(grads)
        from tpfuser.bench.run import _every_rank, _slowest_rank
        every = _every_rank({"a": [float(rank), 10.0 - rank]}, 4)
        slowest = [every[3]["a"]] + _slowest_rank(every)["a"]
        results[rank] = [g.tolist() for g in summed] + [str(t.dtype) for t in summed] + [slowest]
    finally:
        dist.destroy_process_group()


def test_parameter_gradients_are_summed_over_the_dp_group_only():
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.get_context("spawn").Manager().dict()
        mp.spawn(_rank, args=(4, os.path.join(tmp, "init"), results), nprocs=4, join=True)
        results = dict(results)
    # ranks 0 and 2 hold tp shard 0, ranks 1 and 3 tp shard 1 (rank = dp_rank * tp + tp_rank)
    for rank in range(4):
        partner = (rank + 2) % 4
        filled, ramp, dtype_a, dtype_b, slowest = results[rank]
        assert slowest == [[3.0, 7.0], 3.0, 10.0]     # rank 3's samples; each sample's largest over the ranks
        assert filled == [[float(rank + partner)] * 2] * 3
        assert ramp == [i * (rank + 1 + partner + 1) for i in range(4)]
        assert (dtype_a, dtype_b) == ("torch.bfloat16", "torch.float32")   # each gradient keeps its dtype


def test_backward_without_a_dp_group_is_refused_when_dp_is_two():
    import pytest
    from tpfuser.runtime.block import ShardedBlock
    block = ShardedBlock(preset("tiny"), Layout(2, 1), 0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="dp=2: the parameter gradients are summed over dp"):
        block.backward(None, None, [])
