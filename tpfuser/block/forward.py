"""The block's forward, on global shapes (nanoGPT's Block):

    x1  = x  + dropout(attn(ln_1(x)) W_proj^T + b_proj)
    out = x1 + dropout(gelu(ln_2(x1) W_fc^T + b_fc) W_proj2^T + b_proj2)

written once over a block/pieces.py builder: inputs by name, outputs named,
and a cut point before and after each linear (form.FORWARD_CUTS), where a schedule
may end one fusion and begin the next. The c_attn weight's rows are ordered
head by head ([h, 3, d], not nanoGPT's [3, h, d]: shard.qkv_heads_interleaved),
so that splitting them over tp gives each rank whole heads of q, k and v.
"""

from __future__ import annotations

import torch
from nvfuser_direct import DataType

from tpfuser.block.dropout import hash_positions, keep_threshold
from tpfuser.block.form import MASK_POINTS, Form
from tpfuser.block.inputs import MASK_STARTS, drawn_streams, rng_input_names
from tpfuser.block.ops import (NV_DTYPE, causal_probs, dropout, global_positions, int_ops, gelu_tanh, layer_norm,
                               lay_out, one_hot_3)
from tpfuser.block.pieces import Pieces
from tpfuser.block.tensors import BY_NAME, MASKS, PARAM_NAMES, memory_order, saved
from tpfuser.config import BlockConfig

CHECK_MASKS = ("attn_keep", "resid_attn_keep", "resid_mlp_keep")   # a checking forward's outputs, in order


def saved_names(cfg: BlockConfig) -> list[str]:
    """What the training forward saves for the backward, in the backward's order (tensors.saved)."""
    return [t.name for t in saved(cfg)]


def forward_outputs(cfg: BlockConfig, check: bool = False, train: bool = False) -> list[str]:
    """What a forward pass returns, in order: out; with check the keep-masks the
    fusions draw; with train what the backward needs (its masks included, once)."""
    drawn = {f"{stream}_keep" for stream in drawn_streams(cfg)}
    names = ["out"] + ([name for name in CHECK_MASKS if name in drawn] if check else [])
    for name in saved_names(cfg) if train else []:
        if name not in names:
            names.append(name)
    return names


def forward_order(cfg: BlockConfig, check: bool = False, train: bool = False) -> list[str]:
    """The order a forward fusion takes its inputs and returns its outputs in, where it has them."""
    return ["x", *PARAM_NAMES, *rng_input_names(cfg), *forward_outputs(cfg, check, train)]


def mask_cuts(cfg: BlockConfig) -> set[str]:
    """Where the masks' own fusions (Form.masks "fusion") are cut: one fusion
    per drawn stream, then the block. Two masks in one fusion are two
    unconnected graphs, which no nvFuser scheduler takes whole: its segmenter
    then searches the hashes' ~300 expressions (1.6-2.0 s of a first call:
    NOTES.md) for the two kernels a fusion each gives at once."""
    streams = drawn_streams(cfg)
    points = {f"masks.{stream}" for stream in streams[1:]}
    assert points <= set(MASK_POINTS), points
    return {"masks"} | points if streams else set()


def keep_mask(b: Pieces, cfg: BlockConfig, stream: str, form: Form):
    """Bernoulli(1 - p) keep-mask of one dropout stream over its tensor's
    global shape: hash(stream key, global position) < (1 - p) 2**32. The
    rank's slice begins at scalars (MASK_STARTS): nvFuser indexes a rank's
    kernel locally, so iota(n, start) is the global coordinate."""
    shape = list(MASKS[stream].shape(cfg))
    starts = [b[name] if name else None for name in MASK_STARTS[stream]]
    ints = int_ops(b, form.hash_ints)
    hashed = hash_positions(global_positions(b, shape, starts), b[f"key.{stream}"], ints)
    threshold = b.define_scalar(keep_threshold(cfg.dropout), dtype=DataType.UInt64 if ints.wide else DataType.Int)
    return b.ops.lt(hashed, threshold)


def split_heads(b, qkv, cfg: BlockConfig, form: Form):
    """(b, s, 3e) with rows ordered [h, 3, d] -> q, k, v each (b, h, s, d), saved
    for the backward, which then slices nothing: each written by a kernel, or
    (qkv_split "view") views of qkv (Form.qkv_split says how)."""
    bs, s, h, d = cfg.batch, cfg.seq, cfg.n_head, cfg.head_dim
    dtype, ops = NV_DTYPE[cfg.torch_dtype], b.ops
    if form.qkv_split in ("slice", "view"):   # reshape before slicing, so that the tp split (on heads) is not sliced
        qkv = ops.reshape(qkv, new_shape=[bs, s, h, 3 * d])   # (b, s, h, 3d)
    else:
        qkv = ops.reshape(qkv, new_shape=[bs, s, h, 3, d])    # (b, s, h, 3, d)

    def part(i):
        if form.qkv_split in ("slice", "view"):
            t = ops.slice(qkv, start_indices=[0, 0, 0, i * d], end_indices=[bs, s, h, (i + 1) * d])   # (b, s, h, d)
            if form.qkv_split == "slice":
                t = ops.cast(ops.mul(ops.cast(t, DataType.Float), 1.0), dtype)
        elif form.qkv_split == "select":
            t = ops.select(qkv, b.define_scalar(i, dtype=DataType.Int), dim=3)
        else:
            t = ops.cast(ops.sum(ops.mul(ops.cast(qkv, DataType.Float), one_hot_3(b, i, 5, 3)), dims=[3]), dtype)
        return ops.permute(t, dims=[0, 2, 1, 3])   # (b, h, s, d)
    return tuple(part(i) for i in range(3))


def define_forward(b: Pieces, cfg: BlockConfig, form: Form, check: bool = False, train: bool = False) -> None:
    """The block forward over builder b (inputs forward_order's, outputs
    forward_outputs'): with check also the keep-masks, with train also what
    the backward needs."""
    bs, s, e = cfg.batch, cfg.seq, cfg.n_embd
    bse, ops = [bs, s, e], b.ops
    dtype, p = NV_DTYPE[cfg.torch_dtype], cfg.dropout
    returned = set(forward_outputs(cfg, check, train))

    def out(name, tv):   # an output of the pass where it returns it
        if name in returned:
            b.output(name, tv)
        return tv

    def keep(stream):   # a keep-mask, drawn here or read from the masks' fusion
        if form.masks == "fusion":
            return b[f"{stream}_keep"]
        return out(f"{stream}_keep", keep_mask(b, cfg, stream, form))

    if form.masks == "fusion" and p > 0:
        for i, stream in enumerate(drawn_streams(cfg)):
            if i:   # a fusion per mask (mask_cuts): nvFuser schedules only a connected fusion whole
                b.cut(f"masks.{stream}", {})
            b.output(f"{stream}_keep", keep_mask(b, cfg, stream, form))
        b.cut("masks", {})

    def x_float():   # the input in fp32, made once in each fusion that reads it
        return b.derived("x.float", lambda: ops.cast(b["x"], DataType.Float))

    ln_1, mean, rstd = layer_norm(b, x_float(), b["ln_1.weight"], b["ln_1.bias"], bse)
    out("ln_1.mean", mean)
    out("ln_1.rstd", rstd)
    (ln_1,) = b.cut("attn.c_attn", {"ln_1.out": ops.cast(ln_1, dtype)})
    qkv = ops.linear(ln_1, b["attn.c_attn.weight"], b["attn.c_attn.bias"])   # (b, s, 3e), heads outermost
    (qkv,) = b.cut("attn.c_attn.out", {"qkv": qkv})
    q, k, v = (out(name, t) for name, t in zip("qkv", split_heads(b, qkv, cfg, form)))
    if cfg.torch_dtype == torch.bfloat16:
        # Flash attention; its dropout on the probabilities draws from ATen's
        # CUDA generator (replayable with torch.cuda.get/set_rng_state).
        y, lse, seed, offset = ops.sdpfa_fwd(q, k, v, dropout_p=b.define_scalar(p, dtype=DataType.Double),
                                             is_causal=b.define_scalar(True, dtype=DataType.Bool), scale=None)
        if form.flash_layout:   # as the table says: q, k, v and y as flash attention holds them
            laid = {"q": q, "k": k, "v": v, "sdpa_out": y}
            if form.qkv_split == "view":   # views of qkv keep its layout (one of their own would be a copy)
                laid = {"sdpa_out": y}
            for name, tv in laid.items():
                lay_out(tv, memory_order(BY_NAME[name], cfg))
        for name, tv in (("sdpa_out", y), ("sdpa_lse", lse), ("sdpa_seed", seed), ("sdpa_offset", offset)):
            out(name, tv)
    else:   # attention written out, its dropout drawn by the fusion
        keep_attn = keep("attn") if p > 0 else None
        probs = causal_probs(b, q, k, cfg)
        y = ops.matmul(probs if keep_attn is None else dropout(b, probs, keep_attn, p), v)   # (b, h, s, d)
    y = ops.reshape(ops.permute(y, dims=[0, 2, 1, 3]), new_shape=bse)   # (b, s, e)
    (y,) = b.cut("attn.c_proj", {"attn_out": y})
    proj = ops.linear(y, b["attn.c_proj.weight"])   # row-parallel: partial sums over tp, reduced here
    (proj,) = b.cut("attn.c_proj.out", {"attn.c_proj.out": proj})
    branch = ops.add(ops.cast(proj, DataType.Float), ops.cast(b["attn.c_proj.bias"], DataType.Float))
    if p > 0:
        branch = dropout(b, branch, keep("resid_attn"), p)
    x1 = b.keep("x1", out("x1", ops.add(x_float(), branch)))   # the residual stream, read again at the end

    ln_2, mean, rstd = layer_norm(b, x1, b["ln_2.weight"], b["ln_2.bias"], bse)
    out("ln_2.mean", mean)
    out("ln_2.rstd", rstd)
    (ln_2,) = b.cut("mlp.c_fc", {"ln_2.out": ops.cast(ln_2, dtype)})
    h = out("mlp_h", ops.linear(ln_2, b["mlp.c_fc.weight"], b["mlp.c_fc.bias"]))   # (b, s, 4e)
    (h,) = b.cut("mlp.c_fc.out", {"mlp_h": h})
    (act,) = b.cut("mlp.c_proj", {"mlp_act": ops.cast(gelu_tanh(b, ops.cast(h, DataType.Float)), dtype)})
    proj = ops.linear(act, b["mlp.c_proj.weight"])
    (proj,) = b.cut("mlp.c_proj.out", {"mlp.c_proj.out": proj})
    branch = ops.add(ops.cast(proj, DataType.Float), ops.cast(b["mlp.c_proj.bias"], DataType.Float))
    if p > 0:
        branch = dropout(b, branch, keep("resid_mlp"), p)
    b.output("out", ops.cast(ops.add(b.value("x1"), branch), dtype))
