"""tools/host_overhead.py: our Python per call, the fusions' execute faked (CPU)."""
import sys

sys.path.insert(0, "tools")
import host_overhead  # noqa: E402


def test_it_times_calls_that_run_our_code_and_not_nvfusers():
    block = host_overhead.faked_block("tiny")
    calls = []
    fusion = block._fusion("forward", True)
    fake = fusion.fd.execute
    fusion.fd.execute = lambda inputs, **kwargs: calls.append(len(inputs)) or fake(inputs)
    timing = host_overhead.per_call_us(block, 5)
    assert set(timing) == {"forward_us", "train_step_us"} and all(t > 0 for t in timing.values())
    assert len(calls) == 5 and calls[0] > 1 + 12     # x, the parameters and the dropout scalars
