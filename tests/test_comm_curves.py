"""tools/comm_curves.py without a GPU: its bus bandwidth against nccl-tests'
definition worked by hand and against predict/comm.py's reading of it (a
measured time must come back out of the model unchanged), its message sizes,
its JSON as `plan --comm-table` reads it, and its refusal of an environment
that leaves NVLink multicast on. The timings are made up."""
import json
import sys

import pytest

from tpfuser.predict import comm

sys.path.insert(0, "tools")
import comm_curves  # noqa: E402

MiB = 1 << 20


def test_busbw_by_hand():
    """8 MiB in 0.1 ms is 83.9 GB/s of algorithm bandwidth; over 8 ranks an all-reduce's bus carries
    2 * 7/8 of it, an all-gather's 7/8, a send/recv step all of it."""
    algbw = 8 * MiB / 1e-4 / 1e9
    assert comm_curves.busbw_gbps("allreduce", 8 * MiB, 0.1, 8) == pytest.approx(algbw * 1.75)
    assert comm_curves.busbw_gbps("allgather", 8 * MiB, 0.1, 8) == pytest.approx(algbw * 0.875)
    assert comm_curves.busbw_gbps("reducescatter", 8 * MiB, 0.1, 2) == pytest.approx(algbw * 0.5)
    assert comm_curves.busbw_gbps("sendrecv", 8 * MiB, 0.1, 8) == pytest.approx(algbw)
    assert comm_curves.busbw_gbps("copyengine", 8 * MiB, 0.1, 4) == pytest.approx(algbw)


@pytest.mark.parametrize("kind", comm.KINDS)
@pytest.mark.parametrize("ranks", [2, 5, 8])
def test_a_measured_time_comes_back_out_of_the_model(kind, ranks):
    """What the curve writes, predict/comm.py's BusTable reads back into the same time."""
    size, ms = 3 * MiB, 0.042
    bus = comm.BusTable(kind, (size,), (comm_curves.busbw_gbps(kind, size, ms, ranks),), ranks)
    assert bus.time_ms(size, ranks) == pytest.approx(ms)


def test_message_sizes_double_and_split_evenly_over_the_team():
    assert comm_curves.message_sizes(64 << 10, 1 * MiB, 8) == [64 << 10, 128 << 10, 256 << 10, 512 << 10, MiB]
    five = comm_curves.message_sizes(64 << 10, 256 << 10, 5)
    assert five == [65530, 131070, 262140]                  # whole bf16 elements for each of 5 ranks
    assert all(s % (5 * 2) == 0 for s in five)
    assert comm_curves.message_sizes(2, 8, 4) == [8]       # too small for 4 ranks' elements: left out


def test_the_json_is_what_plan_comm_table_reads(tmp_path):
    sizes = [1 * MiB, 2 * MiB]
    tables = {kind: comm_curves.table(kind, sizes, [0.05, 0.08], 4) for kind in comm_curves.KINDS}
    data = comm_curves.comm_json(tables, "made up", {"gpu": "none", "ranks": 4})
    assert set(data["tables"]) == {"allreduce", "allgather", "reducescatter", "sendrecv", "copyengine"}
    assert data["tables"]["sendrecv"]["busbw_gbps"] == pytest.approx([MiB / 5e-5 / 1e9, 2 * MiB / 8e-5 / 1e9])
    (tmp_path / "all.json").write_text(json.dumps(data))
    path = tmp_path / "table.json"
    comm_curves.keep_kinds(str(tmp_path / "all.json"), str(path), comm.KINDS)   # what tools/multigpu.py hands plan
    read = comm.read_comm_table(str(path))
    assert set(read) == set(comm.KINDS)
    assert read["allreduce"].ranks == 4 and read["allreduce"].sizes == tuple(sizes)
    assert read["allreduce"].time_ms(2 * MiB, 4) == pytest.approx(0.08)


def test_it_refuses_to_run_with_multicast_on(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    assert comm_curves.main(["--out", "x"]) == 2
    assert capsys.readouterr().err.strip() == ("error: comm_curves: needs MULTICAST_OFF in the environment: "
                                               "NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    assert comm_curves.main(["--out", "x", "--teams", "4"]) == 2
    assert "--teams [4]: each must be 2 to the world (2)" in capsys.readouterr().err


def test_a_dry_run_over_gloo_writes_a_table_per_team(tmp_path):
    """The whole script under torchrun, 3 CPU ranks (gloo, --device cpu): its figures mean nothing,
    its files' shape does."""
    import os
    import subprocess
    env = {**os.environ, **comm_curves.MULTICAST_OFF}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "tools/comm_curves.py", "--out", str(tmp_path), "--teams", "2", "3", "--device", "cpu",
           "--min-bytes", "4096", "--max-bytes", "8192", "--iters", "1", "--reps", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    for team in (2, 3):
        data = json.loads((tmp_path / f"comm_table_tp{team}.json").read_text())
        assert set(data["tables"]) == {"allreduce", "allgather", "reducescatter", "sendrecv"}   # no copy engine
        assert all(t["ranks"] == team and len(t["sizes"]) == 2 for t in data["tables"].values())
        assert "dry run" in data["source"]
