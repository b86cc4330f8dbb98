"""What the block's fusions take, by name: the tensors of tensors.py's table
(global shape, dtype, memory order) and the dropout scalars. A pass reads
an input by name (block/pieces.py) and this defines it."""

from __future__ import annotations

import torch
from nvfuser_direct import DataType

from tpfuser.block.form import Form
from tpfuser.block.ops import NV_DTYPE, stride_order
from tpfuser.block.tensors import BY_NAME, MASKS, memory_order
from tpfuser.config import BlockConfig

# The dropouts drawn in the fusions hash (stream key, global position)
# (dropout.py), so that a rank's mask is its slice of the unsharded run's mask.
# The fusions take the key of each stream they draw and, per mask dimension
# some layout splits (batch, heads, and the sequence where sequence
# parallelism splits it), the scalar where the rank's slice begins.
_STARTS = {"b": "start.batch", "h": "start.head", "s": "start.seq"}
MASK_STARTS = {stream: tuple(_STARTS[dim] if dim in ("b", "h") or (dim == "s" and mask.seq_split) else None
                             for dim in mask.dims)
               for stream, mask in MASKS.items()}


def drawn_streams(cfg: BlockConfig) -> list[str]:
    """The dropout streams the fusions draw: the two residual ones, and in fp32
    the attention's (in bf16 flash attention draws its own, from ATen's philox)."""
    if cfg.dropout == 0:
        return []
    return ["resid_attn", "resid_mlp"] + (["attn"] if cfg.torch_dtype == torch.float32 else [])


def rng_input_names(cfg: BlockConfig) -> list[str]:
    """The dropout scalars, in input order: each drawn stream's key, then
    where the rank's slice of each masked tensor begins."""
    streams = drawn_streams(cfg)
    starts = sorted({name for stream in streams for name in MASK_STARTS[stream] if name})
    return [f"key.{stream}" for stream in streams] + starts


_KINDS = {"f32": DataType.Float, "u64": DataType.UInt64, "bool": DataType.Bool}


def declared_order(name: str, cfg: BlockConfig, form: Form) -> tuple[int, ...] | None:
    """The memory order a fusion declares its input `name` in (tensors.memory_order; None:
    its dimensions' own order, as for the dropout scalars; dense unless free_strides)."""
    laid = free_strides(name, form) or (form.flash_layout and name in BY_NAME)
    return memory_order(BY_NAME[name], cfg) if laid else None


def free_strides(name: str, form: Form) -> bool:
    """Whether a fusion declares input `name` with free strides, dense or not, in
    declared_order: q, k, v as views of qkv (forward.split_heads "view"); in
    bf16 in flash attention's order whatever form.flash_layout says (the order
    ATen's flash backward gives their gradients and nvFuser expects them in),
    in fp32 in their own."""
    return form.qkv_split == "view" and name in ("q", "k", "v")


def input_definer(cfg: BlockConfig, form: Form):
    """define_input(fd, name) for block/pieces.py: a tensor of the table at its
    global shape and memory order (laid out as the fusion that writes it
    does), or a dropout scalar (a key: a 0-d int64 CUDA tensor with
    form.keys_on_device)."""
    def define_input(fd, name: str):
        if name.startswith("key."):
            if form.keys_on_device:
                return fd.define_tensor(shape=[], contiguity=True, dtype=DataType.Int)
            return fd.define_scalar(dtype=DataType.Int)
        if name.startswith("start."):
            return fd.define_scalar(dtype=DataType.Int)
        t = BY_NAME[name]
        dtype = NV_DTYPE[cfg.torch_dtype] if t.dtype == "block" else _KINDS[t.dtype]
        shape = list(t.shape(cfg))   # an extent of 1 is a Broadcast, whose contiguity nvFuser wants None
        contiguity = [None if n == 1 else False for n in shape] if free_strides(name, form) else True
        return fd.define_tensor(shape=shape, contiguity=contiguity, dtype=dtype,
                                stride_order=stride_order(declared_order(name, cfg, form)))
    return define_input
