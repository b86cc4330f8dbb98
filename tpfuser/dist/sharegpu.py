"""One rank of a job with more ranks than GPUs (`tpfuser check --share-gpu`).

torchrun starts `python -m tpfuser.dist.sharegpu ARGS` for every rank; this sets,
before anything imports torch or nvFuser, what lets several ranks use one GPU,
then runs `python -m tpfuser.cli ARGS` in its place (or, with `--script PATH
ARGS`, that script):
- NCCL_HOSTID, different on every rank: NCCL refuses two ranks on one GPU of
  one host ("Duplicate GPU detected"); ranks of different hosts it connects
  through its socket transport, here over loopback (NCCL_SOCKET_IFNAME=lo).
- LOCAL_RANK (the GPU) = local rank modulo the GPUs the launcher saw, and
  LOCAL_WORLD_SIZE = those GPUs: a node of that many ranks, as far as each rank knows.
- nvFuser's store is served by rank 0 alone: NVFUSER_MASTER_ADDR "localhost"
  for it, "127.0.0.1" for the others (each rank is its node's local rank 0, and
  nvFuser's Communicator would otherwise start a server in every one); its port
  next to torchrun's, so that several jobs can run at once.
- LD_PRELOAD of shim/default_stream.c, built once (build_default_stream_shim),
  when TPFUSER_DEFAULT_STREAM_SHIM names it: nvFuser 0.2.36's host IR takes a
  rank's global index for a CUDA device index, which a rank past the GPUs
  lacks; the shim gives such an index the current device (its comment says how).
For correctness only: the ranks time-share the GPU and their bytes go through
host sockets, so their timings say nothing about one GPU per rank.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

SHARED_GPU_MARK = "TPFUSER_SHARED_GPUS"   # set by the launcher: how many GPUs the ranks share
SHIM_VARIABLE = "TPFUSER_DEFAULT_STREAM_SHIM"   # the built shim's path, preloaded in every rank
SHIM_NAME = "tpfuser_default_stream.so"


def build_default_stream_shim(folder: str | None = None) -> str:
    """Build shim/default_stream.c into `folder` (default ~/.cache/tpfuser) once,
    with gcc; return the library's path. Rebuilt when the source is newer. One
    process builds it (the launcher, before its ranks start): the file appears
    whole (built aside, then renamed)."""
    source = os.path.join(os.path.dirname(__file__), "shim", "default_stream.c")
    folder = folder or os.path.join(os.path.expanduser("~"), ".cache", "tpfuser")
    target = os.path.join(folder, SHIM_NAME)
    if os.path.exists(target) and os.path.getmtime(target) >= os.path.getmtime(source):
        return target
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("building the default-stream shim needs a C compiler (gcc or cc on PATH, or CC); "
                           "without it the overlapped fusions need a GPU per rank")
    os.makedirs(folder, exist_ok=True)
    fd, aside = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    run = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-fexceptions", "-o", aside, source, "-ldl", "-lpthread"],
                         capture_output=True, text=True)
    if run.returncode:
        os.unlink(aside)
        raise RuntimeError(f"building the default-stream shim failed ({compiler}): {run.stderr.strip()[:400]}")
    os.replace(aside, target)
    return target


def default_stream_shim_loaded() -> bool:
    """Whether this process has the shim mapped (preloaded): read from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            return any(line.rstrip().endswith(SHIM_NAME) for line in maps)
    except OSError:
        return False


def rank_environment(environ: dict[str, str]) -> dict[str, str]:
    """The environment of one rank, from torchrun's (RANK, LOCAL_RANK, MASTER_PORT)."""
    env = dict(environ)
    rank, local_rank = env.get("RANK", "0"), int(env.get("LOCAL_RANK", "0"))
    gpus = max(1, int(env.get(SHARED_GPU_MARK, "1")))
    env.update(NCCL_HOSTID=f"tpfuser-shared-gpu-rank-{rank}", NCCL_IB_DISABLE="1", NCCL_NVLS_ENABLE="0",
               LOCAL_RANK=str(local_rank % gpus), LOCAL_WORLD_SIZE=str(gpus),
               NVFUSER_MASTER_ADDR="localhost" if rank == "0" else "127.0.0.1")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if env.get(SHIM_VARIABLE):
        env["LD_PRELOAD"] = " ".join(filter(None, (env[SHIM_VARIABLE], env.get("LD_PRELOAD"))))
    if "NVFUSER_MASTER_PORT" not in env and "MASTER_PORT" in env:
        env["NVFUSER_MASTER_PORT"] = str(int(env["MASTER_PORT"]) + 1)
    return env



def check_host_ir_device(rank: int, device_count: int) -> None:
    """nvFuser 0.2.36's host IR evaluator (what runs the stream-parallel
    fusions) takes the rank's global index for a CUDA device index
    (HostIrEvaluator's constructor, csrc/host_ir/evaluator.cpp at 7e04d26:
    getDefaultCUDAStream(deviceId())). A rank at or beyond this node's GPU
    count then fails with "Device index value 1 is out of index range [0, 1)"
    (ranks sharing one GPU). Refuse it up front, saying so, unless the
    process preloads sharegpu's default-stream shim, which gives such an index
    the current device."""
    if rank >= device_count and not default_stream_shim_loaded():
        raise ValueError(f"the overlapped fusions need a GPU per rank: nvFuser 0.2.36 runs them on CUDA device "
                         f"<global rank> ({rank}), and this process sees {device_count} GPU(s); ranks sharing a GPU "
                         f"need the default-stream shim preloaded (LD_PRELOAD=$(python3 -c 'from tpfuser.dist.sharegpu "
                         f"import build_default_stream_shim as b; print(b())'), or {SHIM_VARIABLE} under tpfuser.dist.sharegpu)")


def main() -> None:
    """Become this rank: `tpfuser ARGS` (the command line), or with `--script
    PATH ARGS` that Python script (a tool run on every rank)."""
    args = sys.argv[1:]
    run = [sys.executable, *args[1:]] if args[:1] == ["--script"] else [sys.executable, "-m", "tpfuser.cli", *args]
    os.execve(sys.executable, run, rank_environment(dict(os.environ)))


if __name__ == "__main__":
    main()
