"""Launch plumbing: torchrun and mpirun variables, the relaunch command."""
import sys

import pytest

from tpfuser import launch
from tpfuser.config import Layout


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (3, 4, 1, 2)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (5, 8, 1, 4)),
    ({}, (0, 1, 0, 1)),
], ids=["torchrun", "mpirun", "none"])
def test_rank_info_reads_torchrun_and_mpirun(monkeypatch, env, expected):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                 "TPFUSER_SINGLE_PROCESS"):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    info = launch.rank_info()
    assert (info["rank"], info["world_size"], info["local_rank"], info["local_world_size"]) == expected
    assert launch.in_launcher() == bool(env)


def test_world_of_one_described_by_tpfuser_is_not_a_launcher(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TPFUSER_SINGLE_PROCESS", "1")
    assert not launch.in_launcher()


def test_torchrun_command():
    cmd, env = launch.torchrun_command(Layout(2, 4), ["check", "--dp", "2", "--tp", "4"],
                                      {"PATH": "/bin", "RANK": "0", "WORLD_SIZE": "1", "TPFUSER_SINGLE_PROCESS": "1",
                                       "NVFUSER_MASTER_PORT": "1234"})
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
                   "-m", "tpfuser.cli", "check", "--dp", "2", "--tp", "4"]
    assert env == {"PATH": "/bin"}
