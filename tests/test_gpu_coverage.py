"""tools/gpu_coverage.py: which GPU tests a committed JUnit file says passed (the
H200 runs' JUnit files, copied to tests/data: tests/data/README.md)."""
import os
import sys

sys.path.insert(0, "tools")
import gpu_coverage  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

JUNIT = """<testsuites><testsuite>
<testcase classname="tests.test_gpu" name="test_a[fp32]" />
<testcase classname="tests.test_gpu" name="test_b"><failure message="x"/></testcase>
<testcase classname="tests.test_gpu" name="test_c"><skipped message="no CUDA"/></testcase>
<testcase classname="tests.test_gpu" name="test_d"><error message="x"/></testcase>
</testsuite></testsuites>"""


def test_only_passed_cases_count_and_since_drops_earlier_runs(tmp_path):
    for run in ("run2", "run10"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "gpu_tests.xml").write_text(JUNIT)
    passed = gpu_coverage.passed_in(str(tmp_path))
    assert gpu_coverage.run_number(str(tmp_path / "run10" / "x.xml")) == 10
    assert passed == {"tests/test_gpu.py::test_a[fp32]": ["run2", "run10"]}   # by run number, not name
    assert gpu_coverage.passed_in(str(tmp_path), since=3) == {"tests/test_gpu.py::test_a[fp32]": ["run10"]}


def test_the_committed_runs_name_real_gpu_tests():
    ids = set(gpu_coverage.gpu_test_ids())
    passed = gpu_coverage.passed_in(DATA)
    assert len(ids) > 30 and passed
    assert set(passed) <= ids        # a renamed or removed test would linger here as covered
    assert "tests/test_gpu_graphs.py::test_tp_block_graphs_train_as_the_called_module[bf16]" in passed


def test_split_balances_by_seconds_and_counts_an_unrun_test_as_the_slowest():
    ids = ["a", "b", "c", "d", "e"]
    seconds = {"a": 100.0, "b": 60.0, "c": 50.0, "d": 10.0}   # e never ran: counts 100
    groups = gpu_coverage.split(ids, seconds, 3)
    assert sorted(t for g in groups for t in g) == ids            # every test once
    loads = sorted(sum(seconds.get(t, 100.0) for t in g) for g in groups)
    assert loads == [100.0, 110.0, 110.0]                         # e | a d | b c (longest first)
    assert ["a", "d"] in groups and ["b", "c"] in groups
    assert gpu_coverage.split(ids[:2], seconds, 4) == [["a"], ["b"]]   # no empty group


def test_split_refuses_no_groups(capsys):
    import pytest
    with pytest.raises(SystemExit):
        gpu_coverage.main(["--split", "0"])
    assert "--split: expected a number of groups of at least 1, got 0" in capsys.readouterr().err
