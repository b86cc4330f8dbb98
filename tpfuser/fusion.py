"""The block's forward and backward as nvFuser fusions, and the schedule that shards them.

This is the one module that imports nvfuser_direct. `define_forward` and
`define_backward` write the block on global (unsharded) shapes; `schedule`
applies the dp x tp mesh from plan.placements; nvFuser propagates the sharding
to the intermediates and inserts the collectives.

The c_attn weight the fusion takes has its rows ordered head by head
([h, 3, d] rather than nanoGPT's [3, h, d]; see shard.qkv_heads_interleaved),
so that splitting its rows over tp gives each rank whole heads of q, k and v.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

import nvfuser_direct as nvf
from nvfuser_direct import DataType, FusionDefinition, ParallelType

from tpfuser.config import BlockConfig, Layout
from tpfuser.dropout import hash_positions, keep_threshold
from tpfuser.plan import DP, TP, axis_sizes, placements, saved_specs
from tpfuser.reference import LN_EPS, PARAM_NAMES, param_shapes
from tpfuser.tensors import BY_NAME, MASKS, memory_order

_NV_DTYPE = {torch.bfloat16: DataType.BFloat16, torch.float32: DataType.Float}

# How q, k and v leave qkv, and their gradients return to it: an experiment
# for one head per rank, which nvFuser 0.2.36 fails in the default form
# (NOTES-history.md; tools/repro_one_head.py probes each form on its own).
#   slice   slices of the (b, s, h, 3d) view, each through a kernel (the
#           multiplication by one); the gradient by cat. Run 9's form: the
#           default, every mesh but one head per rank checked with it.
#   select  select on the 3-axis of the (b, s, h, 3, d) view (a kernel, not a
#           view); the gradient by cat.
#   onehot  sums over that 3-axis times a one-hot made from iota; the gradient
#           the sum of the three broadcast on it times their one-hots
#           (pointwise: neither a view nor a cat). Exact for finite values.
# Set with TPFUSER_QKV_SPLIT before tpfuser is imported; a report records it.
QKV_SPLITS = ("slice", "select", "onehot")
QKV_SPLIT = os.environ.get("TPFUSER_QKV_SPLIT", "slice")
if QKV_SPLIT not in QKV_SPLITS:
    raise ValueError(f"TPFUSER_QKV_SPLIT={QKV_SPLIT!r}: expected one of {', '.join(QKV_SPLITS)}")
_MESH_AXIS = {DP: ParallelType.mesh_y, TP: ParallelType.mesh_x}

# The dropouts drawn in the fusion hash (stream key, global position) (dropout.py),
# so that a rank's mask is its slice of the unsharded run's mask. The fusion
# takes, after the tensors, the key of each stream it draws and where the
# rank's slice begins (rng_input_names).
# Per mask's dimension, the scalar input where the rank's slice begins, for
# the dimensions some layout splits (tensors.py): batch, heads, and the
# sequence where sequence parallelism splits it. resid: [b, s, e]; attn: [b, h, s, s].
_STARTS = {"b": "start.batch", "h": "start.head", "s": "start.seq"}
MASK_STARTS = {stream: tuple(_STARTS[dim] if dim in ("b", "h") or (dim == "s" and mask.seq_split) else None
                             for dim in mask.dims)
               for stream, mask in MASKS.items()}


@dataclass
class ForwardFusion:
    """A defined (and possibly scheduled) forward fusion with its named TensorViews."""

    fd: FusionDefinition
    cfg: BlockConfig
    check: bool
    inputs: dict = field(default_factory=dict)    # name -> TensorView (x, params)
    outputs: dict = field(default_factory=dict)   # name -> TensorView, in output order
    has_rng: bool = False   # takes the scalars rng_input_names(cfg) after the tensors
    device_keys: dict = field(default_factory=dict)   # key.<stream> -> 0-d TensorView (keys_on_device)


# The LayerNorm helpers work on rows of hidden vectors: `bse` is their shape [b, s, e].

def _bcast_rows(fd, t, bse):
    """[b, s] -> [b, s, e]"""
    return fd.ops.broadcast_in_dim(t, shape=bse, broadcast_dims=[0, 1])


def _normalize(fd, x, mean, rstd, bse):
    """(x - mean) * rstd; x float [b, s, e], mean and rstd [b, s]."""
    return fd.ops.mul(fd.ops.sub(x, _bcast_rows(fd, mean, bse)), _bcast_rows(fd, rstd, bse))


def _affine(fd, xhat, weight, bias, bse):
    weight = fd.ops.broadcast_in_dim(fd.ops.cast(weight, DataType.Float), shape=bse, broadcast_dims=[2])
    bias = fd.ops.broadcast_in_dim(fd.ops.cast(bias, DataType.Float), shape=bse, broadcast_dims=[2])
    return fd.ops.add(fd.ops.mul(xhat, weight), bias)


def _layer_norm(fd, x, weight, bias, bse):
    """x: float [b, s, e]; weight, bias: [e] of any float dtype. Returns (y, mean, rstd), stats [b, s]."""
    var, mean = fd.ops.var_mean(x, dims=[2], correction=0, keepdim=False)
    rstd = fd.ops.rsqrt(fd.ops.add(var, fd.define_scalar(LN_EPS, dtype=DataType.Double)))
    return _affine(fd, _normalize(fd, x, mean, rstd, bse), weight, bias, bse), mean, rstd


def _gelu_tanh(fd, x):
    inner = fd.ops.add(x, fd.ops.mul(fd.ops.mul(fd.ops.mul(x, x), x), 0.044715))
    return fd.ops.mul(fd.ops.mul(x, 0.5),
                      fd.ops.add(fd.ops.tanh(fd.ops.mul(inner, math.sqrt(2.0 / math.pi))), 1.0))


def rng_input_names(cfg: BlockConfig) -> list[str]:
    """The fusion's dropout scalars, in input order: the key of each stream the
    fusion draws, then where the rank's slice of each masked tensor begins. In
    bf16 the attention dropout lives inside flash attention (ATen's own philox),
    so the fusion draws only the two residual masks."""
    if cfg.dropout == 0:
        return []
    streams = ["resid_attn", "resid_mlp"] + (["attn"] if cfg.torch_dtype == torch.float32 else [])
    starts = sorted({name for stream in streams for name in MASK_STARTS[stream] if name})
    return [f"key.{stream}" for stream in streams] + starts


def _rng_scalars(fd, cfg, keys_on_device=False):
    """The dropout inputs. With keys_on_device the stream keys are 0-d int64
    CUDA tensors, read by the kernels at run time, so that a CUDA graph
    replays new masks after new keys are written into them (graphs.py); the
    slice starts, fixed for a rank, stay host scalars."""
    def define(name):
        if keys_on_device and name.startswith("key."):
            return fd.define_tensor(shape=[], contiguity=True, dtype=DataType.Int)
        return fd.define_scalar(dtype=DataType.Int)
    return {name: define(name) for name in rng_input_names(cfg)} or None


def _int_ops(fd) -> SimpleNamespace:
    """dropout.py's integer operations on nvFuser values."""
    return SimpleNamespace(xor=fd.ops.bitwise_xor, band=fd.ops.bitwise_and, shr=fd.ops.bitwise_right_shift,
                           shl=fd.ops.bitwise_left_shift, add=fd.ops.add, mul=fd.ops.mul)


def _global_positions(fd, shape, starts):
    """int64 index in the global tensor of `shape` of every element; `starts`:
    per dimension, the scalar where this rank's slice begins, or None (not split).
    nvFuser indexes a rank's kernel locally (device-parallel loops have index 0),
    so the starts come in as inputs: iota(n, start) is the global coordinate."""
    index, stride = None, 1
    for dim in reversed(range(len(shape))):
        start = starts[dim] if starts[dim] is not None else fd.define_scalar(0, dtype=DataType.Int)
        coord = fd.ops.iota(fd.define_scalar(shape[dim], dtype=DataType.Int), start,
                            fd.define_scalar(1, dtype=DataType.Int), dtype=DataType.Int)
        term = fd.ops.broadcast_in_dim(fd.ops.mul(coord, stride), shape=list(shape), broadcast_dims=[dim])
        index = term if index is None else fd.ops.add(index, term)
        stride *= shape[dim]
    return index


def _keep_mask(fd, shape, p, rng, stream):
    """Bernoulli(1 - p) keep-mask: hash(stream key, global position) < (1 - p) 2**32."""
    starts = [rng[name] if name else None for name in MASK_STARTS[stream]]
    hashed = hash_positions(_global_positions(fd, shape, starts), rng[f"key.{stream}"], _int_ops(fd))
    return fd.ops.lt(hashed, fd.define_scalar(keep_threshold(p), dtype=DataType.Int))


def _dropout(fd, x, keep, p):
    return fd.ops.mul(fd.ops.mul(x, fd.ops.cast(keep, DataType.Float)), 1.0 / (1.0 - p))


def _causal_probs(fd, q, k, cfg):
    """softmax(q k^T / sqrt(d) + causal mask); q, k float [b, h, s, d] -> [b, h, s, s]."""
    b, h, s, d = cfg.batch, cfg.n_head, cfg.seq, cfg.head_dim
    scores = fd.ops.mul(fd.ops.matmul(q, fd.ops.permute(k, dims=[0, 1, 3, 2])), 1.0 / math.sqrt(d))  # (b, h, s, s)
    row = fd.ops.broadcast_in_dim(fd.ops.iota(s, dtype=DataType.Int), shape=[s, s], broadcast_dims=[0])
    col = fd.ops.broadcast_in_dim(fd.ops.iota(s, dtype=DataType.Int), shape=[s, s], broadcast_dims=[1])
    future = fd.ops.broadcast_in_dim(fd.ops.gt(col, row), shape=[b, h, s, s], broadcast_dims=[2, 3])
    scores = fd.ops.where(future, fd.define_scalar(float("-inf"), dtype=DataType.Double), scores)
    row_max = fd.ops.broadcast_in_dim(fd.ops.max(scores, dims=[3], keepdim=False), shape=[b, h, s, 1], broadcast_dims=[0, 1, 2])
    unnorm = fd.ops.exp(fd.ops.sub(scores, row_max))
    denom = fd.ops.broadcast_in_dim(fd.ops.sum(unnorm, dims=[3], keepdim=False), shape=[b, h, s, 1], broadcast_dims=[0, 1, 2])
    return fd.ops.div(unnorm, denom)


def _dropped_probs(fd, q, k, cfg, p, keep):
    """(probs, probs after dropout) of the written-out attention; keep=None: no dropout."""
    probs = _causal_probs(fd, q, k, cfg)
    return probs, (probs if keep is None else _dropout(fd, probs, keep, p))


def _causal_attention(fd, q, k, v, cfg, p, rng, outputs):
    """softmax(q k^T / sqrt(d) + causal) v, written out for dtypes flash
    attention lacks (fp32). q, k, v: float [b, h, s, d]."""
    keep = None
    if p > 0:
        keep = outputs["attn_keep"] = _keep_mask(fd, [cfg.batch, cfg.n_head, cfg.seq, cfg.seq], p, rng, "attn")
    _, dropped = _dropped_probs(fd, q, k, cfg, p, keep)
    return fd.ops.matmul(dropped, v)  # (b, h, s, d)


def saved_names(cfg: BlockConfig) -> list[str]:
    """What the training forward saves for backward, in order (plan.saved_specs)."""
    return list(saved_specs(cfg))


def _one_hot_3(fd, i: int, rank: int, axis: int):
    """A float tensor of `rank` dimensions, 3 long on `axis` and 1 elsewhere: 1 at i."""
    hot = fd.ops.cast(fd.ops.eq(fd.ops.iota(fd.define_scalar(3, dtype=DataType.Int)), i), DataType.Float)
    return fd.ops.broadcast_in_dim(hot, shape=[3 if a == axis else 1 for a in range(rank)], broadcast_dims=[axis])


def _split_heads(fd, qkv, cfg):
    """(b, s, 3e) with rows ordered [h, 3, d] -> q, k, v each (b, h, s, d), each
    written by a kernel and saved for the backward, which then slices nothing
    (QKV_SPLIT says how). The default's multiplication by one was meant to spare
    nvFuser 0.2.36 the strided views it misreads with one head per rank; it does
    not (nvFuser still makes each slice a view first: run 9, NOTES-history.md)."""
    b, s, h, d = cfg.batch, cfg.seq, cfg.n_head, cfg.head_dim
    dtype = _NV_DTYPE[cfg.torch_dtype]
    if QKV_SPLIT == "slice":
        # Reshape before slicing, so that the tp split (on heads) is not sliced.
        qkv = fd.ops.reshape(qkv, new_shape=[b, s, h, 3 * d])  # (b, s, h, 3d)
    else:
        qkv = fd.ops.reshape(qkv, new_shape=[b, s, h, 3, d])   # (b, s, h, 3, d)

    def part(i):
        if QKV_SPLIT == "slice":
            t = fd.ops.slice(qkv, start_indices=[0, 0, 0, i * d], end_indices=[b, s, h, (i + 1) * d])   # (b, s, h, d)
            t = fd.ops.cast(fd.ops.mul(fd.ops.cast(t, DataType.Float), 1.0), dtype)
        elif QKV_SPLIT == "select":
            t = fd.ops.select(qkv, fd.define_scalar(i, dtype=DataType.Int), dim=3)
        else:
            t = fd.ops.sum(fd.ops.mul(fd.ops.cast(qkv, DataType.Float), _one_hot_3(fd, i, 5, 3)), dims=[3])
            t = fd.ops.cast(t, dtype)
        return fd.ops.permute(t, dims=[0, 2, 1, 3])   # (b, h, s, d)
    return tuple(part(i) for i in range(3))


def _join_heads_grad(fd, g_q, g_k, g_v, cfg):
    """The gradient of qkv, (b, s, 3e) in the block's dtype with rows [h, 3, d],
    from those of q, k and v, each (b, h, s, d) (QKV_SPLIT says how)."""
    b, s, e, h, d = cfg.batch, cfg.seq, cfg.n_embd, cfg.n_head, cfg.head_dim
    parts = [fd.ops.permute(t, dims=[0, 2, 1, 3]) for t in (g_q, g_k, g_v)]   # (b, s, h, d)
    if QKV_SPLIT == "onehot":
        spread = [fd.ops.mul(fd.ops.broadcast_in_dim(fd.ops.cast(t, DataType.Float), shape=[b, s, h, 3, d],
                                                     broadcast_dims=[0, 1, 2, 4]), _one_hot_3(fd, i, 5, 3))
                  for i, t in enumerate(parts)]
        g_qkv = fd.ops.add(fd.ops.add(spread[0], spread[1]), spread[2])
        return fd.ops.cast(fd.ops.reshape(g_qkv, new_shape=[b, s, 3 * e]), _NV_DTYPE[cfg.torch_dtype])
    # cat before the reshape, so that the concatenation is not along the
    # tp-split dimension (heads)
    return fd.ops.reshape(fd.ops.cat(parts, dim=3, manual_padding=0), new_shape=[b, s, 3 * e])


def _row_parallel_out(fd, h, w, linear: str, p: float, rng, masks: dict, stream: str, bse: list):
    """A row-parallel linear's output in fp32, through its residual dropout
    (mask `<stream>_keep`). The matmul's partial sums are reduced over tp before
    the (replicated) bias is added, so the bias counts once."""
    out = fd.ops.add(fd.ops.cast(fd.ops.linear(h, w[f"{linear}.weight"]), DataType.Float),
                     fd.ops.cast(w[f"{linear}.bias"], DataType.Float))
    if p > 0:
        masks[f"{stream}_keep"] = _keep_mask(fd, bse, p, rng, stream)
        out = _dropout(fd, out, masks[f"{stream}_keep"], p)
    return out


def _lay_out(tv, order: tuple[int, ...] | None) -> None:
    """Have nvFuser allocate tv with its logical dimensions in `order` in
    memory (tensors.memory_order); None leaves it to nvFuser."""
    if order is not None:
        logical = tv.get_logical_domain()
        tv.set_allocation_domain([logical[i] for i in order], True)


def _stride_order(order: tuple[int, ...] | None) -> list[int]:
    """define_tensor's stride_order for a memory order: per dimension, its rank
    among the strides, 0 the innermost; [] for the logical order."""
    if order is None:
        return []
    ranks = [0] * len(order)
    for position, dim in enumerate(order):
        ranks[dim] = len(order) - 1 - position
    return ranks


def define_forward(fd: FusionDefinition, cfg: BlockConfig, check: bool = False, train: bool = False,
                   keys_on_device: bool = False) -> ForwardFusion:
    """Define the block forward on global shapes inside `fd` (not yet sharded).

    Inputs: x [b, s, e], then the parameters in PARAM_NAMES order, then, when
    cfg.dropout > 0, the dropout scalars (rng_input_names; the keys 0-d int64
    CUDA tensors with keys_on_device). Outputs: out [b, s, e];
    with check=True also the keep-masks of every dropout drawn in the fusion;
    with train=True also what the backward needs (saved_names).
    """
    b, s, e = cfg.batch, cfg.seq, cfg.n_embd
    dtype, p = _NV_DTYPE[cfg.torch_dtype], cfg.dropout
    ff = ForwardFusion(fd, cfg, check, has_rng=p > 0)

    ff.inputs["x"] = fd.define_tensor(shape=[b, s, e], contiguity=True, dtype=dtype)
    shapes = param_shapes(cfg)
    for name in PARAM_NAMES:
        ff.inputs[name] = fd.define_tensor(shape=list(shapes[name]), contiguity=True, dtype=dtype)
    w = ff.inputs
    rng = _rng_scalars(fd, cfg, keys_on_device)
    if keys_on_device:
        ff.device_keys = {name: tv for name, tv in (rng or {}).items() if name.startswith("key.")}
    masks, saved = {}, {}

    x = fd.ops.cast(w["x"], DataType.Float)
    ln_1, saved["ln_1.mean"], saved["ln_1.rstd"] = _layer_norm(fd, x, w["ln_1.weight"], w["ln_1.bias"], [b, s, e])
    ln_1 = fd.ops.cast(ln_1, dtype)
    qkv = fd.ops.linear(ln_1, w["attn.c_attn.weight"], w["attn.c_attn.bias"])  # (b, s, 3e), heads outermost
    q, k, v = saved["q"], saved["k"], saved["v"] = _split_heads(fd, qkv, cfg)
    if cfg.torch_dtype == torch.bfloat16:
        # Flash attention; its dropout on the probabilities draws from ATen's
        # CUDA generator (replayable with torch.cuda.get/set_rng_state).
        y, saved["sdpa_lse"], saved["sdpa_seed"], saved["sdpa_offset"] = fd.ops.sdpfa_fwd(
            q, k, v, dropout_p=fd.define_scalar(p, dtype=DataType.Double),
            is_causal=fd.define_scalar(True, dtype=DataType.Bool), scale=None)
        saved["sdpa_out"] = y
        for name, tv in saved.items():   # as the table says: q, k, v and y as flash attention holds them
            _lay_out(tv, memory_order(BY_NAME[name], cfg))
    else:
        y = _causal_attention(fd, q, k, v, cfg, p, rng, masks)
    y = fd.ops.reshape(fd.ops.permute(y, dims=[0, 2, 1, 3]), new_shape=[b, s, e])  # (b, s, e)
    x = saved["x1"] = fd.ops.add(x, _row_parallel_out(fd, y, w, "attn.c_proj", p, rng, masks, "resid_attn", [b, s, e]))

    ln_2, saved["ln_2.mean"], saved["ln_2.rstd"] = _layer_norm(fd, x, w["ln_2.weight"], w["ln_2.bias"], [b, s, e])
    ln_2 = fd.ops.cast(ln_2, dtype)
    mlp_hidden = saved["mlp_h"] = fd.ops.linear(ln_2, w["mlp.c_fc.weight"], w["mlp.c_fc.bias"])  # (b, s, 4e)
    mlp_hidden = fd.ops.cast(_gelu_tanh(fd, fd.ops.cast(mlp_hidden, DataType.Float)), dtype)
    mlp_out = _row_parallel_out(fd, mlp_hidden, w, "mlp.c_proj", p, rng, masks, "resid_mlp", [b, s, e])
    out = fd.ops.cast(fd.ops.add(x, mlp_out), dtype)

    ff.outputs["out"] = out
    if check:
        for name in ("attn_keep", "resid_attn_keep", "resid_mlp_keep"):
            if name in masks:
                ff.outputs[name] = masks[name]
    if train:   # the masks are saved too: with check=True they are output once
        saved |= masks
        for name in saved_names(cfg):
            ff.outputs.setdefault(name, saved[name])
    for tv in ff.outputs.values():
        fd.add_output(tv)
    return ff


def make_mesh(layout: Layout, row: int | None = None):
    """The dp x tp mesh; with `row`, that dp rank's 1-D mesh of tp devices."""
    if row is not None:
        return nvf.multidevice.DeviceMesh(torch.arange(row * layout.tp, (row + 1) * layout.tp))
    return nvf.multidevice.DeviceMesh(torch.arange(layout.world_size).reshape(layout.dp, layout.tp))


def _apply_placement(tv, placement, layout, split_unit_axes: bool = False):
    sizes = axis_sizes(layout)
    # Split the highest dimension first so that lower indices stay valid.
    for dim in sorted(placement, reverse=True):
        if sizes[placement[dim]] == 1 and not split_unit_axes:
            continue
        tv.outer_split(dim, sizes[placement[dim]])
        tv.axis(dim).parallelize(_MESH_AXIS[placement[dim]])


def schedule(ff, layout: Layout, row: int | None = None, split_unit_axes: bool = False) -> None:
    """Put every input (and output, and the backward's planned intermediates) on the
    dp x tp mesh and split it as plan.placements(layout) says.

    With `row`, on that dp rank's tp devices alone (a 1-D mesh), the dp splits left out.
    A mesh axis of one device is not split over (split_unit_axes=True splits
    over it too): the tensor is the same, but nvFuser 0.2.36 posts no
    collective over a team of one then, where with the splits it posts the
    row-parallel all-reduces through NCCL even at 1x1 (NOTES.md, runs 26-30:
    20 kernels a forward against 18, and bf16 graph replays that can differ
    from the call). split_unit_axes=True was the default until run 30.
    Must run inside the `with FusionDefinition()` block, after define_forward or define_backward.
    """
    mesh = make_mesh(layout, row)
    where = placements(layout)
    flat = row is not None
    named = [*ff.inputs.items(), *ff.outputs.items(), *getattr(ff, "intermediates", {}).items()]
    for tv in getattr(ff, "device_keys", {}).values():   # replicated: every rank reads the same keys
        tv.set_device_mesh(mesh)
    for name, tv in named:
        tv.set_device_mesh(mesh)
        placement = where[name]
        if flat:
            placement = {dim: axis for dim, axis in placement.items() if axis != DP}
        _apply_placement(tv, placement, layout, split_unit_axes)


def build_forward(cfg: BlockConfig, layout: Layout | None = None, check: bool = False,
                  train: bool = False, keys_on_device: bool = False, split_unit_axes: bool = False) -> ForwardFusion:
    """Define the forward and, when a layout is given, shard it on its mesh (schedule)."""
    with FusionDefinition() as fd:
        ff = define_forward(fd, cfg, check, train, keys_on_device)
        if layout is not None:
            layout.check(cfg)
            schedule(ff, layout, split_unit_axes=split_unit_axes)
    return ff


def fusion_text(ff: ForwardFusion) -> str:
    """The fusion's math, as nvFuser prints it (no GPU needed)."""
    return ff.fd.fusion.print_math()


def loop_sharding(tv) -> tuple[str, list[tuple[str, int]]]:
    """(device mesh, [(parallel type, extent), ...] of the loop domain) of a TensorView,
    read from its IterDomains: 'mesh_x' / 'mesh_y' for device-parallel axes, '' otherwise."""
    axes = []
    for axis in tv.get_loop_domain():
        if axis.is_reduction():   # e.g. the reduced axis of a LayerNorm's mean
            continue
        text = str(axis)  # e.g. 'ideviceIdx.y388{2}' or 'iS389{2}'
        extent = int(text[text.rindex("{") + 1:text.rindex("}")])
        kind = "mesh_x" if "deviceIdx.x" in text else "mesh_y" if "deviceIdx.y" in text else ""
        axes.append((kind, extent))
    text = str(tv)
    mesh = text[text.index("DeviceMesh"):text.rindex(")")] if "DeviceMesh" in text else ""
    return mesh, axes



# ---------------------------------------------------------------------------
# Backward

def saved_shapes(cfg: BlockConfig) -> dict[str, list[int]]:
    return {name: list(shape) for name, (shape, _) in saved_specs(cfg).items()}


@dataclass
class BackwardFusion:
    fd: FusionDefinition
    cfg: BlockConfig
    inputs: dict = field(default_factory=dict)    # grad_out, x, params, saved
    outputs: dict = field(default_factory=dict)   # grad_x, then grad.<param> in PARAM_NAMES order
    intermediates: dict = field(default_factory=dict)   # plan.BACKWARD_INTERMEDIATES present in this fusion
    meshed: bool = False

    def execute(self, inputs: list, enable: tuple[str, ...] = ()) -> list[torch.Tensor]:
        # nvFuser's resize scheduler fails on the q, k, v concatenation of a
        # sharded backward (upstream issue 4890); its own test turns it off too.
        return self.fd.execute(inputs, _disable_options=["resize_scheduler"] if self.meshed else [],
                               **enable_options(enable))


def enable_options(enable: tuple[str, ...]) -> dict:
    """fd.execute's keyword turning nvFuser options on; none asked: no keyword."""
    return {"_enable_options": list(enable)} if enable else {}


def _gelu_tanh_grad(fd, x):
    """d/dx of 0.5 x (1 + tanh(k (x + c x^3)))."""
    k, c = math.sqrt(2.0 / math.pi), 0.044715
    x2 = fd.ops.mul(x, x)
    t = fd.ops.tanh(fd.ops.mul(fd.ops.add(x, fd.ops.mul(fd.ops.mul(x2, x), c)), k))
    dinner = fd.ops.mul(fd.ops.add(fd.ops.mul(x2, 3 * c), 1.0), k)
    sech2 = fd.ops.sub(fd.define_scalar(1.0, dtype=DataType.Double), fd.ops.mul(t, t))
    return fd.ops.add(fd.ops.mul(fd.ops.add(t, 1.0), 0.5), fd.ops.mul(fd.ops.mul(fd.ops.mul(x, 0.5), sech2), dinner))


def _sum_rows(fd, t):
    """Sum over batch and sequence: [b, s, n] -> [n], one dimension at a time.
    Over dp (b) and under sequence parallelism (s) these are cross-rank sums, and
    nvFuser 0.2.36 lowers a sum over a device-split axis and another axis at once
    to a wrong-sized local copy (post_communication.cpp:74, NOTES-history.md)."""
    return fd.ops.sum(fd.ops.sum(t, dims=[0], keepdim=False, dtype=DataType.Null), dims=[0], keepdim=False,
                      dtype=DataType.Null)


def _weight_grad(fd, g, a, rows):
    """dL/dW of y = a W^T: g^T a over all rows; g [b, s, n_out], a [b, s, n_in] -> [n_out, n_in].
    Under sequence parallelism g and a are whole (all-gathered) here: the merge of
    b and s never merges a device-split axis (plan.BACKWARD_INTERMEDIATES)."""
    g2 = fd.ops.reshape(g, new_shape=[rows, g.shape()[2]])   # (bs, n_out)
    a2 = fd.ops.reshape(a, new_shape=[rows, a.shape()[2]])   # (bs, n_in)
    return fd.ops.matmul(fd.ops.permute(g2, dims=[1, 0]), a2)


def _input_grad(fd, g, w):
    """dL/da of y = a W^T: g W; g [b, s, n_out], w [n_out, n_in] -> [b, s, n_in].
    A 3-D product, no reshape: under sequence parallelism its tp partial sums are
    reduce-scattered on s, which a [b*s] merge would put inside a merged axis."""
    return fd.ops.matmul(g, w)


def _layer_norm_backward(fd, g, xhat, rstd, weight, bse):
    """g: float [b, s, e], the gradient of the LayerNorm's output; xhat its normalized
    input. Returns (grad of the input, of the weight, of the bias), float."""
    grad_weight, grad_bias = _sum_rows(fd, fd.ops.mul(g, xhat)), _sum_rows(fd, g)
    gxhat = fd.ops.mul(g, fd.ops.broadcast_in_dim(fd.ops.cast(weight, DataType.Float), shape=bse,
                                                   broadcast_dims=[2]))
    e = bse[2]
    mean_g = fd.ops.mul(fd.ops.sum(gxhat, dims=[2], keepdim=False, dtype=DataType.Null), 1.0 / e)
    mean_gx = fd.ops.mul(fd.ops.sum(fd.ops.mul(gxhat, xhat), dims=[2], keepdim=False, dtype=DataType.Null), 1.0 / e)
    centered = fd.ops.sub(fd.ops.sub(gxhat, _bcast_rows(fd, mean_g, bse)),
                          fd.ops.mul(xhat, _bcast_rows(fd, mean_gx, bse)))
    return fd.ops.mul(centered, _bcast_rows(fd, rstd, bse)), grad_weight, grad_bias


def _ln_linear_backward(fd, g, linear, x, ln, w, cfg):
    """Backward of a column-parallel linear on a LayerNorm's output: g, the
    gradient of the linear's output (block dtype); x, the LayerNorm's input
    (float [b, s, e]); the LayerNorm is recomputed from its saved statistics.
    Returns (gradient of x, float; the linear's weight gradient and the
    LayerNorm's, by name; the intermediates the schedule places). The linear's
    input gradient is a partial sum over tp: nvFuser all-reduces it."""
    bse = [cfg.batch, cfg.seq, cfg.n_embd]
    xhat = _normalize(fd, x, w[f"{ln}.mean"], w[f"{ln}.rstd"], bse)
    ln_out = fd.ops.cast(_affine(fd, xhat, w[f"{ln}.weight"], w[f"{ln}.bias"], bse), _NV_DTYPE[cfg.torch_dtype])
    grads = {f"{linear}.weight": _weight_grad(fd, g, ln_out, bse[0] * bse[1])}
    g_ln = fd.ops.cast(_input_grad(fd, g, w[f"{linear}.weight"]), DataType.Float)
    g_x, grads[f"{ln}.weight"], grads[f"{ln}.bias"] = _layer_norm_backward(
        fd, g_ln, xhat, w[f"{ln}.rstd"], w[f"{ln}.weight"], bse)
    return g_x, grads, {f"{ln}.out": ln_out, f"g.{ln}.out": g_ln}


def _causal_attention_backward(fd, gy, q, k, v, probs, keep, dropped, cfg, p):
    """Gradients of q, k, v (float [b, h, s, d]) of the written-out attention,
    given its recomputed probabilities (_dropped_probs)."""
    b, h, s, d = cfg.batch, cfg.n_head, cfg.seq, cfg.head_dim
    grad_v = fd.ops.matmul(fd.ops.permute(dropped, dims=[0, 1, 3, 2]), gy)    # (b, h, s, d)
    grad_dropped = fd.ops.matmul(gy, fd.ops.permute(v, dims=[0, 1, 3, 2]))   # (b, h, s, s)
    grad_probs = _dropout(fd, grad_dropped, keep, p) if keep is not None else grad_dropped
    row_dot = fd.ops.broadcast_in_dim(fd.ops.sum(fd.ops.mul(grad_probs, probs), dims=[3], keepdim=False,
                                                 dtype=DataType.Null), shape=[b, h, s, 1], broadcast_dims=[0, 1, 2])
    grad_scores = fd.ops.mul(fd.ops.mul(probs, fd.ops.sub(grad_probs, row_dot)), 1.0 / math.sqrt(d))
    grad_q = fd.ops.matmul(grad_scores, k)
    grad_k = fd.ops.matmul(fd.ops.permute(grad_scores, dims=[0, 1, 3, 2]), q)
    return grad_q, grad_k, grad_v


def backward_output_names() -> list[str]:
    return ["grad_x"] + [f"grad.{name}" for name in PARAM_NAMES]


def define_backward(fd: FusionDefinition, cfg: BlockConfig, outputs=None) -> BackwardFusion:
    """The block's backward on global shapes.

    Inputs: grad_out [b, s, e], x, the parameters (PARAM_NAMES order), the saved
    tensors (saved_names order), the fusion's dropout masks among them; flash
    attention's own dropout is replayed by sdpfa_bwd from its saved philox state.
    Outputs: grad_x, then the gradient of every parameter in PARAM_NAMES order
    (backward_output_names). `outputs`, a subset of those names, keeps only
    them: nvFuser then compiles only what they need (to bisect a failure).
    """
    b, s, e, h, d = cfg.batch, cfg.seq, cfg.n_embd, cfg.n_head, cfg.head_dim
    dtype, p = _NV_DTYPE[cfg.torch_dtype], cfg.dropout
    bf = BackwardFusion(fd, cfg)
    nv = {"block": dtype, "f32": DataType.Float, "u64": DataType.UInt64, "bool": DataType.Bool}
    bf.inputs["grad_out"] = fd.define_tensor(shape=[b, s, e], contiguity=True, dtype=dtype)
    bf.inputs["x"] = fd.define_tensor(shape=[b, s, e], contiguity=True, dtype=dtype)
    for name, shape in param_shapes(cfg).items():
        bf.inputs[name] = fd.define_tensor(shape=list(shape), contiguity=True, dtype=dtype)
    for name, (shape, kind) in saved_specs(cfg).items():   # laid out as the forward writes them
        bf.inputs[name] = fd.define_tensor(shape=list(shape), contiguity=True, dtype=nv[kind],
                                           stride_order=_stride_order(memory_order(BY_NAME[name], cfg)))
    w = bf.inputs
    grads = {}

    g = fd.ops.cast(w["grad_out"], DataType.Float)
    # MLP branch: out = x1 + dropout(gelu(ln_2(x1) W_fc^T + b_fc) W_proj^T + b_proj)
    g_mlp = _dropout(fd, g, w["resid_mlp_keep"], p) if p > 0 else g
    grads["mlp.c_proj.bias"] = _sum_rows(fd, g_mlp)
    h_pre = fd.ops.cast(w["mlp_h"], DataType.Float)                        # (b, s, 4e)
    g_mlp = bf.intermediates["g.mlp.c_proj.out"] = fd.ops.cast(g_mlp, dtype)
    grads["mlp.c_proj.weight"] = _weight_grad(fd, g_mlp, fd.ops.cast(_gelu_tanh(fd, h_pre), dtype), b * s)
    g_h = fd.ops.mul(fd.ops.cast(_input_grad(fd, g_mlp, w["mlp.c_proj.weight"]), DataType.Float),
                     _gelu_tanh_grad(fd, h_pre))                             # (b, s, 4e)
    grads["mlp.c_fc.bias"] = _sum_rows(fd, g_h)
    g_ln_2, more, placed = _ln_linear_backward(fd, fd.ops.cast(g_h, dtype), "mlp.c_fc", w["x1"], "ln_2", w, cfg)
    grads |= more
    bf.intermediates |= placed
    g_x1 = fd.ops.add(g, g_ln_2)

    # Attention branch: x1 = x + dropout(attn(ln_1(x)) W_proj^T + b_proj)
    g_attn = _dropout(fd, g_x1, w["resid_attn_keep"], p) if p > 0 else g_x1
    grads["attn.c_proj.bias"] = _sum_rows(fd, g_attn)
    q, k, v = w["q"], w["k"], w["v"]                                       # (b, h, s, d)
    g_attn = bf.intermediates["g.attn.c_proj.out"] = fd.ops.cast(g_attn, dtype)
    if cfg.torch_dtype == torch.bfloat16:
        y = w["sdpa_out"]
    else:  # recompute the probabilities once, for y and for the attention backward
        keep = w.get("attn_keep")
        probs, dropped = _dropped_probs(fd, q, k, cfg, p, keep)
        y = fd.ops.matmul(dropped, v)
    y_bse = fd.ops.reshape(fd.ops.permute(y, dims=[0, 2, 1, 3]), new_shape=[b, s, e])
    grads["attn.c_proj.weight"] = _weight_grad(fd, g_attn, y_bse, b * s)
    g_y = _input_grad(fd, g_attn, w["attn.c_proj.weight"])          # (b, s, e), heads over tp
    g_y = fd.ops.permute(fd.ops.reshape(g_y, new_shape=[b, s, h, d]), dims=[0, 2, 1, 3])  # (b, h, s, d)
    if cfg.torch_dtype == torch.bfloat16:
        g_q, g_k, g_v = fd.ops.sdpfa_bwd(
            g_y, q, k, v, w["sdpa_out"], w["sdpa_lse"], fd.define_scalar(p, dtype=DataType.Double),
            fd.define_scalar(True, dtype=DataType.Bool), w["sdpa_seed"], w["sdpa_offset"], None)
    else:
        g_q, g_k, g_v = _causal_attention_backward(fd, g_y, q, k, v, probs, keep, dropped, cfg, p)
    g_qkv = _join_heads_grad(fd, g_q, g_k, g_v, cfg)                      # (b, s, 3e)
    grads["attn.c_attn.bias"] = _sum_rows(fd, fd.ops.cast(g_qkv, DataType.Float))
    g_x, more, placed = _ln_linear_backward(fd, fd.ops.cast(g_qkv, dtype), "attn.c_attn",
                                            fd.ops.cast(w["x"], DataType.Float), "ln_1", w, cfg)
    grads |= more
    bf.intermediates |= placed

    grads = {"grad_x": fd.ops.add(g_x1, g_x)} | {f"grad.{name}": t for name, t in grads.items()}
    results = {name: grads[name] for name in backward_output_names()}
    unknown = set(outputs or ()) - set(results)
    if unknown:
        raise ValueError(f"outputs {sorted(unknown)}: not among {list(results)}")
    for name, tv in results.items():
        if outputs is None or name in outputs:
            bf.outputs[name] = fd.ops.cast(tv, dtype)
            fd.add_output(bf.outputs[name])
    return bf


def build_backward(cfg: BlockConfig, layout: Layout | None = None, outputs=None, dp_rank: int = 0,
                   split_unit_axes: bool = False) -> BackwardFusion:
    """Define the backward and, when a layout is given, shard it on its mesh.

    The backward of dp rank `dp_rank` runs on that rank's tp devices alone, on
    its b/dp rows of the batch: its parameter gradients are sums over those
    rows, and the caller sums them over dp (runtime.ShardedBlock.backward, as
    DDP does). Inside the fusion, nvFuser 0.2.36 would all-reduce a sum over the
    mesh's dp axis within the tp team instead: its lowering of an all-reduce
    takes the team along mesh_x whatever the axis reduced (read in its source,
    not seen run; NOTES-history.md)."""
    if layout is not None:
        layout.check(cfg)
        cfg = cfg.replace(batch=cfg.batch // layout.dp)
    with FusionDefinition() as fd:
        bf = define_backward(fd, cfg, outputs)
        if layout is not None:
            schedule(bf, layout, row=dp_rank, split_unit_axes=split_unit_axes)
            bf.meshed = True
    return bf


# ---------------------------------------------------------------------------
# Overlapped linears (issue 17): one tensor-parallel linear and its collective
# cut into `chunks` along the tokens, each chunk on its own stream
# (ParallelType.stream), so that chunk i's collective runs beside another
# chunk's GEMM. Standalone fusions of the block's shapes, written as nvFuser's
# own overlap tests write them (tests/python/multidevice/test_overlap.py:
# test_row_parallel_linear_forward, test_overlap_allgather_matmul_stream_outermost);
# the whole block is not yet lowered this way. tools/overlap_check.py runs them.

@dataclass
class OverlapFusion:
    fd: FusionDefinition
    kind: str          # "row-parallel all-reduce" or "all-gather column-parallel"
    chunks: int
    tp: int
    inputs: list = field(default_factory=list)
    output: object = None


def row_parallel_overlapped(tokens: int, n_in: int, n_out: int, tp: int, chunks: int,
                            dtype: torch.dtype = torch.bfloat16) -> OverlapFusion:
    """out [t, n_out] = h [t, n_in] @ W^T, h and W split on n_in over tp (the
    MLP's c_proj: the partial sums all-reduced), the tokens cut into `chunks`
    streams: each chunk's all-reduce follows its own GEMM. Run with
    execute(..., _enable_options=["host_ir_lowering"]) (OVERLAP_OPTIONS)."""
    if tokens % chunks or n_in % tp:
        raise ValueError(f"row-parallel overlap: chunks={chunks} must divide the tokens ({tokens}) "
                         f"and tp={tp} the inner size ({n_in})")
    with FusionDefinition() as fd:
        h = fd.define_tensor(shape=[tokens, n_in], contiguity=True, dtype=_NV_DTYPE[dtype])
        w = fd.define_tensor(shape=[n_out, n_in], contiguity=True, dtype=_NV_DTYPE[dtype])
        out = fd.ops.linear(h, w)
        fd.add_output(out)
        mesh = make_mesh(Layout(1, tp), row=0)   # a 1-D mesh of tp devices
        for tv in (h, w):
            tv.set_device_mesh(mesh)
        h.outer_split(0, chunks)
        h.axis(0).parallelize(ParallelType.stream)
        h.outer_split(2, tp)
        h.axis(2).parallelize(ParallelType.mesh_x)
        w.outer_split(1, tp)
        w.axis(1).parallelize(ParallelType.mesh_x)
    return OverlapFusion(fd, "row-parallel all-reduce", chunks, tp, [h, w], out)


def allgather_column_parallel_overlapped(tokens: int, n_in: int, n_out: int, tp: int, chunks: int,
                                         dtype: torch.dtype = torch.bfloat16) -> OverlapFusion:
    """Under sequence parallelism: out = all_gather(x) @ W^T + b, x's tokens split
    over tp, each rank's slice cut into `chunks`; x is [chunks, tp, t/(chunks tp), n_in]
    (rank r's local [chunks, rows, n_in] is its slice viewed so), W [n_out, n_in]
    and b whole (a column-parallel shard). The output's chunk axis is a stream:
    chunk i's all-gather runs beside chunk i-1's GEMM. Run with
    nvfuser_direct.multidevice.MultiDeviceExecutor, as nvFuser's test does."""
    if tokens % (chunks * tp):
        raise ValueError(f"all-gather overlap: chunks={chunks} x tp={tp} must divide the tokens ({tokens})")
    with FusionDefinition() as fd:
        nv = _NV_DTYPE[dtype]
        x = fd.define_tensor(shape=[chunks, tp, tokens // (chunks * tp), n_in], contiguity=True, dtype=nv)
        w = fd.define_tensor(shape=[n_out, n_in], contiguity=True, dtype=nv)
        b = fd.define_tensor(shape=[n_out], contiguity=True, dtype=nv)
        out = fd.ops.linear(x, w, b)   # [chunks, tp, rows, n_out]
        fd.add_output(out)
        mesh = make_mesh(Layout(1, tp), row=0)   # a 1-D mesh of tp devices
        for tv in (x, w, b, out):
            tv.set_device_mesh(mesh)
        x.axis(1).parallelize(ParallelType.mesh_x)
        out.axis(0).parallelize(ParallelType.stream)
    return OverlapFusion(fd, "all-gather column-parallel", chunks, tp, [x, w, b], out)


OVERLAP_OPTIONS = {"_enable_options": ["host_ir_lowering"], "_disable_options": ["infer_contiguity"]}


def check_host_ir_device(rank: int, device_count: int) -> None:
    """nvFuser 0.2.36's host IR evaluator (what runs the stream-parallel
    fusions) takes the rank's global index for a CUDA device index
    (HostIrEvaluator's constructor, csrc/host_ir/evaluator.cpp at 7e04d26:
    getDefaultCUDAStream(deviceId())). A rank at or beyond this node's GPU
    count then fails with "Device index value 1 is out of index range [0, 1)"
    (run 15: ranks sharing one GPU). Refuse it up front, saying so, unless the
    process preloads sharegpu's default-stream shim, which gives such an index
    the current device."""
    from tpfuser.sharegpu import SHIM_VARIABLE, default_stream_shim_loaded
    if rank >= device_count and not default_stream_shim_loaded():
        raise ValueError(f"the overlapped fusions need a GPU per rank: nvFuser 0.2.36 runs them on CUDA device "
                         f"<global rank> ({rank}), and this process sees {device_count} GPU(s); ranks sharing a GPU "
                         f"need the default-stream shim preloaded (LD_PRELOAD=$(python3 -c 'from tpfuser.sharegpu "
                         f"import build_default_stream_shim as b; print(b())'), or {SHIM_VARIABLE} under "
                         f"tpfuser.sharegpu)")


def run_allgather_overlapped(of: OverlapFusion, inputs: list):
    """Execute an all-gather overlap fusion the way nvFuser's own test does."""
    executor = getattr(of, "_executor", None)
    if executor is None:
        params = nvf.multidevice.MultiDeviceExecutorParams()
        params.backend_type = nvf.CommunicatorBackend.nccl
        executor = of._executor = nvf.multidevice.MultiDeviceExecutor(of.fd.fusion, params)
    return executor.run(inputs)
