"""The DTensor tensor-parallel peer (tpfuser/bench/peers.py), run on the CPU: two
ranks over gloo, each checking its forward output and the gathered gradients
against the unsharded reference."""
import os
import tempfile

import pytest
import torch.multiprocessing as mp

from tpfuser.config import preset
from tpfuser.verify.reference import make_block, make_input


def _rank(rank, world, init_file, results):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from tpfuser.bench.peers import dtensor_block, full_grads
    from tpfuser.verify.reference import sdpa_forward
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = preset("tiny", dtype="fp32", dropout=0.0)
        ref = make_block(cfg).double()
        x, g = make_input(cfg).double(), make_input(cfg, seed=2).double()
        block = dtensor_block(ref, init_device_mesh("cpu", (world,)))
        out = sdpa_forward(block, x, 0.0, heads_interleaved=True)
        out.backward(g)
        expected = ref(x)
        expected.backward(g)
        errors = {"out": ((out - expected).norm() / expected.norm()).item()}
        ref_grads = dict(ref.named_parameters())
        for name, grad in full_grads(block).items():
            errors[name] = ((grad - ref_grads[name].grad).norm() / ref_grads[name].grad.norm()).item()
        shard_rows = block.attn.c_attn.weight.to_local().shape[0]
        results[rank] = {"errors": errors, "c_attn_local_rows": shard_rows}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2])
def test_dtensor_peer_matches_reference_float64(world):
    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.get_context("spawn").Manager()
        results = manager.dict()
        mp.spawn(_rank, args=(world, os.path.join(tmp, "init"), results), nprocs=world, join=True)
        results = dict(results)
    cfg = preset("tiny")
    for rank in range(world):
        r = results[rank]
        assert r["c_attn_local_rows"] == 3 * cfg.n_embd // world     # sharded, not replicated
        bad = {k: v for k, v in r["errors"].items() if not v < 1e-10}
        assert not bad, (rank, bad)
