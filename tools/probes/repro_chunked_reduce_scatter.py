"""nvFuser 0.2.36: a row-parallel linear whose reduce-scatter is chunked on the
stream axis, in the three ways a fusion can be run; prints each one's result
or the first line of its error (docs/overlap.md quotes them).

    TPFUSER_DEFAULT_STREAM_SHIM=$(python3 -c "from tpfuser.dist.sharegpu import build_default_stream_shim as b; print(b())") \
    torchrun --nproc-per-node 2 -m tpfuser.dist.sharegpu --script tools/probes/repro_chunked_reduce_scatter.py
    (ranks sharing a GPU: tpfuser.dist.sharegpu sets each up and preloads the default-stream shim)

out [t, n] = h [t, k] W^T with k split over tp and the output's tokens split over
tp (a reduce-scatter), the reduction axis split too (as nvFuser's own
test_linear_reduce_scatter), and the tokens cut into 2 stream chunks first.
"""
import os
import sys

import torch
import nvfuser_direct as nvf
from nvfuser_direct import DataType, FusionDefinition, ParallelType

T, K, N, CHUNKS = 16, 8, 4, 2


def define(tp: int, stream: bool = True) -> FusionDefinition:
    with FusionDefinition() as fd:
        h = fd.define_tensor([T, K], contiguity=True, dtype=DataType.Float)
        w = fd.define_tensor([N, K], contiguity=True, dtype=DataType.Float)
        out = fd.ops.linear(h, w)
        fd.add_output(out)
        mesh = nvf.multidevice.DeviceMesh(torch.arange(tp))
        for tv in (h, w, out):
            tv.set_device_mesh(mesh)
        h.outer_split(1, tp)
        h.axis(1).parallelize(ParallelType.mesh_x)
        w.outer_split(1, tp)
        w.axis(1).parallelize(ParallelType.mesh_x)
        out.outer_split(2, tp)                      # the reduction axis rK
        out.axis(2).parallelize(ParallelType.mesh_x)
        if stream:
            out.outer_split(0, CHUNKS)
            out.axis(0).parallelize(ParallelType.stream)
            out.outer_split(1, tp)                  # the chunk's tokens over tp
            out.axis(1).parallelize(ParallelType.mesh_x)
        else:
            out.outer_split(0, tp)
            out.axis(0).parallelize(ParallelType.mesh_x)
    return fd


def main() -> int:
    comm = nvf.multidevice.Communicator.instance()
    tp, rank = comm.size(), comm.rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(0)
    h, w = torch.randn(T, K), torch.randn(N, K)
    expected = (h.double() @ w.double().T).float()
    h_l, w_l = (t.chunk(tp, dim=1)[rank].contiguous().cuda() for t in (h, w))
    # the chunked output: each chunk's tokens over tp, so rank r holds rows r of each chunk
    want = torch.cat([c.chunk(tp, dim=0)[rank] for c in expected.chunk(CHUNKS, dim=0)])
    ways = {
        "unchunked, fd.execute": lambda: define(tp, stream=False).execute([h_l, w_l]),
        "host_ir_lowering": lambda: define(tp).execute([h_l, w_l], _enable_options=["host_ir_lowering"],
                                                       _disable_options=["infer_contiguity"]),
        "MultiDeviceExecutor": lambda: nvf.multidevice.MultiDeviceExecutor(
            define(tp).fusion, nvf.multidevice.MultiDeviceExecutorParams()).run([h_l, w_l]),
        "fd.execute": lambda: define(tp).execute([h_l, w_l]),
    }
    for name, run in ways.items():
        try:
            (out,) = run()
            target = expected.chunk(tp, dim=0)[rank] if name.startswith("unchunked") else want
            err = ((out.cpu().double() - target.double()).norm() / target.double().norm()).item()
            line = f"ran, rel err {err:.1e}"
        except Exception as e:   # noqa: BLE001 - the point is the error
            line = "error: " + next((s for s in str(e).splitlines() if s.strip()), type(e).__name__)[:300]
        print(f"rank {rank}: {name}: {line}", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
