"""A model of what overlapping the tensor-parallel collectives with their GEMMs can win.

Each forward collective sits next to one linear (plan.collectives): under
TP+SP an all-gather before each column-parallel linear and a reduce-scatter
after each row-parallel one; under TP an all-reduce after each row-parallel
linear. Cut the rank's sequence into N chunks and each such linear into N
GEMMs: chunk i's communication runs while another chunk's GEMM computes. With
c the collective's time and g its GEMM's, whole:

    serial      c + g
    overlapped  c/N + g/N + (N - 1) max(c, g)/N      (fill, steady state, drain)

c = the bytes each rank sends (ring algorithms, plan.Collective) over the bus
bandwidth; g = the GEMM's FLOPs per rank over the matmul rate. Both rates are
stated by the caller, not measured here; the rest of the block (attention,
LayerNorms, elementwise work) is counted at the matmul rate for its FLOPs only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpfuser.config import BlockConfig, Layout
from tpfuser.parallel.collectives import Collective, forward_collectives
from tpfuser.parallel.placements import forward_flops

# Stated defaults, to be replaced by the caller's own figures:
BUSBW_GBPS = 360.0    # an assumed NCCL bus bandwidth over 8 NVLink GPUs; `tpfuser bench --tp N` measures it
TFLOPS = 689.0        # bf16 matmul rate at gpt3's GEMM shapes, measured on one H200 (docs/history.md)


@dataclass(frozen=True)
class Step:
    """One collective and the GEMM it can hide behind, in milliseconds."""

    collective: Collective
    gemm: str            # the linear next to it (forward_flops' name)
    comm_ms: float
    gemm_ms: float
    chunks: int

    @property
    def serial_ms(self) -> float:
        return self.comm_ms + self.gemm_ms

    @property
    def overlapped_ms(self) -> float:
        n, c, g = self.chunks, self.comm_ms, self.gemm_ms
        return c / n + g / n + (n - 1) * max(c, g) / n

    @property
    def exposed_ms(self) -> float:
        """The communication time the GEMM does not hide, overlapped."""
        return self.overlapped_ms - self.gemm_ms


def check_chunks(cfg: BlockConfig, layout: Layout, chunks: int) -> None:
    """Refuse a chunk count that does not cut the rank's sequence evenly."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"--overlap={chunks!r}: must be a positive number of chunks")
    tokens = cfg.seq // layout.tp if layout.sp else cfg.seq
    what = f"the rank's sequence slice seq/tp = {cfg.seq}/{layout.tp} = {tokens}" if layout.sp else f"seq = {cfg.seq}"
    if tokens % chunks:
        raise ValueError(f"--overlap={chunks}: must divide {what} (each chunk is a piece of the sequence)")


def check_rates(busbw_gbps: float | None, tflops: float | None, given: bool = True) -> None:
    """Refuse a rate that is not positive and finite, or one given without the
    option it is for (given=False: neither --overlap nor --predict asked)."""
    for name, value in (("bandwidth", busbw_gbps), ("tflops", tflops)):
        if value is None:
            continue
        if not given:
            raise ValueError(f"--{name}={value!r}: a rate for --overlap or --predict, and neither was given")
        if not value > 0 or value == float("inf"):
            raise ValueError(f"--{name}={value!r}: must be a positive, finite rate")


def overlap_model(cfg: BlockConfig, layout: Layout, chunks: int, busbw_gbps: float | None = None,
                  tflops: float | None = None) -> dict:
    """The forward's collectives with and without overlap, per rank, and the block's totals."""
    busbw_gbps = BUSBW_GBPS if busbw_gbps is None else busbw_gbps
    tflops = TFLOPS if tflops is None else tflops
    layout.check(cfg)
    check_chunks(cfg, layout, chunks)
    check_rates(busbw_gbps, tflops)
    flops = forward_flops(cfg, layout)
    steps = [Step(c, c.linear, c.wire_bytes_per_rank / (busbw_gbps * 1e9) * 1e3,
                  flops[c.linear] / (tflops * 1e12) * 1e3, chunks) for c in forward_collectives(cfg, layout)]
    compute_ms = flops["total"] / (tflops * 1e12) * 1e3
    comm_ms = sum(s.comm_ms for s in steps)
    exposed_ms = sum(s.exposed_ms for s in steps)
    return {
        "chunks": chunks, "busbw_gbps": busbw_gbps, "tflops": tflops,
        "steps": [{"kind": s.collective.kind, "where": s.collective.where, "wire_bytes_per_rank":
                   s.collective.wire_bytes_per_rank, "comm_ms": s.comm_ms, "gemm": s.gemm, "gemm_ms": s.gemm_ms,
                   "serial_ms": s.serial_ms, "overlapped_ms": s.overlapped_ms, "exposed_ms": s.exposed_ms}
                  for s in steps],
        "matmul_ms": compute_ms,
        "exposed_comm_ms": {"serial": comm_ms, "overlapped": exposed_ms},
        "forward_ms": {"serial": compute_ms + comm_ms, "overlapped": compute_ms + exposed_ms},
    }


def format_overlap(model: dict) -> str:
    lines = [f"overlap model, forward, {model['chunks']} chunks, at {model['busbw_gbps']:.0f} GB/s bus bandwidth "
             f"and {model['tflops']:.0f} TFLOP/s (stated, not measured here):",
             f"  {'collective':<40}{'comm ms':>9}{'GEMM':>14}{'GEMM ms':>9}{'serial':>9}{'overlapped':>11}{'exposed':>9}"]
    for s in model["steps"]:
        lines.append(f"  {s['kind'] + ' ' + s['where']:<40}{s['comm_ms']:9.3f}{s['gemm']:>14}{s['gemm_ms']:9.3f}"
                     f"{s['serial_ms']:9.3f}{s['overlapped_ms']:11.3f}{s['exposed_ms']:9.3f}")
    e, f = model["exposed_comm_ms"], model["forward_ms"]
    lines.append(f"  exposed communication: {e['serial']:.3f} ms serial, {e['overlapped']:.3f} ms overlapped; "
                 f"matmuls {model['matmul_ms']:.3f} ms; forward (matmuls + exposed communication): "
                 f"{f['serial']:.3f} ms serial, {f['overlapped']:.3f} ms overlapped")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# The same decomposition in plain PyTorch (async collectives on the process
# group's own stream, GEMMs on the caller's): the reference an overlapped
# fusion is checked and timed against. Rows are tokens (b*s flattened, or s).

def allgather_matmul(x_local, weight, group, chunks: int):
    """y = all_gather(x) @ weight^T under sequence parallelism, the gather cut in
    `chunks`: x_local [t/tp, n_in] is this rank's slice of the tokens (rank-major),
    weight [n_out, n_in] a column-parallel shard; returns y [t, n_out], all tokens.
    Chunk i holds piece i of every rank's slice; chunk i+1 is gathered while
    chunk i's GEMM runs."""
    tp = dist.get_world_size(group)
    pieces = [p.contiguous() for p in x_local.chunk(chunks, dim=0)]

    def gather(i):
        buf = x_local.new_empty((tp * pieces[i].shape[0], x_local.shape[1]))
        return buf, dist.all_gather_into_tensor(buf, pieces[i], group=group, async_op=True)
    outs, pending = [], gather(0)
    for i in range(len(pieces)):
        buf, work = pending
        work.wait()
        if i + 1 < len(pieces):
            pending = gather(i + 1)
        outs.append((buf @ weight.T).view(tp, -1, weight.shape[0]))   # (rank, piece rows, n_out)
    return torch.cat(outs, dim=1).reshape(-1, weight.shape[0])        # rank-major: the global token order


def matmul_reducescatter(h, weight, group, chunks: int):
    """reduce_scatter(h @ weight^T) under sequence parallelism, cut in `chunks`:
    h [t, n_in/tp] all tokens of a row-parallel input shard, weight [n_out, n_in/tp];
    returns this rank's slice [t/tp, n_out] of the sum over ranks. Chunk i is
    piece i of every rank's slice: its partial products are reduce-scattered
    while chunk i+1's GEMM runs."""
    tp = dist.get_world_size(group)
    t = h.shape[0]
    if t % (tp * chunks):
        raise ValueError(f"chunks={chunks}: must divide the rank's token slice {t}/{tp}")
    rows = h.view(tp, chunks, t // (tp * chunks), h.shape[1])        # (rank, chunk, rows, n_in/tp)
    outs, works = [], []
    for i in range(chunks):
        partial = (rows[:, i].reshape(-1, h.shape[1]) @ weight.T).contiguous()   # every rank's piece i, partial
        outs.append(partial.new_empty((partial.shape[0] // tp, weight.shape[0])))
        works.append(dist.reduce_scatter_tensor(outs[-1], partial, group=group, async_op=True))
    for work in works:
        work.wait()
    return torch.cat(outs, dim=0)
