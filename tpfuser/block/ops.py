"""The block's primitives as nvFuser operations, on global shapes: LayerNorm,
GELU (tanh), dropout by a keep-mask, attention written out (fp32, where flash
attention has no kernel), the matmuls of a linear's gradients, and the
integer operations dropout.py's hash runs on. Each takes the FusionDefinition
it adds to; `bse` is the [b, s, e] shape of a row of hidden vectors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from nvfuser_direct import DataType

from tpfuser.block.tensors import LN_EPS

NV_DTYPE = {torch.bfloat16: DataType.BFloat16, torch.float32: DataType.Float}


def bcast_rows(fd, t, bse):
    """[b, s] -> [b, s, e]"""
    return fd.ops.broadcast_in_dim(t, shape=bse, broadcast_dims=[0, 1])


def normalize(fd, x, mean, rstd, bse):
    """(x - mean) * rstd; x float [b, s, e], mean and rstd [b, s]."""
    return fd.ops.mul(fd.ops.sub(x, bcast_rows(fd, mean, bse)), bcast_rows(fd, rstd, bse))


def affine(fd, xhat, weight, bias, bse):
    weight = fd.ops.broadcast_in_dim(fd.ops.cast(weight, DataType.Float), shape=bse, broadcast_dims=[2])
    bias = fd.ops.broadcast_in_dim(fd.ops.cast(bias, DataType.Float), shape=bse, broadcast_dims=[2])
    return fd.ops.add(fd.ops.mul(xhat, weight), bias)


def layer_norm(fd, x, weight, bias, bse):
    """x: float [b, s, e]; weight, bias: [e] of any float dtype. Returns (y, mean, rstd), stats [b, s]."""
    var, mean = fd.ops.var_mean(x, dims=[2], correction=0, keepdim=False)
    rstd = fd.ops.rsqrt(fd.ops.add(var, fd.define_scalar(LN_EPS, dtype=DataType.Double)))
    return affine(fd, normalize(fd, x, mean, rstd, bse), weight, bias, bse), mean, rstd


def gelu_tanh(fd, x):
    inner = fd.ops.add(x, fd.ops.mul(fd.ops.mul(fd.ops.mul(x, x), x), 0.044715))
    return fd.ops.mul(fd.ops.mul(x, 0.5),
                      fd.ops.add(fd.ops.tanh(fd.ops.mul(inner, math.sqrt(2.0 / math.pi))), 1.0))


def int_ops(fd, hash_ints: str = "int64") -> SimpleNamespace:
    """dropout.py's integer operations on nvFuser values, in int64 or (hash_ints
    "uint64", Form.hash_ints) on values made UInt64, whose products of two 32-bit
    values are exact (`wide`: half the multiplications)."""
    names = dict(xor="bitwise_xor", band="bitwise_and", shr="bitwise_right_shift", shl="bitwise_left_shift",
                 add="add", mul="mul")
    if hash_ints == "int64":
        return SimpleNamespace(**{name: getattr(fd.ops, op) for name, op in names.items()}, wide=False)

    def unsigned(v):   # a constant as a UInt64 scalar (nvFuser promotes no UInt64 scalar with an Int one)
        return fd.define_scalar(v, dtype=DataType.UInt64) if isinstance(v, int) else fd.ops.cast(v, DataType.UInt64)

    def op(name):
        return lambda a, b: getattr(fd.ops, name)(a, unsigned(b) if isinstance(b, int) else b)
    return SimpleNamespace(**{name: op(op_name) for name, op_name in names.items()}, wide=True, unsigned=unsigned)


def global_positions(fd, shape, starts):
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


def dropout(fd, x, keep, p):
    return fd.ops.mul(fd.ops.mul(x, fd.ops.cast(keep, DataType.Float)), 1.0 / (1.0 - p))


def causal_probs(fd, q, k, cfg):
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


def one_hot_3(fd, i: int, rank: int, axis: int):
    """A float tensor of `rank` dimensions, 3 long on `axis` and 1 elsewhere: 1 at i."""
    hot = fd.ops.cast(fd.ops.eq(fd.ops.iota(fd.define_scalar(3, dtype=DataType.Int)), i), DataType.Float)
    return fd.ops.broadcast_in_dim(hot, shape=[3 if a == axis else 1 for a in range(rank)], broadcast_dims=[axis])


def lay_out(tv, order: tuple[int, ...] | None) -> None:
    """Have nvFuser allocate tv with its logical dimensions in `order` in
    memory (tensors.memory_order); None leaves it to nvFuser."""
    if order is not None:
        logical = tv.get_logical_domain()
        tv.set_allocation_domain([logical[i] for i in order], True)


def stride_order(order: tuple[int, ...] | None) -> list[int]:
    """define_tensor's stride_order for a memory order: per dimension, its rank
    among the strides, 0 the innermost; [] for the logical order."""
    if order is None:
        return []
    ranks = [0] * len(order)
    for position, dim in enumerate(order):
        ranks[dim] = len(order) - 1 - position
    return ranks


def gelu_tanh_grad(fd, x):
    """d/dx of 0.5 x (1 + tanh(k (x + c x^3)))."""
    k, c = math.sqrt(2.0 / math.pi), 0.044715
    x2 = fd.ops.mul(x, x)
    t = fd.ops.tanh(fd.ops.mul(fd.ops.add(x, fd.ops.mul(fd.ops.mul(x2, x), c)), k))
    dinner = fd.ops.mul(fd.ops.add(fd.ops.mul(x2, 3 * c), 1.0), k)
    sech2 = fd.ops.sub(fd.define_scalar(1.0, dtype=DataType.Double), fd.ops.mul(t, t))
    return fd.ops.add(fd.ops.mul(fd.ops.add(t, 1.0), 0.5), fd.ops.mul(fd.ops.mul(fd.ops.mul(x, 0.5), sech2), dinner))


def sum_rows(fd, t):
    """Sum over batch and sequence: [b, s, n] -> [n], one dimension at a time.
    Over dp (b) and under sequence parallelism (s) these are cross-rank sums, and
    nvFuser 0.2.36 lowers a sum over a device-split axis and another axis at once
    to a wrong-sized local copy (post_communication.cpp:74, NOTES-history.md)."""
    return fd.ops.sum(fd.ops.sum(t, dims=[0], keepdim=False, dtype=DataType.Null), dims=[0], keepdim=False,
                      dtype=DataType.Null)


def weight_grad(fd, g, a, rows):
    """dL/dW of y = a W^T: g^T a over all rows; g [b, s, n_out], a [b, s, n_in] -> [n_out, n_in].
    Under sequence parallelism g and a are whole (all-gathered) here: the merge of
    b and s never merges a device-split axis (the backward's intermediates in tensors.TENSORS)."""
    g2 = fd.ops.reshape(g, new_shape=[rows, g.shape()[2]])   # (bs, n_out)
    a2 = fd.ops.reshape(a, new_shape=[rows, a.shape()[2]])   # (bs, n_in)
    return fd.ops.matmul(fd.ops.permute(g2, dims=[1, 0]), a2)


def input_grad(fd, g, w):
    """dL/da of y = a W^T: g W; g [b, s, n_out], w [n_out, n_in] -> [b, s, n_in].
    A 3-D product, no reshape: under sequence parallelism its tp partial sums are
    reduce-scattered on s, which a [b*s] merge would put inside a merged axis."""
    return fd.ops.matmul(g, w)


def layer_norm_param_grads(fd, g, xhat):
    """g: float [b, s, e], the gradient of a LayerNorm's output; xhat its normalized
    input. Returns (grad of the weight, of the bias), float."""
    return sum_rows(fd, fd.ops.mul(g, xhat)), sum_rows(fd, g)


def layer_norm_input_grad(fd, g, xhat, rstd, weight, bse):
    """The gradient of the LayerNorm's input, float [b, s, e] (g, xhat: layer_norm_param_grads')."""
    gxhat = fd.ops.mul(g, fd.ops.broadcast_in_dim(fd.ops.cast(weight, DataType.Float), shape=bse,
                                                   broadcast_dims=[2]))
    e = bse[2]
    mean_g = fd.ops.mul(fd.ops.sum(gxhat, dims=[2], keepdim=False, dtype=DataType.Null), 1.0 / e)
    mean_gx = fd.ops.mul(fd.ops.sum(fd.ops.mul(gxhat, xhat), dims=[2], keepdim=False, dtype=DataType.Null), 1.0 / e)
    centered = fd.ops.sub(fd.ops.sub(gxhat, bcast_rows(fd, mean_g, bse)),
                          fd.ops.mul(xhat, bcast_rows(fd, mean_gx, bse)))
    return fd.ops.mul(centered, bcast_rows(fd, rstd, bse))


def causal_attention_backward(fd, gy, q, k, v, probs, keep, dropped, cfg, p):
    """Gradients of q, k, v (float [b, h, s, d]) of the written-out attention,
    given its recomputed probabilities (causal_probs) and those after dropout (`dropped`)."""
    b, h, s, d = cfg.batch, cfg.n_head, cfg.seq, cfg.head_dim
    grad_v = fd.ops.matmul(fd.ops.permute(dropped, dims=[0, 1, 3, 2]), gy)    # (b, h, s, d)
    grad_dropped = fd.ops.matmul(gy, fd.ops.permute(v, dims=[0, 1, 3, 2]))   # (b, h, s, s)
    grad_probs = dropout(fd, grad_dropped, keep, p) if keep is not None else grad_dropped
    row_dot = fd.ops.broadcast_in_dim(fd.ops.sum(fd.ops.mul(grad_probs, probs), dims=[3], keepdim=False,
                                                 dtype=DataType.Null), shape=[b, h, s, 1], broadcast_dims=[0, 1, 2])
    grad_scores = fd.ops.mul(fd.ops.mul(probs, fd.ops.sub(grad_probs, row_dot)), 1.0 / math.sqrt(d))
    grad_q = fd.ops.matmul(grad_scores, k)
    grad_k = fd.ops.matmul(fd.ops.permute(grad_scores, dims=[0, 1, 3, 2]), q)
    return grad_q, grad_k, grad_v
