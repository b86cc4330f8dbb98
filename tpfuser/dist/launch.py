"""The launcher: `--dp/--tp` outside torchrun or mpirun re-executes the same
command under torchrun over the local GPUs (relaunch), every rank bounded in
time and ended together (run_bounded); what ranks sharing one GPU need in
memory. A rank's own place in the world is world.py's.
"""

from __future__ import annotations

import ctypes
import faulthandler
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import torch

from tpfuser.block.tensors import param_shapes
from tpfuser.config import Layout
from tpfuser.dist import procs
from tpfuser.dist.sharegpu import SHARED_GPU_MARK, SHIM_VARIABLE, build_default_stream_shim
from tpfuser.dist.world import SINGLE_PROCESS_MARK, free_port
from tpfuser.outputs import Signalled
from tpfuser.parallel.placements import PARAM_PLACEMENTS, local_shape, saved_bytes_per_rank
from tpfuser.parallel.linear_schedule import EXECUTOR_OVERLAPS

# Deferred: tpfuser.runtime.chunked (relaunch, for a chunked schedule's CONNECTIONS_VAR), a layer above
# this one that imports nvFuser, which the launcher process (`check`, `bench` over ranks) runs none of.

# A rank that dies leaves the others waiting in a collective; NCCL's watchdog
# and torchrun bound that. This is the bound we ask of the whole run, read
# from TIMEOUT_VAR when a run starts (run_timeout_s).
TIMEOUT_VAR = "TPFUSER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0   # a week: what faulthandler's watchdog (arm_stack_dumps) can wait for, and more
# A plain number of seconds in text (not inf, nan, a sign), else NaN, which every bound refuses.
_seconds = lambda text: float(text) if re.fullmatch(r"\s*\d*\.?\d+([eE][+-]?\d+)?\s*", text) else math.nan  # noqa: E731
# Between SIGTERM and SIGKILL: time for torchrun to stop its ranks and NCCL to let go.
GRACE_S = 10.0
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)   # what ends the ranks with us
# A run past its bound: run_bounded measures each rank's CPU over WATCH_S before
# ending it; each rank prints its Python stacks a little before (arm_stack_dumps),
# at the time run_bounded puts in STACKS_AT_VAR (seconds since the epoch).
WATCH_S = 2.0
STACKS_AT_VAR = "TPFUSER_STACKS_AT"
_STACKS_FD: int | None = None   # where the stacks go: stderr as it was when first armed


def stacks_due_s(bound_s: float) -> float:
    """When, after a bounded run starts, its ranks print their stacks: 20 s
    before the bound, or a quarter of it before for a short one."""
    return bound_s - min(20.0, bound_s / 4)


def arm_stack_dumps() -> None:
    """Where this process is, on request and before it is ended: SIGUSR1 prints
    every thread's Python stack to stderr (`kill -USR1 PID`), and a rank of a
    run_bounded run (RANK and STACKS_AT_VAR set) prints them by itself then
    (faulthandler's watchdog thread: no signal, which a library may have taken);
    so does a labelled process of run_bounded_all's (procs.LABEL_VAR)."""
    global _STACKS_FD
    if _STACKS_FD is None:
        try:   # the process's own stderr (not a replacement without a descriptor: pytest's), duplicated:
            # commlog.captured_communications points descriptor 2 at a file while nvFuser runs, and
            # a rank ended there would leave its stacks in that file (two runs on an H200 printed
            # none; docs/history.md)
            _STACKS_FD = os.dup(sys.__stderr__.fileno())
        except (AttributeError, OSError, ValueError):   # no stderr to write to: nothing to arm
            return
    faulthandler.register(signal.SIGUSR1, file=_STACKS_FD, all_threads=True)
    left = stacks_due_in_s() if "RANK" in os.environ or procs.LABEL_VAR in os.environ else None
    if left is not None:
        faulthandler.dump_traceback_later(left, file=_STACKS_FD, exit=False)


def stacks_due_in_s() -> float | None:
    """Seconds (at least 1) until run_bounded wants this process's stacks (STACKS_AT_VAR, ours), or None;
    refused in one line where it holds no time within MAX_TIMEOUT_S (faulthandler's wait would overflow)."""
    if (text := os.environ.get(STACKS_AT_VAR)) is None:
        return None
    if not (left := _seconds(text) - time.time()) < MAX_TIMEOUT_S:
        raise ValueError(f"{STACKS_AT_VAR}={text!r}: expected the time (seconds since the epoch, within "
                         f"{MAX_TIMEOUT_S:.0f} s) a bounded run's ranks print their stacks at; tpfuser's launcher sets it")
    return max(1.0, left)


def torchrun_command(layout: Layout, argv: list[str], environ: dict[str, str],
                     shared_gpus: int = 0) -> tuple[list[str], dict[str, str]]:
    """The command and environment that re-run `tpfuser argv` under torchrun on this node.
    The world of one this process may have described (world.py) is dropped. nvFuser's store gets a
    port free now (not torchrun's port + 1, which a concurrent run's torchrun may hold).
    shared_gpus > 0: the ranks share that many GPUs (tpfuser.dist.sharegpu sets each rank up)."""
    env = {k: v for k, v in environ.items()
           if k not in (SINGLE_PROCESS_MARK, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "NVFUSER_MASTER_ADDR", "NVFUSER_MASTER_PORT", SHARED_GPU_MARK)}
    env["NVFUSER_MASTER_PORT"] = str(free_port())
    module = "tpfuser.cli"
    if shared_gpus:
        env[SHARED_GPU_MARK] = str(shared_gpus)
        module = "tpfuser.dist.sharegpu"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={layout.world_size}", "-m", module, *argv]
    return cmd, env


def run_timeout_s() -> float:
    """The bound on a multi-rank run in seconds: TPFUSER_TIMEOUT_S when a run starts, or 600."""
    text = os.environ.get(TIMEOUT_VAR)
    if text is None:
        return DEFAULT_TIMEOUT_S
    if not 0 < (value := _seconds(text)) <= MAX_TIMEOUT_S:
        raise ValueError(f"{TIMEOUT_VAR}={text!r}: must be a positive number of seconds, at most {MAX_TIMEOUT_S:.0f} "
                         f"(the bound on a multi-rank run; unset: {DEFAULT_TIMEOUT_S:.0f})")
    return value


def _report_ranks(tracked: dict[int, str], watch_s: float) -> None:
    """For each rank of a run past its bound: the CPU it used over watch_s and
    its busiest threads by name (busy: compiling or spinning; near 0: waiting).
    Ranks have printed their Python stacks a little before (arm_stack_dumps)."""
    ranks = {pid: procs.rank_of(pid) for pid in procs.alive(tracked)}
    ranks = {pid: rank for pid, rank in ranks.items() if rank is not None}
    before = {pid: procs.threads_cpu_s(pid) for pid in ranks}
    time.sleep(watch_s)
    for pid, rank in sorted(ranks.items(), key=lambda kv: int(kv[1]) if kv[1].isdigit() else -1):
        after = procs.threads_cpu_s(pid)
        if not after:
            continue
        used = {tid: (name, cpu - before[pid].get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()}
        busiest = sorted(used.values(), key=lambda nc: -nc[1])[:4]
        total = sum(c for _, c in used.values())
        print(f"{'rank ' if rank.isdigit() else ''}{rank} (pid {pid}): {total:.1f} s of CPU in the last {watch_s:g} s over {len(after)} threads, "
              f"the busiest: " + ", ".join(f"{n} {c:.1f}" for n, c in busiest)
              + (" (waiting, in a collective most likely)" if total < 0.1 * watch_s else ""), file=sys.stderr, flush=True)


def _signal_all(root: int, tracked: dict[int, str], sig) -> None:
    try:
        os.killpg(root, sig)
    except ProcessLookupError:
        pass
    for pid in procs.alive(tracked):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_ended(proc: subprocess.Popen, tracked: dict[int, str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        proc.poll()   # reap our child, or it counts as running
        if proc.returncode is not None and not procs.alive(tracked):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _end_all(started: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to each process, its group and its descendants (torchrun and its
    ranks), all at once, SIGKILL to whatever is left after grace_s; return when
    none of them runs any more, or say which still do (a process the kernel
    cannot kill, e.g. stuck in a driver). A second Ctrl-C or SIGTERM meanwhile
    does not cut this short: its SIGKILL must come."""
    deaf = {}
    if threading.current_thread() is threading.main_thread():
        deaf = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ENDING_SIGNALS}
    try:
        tracked: dict[int, str] = {}
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for proc in started:
                tracked |= procs.tree(proc.pid)   # and any process started since
                _signal_all(proc.pid, tracked, sig)
            deadline = time.monotonic() + wait_s
            if all(_wait_ended(proc, tracked, max(0.0, deadline - time.monotonic())) for proc in started):
                break
        left = procs.alive(tracked)
        if left:
            print(f"error: processes {', '.join(map(str, left))} still run after SIGKILL", file=sys.stderr)
        for proc in started:
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for sig, handler in deaf.items():
            signal.signal(sig, handler)


class Ended(Signalled):
    """This process was told to end (SIGTERM, SIGHUP) while its ranks ran: they are ended too."""

    @property
    def line(self) -> str:
        return f"ended by {signal.Signals(self.signum).name}: every rank was ended with it"


def _raise_ended(signum, frame):
    raise Ended(signum)


def _child_setup(mask: set) -> None:
    """In the child, before it runs: the signal mask its parent had before it
    held the ending signals for the start (_start), and SIGTERM when this
    launcher dies (even by SIGKILL, which no handler sees: Linux's parent-death
    signal)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _start(started: list[subprocess.Popen], cmd: list[str], **kwargs) -> None:
    """Start cmd and put it in `started`, holding Ctrl-C, SIGTERM and SIGHUP
    until it is there: one that came in between would raise before the caller
    knew the process, and leave it running (ended by nobody)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ENDING_SIGNALS)
    try:
        started.append(subprocess.Popen(cmd, preexec_fn=lambda: _child_setup(mask), **kwargs))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)   # a signal held meanwhile is taken now


def run_bounded(cmd: list[str], env: dict[str, str], timeout_s: float, grace_s: float | None = None) -> int | None:
    """Run cmd in a session (and process group) of its own; its exit status, or
    None when it ran past timeout_s: then its ranks have printed their stacks
    (STACKS_AT_VAR), it says what each was doing (_report_ranks), and it is
    ended with its group and every process it started (torchrun's ranks run in
    sessions of their own), so that none is left holding a GPU. Ctrl-C, SIGTERM
    (timeout(1)'s) and SIGHUP (a closed terminal) end them too, then raise
    (KeyboardInterrupt, Ended); a SIGKILL of this process ends cmd by its
    parent-death signal. grace_s: between SIGTERM and SIGKILL (GRACE_S)."""
    return run_bounded_all([cmd], env, timeout_s, grace_s)[0]


def run_bounded_all(cmds: list[list[str]], env: dict[str, str], timeout_s: float, grace_s: float | None = None,
                    stdouts: list | None = None, labels: list[str] | None = None,
                    merge_stderr: bool = False) -> list[int | None]:
    """run_bounded for several commands at once (side by side, one bound for
    all): each one's exit status, None for those still running at the bound
    (ended together, with everything they started); a signal to this process
    ends them all. stdouts: a file for each command's standard output (default:
    ours). labels: what each is, for a process that is no rank (procs.LABEL_VAR):
    it then prints its stacks before the bound, and is named past it.
    merge_stderr: each command's standard error goes where its output goes."""
    grace_s = GRACE_S if grace_s is None else grace_s
    env = {**env, STACKS_AT_VAR: f"{time.time() + stacks_due_s(timeout_s):.1f}"}
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _raise_ended) for sig in (signal.SIGTERM, signal.SIGHUP)}
    started: list[subprocess.Popen] = []
    try:
        for i, cmd in enumerate(cmds):
            own = {**env, procs.LABEL_VAR: labels[i]} if labels else env
            _start(started, cmd, env=own, start_new_session=True, stdout=stdouts[i] if stdouts else None,
                   stderr=subprocess.STDOUT if merge_stderr else None)
        deadline = time.monotonic() + timeout_s
        while any(proc.poll() is None for proc in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        late = [proc for proc in started if proc.poll() is None]
        if late:
            _report_ranks({pid: t for proc in late for pid, t in procs.tree(proc.pid).items()}, WATCH_S)
            _end_all(late, grace_s)
        return [None if proc in late else proc.returncode for proc in started]
    except BaseException:
        _end_all([proc for proc in started if proc.poll() is None], grace_s)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def relaunch(layout: Layout, argv: list[str] | None = None, share_gpu: bool = False, schedule=None) -> int:
    """Re-run this command (`tpfuser argv`, default this process's) under
    torchrun with dp*tp local ranks; refuse when this machine has fewer GPUs,
    unless share_gpu (the ranks then share the GPUs there are: tpfuser.dist.sharegpu).
    A schedule that chunks its linears gets CUDA_DEVICE_MAX_CONNECTIONS=1 in every rank (runtime/chunked.py
    says why), and where it runs some by MultiDeviceExecutor on shared GPUs, the default-stream shim.
    Past TPFUSER_TIMEOUT_S every rank is ended and 124 returned."""
    timeout_s = run_timeout_s()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0 or (gpus < layout.world_size and not share_gpu):
        raise ValueError(f"a {layout.dp}x{layout.tp} mesh needs {layout.world_size} GPUs, one per rank; "
                         f"this machine has {gpus}" + ("; --share-gpu runs the ranks on fewer GPUs "
                                                      "(for checking, not timing)" if gpus else ""))
    environ = dict(os.environ)
    if schedule is not None and schedule.chunked():
        from tpfuser.runtime.chunked import CONNECTIONS_VAR
        environ[CONNECTIONS_VAR] = "1"
        if share_gpu and gpus < layout.world_size and schedule.overlapped(*EXECUTOR_OVERLAPS):
            environ.setdefault(SHIM_VARIABLE, build_default_stream_shim())
    cmd, env = torchrun_command(layout, sys.argv[1:] if argv is None else argv, environ,
                                shared_gpus=min(gpus, layout.world_size) if share_gpu else 0)
    returncode = run_bounded(cmd, env, timeout_s)
    if returncode is None:
        print(f"error: the {layout.world_size}-rank run did not finish in {timeout_s:g} s and was ended, "
              f"every rank (a rank may have died; {TIMEOUT_VAR} sets the bound)", file=sys.stderr)
        return 124
    return returncode


# A rank's CUDA context, nvFuser's and NCCL's buffers (about 0.6 GiB seen per process on the H200).
RANK_CONTEXT_BYTES = 1 << 30


def shared_gpu_phases(cfg, layout: Layout) -> dict[str, int]:
    """GPU memory a --share-gpu check of cfg on this mesh needs, all ranks on one GPU
    (an estimate), in each of its phases (oracle.expectations frees the first
    before the second): "reference", rank 0's float32 run of the whole block
    (weights, gradients, activations; in bf16 its eager bf16 run too) beside every
    rank's CUDA context; "block", every rank's shards, gradients, expected slices,
    float64 copies of its largest gradient pair and saved activations (ten times
    over: fitted to an H100's allocator peaks, gpt3 1x8 7.3 GiB a rank, 1x8 SP 5.7)."""
    shapes = param_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    locals_ = [math.prod(local_shape(s, PARAM_PLACEMENTS[n], layout)) for n, s in shapes.items()]
    per_rank = (RANK_CONTEXT_BYTES + sum(locals_) * (3 * cfg.torch_dtype.itemsize + 8) + 24 * max(locals_)
                + 10 * saved_bytes_per_rank(cfg, layout))
    oracle = 16 * total + 4 * cfg.batch * cfg.seq * cfg.n_embd * 40
    if cfg.dtype == "fp32":   # the written-out attention's [b, h, s, s] probabilities, a few of them
        oracle += 4 * cfg.batch * cfg.n_head * cfg.seq * cfg.seq * 6
    else:
        oracle += eager_peer_bytes(cfg)
    return {"reference": layout.world_size * RANK_CONTEXT_BYTES + oracle, "block": layout.world_size * per_rank}


def shared_gpu_bytes(cfg, layout: Layout) -> int:
    return max(shared_gpu_phases(cfg, layout).values())   # the larger phase: what the GPU must hold


def eager_peer_bytes(cfg) -> int:
    """What rank 0's eager bf16 run beside the reference adds (oracle.eager_errors): its weights
    and gradients in bf16, and three float64 tensors of its largest gradient's size (rel_l2)."""
    sizes = [math.prod(s) for s in param_shapes(cfg).values()]
    return 4 * sum(sizes) + 24 * max(sizes)


def check_shared_gpu_fits(cfg, layout: Layout, free_bytes: int) -> None:
    """Refuse a --share-gpu run that the GPU's free memory cannot hold."""
    need = shared_gpu_bytes(cfg, layout)
    if need > free_bytes:
        raise ValueError(f"--share-gpu: {layout.world_size} ranks of this block need about {need / 2**30:.1f} GiB "
                         f"of GPU memory (estimated), the GPU has {free_bytes / 2**30:.1f} GiB free; "
                         f"use fewer ranks or a smaller preset")
