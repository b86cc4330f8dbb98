"""What a demanding user tries and the program must refuse in one line (or
take as PyTorch takes it): JSON no file of ours holds, a named schedule
changed in place, options taken and never applied, an output whose name asks
for another format, a signal during a write, a constructor's arguments. All
in-process (CPU) but the signals, which need a process to end."""
import json
import os

import pytest

from tpfuser.cli import main

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
