"""The overlap model (tpfuser/overlap.py, `tpfuser plan --overlap N`)."""
import json
import math

import pytest

from tpfuser.cli import main
from tpfuser.config import Layout, preset
from tpfuser.overlap import Step, overlap_model
from tpfuser.plan import Collective


def _step(c, g, n):
    return Step(Collective("allgather", "tp", "before attn.c_attn", (1,), 2, 8), "attn.c_attn", c, g, n)


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
