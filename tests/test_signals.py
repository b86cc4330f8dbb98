"""A launcher that leaves nothing behind (dist/launch.run_bounded): SIGTERM,
SIGHUP and SIGINT to the process running ranks end the ranks (each in a
session of its own, as torchrun's are) and the process exits with the
signal's conventional status and one line, no traceback; SIGKILL of the
launcher ends them by the parent-death signal."""
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The "torchrun": starts two sleeping ranks, each in a session of its own, and writes their pids.
RANKS = r"""
import subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
         for _ in range(2)]
open(sys.argv[1], "w").write(" ".join(str(r.pid) for r in ranks))
time.sleep(600)
"""
# The command: run_bounded on the "torchrun", as tpfuser's launcher does, under cli.main's handling.
LAUNCHER = r"""
import sys
from tpfuser.dist.launch import Ended, run_bounded
try:
    run_bounded([sys.executable, sys.argv[1], sys.argv[2]], {}, 600, grace_s=1.0)
except Ended as e:
    print(e.line, file=sys.stderr)
    sys.exit(128 + e.signum)
except KeyboardInterrupt:
    print("interrupted (SIGINT): every rank started was ended", file=sys.stderr)
    sys.exit(130)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _launch(tmp_path):
    (tmp_path / "ranks.py").write_text(RANKS)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "ranks.py"), str(pids)],
                            env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (pids.exists() and pids.read_text().strip()):
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
        time.sleep(0.05)
    return proc, [int(p) for p in pids.read_text().split()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_ends_every_rank(tmp_path, sig):
    proc, ranks = _launch(tmp_path)
    assert all(_alive(pid) for pid in ranks)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in ranks), "a rank outlived its launcher"


def test_a_killed_launcher_takes_its_torchrun_with_it(tmp_path):
    proc, ranks = _launch(tmp_path)
    children = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
    proc.kill()   # no handler runs: the parent-death signal ends the "torchrun"
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in children)
    for pid in ranks:   # (the ranks of a real torchrun die with it: its own parent-death handling)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


# The command whose signal lands while its process is being started: a Popen that
# sends it to its own launcher once the child is up, before run_bounded holds the
# process. The child ignores SIGTERM (only the SIGKILL after the grace ends it) and
# writes which signals it has blocked.
STARTED_LATE = r"""
import os, signal, subprocess, sys, time
from tpfuser.dist.launch import Ended, run_bounded
real, ready = subprocess.Popen, sys.argv[1]

class SignalledPopen(real):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        while not os.path.exists(ready):   # the child ignores SIGTERM from here on
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

subprocess.Popen = SignalledPopen
child = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "[os.dup2(os.open(os.devnull, os.O_WRONLY), fd) for fd in (1, 2)]; "   # not the test's pipes
         "blocked = [l for l in open('/proc/self/status') if l.startswith('SigBlk')][0].split()[1]; "
         "open(sys.argv[1], 'w').write(f'{os.getpid()} {blocked}'); time.sleep(600)")
try:
    run_bounded([sys.executable, "-c", child, ready], {}, 600, grace_s=0.5)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_a_signal_while_a_rank_starts_still_ends_it(tmp_path):
    """Ctrl-C that lands between the start of a process and run_bounded knowing
    it: the process is ended all the same (the signal waits for the start), and
    it runs with no signal blocked."""
    (tmp_path / "launcher.py").write_text(STARTED_LATE)
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(tmp_path / "launcher.py"), str(ready)], env=env,
                          capture_output=True, text=True, timeout=60)
    pid, blocked = ready.read_text().split()
    try:
        assert proc.returncode == 130, proc.stderr
        deadline = time.monotonic() + 10
        while _alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(int(pid)), "the process started as the signal came outlived its launcher"
        assert int(blocked, 16) == 0, f"the child runs with signals blocked: SigBlk {blocked}"
    finally:
        if _alive(int(pid)):
            os.kill(int(pid), signal.SIGKILL)
