"""Thunder (https://github.com/Lightning-AI/lightning-thunder) as the bench's
peer: `thunder.jit` of the reference block's forward (`sdpa_forward`), with
Thunder's default executors, nvFuser's among them, and with its CUDA-graph
transform (`thunder.transforms.cudagraph.CUDAGraphTransform`).

An optional extra, `pip install -e '.[peers]'` (lightning-thunder 0.2.6).
That version imports `compute_tensor_descriptor` from the legacy `nvfuser`
module (thunder/executors/nvfuserex_impl.py, `compute_contiguity`), which
nvFuser 0.2.36 no longer ships; its `nvfuser_direct` has the function.
`alias_legacy_nvfuser` puts a module named `nvfuser` holding only that name
into `sys.modules` before Thunder is imported, where there is no module
`nvfuser` to import.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types

import torch

from tpfuser.verify.reference import Block, sdpa_forward

# Deferred: thunder (optional, about 3 s to import) and nvfuser_direct, where a peer is built.

THUNDER_IMPLS = {"thunder": False, "thunder-graph": True}   # name: with Thunder's CUDA-graph transform
INSTALL = "pip install -e '.[peers]'"
# What lightning-thunder 0.2.6 imports from the legacy `nvfuser` module where
# nvfuser_direct (0.2.34 or later) is there; tests/test_thunder_peer.py reads
# Thunder's source for the list.
LEGACY_NVFUSER_NAMES = ("compute_tensor_descriptor",)
ALIAS_DOC = ("nvfuser_direct's " + ", ".join(LEGACY_NVFUSER_NAMES) + " under the legacy module's name "
             "(tpfuser/bench/thunder_peer.py)")


def thunder_missing() -> str | None:
    """One line saying how to get Thunder where it is not installed, else None (Thunder not imported)."""
    if importlib.util.find_spec("thunder") is None:
        return f"lightning-thunder is not installed ({INSTALL})"
    return None


def alias_legacy_nvfuser(modules: dict = sys.modules) -> bool:
    """Where there is no module `nvfuser` to import, one in `modules` that
    re-exports LEGACY_NVFUSER_NAMES from nvfuser_direct. True if it was put there."""
    if "nvfuser" in modules or importlib.util.find_spec("nvfuser") is not None:
        return False
    import nvfuser_direct
    alias = types.ModuleType("nvfuser", ALIAS_DOC)
    alias.__spec__ = importlib.machinery.ModuleSpec("nvfuser", None)
    for name in LEGACY_NVFUSER_NAMES:
        setattr(alias, name, getattr(nvfuser_direct, name))
    modules["nvfuser"] = alias
    return True


class BlockForward(torch.nn.Module):
    """The reference block's training forward as a module of the block's own
    parameters (thunder.jit takes a module's parameters as its inputs)."""

    def __init__(self, block: Block, p: float):
        super().__init__()
        self.block, self.p = block, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sdpa_forward(self.block, x, self.p)


def thunder_block(block: Block, p: float, graphs: bool):
    """thunder.jit of the block's forward (BlockForward) with Thunder's default
    executors, and its CUDA-graph transform where `graphs`; its parameters are
    the block's. Refused, in one line, without Thunder, without a GPU, or where
    Thunder's executors do not include nvFuser's."""
    missing = thunder_missing()
    if missing:
        raise RuntimeError(missing)
    if not torch.cuda.is_available():
        raise RuntimeError("Thunder's peers need a CUDA GPU (its nvFuser executor and its CUDA graphs)")
    alias_legacy_nvfuser()
    import thunder
    executors = [ex.name for ex in thunder.get_default_executors()]
    if "nvfuser" not in executors:
        raise RuntimeError(f"Thunder's nvFuser executor is not among its executors ({', '.join(executors)})")
    transforms = []
    if graphs:
        from thunder.transforms.cudagraph import CUDAGraphTransform
        transforms.append(CUDAGraphTransform())
    return thunder.jit(BlockForward(block, p), transforms=transforms)


def thunder_forward(block: Block, p: float, graphs: bool, x: torch.Tensor):
    """A call of thunder_block(block, p, graphs) on x, built at its first call:
    a refusal or a failure to build then fails this implementation alone."""
    built = []

    def call():
        if not built:
            built.append(thunder_block(block, p, graphs))
        return built[0](x)
    return call


def thunder_note() -> str:
    """What the Thunder peers ran with, for the report (call after thunder_block)."""
    import thunder
    aliased = getattr(sys.modules.get("nvfuser"), "__doc__", None) == ALIAS_DOC
    return (f"lightning-thunder {importlib.metadata.version('lightning-thunder')}, executors "
            f"{', '.join(ex.name for ex in thunder.get_default_executors())}"
            + (f"; legacy nvfuser aliased ({', '.join(LEGACY_NVFUSER_NAMES)} from nvfuser_direct)" if aliased else ""))
