"""Minimal nvFuser 0.2.36 reproducer: a strided slice with one head per rank.

q and k are sliced out of qkv [b, s, h*3d] (rows head by head, as Megatron
orders them) and multiplied; qkv's heads are split over tp. With h == tp (one
head per rank) execution fails in validateAllocationSizesAndStrides: the slice
output's size-1 head axis is marked non-contiguous and the sequence axis
contiguous, but the validator skips the size-1 axis and expects the sequence
stride to be d (it is 3d). With h == 2 tp it runs.

    torchrun --nproc-per-node 2 [share_gpu.sh] python3 tools/repro_one_head.py HEADS
"""
import os
import sys

import torch
import nvfuser_direct as nvf
from nvfuser_direct import DataType, FusionDefinition, ParallelType

heads = int(sys.argv[1])
b, s, d = 2, 8, 8
comm = nvf.multidevice.Communicator.instance()
tp, rank = comm.size(), comm.rank()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
mesh = nvf.multidevice.DeviceMesh(torch.arange(tp))
with FusionDefinition() as fd:
    qkv = fd.define_tensor(shape=[b, s, heads * 3 * d], contiguity=True, dtype=DataType.Float)
    t = fd.ops.reshape(qkv, new_shape=[b, s, heads, 3 * d])                       # (b, s, h, 3d)
    q, k = (fd.ops.permute(fd.ops.slice(t, start_indices=[0, 0, 0, i * d], end_indices=[b, s, heads, (i + 1) * d]),
                           dims=[0, 2, 1, 3]) for i in range(2))                  # (b, h, s, d)
    scores = fd.ops.matmul(q, fd.ops.permute(k, dims=[0, 1, 3, 2]))               # (b, h, s, s)
    fd.add_output(scores)
    for tv, dim in ((qkv, 2), (scores, 1)):
        tv.set_device_mesh(mesh)
        tv.outer_split(dim, tp)
        tv.axis(dim).parallelize(ParallelType.mesh_x)
full = torch.randn(b, s, heads * 3 * d, device="cuda")
mine = full.chunk(tp, dim=2)[rank].contiguous()
try:
    (out,) = fd.execute([mine])
    view = full.view(b, s, heads, 3, d)
    qf, kf = view[:, :, :, 0].transpose(1, 2), view[:, :, :, 1].transpose(1, 2)
    expected = (qf @ kf.transpose(-1, -2)).chunk(tp, dim=1)[rank]
    print(f"rank {rank}: heads {heads} tp {tp}: ran, max error {(out - expected).abs().max().item():.1e}", flush=True)
except RuntimeError as e:
    line = next((ln for ln in str(e).splitlines() if "Expected" in ln), str(e).splitlines()[0])
    print(f"rank {rank}: heads {heads} tp {tp}: FAILED: {line[:400]}", flush=True)
sys.stdout.flush()
os._exit(0)
