"""Every fusion's printed math, digested (tools/fusion_digests.py), equals the
committed record: a change meant to leave the fusions alone (issue 14's
redesign) shows it did. A change of the fusions regenerates the record
(`python3 tools/fusion_digests.py > results/fusion_digests.json`) and says why."""
import json
import sys

sys.path.insert(0, "tools")
import fusion_digests  # noqa: E402


def test_fusions_are_as_recorded():
    before = json.load(open("results/fusion_digests.json"))
    now = fusion_digests.digests()
    assert len(now) == 200
    assert {k for k in now if now[k] != before.get(k)} == set()
