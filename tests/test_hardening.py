"""What a demanding user tries and the program must refuse in one line (or
take as PyTorch takes it): JSON no file of ours holds, a named schedule
changed in place, options taken and never applied, an output whose name asks
for another format, a signal during a write, a constructor's arguments. All
in-process (CPU) but the signals, which need a process to end."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tpfuser.block.form import LINEARS
from tpfuser.cli import main
from tpfuser.config import Layout, preset
from tpfuser.parallel.schedules import SCHEDULES, LinearSchedule, Schedule, load_schedule

ONE_SCHEDULE = {"base": "megatron", "linears": {"mlp.c_proj": {"chunks": 2, "overlap": "fusions"}}}


def refusal(capsys) -> str:
    """The one line a refusal printed on stderr (anything else fails the test)."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# -- JSON the program reads: a schedule file -----------------------------------------------------------------------

SCHEDULE_TEXTS = [
    ("linear_twice", '{"base": "megatron", "linears": {"mlp.c_proj": {"chunks": 2, "overlap": "fusions"}, '
                     '"mlp.c_proj": {"chunks": 1}}}', ["field 'linears.mlp.c_proj' given twice"]),
    ("base_twice", '{"base": "megatron-sp", "base": "megatron"}', ["field 'base' given twice"]),
    ("nan_chunks", '{"base": "megatron", "linears": {"mlp.c_proj": {"chunks": NaN}}}',
     ["field 'linears.mlp.c_proj.chunks': expected a finite number, got NaN"]),
    ("infinity", '{"linears": {"mlp.c_proj": {"chunks": -Infinity}}}',
     ["field 'linears.mlp.c_proj.chunks': expected a finite number, got -Infinity"]),
    ("overflowing_float", '{"linears": {"mlp.c_proj": {"chunks": 1e999}}}',
     ["field 'linears.mlp.c_proj.chunks': expected a finite number, got 1e999"]),
    ("5000_digits", '{"linears": {"mlp.c_proj": {"chunks": ' + "7" * 5000 + "}}}",
     ["field 'linears.mlp.c_proj.chunks': expected a number of at most 20 digits, got a 5000-digit integer"]),
    ("100000_deep", '{"cuts": ' + "[" * 100000 + "]" * 100000 + "}",
     ["field 'cuts[][][] ...': nested deeper than 32 levels (line 1)"]),
]


@pytest.mark.parametrize("text,words", [c[1:] for c in SCHEDULE_TEXTS], ids=[c[0] for c in SCHEDULE_TEXTS])
def test_a_schedule_file_no_schedule_holds_is_refused_naming_file_and_field(tmp_path, capsys, text, words):
    path = tmp_path / "mine.json"
    path.write_text(text)
    assert main(["plan", "--schedule-file", str(path)]) == 2
    err = refusal(capsys)
    assert f"schedule file {str(path)!r}: " in err and all(w in err for w in words), err


def test_a_schedule_file_as_written_is_taken(tmp_path, capsys):
    """The control: the same file with each key once and plain numbers."""
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(ONE_SCHEDULE))
    assert main(["plan", "--schedule-file", str(path)]) == 0
    assert "megatron+custom" in capsys.readouterr().out


def test_a_schedule_file_past_its_bound_is_refused_unread(tmp_path, capsys):
    """A valid schedule padded past 1 MiB: a schedule is a few hundred bytes."""
    path = tmp_path / "big.json"
    path.write_text(json.dumps(ONE_SCHEDULE) + " " * (1 << 20))
    assert main(["plan", "--schedule-file", str(path)]) == 2
    assert f"schedule file {str(path)!r}: {path.stat().st_size} bytes; expected at most 1048576" in refusal(capsys)


# -- JSON the program reads: comm tables, calibrations, bench reports ---------------------------------------------

def test_a_comm_table_json_with_a_kind_twice_or_nan_is_refused(tmp_path):
    from tpfuser.predict.comm import read_comm_table
    table = '{"sizes": [1048576, 2097152], "busbw_gbps": [40.0, %s], "ranks": 8}'
    twice = tmp_path / "twice.json"
    twice.write_text('{"tables": {"allreduce": %s, "allreduce": %s}}' % (table % "60.0", table % "70.0"))
    with pytest.raises(ValueError, match=r"^--comm-table='.*twice.json': field 'tables.allreduce' given twice"):
        read_comm_table(str(twice))
    nan = tmp_path / "nan.json"
    nan.write_text('{"tables": {"allreduce": %s}}' % (table % "NaN"))
    with pytest.raises(ValueError, match=r"field 'tables.allreduce.busbw_gbps\[1\]': expected a finite number, got NaN"):
        read_comm_table(str(nan))


def test_a_comm_table_size_past_what_a_message_can_be_is_refused(tmp_path):
    from tests.test_predict import NCCL_TESTS
    from tpfuser.predict.comm import read_comm_table
    path = tmp_path / "huge.json"
    path.write_text('{"tables": {"allreduce": {"sizes": [1048576, 1.5e300], "busbw_gbps": [40.0, 60.0]}}}')
    with pytest.raises(ValueError, match=r"table 'allreduce': sizes expected a list of whole numbers of bytes, "
                                         r"got \[1048576, 1.5e\+300\] \(a size below 2\*\*63 each\)$"):
        read_comm_table(str(path))
    text = tmp_path / "huge.txt"
    text.write_text(NCCL_TESTS.replace("    16777216", "9" * 30))   # its last row's size, 30 digits
    assert read_comm_table(str(text))["allgather"].sizes == (1 << 20, 4 << 20)


def test_a_calibration_with_a_field_twice_is_refused(tmp_path):
    from tpfuser.predict.calibration import CalibrationError, read_calibration
    data = os.path.join(os.path.dirname(__file__), "data", "calibration_standin.json")
    text = open(data).read().strip()
    assert text.startswith("{")
    path = tmp_path / "cal.json"
    path.write_text('{"stand_in": false, ' + text[1:])   # the stand-in's own "stand_in": true comes after
    with pytest.raises(CalibrationError, match=r"cal.json': field 'stand_in' given twice"):
        read_calibration(str(path))


def test_a_bench_report_with_a_key_twice_or_past_its_bound_is_refused(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from tests.test_plot_cli import report
    from tpfuser.bench import plot
    text = json.dumps(report())
    twice = tmp_path / "twice.json"
    twice.write_text(text[:-1] + ', "mesh": "1x8"}')
    assert plot.main([str(tmp_path / "out.png"), str(twice)]) == 2
    assert "twice.json': field 'mesh' given twice" in refusal(capsys)
    big = tmp_path / "big.json"
    big.write_text(text + " " * (16 << 20))
    assert plot.main([str(tmp_path / "out.png"), str(big)]) == 2
    assert f"big.json': {big.stat().st_size} bytes; expected at most {16 << 20}" in refusal(capsys)
    assert sorted(os.listdir(tmp_path)) == ["big.json", "twice.json"]


# -- Schedules: named ones cannot change; checked again where a block is built; options never applied -------------


MUTATIONS = [
    ("set", lambda d: d.__setitem__("mlp.c_proj", LinearSchedule("column"))),
    ("update", lambda d: d.update({"mlp.c_proj": LinearSchedule("column")})),
    ("delete", lambda d: d.__delitem__("mlp.c_proj")),
    ("pop", lambda d: d.pop("mlp.c_proj")),
    ("setdefault", lambda d: d.setdefault("mlp.c_proj2", LinearSchedule("row"))),
    ("clear", lambda d: d.clear()),
    ("merge", lambda d: d.__ior__({"mlp.c_proj": LinearSchedule("column")})),
]


@pytest.mark.parametrize("change", [m[1] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_a_named_schedule_cannot_be_changed_through_what_load_schedule_returns(change):
    with pytest.raises(TypeError, match=r"^schedule 'megatron': its linears cannot be changed in place"):
        change(load_schedule("megatron").linears)
    assert {k: v.style for k, v in SCHEDULES["megatron"].linears.items()} == \
        {"attn.c_attn": "column", "attn.c_proj": "row", "mlp.c_fc": "column", "mlp.c_proj": "row"}


def test_a_schedules_fusion_options_cannot_be_changed_in_place():
    schedule = load_schedule({"base": "megatron", "fusion_options": {"mlp.c_fc": {"disable_options": ["a"]}}})
    with pytest.raises(TypeError, match=r"^schedule 'megatron\+custom': its fusion_options cannot be changed"):
        schedule.fusion_options["attn.c_proj.out"] = {"disable_options": ["b"]}
    with pytest.raises(TypeError):
        schedule.fusion_options["mlp.c_fc"]["enable_options"] = ["c"]
    with pytest.raises(AttributeError):
        schedule.fusion_options["mlp.c_fc"]["disable_options"].append("d")
    assert schedule.options("mlp.c_fc") == {"_disable_options": ["a"]}


def test_the_dicts_a_schedule_is_made_from_stay_the_callers():
    """Changing them afterwards changes the caller's dicts, not the schedule (it was checked with what it holds)."""
    linears = dict(SCHEDULES["megatron"].linears)
    options = {"mlp.c_fc": {"disable_options": ["a"]}}
    schedule = Schedule("mine", linears, cuts=("mlp.c_fc",), fusion_options=options)
    linears["mlp.c_proj"] = LinearSchedule("column")
    options["mlp.c_fc"]["disable_options"].append("b")
    options["no.such.point"] = {}
    assert schedule.linears["mlp.c_proj"].style == "row"
    assert schedule.fusion_options == {"mlp.c_fc": {"disable_options": ("a",)}}


def test_a_frozen_schedule_still_copies_compares_and_writes_as_json():
    import copy
    import pickle
    schedule = load_schedule({"base": "megatron-overlap", "fusion_options": {"mlp.c_fc": {"disable_options": ["a"]}}})
    assert copy.deepcopy(schedule) == schedule == pickle.loads(pickle.dumps(schedule))
    assert schedule.replace(name="other").linears == schedule.linears
    data = schedule.as_dict()
    assert type(data["linears"]) is dict and type(data["fusion_options"]["mlp.c_fc"]) is dict
    assert data["fusion_options"] == {"mlp.c_fc": {"disable_options": ["a"]}} and data["cuts"] == ["mlp.c_fc",
                                                                                                    "grad:attn.c_proj"]
    again = {k: v for k, v in json.loads(json.dumps(data)).items() if k != "name"}
    assert load_schedule({**again, "base": "megatron-overlap", "name": "again"}).replace(name=schedule.name) == schedule


def test_a_schedule_changed_behind_its_back_is_checked_again_where_a_block_is_built():
    from tpfuser.config import preset
    from tpfuser.runtime.block import ShardedBlock
    schedule = SCHEDULES["megatron"].replace(name="mine")
    object.__setattr__(schedule, "linears", {**schedule.linears, "mlp.c_proj": LinearSchedule("column")})
    words = "schedule field 'linears.mlp.c_proj.style': expected 'row' or 'row-sp'"
    with pytest.raises(ValueError, match=words):
        load_schedule(schedule)
    with pytest.raises(ValueError, match=words):
        ShardedBlock(preset("tiny"), schedule=schedule)


OPTIONS = {"disable_options": ["infer_contiguity"]}
EXECUTOR_CASES = [   # (base, the point given options, refused)
    ("megatron-overlap-streams", "mlp.c_proj", True),          # its all-reduce chunked on the stream axis
    ("megatron-overlap-streams", "attn.c_proj", True),
    ("megatron-overlap-streams", "mlp.c_proj.out", False),     # the fusion after it: fd.execute, with options
    ("megatron-sp-overlap-streams", "mlp.c_fc", True),         # its all-gather chunked on the stream axis
    ("megatron-sp-overlap-streams", "mlp.c_proj", False),      # its reduce-scatter runs whole: fd.execute
    ("megatron-sp-overlap-streams", "grad:mlp.c_fc.in", False),   # the backward runs whole
    ("megatron-overlap", "mlp.c_proj", False),                 # overlap "fusions": each chunk a fusion with options
]


@pytest.mark.parametrize("base,point,refused", EXECUTOR_CASES, ids=[f"{b}-{p}" for b, p, _ in EXECUTOR_CASES])
def test_fusion_options_for_a_linear_run_by_nvfusers_executor_are_refused(base, point, refused):
    spec = {"base": base, "fusion_options": {point: OPTIONS}}
    if not refused:
        assert load_schedule(spec).options(point)["_disable_options"] == ["infer_contiguity"]
        return
    with pytest.raises(ValueError, match=rf"^schedule field 'fusion_options.{point}': expected a point a fusion of "
                                         rf"this schedule begins at and takes options at \({point}, overlap 'streams', "
                                         rf"runs in nvFuser's MultiDeviceExecutor with options of its own\): one of "):
        load_schedule(spec)


def test_fusion_options_for_a_streams_linear_refused_at_the_command_line(tmp_path, capsys):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"base": "megatron-overlap-streams", "fusion_options": {"mlp.c_proj": OPTIONS}}))
    assert main(["plan", "--tp", "2", "--schedule-file", str(path)]) == 2
    assert "fusion_options.mlp.c_proj': expected a point a fusion of this schedule begins at and takes options at" \
        in refusal(capsys)


def test_the_points_refused_options_are_those_the_block_runs_through_the_executor():
    """Schedule.executor_points against runtime/chunked.chunked_pieces, which picks the runner
    of every piece: the points it gives an executor's overlap form, in either pass."""
    from tpfuser.config import Layout, preset
    from tpfuser.parallel.linear_schedule import EXECUTOR_OVERLAPS
    from tpfuser.runtime.chunked import chunked_pieces
    every = {f"all-{overlap}{sp}": load_schedule({"base": f"megatron{sp}", "name": f"all-{overlap}{sp}", "linears": {
        linear: {"chunks": 4, "overlap": overlap} for linear in LINEARS}}) for overlap in ("fusions", "streams")
        for sp in ("", "-sp")}
    for name, schedule in {**SCHEDULES, **every}.items():
        layout = Layout(1, 8, sp=schedule.sequence_parallel)
        run_apart = {point for (_, point), c in chunked_pieces(schedule, preset("gpt3"), layout).items()
                     if c.algorithm in EXECUTOR_OVERLAPS}
        assert schedule.executor_points() == run_apart, name
    assert every["all-streams"].executor_points() == {"attn.c_proj", "mlp.c_proj"}
    assert SCHEDULES["megatron-sp-ring"].executor_points() >= {"grad:mlp.c_fc.in", "attn.c_attn"}


# -- Outputs: the format follows the name, or the name is refused before any work ---------------------------------

PREDICT = ["plan", "--preset", "gpt3", "--tp", "8", "--predict"]
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "svg": b"<?xml", "pdf": b"%PDF-"}


@pytest.mark.parametrize("suffix", sorted(MAGIC))
def test_the_timeline_is_written_in_the_format_its_name_asks_for(tmp_path, suffix):
    pytest.importorskip("matplotlib")
    path = tmp_path / f"timeline.{suffix}"
    assert main([*PREDICT, "--png", str(path)]) == 0
    assert path.read_bytes().startswith(MAGIC[suffix])
    assert os.listdir(tmp_path) == [path.name]


NAMES = [   # (argv, the output's name, words): refused before any work, nothing written
    (PREDICT + ["--png"], "timeline.txt", "--png='{path}': matplotlib writes no 'txt' figure; expected a name ending in"),
    (["plan", "--json"], "plan.png", "--json='{path}': its name asks for a 'png' file, and this writes JSON"),
    (["plan", "--json"], "plan.csv", "--json='{path}': its name asks for a 'csv' file, and this writes JSON"),
    (["check", "--json"], "check.svg", "--json='{path}': its name asks for a 'svg' file"),
    (["bench", "--json"], "bench.pdf", "--json='{path}': its name asks for a 'pdf' file"),
    (["bench", "--png"], "bench.txt", "--png='{path}': matplotlib writes no 'txt' figure"),
]


@pytest.mark.parametrize("argv,name,words", NAMES, ids=[f"{a[0]}-{n}" for a, n, _ in NAMES])
def test_an_output_named_for_another_format_is_refused_before_any_work(tmp_path, capsys, argv, name, words):
    pytest.importorskip("matplotlib")
    path = tmp_path / name
    assert main([*argv, str(path)]) == 2
    assert words.format(path=path) in refusal(capsys)
    assert os.listdir(tmp_path) == []


# -- Signals during a write: nothing left beside the output ------------------------------------------------------


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Writes OUT through outputs.replacing (mode "write") or has check_writable make its probe file beside it
# (mode "probe"), touching READY once the temporary file is there and waiting for a signal; a signal's
# handling as the command line's.
WRITER = r"""
import os, signal, sys, tempfile, time
from tpfuser import outputs
mode, out, ready = sys.argv[1:]

def wait():   # for the signal: delivered now, or (held) pending until the hold ends
    open(ready, "w").close()
    deadline = time.monotonic() + 60
    while not signal.sigpending() and time.monotonic() < deadline:
        time.sleep(0.01)

try:
    if mode == "write":
        with outputs.replacing(out, "--png", suffix=".png") as tmp:
            open(tmp, "w").write("half")
            wait()
    else:
        real = tempfile.NamedTemporaryFile
        def probe(*args, **kwargs):
            made = real(*args, **kwargs)
            wait()
            return made
        tempfile.NamedTemporaryFile = probe
        outputs.check_writable(out, "--json")
except outputs.Signalled as e:
    print(e.line, file=sys.stderr)
    sys.exit(128 + e.signum)
except KeyboardInterrupt:
    print("interrupted (SIGINT): nothing was written", file=sys.stderr)
    sys.exit(130)
"""


def _signalled(tmp_path, argv: list[str], sig) -> subprocess.CompletedProcess:
    """Run argv (READY its last argument) until it touches READY, then send it `sig`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    ready = argv[-1]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(ready):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the writer never reached its write"
        time.sleep(0.02)
    os.remove(ready)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(argv, proc.returncode, "", err)


SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["write", "probe"])
def test_a_signal_during_a_write_leaves_the_output_as_it_was_and_nothing_beside_it(tmp_path, mode, sig):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "figure.png").write_text("the old figure")
    (tmp_path / "writer.py").write_text(WRITER)
    done = _signalled(tmp_path, [sys.executable, str(tmp_path / "writer.py"), mode, str(folder / "figure.png"),
                                 str(tmp_path / "ready")], sig)
    assert done.returncode == 128 + sig, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert os.listdir(folder) == ["figure.png"] and (folder / "figure.png").read_text() == "the old figure"


# The command itself: plan --predict --png, its figure's bytes in the temporary file when the signal comes.
PLAN = r"""
import sys, time
import matplotlib.figure
from tpfuser.cli import main
real = matplotlib.figure.Figure.savefig

def slow(self, *args, **kwargs):
    real(self, *args, **kwargs)
    open(sys.argv[2], "w").close()
    time.sleep(60)

matplotlib.figure.Figure.savefig = slow
sys.exit(main(["plan", "--preset", "gpt3", "--tp", "8", "--predict", "--png", sys.argv[1]]))
"""


def test_sigterm_while_plan_writes_its_timeline_leaves_nothing(tmp_path):
    pytest.importorskip("matplotlib")
    folder = tmp_path / "out"
    folder.mkdir()
    (tmp_path / "plan.py").write_text(PLAN)
    done = _signalled(tmp_path, [sys.executable, str(tmp_path / "plan.py"), str(folder / "timeline.svg"),
                                 str(tmp_path / "ready")], signal.SIGTERM)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.strip() == "ended by SIGTERM: no output was left half-written"
    assert os.listdir(folder) == []


# Files the package writes other than through outputs (replacing, write_output, save_figure), each in a
# temporary folder of its own that nobody reads as an output: by file, how many and why.
OWN_FOLDERS = {
    "tpfuser/verify/dtypes.py": (3, "the schedule file and logs of check's processes, in a TemporaryDirectory"),
    "tpfuser/verify/oracle.py": (1, "each rank's reference slices, in a mkdtemp folder removed after"),
}


def _writes(path) -> int:
    """Calls in a file that write a file: open() with a mode that writes, json.dump, savefig,
    write_text, write_bytes, torch.save."""
    import ast
    found = 0
    for node in ast.walk(ast.parse(open(path).read())):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        mode = node.args[1] if name == "open" and len(node.args) > 1 else next(
            (k.value for k in node.keywords if k.arg == "mode"), None)
        writes_mode = isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax+")
        found += bool(name == "open" and writes_mode or name in ("dump", "savefig", "write_text", "write_bytes")
                      or (name == "save" and ast.unparse(node.func) == "torch.save"))
    return found


def test_every_output_is_written_through_outputs():
    """So that every output is written whole or not at all, and a signal during it leaves nothing."""
    import pathlib
    written = {str(p.relative_to(ROOT)): n for p in sorted(pathlib.Path(ROOT, "tpfuser").rglob("*.py"))
               if str(p.relative_to(ROOT)) != "tpfuser/outputs.py" and (n := _writes(p))}
    assert written == {path: n for path, (n, _) in OWN_FOLDERS.items()}


# -- --comm-table: the kind named against the tool the file names ------------------------------------------------

def test_a_comm_table_named_for_another_collective_than_its_tools_is_refused(tmp_path, capsys):
    from tests.test_predict import NCCL_TESTS
    from tpfuser.predict.comm import read_comm_table
    path = tmp_path / "ar.txt"
    path.write_text(NCCL_TESTS.replace("all_gather_perf", "all_reduce_perf"))
    assert list(read_comm_table(f"allreduce={path}")) == ["allreduce"]   # the kind it names
    with pytest.raises(ValueError, match=rf"^nccl-tests output {path}: all_reduce_perf's output, given as "
                                         rf"allgather's: name it allreduce=FILE, or give all_gather_perf's output$"):
        read_comm_table(f"allgather={path}")
    assert main([*PREDICT, "--comm-table", f"allgather={path}"]) == 2
    assert "all_reduce_perf's output, given as allgather's" in refusal(capsys)


# -- The bench plot: what it draws is positive ------------------------------------------------------------------

NEGATIVE = [   # (the change to a report validate_report takes, the field named)
    ("median", lambda r: r["results"]["nvfuser"].update(min_ms=-1.2, median_ms=-1.0, max_ms=-0.8),
     "report.results['nvfuser'].min_ms: expected a positive time in ms, got -1.2"),
    ("zero", lambda r: r["results"]["eager"].update(min_ms=0.0, median_ms=0.0, max_ms=0.0),
     "report.results['eager'].min_ms: expected a positive time in ms, got 0.0"),
    ("floor", lambda r: r.update(compute_floor_ms=-0.5), "report.compute_floor_ms: expected a positive time in ms"),
    ("ratio", lambda r: r["results"]["gemms"].update(ratio_to_eager=-0.35),
     "report.results['gemms'].ratio_to_eager: expected a positive ratio, got -0.35"),
]


@pytest.mark.parametrize("change,words", [c[1:] for c in NEGATIVE], ids=[c[0] for c in NEGATIVE])
def test_the_bench_plot_refuses_a_report_with_times_that_are_not_positive(tmp_path, capsys, change, words):
    pytest.importorskip("matplotlib")
    from tests.test_plot_cli import report
    from tpfuser.bench import plot
    rep = report()
    change(rep)
    (tmp_path / "r.json").write_text(json.dumps(rep))
    assert plot.main([str(tmp_path / "out.png"), str(tmp_path / "r.json")]) == 2
    assert words in refusal(capsys)
    assert os.listdir(tmp_path) == ["r.json"]


# -- The launcher's variables: a time faulthandler cannot wait for is refused in one line ------------------------

@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "abc", "-inf"])
def test_a_stacks_time_that_is_no_time_is_refused_in_one_line(monkeypatch, capsys, value):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TPFUSER_STACKS_AT", value)
    assert main(["plan"]) == 2
    assert f"TPFUSER_STACKS_AT={value!r}: expected the time (seconds since the epoch, within 604800 s)" \
        in refusal(capsys)


def test_a_stacks_time_ahead_or_past_is_taken(monkeypatch):
    from tpfuser.dist import launch
    monkeypatch.setenv("TPFUSER_STACKS_AT", f"{time.time() + 30:.1f}")
    assert 25 < launch.stacks_due_in_s() <= 30.1
    monkeypatch.setenv("TPFUSER_STACKS_AT", f"{time.time() - 5:.1f}")
    assert launch.stacks_due_in_s() == 1.0


@pytest.mark.parametrize("value", ["1e300", "604801", "1e400"])
def test_a_run_bound_past_what_the_ranks_can_wait_for_is_refused(monkeypatch, value):
    """The ranks' stacks are due a little before the bound (launch.stacks_due_s): past a week,
    faulthandler's watchdog overflows in every rank."""
    from tpfuser.dist import launch
    monkeypatch.setenv("TPFUSER_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=rf"^TPFUSER_TIMEOUT_S={value!r}: must be a positive number of seconds, "
                                         rf"at most 604800 "):
        launch.run_timeout_s()
    monkeypatch.setenv("TPFUSER_TIMEOUT_S", "604800")
    assert launch.run_timeout_s() == 604800


# -- Public constructors: a device as PyTorch takes one, the rest refused in one line at construction ------------


TINY = preset("tiny")


@pytest.mark.parametrize("device,made", [("cuda:0", torch.device("cuda", 0)), ("cuda", torch.device("cuda")),
                                         (1, torch.device("cuda", 1)), ("cpu", torch.device("cpu")),
                                         (torch.device("cuda", 0), torch.device("cuda", 0))],
                         ids=["str", "str-no-index", "int", "cpu-str", "torch.device"])
def test_a_device_is_taken_as_pytorch_takes_it(device, made):
    from tpfuser.runtime.block import ShardedBlock
    from tpfuser.runtime.module import TPBlock
    assert ShardedBlock(TINY, device=device).device == made
    assert TPBlock(TINY, device=device).runner.device == made


def test_a_block_on_a_device_given_as_a_string_loads_or_says_why_not():
    """The finding: 'cuda:0' was kept as a str, and load() failed on str.type."""
    from tpfuser.runtime.block import ShardedBlock
    from tpfuser.verify.reference import make_block
    block = ShardedBlock(TINY, device="cuda:0")
    state = make_block(TINY).state_dict()
    if torch.cuda.is_available():
        assert block.load(state).params[0].device == torch.device("cuda", 0)
    else:
        with pytest.raises(RuntimeError, match=r"^load: the block's device is cuda:0, and torch sees no CUDA GPU"):
            block.load(state)


CONSTRUCTORS = [   # (id, the construction, its one line)
    ("meta", lambda b, m: b(TINY, device=torch.device("meta")),
     "device=device(type='meta'): expected a CUDA device ('cuda', 'cuda:N'): the block's fusions run on a GPU"),
    ("meta_str", lambda b, m: b(TINY, device="meta"), "device='meta': expected a CUDA device"),
    ("float", lambda b, m: b(TINY, device=0.0),
     "device=0.0: expected a torch.device, a str such as 'cuda:0' or a CUDA device's index, got a float"),
    ("bool", lambda b, m: b(TINY, device=True), "device=True: expected a torch.device, a str such as 'cuda:0'"),
    ("no_such_device", lambda b, m: b(TINY, device="gpu0"),
     "device='gpu0': not a device PyTorch knows (Invalid device string: 'gpu0')"),
    ("negative_index", lambda b, m: b(TINY, device=-1), "device=-1: not a device PyTorch knows"),
    ("module_meta", lambda b, m: m(TINY, device="meta"), "device='meta': expected a CUDA device"),
    ("dp_group_str", lambda b, m: b(TINY, Layout(2, 1), dp_group="dp"),
     "dp_group='dp': expected None or a torch.distributed ProcessGroup (world.dp_group(layout, rank)), got str"),
    ("module_dp_group", lambda b, m: m(TINY, Layout(2, 1), dp_group=3), "dp_group=3: expected None or a torch.distributed"),
    ("module_seed_str", lambda b, m: m(TINY, rng_seed="0"), "rng_seed='0': must be an int in [0, 2**64)"),
    ("module_seed_negative", lambda b, m: m(TINY, rng_seed=-1), "rng_seed=-1: must be an int in [0, 2**64)"),
]


@pytest.mark.parametrize("make,words", [c[1:] for c in CONSTRUCTORS], ids=[c[0] for c in CONSTRUCTORS])
def test_a_constructor_refuses_what_it_cannot_take_at_construction(make, words):
    from tpfuser.runtime.block import ShardedBlock
    from tpfuser.runtime.module import TPBlock
    with pytest.raises(ValueError) as err:
        make(ShardedBlock, TPBlock)
    assert str(err.value).startswith(words) and "\n" not in str(err.value), str(err.value)


def test_a_cuda_index_past_the_machines_gpus_is_refused(monkeypatch):
    from tpfuser.runtime.weights import block_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert block_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"^device='cuda:7': this machine has 2 CUDA devices \(cuda:0 to cuda:1\)$"):
        block_device("cuda:7")


REFERENCE = [   # the oracle's public constructors (tpfuser.Block, tpfuser.make_block)
    ("block_a_name", lambda: __import__("tpfuser").Block("tiny"),
     "cfg='tiny': expected a BlockConfig (tpfuser.preset(name) or BlockConfig(...)), got str"),
    ("make_block_a_name", lambda: __import__("tpfuser").make_block("tiny"), "cfg='tiny': expected a BlockConfig"),
    ("make_block_dtype_a_name", lambda: __import__("tpfuser").make_block(TINY, dtype="fp32"),
     "dtype='fp32': expected a torch.dtype (torch.float32, torch.bfloat16), got str"),
    ("make_block_seed_a_str", lambda: __import__("tpfuser").make_block(TINY, seed="1"),
     "seed='1': expected an int, got str"),
]


@pytest.mark.parametrize("make,words", [c[1:] for c in REFERENCE], ids=[c[0] for c in REFERENCE])
def test_the_reference_refuses_what_it_cannot_take_in_one_line(make, words):
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value) == words or str(err.value).startswith(words), str(err.value)
