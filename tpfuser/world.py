"""The process world, started by an explicit call: importing tpfuser changes
nothing outside it.

nvFuser's Communicator reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
(or mpirun's OMPI_COMM_WORLD_*) and NVFUSER_MASTER_ADDR / _PORT when it is
first needed, not when nvfuser_direct is imported nor when a DeviceMesh is
made (seen on the CPU: variables set after both still reach it). Under
torchrun or mpirun they are the launcher's (launch.init_rank completes them);
a process on its own describes a world of one before its first meshed fusion
runs (ShardedBlock does, when it is built on a mesh), so that a 1x1 mesh runs
through the same code path.
"""

from __future__ import annotations

import os
import socket

# Marks a world of one that this process described itself (not a launcher's).
SINGLE_PROCESS_MARK = "TPFUSER_SINGLE_PROCESS"


def describe_single_process() -> bool:
    """Outside torchrun and mpirun, on a machine with a CUDA device, describe a
    world of one to nvFuser (rank 0 of 1, its store on a free local port).
    Without a CUDA device the Communicator cannot start at all: nothing is set.
    Returns whether the variables were set now."""
    import torch
    if not torch.cuda.is_available():
        return False
    if any(v in os.environ for v in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")) or SINGLE_PROCESS_MARK in os.environ:
        return False
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("NVFUSER_MASTER_ADDR", "localhost")
    if "NVFUSER_MASTER_PORT" not in os.environ:
        with socket.socket() as s:  # a free port, so that concurrent runs do not collide
            s.bind(("localhost", 0))
            os.environ["NVFUSER_MASTER_PORT"] = str(s.getsockname()[1])
    os.environ[SINGLE_PROCESS_MARK] = "1"
    return True
