"""The overlap model (tpfuser/parallel/overlap_model.py, `tpfuser plan --overlap N`), its
plain-PyTorch decomposition, and the overlapped linears' fusions (built here;
tools/overlap_check.py runs them on a GPU)."""
import json
import math
import re

import pytest

from tpfuser.cli import main
from tpfuser.config import Layout, preset
from tpfuser.parallel.overlap_model import Step, overlap_model
from tpfuser.parallel.collectives import Collective


def _step(c, g, n):
    return Step(Collective("allgather", "tp", "forward", "input", "attn.c_attn", "ln_1.out", (1,), 2, 8), "attn.c_attn", c, g, n)


def test_one_chunk_hides_nothing():
    s = _step(1.0, 3.0, 1)
    assert s.overlapped_ms == s.serial_ms == 4.0 and s.exposed_ms == 1.0


def test_fill_steady_state_drain():
    assert _step(1.0, 3.0, 4).overlapped_ms == pytest.approx(0.25 + 0.75 + 3 * 0.75)   # GEMM-bound: c/N exposed
    assert _step(1.0, 3.0, 4).exposed_ms == pytest.approx(0.25)
    assert _step(3.0, 1.0, 4).exposed_ms == pytest.approx(3.0 - 0.75)                  # communication-bound


def test_gpt3_tp8_sp_figures():
    m = overlap_model(preset("gpt3"), Layout(1, 8, sp=True), 4, busbw_gbps=360.0, tflops=689.0)
    assert [s["kind"] for s in m["steps"]] == ["allgather", "reducescatter", "allgather", "reducescatter"]
    # 7/8 of a [1, 2048, 12288] bf16 tensor sent per rank, at 360 GB/s
    assert m["steps"][0]["comm_ms"] == pytest.approx(7 / 8 * 2048 * 12288 * 2 / 360e9 * 1e3)
    # c_attn's GEMM per rank: 2 * 2048 * 12288 * 36864 / 8 FLOPs at 689 TFLOP/s
    assert m["steps"][0]["gemm_ms"] == pytest.approx(2 * 2048 * 12288 * 36864 / 8 / 689e12 * 1e3)
    assert m["exposed_comm_ms"]["overlapped"] < 0.3 * m["exposed_comm_ms"]["serial"]
    assert m["forward_ms"]["serial"] == pytest.approx(m["matmul_ms"] + m["exposed_comm_ms"]["serial"])


@pytest.mark.parametrize("argv, words", [
    (["--tp", "8", "--sp", "--overlap", "3"], "--overlap=3: must divide the rank's sequence slice seq/tp = 2048/8 = 256"),
    (["--tp", "8", "--overlap", "0"], "--overlap=0: must be a positive number of chunks"),
    (["--tp", "8", "--overlap", "4", "--bandwidth", "0"], "--bandwidth=0.0: must be a positive, finite rate"),
], ids=["not-dividing", "zero", "no-bandwidth"])
def test_plan_overlap_refusals(capsys, argv, words):
    assert main(["plan", "--preset", "gpt3", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.splitlines()) == 1


def test_plan_overlap_prints_and_writes_the_model(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--preset", "gpt3", "--tp", "8", "--sp", "--overlap", "4", "--json", str(out)]) == 0
    assert "overlap model, forward, 4 chunks" in capsys.readouterr().out
    model = json.load(open(out))["overlap"]
    assert model["chunks"] == 4 and math.isclose(model["busbw_gbps"], 360.0)


def _decomposition_rank(rank, world, init_file, results):
    import torch
    import torch.distributed as dist
    from tpfuser.parallel.overlap_model import allgather_matmul, matmul_reducescatter
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(0)   # every rank draws the same global tensors
        t, n_in, n_out = 16, 12, 10
        x = torch.randn(t, n_in, generator=gen, dtype=torch.float64)
        w_col = torch.randn(n_out * world, n_in, generator=gen, dtype=torch.float64)   # column-parallel, global
        h = torch.randn(t, n_in * world, generator=gen, dtype=torch.float64)
        w_row = torch.randn(n_out, n_in * world, generator=gen, dtype=torch.float64)   # row-parallel, global
        x_local = x.chunk(world, dim=0)[rank]
        w_col_local = w_col.chunk(world, dim=0)[rank]
        h_local, w_row_local = h.chunk(world, dim=1)[rank], w_row.chunk(world, dim=1)[rank]
        errors = {}
        for chunks in (1, 2, 4):
            y = allgather_matmul(x_local, w_col_local, None, chunks)
            errors[f"ag {chunks}"] = (y - x @ w_col_local.T).abs().max().item()
            z = matmul_reducescatter(h_local, w_row_local, None, chunks)
            errors[f"rs {chunks}"] = (z - (h @ w_row.T).chunk(world, dim=0)[rank]).abs().max().item()
        try:
            matmul_reducescatter(h_local, w_row_local, None, 3)
            errors["refused"] = False
        except ValueError as e:
            errors["refused"] = "chunks=3: must divide" in str(e)
        results[rank] = errors
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_chunked_collectives_equal_the_whole_ones(world, tmp_path):
    """The PyTorch decomposition (gloo on the CPU): chunked all-gather + GEMM and
    GEMM + chunked reduce-scatter give the unchunked results (float64, 1e-12)."""
    import torch.multiprocessing as mp
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.spawn(_decomposition_rank, args=(world, str(tmp_path / "init"), results), nprocs=world, join=True)
    for rank in range(world):
        r = dict(results[rank])
        assert r.pop("refused") is True
        assert all(v < 1e-12 for v in r.values()), (rank, r)


def test_overlapped_row_parallel_linear_is_cut_into_stream_chunks():
    """The row-parallel linear's tokens on a stream axis, its inner size over tp (nvFuser's
    test_row_parallel_linear_forward, at the MLP's c_proj of tiny)."""
    import torch
    from tpfuser.parallel.overlapped import row_parallel_overlapped
    of = row_parallel_overlapped(64, 256, 64, tp=2, chunks=4, dtype=torch.float32)
    h, w = (str(t) for t in of.inputs)
    assert "istreamIdx" in h and "{4}" in h.split("istreamIdx")[1][:8] and "ideviceIdx.x" in h
    assert "istreamIdx" not in w and "ideviceIdx.x" in w
    assert of.kind == "row-parallel all-reduce" and (of.chunks, of.tp) == (4, 2)


def test_overlapped_allgather_linear_streams_its_output_chunks():
    import torch
    from tpfuser.parallel.overlapped import allgather_column_parallel_overlapped
    of = allgather_column_parallel_overlapped(64, 64, 256, tp=2, chunks=4, dtype=torch.float32)
    x = str(of.inputs[0])
    assert x.startswith("T0_g_float[iS0{4}, ideviceIdx.x1{2}, iS2{8}, iS3{64}]")   # [chunks, tp, rows, n_in]
    assert "istreamIdx" in str(of.output).split(",")[0]                           # the output's chunk axis


@pytest.mark.parametrize("build, args, words", [
    ("row_parallel_overlapped", (60, 256, 64, 2, 8), "chunks=8 must divide the tokens (60) and tp=2 the inner size (256)"),
    ("row_parallel_overlapped", (64, 250, 64, 4, 2), "chunks=2 must divide the tokens (64) and tp=4 the inner size (250)"),
    ("allgather_column_parallel_overlapped", (64, 64, 256, 4, 32), "chunks=32 x tp=4 must divide the tokens (64)"),
])
def test_overlap_fusions_refuse_what_does_not_divide(build, args, words):
    import tpfuser.parallel.overlapped as overlapped
    with pytest.raises(ValueError, match=re.escape(words)):
        getattr(overlapped, build)(*args)


def test_overlap_refuses_a_rank_beyond_the_gpus_nvfuser_would_index():
    """nvFuser 0.2.36's host IR evaluator indexes CUDA devices by global rank, so
    rank 1 of ranks sharing one GPU failed deep inside nvFuser (on an H200,
    docs/history.md); refused first."""
    from tpfuser.dist.sharegpu import check_host_ir_device
    check_host_ir_device(0, 1)
    check_host_ir_device(3, 4)
    with pytest.raises(ValueError, match=re.escape("CUDA device <global rank> (1), and this process sees 1 GPU(s)")):
        check_host_ir_device(1, 1)


def test_overlap_checks_verdict_names_the_wrong_stream_and_a_changed_second_call(monkeypatch):
    """tools/overlap_check.py (GPU) judges a chunked linear; its verdict on made-up outputs (CPU)."""
    import sys
    from pathlib import Path

    import torch
    monkeypatch.setenv("NVFUSER_DUMP", "")          # the tool sets these at import when absent
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    import overlap_check
    exact = torch.randn(8, 3, dtype=torch.float64)
    wrong = exact.clone()
    wrong[4:6] = 0                                   # the third of 4 streams' token blocks lost
    v = overlap_check._verdict({4: wrong, 1: exact, "posted4": 4, "again": wrong.clone()}, 4, exact,
                               lambda m: overlap_check.token_blocks(m, 4))
    assert v["posted"] == 4 and v["second_call_equal"] and v["rel_err"] > 0.1
    assert [e > 0.5 for e in v["chunk_rel_errs"]] == [False, False, True, False]
    v = overlap_check._verdict({4: exact, 1: exact, "posted4": 4, "again": wrong}, 4, exact,
                               lambda m: overlap_check.token_blocks(m, 4))
    assert v["rel_err"] == 0 and not v["second_call_equal"]
    # the all-gather's tokens are (rank, stream, row): stream i's part takes rows from every rank
    parts = overlap_check.gathered_streams(torch.arange(24.0).reshape(8, 3), tp=2, chunks=2)
    assert parts[1][0, 0].tolist() == [6.0, 7.0, 8.0] and parts[1][1, 0].tolist() == [18.0, 19.0, 20.0]
    sys.modules.pop("overlap_check", None)
