"""A schedule's segment_hints: points kept inside one fusion where nvFuser's
segmenter is told to end a kernel (a segment_set on what crosses the point),
for the first call (NOTES.md). CPU: the fusions' text."""
import json

import pytest

from tpfuser.config import Layout, preset
from tpfuser.parallel.passes import build_pass
from tpfuser.parallel.schedules import SCHEDULES, load_schedule

HINTS = ["attn.c_attn", "attn.c_proj.out", "grad:mlp.c_fc", "grad:attn.c_attn"]


def _hinted(**more):
    return load_schedule({"base": "megatron", "name": "hinted", "segment_hints": HINTS, **more})


def test_a_hint_is_a_segment_set_in_the_same_fusion():
    cfg, hinted, plain = preset("tiny"), _hinted(), SCHEDULES["megatron"]
    for kind, hints in (("train", 2), ("backward", 2)):
        with_hints = build_pass(cfg, hinted.form(), kind, Layout())
        without = build_pass(cfg, plain.form(), kind, Layout())
        assert [p.point for p in with_hints.pieces] == [p.point for p in without.pieces]   # no fusion more
        assert with_hints.outputs == without.outputs
        assert with_hints.text().count("SegmenterSet") == hints and "SegmenterSet" not in without.text()


def test_hints_travel_as_data_and_bad_ones_are_refused():
    hinted = _hinted()
    assert load_schedule(json.loads(json.dumps(hinted.as_dict()))) == hinted
    for bad in (["mlp.c_fc"], ["masks"], ["no.such.point"], "attn.c_attn"):   # a cut of megatron's; nothing crosses
        with pytest.raises(ValueError, match="segment_hints") as e:
            load_schedule({"base": "megatron", "name": "bad", "segment_hints": bad})
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="tried on 1x1 only"):
        hinted.check(preset("tiny"), Layout(1, 2))
    _hinted(experimental=True).check(preset("tiny"), Layout(1, 2))


def test_a_schedule_file_by_path_like(tmp_path):
    """load_schedule takes a pathlib.Path to a JSON file as it takes the str."""
    import json
    import pathlib
    from tpfuser.parallel.schedules import SCHEDULES, load_schedule
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"base": "megatron-sp", "name": "mine"}))
    got = load_schedule(pathlib.Path(path))
    assert got.name == "mine" and got.linears == SCHEDULES["megatron-sp"].linears
    assert load_schedule({"base": "megatron", "name": "megatron"}) == SCHEDULES["megatron"]   # its own name: taken
