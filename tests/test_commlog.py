"""Parsing nvFuser's communication dump, on the line the H200 printed for the 1x2 mesh."""
import json

from tpfuser.commlog import compare_first, parse_communication_log
from tpfuser.config import Layout, preset

SEEN = json.load(open("results/2026-12-02-h200/tp_collectives.json"))["posted"][0]["line"]


def test_parses_the_line_seen_on_the_h200():
    (c,) = parse_communication_log("noise\n" + SEEN + "\nmore noise")
    assert c["kind"] == "allreduce" and c["team"] == [0, 1]
    assert c["shapes"] == {"input": [4, 16, 64, 1], "output": [4, 16, 64]}


def test_compare_with_the_plan():
    posted = parse_communication_log(SEEN)
    cfg = preset("tiny", dtype="fp32", dropout=0.0)
    assert compare_first(posted, cfg, Layout(1, 2))["first_matches_plan"]
    assert not compare_first(posted, cfg, Layout(1, 2, sp=True))["first_matches_plan"]   # SP starts with an all-gather
    assert not compare_first([], cfg, Layout(1, 2))["first_matches_plan"]


def test_a_collective_of_the_wrong_shape_does_not_match():
    wrong = SEEN.replace("output_tensor [4, 16, 64]", "output_tensor [4, 16, 32]")
    assert wrong != SEEN
    cfg = preset("tiny", dtype="fp32", dropout=0.0)
    assert not compare_first(parse_communication_log(wrong), cfg, Layout(1, 2))["first_matches_plan"]


def test_error_line_finds_the_assert_and_drops_the_backtrace():
    from tpfuser.commlog import error_line
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
