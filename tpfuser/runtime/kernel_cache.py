"""A persistent cache of nvFuser's compiled kernels, off unless asked for:
TPFUSER_KERNEL_CACHE=DIR (read when a block first runs a fusion).

It is nvFuser's own kernel database (option kernel_db): the CUDA source of
each kernel and NVRTC's arguments are the key, the cubin the value, so what
it returns is what NVRTC would have made. A later process then skips NVRTC
for every kernel seen before; nvFuser's segmenter and lowering still run (the
cold first call is what `bench --startup` measures, with the cache off).

nvFuser keeps its database in "nvfuser_kernel_db" under the temporary folder
(TMPDIR) and numbers the files by its own count of entries, so two processes
writing one folder would overwrite each other's. Here each process takes a
folder of its own for its life: DIR/nvfuser-<version>/<GPU>-sm<cc>-cuda<v>/
slot-<label or rank> where no other process holds it (an exclusive flock),
else the first free slot-<i>; so ranks sharing a machine never share one,
and a later run finds its own again. TMPDIR names the slot only while nvFuser
opens the database (open_database).
"""

from __future__ import annotations

import fcntl
import os
import re
import sys

import torch

from tpfuser.dist.procs import LABEL_VAR

# Deferred: nvfuser_direct, imported where the cache is set up (its version, the
# fusion that opens the database): this module's names are read without it.

CACHE_VAR = "TPFUSER_KERNEL_CACHE"
SLOTS = 64
OPTION = "kernel_db"
DB_FOLDER, DB_FILE = "nvfuser_kernel_db", "db.csv"   # nvFuser's names (kernel_db.cpp)

_state: dict = {"asked": None, "slot": None, "lock": None}   # decided once a process (active)


def cache_folder(root: str, nvfuser_version: str, gpu: str, capability: tuple[int, int], cuda: str) -> str:
    """The folder of one nvFuser version on one kind of GPU with one CUDA."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return os.path.join(os.path.expanduser(root), f"nvfuser-{nvfuser_version}",
                        f"{slug}-sm{capability[0]}{capability[1]}-cuda{cuda}")


def claim_slot(folder: str, slots: int = SLOTS, prefer: str | None = None):
    """(slot folder, its lock's file descriptor) of slot-<prefer> if no process
    holds it, else of the first numbered slot none holds, now held by this one
    until it exits (or release()); None if all are held. (A child forked
    without an exec shares the lock.)"""
    os.makedirs(folder, exist_ok=True)
    for i in ([prefer] if prefer else []) + list(range(slots)):
        slot = os.path.join(folder, f"slot-{i}")
        os.makedirs(slot, exist_ok=True)
        fd = os.open(os.path.join(slot, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        return slot, fd
    return None


def release(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _this_gpu() -> tuple[str, tuple[int, int], str, str]:
    import nvfuser_direct
    return (torch.cuda.get_device_name(), torch.cuda.get_device_capability(), str(torch.version.cuda),
            str(getattr(nvfuser_direct, "__version__", "unknown")))


def active() -> str | None:
    """This process's slot folder, or None (the cache is off). Decided once,
    at the first ask (on the GPU, before the first fusion runs): the slot
    claimed, and nvFuser's database opened there (open_database). A failure
    says why on stderr, in one line, and leaves the cache off."""
    if _state["asked"] is None:
        _state["asked"] = True
        root = os.environ.get(CACHE_VAR)
        if root:
            claimed = None
            try:
                if OPTION in os.environ.get("NVFUSER_ENABLE", "").split(","):
                    raise RuntimeError(f"NVFUSER_ENABLE has {OPTION} already: nvFuser's own database, in the "
                                       f"temporary folder, would be the one opened")
                gpu, capability, cuda, version = _this_gpu()
                claimed = claim_slot(cache_folder(root, version, gpu, capability, cuda), prefer=_preferred_slot())
                if claimed is None:
                    raise OSError(f"all {SLOTS} slots are held by other processes")
                open_database(claimed[0])
                _state["slot"], _state["lock"] = claimed   # on only once nvFuser has opened it there
            except Exception as e:   # whatever went wrong, the cache is off, and says so in one line
                if claimed is not None:
                    release(claimed[1])
                line = " ".join(str(e).split())[:300]
                print(f"{CACHE_VAR}={root}: kernel cache off ({type(e).__name__}: {line})", file=sys.stderr)
    return _state["slot"]


def _preferred_slot() -> str | None:
    """The slot this process takes when free: its label (a dtype's check) or its
    local rank, so that a rerun finds the kernels it compiled last time."""
    label = os.environ.get(LABEL_VAR) or (f"rank{os.environ['LOCAL_RANK']}" if "LOCAL_RANK" in os.environ
                                                  else None)
    return re.sub(r"[^A-Za-z0-9_-]+", "-", label) if label else None


def open_database(slot: str) -> None:
    """Make nvFuser open its kernel database in `slot`: it opens it once a
    process, under the temporary folder of that moment, at the first kernel it
    compiles with the option on. So a small fusion (one kernel, cached too)
    runs with it on and TMPDIR naming the slot, which is put back after."""
    import nvfuser_direct as nvf
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = slot
    try:
        with nvf.FusionDefinition() as fd:
            t = fd.define_tensor(shape=[-1], contiguity=True, dtype=nvf.DataType.Float)
            fd.add_output(fd.ops.add(t, t))
        fd.execute([torch.ones(8, device="cuda")], _enable_options=[OPTION])
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before
    if not os.path.isfile(os.path.join(slot, DB_FOLDER, DB_FILE)):
        raise RuntimeError(f"nvFuser did not open its kernel database in {slot} (opened elsewhere before?)")


def options() -> dict:
    """fd.execute's keywords a fusion runs with for the cache: none when it is off."""
    return {"_enable_options": [OPTION]} if active() else {}
