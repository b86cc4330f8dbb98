"""tools/probes/host_overhead.py: our Python per call, the fusions' execute faked (CPU)."""
import sys

sys.path.insert(0, "tools/probes")
import host_overhead  # noqa: E402


def test_it_times_calls_that_run_our_code_and_not_nvfusers():
    """Under the single-fusion schedule, and the default one (its forward a few
    fusions, the pass's inputs spread over them)."""
    for schedule in ("megatron-whole", "megatron"):
        block = host_overhead.faked_block("tiny", schedule=schedule)
        calls = []
        pieces = block.pass_of("forward", True).pieces
        for i, piece in enumerate(pieces):
            fake = piece.execute
            piece.execute = (lambda i, fake: lambda inputs, **kwargs: calls.append((i, len(inputs))) or fake(inputs))(
                i, fake)
        timing = host_overhead.per_call_us(block, 5)
        assert set(timing) == {"forward_us", "train_step_us"} and all(t > 0 for t in timing.values())
        assert len(calls) == 5 * len(pieces) and [i for i, _ in calls] == list(range(len(pieces))) * 5
        # x, the parameters and the dropout scalars, over the call's fusions
        assert sum(n for _, n in calls[:len(pieces)]) > 1 + 12
        if schedule == "megatron-whole":
            assert len(pieces) == 1 and calls[0][1] > 1 + 12
