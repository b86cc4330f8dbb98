"""Chunked linears: a schedule's linears whose collectives run in chunks along
the tokens, each chunk's collective beside another chunk's GEMM.

A chunked linear is a fusion of its own in its pass (the schedule cuts the
pass before and after it); this runs that fusion in chunks instead:
  fusions   a meshed fusion per chunk (parallel/overlapped.chunk_fusion), each
            posting its own collective, launched on side streams forked from
            the caller's stream and joined back (CUDA events): CUDA graphs
            capture it as they capture the rest.
  streams   nvFuser's stream axis, lowered to host IR (fd.execute with
            host_ir_lowering for a row-parallel linear's all-reduce,
            MultiDeviceExecutor for an all-gather before a column-parallel
            one): as nvFuser's own overlap tests run them. Not capturable in
            nvFuser 0.2.36; tensor parallelism over one dp row only.

The race: nvFuser 0.2.36's chunked row-parallel all-reduce (host IR) gave
other bits on a second call at 4 and 8 chunks, and the right ones with
CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue: kernels start in launch
order; Megatron-LM sets it for its own overlap; docs/overlap.md). So every
schedule that chunks runs with it, set before CUDA starts (check_connections).
"""

from __future__ import annotations

import os

import torch

from tpfuser.parallel.overlapped import (OVERLAP_OPTIONS, allgather_column_parallel_overlapped, chunk_fusion,
                                         row_parallel_overlapped, run_allgather_overlapped)
from tpfuser.dist.sharegpu import check_host_ir_device
from tpfuser.parallel.chunking import collective_chunks
from tpfuser.parallel.schedules import COLUMN

CONNECTIONS_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
SIDE_STREAMS = 2   # chunk i runs on side stream i % SIDE_STREAMS: chunk i's collective beside chunk i+1's GEMM


def check_connections(schedule) -> None:
    """Before a chunked schedule runs in this process: set CUDA_DEVICE_MAX_CONNECTIONS=1
    if CUDA has not started yet, else refuse in one line unless it is set so."""
    if not schedule.chunked() or os.environ.get(CONNECTIONS_VAR) == "1":
        return
    if torch.cuda.is_initialized():
        raise ValueError(f"schedule {schedule.name!r} chunks its linears, which needs {CONNECTIONS_VAR}=1 "
                         f"before CUDA starts, and CUDA has started without it (it is "
                         f"{os.environ.get(CONNECTIONS_VAR, 'unset')}): set it in the environment")
    os.environ[CONNECTIONS_VAR] = "1"


def chunked_piece(schedule, kind: str, point: str, sp: bool):
    """(linear, pattern, op, chunks, overlap) where the piece beginning at cut
    `point` of a `kind` pass is a chunked linear whose collective the schedule
    chunks; None where it runs whole."""
    if kind == "backward":
        linear = point.removeprefix("grad:").removesuffix(".in") if point.endswith(".in") else None
        if linear not in COLUMN:
            return None
        phase, collective, op = "backward", "reducescatter" if sp else "allreduce", "matmul"
    else:
        linear = point if point in schedule.linears else None
        if linear is None:
            return None
        column = linear in COLUMN
        if column and not sp:
            return None   # a column-parallel linear's forward posts no collective under tensor parallelism
        phase, op = "forward", "linear"
        collective = "allgather" if column else "reducescatter" if sp else "allreduce"
    chunks, _ = collective_chunks(schedule, linear, collective, phase)
    if chunks == 1:
        return None
    pattern = {"allreduce": "rows", "allgather": "gather", "reducescatter": "scatter"}[collective]
    return linear, pattern, op, chunks, schedule.linears[linear].overlap


class ChunkedLinears:
    """The runners of one block's chunked linears, made at their first use."""

    def __init__(self, block):
        self.block = block
        self._runners: dict = {}
        self._streams: list[torch.cuda.Stream] = []
        check_connections(block.schedule)

    def runner(self, run, piece):
        """A callable running `piece` in chunks (its inputs -> its outputs), or None: run it whole."""
        if not self.block.schedule.chunked() or not piece.point:
            return None
        key = (run.kind, run.cfg.dropout > 0, piece.point)
        if key not in self._runners:
            found = chunked_piece(self.block.schedule, run.kind, piece.point, self.block.layout.sp)
            self._runners[key] = None if found is None else self._make(run, piece, *found)
        return self._runners[key]

    def streams(self) -> list[torch.cuda.Stream]:
        if not self._streams:
            self._streams = [torch.cuda.Stream(device=self.block.device) for _ in range(SIDE_STREAMS)]
        return self._streams

    def _make(self, run, piece, linear, pattern, op, chunks, overlap):
        if overlap == "streams":
            return StreamAxisChunks(self.block, run, piece, linear, pattern, chunks)
        return SideStreamChunks(self, run, piece, linear, pattern, op, chunks)


def chunk_layout(pattern: str, a: torch.Tensor, n_out: int, chunks: int, tp: int):
    """(the rank's whole output, chunk i's input, writing chunk i's output into
    the whole) of a rank's input `a` under a pattern (parallel/overlapped.PATTERNS):
      rows     a [..., k/tp]: chunk i is rows i of the rank's tokens; out [..., n].
      gather   a [b, s/tp, k], the rank's part of the sequence: chunk i its slice
               i of c = s/(tp chunks) positions (a copy where b > 1); the chunk's
               output [b, tp c, n/tp] holds every rank's slice i, rank-major:
               it lands at each rank's part of out [b, s, n/tp].
      scatter  a [b, s, k/tp], the whole sequence: chunk i every rank's part's
               slice i, rank-major ([b, tp c, k/tp], a copy); its output [b, c, n]
               is this rank's slice i of out [b, s/tp, n]."""
    if pattern == "rows":
        rows = a.reshape(-1, a.shape[-1])
        out = torch.empty(*a.shape[:-1], n_out, dtype=a.dtype, device=a.device)
        flat, step = out.view(-1, n_out), rows.shape[0] // chunks
        return out, (lambda i: rows[i * step:(i + 1) * step]), \
            (lambda i, o: flat[i * step:(i + 1) * step].copy_(o))
    b = a.shape[0]
    if pattern == "gather":
        s_l = a.shape[1]
        c = s_l // chunks
        out = torch.empty(b, s_l * tp, n_out, dtype=a.dtype, device=a.device)
        by_rank = out.view(b, tp, s_l, n_out)
        return out, (lambda i: a[:, i * c:(i + 1) * c].contiguous()), \
            (lambda i, o: by_rank[:, :, i * c:(i + 1) * c].copy_(o.view(b, tp, c, n_out)))
    s_l = a.shape[1] // tp
    c = s_l // chunks
    by_rank = a.view(b, tp, s_l, a.shape[2])
    out = torch.empty(b, s_l, n_out, dtype=a.dtype, device=a.device)
    # (contiguous: with one position a chunk, c = 1, reshape returns a strided view)
    return out, (lambda i: by_rank[:, :, i * c:(i + 1) * c].reshape(b, tp * c, a.shape[2]).contiguous()), \
        (lambda i, o: out[:, i * c:(i + 1) * c].copy_(o))


class SideStreamChunks:
    """A chunked linear as a meshed fusion per chunk on side streams (module docstring)."""

    def __init__(self, owner: ChunkedLinears, run, piece, linear: str, pattern: str, op: str, chunks: int):
        block = owner.block
        self.owner, self.pattern, self.op, self.chunks = owner, pattern, op, chunks
        self.names = list(piece.inputs)          # (a, W[, bias]) in the piece's order
        self.a_name = next(n for n in self.names if not n.startswith(linear))
        self.order = [self.a_name, f"{linear}.weight"] + ([f"{linear}.bias"] if f"{linear}.bias" in self.names else [])
        self.layout, self.tp = block.layout, block.layout.tp
        self.backward = run.kind == "backward"   # on the dp rank's tp devices alone (schedule.build_pass)
        self.split_unit_axes = block.schedule.split_unit_axes
        self.options = block._piece_options(run, piece)   # the schedule's nvFuser options for the piece it runs
        self._fd = None

    def _fusion(self, a_local: torch.Tensor, w_local: torch.Tensor):
        """The chunk's fusion, made at the first call from the local shapes."""
        if self._fd is None:
            dp = 1 if self.backward else self.layout.dp
            tp = self.tp
            w_shape = list(w_local.shape)
            contract = 1 if self.op == "linear" else 0
            if self.pattern == "gather":
                w_shape[1 - contract] *= tp
                b_l, s_l, k = a_local.shape
                a_shape = (b_l * dp, tp * (s_l // self.chunks), k)
            else:
                w_shape[contract] *= tp
                k = a_local.shape[-1] * tp
                if self.pattern == "rows":
                    a_shape = (dp * a_local[..., 0].numel() // self.chunks, k)
                else:
                    b_l, s = a_local.shape[:2]
                    a_shape = (b_l * dp, s // self.chunks, k)
            self._fd = chunk_fusion(self.op, self.pattern, a_shape, tuple(w_shape), len(self.order) == 3,
                                    a_local.dtype, self.layout, row=self.owner.block.dp_rank if self.backward else None,
                                    split_unit_axes=self.split_unit_axes)
        return self._fd

    def __call__(self, inputs: list) -> list:
        named = dict(zip(self.names, inputs))
        a, w = named[self.a_name], named[self.order[1]]
        rest = [named[n] for n in self.order[1:]]
        fd = self._fusion(a, w)
        n_out = w.shape[0] if self.op == "linear" else w.shape[1]
        out, parts, write = chunk_layout(self.pattern, a, n_out, self.chunks, self.tp)
        main = torch.cuda.current_stream()
        streams = self.owner.streams()
        for stream in streams:
            stream.wait_stream(main)
        for i in range(self.chunks):
            with torch.cuda.stream(streams[i % len(streams)]):
                (chunk_out,) = fd.execute([parts(i), *rest], **self.options)
                write(i, chunk_out)
        for stream in streams:
            main.wait_stream(stream)
        return [out]


class StreamAxisChunks:
    """A chunked linear on nvFuser's stream axis (host IR; module docstring)."""

    def __init__(self, block, run, piece, linear: str, pattern: str, chunks: int):
        if block.layout.dp != 1 or run.kind == "backward" or pattern == "scatter":
            raise ValueError(f"{linear}: overlap 'streams' runs a forward all-reduce or all-gather on a 1 x tp "
                             f"mesh here (nvFuser 0.2.36's host IR); got a {run.kind} {pattern} on "
                             f"{block.layout.dp}x{block.layout.tp}")
        check_host_ir_device(block.rank, torch.cuda.device_count())
        self.block, self.linear, self.pattern, self.chunks = block, linear, pattern, chunks
        self.names = list(piece.inputs)
        self.a_name = next(n for n in self.names if not n.startswith(linear))
        self._of = None

    def __call__(self, inputs: list) -> list:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self.linear}: overlap 'streams' (nvFuser 0.2.36's host IR) cannot be captured "
                               f"in a CUDA graph; run it called, or use overlap 'fusions'")
        named = dict(zip(self.names, inputs))
        a, w = named[self.a_name], named[f"{self.linear}.weight"]
        tp = self.block.layout.tp
        if self.pattern == "rows":
            rows = a.reshape(-1, a.shape[-1])
            if self._of is None:
                self._of = row_parallel_overlapped(rows.shape[0], rows.shape[1] * tp, w.shape[0], tp, self.chunks,
                                                   a.dtype)
            (out,) = self._of.fd.execute([rows, w], **OVERLAP_OPTIONS)
            return [out.view(*a.shape[:-1], w.shape[0])]
        b_l, s_l, k = a.shape                            # gather: the rank's part of the sequence
        rows = a.reshape(self.chunks, -1, k)             # [chunks, rows, k]
        if self._of is None:
            self._of = allgather_column_parallel_overlapped(b_l * s_l * tp, k, w.shape[0], tp, self.chunks, a.dtype)
        (out,) = run_allgather_overlapped(self._of, [rows, w, named[f"{self.linear}.bias"]])
        # [chunks, tp, rows, n]: the tokens chunk-major; back to (b, s) order, rank-major in s
        by_rank = out.permute(1, 0, 2, 3).reshape(tp, b_l, s_l, -1)
        return [by_rank.permute(1, 0, 2, 3).reshape(b_l, tp * s_l, -1)]
