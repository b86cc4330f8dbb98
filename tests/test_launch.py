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


def test_torchrun_command_sharing_gpus_runs_each_rank_through_sharegpu():
    cmd, env = launch.torchrun_command(Layout(1, 8), ["check", "--tp", "8", "--share-gpu"],
                                      {"PATH": "/bin", "NVFUSER_MASTER_PORT": "1234"}, shared_gpus=1)
    assert cmd[-6:] == ["-m", "tpfuser.sharegpu", "check", "--tp", "8", "--share-gpu"]
    assert "--nproc-per-node=8" in cmd
    assert env == {"PATH": "/bin", "TPFUSER_SHARED_GPUS": "1"}


@pytest.mark.parametrize("rank", [0, 5])
def test_sharegpu_rank_environment(rank):
    from tpfuser.sharegpu import rank_environment
    env = rank_environment({"RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_PORT": "29400",
                            "TPFUSER_SHARED_GPUS": "2"})
    assert env["NCCL_HOSTID"].endswith(f"-{rank}")          # every rank its own host to NCCL
    assert env["LOCAL_RANK"] == str(rank % 2) and env["LOCAL_WORLD_SIZE"] == "1"
    assert env["NVFUSER_MASTER_ADDR"] == ("localhost" if rank == 0 else "127.0.0.1")   # rank 0 alone serves the store
    assert env["NVFUSER_MASTER_PORT"] == "29401"
    assert env["NCCL_SOCKET_IFNAME"] == "lo"


def test_sharegpu_ranks_get_distinct_nccl_hosts():
    from tpfuser.sharegpu import rank_environment
    hosts = {rank_environment({"RANK": str(r)})["NCCL_HOSTID"] for r in range(8)}
    assert len(hosts) == 8


def test_share_gpu_refuses_what_the_gpu_cannot_hold():
    from tpfuser.config import preset
    gib = 2 ** 30
    launch.check_shared_gpu_fits(preset("tiny"), Layout(1, 8), 139 * gib)
    launch.check_shared_gpu_fits(preset("gpt3"), Layout(1, 8), 139 * gib)
    with pytest.raises(ValueError, match=r"--share-gpu: 8 ranks .* need about .* GiB .* has 4.0 GiB free"):
        launch.check_shared_gpu_fits(preset("tiny"), Layout(1, 8), 4 * gib)
    with pytest.raises(ValueError, match="--share-gpu"):   # rank 0's fp32 reference of 1.8 G weights and 8 ranks
        launch.check_shared_gpu_fits(preset("gpt3"), Layout(1, 8), 60 * gib)


def test_relaunch_without_enough_gpus_names_share_gpu(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 4 GPUs, one per rank; this machine has 1; --share-gpu"):
        launch.relaunch(Layout(1, 4), ["check"])
