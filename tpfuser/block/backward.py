"""The block's backward, on global shapes, over a block/pieces.py builder.

It takes the upstream gradient, the input, the parameters and what the
training forward saved (its dropout masks among them: drawing them again
would be a second hash in the backward; flash attention's own dropout is
replayed by sdpfa_bwd from its saved philox state), and returns the input's
gradient and each parameter's. The LayerNorms are recomputed from their
saved statistics. Cut points (form.BACKWARD_CUTS): before each sublayer's linears'
backward, where the residual stream's gradient (or the linear's upstream
gradient) crosses, around each column-parallel linear's input gradient, and
between a LayerNorm's parameter gradients and its input's.
"""

from __future__ import annotations

import torch
from nvfuser_direct import DataType

from tpfuser.block.form import Form
from tpfuser.block.forward import saved_names
from tpfuser.block.ops import (NV_DTYPE, affine, causal_attention_backward, causal_probs, dropout, gelu_tanh,
                               gelu_tanh_grad, input_grad, layer_norm_input_grad, layer_norm_param_grads, normalize,
                               one_hot_3, sum_rows, weight_grad)
from tpfuser.block.pieces import Pieces
from tpfuser.block.tensors import PARAM_NAMES
from tpfuser.config import BlockConfig


def backward_output_names() -> list[str]:
    return ["grad_x"] + [f"grad.{name}" for name in PARAM_NAMES]


def backward_order(cfg: BlockConfig) -> list[str]:
    """The order the backward's fusions take their inputs and return their outputs in, where they have them."""
    return ["grad_out", "x", *PARAM_NAMES, *saved_names(cfg), *backward_output_names()]


def join_heads_grad(b, g_q, g_k, g_v, cfg: BlockConfig, form: Form):
    """The gradient of qkv, (b, s, 3e) in the block's dtype with rows [h, 3, d],
    from those of q, k and v, each (b, h, s, d) (Form.qkv_split says how)."""
    bs, s, e, h, d = cfg.batch, cfg.seq, cfg.n_embd, cfg.n_head, cfg.head_dim
    ops = b.ops
    parts = [ops.permute(t, dims=[0, 2, 1, 3]) for t in (g_q, g_k, g_v)]   # (b, s, h, d)
    if form.qkv_split == "onehot":
        spread = [ops.mul(ops.broadcast_in_dim(ops.cast(t, DataType.Float), shape=[bs, s, h, 3, d],
                                               broadcast_dims=[0, 1, 2, 4]), one_hot_3(b, i, 5, 3))
                  for i, t in enumerate(parts)]
        g_qkv = ops.add(ops.add(spread[0], spread[1]), spread[2])
        return ops.cast(ops.reshape(g_qkv, new_shape=[bs, s, 3 * e]), NV_DTYPE[cfg.torch_dtype])
    # cat before the reshape, so that the concatenation is not along the tp-split dimension (heads)
    return ops.reshape(ops.cat(parts, dim=3, manual_padding=0), new_shape=[bs, s, 3 * e])


def ln_linear_backward(b: Pieces, g, linear: str, x, ln: str, cfg: BlockConfig, give, cut):
    """Backward of a column-parallel linear on a LayerNorm's output: g, the
    gradient of the linear's output (block dtype); x(), the LayerNorm's input
    (float [b, s, e]), the LayerNorm recomputed from its saved statistics.
    Gives the linear's weight gradient and the LayerNorm's (`give`); returns
    the gradient of x (float). The linear's input gradient g W is a partial
    sum over tp: nvFuser all-reduces it (under SP: reduce-scatters it); the
    pass may be cut around that matmul (`grad:<linear>.in` and `.in.out`),
    which is then a fusion of its own."""
    bse, ops = [cfg.batch, cfg.seq, cfg.n_embd], b.ops
    upstream = {"mlp.c_fc": "g.mlp_h", "attn.c_attn": "g.qkv"}[linear]

    def xhat():   # the LayerNorm's normalized input, made again in a later fusion
        return b.derived(f"{ln}.xhat", lambda: normalize(b, x(), b[f"{ln}.mean"], b[f"{ln}.rstd"], bse))
    ln_out = ops.cast(affine(b, xhat(), b[f"{ln}.weight"], b[f"{ln}.bias"], bse), NV_DTYPE[cfg.torch_dtype])
    b.place(f"{ln}.out.whole", ln_out)
    give(**{f"{linear}.weight": weight_grad(b, g, ln_out, bse[0] * bse[1])})
    (g,) = cut(f"grad:{linear}.in", {upstream: g})
    (g_in,) = cut(f"grad:{linear}.in.out", {f"{linear}.grad_in": input_grad(b, g, b[f"{linear}.weight"])})

    def g_ln_of(g_in):   # the gradient of the LayerNorm's output, in fp32
        g_ln = ops.cast(g_in, DataType.Float)
        b.place(f"g.{ln}.out", g_ln)
        return g_ln
    g_ln = g_ln_of(g_in)
    weight, bias = layer_norm_param_grads(b, g_ln, xhat())
    give(**{f"{ln}.weight": weight, f"{ln}.bias": bias})
    # cut (`grad:<ln>`): the parameters' sums over the rows and the input's gradient
    # (a sum over each row) are each a fusion nvFuser schedules whole
    (g_in_again,) = cut(f"grad:{ln}", {f"{linear}.grad_in": g_in})
    if g_in_again is not g_in:
        g_ln = g_ln_of(g_in_again)
    return layer_norm_input_grad(b, g_ln, xhat(), b[f"{ln}.rstd"], b[f"{ln}.weight"], bse)


def define_backward(b: Pieces, cfg: BlockConfig, form: Form, outputs=None) -> None:
    """The block's backward over builder b (inputs and outputs in backward_order).
    `outputs`, a subset of backward_output_names(), keeps only them: nvFuser
    then compiles only what they need (to bisect a failure)."""
    bs, s, e, h, d = cfg.batch, cfg.seq, cfg.n_embd, cfg.n_head, cfg.head_dim
    dtype, p, ops = NV_DTYPE[cfg.torch_dtype], cfg.dropout, b.ops
    unknown = set(outputs or ()) - set(backward_output_names())
    if unknown:
        raise ValueError(f"outputs {sorted(unknown)}: not among {backward_output_names()}")
    made = {}   # gradients not yet returned: cast and returned in order, by the fusion that made them

    def give(**grads):
        made.update(grads)

    def flush():
        for name in backward_output_names():
            key = name.removeprefix("grad.") if name != "grad_x" else name
            if key in made and (outputs is None or name in outputs):
                b.output(name, ops.cast(made.pop(key), dtype))
        made.clear()

    def cut(point, live):   # where the pass is cut, the gradients made so far leave with it
        if point in b.cuts:
            flush()
        return b.cut(point, live)

    def grad_out_float():
        return b.derived("grad_out.float", lambda: ops.cast(b["grad_out"], DataType.Float))

    # MLP branch: out = x1 + dropout(gelu(ln_2(x1) W_fc^T + b_fc) W_proj^T + b_proj)
    g = grad_out_float()
    g_mlp = dropout(b, g, b["resid_mlp_keep"], p) if p > 0 else g
    give(**{"mlp.c_proj.bias": sum_rows(b, g_mlp)})
    h_pre = ops.cast(b["mlp_h"], DataType.Float)                          # (b, s, 4e)
    g_mlp = ops.cast(g_mlp, dtype)
    b.place("g.mlp.c_proj.out", g_mlp)
    give(**{"mlp.c_proj.weight": weight_grad(b, g_mlp, ops.cast(gelu_tanh(b, h_pre), dtype), bs * s)})
    g_h = ops.mul(ops.cast(input_grad(b, g_mlp, b["mlp.c_proj.weight"]), DataType.Float),
                  gelu_tanh_grad(b, h_pre))                                  # (b, s, 4e)
    give(**{"mlp.c_fc.bias": sum_rows(b, g_h)})
    (g_h,) = cut("grad:mlp.c_fc", {"g.mlp_h": ops.cast(g_h, dtype)})
    g_ln_2 = ln_linear_backward(b, g_h, "mlp.c_fc", lambda: b["x1"], "ln_2", cfg, give, cut)
    (g_x1,) = cut("grad:attn.c_proj", {"g.x1": ops.add(grad_out_float(), g_ln_2)})
    b.keep("g.x1", g_x1)   # the residual stream's gradient, read again at the end

    # Attention branch: x1 = x + dropout(attn(ln_1(x)) W_proj^T + b_proj)
    g_attn = dropout(b, g_x1, b["resid_attn_keep"], p) if p > 0 else g_x1
    give(**{"attn.c_proj.bias": sum_rows(b, g_attn)})
    q, k, v = b["q"], b["k"], b["v"]                                        # (b, h, s, d)
    g_attn = ops.cast(g_attn, dtype)
    b.place("g.attn.c_proj.out", g_attn)
    if cfg.torch_dtype == torch.bfloat16:
        y = b["sdpa_out"]
    else:   # the probabilities recomputed once, for y and for the attention backward
        keep = b["attn_keep"] if p > 0 else None
        probs = causal_probs(b, q, k, cfg)
        dropped = probs if keep is None else dropout(b, probs, keep, p)
        y = ops.matmul(dropped, v)
    y_bse = ops.reshape(ops.permute(y, dims=[0, 2, 1, 3]), new_shape=[bs, s, e])
    give(**{"attn.c_proj.weight": weight_grad(b, g_attn, y_bse, bs * s)})
    g_y = input_grad(b, g_attn, b["attn.c_proj.weight"])                   # (b, s, e), heads over tp
    g_y = ops.permute(ops.reshape(g_y, new_shape=[bs, s, h, d]), dims=[0, 2, 1, 3])   # (b, h, s, d)
    if cfg.torch_dtype == torch.bfloat16:
        g_q, g_k, g_v = ops.sdpfa_bwd(
            g_y, q, k, v, b["sdpa_out"], b["sdpa_lse"], b.define_scalar(p, dtype=DataType.Double),
            b.define_scalar(True, dtype=DataType.Bool), b["sdpa_seed"], b["sdpa_offset"], None)
    else:
        g_q, g_k, g_v = causal_attention_backward(b, g_y, q, k, v, probs, keep, dropped, cfg, p)
    g_qkv = join_heads_grad(b, g_q, g_k, g_v, cfg, form)                  # (b, s, 3e)
    give(**{"attn.c_attn.bias": sum_rows(b, ops.cast(g_qkv, DataType.Float))})
    (g_qkv,) = cut("grad:attn.c_attn", {"g.qkv": ops.cast(g_qkv, dtype)})
    g_x = ln_linear_backward(b, g_qkv, "attn.c_attn", lambda: ops.cast(b["x"], DataType.Float), "ln_1", cfg,
                             give, cut)
    give(grad_x=ops.add(b.value("g.x1"), g_x))
    flush()
