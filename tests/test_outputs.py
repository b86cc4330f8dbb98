"""Output paths (tpfuser/outputs.py): the up-front check never blocks and never
touches what is there; a write is whole or nothing, the file there kept as it
was on failure, no temporary file left; "-" is standard output where it makes
sense. In the API and as the command line meets them (CPU, no GPU)."""
import errno
import json
import os
import stat
import subprocess
import sys
import threading

import pytest

from tpfuser import outputs
from tpfuser.outputs import check_writable, replacing, write_json, write_output

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TPFUSER_SINGLE_PROCESS", "TPFUSER_TIMEOUT_S")


def refusal(fn, *args, **kwargs) -> str:
    """The one line fn refuses with (a ValueError)."""
    with pytest.raises(ValueError) as err:
        fn(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def finishes(fn, timeout_s=10.0):
    """fn's outcome (its value or its exception) when it returns within the
    timeout; a check that opened a named pipe would block there forever."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:   # noqa: BLE001 - handed to the test
            box["error"] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"blocked for {timeout_s} s"
    return box


def listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


# -- the up-front check ---------------------------------------------------

def test_named_pipe_refused_without_blocking(tmp_path):
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    box = finishes(lambda: check_writable(str(fifo), "--json"))
    assert isinstance(box.get("error"), ValueError), box
    assert str(box["error"]) == f"--json={str(fifo)!r}: not a regular file (a pipe, socket or device); give a file name"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and listing(tmp_path) == ["out.json"]


def test_dangling_link_refused_and_left_as_it_was(tmp_path):
    link = tmp_path / "out.json"
    os.symlink(tmp_path / "nowhere" / "x.json", link)
    message = refusal(check_writable, str(link), "--json")
    assert message.startswith(f"--json={str(link)!r}: a symbolic link to ") and "which does not exist" in message
    assert os.path.islink(link) and os.readlink(link) == str(tmp_path / "nowhere" / "x.json")
    with pytest.raises(ValueError):   # the write alone fails too, in one line, the link kept (not replaced)
        write_json(str(link), {"a": 1})
    assert os.path.islink(link)
    assert listing(tmp_path) == ["out.json"]


def test_link_to_a_file_is_written_through(tmp_path):
    target = tmp_path / "real" / "plan.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "plan.json"
    os.symlink(target, link)
    check_writable(str(link), "--json")
    write_json(str(link), {"a": 1})
    assert os.path.islink(link) and os.readlink(link) == str(target)
    assert json.loads(target.read_text()) == {"a": 1}
    assert listing(tmp_path) == ["plan.json", "real"] and listing(target.parent) == ["plan.json"]


@pytest.mark.parametrize("make, words", [
    (lambda t: str(t), "is a directory; give a file name"),
    (lambda t: str(t / "no" / "such" / "x.json"), "its folder"),
    (lambda t: str(t / "file" / "x.json"), "is a file, not a folder"),
    (lambda t: str(t / "x.json") + os.sep, "a folder's name; give a file name"),
    (lambda t: str(t / ("x" * 300 + ".json")), "bytes long; expected at most"),
    (lambda t: "", "an empty path"),
    (lambda t: "   ", "an empty path"),
], ids=["directory", "missing_folder", "parent_is_a_file", "trailing_slash", "name_too_long", "empty", "blank"])
def test_paths_that_take_no_file_are_refused(tmp_path, make, words):
    (tmp_path / "file").write_text("kept")
    before = listing(tmp_path)
    path = make(tmp_path)
    message = refusal(check_writable, path, "--json")
    assert message.startswith(f"--json={path!r}: ") and words in message, message
    assert listing(tmp_path) == before and (tmp_path / "file").read_text() == "kept"


def test_check_leaves_an_existing_file_as_it_was(tmp_path):
    out = tmp_path / "plan.json"
    out.write_text("precious")
    os.utime(out, (1_000_000, 1_000_000))
    check_writable(str(out), "--json")
    assert out.read_text() == "precious" and os.stat(out).st_mtime == 1_000_000
    assert listing(tmp_path) == ["plan.json"]


def test_not_a_path_refused():
    assert refusal(check_writable, 3, "--json") == "--json=3: expected a path (str), got int"


def test_stdout_where_it_makes_sense():
    check_writable("-", "--json")   # text: standard output
    assert refusal(check_writable, "-", "--png") == "--png='-': an image is not written to standard output; give a file name"
    assert refusal(check_writable, "-", "OUT", stdout=False).startswith("OUT='-': ")


# -- the write --------------------------------------------------------------

def test_dash_is_standard_output(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_json("-", {"a": [1, 2]})
    assert json.loads(capsys.readouterr().out) == {"a": [1, 2]}
    assert listing(tmp_path) == []   # no file named "-"


def test_path_objects_taken(tmp_path):
    write_json(tmp_path / "x.json", [1])
    assert json.loads((tmp_path / "x.json").read_text()) == [1]


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_failed_write_leaves_the_file_and_no_temporary(tmp_path, monkeypatch, where):
    """A full disk (ENOSPC) at each step: the old file whole, nothing beside it, one line naming the path."""
    out = tmp_path / "plan.json"
    out.write_text("the old plan")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fail(*args, **kwargs):
        raise full
    if where == "write":
        real_open = open

        class Full:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, text):
                self.f.write(text[: len(text) // 2])   # half of it on disk, then the disk is full
                self.f.flush()
                raise full
        monkeypatch.setattr("builtins.open", lambda p, *a, **k: Full(real_open(p, *a, **k))
                            if os.path.basename(str(p)).startswith(".plan.json.") else real_open(p, *a, **k))
    else:
        monkeypatch.setattr(outputs.os, where, fail)
    message = refusal(write_json, str(out), {"a": 1})
    assert message == f"--json={str(out)!r}: could not be written (No space left on device); nothing was written"
    monkeypatch.undo()
    assert out.read_text() == "the old plan"
    assert listing(tmp_path) == ["plan.json"]


def test_interrupt_mid_write_leaves_no_temporary(tmp_path):
    out = tmp_path / "x.json"
    out.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with replacing(str(out), "--json") as tmp:
            with open(tmp, "w") as f:
                f.write("half")
            raise KeyboardInterrupt
    assert out.read_text() == "old" and listing(tmp_path) == ["x.json"]


def test_write_keeps_the_files_mode(tmp_path):
    out = tmp_path / "x.json"
    out.write_text("old")
    os.chmod(out, 0o640)
    write_output(str(out), "new")
    assert out.read_text() == "new" and stat.S_IMODE(os.stat(out).st_mode) == 0o640
    fresh = tmp_path / "fresh.json"
    write_output(str(fresh), "new")
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o666 & ~mask   # as open() makes it, not mkstemp's 0600


def test_long_name_written(tmp_path):
    """The temporary file's name is cut to fit: a name of 250 bytes is written."""
    out = tmp_path / ("x" * 245 + ".json")
    check_writable(str(out), "--json")
    write_output(str(out), "ok")
    assert out.read_text() == "ok" and listing(tmp_path) == [out.name]


def test_closed_standard_output_is_one_line(monkeypatch):
    class Gone:
        def write(self, text):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        def flush(self):
            pass
    monkeypatch.setattr(sys, "stdout", Gone())
    assert refusal(write_output, "-", "x", "--json") == "--json='-': standard output could not be written (Input/output error)"


# -- the command line -------------------------------------------------------

def _cli(argv, timeout=120, **kwargs):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return subprocess.run([sys.executable, "-m", "tpfuser.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def test_plan_json_dash_is_json_alone_on_stdout(tmp_path):
    r = _cli(["plan", "--json", "-"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["preset"] == "tiny"
    assert not (tmp_path / "-").exists()


def test_plan_json_dash_writes_no_file_named_dash(tmp_path):
    r = _cli(["plan", "--json", "-"], cwd=tmp_path)
    assert r.returncode == 0 and "\"preset\": \"tiny\"" in r.stdout, r.stderr
    assert listing(tmp_path) == []


def test_plan_json_to_a_named_pipe_refused_at_once(tmp_path):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    r = _cli(["plan", "--json", str(fifo)], timeout=60)   # a blocked open would be this timeout's failure
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"error: --json={str(fifo)!r}: not a regular file (a pipe, socket or device); give a file name\n"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_plan_json_to_a_dangling_link_refused_and_kept(tmp_path):
    link = tmp_path / "plan.json"
    os.symlink("missing.json", link)
    r = _cli(["plan", "--json", str(link)])
    assert r.returncode == 2 and r.stdout == "" and "which does not exist" in r.stderr
    assert os.readlink(link) == "missing.json" and listing(tmp_path) == ["plan.json"]


FULL_DISK = r"""
import errno, os, sys
from tpfuser import outputs
def full(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
outputs.os.fsync = full
from tpfuser.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_plan_json_on_a_full_disk_is_one_line_and_keeps_the_file(tmp_path):
    out = tmp_path / "plan.json"
    out.write_text("the old plan")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    r = subprocess.run([sys.executable, "-c", FULL_DISK, "plan", "--json", str(out)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == (f"error: --json={str(out)!r}: could not be written (No space left on device); "
                        f"nothing was written\n")
    assert out.read_text() == "the old plan" and listing(tmp_path) == ["plan.json"]


def test_an_output_that_names_an_input_or_another_output_is_refused(tmp_path):
    """Writing it would destroy what the command reads (a schedule, the calibration) or what it just wrote."""
    sched = tmp_path / "s.json"
    sched.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(sched)
    check = outputs.check_distinct
    assert "the same file as --schedule-file=" in refusal(check, {"--json": str(link)}, {"--schedule-file": str(sched)})
    assert "the same file as --comm-table=" in refusal(check, {"--json": str(sched)},
                                                       {"--comm-table": ["other", str(sched)]})
    new = str(tmp_path / "new.out")   # not there yet: the same path is the same file
    assert "--png=" in refusal(check, {"--json": new, "--png": os.path.join(str(tmp_path), ".", "new.out")}, {})
    check({"--json": "-", "--png": new}, {"--schedule-file": None, "--calibration": str(sched)})   # all distinct
    check({"--json": None}, {"--schedule-file": str(sched)})
    assert sched.read_text() == "{}"


@pytest.mark.parametrize("argv", [["--name", ""], ["--name", "  "], ["--many", "a", "--many", ""]])
def test_an_empty_option_value_is_refused_not_taken_as_the_default(argv, capsys):
    p = outputs.ArgParser(prog="t")
    p.add_argument("--name", default=None)
    p.add_argument("--many", action="append", default=[])
    p.add_argument("--json", default=None)   # an output path: check_writable's own refusal
    with pytest.raises(SystemExit) as end:
        p.parse_args(argv)
    assert end.value.code == 2 and "an empty value; give one, or leave the option out" in capsys.readouterr().err
    assert p.parse_args(["--json", ""]).json == "" and p.parse_args(["--name", "x"]).name == "x"


def test_a_stream_or_device_is_not_replaced():
    for path in ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"):
        assert "a device or stream, not a file to write whole; use - for standard output" in \
            refusal(check_writable, path, "--json")
