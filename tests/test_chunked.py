"""Chunked linears (runtime/chunked.py) on the CPU: each pattern's chunks,
run through what each chunk's meshed fusion computes on every rank (its
collective emulated over the ranks' chunks), reassemble every rank's slice of
the whole linear; and which of a schedule's fusions run chunked."""
import pytest
import torch

from tpfuser.parallel.schedules import SCHEDULES
from tpfuser.runtime.chunked import chunk_layout, chunked_piece

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


def test_the_chunked_pieces_of_the_overlapped_schedules():
    tp, sp = SCHEDULES["megatron-overlap"], SCHEDULES["megatron-sp-overlap"]
    assert chunked_piece(tp, "forward", "attn.c_proj", sp=False) == ("attn.c_proj", "rows", "linear", 4, "fusions")
    assert chunked_piece(tp, "forward", "attn.c_attn", sp=False) is None      # no collective in TP's forward
    assert chunked_piece(tp, "backward", "grad:mlp.c_fc.in", sp=False) == ("mlp.c_fc", "rows", "matmul", 4, "fusions")
    assert chunked_piece(sp, "train", "mlp.c_fc", sp=True)[1] == "gather"
    assert chunked_piece(sp, "forward", "mlp.c_proj", sp=True)[1] == "scatter"
    assert chunked_piece(sp, "backward", "grad:attn.c_attn.in", sp=True)[1] == "scatter"
    assert chunked_piece(tp, "forward", "mlp.c_fc.out", sp=False) is None
    streams = SCHEDULES["megatron-sp-overlap-streams"]
    assert chunked_piece(streams, "forward", "attn.c_proj", sp=True) is None   # a reduce-scatter: nvFuser cannot
    assert chunked_piece(SCHEDULES["megatron"], "forward", "attn.c_proj", sp=False) is None
