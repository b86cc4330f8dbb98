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
