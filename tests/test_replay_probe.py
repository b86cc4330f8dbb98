"""tools/probes/replay_probe.py (the bf16 graph tests that failed on the H200,
2026-12-03): the suite runs every suspect the probe knows, and a name it does
not know is refused (CPU)."""
import os
import re
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, os.path.join(TOOLS, "probes"))
import replay_probe  # noqa: E402


def test_the_suite_runs_every_suspect_and_the_control():
    suite = open(os.path.join(TOOLS, "gpu_suite.sh")).read()
    default = re.search(r"REPLAY_SUSPECTS:-([^}]*)\}", suite).group(1).split()
    assert default == list(replay_probe.SUSPECTS)
    assert "nothing" in default


def test_an_unknown_suspect_is_refused_by_name():
    with pytest.raises(SystemExit, match="one of: nothing.*got \\['eager'\\]"):
        replay_probe.main(["eager"])
    with pytest.raises(SystemExit, match="got \\['nothing', 'nothing'\\]"):
        replay_probe.main(["nothing", "nothing"])
