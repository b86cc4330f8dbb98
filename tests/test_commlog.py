"""Parsing nvFuser's communication dump (NVFUSER_DUMP=communication), on the
format nvFuser 0.2.36 prints, and comparing what was posted with the plan."""
import ctypes

from tpfuser.verify.commlog import captured_communications, compare_collectives, parse_communication_log
from tpfuser.config import Layout, preset
from tpfuser.parallel.collectives import forward_collectives as collectives

# A line nvFuser 0.2.36 printed for tiny's row-parallel all-reduce on the 1x2 mesh (fp32).
SEEN = ("Posting Communication 91581 (type=Allreduce, team=(0 1), input=T115_g_float[ideviceIdx.y605{1}, "
        "ideviceIdx.x604{2}, iS606{4}, iS602{16}, iS603{64}] (DeviceMesh{{0 1}}), output=T68_g_float["
        "ideviceIdx.y580{1}, rdeviceIdx.x579{2}, iS581{4}, iS577{16}, iS578{64}] (DeviceMesh{{0 1}}), "
        "backend=NCCL) with input_tensor [4, 16, 64, 1] and output_tensor [4, 16, 64]")


def test_parses_the_line_nvfuser_prints():
    (c,) = parse_communication_log("noise\n" + SEEN + "\nmore noise")
    assert c["kind"] == "allreduce" and c["team"] == [0, 1] and c["dtype"] == "float"
    assert c["shapes"] == {"input": [4, 16, 64, 1], "output": [4, 16, 64]}


def _posted(kind, team, shape_in, shape_out):
    return {"kind": kind, "team": team, "shapes": {"input": shape_in, "output": shape_out}}


def test_compare_with_the_whole_plan():
    cfg = preset("tiny", dtype="fp32", dropout=0.0)
    seen = parse_communication_log(SEEN)
    both = seen + [dict(seen[0])]
    assert compare_collectives(both, collectives(cfg, Layout(1, 2)), [0, 1])["matches"]
    assert not compare_collectives(seen, collectives(cfg, Layout(1, 2)), [0, 1])["matches"]          # one missing
    assert not compare_collectives(both + seen, collectives(cfg, Layout(1, 2)), [0, 1])["matches"]   # one too many
    assert not compare_collectives(both, collectives(cfg, Layout(1, 2, sp=True)), [0, 1])["matches"]  # SP gathers first
    assert not compare_collectives(both, collectives(cfg, Layout(2, 2)), [2, 3])["matches"]   # another mesh
    assert not compare_collectives(both, collectives(cfg, Layout(1, 2)), [2, 3])["matches"]   # over another team


def test_sp_plan_matches_gathers_and_reduce_scatters_by_elements():
    cfg = preset("tiny", dtype="bf16", dropout=0.0)
    b, s, e = 4, 16, 64
    posted = [_posted("allgather", [0, 1], [b, s // 2, e], [b, s, e]),
              _posted("reducescatter", [0, 1], [b, s, e, 1], [b, s // 2, e])] * 2
    assert compare_collectives(posted, collectives(cfg, Layout(1, 2, sp=True)), [0, 1])["matches"]
    posted[1] = _posted("reducescatter", [0, 1], [b, s, e // 2, 1], [b, s // 2, e // 2])   # half the bytes
    assert not compare_collectives(posted, collectives(cfg, Layout(1, 2, sp=True)), [0, 1])["matches"]


def test_a_collective_of_the_wrong_shape_does_not_match():
    wrong = SEEN.replace("input_tensor [4, 16, 64, 1] and output_tensor [4, 16, 64]",
                         "input_tensor [4, 16, 32, 1] and output_tensor [4, 16, 32]")
    assert wrong != SEEN
    cfg = preset("tiny", dtype="fp32", dropout=0.0)
    assert not compare_collectives(parse_communication_log(wrong) * 2, collectives(cfg, Layout(1, 2)), [0, 1])["matches"]


def test_captured_communications_reads_what_c_code_writes_to_stdout(capfd):
    libc = ctypes.CDLL(None)
    with captured_communications() as posted:
        libc.printf(b"%s\nsomething else\n", SEEN.encode())   # as nvFuser's C++ dump writes it
    assert [p["kind"] for p in posted] == ["allreduce"]
    out = capfd.readouterr().out
    assert "something else" in out and "Posting Communication" not in out   # the rest is written back


def test_error_line_finds_the_assert_and_drops_the_backtrace():
    from tpfuser.verify.commlog import error_line
    e = RuntimeError("\n".join([
        "Error from segmentation group 0:  INTERNAL ASSERT FAILED at /Fuser/csrc/multidevice/post_communication.cpp:74, please report",
        "Expected (dst.numel())==(src.numel()) . Found 64 vs 1024.",
        "Exception raised from doLocalCopy at post_communication.cpp:74 (most recent call first):",
        "frame #0: c10::Error::Error(...)"]))
    assert error_line(e) == ("Error from segmentation group 0:  INTERNAL ASSERT FAILED at /Fuser/csrc/multidevice/"
                             "post_communication.cpp:74, please report | Expected (dst.numel())==(src.numel()) . Found 64 vs 1024.")
    assert error_line(e, context=0).endswith("please report")
    nccl = RuntimeError("setup\nNCCL error in: NCCLUtils.cpp:93, invalid usage\nframe #0")
    assert error_line(nccl, context=0) == "NCCL error in: NCCLUtils.cpp:93, invalid usage"
    assert error_line(ValueError("plain message")) == "plain message"      # nothing marked: the first line
    assert error_line(ValueError("")) == "ValueError"


def _stored(kind, numel, team=(0, 1, 2, 3)):
    return {"kind": kind, "team": list(team), "numel": numel}


# tiny 1x4 SP's backward on rank 0 in the order nvFuser 0.2.36 posted it (as a report stores it):
# the six [e] all-reduces of the tp-replicated parameters' gradients between the gathers.
SP_BACKWARD_POSTED = [_stored(kind, numel) for kind, numel in (
    ("allgather", 4096), ("allreduce", 64), ("reducescatter", 4096), ("allgather", 4096), ("allgather", 4096),
    ("allreduce", 64), ("allreduce", 64), ("allreduce", 64), ("reducescatter", 4096), ("allgather", 4096),
    ("allreduce", 64), ("allreduce", 64))]


def test_sp_backward_posted_in_nvfusers_order_matches_the_plan_in_any_order():
    """The SP backward all-reduces the six tp-replicated parameters' gradients
    (LayerNorms, row-parallel biases: sums over sequence shards), and nvFuser
    posts them between the gathers, not where the plan lists them."""
    from tpfuser.parallel.collectives import backward_collectives
    cfg = preset("tiny", dtype="fp32", dropout=0.1)
    posted = SP_BACKWARD_POSTED
    planned = [c for c in backward_collectives(cfg, Layout(1, 4, sp=True)) if c.axis == "tp"]
    result = compare_collectives(posted, planned, [0, 1, 2, 3])
    assert result["matches"] and not result["in_order"]
    without_a_gradient = [c for c in planned if c.where != "ln_1.bias gradient (partial sums over the sequence shards)"]
    assert not compare_collectives(posted, without_a_gradient, [0, 1, 2, 3])["matches"]
    swapped = [dict(p, kind="allreduce") if p["kind"] == "allgather" else p for p in posted]
    assert not compare_collectives(swapped, planned, [0, 1, 2, 3])["matches"]   # same count, other kinds


def test_error_message_keeps_nested_segment_errors_and_drops_every_backtrace():
    """The one-head failure on the GPU (docs/history.md) was cut to
    'executor_utils.cpp:511' by error_line; the lines after it name the failing input."""
    from tpfuser.verify.commlog import error_message
    e = RuntimeError("\n".join([
        "INTERNAL ASSERT FAILED at fusion_kernel_runtime.cpp:476. Detected exception while compiling",
        "Error from segmentation group 58:  INTERNAL ASSERT FAILED at executor_utils.cpp:511",
        "When trying to run the provided host program, there was an error with the provided input 3.",
        "Exception raised from bindInputs at executor_utils.cpp:511 (most recent call first):",
        "frame #0: c10::Error::Error(...)",
        "  frame #1: nvfuser::bindInputs(...)",
        "Expr eval provided the error:",
        '"""Expected (stride)==(expected_stride_if_contiguous). Found 24 vs 8."""',
        "Exception raised from validate at tensor_metadata.cpp:272 (most recent call first):",
        "frame #0: c10::Error::Error(...)"]))
    message = error_message(e)
    assert "provided input 3" in message and "Found 24 vs 8" in message
    assert "frame #" not in message and "Exception raised from" not in message
    assert message.count("\n") == 4            # five lines kept
    assert error_message(e, limit=10) == message[:10]
    assert error_message(ValueError("")) == "ValueError"
