"""The timeline model (tpfuser/predict), on the CPU: the bandwidth tables and
their interpolation, bytes per algorithm, the two-lane timeline on known
inputs, the nccl-tests parser, the calibration reader's refusals, the
command's output on the STAND-IN calibration (tests/data: made up, not
measured), and tools/calibrate.py's dry run on the CPU."""

import argparse
import importlib.util
import json
import math
import os

import pytest

from tpfuser.config import Layout, preset
from tpfuser.parallel.collectives import backward_collectives, forward_collectives as collectives
from tpfuser.parallel.schedules import SCHEDULES, schedule_from_dict
from tpfuser.predict import calibration, comm, timeline
from tpfuser.predict.calibration import PIECES, CalibrationError, Pieces, read_calibration
from tpfuser.predict.command import add_predict_arguments, check_predict_arguments, predict_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(ROOT, "tests", "data", "calibration_standin.json")
MiB, KiB = 1 << 20, 1 << 10
# 8xH100 ring all-reduce busbw, NVLink multicast off (published.py: together-nccl-tests' all_reduce_ring.out)
PUBLISHED = {1: 39.44, 2: 87.26, 4: 138.26, 8: 182.39, 16: 231.88, 32: 274.45, 64: 318.55}


def test_interpolation_hits_the_published_points_and_logs_between():
    t = comm.interconnect("h200-nvlink").tables["allreduce"]
    for mib, bw in PUBLISHED.items():
        assert t.busbw(mib * MiB) == pytest.approx(bw)
    frac = math.log2(48 / 32)   # 48 MiB sits 0.585 of the way from 32 to 64 MiB in log(size)
    assert t.busbw(48 * MiB) == pytest.approx(274.45 * (318.55 / 274.45) ** frac)
    # where busbw doubles with size (the latency floor), time stays flat between the points
    ag = comm.interconnect("h200-nvlink").tables["allgather"]
    lo, hi = ag.sizes[0], ag.sizes[1]
    assert ag.busbw(hi) / ag.busbw(lo) == pytest.approx(2, rel=0.01)
    mid = (lo * hi) ** 0.5
    assert ag.time_ms(mid, 8) == pytest.approx(ag.time_ms(lo, 8), rel=0.01)
    # at the size that matters (gpt3's 48 MiB all-reduce): between the source's 32 and 64 MiB times
    assert 0.21396 < t.time_ms(48 * MiB, 8) < 0.36867
    assert t.time_ms(48 << 10, 8) == pytest.approx(t.time_ms(64 << 10, 8))  # the latency floor below 64 KiB
    assert t.busbw(16 << 30) == pytest.approx(368.09)                        # held above 8 GiB
    assert t.time_ms(48 * MiB, 1) == 0.0                                     # a team of one posts nothing


def test_bytes_per_algorithm():
    assert comm.algorithm_bytes("allreduce", 800, 8) == pytest.approx(2 * 7 / 8 * 800)
    assert comm.algorithm_bytes("allgather", 800, 8) == pytest.approx(7 / 8 * 800)
    assert comm.algorithm_bytes("reducescatter", 800, 4) == pytest.approx(3 / 4 * 800)
    cfg = preset("gpt3")
    for sp in (False, True):
        layout = Layout(1, 8, sp)
        for c in collectives(cfg, layout) + backward_collectives(cfg, layout):
            assert comm.algorithm_bytes(c.kind, c.tensor_bytes, c.team) == pytest.approx(c.wire_bytes_per_rank, abs=1)
    flat = comm.flat(100.0)   # 100 GB/s: 7/8 of 48 MiB in 0.44 ms
    assert flat.time_ms("allgather", 48 * MiB, 8) == pytest.approx(7 / 8 * 48 * MiB / 100e9 * 1e3)


NCCL_TESTS = """# nThread 1 nGpus 8 minBytes 1048576 maxBytes 67108864 step: 2(factor) warmup iters: 5 iters: 20
# Collective test starting: all_gather_perf
#  Rank  0 Group  0 Pid  1 on host device  0 [0x18] NVIDIA H200
#  Rank  1 Group  0 Pid  1 on host device  1 [0x2a] NVIDIA H200
#  Rank  2 Group  0 Pid  1 on host device  2 [0x3a] NVIDIA H200
#  Rank  3 Group  0 Pid  1 on host device  3 [0x5d] NVIDIA H200
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     1048576         65536     float    none      -1    30.11   34.82   26.12      0    29.50   35.54   26.66      0
     4194304        262144     float    none      -1    45.20   92.79   69.59      0    44.90   93.41   70.06      0
    16777216       1048576     float    none      -1    99.81  168.09  126.07      0    99.02  169.43  127.07      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 73.9
"""


def test_nccl_tests_parser(tmp_path):
    t = comm.parse_nccl_tests(NCCL_TESTS)
    assert (t.kind, t.ranks, t.sizes) == ("allgather", 4, (1 * MiB, 4 * MiB, 16 * MiB))
    assert t.busbw_gbps == (26.12, 69.59, 126.07)   # the out-of-place busbw column, by the header
    with pytest.raises(ValueError, match="cannot tell the collective"):
        comm.parse_nccl_tests(NCCL_TESTS.replace("all_gather_perf", "some_perf"))
    with pytest.raises(ValueError, match="no nccl-tests header"):
        comm.parse_nccl_tests("\n".join(line for line in NCCL_TESTS.splitlines() if "size " not in line))
    path = tmp_path / "ag.txt"
    path.write_text(NCCL_TESTS.replace("all_gather_perf", "x"))
    tables = comm.read_comm_table(f"reducescatter={path}")   # the kind named, the file's text not needed
    assert list(tables) == ["reducescatter"] and tables["reducescatter"].busbw(4 * MiB) == 69.59
    merged = comm.interconnect("h200-nvlink").replace(tables)
    assert merged.tables["reducescatter"].busbw_gbps == (26.12, 69.59, 126.07)
    assert merged.tables["allreduce"].busbw(64 * MiB) == 318.55


def _pieces(gemm_ms: dict, ratio: float | None = 1.0, chunks=(1, 2, 4, 8)) -> Pieces:
    """Every piece zero (1e-9 ms) but the GEMMs named, each chunk count taking the same total."""
    passes = {kind: {p: ({str(c): gemm_ms.get(p, 1e-9) for c in chunks} if calibration.is_gemm(p) else 1e-9)
                     for p in pieces} for kind, pieces in PIECES.items()}
    beside = {} if ratio is None else {"forward": {"mlp.c_proj": {str(c): ratio for c in chunks}}}
    return Pieces(passes, beside, "test pieces")


def _forward(schedule, pieces, bw=100.0, tp=8):
    layout = schedule.layout(1, tp)
    return timeline.summarize(timeline.simulate(timeline.forward_ops(preset("gpt3"), layout, schedule, pieces,
                                                                     comm.flat(bw))[0]))


def _chunked(base: str, linear: str, n: int):
    return schedule_from_dict({"base": base, "linears": {linear: {"chunks": n, "overlap": "fusions"}}})


C = 2 * 7 / 8 * 48 * MiB / 100e9 * 1e3   # one 48 MiB all-reduce over 8 ranks at 100 GB/s, ms (0.881)


def test_one_chunk_forward_is_compute_plus_communication():
    s = _forward(SCHEDULES["megatron"], _pieces({"mlp.c_proj": 2.0, "attn.c_proj": 0.5}))
    assert s["comm_ms"] == pytest.approx(2 * C)
    assert s["exposed_ms"] == pytest.approx(2 * C)
    assert s["pass_ms"] == pytest.approx(2.5 + 2 * C, abs=1e-6)


def test_chunks_shrink_exposed_communication_to_the_last_chunk():
    s = _forward(_chunked("megatron", "mlp.c_proj", 4), _pieces({"mlp.c_proj": 4.0}))
    row = next(r for r in s["pieces"] if r["piece"] == "allreduce after mlp.c_proj")
    comm4 = comm.flat(100.0).time_ms("allreduce", 12 * MiB, 8)   # one of four chunks (no latency term: flat)
    assert row["comm_ms"] == pytest.approx(4 * comm4)              # four chunks posted, one after each GEMM chunk
    assert row["exposed_ms"] == pytest.approx(comm4, abs=1e-6)     # the drain; the rest hid behind GEMM chunks
    assert s["pass_ms"] == pytest.approx(4.0 + C + comm4, abs=1e-6)   # attn.c_proj's all-reduce stays whole


def test_communication_longer_than_compute_is_exposed():
    g = 0.4   # the GEMM's four chunks take 0.1 ms each, each all-reduce chunk C/4 = 0.22 ms
    s = _forward(_chunked("megatron", "mlp.c_proj", 4), _pieces({"mlp.c_proj": g}))
    row = next(r for r in s["pieces"] if r["piece"] == "allreduce after mlp.c_proj")
    assert row["exposed_ms"] == pytest.approx(C - 3 * g / 4, abs=1e-6)


def test_gather_fill_stays_exposed_under_sequence_parallelism():
    s = _forward(_chunked("megatron-sp", "attn.c_attn", 4), _pieces({"attn.c_attn": 4.0}))
    row = next(r for r in s["pieces"] if r["piece"] == "allgather before attn.c_attn")
    assert row["exposed_ms"] == pytest.approx(C / 2 / 4, abs=1e-6)   # the first of four gather chunks


def test_a_gemm_beside_a_collective_runs_slower():
    ops = [timeline.Op("g", timeline.COMPUTE, 1.0, "g", "gemm", (), 2.0),
           timeline.Op("c", timeline.COMM, 1.0, "c", "collective")]
    g, c = timeline.simulate(ops)
    assert (c.end, g.end) == (pytest.approx(1.0), pytest.approx(1.5))   # half speed while c runs, then alone
    slow = _forward(_chunked("megatron", "mlp.c_proj", 4), _pieces({"mlp.c_proj": 4.0}, ratio=1.5))
    assert slow["slowdown_ms"] > 0.1 and slow["pass_ms"] > _forward(
        _chunked("megatron", "mlp.c_proj", 4), _pieces({"mlp.c_proj": 4.0}))["pass_ms"] + 0.1


def test_every_collective_has_a_place_and_chunks_not_calibrated_are_refused():
    cfg = preset("gpt3")
    for sp in (False, True):
        layout = Layout(1, 8, sp)
        for colls in (collectives(cfg, layout), backward_collectives(cfg, layout)):
            assert sum(len(v) for v in timeline.attach(colls).values()) == len(colls)
    with pytest.raises(CalibrationError, match="mlp.c_proj was timed at chunks 1, 2, 4, 8, the schedule asks 16"):
        _forward(_chunked("megatron", "mlp.c_proj", 16), _pieces({"mlp.c_proj": 1.0}))


def _bad(tmp_path, change):
    data = json.load(open(STANDIN))
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError) as e:
        read_calibration(str(path))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_calibration_reader_refuses_a_bad_file_naming_the_field(tmp_path):
    at = lambda d: d["presets"]["gpt3"]["tp"]["8"]   # noqa: E731
    msg = _bad(tmp_path, lambda d: at(d)["tp"]["forward"]["mlp.c_fc"].update({"4": -1}))
    assert "'presets.gpt3.tp.8.tp.forward.mlp.c_fc.4': expected a positive, finite time in ms, got -1" in msg
    msg = _bad(tmp_path, lambda d: at(d)["sp"]["backward"].pop("attention"))
    assert "'presets.gpt3.tp.8.sp.backward.attention'" in msg
    assert "'format': expected 'tpfuser-calibration/1'" in _bad(tmp_path, lambda d: d.update(format="v0"))
    assert "'presets.gpt3.tp.8.whole.backward_ms'" in _bad(tmp_path, lambda d: at(d)["whole"].pop("backward_ms"))
    # fields read only later (the header's clock, a chunk key's int()) or not at all (a stray piece)
    assert "'sm_clock_mhz_after': expected a clock in MHz" in _bad(tmp_path, lambda d: d.update(sm_clock_mhz_after="fast"))
    msg = _bad(tmp_path, lambda d: at(d)["tp"]["forward"]["mlp.c_fc"].update({"\u00b2": 1.0}))
    assert "'presets.gpt3.tp.8.tp.forward.mlp.c_fc.\u00b2': expected a chunk count" in msg
    msg = _bad(tmp_path, lambda d: at(d)["tp"]["forward"].update(frob=1.0))
    assert "'presets.gpt3.tp.8.tp.forward.frob': expected a piece of the forward" in msg
    assert "'complete': expected true or false" in _bad(tmp_path, lambda d: d.update(complete="no"))


@pytest.mark.parametrize("table, words", [
    ({"sizes": ["1", 2], "busbw_gbps": [1, 2]}, "sizes expected a list of whole numbers of bytes, got ['1', 2]"),
    ({"sizes": "12", "busbw_gbps": [1, 2]}, "sizes expected a list of whole numbers of bytes, got '12'"),
    ({"sizes": [1.7, 2], "busbw_gbps": [1, 2]}, "sizes expected a list of whole numbers of bytes"),
    ({"sizes": [1, 2], "busbw_gbps": [True, 2]}, "busbw_gbps expected a list of GB/s, got [True, 2]"),
    ({"sizes": [1, 2], "busbw_gbps": [1, 2], "ranks": 0}, "ranks expected a whole number >= 2"),
])
def test_a_comm_table_json_of_the_wrong_types_is_refused(tmp_path, table, words):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tables": {"allreduce": table}}).replace("Infinity", "1e400"))
    with pytest.raises(ValueError) as err:
        comm.read_comm_table(str(path))
    assert str(err.value).startswith(f"--comm-table={str(path)!r}: table 'allreduce': ") and words in str(err.value)


def _args(*argv):
    p = argparse.ArgumentParser()
    for name, kind in (("--bandwidth", float), ("--tflops", float), ("--overlap", int)):
        p.add_argument(name, type=kind, default=None)
    p.add_argument("--preset", default="gpt3")
    add_predict_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("interconnect", sorted(comm.INTERCONNECTS))
def test_every_source_the_prediction_prints_is_public(capsys, interconnect):
    """Each anchor's source and each table's is a repository path or a URL
    (github.com/...), and the output cites no issue of ours."""
    import re
    cfg, schedule = preset("gpt3"), SCHEDULES["megatron"]
    rep = predict_command(cfg, schedule.layout(1, 8), schedule,
                          _args("--calibration", STANDIN, "--interconnect", interconnect))
    out = capsys.readouterr().out
    assert rep["anchors"] and all(re.search(r"\bgithub\.com/\S+/\S+", src) for *_, src in rep["anchors"])
    for kind, table in rep["interconnect"]["tables"].items():
        assert "github.com/" in table["source"], (kind, table["source"])
    assert not re.search(r"(?<!#)\bissues? #?\d", out.replace("github.com/NVIDIA/nccl-tests/issues/", "")), out


def test_command_output_on_the_standin_calibration(tmp_path, capsys):
    png = tmp_path / "t.png"
    args = _args("--calibration", STANDIN, "--compare", "--png", str(png))
    assert args.predict   # --calibration, --compare and --png each turn --predict on
    cfg, schedule = preset("gpt3"), SCHEDULES["megatron-sp"]
    rep = predict_command(cfg, schedule.layout(1, 8), schedule, args)
    out = capsys.readouterr().out
    for text in ("STAND-IN calibration", "forward (ms;", "backward (ms;", "reducescatter after mlp.c_proj",
                 "goal: forward", "TransformerEngine, TP+SP, no overlap", "github.com/NVIDIA/Fuser/pull/5560",
                 "NVLink multicast off", "communication: not checked",
                 "calibration check", "all within 10 %", "every named schedule", "megatron-sp-overlap"):
        assert text in out, text
    f = rep["forward"]
    assert f["pass_ms"] == pytest.approx(f["compute_ms"] + f["slowdown_ms"] + f["exposed_ms"])
    assert sum(1 for r in rep["compare"] if r.get("fastest_forward")) == 1
    assert rep["communication_checked"] is False and rep["calibration"]["stand_in"] is True
    json.dumps(rep)   # plan --json writes it
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_refusals_in_one_line(tmp_path, monkeypatch):
    cfg, schedule = preset("gpt3"), SCHEDULES["megatron"]
    monkeypatch.setattr("tpfuser.predict.command.default_path", lambda preset=None: str(tmp_path / "h200.json"))
    for call in (predict_command, check_predict_arguments):   # the latter: what plan's preflight can refuse early
        with pytest.raises(ValueError, match=r"committed calibration .*h200.json is missing: make it on the GPU "
                                             r"with tools/calibrate.py"):
            call(cfg, schedule.layout(1, 8), schedule, _args("--predict"))
    with pytest.raises(ValueError, match="dropout=0.1, the block here has dropout=0.0"):
        predict_command(preset("gpt3", dropout=0.0), schedule.layout(1, 8), schedule, _args("--calibration", STANDIN))
    with pytest.raises(ValueError, match="--tflops=500.0: --predict takes the GEMMs' times from the calibration"):
        predict_command(cfg, schedule.layout(1, 8), schedule, _args("--calibration", STANDIN, "--tflops", "500"))
    with pytest.raises(ValueError, match="has nanogpt at tp 1, 5, not at tp 25"):
        predict_command(preset("nanogpt"), Layout(1, 25), schedule, _args("--calibration", STANDIN, "--preset", "nanogpt"))


def test_calibration_check_says_where_it_is_off(tmp_path):
    data = json.load(open(STANDIN))
    data["presets"]["gpt3"]["tp"]["8"]["whole"]["backward_ms"] *= 1.5
    path = tmp_path / "off.json"
    path.write_text(json.dumps(data))
    rows = {(r["tp"], r["pass"]): r for r in calibration.check_sums(read_calibration(str(path)), "gpt3")}
    assert rows[(8, "forward")]["within"] and not rows[(8, "backward")]["within"]
    assert [p for p, _ in rows[(8, "backward")]["largest"]][0] in ("mlp.c_fc.wgrad", "mlp.c_proj.wgrad",
                                                                    "mlp.c_fc.dgrad", "mlp.c_proj.dgrad")


def test_the_standin_is_what_its_generator_makes():
    spec = importlib.util.spec_from_file_location("make_standin", os.path.join(ROOT, "tests", "data", "make_standin.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert json.load(open(STANDIN)) == json.loads(json.dumps(mod.standin()))


def test_calibrate_dry_run_on_the_cpu_writes_a_calibration(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("calibrate", os.path.join(ROOT, "tools", "calibrate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "cpu.json"
    assert mod.main(["--device", "cpu", "--preset", "tiny", "--tp", "1", "2", "--samples", "1",
                     "--json", str(path)]) == 0
    cal = read_calibration(str(path))
    assert cal.data["complete"] and sorted(cal.data["presets"]["tiny"]["tp"]) == ["1", "2"]
    assert cal.pieces("tiny", 2, True).ms("forward", "mlp.c_fc", 4) > 0
    assert "pieces' sum vs the whole pass" in capsys.readouterr().out


@pytest.mark.parametrize("interconnect, kind, size, published_us", [
    ("h200-nvlink", "allgather", 1 * MiB, 41.67), ("h200-nvlink", "allgather", 16 * MiB, 70.80),
    ("h200-nvlink", "allgather", 64 * MiB, 210.89), ("h200-nvlink", "allgather", 8 << 30, 21001.0),
    ("h200-nvlink", "reducescatter", 1 * MiB, 40.60), ("h200-nvlink", "reducescatter", 32 * MiB, 118.78),
    ("h200-nvlink", "reducescatter", 1 << 30, 2711.56), ("h100-nvlink-nvls", "allreduce", 4 * MiB, 56.02),
    ("h100-nvlink-nvls", "allreduce", 64 * MiB, 327.16), ("h100-nvlink-nvls", "allreduce", 256 * KiB, 37.95),
    ("h200-nvlink", "allreduce", 64 * KiB, 35.76), ("h100-nvlink", "allreduce", 256 * KiB, 37.95),
    ("h100-nvlink", "allreduce", 1 * MiB, 46.52), ("h100-nvlink", "allreduce", 64 * MiB, 368.67),
    ("h200-nvlink", "allreduce", 8 << 30, 40838.9),
])
def test_shipped_tables_give_the_published_times(interconnect, kind, size, published_us):
    """The busbw columns as shipped, turned back into times, are the sources' time
    column (a check of the transcription against a column it did not copy)."""
    assert comm.interconnect(interconnect).time_ms(kind, size, 8) * 1e3 == pytest.approx(published_us, rel=0.005)


def test_the_h200_tables_say_they_are_h100_figures():
    """No public 8xH200 nccl-tests figures were found: every h200-nvlink table is the H100 node's, and says so."""
    tables = comm.interconnect("h200-nvlink").tables
    for kind in comm.KINDS:
        assert "8xH100" in tables[kind].source and "taken for H200" in tables[kind].source
    for kind in comm.P2P_KINDS:
        assert "H100" in tables[kind].source and "taken for H200" in tables[kind].source


def test_the_clock_shown_is_the_one_read_after_the_timing():
    from tpfuser.predict.command import _clock
    assert _clock({"sm_clock_mhz": 345.0, "sm_clock_mhz_after": 1950.0, "max_sm_clock_mhz": 1980.0}) == \
        "SM clock 1950 of 1980 MHz after its timing"
    assert _clock({"sm_clock_mhz": 345.0}) == "SM clock 345 MHz before its timing"
    assert _clock({"sm_clock_mhz": None}) == "SM clock unknown"


def test_goal_verdict_scaled_to_the_measured_whole(tmp_path, capsys):
    """The goal's verdict again with each pass's pieces scaled to the measured whole pass
    (the calibration check's error): none where they add up exactly, all of it where not."""
    data = json.load(open(STANDIN))
    at = data["presets"]["gpt3"]["tp"]["8"]
    cal = read_calibration(STANDIN)
    pieces = cal.pieces("gpt3", 8, False)
    at["whole"]["forward_ms"] = calibration.pass_sum(pieces, "forward")         # error 0
    at["whole"]["backward_ms"] = 2 * calibration.pass_sum(pieces, "backward")   # the pieces are half the whole
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    cfg, schedule = preset("gpt3"), SCHEDULES["megatron"]
    rep = predict_command(cfg, schedule.layout(1, 8), schedule, _args("--calibration", str(path)))
    scaled = rep["goal"]["scaled_to_whole"]
    assert scaled["forward"]["error"] == pytest.approx(0, abs=1e-12)
    assert scaled["forward"]["pass_ms"] == pytest.approx(rep["forward"]["pass_ms"])
    assert scaled["backward"]["error"] == pytest.approx(-0.5)
    assert scaled["backward"]["pass_ms"] >= 2 * rep["backward"]["compute_ms"]
    assert scaled["backward"]["met"] == (scaled["backward"]["pass_ms"] <= 4.0)
    assert "-50.0 % against the measured whole backward at tp 8; scaled to it" in capsys.readouterr().out


def test_what_chunking_the_collectives_costs(capsys):
    """A chunked collective's messages are smaller, so slower per byte: the goal
    line names what the chunks cost against the same collectives whole."""
    net, cfg = comm.interconnect("h200-nvlink"), preset("gpt3")
    ar = lambda nbytes: net.time_ms("allreduce", nbytes, 8)   # noqa: E731
    whole = 1 * 2048 * 12288 * 2   # one (b, s, e) bf16 activation
    args = _args("--calibration", STANDIN)
    base = predict_command(cfg, SCHEDULES["megatron"].layout(1, 8), SCHEDULES["megatron"], args)
    over = predict_command(cfg, SCHEDULES["megatron-overlap"].layout(1, 8), SCHEDULES["megatron-overlap"], args)
    n = SCHEDULES["megatron-overlap"].linears["attn.c_proj"].chunks
    assert base["forward"]["comm_ms"] == pytest.approx(base["forward"]["comm_whole_ms"]) == pytest.approx(2 * ar(whole))
    assert over["forward"]["comm_whole_ms"] == pytest.approx(2 * ar(whole))
    assert over["forward"]["comm_ms"] == pytest.approx(2 * n * ar(whole / n))
    way = over["goal"]["in_the_way"]["forward"]
    assert way["chunking_cost_ms"] == pytest.approx(2 * (n * ar(whole / n) - ar(whole))) and way["chunking_cost_ms"] > 0
    assert way["chunks_alone_ms"] == pytest.approx(2 * n * ar(whole / n))
    out = capsys.readouterr().out
    assert out.count("chunking the collectives costs") == 1 + (over["goal"]["in_the_way"]["backward"] is not None)


def test_default_calibration_is_the_first_committed_one_holding_the_preset(tmp_path):
    def write(name, presets):
        (tmp_path / name).write_text(json.dumps({"presets": {p: {} for p in presets}}))
    write("h200.json", ["gpt3"])
    write("h100.json", ["gpt3", "nanogpt"])
    where = str(tmp_path)
    assert calibration.default_path("gpt3", where) == str(tmp_path / "h200.json")      # H200's first
    assert calibration.default_path("nanogpt", where) == str(tmp_path / "h100.json")   # only H100's holds it
    assert calibration.default_path("tiny", where) == str(tmp_path / "h200.json")      # none: H200's, refused on reading
    assert calibration.default_path(None, where) == str(tmp_path / "h200.json")
    (tmp_path / "h200.json").write_text("{not json")                                   # a broken one is passed over
    assert calibration.default_path("gpt3", where) == str(tmp_path / "h100.json")
