"""Launch plumbing: torchrun and mpirun variables (world.py), the relaunch command (launch.py)."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tpfuser.dist import launch, world
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
    info = world.rank_info()
    assert (info["rank"], info["world_size"], info["local_rank"], info["local_world_size"]) == expected
    assert world.in_launcher() == bool(env)


def test_world_of_one_described_by_tpfuser_is_not_a_launcher(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TPFUSER_SINGLE_PROCESS", "1")
    assert not world.in_launcher()


def test_torchrun_command():
    cmd, env = launch.torchrun_command(Layout(2, 4), ["check", "--dp", "2", "--tp", "4"],
                                      {"PATH": "/bin", "RANK": "0", "WORLD_SIZE": "1", "TPFUSER_SINGLE_PROCESS": "1",
                                       "NVFUSER_MASTER_PORT": "1234"})
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
                   "-m", "tpfuser.cli", "check", "--dp", "2", "--tp", "4"]
    port = int(env.pop("NVFUSER_MASTER_PORT"))   # a free one, never the caller's (a concurrent run's, perhaps)
    assert env == {"PATH": "/bin"} and port != 1234 and 0 < port < 65536


def test_torchrun_command_sharing_gpus_runs_each_rank_through_sharegpu():
    cmd, env = launch.torchrun_command(Layout(1, 8), ["check", "--tp", "8", "--share-gpu"],
                                      {"PATH": "/bin", "NVFUSER_MASTER_PORT": "1234"}, shared_gpus=1)
    assert cmd[-6:] == ["-m", "tpfuser.dist.sharegpu", "check", "--tp", "8", "--share-gpu"]
    assert "--nproc-per-node=8" in cmd
    assert int(env.pop("NVFUSER_MASTER_PORT")) != 1234 and env == {"PATH": "/bin", "TPFUSER_SHARED_GPUS": "1"}


@pytest.mark.parametrize("rank", [0, 5])
def test_sharegpu_rank_environment(rank):
    from tpfuser.dist.sharegpu import rank_environment
    env = rank_environment({"RANK": str(rank), "LOCAL_RANK": str(rank), "MASTER_PORT": "29400",
                            "TPFUSER_SHARED_GPUS": "2"})
    assert env["NCCL_HOSTID"].endswith(f"-{rank}")          # every rank its own host to NCCL
    assert env["LOCAL_RANK"] == str(rank % 2) and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["NVFUSER_MASTER_ADDR"] == ("localhost" if rank == 0 else "127.0.0.1")   # rank 0 alone serves the store
    assert env["NVFUSER_MASTER_PORT"] == "29401"
    assert env["NCCL_SOCKET_IFNAME"] == "lo"


def test_sharegpu_ranks_get_distinct_nccl_hosts():
    from tpfuser.dist.sharegpu import rank_environment
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
        launch.check_shared_gpu_fits(preset("gpt3"), Layout(1, 8), 50 * gib)


def test_the_estimate_is_the_larger_phase_not_their_sum():
    """oracle.expectations frees rank 0's reference before any rank builds its
    block. Run 58 (H100, gpt3 bf16) measured the allocators' peaks: rank 0's
    reference 49.97 GiB, each rank's block 7.32 GiB at 1x8 and 5.65 at 1x8 SP;
    each phase's estimate holds that and 0.6 GiB a rank's context, and the larger
    fits an H100's 79 GiB, which the two summed would not."""
    from tpfuser.config import preset
    gib = 2 ** 30
    gpt3 = preset("gpt3")
    for layout, block_peak in ((Layout(1, 8), 7.32), (Layout(1, 8, sp=True), 5.65)):
        phases = launch.shared_gpu_phases(gpt3, layout)
        assert phases["reference"] >= (49.97 + 8 * 0.6) * gib
        assert phases["block"] >= 8 * (block_peak + 0.6) * gib
        assert launch.shared_gpu_bytes(gpt3, layout) == max(phases.values()) < 0.9 * 79 * gib < sum(phases.values())
    assert 8 * gib <= launch.shared_gpu_bytes(preset("tiny"), Layout(1, 8)) < 9 * gib   # 8 contexts


def test_a_bf16_check_counts_rank_0s_eager_run(monkeypatch):
    """In bf16, rank 0 also runs the block in eager bf16 (oracle.eager_errors):
    weights and gradients in bf16 (4 bytes a parameter) and, while the largest
    gradient (c_fc's or c_proj's, 4 e^2) is compared, three float64 tensors of its size."""
    from tpfuser.config import preset
    gpt3 = preset("gpt3")
    e = gpt3.n_embd
    params = 12 * e * e + 13 * e
    assert launch.eager_peer_bytes(gpt3) == 4 * params + 24 * 4 * e * e
    with_eager = launch.shared_gpu_phases(gpt3, Layout(1, 8))
    fp32 = launch.shared_gpu_phases(preset("gpt3", dtype="fp32"), Layout(1, 8))
    monkeypatch.setattr(launch, "eager_peer_bytes", lambda cfg: 0)
    without = launch.shared_gpu_phases(gpt3, Layout(1, 8))
    assert with_eager["reference"] - without["reference"] == 4 * params + 24 * 4 * e * e
    assert with_eager["block"] == without["block"]
    assert launch.shared_gpu_phases(preset("gpt3", dtype="fp32"), Layout(1, 8)) == fp32   # fp32 runs no eager peer


def test_relaunch_without_enough_gpus_names_share_gpu(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 4 GPUs, one per rank; this machine has 1; --share-gpu"):
        launch.relaunch(Layout(1, 4), ["check"])


# A stuck run as torchrun makes it: a launcher that ignores SIGTERM, a rank in its
# process group, and a rank in a session of its own (torchrun starts each rank so);
# both ranks ignore SIGTERM too. Each writes its pid to the file named by argv[1].
STUCK_RUN = r"""
import os, signal, subprocess, sys, time
hang = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
signal.signal(signal.SIGTERM, signal.SIG_IGN)
ranks = [subprocess.Popen([sys.executable, "-c", hang], start_new_session=True),
         subprocess.Popen([sys.executable, "-c", hang])]
with open(sys.argv[1], "w") as f:
    f.write(" ".join(str(p.pid) for p in [*ranks]))
time.sleep(600)
"""


def _gone(pid, group=False, within_s=10.0):
    """True once no process (a zombie neither: init reaps the orphans) has this pid (or process group)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            (os.killpg if group else os.kill)(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_timeout_ends_every_rank(tmp_path, monkeypatch, capsys):
    """relaunch past TPFUSER_TIMEOUT_S returns 124 and leaves no process behind:
    not the launcher, not its group, not a rank in a session of its own."""
    pids = tmp_path / "pids"
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_RUN)
    monkeypatch.setenv("TPFUSER_TIMEOUT_S", "3")
    monkeypatch.setattr(launch, "GRACE_S", 0.5)
    monkeypatch.setattr(launch, "WATCH_S", 0.5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    started = []

    def fake_torchrun(layout, argv, environ, shared_gpus=0):
        return [sys.executable, str(script), str(pids)], dict(environ)

    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(launch, "torchrun_command", fake_torchrun)
    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    t0 = time.monotonic()
    assert launch.relaunch(Layout(1, 2), ["check"]) == 124
    assert time.monotonic() - t0 < 3 + 30   # ended at its bound, not left to sleep its 600 s (a margin load keeps)
    assert "did not finish in 3 s and was ended, every rank" in capsys.readouterr().err
    leader = started[0].pid
    own_session, in_group = (int(p) for p in pids.read_text().split())
    assert _gone(leader, group=True), "a process of the launcher's group is left"
    assert _gone(own_session), "the rank in a session of its own is left"
    assert _gone(in_group) and _gone(leader)


# A launcher with two ranks that never end (plain Python: they start in a blink
# however busy the machine): rank 0 sleeps, rank 1 spins. Each writes the
# stacks time run_bounded handed it (argv[2] + rank). The launcher is no rank (no RANK).
RANK_PROGRAM = r"""
import os, sys, time
with open(sys.argv[2] + sys.argv[1], "w") as f:
    f.write(os.environ.get(sys.argv[3], ""))
def waiting():
    time.sleep(600)
def spinning():
    while True:
        pass
(spinning if sys.argv[1] == "1" else waiting)()
"""
WAITING_RANKS = r"""
import os, subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, sys.argv[1], str(r), *sys.argv[2:]], env={**os.environ, "RANK": str(r)})
         for r in (0, 1)]
time.sleep(600)
"""


def test_a_run_past_its_bound_names_each_rank_and_ends_them(tmp_path, monkeypatch, capfd):
    """Past its bound run_bounded names each rank (not the launcher) with the CPU
    it used, says which waits, ends every process; the ranks were told when to
    print their stacks (STACKS_AT_VAR). What a rank prints then:
    test_an_armed_rank_prints_its_stacks_at_the_time_it_was_given; the CPU
    figures' arithmetic: test_the_report_of_a_late_rank."""
    (tmp_path / "rank.py").write_text(RANK_PROGRAM)
    (tmp_path / "launcher.py").write_text(WAITING_RANKS)
    monkeypatch.setattr(launch, "GRACE_S", 0.5)
    monkeypatch.setattr(launch, "WATCH_S", 1.0)
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    started = time.time()
    cmd = [sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "rank.py"), str(tmp_path / "stacks_at_"),
           launch.STACKS_AT_VAR]
    assert launch.run_bounded(cmd, env, 5) is None
    err = capfd.readouterr().err
    lines = {line.split(" (pid")[0]: line for line in err.splitlines() if line.startswith("rank ")}
    assert set(lines) == {"rank 0", "rank 1"}, err   # the ranks, not the launcher
    assert "waiting" in lines["rank 0"], lines   # asleep: no CPU, however busy the machine
    assert "the busiest: python" in lines["rank 1"]
    for r in (0, 1):
        stacks_at = float((tmp_path / f"stacks_at_{r}").read_text())
        assert abs(stacks_at - (started + launch.stacks_due_s(5))) < 2, stacks_at - started
    pids = [int(line.split("(pid ")[1].split(")")[0]) for line in lines.values()]
    assert all(_gone(pid) for pid in pids), "a rank is left running"


def test_the_report_of_a_late_rank(monkeypatch, capsys):
    """_report_ranks, on CPU figures given: each rank's CPU over the watch is its
    threads' after less before (a thread born meanwhile counts whole), the
    busiest threads first, and a rank under a tenth of the watch is waiting."""
    before = {10: {10: ("python", 5.0), 11: ("pt_worker", 1.0)}, 20: {20: ("python", 7.0)}}
    after = {10: {10: ("python", 5.08), 11: ("pt_worker", 1.0)},                  # 0.08 s in 2 s: waiting
             20: {20: ("python", 8.5), 21: ("nvfuser_compile", 0.3)}}             # 1.8 s: working
    reads = {10: iter([before[10], after[10]]), 20: iter([before[20], after[20]])}
    monkeypatch.setattr(launch.procs, "alive", lambda tracked: list(tracked))
    monkeypatch.setattr(launch.procs, "rank_of", lambda pid: {10: "0", 20: "1"}[pid])
    monkeypatch.setattr(launch.procs, "threads_cpu_s", lambda pid: next(reads[pid]))
    monkeypatch.setattr(launch.time, "sleep", lambda s: None)
    launch._report_ranks({10: "t", 20: "t"}, 2.0)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("rank 0 (pid 10): 0.1 s of CPU in the last 2 s over 2 threads, the busiest: python 0.1, "
                        "pt_worker 0.0 (waiting, in a collective most likely)")
    assert lines[1] == ("rank 1 (pid 20): 1.8 s of CPU in the last 2 s over 2 threads, the busiest: python 1.5, "
                        "nvfuser_compile 0.3")


def test_a_threads_cpu_is_read_as_the_thread_measures_it():
    """procs.threads_cpu_s against the thread's own clock (time.thread_time): the
    CPU this thread spends between two reads, however long that takes in wall time."""
    from tpfuser.dist import procs
    tid = threading.get_native_id()
    first, t0 = procs.threads_cpu_s(os.getpid())[tid][1], time.thread_time()
    while time.thread_time() - t0 < 0.3:
        pass
    second, t1 = procs.threads_cpu_s(os.getpid())[tid][1], time.thread_time()
    assert abs((second - first) - (t1 - t0)) < 0.05   # /proc counts in clock ticks (10 ms)


ARMED_RANK = r"""
import os, sys, tempfile, time
from tpfuser.dist.launch import STACKS_AT_VAR, arm_stack_dumps
os.environ["RANK"] = "0"
os.environ[STACKS_AT_VAR] = str(time.time() + 1)
arm_stack_dumps()
def waiting_in_a_collective():
    with tempfile.TemporaryFile() as log:   # as commlog.captured_communications does while nvFuser runs
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        time.sleep(30)
waiting_in_a_collective()
"""


def test_an_armed_rank_prints_its_stacks_at_the_time_it_was_given(tmp_path):
    """A rank that armed its stack dumps (as every entry point does) prints its
    Python stacks at STACKS_AT_VAR's time to the stderr it started with, though
    its descriptors 1 and 2 point at a file by then."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", ARMED_RANK], env=env, stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stderr:   # until the stacks name the function (or the process ends)
            seen.append(line)
            if "in waiting_in_a_collective" in line:
                break
    finally:
        proc.kill()
        proc.wait()
    assert any("in waiting_in_a_collective" in line for line in seen), "".join(seen)[-2000:]


def test_a_run_that_finishes_returns_its_status(tmp_path):
    assert launch.run_bounded([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), 30) == 3


@pytest.mark.parametrize("value, ok", [("5", 5.0), ("0.5", 0.5), (None, 600.0), ("0", None), ("-5", None),
                                       ("abc", None), ("", None), ("inf", None), ("nan", None)],
                         ids=["5", "half", "unset", "zero", "negative", "abc", "empty", "inf", "nan"])
def test_timeout_variable_is_checked(monkeypatch, value, ok):
    if value is None:
        monkeypatch.delenv("TPFUSER_TIMEOUT_S", raising=False)
    else:
        monkeypatch.setenv("TPFUSER_TIMEOUT_S", value)
    if ok is not None:
        assert launch.run_timeout_s() == ok
    else:
        with pytest.raises(ValueError) as err:
            launch.run_timeout_s()
        assert str(err.value).startswith(f"TPFUSER_TIMEOUT_S={value!r}: must be a positive number of seconds")


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "TPFUSER_SINGLE_PROCESS")


@pytest.mark.parametrize("env, layout, message", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, None, "RANK=2 with WORLD_SIZE=2: a rank must be below its world size"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, None,
     "LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2: a rank must be below its world size"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, None,
     "LOCAL_WORLD_SIZE=4 with WORLD_SIZE=2: more ranks on this node than in the world"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, None, "RANK='x': must be an int (the launcher sets it)"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, None, "RANK=-1: must be >= 0"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, None, "WORLD_SIZE=0: must be >= 1"),
    ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, None,
     "OMPI_COMM_WORLD_RANK=4 with OMPI_COMM_WORLD_SIZE=4: a rank must be below"),
    ({"RANK": "0", "WORLD_SIZE": "3"}, Layout(1, 2), "WORLD_SIZE=3 != dp*tp = 1*2 = 2; launch exactly 2 ranks"),
], ids=["rank", "local_rank", "local_world", "not_int", "negative", "world_zero", "mpirun", "mesh"])
def test_inconsistent_launch_refused_naming_the_variables(monkeypatch, env, layout, message):
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as err:
        world.check_launch(layout, nvfuser=False)
    assert str(err.value).startswith(message), str(err.value)


def test_launcher_without_cuda_refused_before_nvfuser(monkeypatch):
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"under a launcher \(WORLD_SIZE=2\) on a machine without a CUDA device"):
        world.check_launch(Layout(1, 2))
    world.check_launch(Layout(1, 2), nvfuser=False)   # plan imports no nvFuser: fine
    monkeypatch.delenv("WORLD_SIZE")
    world.check_launch(Layout(1, 2))   # outside a launcher: nothing to check
