"""The timeline model's rings and what they are timed from, on the CPU: the
default curves with NVLink multicast off, every printed source public, the P2P
figures and the tables that replace them (sendrecv_perf output, a copy-engine
JSON), and the ring's timeline on hand cases (its steps, the copy engine
slowing no GEMM, the all-gather's first step waiting for nothing, the
reduce-scatter's last send exposed, its local reduction)."""

import json
import re

import pytest

from tpfuser.predict import comm, published

MiB = 1 << 20


def test_the_default_curves_run_with_nvlink_multicast_off():
    """The machines run NCCL with NCCL_NVLS_ENABLE=0: no default all-reduce curve is NCCL's NVLS one."""
    for name in ("h100-nvlink", "h200-nvlink"):
        net = comm.interconnect(name)
        assert "multicast off" in net.curves
        for kind in comm.KINDS:
            source = net.tables[kind].source
            assert ", ring," in source and "nvls" not in source.lower(), (name, kind)
    nvls = comm.interconnect("h100-nvlink-nvls")
    assert "NVLS" in nvls.tables["allreduce"].source and "all_reduce_nvls.out" in nvls.tables["allreduce"].source
    assert "multicast on" in nvls.curves
    # NVLS reduces in the switch: more busbw than the ring at 48 MiB, the same below 1 MiB (the ring's floor)
    ring = comm.interconnect("h100-nvlink")
    assert nvls.time_ms("allreduce", 48 * MiB, 8) < ring.time_ms("allreduce", 48 * MiB, 8)
    assert nvls.time_ms("allreduce", 128 << 10, 8) == ring.time_ms("allreduce", 128 << 10, 8)


_PUBLIC = re.compile(r"github\.com/[\w.-]+/[\w.-]+|https://")


def test_every_source_printed_is_public():
    """A repository path or a URL in each table's source; no project-internal issue number."""
    for name, net in comm.INTERCONNECTS.items():
        for kind, table in net.tables.items():
            assert _PUBLIC.search(table.source), (name, kind, table.source)
        for text in (net.source, net.curves):
            assert not re.search(r"\bissue \d|tpfuser issue", text), (name, text)
    from tpfuser.predict.command import ANCHORS
    for rows in ANCHORS.values():
        for name, _, _, source in rows:
            assert _PUBLIC.search(source) and not re.search(r"\bissue \d", source), (name, source)


def test_p2p_links_are_latency_plus_bytes_over_bandwidth():
    net = comm.interconnect("h100-nvlink")
    ce, nccl = net.tables["copyengine"], net.tables["sendrecv"]
    assert (ce.latency_us, ce.bandwidth_gbps) == (3.55, 376.0)   # published.COPYENGINE's figures
    assert net.p2p_ms("cuda", 6 * MiB) == pytest.approx(3.55e-3 + 6 * MiB / 376e9 * 1e3)
    # NCCL's: the ring all-gather's steps: its 8 GiB busbw, its 128 KiB time over 7 steps
    assert nccl.bandwidth_gbps == published.ALLGATHER_RING[-1][1] == 357.90
    floor_us = net.time_ms("allgather", 128 << 10, 8) * 1e3
    assert nccl.latency_us == pytest.approx(floor_us / 7) and 5 < nccl.latency_us < 6
    assert net.p2p_ms("nccl", 6 * MiB) == pytest.approx(nccl.latency_us * 1e-3 + 6 * MiB / 357.9e9 * 1e3)
    # seven such steps come within 10 % of the all-gather they are taken from (48 MiB over 8 ranks)
    assert 7 * net.p2p_ms("nccl", 6 * MiB) == pytest.approx(net.time_ms("allgather", 48 * MiB, 8), rel=0.10)
    with pytest.raises(ValueError, match="a ring over backend 'ucc' is not modelled: expected one of nccl, cuda"):
        net.p2p_ms("ucc", MiB)
    assert comm.flat(100.0).p2p_ms("cuda", 100e6) == pytest.approx(1.0)   # --bandwidth flattens P2P too


SENDRECV = """# nccl-tests version 2.17.9 nccl-headers=22602 nccl-library=22602
# Collective test starting: sendrecv_perf
# nThread 1 nGpus 8 minBytes 1048576 maxBytes 16777216 step: 4(factor) warmup iters: 5 iters: 20
#  Rank  0 Group  0 Pid  1 on host device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  1 on host device  1 [0x2a] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     1048576        262144     float     sum      -1    12.00   87.38   87.38      0    12.10   86.66   86.66    N/A
     4194304       1048576     float     sum      -1    20.00  209.72  209.72      0    20.10  208.67  208.67    N/A
    16777216       4194304     float     sum      -1    50.00  335.54  335.54      0    50.20  334.21  334.21    N/A
# Avg bus bandwidth    : 210.9
"""


def test_sendrecv_perf_output_replaces_the_nccl_p2p_figures(tmp_path):
    path = tmp_path / "sr.txt"
    path.write_text(SENDRECV)
    tables = comm.read_comm_table(str(path))   # the kind from the tool's name
    assert list(tables) == ["sendrecv"] and tables["sendrecv"].busbw_gbps == (87.38, 209.72, 335.54)
    net = comm.interconnect("h100-nvlink").replace(tables)
    assert net.p2p_ms("nccl", 4 * MiB) == pytest.approx(0.020, rel=1e-3)    # the time column, back
    assert net.p2p_ms("nccl", 64 << 10) == pytest.approx(0.012, rel=1e-3)   # held at the smallest size's time
    assert net.p2p_ms("cuda", 4 * MiB) == comm.interconnect("h100-nvlink").p2p_ms("cuda", 4 * MiB)
    assert "sendrecv" in net.curves and "--comm-table" in net.curves


def test_a_copy_engine_json_table_replaces_the_copy_engine_figures(tmp_path):
    path = tmp_path / "ce.json"
    path.write_text(json.dumps({"source": "nvbandwidth on the machine", "tables": {
        "copyengine": {"sizes": [1 * MiB, 16 * MiB], "busbw_gbps": [100.0, 350.0]}}}))
    tables = comm.read_comm_table(str(path))
    assert tables["copyengine"].ranks == 2 and "nvbandwidth on the machine" in tables["copyengine"].source
    net = comm.interconnect("h200-nvlink").replace(tables)
    assert net.p2p_ms("cuda", 16 * MiB) == pytest.approx(16 * MiB / 350e9 * 1e3)
    assert list(comm.read_comm_table(f"copyengine={path}")) == ["copyengine"]
    with pytest.raises(ValueError, match="kind expected one of allreduce, allgather, reducescatter, sendrecv, "
                                         "copyengine, got 'p2p'"):
        comm.read_comm_table(f"p2p={path}")


# ---------------------------------------------------------------------------
# The ring's timeline, on hand cases: every piece ~0 (1e-9 ms) but the GEMMs named, every
# collective but the ring's steps ~0 (a flat 1e9 GB/s), each step P ms over its backend.

from tpfuser.config import preset  # noqa: E402
from tpfuser.parallel.schedules import SCHEDULES, schedule_from_dict  # noqa: E402
from tpfuser.predict import timeline  # noqa: E402
from tpfuser.predict.calibration import PIECES, CalibrationError, Pieces, is_gemm  # noqa: E402

CFG = preset("gpt3")


def _pieces(gemm_ms: dict, ratio=None, chunks=(1, 2, 4, 8), gelu_ms=1e-9) -> Pieces:
    passes = {kind: {p: ({str(c): gemm_ms.get(p, 1e-9) for c in chunks} if is_gemm(p) else 1e-9) for p in pieces}
              for kind, pieces in PIECES.items()}
    passes["forward"]["gelu"] = gelu_ms
    beside = {} if ratio is None else {"forward": {p: {str(c): ratio for c in chunks} for p in gemm_ms}}
    return Pieces(passes, beside, "test pieces")


def _net(step_ms: float, tp: int):
    """Each ring step (one rank's chunk of gpt3's 48 MiB activation) takes step_ms, NCCL's and the copy engine's."""
    step_bytes = CFG.batch * CFG.seq * CFG.n_embd * 2 // tp
    links = {kind: comm.P2PLink(kind, 0.0, step_bytes / (step_ms * 1e-3) / 1e9, "test") for kind in comm.P2P_KINDS}
    return comm.flat(1e9).replace(links)


def _forward(name: str, pieces, step_ms: float, tp: int) -> dict:
    schedule = SCHEDULES[name]
    ops, _ = timeline.forward_ops(CFG, schedule.layout(1, tp), schedule, pieces, _net(step_ms, tp))
    return timeline.summarize(timeline.simulate(ops))


def _row(s: dict, piece: str) -> dict:
    return next(r for r in s["pieces"] if r["piece"] == piece)


def _events(s: dict, prefix: str) -> list[dict]:
    return [e for e in s["events"] if e["name"].startswith(prefix)]


@pytest.mark.parametrize("step_ms, pass_ms", [(1.0, 7.0), (3.0, 14.0)], ids=["steps-hidden", "steps-longer"])
def test_a_two_step_ring_forward_takes_the_time_worked_by_hand(step_ms, pass_ms):
    """tp 2, mlp.c_fc's GEMM 4 ms (2 a chunk), every step P: attn.c_attn's gather waits its one step (P),
    attn.c_proj's scatter sends its one partial (P), mlp.c_fc's gather hides its step behind chunk 0
    (max(P, 2)) then runs chunk 1 (2), mlp.c_proj's scatter sends (P): 2P + max(P, 2) + 2 + P."""
    s = _forward("megatron-sp-ring-ce", _pieces({"mlp.c_fc": 4.0}), step_ms, 2)
    assert s["pass_ms"] == pytest.approx(pass_ms, abs=1e-6)
    assert _row(s, "allgather before mlp.c_fc (ring, CE)")["exposed_ms"] == pytest.approx(max(0.0, step_ms - 2),
                                                                                          abs=1e-6)


def test_the_gather_rings_first_step_waits_for_no_transfer():
    s = _forward("megatron-sp-ring", _pieces({"mlp.c_fc": 8.0}), 0.5, 4)
    steps, gemms = _events(s, "allgather before mlp.c_fc"), _events(s, "mlp.c_fc [")
    assert len(steps) == 3 and len(gemms) == 4   # tp - 1 transfers, tp GEMM chunks
    assert gemms[0]["start_ms"] == pytest.approx(steps[0]["start_ms"])     # chunk 0 on the rank's own, at once
    for step, gemm in zip(steps, gemms[1:]):                                # chunk j once step j has brought it
        assert gemm["start_ms"] >= step["end_ms"] - 1e-9
    assert _row(s, "allgather before mlp.c_fc (ring, NCCL)")["exposed_ms"] == pytest.approx(0, abs=1e-9)


def test_the_scatter_rings_last_send_is_exposed_then_the_partials_are_summed():
    """tp 4, mlp.c_proj 8 ms (2 a chunk), each send 0.5: sends 1 and 2 hide behind chunks 2 and 3, send 3 is
    exposed; then the sum of the 4 partials, (4 + 1) x step_bytes at the forward GELU's bytes a second."""
    gelu_ms = 0.02
    s = _forward("megatron-sp-ring-ce", _pieces({"mlp.c_proj": 8.0}, gelu_ms=gelu_ms), 0.5, 4)
    row = _row(s, "reducescatter after mlp.c_proj (ring, CE)")
    assert row["comm_ms"] == pytest.approx(3 * 0.5) and row["exposed_ms"] == pytest.approx(0.5, abs=1e-6)
    sends, gemms = _events(s, "reducescatter after mlp.c_proj"), _events(s, "mlp.c_proj [")
    assert [e["start_ms"] for e in sends] == pytest.approx([g["end_ms"] for g in gemms[1:]])   # chunk 0 is its own
    rate = 2 * CFG.batch * CFG.seq * (4 * CFG.n_embd // 4) * 2 / (gelu_ms * 1e-3)
    step_bytes = CFG.batch * CFG.seq * CFG.n_embd * 2 // 4
    (total,) = _events(s, "sum of the ring's partials after mlp.c_proj")
    assert total["alone_ms"] == pytest.approx(5 * step_bytes / rate * 1e3)
    assert total["start_ms"] == pytest.approx(sends[-1]["end_ms"])   # the last partial arrives with the last send


def test_the_copy_engine_slows_no_gemm_and_nccl_send_recv_does():
    pieces = _pieces({"mlp.c_proj": 8.0}, ratio=2.0)   # a GEMM beside an SM-using transfer runs at half speed
    ce = _forward("megatron-sp-ring-ce", pieces, 0.5, 4)
    nccl = _forward("megatron-sp-ring", pieces, 0.5, 4)
    assert ce["slowdown_ms"] == pytest.approx(0, abs=1e-9)
    # sends 1 and 2, each 0.5 ms beside a chunk that makes half its progress then: 0.25 ms later each
    assert nccl["slowdown_ms"] == pytest.approx(2 * 0.25, abs=1e-6)
    assert nccl["pass_ms"] == pytest.approx(ce["pass_ms"] + 0.5, abs=1e-6)


def test_a_ring_needs_its_gemms_timed_at_tp_chunks():
    with pytest.raises(CalibrationError, match="attn.c_attn was timed at chunks 1, 2, 4, the schedule asks 8"):
        _forward("megatron-sp-ring", _pieces({"mlp.c_fc": 1.0}, chunks=(1, 2, 4)), 0.1, 8)
    _forward("megatron-sp-ring", _pieces({"mlp.c_fc": 1.0}, chunks=(1, 2, 4)), 0.1, 4)   # tp 4: 4 chunks, timed


def test_compare_takes_the_rings_and_a_schedule_file_of_the_layouts_parallelism(capsys):
    from tests.test_predict import STANDIN, _args
    from tpfuser.predict.command import predict_command
    mine = schedule_from_dict({"base": "megatron-sp", "name": "mlp-ring-ce", "linears": {
        linear: {"overlap": "ring", "collective": "cuda"} for linear in ("mlp.c_fc", "mlp.c_proj")}})
    rep = predict_command(CFG, mine.layout(1, 8), mine, _args("--calibration", STANDIN, "--compare"))
    rows = {r["schedule"]: r for r in rep["compare"]}
    assert {"megatron-sp-ring", "megatron-sp-ring-ce", "mlp-ring-ce"} <= set(rows)
    assert all(SCHEDULES[name].sequence_parallel for name in rows if name in SCHEDULES)   # no TP-only schedule
    assert rows["mlp-ring-ce"]["given"] and not rows["megatron-sp-ring"]["given"]
    assert rows["mlp-ring-ce"]["forward_ms"] == pytest.approx(rep["forward"]["pass_ms"])
    out = capsys.readouterr().out
    assert "mlp-ring-ce (given)" in out and "rings (SP): each step one P2P send" in out
    tp = SCHEDULES["megatron"]
    rep = predict_command(CFG, tp.layout(1, 8), tp, _args("--calibration", STANDIN, "--compare"))
    names = [r["schedule"] for r in rep["compare"]]
    assert "megatron" in names and not any(SCHEDULES[n].sequence_parallel for n in names)   # no ring, no SP
    assert not any(r["given"] for r in rep["compare"])   # a named schedule given is not listed twice
