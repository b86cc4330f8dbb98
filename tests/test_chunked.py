"""Chunked linears (runtime/chunked.py) on the CPU: each pattern's chunks,
run through what each chunk's meshed fusion computes on every rank (its
collective emulated over the ranks' chunks), reassemble every rank's slice of
the whole linear; and which of a schedule's fusions run chunked."""
import pytest
import torch

from tpfuser.parallel.schedules import SCHEDULES
from tpfuser.config import Layout, preset
from tpfuser.runtime.chunked import chunk_layout, chunked_pieces, ring_input, ring_input_shape, ring_output

TP, B, S, K, N = 2, 2, 16, 8, 6


def _layouts(pattern, inputs, n_out, chunks):
    return [chunk_layout(pattern, a, n_out, chunks, TP) for a in inputs]


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_rows_all_reduced_chunk_by_chunk_is_the_row_parallel_linear(chunks):
    torch.manual_seed(0)
    x, w = torch.randn(B, S, K, dtype=torch.float64), torch.randn(N, K, dtype=torch.float64)
    xs, ws = x.chunk(TP, dim=2), w.chunk(TP, dim=1)       # the contraction split over tp
    layouts = _layouts("rows", xs, N, chunks)
    for i in range(chunks):
        total = sum(parts(i) @ wr.T for (_, parts, _), wr in zip(layouts, ws))   # the all-reduce
        for _, _, write in layouts:
            write(i, total)
    for out, _, _ in layouts:
        torch.testing.assert_close(out, x @ w.T)


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_gathered_chunks_land_at_every_ranks_part_of_the_sequence(chunks):
    torch.manual_seed(1)
    x, w = torch.randn(B, S, K, dtype=torch.float64), torch.randn(N, K, dtype=torch.float64)
    xs, ws = x.chunk(TP, dim=1), w.chunk(TP, dim=0)       # the sequence over tp; the output columns over tp
    layouts = [chunk_layout("gather", a, N // TP, chunks, TP) for a in xs]
    for i in range(chunks):
        gathered = torch.cat([parts(i) for _, parts, _ in layouts], dim=1)       # the all-gather, rank-major
        for (_, _, write), wr in zip(layouts, ws):
            write(i, gathered @ wr.T)
    for (out, _, _), wr in zip(layouts, ws):
        torch.testing.assert_close(out, x @ wr.T)


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_scattered_chunks_are_each_ranks_slice_of_the_summed_output(chunks):
    torch.manual_seed(2)
    x, w = torch.randn(B, S, K, dtype=torch.float64), torch.randn(N, K, dtype=torch.float64)
    xs, ws = x.chunk(TP, dim=2), w.chunk(TP, dim=1)
    layouts = _layouts("scatter", xs, N, chunks)
    for i in range(chunks):
        total = sum(parts(i) @ wr.T for (_, parts, _), wr in zip(layouts, ws))   # [b, tp c, n], rank-major
        for r, (_, _, write) in enumerate(layouts):
            write(i, total.chunk(TP, dim=1)[r])                                   # the reduce-scatter
    expected = (x @ w.T).chunk(TP, dim=1)
    for (out, _, _), want in zip(layouts, expected):
        torch.testing.assert_close(out, want)


@pytest.mark.parametrize("pattern", ["rows", "gather", "scatter"])
def test_every_chunk_input_is_contiguous_down_to_one_position_a_chunk(pattern):
    """A chunk fusion declares its input contiguous: with s/(tp chunks) = 1 a
    chunk's slice is a view that is not (seen on the H200: tiny 1x4 SP, 4 chunks)."""
    a = torch.randn(B, S if pattern == "scatter" else S // TP, K)
    chunks = S // TP   # one position a chunk
    _, parts, _ = chunk_layout(pattern, a, N, chunks, TP)
    assert all(parts(i).is_contiguous() for i in range(chunks))


def _runs(name, layout):
    """{(phase, cut point): (algorithm, the collective's kind, chunks)} the runtime runs beside a GEMM."""
    return {key: (c.algorithm, c.kind, c.chunks)
            for key, c in chunked_pieces(SCHEDULES[name], preset("gpt3"), layout).items()}


def test_the_chunked_pieces_of_the_overlapped_schedules():
    tp, sp = Layout(1, 8), Layout(1, 8, sp=True)
    assert _runs("megatron-overlap", tp) == {   # no collective in TP's forward column-parallel linears
        ("forward", "attn.c_proj"): ("fusions", "allreduce", 4), ("forward", "mlp.c_proj"): ("fusions", "allreduce", 4),
        ("backward", "grad:attn.c_attn.in"): ("fusions", "allreduce", 4),
        ("backward", "grad:mlp.c_fc.in"): ("fusions", "allreduce", 4)}
    assert _runs("megatron-sp-overlap", sp) == {
        ("forward", "attn.c_attn"): ("fusions", "allgather", 4), ("forward", "mlp.c_fc"): ("fusions", "allgather", 4),
        ("forward", "attn.c_proj"): ("fusions", "reducescatter", 4),
        ("forward", "mlp.c_proj"): ("fusions", "reducescatter", 4),
        ("backward", "grad:attn.c_attn.in"): ("fusions", "reducescatter", 4),
        ("backward", "grad:mlp.c_fc.in"): ("fusions", "reducescatter", 4)}
    # a reduce-scatter on nvFuser's stream axis is not lowered: it runs whole
    assert _runs("megatron-sp-overlap-streams", sp) == {
        ("forward", "attn.c_attn"): ("streams", "allgather", 4), ("forward", "mlp.c_fc"): ("streams", "allgather", 4)}
    assert _runs("megatron", tp) == {}
    ring = _runs("megatron-sp-ring", sp)
    assert set(ring) == set(_runs("megatron-sp-overlap", sp)) and {v[0] for v in ring.values()} == {"ring"}
    assert {v[2] for v in ring.values()} == {8}   # a step per rank


def _ring(kind, xs, step_result):
    """Every rank's block output through its ring input and output: `step_result(inputs)` is what
    nvFuser's executor returns to each rank, from every rank's ring input."""
    inputs = [ring_input(kind, a, TP, torch.empty(ring_input_shape(kind, a.shape, TP), dtype=a.dtype)) for a in xs]
    return [ring_output(kind, out, a.shape, TP) for a, out in zip(xs, step_result(inputs))]


def test_the_allgather_ring_gives_each_rank_its_column_parallel_linear_of_the_whole_sequence():
    torch.manual_seed(3)
    x, w = torch.randn(B, S, K, dtype=torch.float64), torch.randn(N, K, dtype=torch.float64)
    xs, ws = x.chunk(TP, dim=1), w.chunk(TP, dim=0)       # the sequence over tp; the output rows over tp
    # in step j a rank's GEMM reads rank j's input: the executor returns [tp, b s/tp, n/tp], rank-major
    outs = [_ring("allgather", xs, lambda ins: [torch.cat(ins) @ wr.T for _ in ins])[r] for r, wr in enumerate(ws)]
    for out, wr in zip(outs, ws):
        torch.testing.assert_close(out, x @ wr.T)


def test_the_reducescatter_ring_gives_each_rank_its_part_of_the_sequence_summed():
    torch.manual_seed(4)
    x, w = torch.randn(B, S, K, dtype=torch.float64), torch.randn(N, K, dtype=torch.float64)
    xs, ws = x.chunk(TP, dim=2), w.chunk(TP, dim=1)       # the contraction split over tp: partial sums

    def executor(ins):   # rank r receives step r's partial product from every rank and sums them
        return [sum(a[0, r] @ wr.T for a, wr in zip(ins, ws)).unsqueeze(0) for r in range(TP)]
    for out, want in zip(_ring("reducescatter", xs, executor), (x @ w.T).chunk(TP, dim=1)):
        torch.testing.assert_close(out, want)


def test_a_ring_takes_its_input_in_any_memory_order():
    """A fusion may hand the next its output laid out otherwise (flash attention's order, say)."""
    torch.manual_seed(5)
    a = torch.randn(B, K, S, dtype=torch.float64).transpose(1, 2)    # [b, s, k], not contiguous
    into = torch.empty(ring_input_shape("reducescatter", a.shape, TP), dtype=a.dtype)
    ring_input("reducescatter", a, TP, into)
    for j in range(TP):   # step j: every batch row's part j of the sequence
        torch.testing.assert_close(into[0, j].view(B, S // TP, K), a[:, j * S // TP:(j + 1) * S // TP])
