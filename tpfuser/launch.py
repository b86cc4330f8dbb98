"""One launch path for torchrun and mpirun; `--dp/--tp` outside a launcher
re-executes the same command under torchrun over the local GPUs.

nvFuser's Communicator reads RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE
(torchrun) or OMPI_COMM_WORLD_* (mpirun), and NVFUSER_MASTER_ADDR / _PORT for
its TCP store; we derive those from torchrun's MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

from tpfuser.config import Layout
from tpfuser.runtime import check_world

# A rank that dies leaves the others waiting in a collective; NCCL's watchdog
# and torchrun bound that. This is the bound we ask of the whole run.
RUN_TIMEOUT_S = int(os.environ.get("TPFUSER_TIMEOUT_S", "600"))

_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK")
_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _env_int(names, default: int) -> int:
    for n in names:
        if n in os.environ:
            return int(os.environ[n])
    return default


def in_launcher() -> bool:
    """True under torchrun or mpirun (not in the world of one fusion.py describes)."""
    return "TPFUSER_SINGLE_PROCESS" not in os.environ and any(n in os.environ for n in _SIZE_VARS)


def rank_info() -> dict[str, int]:
    return {"rank": _env_int(_RANK_VARS, 0), "world_size": _env_int(_SIZE_VARS, 1),
            "local_rank": _env_int(_LOCAL_RANK_VARS, 0), "local_world_size": _env_int(_LOCAL_SIZE_VARS, 1)}


def init_rank(layout: Layout) -> int:
    """Validate the launch against the mesh, pick this rank's GPU, return the rank."""
    import torch
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
    The world of one that fusion.py may have described for this process is dropped.
    shared_gpus > 0: the ranks share that many GPUs (tpfuser.sharegpu sets each rank up)."""
    from tpfuser.sharegpu import SHARED_GPU_MARK
    env = {k: v for k, v in environ.items()
           if k not in ("TPFUSER_SINGLE_PROCESS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "NVFUSER_MASTER_ADDR", "NVFUSER_MASTER_PORT", SHARED_GPU_MARK)}
    module = "tpfuser.cli"
    if shared_gpus:
        env[SHARED_GPU_MARK] = str(shared_gpus)
        module = "tpfuser.sharegpu"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={layout.world_size}", "-m", module, *argv]
    return cmd, env


def relaunch(layout: Layout, argv: list[str] | None = None, share_gpu: bool = False) -> int:
    """Re-run this command (`tpfuser argv`, default this process's) under
    torchrun with dp*tp local ranks; refuse when this machine has fewer GPUs,
    unless share_gpu (the ranks then share the GPUs there are: tpfuser.sharegpu)."""
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0 or (gpus < layout.world_size and not share_gpu):
        raise ValueError(f"a {layout.dp}x{layout.tp} mesh needs {layout.world_size} GPUs, one per rank; "
                         f"this machine has {gpus}" + ("; --share-gpu runs the ranks on fewer GPUs "
                                                      "(for checking, not timing)" if gpus else ""))
    cmd, env = torchrun_command(layout, sys.argv[1:] if argv is None else argv, dict(os.environ),
                                shared_gpus=min(gpus, layout.world_size) if share_gpu else 0)
    try:
        return subprocess.run(cmd, timeout=RUN_TIMEOUT_S, env=env).returncode
    except subprocess.TimeoutExpired:
        print(f"error: the {layout.world_size}-rank run did not finish in {RUN_TIMEOUT_S} s "
              f"(a rank may have died; set TPFUSER_TIMEOUT_S to change the bound)", file=sys.stderr)
        return 124


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


# A rank's CUDA context, nvFuser's and NCCL's buffers (about 0.6 GiB seen per process on the H200).
RANK_CONTEXT_BYTES = 1 << 30


def check_shared_gpu_fits(cfg, layout: Layout, free_bytes: int) -> None:
    """Refuse a --share-gpu run that the GPU's free memory cannot hold."""
    need = shared_gpu_bytes(cfg, layout)
    if need > free_bytes:
        raise ValueError(f"--share-gpu: {layout.world_size} ranks of this block need about {need / 2**30:.1f} GiB "
                         f"of GPU memory (estimated), the GPU has {free_bytes / 2**30:.1f} GiB free; "
                         f"use fewer ranks or a smaller preset")
