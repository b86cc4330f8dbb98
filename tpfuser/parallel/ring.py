"""nvFuser's P2P ring decompositions of a tensor-parallel linear's collective
(a schedule's overlap "ring"), on one dp row's tp devices.

Written as nvFuser's own tests write them (NVIDIA/Fuser's
tests/python/multidevice/test_overlap.py) and lowered by its MultiDeviceExecutor with
`offset_stream_indexing_by_rank`: the stream axis has tp steps, and in step i
rank r works on the chunk of rank (r + i) mod tp, so that each step's GEMM
runs on the chunk in hand while the next one travels (host IR: a FOR over
the steps, one send and one receive in each but the rank's own; by NCCL's
send/recv, or with the `cuda` backend by the copy engine over CUDA IPC).

  all-gather + GEMM   y = all_gather(x) W^T + b: x [tp, t, k], its first axis
                      split over tp (rank r's t tokens); W [n, k], b [n] the
                      rank's column-parallel shard, passed whole. y [tp, t, n],
                      its first axis the stream: step i's GEMM reads the
                      chunk received in it.
  GEMM + reduce-scatter  y = reduce_scatter(a B): a [tp, tp, t, k], axis 0
                      split over tp (the rank's k-slice of the contraction),
                      axis 1 the stream (whose tokens); B [tp, 1, k, n], axis 0
                      split over tp. Step i computes the partial product of the
                      tokens rank (r + i) mod tp keeps and sends it there;
                      each rank sums the tp partials it received: y [tp, t, n],
                      axis 0 split over tp. The partial products are resharded
                      by a set of their own (one input, so nvFuser's pass puts
                      the resharding after the matmul, as NVFUSER_ENABLE=
                      insert_resharding_after would: without it, and without
                      the set, nvFuser lowers a ring that sends the inputs).
"""

from __future__ import annotations

import torch
import nvfuser_direct as nvf
from nvfuser_direct import FusionDefinition, ParallelType

from tpfuser.block.ops import NV_DTYPE

RING_FORMS = ("allgather", "reducescatter")


def row_mesh(tp: int, dp_rank: int):
    """dp rank `dp_rank`'s tp devices, a 1-D mesh."""
    return nvf.multidevice.DeviceMesh(torch.arange(dp_rank * tp, (dp_rank + 1) * tp))


def allgather_linear(tp: int, tokens: int, k: int, n: int, dtype: torch.dtype, dp_rank: int = 0,
                     bias: bool = True) -> FusionDefinition:
    """The all-gather + GEMM ring (module docstring): inputs x [tp, tokens, k] (a rank's: [1, tokens, k]),
    W [n, k] (and b [n]); output [tp, tokens, n], every rank's tokens, rank-major."""
    nv = NV_DTYPE[dtype]
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[tp, tokens, k], contiguity=True, dtype=nv)
        w = fd.define_tensor(shape=[n, k], contiguity=True, dtype=nv)
        b = fd.define_tensor(shape=[n], contiguity=True, dtype=nv) if bias else None
        out = fd.ops.linear(x, w, b)            # [tp, tokens, n]
        fd.add_output(out)
        mesh = row_mesh(tp, dp_rank)
        for tv in (x, w, b, out):
            if tv is not None:
                tv.set_device_mesh(mesh)
        x.axis(0).parallelize(ParallelType.mesh_x)
        out.axis(0).parallelize(ParallelType.stream)
    return fd


def matmul_reducescatter(tp: int, tokens: int, k: int, n: int, dtype: torch.dtype,
                         dp_rank: int = 0) -> FusionDefinition:
    """The GEMM + reduce-scatter ring (module docstring): inputs a [tp, tp, tokens, k] (a rank's:
    [1, tp, tokens, k], its k-slice of every rank's tokens), B [tp, 1, k, n] (a rank's: [1, 1, k, n]);
    output [tp, tokens, n] split over tp (a rank's: [1, tokens, n], the sum over ranks of its tokens')."""
    nv = NV_DTYPE[dtype]
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=[tp, tp, tokens, k], contiguity=True, dtype=nv)
        b = fd.define_tensor(shape=[tp, 1, k, n], contiguity=True, dtype=nv)
        partial = fd.ops.matmul(a, b)           # [tp (k-slice), tp (whose tokens), tokens, n], placed as a
        moved = fd.ops.set(partial)             # ... sent: each to the rank whose tokens it holds
        out = fd.ops.sum(moved, 0)              # [tp (whose tokens), tokens, n]
        fd.add_output(out)
        mesh = row_mesh(tp, dp_rank)
        for tv in (a, b, partial, moved, out):
            tv.set_device_mesh(mesh)
        for tv in (a, partial):
            tv.axis(0).parallelize(ParallelType.mesh_x)
            tv.axis(1).parallelize(ParallelType.stream)
        b.axis(0).parallelize(ParallelType.mesh_x)
        moved.axis(0).parallelize(ParallelType.stream)
        moved.axis(1).parallelize(ParallelType.mesh_x)
        out.axis(1).parallelize(ParallelType.mesh_x)
    return fd


def ring_executor(fd: FusionDefinition, form: str, backend: str):
    """nvFuser's MultiDeviceExecutor for a ring fusion: a step per rank offset by the rank, the output's
    memory kept from call to call (the caller copies it out before the next), `backend` nccl or cuda."""
    if form not in RING_FORMS:
        raise ValueError(f"ring form {form!r}: expected one of {', '.join(RING_FORMS)}")
    params = nvf.multidevice.MultiDeviceExecutorParams()
    params.backend_type = getattr(nvf.CommunicatorBackend, backend)
    params.offset_stream_indexing_by_rank = True
    params.use_allocation_cache = True
    return nvf.multidevice.MultiDeviceExecutor(fd.fusion, params)

