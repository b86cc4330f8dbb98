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

from tpfuser.dist.sharegpu import check_host_ir_device
from tpfuser.parallel.collectives import Collective, all_collectives, cut_point, runs_beside_gemm
from tpfuser.parallel.overlapped import (OVERLAP_OPTIONS, allgather_column_parallel_overlapped, chunk_fusion,
                                         row_parallel_overlapped, run_allgather_overlapped)
from tpfuser.parallel.ring import allgather_linear, matmul_reducescatter, ring_executor

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


PATTERN = {"allreduce": "rows", "allgather": "gather", "reducescatter": "scatter"}


def chunked_pieces(schedule, cfg, layout) -> dict[tuple[str, str], Collective]:
    """{(phase, cut point): the collective} of every linear whose fusion the runtime runs with its
    collective beside the GEMM (collectives.runs_beside_gemm): the point its fusion begins at in that phase."""
    return {(c.phase, cut_point(c.site, c.linear)): c
            for c in all_collectives(cfg, layout, schedule) if runs_beside_gemm(c)}


def refuse_capture(linear: str, overlap: str) -> None:
    """Refuse, under CUDA-graph capture, a linear run by nvFuser's host IR (overlap streams or ring)."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{linear}: overlap {overlap!r} (nvFuser 0.2.36's host IR, its MultiDeviceExecutor) cannot "
                           f"be captured in a CUDA graph; run it called, or use overlap 'fusions'")


class ChunkedLinears:
    """The runners of one block's chunked linears, made at their first use."""

    def __init__(self, block):
        self.block = block
        self._runners: dict = {}
        self._at: dict | None = None   # chunked_pieces, made at first use
        self._streams: list[torch.cuda.Stream] = []
        check_connections(block.schedule)

    def runner(self, run, piece):
        """A callable running `piece` with its collective beside the GEMM (its inputs -> its outputs),
        or None: run it whole."""
        if not self.block.schedule.chunked() or not piece.point:
            return None
        key = (run.kind, run.cfg.dropout > 0, piece.point)
        if key not in self._runners:
            if self._at is None:
                self._at = chunked_pieces(self.block.schedule, self.block.cfg, self.block.layout)
            c = self._at.get(("backward" if run.kind == "backward" else "forward", piece.point))
            self._runners[key] = None if c is None else self._make(run, piece, c)
        return self._runners[key]

    def streams(self) -> list[torch.cuda.Stream]:
        if not self._streams:
            self._streams = [torch.cuda.Stream(device=self.block.device) for _ in range(SIDE_STREAMS)]
        return self._streams

    def _make(self, run, piece, c: Collective):
        op = "matmul" if c.phase == "backward" else "linear"
        if c.algorithm == "ring":
            return RingSteps(self.block, piece, c)
        if c.algorithm == "streams":
            return StreamAxisChunks(self.block, run, piece, c.linear, PATTERN[c.kind], c.chunks)
        return SideStreamChunks(self, run, piece, c.linear, PATTERN[c.kind], op, c.chunks)


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
        self.backward = run.kind == "backward"   # on the dp rank's tp devices alone (passes.build_pass)
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
        refuse_capture(self.linear, "streams")
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


class RingSteps:
    """A linear and its collective as nvFuser's P2P ring (parallel/ring.py), a step per rank of tp, run by
    nvFuser's MultiDeviceExecutor on the rank's dp row. Its memory is kept from call to call (the
    allocation cache; the copy engine's buffers must keep their addresses, their IPC handles being
    exchanged once): the input is copied into a buffer of the runner's own, and the output copied out.
      allgather      (forward, before a column-parallel linear) a [b, s/tp, k], the rank's part of the
                     sequence -> [b, s, n/tp]
      reducescatter  (after a row-parallel linear: a [b, s, k/tp], W [n, k/tp], + bias once; after a
                     column-parallel input-gradient matmul: a [b, s, k/tp], W [k/tp, n]) -> [b, s/tp, n]"""

    def __init__(self, block, piece, c: Collective):
        check_host_ir_device(block.rank, torch.cuda.device_count())
        self.block, self.c, self.tp = block, c, block.layout.tp
        self.names = list(piece.inputs)
        self.a_name = next(n for n in self.names if n not in (f"{c.linear}.weight", f"{c.linear}.bias"))
        self.bias = f"{c.linear}.bias" in self.names
        self.transpose = c.phase == "forward"     # a linear's W [n, k]: the ring's matmul reads it as [k, n]
        self._executor = self._a = self._w = None
        self._w_key = None

    def __call__(self, inputs: list) -> list:
        refuse_capture(self.c.linear, "ring")
        named = dict(zip(self.names, inputs))
        a, w = named[self.a_name], named[f"{self.c.linear}.weight"]
        if self.c.kind == "allgather":
            return [self._allgather(a, w, named.get(f"{self.c.linear}.bias"))]
        out = self._reducescatter(a, w)   # a tensor of its own (ring_output): the bias is added in place
        return [out.add_(named[f"{self.c.linear}.bias"]) if self.bias else out]

    def _allgather(self, a, w, bias):
        if self._executor is None:
            fd = allgather_linear(self.tp, a.shape[0] * a.shape[1], a.shape[2], w.shape[0], a.dtype,
                                  self.block.dp_rank, bias is not None)
            self._executor = ring_executor(fd, "allgather", self.c.backend)
            self._a = torch.empty(ring_input_shape("allgather", a.shape, self.tp), dtype=a.dtype, device=a.device)
        ring_input("allgather", a, self.tp, self._a)
        (out,) = self._executor.run([self._a, w] + ([bias] if bias is not None else []))
        return ring_output("allgather", out, a.shape, self.tp)

    def _reducescatter(self, a, w):
        b_mat = self._matrix(w)                  # [k/tp, n]
        if self._executor is None:
            fd = matmul_reducescatter(self.tp, a.shape[0] * a.shape[1] // self.tp, a.shape[2], b_mat.shape[1],
                                      a.dtype, self.block.dp_rank)
            self._executor = ring_executor(fd, "reducescatter", self.c.backend)
            self._a = torch.empty(ring_input_shape("reducescatter", a.shape, self.tp), dtype=a.dtype, device=a.device)
        ring_input("reducescatter", a, self.tp, self._a)
        (out,) = self._executor.run([self._a, b_mat.view(1, 1, *b_mat.shape)])
        return ring_output("reducescatter", out, a.shape, self.tp)

    def _matrix(self, w):
        """The ring's B [k/tp, n]: W itself (a matmul's), or W^T laid out so (a linear's), kept while W is unchanged."""
        if not self.transpose:
            return w.contiguous()
        key = (w.data_ptr(), w._version, tuple(w.shape))
        if key != self._w_key:
            self._w, self._w_key = w.t().contiguous(), key
        return self._w


def ring_input_shape(kind: str, shape, tp: int) -> tuple[int, ...]:
    """A rank's ring input (parallel/ring.py) for its block input of `shape`: all-gather [b, s/tp, k] ->
    [1, b s/tp, k]; reduce-scatter [b, s, k/tp] -> [1, tp, b s/tp, k/tp]."""
    b, s, k = shape
    return (1, b * s, k) if kind == "allgather" else (1, tp, b * s // tp, k)


def ring_input(kind: str, a: torch.Tensor, tp: int, into: torch.Tensor) -> torch.Tensor:
    """Write a rank's block input `a` into its ring input `into` (ring_input_shape): for the
    reduce-scatter, rank j's tokens (every batch row's part j of the sequence) in step j."""
    if kind == "allgather":
        return into.view_as(a).copy_(a)
    b, s, k = a.shape
    into.view(tp, b, s // tp, k).copy_(a.unflatten(1, (tp, s // tp)).transpose(0, 1))   # (a view, any strides)
    return into


def ring_output(kind: str, out: torch.Tensor, shape, tp: int) -> torch.Tensor:
    """The block's output from a rank's ring output, as a tensor of its own (the executor's
    allocation cache hands `out` back on the next call): all-gather [tp, b s/tp, n] (rank j's tokens in
    step j) -> [b, s, n], the sequence rank-major; reduce-scatter [1, b s/tp, n] -> [b, s/tp, n]."""
    b, s = shape[:2]
    if kind == "reducescatter":
        return out.view(b, s // tp, -1).clone()
    n = out.shape[-1]
    whole = out.new_empty(b, tp * s, n)
    whole.view(b, tp, s, n).copy_(out.view(tp, b, s, n).transpose(0, 1))   # one copy, whatever b
    return whole
