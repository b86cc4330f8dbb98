"""Every fusion's printed math, digested (tools/fusion_digests.py), equals the
committed record: a change meant to leave the fusions alone (a redesign)
shows it did. A change of the fusions regenerates the record
(`python3 tools/fusion_digests.py > tests/data/golden/fusion_digests.json`, and
for the single-fusion family `python3 tools/fusion_digests.py --schedules
megatron-whole,megatron-sp-whole > tests/data/golden/fusion_digests_whole.json`)
and says why.

Three records, one per family of schedules: the default
(megatron-cut-linears and its -sp: each mask a fusion of its own, the passes
cut at every linear and in each LayerNorm's backward; `python3
tools/fusion_digests.py --schedules megatron-cut-linears,megatron-sp-cut-linears
> tests/data/golden/fusion_digests_cut_linears.json`), the one cut at the
sublayers (megatron, megatron-sp) and the
single-fusion one (megatron-whole, megatron-sp-whole), which writes the
fusions as they were before the schedules. Its record is the one from before
but for the 50 backward digests: the backward no longer takes the four
linears' biases it never read (its text otherwise the same, renumbered)."""
import json
import os
import sys

import pytest

sys.path.insert(0, "tools")
import fusion_digests  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden")
RECORDS = {("megatron", "megatron-sp"): os.path.join(GOLDEN, "fusion_digests.json"),
           ("megatron-whole", "megatron-sp-whole"): os.path.join(GOLDEN, "fusion_digests_whole.json"),
           ("megatron-cut-linears", "megatron-sp-cut-linears"): os.path.join(GOLDEN, "fusion_digests_cut_linears.json")}


@pytest.mark.parametrize("schedules, path", RECORDS.items(), ids=[s[0] for s in RECORDS])
def test_fusions_are_as_recorded(schedules, path):
    before = json.load(open(path))
    now = fusion_digests.digests(schedules)
    assert len(now) == len(before) == 200
    assert {k for k in now | before if now.get(k) != before.get(k)} == set()


def test_the_families_digest_the_same_fusions_and_differ():
    """The same 200 (preset, dtype, mesh, pass) in every record; the families write each differently."""
    sublayers, whole, cut = (json.load(open(path)) for path in RECORDS.values())
    assert set(sublayers) == set(whole) == set(cut)
    assert all(len({sublayers[k], whole[k], cut[k]}) == 3 for k in sublayers)
