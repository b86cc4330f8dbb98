"""gather_output across real processes (torch.distributed, gloo, CPU)."""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpfuser.config import Layout
from tpfuser.parallel.placements import placements
from tpfuser.dist.world import gather_output
from tpfuser.parallel.shard import local_slice


def _worker(rank, world, port, layout, full, queue):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        local = local_slice(full, placements(Layout())["out"], layout, rank)
        queue.put((rank, torch.equal(gather_output(local, layout), full)))
    finally:
        dist.destroy_process_group()


def test_gather_output_reassembles_every_ranks_shard():
    layout = Layout(dp=2, tp=2)   # out: batch over dp, replicated over tp
    full = torch.arange(4 * 3 * 2, dtype=torch.float32).view(4, 3, 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 4, port, layout, full, queue)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    results = dict(queue.get(timeout=5) for _ in procs)
    assert results == {0: True, 1: True, 2: True, 3: True}


def test_gather_output_world_of_one_is_identity():
    t = torch.ones(2, 3, 4)
    assert gather_output(t, Layout(1, 1)) is t
