"""Probe (run 13), the ground for graph-safe dropout (issue 15): a dropout key
as a CUDA int64 tensor input of a meshed fusion (0-d, or [1] with `1d`),
hashed with global positions (tpfuser.block.dropout), then a row-parallel linear
(an all-reduce over tp). Called, then captured in a CUDA graph and replayed
after writing a new key into the static key tensor: each replay's mask must
be the new key's.

    torchrun --standalone --nproc-per-node 2 --no-python .nvf/share_gpu.sh \
        python3 tools/probes/probe_device_keys.py [0d|1d]
"""
import os
import sys

import torch
import nvfuser_direct as nvf
from nvfuser_direct import DataType, FusionDefinition, ParallelType

from tpfuser.block.dropout import hash_positions, keep_threshold, keep_mask
from tpfuser.block.ops import global_positions, int_ops

comm = nvf.multidevice.Communicator.instance()
tp, rank = comm.size(), comm.rank()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
mesh = nvf.multidevice.DeviceMesh(torch.arange(tp))
b, e = 8, 32 * tp
p = 0.25
with FusionDefinition() as fd:
    x = fd.define_tensor(shape=[b, e], contiguity=True, dtype=DataType.Float)
    KEY_SHAPE = [] if sys.argv[1:] != ["1d"] else [1]
    key = fd.define_tensor(shape=KEY_SHAPE, contiguity=True, dtype=DataType.Int)
    key_in = key if not KEY_SHAPE else fd.ops.squeeze(key, dims=[0])
    start = fd.define_scalar(dtype=DataType.Int)
    index = global_positions(fd, [b, e], [None, start])
    keep = fd.ops.lt(hash_positions(index, key_in, int_ops(fd)), fd.define_scalar(keep_threshold(p), dtype=DataType.Int))
    y = fd.ops.mul(x, fd.ops.cast(keep, DataType.Float))
    wt = fd.define_tensor(shape=[4, e], contiguity=True, dtype=DataType.Float)
    total = fd.ops.linear(y, wt)   # row-parallel: all-reduced over tp
    fd.add_output(y)
    fd.add_output(total)
    for tv, dim in ((x, 1), (key, None), (wt, 1), (y, 1), (total, None)):
        tv.set_device_mesh(mesh)
        if dim is not None:
            tv.outer_split(dim, tp)
            tv.axis(dim).parallelize(ParallelType.mesh_x)


def expected(k, X):
    m = keep_mask(k, p, (b, e), device="cuda")
    Y = X * m
    return Y.chunk(tp, dim=1)[rank], Y @ WT.T


def report(label, fn):
    try:
        print(f"rank {rank} tp {tp} key {sys.argv[1:]} {label}: {fn()}", flush=True)
    except Exception as ex:  # noqa: BLE001
        text = str(ex)
        line = next((ln for ln in text.splitlines() if "Expected" in ln or "rror" in ln), text.splitlines()[0] if text else repr(ex))
        print(f"rank {rank} tp {tp} key {sys.argv[1:]} {label}: FAILED: {line[:300]}", flush=True)


torch.manual_seed(0)
X = torch.randn(b, e, device="cuda")
WT = torch.randn(4, e, device="cuda")
WT_mine = WT.chunk(tp, dim=1)[rank].contiguous()
mine = X.chunk(tp, dim=1)[rank].contiguous()
start_v = rank * (e // tp)
K1, K2 = 0x1234567, 0x2345678901
static_key = torch.tensor(K1, dtype=torch.int64, device="cuda")
if sys.argv[1:] == ["1d"]:
    static_key = static_key.view(1)


def called():
    y, total = fd.execute([mine, static_key, start_v, WT_mine])
    ey, et = expected(K1, X)
    return f"y equal {torch.equal(y, ey)}, sum err {(total - et).abs().max().item():.1e}"


report("called", called)


def graphed():
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fd.execute([mine, static_key, start_v, WT_mine])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = fd.execute([mine, static_key, start_v, WT_mine])
    res = []
    for k in (K1, K2):
        static_key.fill_(k)
        g.replay()
        torch.cuda.synchronize()
        ey, et = expected(k, X)
        res.append(f"key {k:#x}: y equal {torch.equal(outs[0], ey)}, sum err {(outs[1] - et).abs().max().item():.1e}")
    return "; ".join(res)


report("graphed", graphed)
sys.stdout.flush()
os._exit(0)
