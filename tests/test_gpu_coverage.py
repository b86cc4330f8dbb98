"""tools/gpu_coverage.py: which GPU tests a JUnit file says passed, on JUnit
files and test files made here (no committed run is read)."""
import sys

sys.path.insert(0, "tools")
import gpu_coverage  # noqa: E402

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


def test_the_gpu_tests_are_collected_by_their_mark(tmp_path):
    (tmp_path / "test_made.py").write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_on_gpu():\n    pass\n\n\n"
                                           "def test_on_cpu():\n    pass\n")
    ids = gpu_coverage.gpu_test_ids([str(tmp_path / "test_made.py")])
    assert len(ids) == 1 and ids[0].endswith("test_made.py::test_on_gpu")


def test_the_report_names_what_passed_and_what_never_did(tmp_path, monkeypatch, capsys):
    """Against the GPU tests there are now: one a run passed (named with its
    runs), one none did (the exit status says the suite is not shown to pass);
    a test a run passed that no longer exists is not counted."""
    for run in ("run3", "run7"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "gpu_tests.xml").write_text(JUNIT)
    monkeypatch.setattr(gpu_coverage, "gpu_test_ids", lambda: ["tests/test_gpu.py::test_a[fp32]",
                                                               "tests/test_gpu.py::test_e"])
    assert gpu_coverage.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == ["passed  tests/test_gpu.py::test_a[fp32]  (run3, run7)", "NOT YET tests/test_gpu.py::test_e",
                   "1 of 2 GPU tests passed in a committed run from run0 on"]


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
