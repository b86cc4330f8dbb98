"""The GPU tests' launcher (tests/ranks_on_one_gpu.py), on the CPU: torchrun
starts the ranks (no CUDA needed until a rank asks for it)."""
import os
import time

from tests.ranks_on_one_gpu import run_on_ranks

# Each line in one write: the ranks share one log, and under PYTHONUNBUFFERED
# print writes a line's newline apart, and lines ran together ("store port 43727rank 1: on stderr").
SAYS_ITS_PORT = """
import os, sys
sys.stdout.write(f"rank {os.environ['RANK']}: store port {os.environ['NVFUSER_MASTER_PORT']}\\n"); sys.stdout.flush()
sys.stderr.write(f"rank {os.environ['RANK']}: on stderr\\n"); sys.stderr.flush()
"""

STAYS = """
import os, sys, time
open(sys.argv[1] + os.environ['RANK'], 'w').write(str(os.getpid()))
sys.stdout.write(f"rank {os.environ['RANK']}: waiting\\n"); sys.stdout.flush()
sys.stderr.write(f"[rank {os.environ['RANK']} +0.0 s] sleeping\\n"); sys.stderr.flush()
time.sleep(600)
"""


def test_ranks_get_a_store_port_of_their_own_and_their_stderr_is_kept(tmp_path):
    """A port the caller's process holds (its world of one's, world.describe_single_process)
    is not inherited: the ranks share a free one."""
    (tmp_path / "port.py").write_text(SAYS_ITS_PORT)
    env = {**os.environ, "NVFUSER_MASTER_PORT": "1234", "TPFUSER_SINGLE_PROCESS": "1", "WORLD_SIZE": "1"}
    done = run_on_ranks(str(tmp_path / "port.py"), [], env=env, timeout_s=120)
    ports = {line.split("store port ")[1] for line in done.output.splitlines() if "store port" in line}
    assert done.returncode == 0 and len(ports) == 1 and ports != {"1234"}, done.tail()
    assert "rank 0: on stderr" in done.output and "rank 1: on stderr" in done.output


def test_ranks_past_the_bound_are_ended_and_what_they_said_is_kept(tmp_path):
    (tmp_path / "stays.py").write_text(STAYS)
    started = time.monotonic()
    done = run_on_ranks(str(tmp_path / "stays.py"), [str(tmp_path / "pid")], timeout_s=20)
    assert done.returncode is None and time.monotonic() - started < 60, done.tail()
    assert "rank 0: waiting" in done.output and "rank 1: waiting" in done.output, done.tail()
    story = done.tail(chars=0)   # the ranks' lines, however long torchrun's own trace at the end
    assert all(said in story for said in ("rank 0: waiting", "[rank 0 +0.0 s] sleeping", "[rank 1 +0.0 s] sleeping"))
    for rank in "01":
        pid = int((tmp_path / f"pid{rank}").read_text())
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid
