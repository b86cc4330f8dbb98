"""nvFuser 0.2.36's chunked row-parallel all-reduce (host IR) on two ranks
sharing the GPU, with CUDA_DEVICE_MAX_CONNECTIONS=1: right, and a second call
bit-equal. runtime/chunked.py says why every chunked schedule runs with the
variable; the run without it (it races) is a record, not a test: the GPU
suite's `race` step (tools/gpu_suite.sh)."""
import json
import os

import pytest
import torch

from tests.ranks_on_one_gpu import run_on_ranks


def _row_parallel_on_two_ranks(tmp_path, connections: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if connections is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = connections
    out = tmp_path / "race.json"
    done = run_on_ranks("overlap_check.py", ["--only", "row", "--chunks", "1", "4", "--json", str(out)], env=env,
                        shim=True)
    assert out.exists(), done.tail()
    rows = json.loads(out.read_text())["rows"]
    return {r["chunks"]: r for r in rows}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chunked_allreduce_with_one_connection_is_right(tmp_path, record):
    rows = _row_parallel_on_two_ranks(tmp_path, "1")
    record(connections="1", chunks=4, rel_err=rows[4]["rel_err"], second_call_equal=rows[4]["second_call_equal"])
    assert rows[4]["ok"] and rows[4]["second_call_equal"], rows[4]
