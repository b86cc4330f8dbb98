"""The race of nvFuser 0.2.36's chunked row-parallel all-reduce (host IR): on
two ranks sharing the GPU, the 4-chunk linear without CUDA_DEVICE_MAX_CONNECTIONS=1
(a negative control: its result is recorded, mismatch or not) and with it
(must be right, and a second call bit-equal). runtime/chunked.py says why
every chunked schedule runs with the variable."""
import json
import math
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
def test_chunked_allreduce_without_one_connection_is_recorded(tmp_path, record):
    rows = _row_parallel_on_two_ranks(tmp_path, None)
    four = rows[4]
    assert rows[1]["ok"], rows[1]                       # one chunk: no streams to race
    assert "rel_err" in four and "second_call_equal" in four, four
    # it ran to the end: an error measured (a race may leave NaN: recorded, not failed) and a second call compared
    assert isinstance(four["rel_err"], float) and not math.isinf(four["rel_err"]), four
    assert isinstance(four["second_call_equal"], bool), four
    record(connections=None, chunks=4, rel_err=four["rel_err"], second_call_equal=four["second_call_equal"],
           mismatch=not four["ok"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chunked_allreduce_with_one_connection_is_right(tmp_path, record):
    rows = _row_parallel_on_two_ranks(tmp_path, "1")
    record(connections="1", chunks=4, rel_err=rows[4]["rel_err"], second_call_equal=rows[4]["second_call_equal"])
    assert rows[4]["ok"] and rows[4]["second_call_equal"], rows[4]
