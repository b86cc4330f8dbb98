"""Every fusion's printed math, digested (tools/fusion_digests.py), equals the
committed record: a change meant to leave the fusions alone (issue 14's
redesign) shows it did. A change of the fusions regenerates the record
(`python3 tools/fusion_digests.py > tests/data/golden/fusion_digests.json`, and
for the single-fusion family `python3 tools/fusion_digests.py --schedules
megatron-whole,megatron-sp-whole > tests/data/golden/fusion_digests_whole.json`)
and says why.

Two records, one per family of schedules: the default (megatron, megatron-sp:
the masks in a fusion of their own, the passes cut at the sublayers) and the
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
           ("megatron-whole", "megatron-sp-whole"): os.path.join(GOLDEN, "fusion_digests_whole.json")}


@pytest.mark.parametrize("schedules, path", RECORDS.items(), ids=[s[0] for s in RECORDS])
def test_fusions_are_as_recorded(schedules, path):
    before = json.load(open(path))
    now = fusion_digests.digests(schedules)
    assert len(now) == len(before) == 200
    assert {k for k in now | before if now.get(k) != before.get(k)} == set()


def test_the_families_digest_the_same_fusions_and_differ():
    """The same 200 (preset, dtype, mesh, pass) in both records; the families write them differently."""
    default, whole = (json.load(open(path)) for path in RECORDS.values())
    assert set(default) == set(whole)
    assert all(default[k] != whole[k] for k in default)
