"""One head per rank is refused (schedules.known_failure) because nvFuser
0.2.36 fails it: this runs the reproducer (tools/repro_one_head.py, 2 heads on
2 ranks sharing the GPU, the block's slice form) and fails the day a newer
nvFuser runs it, so that the refusal is lifted then; 4 heads on 2 ranks must run."""
import os

import pytest
import torch

from tests.ranks_on_one_gpu import run_on_ranks


def _rank0(done) -> str:
    lines = [line for line in done.output.splitlines() if line.startswith("rank 0:")]
    assert lines, done.tail()
    return lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_head_per_rank_still_fails_in_this_nvfuser(record):
    done = run_on_ranks("repro_one_head.py", ["2", "slice"], timeout_s=150)
    line = _rank0(done)
    record(one_head=line[:400], returncode=done.returncode, stages=done.story()[-20:])
    assert "FAILED" in line and "stride" in line, (
        f"nvFuser now runs one head per rank ({line[:200]}): lift schedules.known_failure's refusal")
    assert done.returncode == 0, done.tail()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_heads_per_rank_run_exactly():
    done = run_on_ranks("repro_one_head.py", ["4", "slice"], timeout_s=150)
    assert "ran, max error 0.0e+00" in _rank0(done) and done.returncode == 0, done.tail()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_rank_stuck_in_a_form_is_ended_by_its_bound():
    """ONE_HEAD_FORM_S bounds each form: at 10 ms no rank can compile and run one,
    so each prints its stacks and exits 1 instead of finishing (or hanging)."""
    done = run_on_ranks("repro_one_head.py", ["4", "slice"], env={**os.environ, "ONE_HEAD_FORM_S": "0.01"},
                        timeout_s=120)
    assert done.returncode not in (0, None) and "Timeout" in done.output, done.tail()
    assert "ran, max error" not in done.output
