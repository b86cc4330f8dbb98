"""The block forward as an nvFuser fusion, and the schedule that shards it.

This is the one module that imports nvfuser_direct. `define_forward` writes
the block on global (unsharded) shapes; `schedule` applies the dp x tp mesh
from plan.PLACEMENTS; nvFuser propagates the sharding to the intermediates and
inserts the collectives.

The c_attn weight the fusion takes has its rows ordered head by head
([h, 3, d] rather than nanoGPT's [3, h, d]; see shard.qkv_heads_interleaved),
so that splitting its rows over tp gives each rank whole heads of q, k and v.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field

import torch

SINGLE_PROCESS_MARK = "TPFUSER_SINGLE_PROCESS"


def _single_process_defaults() -> None:
    """Outside torchrun/mpirun, describe a world of one so that nvFuser's
    Communicator comes up and a 1x1 mesh runs through the same code path.
    Without a CUDA device the Communicator cannot start at all: leave it be."""
    if not torch.cuda.is_available():
        return
    if any(v in os.environ for v in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")) or SINGLE_PROCESS_MARK in os.environ:
        return
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("NVFUSER_MASTER_ADDR", "localhost")
    if "NVFUSER_MASTER_PORT" not in os.environ:
        with socket.socket() as s:  # a free port, so that concurrent runs do not collide
            s.bind(("localhost", 0))
            os.environ["NVFUSER_MASTER_PORT"] = str(s.getsockname()[1])
    os.environ[SINGLE_PROCESS_MARK] = "1"


_single_process_defaults()

import nvfuser_direct as nvf  # noqa: E402
from nvfuser_direct import DataType, FusionDefinition, ParallelType  # noqa: E402

from tpfuser.config import BlockConfig, Layout
from tpfuser.plan import DP, TP, PLACEMENTS
from tpfuser.reference import LN_EPS, PARAM_NAMES, param_shapes

_NV_DTYPE = {torch.bfloat16: DataType.BFloat16, torch.float32: DataType.Float}
_MESH_AXIS = {DP: ParallelType.mesh_y, TP: ParallelType.mesh_x}

# Each dropout draws from its own philox stream: rng_offset + this number.
RNG_STREAMS = {"resid_attn": 0, "resid_mlp": 1, "attn": 2}


@dataclass
class ForwardFusion:
    """A defined (and possibly scheduled) forward fusion with its named TensorViews."""

    fd: FusionDefinition
    cfg: BlockConfig
    check: bool
    inputs: dict = field(default_factory=dict)    # name -> TensorView (x, params)
    outputs: dict = field(default_factory=dict)   # name -> TensorView, in output order
    has_rng: bool = False                          # takes (rng_seed, rng_offset) after the tensors


def _layer_norm(fd, x, weight, bias, b, s, e):
    """x: float [b, s, e]; weight, bias: [e] of any float dtype."""
    var, mean = fd.ops.var_mean(x, dims=[2], correction=0, keepdim=False)
    rstd = fd.ops.rsqrt(fd.ops.add(fd.ops.broadcast_in_dim(var, shape=[b, s, 1], broadcast_dims=[0, 1]),
                                   fd.define_scalar(LN_EPS, dtype=DataType.Double)))
    mean = fd.ops.broadcast_in_dim(mean, shape=[b, s, 1], broadcast_dims=[0, 1])
    normed = fd.ops.mul(fd.ops.sub(x, mean), rstd)
    weight = fd.ops.broadcast_in_dim(fd.ops.cast(weight, DataType.Float), shape=[b, s, e], broadcast_dims=[2])
    bias = fd.ops.broadcast_in_dim(fd.ops.cast(bias, DataType.Float), shape=[b, s, e], broadcast_dims=[2])
    return fd.ops.add(fd.ops.mul(normed, weight), bias)


def _gelu_tanh(fd, x):
    inner = fd.ops.add(x, fd.ops.mul(fd.ops.mul(fd.ops.mul(x, x), x), 0.044715))
    return fd.ops.mul(fd.ops.mul(x, 0.5),
                      fd.ops.add(fd.ops.tanh(fd.ops.mul(inner, math.sqrt(2.0 / math.pi))), 1.0))


def _keep_mask(fd, shape, p, rng_seed, rng_offset, stream):
    """Bernoulli(1 - p) keep-mask from philox(rng_seed, rng_offset + stream)."""
    offset = fd.ops.add(rng_offset, fd.define_scalar(RNG_STREAMS[stream], dtype=DataType.Int))
    u = fd.ops.uniform(fd.define_scalar(0.0, dtype=DataType.Double), fd.define_scalar(1.0, dtype=DataType.Double),
                       shape=shape, rng_seed=rng_seed, rng_offset=offset, dtype=DataType.Float)
    return fd.ops.lt(u, fd.define_scalar(1.0 - p, dtype=DataType.Double))


def _dropout(fd, x, keep, p):
    return fd.ops.mul(fd.ops.mul(x, fd.ops.cast(keep, DataType.Float)), 1.0 / (1.0 - p))


def _causal_attention(fd, q, k, v, cfg, p, rng, outputs):
    """softmax(q k^T / sqrt(d) + causal) v, written out for dtypes flash
    attention lacks (fp32). q, k, v: float [b, h, s, d]."""
    b, h, s, d = cfg.batch, cfg.n_head, cfg.seq, cfg.head_dim
    scores = fd.ops.mul(fd.ops.matmul(q, fd.ops.permute(k, dims=[0, 1, 3, 2])), 1.0 / math.sqrt(d))  # (b, h, s, s)
    row = fd.ops.broadcast_in_dim(fd.ops.iota(s, dtype=DataType.Int), shape=[s, s], broadcast_dims=[0])
    col = fd.ops.broadcast_in_dim(fd.ops.iota(s, dtype=DataType.Int), shape=[s, s], broadcast_dims=[1])
    future = fd.ops.broadcast_in_dim(fd.ops.gt(col, row), shape=[b, h, s, s], broadcast_dims=[2, 3])
    scores = fd.ops.where(future, fd.define_scalar(float("-inf"), dtype=DataType.Double), scores)
    row_max = fd.ops.broadcast_in_dim(fd.ops.max(scores, dims=[3], keepdim=False), shape=[b, h, s, 1], broadcast_dims=[0, 1, 2])
    unnorm = fd.ops.exp(fd.ops.sub(scores, row_max))
    denom = fd.ops.broadcast_in_dim(fd.ops.sum(unnorm, dims=[3], keepdim=False), shape=[b, h, s, 1], broadcast_dims=[0, 1, 2])
    probs = fd.ops.div(unnorm, denom)
    if p > 0:
        keep = _keep_mask(fd, [b, h, s, s], p, *rng, "attn")
        outputs["attn_keep"] = keep
        probs = _dropout(fd, probs, keep, p)
    return fd.ops.matmul(probs, v)  # (b, h, s, d)


def define_forward(fd: FusionDefinition, cfg: BlockConfig, check: bool = False) -> ForwardFusion:
    """Define the block forward on global shapes inside `fd` (not yet sharded).

    Inputs: x [b, s, e], then the parameters in PARAM_NAMES order, then, when
    cfg.dropout > 0, the scalars rng_seed and rng_offset. Outputs: out [b, s, e];
    with check=True also the keep-masks of every dropout drawn in the fusion.
    """
    b, s, e, h, d = cfg.batch, cfg.seq, cfg.n_embd, cfg.n_head, cfg.head_dim
    dtype, p = _NV_DTYPE[cfg.torch_dtype], cfg.dropout
    ff = ForwardFusion(fd, cfg, check, has_rng=p > 0)

    ff.inputs["x"] = fd.define_tensor(shape=[b, s, e], contiguity=True, dtype=dtype)
    shapes = param_shapes(cfg)
    for name in PARAM_NAMES:
        ff.inputs[name] = fd.define_tensor(shape=list(shapes[name]), contiguity=True, dtype=dtype)
    w = ff.inputs
    rng = (fd.define_scalar(dtype=DataType.Int), fd.define_scalar(dtype=DataType.Int)) if p > 0 else None
    masks = {}

    x = fd.ops.cast(w["x"], DataType.Float)
    ln_1 = fd.ops.cast(_layer_norm(fd, x, w["ln_1.weight"], w["ln_1.bias"], b, s, e), dtype)
    qkv = fd.ops.linear(ln_1, w["attn.c_attn.weight"], w["attn.c_attn.bias"])  # (b, s, 3e), heads outermost
    qkv = fd.ops.reshape(qkv, new_shape=[b, s, h, 3 * d])                      # (b, s, h, 3d)
    q, k, v = (fd.ops.permute(fd.ops.slice(qkv, start_indices=[0, 0, 0, i * d], end_indices=[b, s, h, (i + 1) * d]),
                              dims=[0, 2, 1, 3])                               # (b, h, s, d)
               for i in range(3))
    if cfg.torch_dtype == torch.bfloat16:
        # Flash attention; its dropout on the probabilities draws from ATen's
        # CUDA generator (replayable with torch.cuda.get/set_rng_state).
        y, _lse, _seed, _offset = fd.ops.sdpfa_fwd(
            q, k, v, dropout_p=fd.define_scalar(p, dtype=DataType.Double),
            is_causal=fd.define_scalar(True, dtype=DataType.Bool), scale=None)
    else:
        y = _causal_attention(fd, q, k, v, cfg, p, rng, masks)
    y = fd.ops.reshape(fd.ops.permute(y, dims=[0, 2, 1, 3]), new_shape=[b, s, e])  # (b, s, e)
    # Row-parallel projection: the matmul's partial sums are reduced over tp
    # before the (replicated) bias is added, so the bias counts once.
    attn_out = fd.ops.add(fd.ops.cast(fd.ops.linear(y, w["attn.c_proj.weight"]), DataType.Float),
                          fd.ops.cast(w["attn.c_proj.bias"], DataType.Float))
    if p > 0:
        masks["resid_attn_keep"] = _keep_mask(fd, [b, s, e], p, *rng, "resid_attn")
        attn_out = _dropout(fd, attn_out, masks["resid_attn_keep"], p)
    x = fd.ops.add(x, attn_out)

    ln_2 = fd.ops.cast(_layer_norm(fd, x, w["ln_2.weight"], w["ln_2.bias"], b, s, e), dtype)
    mlp_hidden = fd.ops.linear(ln_2, w["mlp.c_fc.weight"], w["mlp.c_fc.bias"])  # (b, s, 4e)
    mlp_hidden = fd.ops.cast(_gelu_tanh(fd, fd.ops.cast(mlp_hidden, DataType.Float)), dtype)
    mlp_out = fd.ops.add(fd.ops.cast(fd.ops.linear(mlp_hidden, w["mlp.c_proj.weight"]), DataType.Float),
                         fd.ops.cast(w["mlp.c_proj.bias"], DataType.Float))
    if p > 0:
        masks["resid_mlp_keep"] = _keep_mask(fd, [b, s, e], p, *rng, "resid_mlp")
        mlp_out = _dropout(fd, mlp_out, masks["resid_mlp_keep"], p)
    out = fd.ops.cast(fd.ops.add(x, mlp_out), dtype)

    ff.outputs["out"] = out
    if check:
        for name in ("attn_keep", "resid_attn_keep", "resid_mlp_keep"):
            if name in masks:
                ff.outputs[name] = masks[name]
    for tv in ff.outputs.values():
        fd.add_output(tv)
    return ff


def make_mesh(layout: Layout):
    return nvf.multidevice.DeviceMesh(torch.arange(layout.world_size).reshape(layout.dp, layout.tp))


def _apply_placement(tv, placement, layout):
    sizes = {DP: layout.dp, TP: layout.tp}
    # Split the highest dimension first so that lower indices stay valid.
    for dim in sorted(placement, reverse=True):
        tv.outer_split(dim, sizes[placement[dim]])
        tv.axis(dim).parallelize(_MESH_AXIS[placement[dim]])


def schedule(ff: ForwardFusion, layout: Layout) -> None:
    """Put every input and output on the dp x tp mesh and split it as plan.PLACEMENTS says.

    Must run inside the `with FusionDefinition()` block, after define_forward.
    """
    mesh = make_mesh(layout)
    for name, tv in list(ff.inputs.items()) + list(ff.outputs.items()):
        tv.set_device_mesh(mesh)
        _apply_placement(tv, PLACEMENTS[name], layout)


def build_forward(cfg: BlockConfig, layout: Layout | None = None, check: bool = False) -> ForwardFusion:
    """Define the forward and, when a layout is given, shard it on its mesh."""
    with FusionDefinition() as fd:
        ff = define_forward(fd, cfg, check)
        if layout is not None:
            layout.check(cfg)
            schedule(ff, layout)
    return ff


def fusion_text(ff: ForwardFusion) -> str:
    """The fusion's math, as nvFuser prints it (no GPU needed)."""
    return ff.fd.fusion.print_math()


def communicator():
    """nvFuser's process-wide Communicator (reads torchrun's or mpirun's variables)."""
    return nvf.multidevice.Communicator.instance()


def loop_sharding(tv) -> tuple[str, list[tuple[str, int]]]:
    """(device mesh, [(parallel type, extent), ...] of the loop domain) of a TensorView,
    read from its IterDomains: 'mesh_x' / 'mesh_y' for device-parallel axes, '' otherwise."""
    axes = []
    for axis in tv.get_loop_domain():
        text = str(axis)  # e.g. 'ideviceIdx.y388{2}' or 'iS389{2}'
        extent = int(text[text.rindex("{") + 1:text.rindex("}")])
        kind = "mesh_x" if "deviceIdx.x" in text else "mesh_y" if "deviceIdx.y" in text else ""
        axes.append((kind, extent))
    text = str(tv)
    mesh = text[text.index("DeviceMesh"):text.rindex(")")] if "DeviceMesh" in text else ""
    return mesh, axes
