"""Overlapped linears: one tensor-parallel linear and its collective cut into
`chunks` along the tokens, each chunk on its own stream (ParallelType.stream),
so that chunk i's collective runs beside another chunk's GEMM. Standalone
fusions of the block's shapes, written as nvFuser's own overlap tests write
them (tests/python/multidevice/test_overlap.py: test_row_parallel_linear_forward,
test_overlap_allgather_matmul_stream_outermost). tools/overlap_check.py runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import nvfuser_direct as nvf
from nvfuser_direct import FusionDefinition, ParallelType

from tpfuser.block.ops import NV_DTYPE
from tpfuser.block.pieces import Piece
from tpfuser.config import Layout
from tpfuser.parallel.placements import DP, TP
from tpfuser.parallel.passes import apply_placement, make_mesh, validate

@dataclass
class OverlapFusion:
    fd: FusionDefinition
    kind: str          # "row-parallel all-reduce" or "all-gather column-parallel"
    chunks: int
    tp: int
    inputs: list = field(default_factory=list)
    output: object = None


def row_parallel_overlapped(tokens: int, n_in: int, n_out: int, tp: int, chunks: int,
                            dtype: torch.dtype = torch.bfloat16) -> OverlapFusion:
    """out [t, n_out] = h [t, n_in] @ W^T, h and W split on n_in over tp (the
    MLP's c_proj: the partial sums all-reduced), the tokens cut into `chunks`
    streams: each chunk's all-reduce follows its own GEMM. Run with
    execute(..., _enable_options=["host_ir_lowering"]) (OVERLAP_OPTIONS)."""
    if tokens % chunks or n_in % tp:
        raise ValueError(f"row-parallel overlap: chunks={chunks} must divide the tokens ({tokens}) "
                         f"and tp={tp} the inner size ({n_in})")
    with FusionDefinition() as fd:
        h = fd.define_tensor(shape=[tokens, n_in], contiguity=True, dtype=NV_DTYPE[dtype])
        w = fd.define_tensor(shape=[n_out, n_in], contiguity=True, dtype=NV_DTYPE[dtype])
        out = fd.ops.linear(h, w)
        fd.add_output(out)
        mesh = make_mesh(Layout(1, tp), row=0)   # a 1-D mesh of tp devices
        for tv in (h, w):
            tv.set_device_mesh(mesh)
        h.outer_split(0, chunks)
        h.axis(0).parallelize(ParallelType.stream)
        h.outer_split(2, tp)
        h.axis(2).parallelize(ParallelType.mesh_x)
        w.outer_split(1, tp)
        w.axis(1).parallelize(ParallelType.mesh_x)
    return OverlapFusion(fd, "row-parallel all-reduce", chunks, tp, [h, w], out)


def allgather_column_parallel_overlapped(tokens: int, n_in: int, n_out: int, tp: int, chunks: int,
                                         dtype: torch.dtype = torch.bfloat16) -> OverlapFusion:
    """Under sequence parallelism: out = all_gather(x) @ W^T + b, x's tokens split
    over tp, each rank's slice cut into `chunks`; x is [chunks, tp, t/(chunks tp), n_in]
    (rank r's local [chunks, rows, n_in] is its slice viewed so), W [n_out, n_in]
    and b whole (a column-parallel shard). The output's chunk axis is a stream:
    chunk i's all-gather runs beside chunk i-1's GEMM. Run with
    nvfuser_direct.multidevice.MultiDeviceExecutor, as nvFuser's test does."""
    if tokens % (chunks * tp):
        raise ValueError(f"all-gather overlap: chunks={chunks} x tp={tp} must divide the tokens ({tokens})")
    with FusionDefinition() as fd:
        nv = NV_DTYPE[dtype]
        x = fd.define_tensor(shape=[chunks, tp, tokens // (chunks * tp), n_in], contiguity=True, dtype=nv)
        w = fd.define_tensor(shape=[n_out, n_in], contiguity=True, dtype=nv)
        b = fd.define_tensor(shape=[n_out], contiguity=True, dtype=nv)
        out = fd.ops.linear(x, w, b)   # [chunks, tp, rows, n_out]
        fd.add_output(out)
        mesh = make_mesh(Layout(1, tp), row=0)   # a 1-D mesh of tp devices
        for tv in (x, w, b, out):
            tv.set_device_mesh(mesh)
        x.axis(1).parallelize(ParallelType.mesh_x)
        out.axis(0).parallelize(ParallelType.stream)
    return OverlapFusion(fd, "all-gather column-parallel", chunks, tp, [x, w, b], out)


OVERLAP_OPTIONS = {"_enable_options": ["host_ir_lowering"], "_disable_options": ["infer_contiguity"]}


def run_allgather_overlapped(of: OverlapFusion, inputs: list):
    """Execute an all-gather overlap fusion the way nvFuser's own test does."""
    executor = getattr(of, "_executor", None)
    if executor is None:
        params = nvf.multidevice.MultiDeviceExecutorParams()
        params.backend_type = nvf.CommunicatorBackend.nccl
        executor = of._executor = nvf.multidevice.MultiDeviceExecutor(of.fd.fusion, params)
    return executor.run(inputs)


# ---------------------------------------------------------------------------
# One chunk of a block's linear, as a meshed fusion of its own (a schedule's
# overlap "fusions": runtime/chunked.py launches one per chunk on side streams).
# Each is defined on the chunk's global shape and placed like the block's
# tensors, so nvFuser posts the chunk's collective itself. Three patterns, by
# where the collective is (the token axis each cuts, per rank):
#   rows     the partial sums of a product over a tp-split contraction, all-reduced
#            (tensor parallelism: a row-parallel linear; a column-parallel
#            linear's input gradient). A chunk: rows of the rank's b x s tokens.
#   gather   the tokens all-gathered before a column-parallel linear (sequence
#            parallelism). A chunk: the same slice of every rank's part of the
#            sequence, gathered: [b, tp, c] tokens.
#   scatter  the partial sums reduce-scattered (sequence parallelism: a
#            row-parallel linear; a column-parallel linear's input gradient).
#            A chunk: the tokens that land in the same slice of every rank's part.
PATTERNS = ("rows", "gather", "scatter")


def chunk_fusion(op: str, pattern: str, a_shape: tuple[int, ...], w_shape: tuple[int, int], bias: bool,
                 dtype: torch.dtype, layout: Layout, row: int | None = None, split_unit_axes: bool = False):
    """One chunk of `op` ("linear": out = a W^T (+ bias), W [n, k]; "matmul":
    out = a W, W [k, n]) under `pattern`, on the chunk's global shapes
    (a_shape: rows [t, k], gather and scatter [b, tp * c, k]), placed on the
    dp x tp mesh, or with `row` on that dp rank's tp devices alone. Returns
    the FusionDefinition; its input order is (a, W[, bias])."""
    if pattern not in PATTERNS or op not in ("linear", "matmul"):
        raise ValueError(f"chunk fusion {op!r} {pattern!r}: expected linear or matmul, and one of {PATTERNS}")
    contract = {"linear": 1, "matmul": 0}[op]           # W's contracted dimension
    nv = NV_DTYPE[dtype]
    dp = {} if row is not None else {0: DP}
    with FusionDefinition() as fd:
        a = fd.define_tensor(shape=list(a_shape), contiguity=True, dtype=nv)
        w = fd.define_tensor(shape=list(w_shape), contiguity=True, dtype=nv)
        b = fd.define_tensor(shape=[w_shape[0]], contiguity=True, dtype=nv) if bias else None
        out = fd.ops.linear(a, w, b) if op == "linear" else fd.ops.matmul(a, w)
        fd.add_output(out)
        mesh = make_mesh(layout, row)
        last = len(a_shape) - 1
        if pattern == "gather":   # a split over tp on its tokens, W (and the bias) on its output rows
            placed = [(a, dp | {1: TP}, None), (w, {1 - contract: TP}, None), (out, dp | {last: TP}, None)]
            if b is not None:
                placed.append((b, {0: TP}, None))
        else:                     # the contraction split over tp, the partial sums reduced
            placed = [(a, dp | {last: TP}, None), (w, {contract: TP}, None),
                      (out, dp | ({1: TP} if pattern == "scatter" else {}), TP)]
        for tv, placement, reduced in placed:
            tv.set_device_mesh(mesh)
            apply_placement(tv, placement, layout, split_unit_axes, reduced)
        validate(Piece("chunk", fd, outputs={"out": out}))
    return fd
