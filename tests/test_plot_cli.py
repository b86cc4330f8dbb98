"""`python -m tpfuser.bench.plot OUT.png REPORT.json ...` with the command
line's rules: every refusal one line naming the thing, exit status 2, no
traceback, nothing written (the output path checked before a report is read);
the figure written whole or not at all (CPU)."""
import errno
import json
import os
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("matplotlib")

from tpfuser.bench import plot  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def report(mesh="1x1", **changes) -> dict:
    """A bench report validate_report takes (the fields the plot reads, made up)."""
    rep = {"preset": "tiny", "config": {}, "pass": "forward", "mesh": mesh, "gpu": "stand-in", "torch": "2.10",
           "timing": "made up", "matmul_tflops_measured": 700.0, "matmul_gflop": 1.0, "compute_floor_ms": 0.5,
           "results": {name: {"median_ms": ms, "min_ms": ms * 0.9, "max_ms": ms * 1.1, "runs": 10, "tflops": 1.0,
                              "fraction_of_matmul_rate": 0.5, "ratio_to_eager": ms / 2.0}
                       for name, ms in (("eager", 2.0), ("nvfuser", 1.0), ("gemms", 0.7))}}
    rep.update(changes)
    return rep


def with_row(**row):
    rep = report()
    rep["results"]["eager"].update(row)
    return rep


def dumped(obj) -> str:
    return json.dumps(obj, indent=1)


GOOD = dumped(report())
# (id, OUT (in the case's folder; "{dir}": the folder itself), the reports' texts (None: the path as given), words)
CASES = [
    ("out_directory", "{dir}", [GOOD], ["OUT=", "is a directory; give a file name"]),
    ("out_dash", "-", [GOOD], ["OUT='-': an image is not written to standard output"]),
    ("out_fifo", "@fifo", [GOOD], ["not a regular file (a pipe, socket or device)"]),
    ("out_dangling_link", "@dangling", [GOOD], ["a symbolic link to", "which does not exist"]),
    ("out_missing_folder", "no/such/out.png", [GOOD], ["its folder", "does not exist"]),
    ("out_unknown_suffix", "out.frob", [GOOD], ["matplotlib writes no 'frob' figure; expected a name ending in"]),
    ("out_empty", "", [GOOD], ["OUT='': an empty path"]),
    ("report_missing", "out.png", ["@missing"], ["REPORT=", "missing.json': no such file"]),
    ("report_directory", "out.png", ["@dir"], ["REPORT=", "is a directory; expected a bench report"]),
    ("report_fifo", "out.png", ["@fifo"], ["REPORT=", "not a regular file"]),
    ("report_empty", "out.png", [""], ["report0.json': empty"]),
    ("report_truncated", "out.png", [GOOD[: len(GOOD) // 2]], ["report0.json': cut short"]),
    ("report_cut_in_a_string", "out.png", [GOOD[: GOOD.index('"forward"') + 4]],
     ["report0.json': cut short (its JSON ends inside an unclosed string"]),
    ("report_not_json", "out.png", ["median 1.0 ms\n"], ["report0.json': not JSON (Expecting value: line 1 column 1)"]),
    ("report_binary", "out.png", [PNG.decode("latin-1")], ["report0.json': not text (byte 0 is not UTF-8)"]),
    ("report_a_list", "out.png", ["[1, 2]"], ["report0.json': JSON of another kind (a list)"]),
    ("report_missing_key", "out.png", [dumped({k: v for k, v in report().items() if k != "compute_floor_ms"})],
     ["report0.json': not a bench report: report: missing key 'compute_floor_ms'"]),
    ("report_wrong_type", "out.png", [dumped(with_row(median_ms="1.0"))],
     ["not a bench report: report.results['eager'].median_ms: expected float, got str"]),
    ("report_bool", "out.png", [dumped(with_row(runs=True))],
     ["report.results['eager'].runs: expected int, got bool"]),
    ("report_row_not_object", "out.png", [dumped(report(results={"eager": 5}))],
     ["report.results['eager']: expected an object of timings, got int"]),
    ("report_bad_mesh", "out.png", [dumped(report(mesh="tp8"))], ["report.mesh: expected DPxTP (e.g. '1x8'), got 'tp8'"]),
    ("report_ratio_str", "out.png", [dumped(with_row(ratio_to_eager="1x"))],
     ["report.results['eager'].ratio_to_eager: expected float, got str"]),
    ("report_plan", "out.png", [dumped({"preset": "tiny", "collectives": []})],
     ["a plan (tpfuser plan --json), not a bench report"]),
    ("second_report_bad", "out.png", [GOOD, "{"], ["report1.json': cut short"]),
    ("stdin_twice", "out.png", ["@-", "@-"], ["REPORT='-': standard input given more than once"]),
    ("no_arguments", None, [], ["python -m tpfuser.bench.plot: the following arguments are required: OUT.png"]),
    ("no_report", "out.png", [], ["the following arguments are required: REPORT.json"]),
    ("unknown_option", "out.png", ["@--frob", GOOD], ["unrecognized arguments: --frob"]),
]


def _argv(folder, out, texts):
    """The case's command line, its files made in `folder`."""
    argv = []
    if out is not None:
        if out == "@fifo":
            os.mkfifo(folder / "out.png")
            out = str(folder / "out.png")
        elif out == "@dangling":
            os.symlink("gone/out.png", folder / "out.png")
            out = str(folder / "out.png")
        elif out == "{dir}":
            out = str(folder)
        elif out not in ("-", ""):
            out = str(folder / out)
        argv.append(out)
    for i, text in enumerate(texts):
        if text == "@missing":
            argv.append(str(folder / "missing.json"))
        elif text == "@dir":
            (folder / "sub").mkdir()
            argv.append(str(folder / "sub"))
        elif text == "@fifo":
            os.mkfifo(folder / "in.json")
            argv.append(str(folder / "in.json"))
        elif text.startswith("@-"):
            argv.append(text[1:])
        else:
            (folder / f"report{i}.json").write_bytes(text.encode("latin-1") if text.startswith("\x89") else text.encode())
            argv.append(str(folder / f"report{i}.json"))
    return argv


def _run(argv, stdin=None):
    return subprocess.run([sys.executable, "-m", "tpfuser.bench.plot", *argv], capture_output=True, timeout=120,
                          input=stdin)


def _state(folder):
    """Every entry under folder, with its kind and bytes (what a refusal must leave as it was)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            out[os.path.relpath(p, folder)] = (stat.S_IFMT(st.st_mode), open(p, "rb").read()
                                               if stat.S_ISREG(st.st_mode) else None)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def one(case):
        folder = tmp_path_factory.mktemp(case[0])
        argv = _argv(folder, case[1], case[2])
        before = _state(folder)
        return _run(argv), before, _state(folder), folder
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        return dict(zip((c[0] for c in CASES), pool.map(one, CASES)))


@pytest.mark.parametrize("words", [c[3] for c in CASES], ids=[c[0] for c in CASES])
def test_refusal_is_one_line_and_writes_nothing(runs, request, words):
    r, before, after, folder = runs[request.node.callspec.id]
    err = r.stderr.decode()
    assert r.returncode == 2, (r.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    for w in words:
        assert w in lines[0], lines[0]
    assert r.stdout == b""
    assert after == before, "a refused plot changed its folder"
    assert not os.path.exists(str(folder) + ".png"), "wrote DIR.png beside the directory"


def test_at_least_20_cases():
    assert len(CASES) >= 20


def test_plots_a_report(tmp_path):
    (tmp_path / "r.json").write_text(GOOD)
    r = _run([str(tmp_path / "out.png"), str(tmp_path / "r.json")])
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert (tmp_path / "out.png").read_bytes().startswith(PNG)
    assert sorted(os.listdir(tmp_path)) == ["out.png", "r.json"]   # no temporary file left


def test_plots_meshes_from_standard_input_and_a_file_as_svg(tmp_path):
    (tmp_path / "r.json").write_text(dumped(report(mesh="1x2")))
    out = tmp_path / "scaling.svg"
    r = _run([str(out), "-", str(tmp_path / "r.json")], stdin=GOOD.encode())
    assert r.returncode == 0, r.stderr
    assert b"<svg" in out.read_bytes()[:400]


def test_output_through_a_link_replaces_the_file_not_the_link(tmp_path):
    target = tmp_path / "figs" / "bench.png"
    target.parent.mkdir()
    target.write_bytes(b"old")
    os.symlink(target, tmp_path / "bench.png")
    (tmp_path / "r.json").write_text(GOOD)
    r = _run([str(tmp_path / "bench.png"), str(tmp_path / "r.json")])
    assert r.returncode == 0, r.stderr
    assert os.path.islink(tmp_path / "bench.png") and target.read_bytes().startswith(PNG)
    assert os.listdir(target.parent) == ["bench.png"]


def test_output_checked_before_the_reports_are_read(tmp_path, monkeypatch, capsys):
    read = []
    monkeypatch.setattr(plot, "read_report", lambda p: read.append(p))
    assert plot.main([str(tmp_path), str(tmp_path / "r.json")]) == 2
    assert read == [] and "is a directory" in capsys.readouterr().err


def test_failed_write_keeps_the_old_figure(tmp_path, monkeypatch, capsys):
    """A full disk while the figure is written: half a file on disk, then ENOSPC.
    The old figure stays whole, no temporary file, one line naming the path."""
    import matplotlib.figure
    out = tmp_path / "bench.png"
    out.write_bytes(b"the old figure")
    (tmp_path / "r.json").write_text(GOOD)

    def full(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(PNG)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    assert plot.main([str(out), str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err == (f"error: OUT={str(out)!r}: could not be written (No space left on device); "
                                       f"nothing was written\n")
    assert out.read_bytes() == b"the old figure"
    assert sorted(os.listdir(tmp_path)) == ["bench.png", "r.json"]


def test_interrupt_leaves_nothing(tmp_path, monkeypatch, capsys):
    import matplotlib.figure
    (tmp_path / "r.json").write_text(GOOD)

    def interrupted(self, fname, **kwargs):
        open(fname, "wb").write(PNG)
        raise KeyboardInterrupt
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", interrupted)
    try:
        status = plot.main([str(tmp_path / "out.png"), str(tmp_path / "r.json")])
    except KeyboardInterrupt:
        pytest.fail("the interrupt left main (a traceback for the user)")
    assert status == 130
    assert "interrupted" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["r.json"]
