"""One head per rank is refused (schedules.known_failure) because nvFuser
0.2.36 fails it: this runs the reproducer (tools/repro_one_head.py, 2 heads on
2 ranks sharing the GPU, the block's slice form) and fails the day a newer
nvFuser runs it, so that the refusal is lifted then; 4 heads on 2 ranks must run."""
import pytest
import torch

from tests.ranks_on_one_gpu import run_on_ranks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_head_per_rank_still_fails_in_this_nvfuser(record):
    done = run_on_ranks("repro_one_head.py", ["2", "slice"])
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank 0:")]
    assert lines, done.stderr[-2000:]
    record(one_head=lines[0][:400])
    assert "FAILED" in lines[0] and "stride" in lines[0], (
        f"nvFuser now runs one head per rank ({lines[0][:200]}): lift schedules.known_failure's refusal")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_heads_per_rank_run_exactly():
    done = run_on_ranks("repro_one_head.py", ["4", "slice"])
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank 0:")]
    assert lines and "ran, max error 0.0e+00" in lines[0], done.stdout[-1000:] + done.stderr[-1000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_rank_stuck_in_a_form_is_ended_by_its_bound():
    """ONE_HEAD_FORM_S bounds each form: at 10 ms no rank can compile and run one,
    so each prints its stacks and exits 1 instead of finishing (or hanging)."""
    import os
    done = run_on_ranks("repro_one_head.py", ["4", "slice"], env={**os.environ, "ONE_HEAD_FORM_S": "0.01"},
                        timeout_s=120)
    assert done.returncode != 0 and "Timeout" in done.stderr, done.stdout[-1000:] + done.stderr[-1000:]
    assert "ran, max error" not in done.stdout
