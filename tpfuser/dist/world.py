"""The process world, started by explicit calls (importing tpfuser changes
nothing outside it), and the collectives outside the fusions.

- A process on its own: describe_single_process (a world of one).
- Under torchrun or mpirun: rank_info and check_launch (the launcher's
  variables, refused when they disagree), init_rank (this rank's GPU), its
  groups (dp_group, rank_groups).
- Outside the fusions: sum_over_group (the dp sum of the parameter
  gradients, as DDP's buckets), gather_output (shards reassembled, for checking).

nvFuser's Communicator reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
(or mpirun's OMPI_COMM_WORLD_*) and NVFUSER_MASTER_ADDR / _PORT when it is
first needed, not when nvfuser_direct is imported nor when a DeviceMesh is
made (seen on the CPU: variables set after both still reach it). Under
torchrun or mpirun they are the launcher's (world.init_rank completes them);
a process on its own describes a world of one before its first meshed fusion
runs (ShardedBlock does, when it is built on a mesh), so that a 1x1 mesh runs
through the same code path.
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tpfuser.config import Layout
from tpfuser.parallel.placements import placements
from tpfuser.parallel.shard import gather

# Marks a world of one that this process described itself (not a launcher's).
SINGLE_PROCESS_MARK = "TPFUSER_SINGLE_PROCESS"


def free_port() -> int:
    """A port free on this host now, for nvFuser's store: so that concurrent runs do not collide."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def describe_single_process() -> bool:
    """Outside torchrun and mpirun, on a machine with a CUDA device, describe a
    world of one to nvFuser (rank 0 of 1, its store on a free local port).
    Without a CUDA device the Communicator cannot start at all: nothing is set.
    Returns whether the variables were set now."""
    if not torch.cuda.is_available():
        return False
    if any(v in os.environ for v in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")) or SINGLE_PROCESS_MARK in os.environ:
        return False
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("NVFUSER_MASTER_ADDR", "localhost")
    if "NVFUSER_MASTER_PORT" not in os.environ:
        os.environ["NVFUSER_MASTER_PORT"] = str(free_port())
    os.environ[SINGLE_PROCESS_MARK] = "1"
    return True


# ---------------------------------------------------------------------------
# Under torchrun or mpirun: this rank's place, its GPU and its groups.

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
        if not torch.cuda.is_available():
            var = next(n for n in _SIZE_VARS if n in os.environ)
            raise ValueError(f"under a launcher ({var}={info['world_size']}) on a machine without a CUDA device: "
                             f"nvFuser's multi-device runtime needs one; run `tpfuser show` or `tpfuser plan` "
                             f"without the launcher")


def init_rank(layout: Layout) -> int:
    """Validate the launch against the mesh, pick this rank's GPU, return the rank."""
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
    mine = None
    for t in range(layout.tp):
        group = dist.new_group([d * layout.tp + t for d in range(layout.dp)])
        if rank % layout.tp == t:
            mine = group
    return mine


def check_group(name: str, group) -> None:
    """Refuse, in one line, a process group that is none: not None nor a torch.distributed ProcessGroup."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{name}={group!r}: expected None or a torch.distributed ProcessGroup "
                         f"(world.dp_group(layout, rank)), got {type(group).__name__}")


def rank_groups(layout: Layout, rank: int):
    """torch.distributed (NCCL) for this rank, and its groups: .tp and .dp (this
    rank's row and column of the mesh) and .tp_mesh (a torch DeviceMesh over its
    tp row, for DTensor). Called by every rank after init_rank."""
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    # Ranks laid out as the fusion's mesh (rank = dp_rank * tp + tp_rank); its groups are DTensor's too.
    mesh = init_device_mesh("cuda", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    return SimpleNamespace(tp=mesh.get_group("tp"), dp=mesh.get_group("dp"), tp_mesh=mesh["tp"])


def check_world(layout: Layout, world_size: int, local_gpus: Optional[int] = None, local_ranks: Optional[int] = None) -> None:
    """Fail before any GPU work when the launch cannot host the mesh."""
    if world_size != layout.world_size:
        raise ValueError(f"world size {world_size} != dp*tp = {layout.dp}*{layout.tp} = {layout.world_size}; "
                         f"launch exactly {layout.world_size} ranks")
    if local_gpus is not None and local_ranks is not None and local_ranks > local_gpus:
        raise ValueError(f"{local_ranks} ranks on this node but only {local_gpus} CUDA device(s) visible")


# ---------------------------------------------------------------------------
# The collectives outside the fusions: the dp sum of the gradients, gathers for checking.

def sum_over_group(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Each tensor summed over a torch.distributed group in one all-reduce:
    flattened together, summed in fp32 (through the CPU where the group is
    gloo's), each returned in its own dtype and shape. The dp sum of parameter
    gradients (as DDP's buckets do it)."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    on = flat.cpu() if dist.get_backend(group) == "gloo" else flat
    dist.all_reduce(on, group=group)
    flat = on.to(flat.device)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].view_as(t).to(t.dtype))
        at += t.numel()
    return out


def gather_output(local: torch.Tensor, layout: Layout, name: str = "out", group=None) -> torch.Tensor:
    """Every rank's shard of a tensor named in plan.placements (an output, a
    parameter or its gradient), reassembled into the global tensor on
    every rank (for checking; it moves the whole tensor). Uses torch.distributed
    (any backend; the shards travel through the CPU), which the caller
    initializes; with a world of one it returns the local tensor."""
    if layout.world_size == 1:
        return local
    if not dist.is_initialized():
        raise RuntimeError("gather_output needs torch.distributed initialized (e.g. init_process_group('gloo'))")
    if dist.get_world_size(group) != layout.world_size:
        raise ValueError(f"world size {dist.get_world_size(group)} != dp*tp = {layout.world_size}")
    shards: list = [None] * layout.world_size
    dist.all_gather_object(shards, local.detach().cpu(), group=group)
    return gather(shards, placements(layout)[name], layout)
