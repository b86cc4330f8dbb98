"""One launch path for torchrun and mpirun; `--dp/--tp` outside a launcher
re-executes the same command under torchrun over the local GPUs.

nvFuser's Communicator reads RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE
(torchrun) or OMPI_COMM_WORLD_* (mpirun), and NVFUSER_MASTER_ADDR / _PORT for
its TCP store; we derive those from torchrun's MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

from tpfuser.config import Layout
from tpfuser.world import SINGLE_PROCESS_MARK

# A rank that dies leaves the others waiting in a collective; NCCL's watchdog
# and torchrun bound that. This is the bound we ask of the whole run, read
# from TIMEOUT_VAR when a run starts (run_timeout_s).
TIMEOUT_VAR = "TPFUSER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
# Between SIGTERM and SIGKILL: time for torchrun to stop its ranks and NCCL to let go.
GRACE_S = 10.0

_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK")
_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _env_int(names, default: int) -> tuple[int, str]:
    """(value, the variable it came from) of the first of `names` set; (default, 'NAME (unset)') otherwise."""
    for n in names:
        if n in os.environ:
            text = os.environ[n]
            try:
                value = int(text)
            except ValueError:
                raise ValueError(f"{n}={text!r}: must be an int (the launcher sets it)") from None
            if value < 0:
                raise ValueError(f"{n}={value}: must be >= 0")
            return value, f"{n}={value}"
    return default, f"{names[0]} (unset: {default})"


def in_launcher() -> bool:
    """True under torchrun or mpirun (not in the world of one world.describe_single_process describes)."""
    return SINGLE_PROCESS_MARK not in os.environ and any(n in os.environ for n in _SIZE_VARS)


def rank_info() -> dict[str, int]:
    """This process's place in the launch, from torchrun's or mpirun's variables;
    refused, naming them, when they contradict each other."""
    (rank, r), (world, w) = _env_int(_RANK_VARS, 0), _env_int(_SIZE_VARS, 1)
    (local_rank, lr), (local_world, lw) = _env_int(_LOCAL_RANK_VARS, 0), _env_int(_LOCAL_SIZE_VARS, 1)
    for value, what in ((world, w), (local_world, lw)):
        if value < 1:
            raise ValueError(f"{what}: must be >= 1")
    for (a, a_what), (b, b_what) in (((rank, r), (world, w)), ((local_rank, lr), (local_world, lw))):
        if a >= b:
            raise ValueError(f"{a_what} with {b_what}: a rank must be below its world size")
    if local_world > world:
        raise ValueError(f"{lw} with {w}: more ranks on this node than in the world")
    return {"rank": rank, "world_size": world, "local_rank": local_rank, "local_world_size": local_world}


def check_launch(layout: Layout | None = None, nvfuser: bool = True) -> None:
    """Under torchrun or mpirun, before any work: the launcher's variables agree
    with each other (rank_info) and, given the layout the ranks will run, with
    dp*tp; and, when the command will import nvFuser, there is a CUDA device:
    without one nvFuser's Communicator, which reads the same variables, aborts
    the process at exit (an internal assert, exit 134). Nothing outside a launcher."""
    if not in_launcher():
        return
    info = rank_info()
    if layout is not None and info["world_size"] != layout.world_size:
        var = next(n for n in _SIZE_VARS if n in os.environ)
        raise ValueError(f"{var}={info['world_size']} != dp*tp = {layout.dp}*{layout.tp} = {layout.world_size}; "
                         f"launch exactly {layout.world_size} ranks")
    if nvfuser:
        import torch
        if not torch.cuda.is_available():
            var = next(n for n in _SIZE_VARS if n in os.environ)
            raise ValueError(f"under a launcher ({var}={info['world_size']}) on a machine without a CUDA device: "
                             f"nvFuser's multi-device runtime needs one; run `tpfuser show` or `tpfuser plan` "
                             f"without the launcher")


def init_rank(layout: Layout) -> int:
    """Validate the launch against the mesh, pick this rank's GPU, return the rank."""
    import torch
    from tpfuser.runtime import check_world
    check_launch(layout)
    info = rank_info()
    check_world(layout, info["world_size"], torch.cuda.device_count(), info["local_world_size"])
    if "MASTER_ADDR" in os.environ:
        os.environ.setdefault("NVFUSER_MASTER_ADDR", os.environ["MASTER_ADDR"])
    if "MASTER_PORT" in os.environ:
        # nvFuser's store must not collide with torchrun's own on MASTER_PORT.
        os.environ.setdefault("NVFUSER_MASTER_PORT", str(int(os.environ["MASTER_PORT"]) + 1))
    torch.cuda.set_device(info["local_rank"])
    return info["rank"]


def dp_group(layout: Layout, rank: int):
    """This rank's dp group: the ranks holding the same tp shards (one per dp
    row), over which the backward sums parameter gradients. Every rank must call
    it (torch.distributed creates all groups collectively); torch.distributed
    must be initialized."""
    import torch.distributed as dist
    mine = None
    for t in range(layout.tp):
        group = dist.new_group([d * layout.tp + t for d in range(layout.dp)])
        if rank % layout.tp == t:
            mine = group
    return mine


def rank_groups(layout: Layout, rank: int):
    """torch.distributed (NCCL) for this rank, and its groups: .tp and .dp (this
    rank's row and column of the mesh) and .tp_mesh (a torch DeviceMesh over its
    tp row, for DTensor). Called by every rank after init_rank."""
    from types import SimpleNamespace
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    # Ranks laid out as the fusion's mesh (rank = dp_rank * tp + tp_rank); its groups are DTensor's too.
    mesh = init_device_mesh("cuda", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    return SimpleNamespace(tp=mesh.get_group("tp"), dp=mesh.get_group("dp"), tp_mesh=mesh["tp"])


def torchrun_command(layout: Layout, argv: list[str], environ: dict[str, str],
                     shared_gpus: int = 0) -> tuple[list[str], dict[str, str]]:
    """The command and environment that re-run `tpfuser argv` under torchrun on this node.
    The world of one this process may have described (world.py) is dropped.
    shared_gpus > 0: the ranks share that many GPUs (tpfuser.sharegpu sets each rank up)."""
    from tpfuser.sharegpu import SHARED_GPU_MARK
    env = {k: v for k, v in environ.items()
           if k not in (SINGLE_PROCESS_MARK, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "NVFUSER_MASTER_ADDR", "NVFUSER_MASTER_PORT", SHARED_GPU_MARK)}
    module = "tpfuser.cli"
    if shared_gpus:
        env[SHARED_GPU_MARK] = str(shared_gpus)
        module = "tpfuser.sharegpu"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={layout.world_size}", "-m", module, *argv]
    return cmd, env


def run_timeout_s() -> float:
    """The bound on a multi-rank run, in seconds: TPFUSER_TIMEOUT_S, read when a
    run starts, or 600."""
    text = os.environ.get(TIMEOUT_VAR)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{TIMEOUT_VAR}={text!r}: must be a positive number of seconds "
                         f"(the bound on a multi-rank run; unset: {DEFAULT_TIMEOUT_S:.0f})")
    return value


def _processes() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (parent pid, process group, state, start time) of every process, from
    Linux's /proc; empty elsewhere."""
    table = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:   # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) ": state, ppid, pgrp, ...
        table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0], fields[19])
    return table


def _tree(root: int) -> dict[int, str]:
    """pid -> start time of root, its process group and every descendant: torchrun
    starts each rank in a session of its own, out of reach of a signal to its group."""
    table = _processes()
    found = {pid: row[3] for pid, row in table.items() if pid == root or row[1] == root}
    todo = list(found)
    while todo:
        parent = todo.pop()
        for pid, row in table.items():
            if row[0] == parent and pid not in found:
                found[pid] = row[3]
                todo.append(pid)
    return found


def _signal_all(root: int, tracked: dict[int, str], sig) -> None:
    try:
        os.killpg(root, sig)
    except ProcessLookupError:
        pass
    for pid in _alive(tracked):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive(tracked: dict[int, str]) -> list[int]:
    """The tracked processes still running (not zombies, and not a new process that reuses the pid)."""
    table = _processes()
    return [pid for pid, start in tracked.items() if pid in table and table[pid][3] == start and table[pid][2] != "Z"]


def _wait_ended(proc: subprocess.Popen, tracked: dict[int, str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        proc.poll()   # reap our child, or it counts as running
        if proc.returncode is not None and not _alive(tracked):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _end_all(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to proc, its group and its descendants (torchrun and its ranks), SIGKILL
    to whatever is left after grace_s; return when none of them runs any more."""
    tracked = _tree(proc.pid)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        tracked |= _tree(proc.pid)   # and any process started since
        _signal_all(proc.pid, tracked, sig)
        if _wait_ended(proc, tracked, wait_s):
            break
    proc.wait()


def run_bounded(cmd: list[str], env: dict[str, str], timeout_s: float, grace_s: float | None = None) -> int | None:
    """Run cmd in a session (and process group) of its own; its exit status, or
    None when it ran past timeout_s: then it is ended with its group and every
    process it started (torchrun's ranks run in sessions of their own), so that
    none is left holding a GPU. Ctrl-C ends them too. grace_s: between SIGTERM
    and SIGKILL (GRACE_S)."""
    grace_s = GRACE_S if grace_s is None else grace_s
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end_all(proc, grace_s)
        return None
    except BaseException:
        _end_all(proc, grace_s)
        raise


def relaunch(layout: Layout, argv: list[str] | None = None, share_gpu: bool = False) -> int:
    """Re-run this command (`tpfuser argv`, default this process's) under
    torchrun with dp*tp local ranks; refuse when this machine has fewer GPUs,
    unless share_gpu (the ranks then share the GPUs there are: tpfuser.sharegpu).
    Past TPFUSER_TIMEOUT_S every rank is ended and 124 returned."""
    timeout_s = run_timeout_s()
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0 or (gpus < layout.world_size and not share_gpu):
        raise ValueError(f"a {layout.dp}x{layout.tp} mesh needs {layout.world_size} GPUs, one per rank; "
                         f"this machine has {gpus}" + ("; --share-gpu runs the ranks on fewer GPUs "
                                                      "(for checking, not timing)" if gpus else ""))
    cmd, env = torchrun_command(layout, sys.argv[1:] if argv is None else argv, dict(os.environ),
                                shared_gpus=min(gpus, layout.world_size) if share_gpu else 0)
    returncode = run_bounded(cmd, env, timeout_s)
    if returncode is None:
        print(f"error: the {layout.world_size}-rank run did not finish in {timeout_s:g} s and was ended, "
              f"every rank (a rank may have died; {TIMEOUT_VAR} sets the bound)", file=sys.stderr)
        return 124
    return returncode


# A rank's CUDA context, nvFuser's and NCCL's buffers (about 0.6 GiB seen per process on the H200).
RANK_CONTEXT_BYTES = 1 << 30


def shared_gpu_bytes(cfg, layout: Layout) -> int:
    """GPU memory a --share-gpu check of cfg on this mesh needs, all ranks on one
    GPU (an estimate): every rank's CUDA context and communicators, its weights,
    gradients and saved activations a few times over, and rank 0's float32
    reference of the whole block (weights, gradients, activations)."""
    from tpfuser.plan import PARAM_PLACEMENTS, local_shape, saved_bytes_per_rank
    from tpfuser.reference import param_shapes
    shapes = param_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    local = sum(math.prod(local_shape(s, PARAM_PLACEMENTS[n], layout)) for n, s in shapes.items())
    rows = cfg.batch * cfg.seq
    per_rank = RANK_CONTEXT_BYTES + local * (3 * cfg.torch_dtype.itemsize + 8) + 3 * saved_bytes_per_rank(cfg, layout)
    oracle = 16 * total + 4 * rows * cfg.n_embd * 40
    if cfg.dtype == "fp32":   # the written-out attention's [b, h, s, s] probabilities, a few of them
        oracle += 4 * cfg.batch * cfg.n_head * cfg.seq * cfg.seq * 6
    return layout.world_size * per_rank + oracle


def check_shared_gpu_fits(cfg, layout: Layout, free_bytes: int) -> None:
    """Refuse a --share-gpu run that the GPU's free memory cannot hold."""
    need = shared_gpu_bytes(cfg, layout)
    if need > free_bytes:
        raise ValueError(f"--share-gpu: {layout.world_size} ranks of this block need about {need / 2**30:.1f} GiB "
                         f"of GPU memory (estimated), the GPU has {free_bytes / 2**30:.1f} GiB free; "
                         f"use fewer ranks or a smaller preset")
