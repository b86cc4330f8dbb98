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
