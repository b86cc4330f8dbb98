"""A float64 simulation of a mesh's tp ranks (dp = 1): each rank computes on
its own parameter shards, sliced as the runtime slices them, and under
sequence parallelism on its slice of the sequence outside attention and the
MLP. Between the ranks only the plan's collectives pass: under tensor
parallelism an all-reduce of each row-parallel partial sum (forward) and of
each column-parallel input gradient (backward); under sequence parallelism an
all-gather of the sequence before each column-parallel linear and a
reduce-scatter after each row-parallel one, the other way round backward.
The tests compare it with the reference's autograd: the sharding math, checked
without nvFuser or a GPU."""

import math

import torch

from tpfuser.config import BlockConfig, Layout
from tpfuser.block.tensors import LN_EPS, PARAM_NAMES
from tpfuser.verify.reference import gelu_tanh
from tpfuser.parallel.shard import fusion_params, rank_params


class Collectives:
    """What passes between the tp ranks: under TP the replicated region is whole
    on every rank; under SP each rank holds its slice of the sequence (dim 1)."""

    def __init__(self, layout: Layout):
        self.tp, self.sp = layout.tp, layout.sp

    def scatter(self, t):
        """Each rank's part of a tensor of the replicated region."""
        return list(t.chunk(self.tp, dim=1)) if self.sp else [t] * self.tp

    def gather(self, parts):
        """The whole tensor before a column-parallel linear (SP: an all-gather)."""
        return torch.cat(parts, dim=1) if self.sp else parts[0]

    def reduce(self, partials):
        """Partial sums after a row-parallel linear: all-reduced (TP) or reduce-scattered (SP)."""
        total = sum(partials)
        return list(total.chunk(self.tp, dim=1)) if self.sp else [total] * self.tp


def _simulated_ranks(state, cfg: BlockConfig, layout: Layout) -> list[dict[str, torch.Tensor]]:
    """Every tp rank's parameter shards by name, through the runtime's slicing."""
    layout.check(cfg)
    fparams = fusion_params(state, cfg)
    return [dict(zip(PARAM_NAMES, rank_params(fparams, layout, r))) for r in range(layout.world_size)]


def _layer_norm(x, weight, bias):
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + LN_EPS) * weight + bias


def _rank_attention(ln_1, w, cfg: BlockConfig, tp: int):
    """Column-parallel qkv, attention over this rank's heads, and the partial
    row-parallel projection (no bias): sum over ranks = c_proj(attn) - bias."""
    b, s, _ = ln_1.shape
    h_local, d = cfg.n_head // tp, cfg.head_dim
    qkv = ln_1 @ w["attn.c_attn.weight"].T + w["attn.c_attn.bias"]  # (b, s, 3e/tp), heads outermost
    qkv = qkv.view(b, s, h_local, 3, d)
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))   # (b, h/tp, s, d)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    y = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
    y = y.transpose(1, 2).reshape(b, s, h_local * d)                 # (b, s, e/tp)
    return y @ w["attn.c_proj.weight"].T


def _rank_mlp(ln_2, w):
    return gelu_tanh(ln_2 @ w["mlp.c_fc.weight"].T + w["mlp.c_fc.bias"]) @ w["mlp.c_proj.weight"].T


def _gelu_tanh_grad(x):
    k, c = math.sqrt(2.0 / math.pi), 0.044715
    t = torch.tanh(k * (x + c * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * c * x * x)


def _layer_norm_backward(g, x, weight):
    mean = x.mean(-1, keepdim=True)
    rstd = 1 / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + LN_EPS)
    xhat = (x - mean) * rstd
    gxhat = g * weight
    gx = rstd * (gxhat - gxhat.mean(-1, keepdim=True) - xhat * (gxhat * xhat).mean(-1, keepdim=True))
    return gx, (g * xhat).sum((0, 1)), g.sum((0, 1))


def _rank_attention_backward(g_attn, ln_1, w, cfg: BlockConfig, tp: int):
    """This rank's grads of c_attn (its rows), c_proj (its columns), and its
    partial gradient of ln_1's output (to be summed over tp)."""
    b, s, _ = ln_1.shape
    h_local, d = cfg.n_head // tp, cfg.head_dim
    qkv = (ln_1 @ w["attn.c_attn.weight"].T + w["attn.c_attn.bias"]).view(b, s, h_local, 3, d)
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))            # (b, h/tp, s, d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(~causal, float("-inf")), -1)
    y = (probs @ v).transpose(1, 2).reshape(b, s, h_local * d)               # (b, s, e/tp)
    grads = {"attn.c_proj.weight": g_attn.reshape(b * s, -1).T @ y.reshape(b * s, -1)}
    g_y = (g_attn @ w["attn.c_proj.weight"]).view(b, s, h_local, d).transpose(1, 2)
    g_v = probs.transpose(-2, -1) @ g_y
    g_probs = g_y @ v.transpose(-2, -1)
    g_scores = probs * (g_probs - (g_probs * probs).sum(-1, keepdim=True)) / math.sqrt(d)
    g_q, g_k = g_scores @ k, g_scores.transpose(-2, -1) @ q
    g_qkv = torch.stack([t.transpose(1, 2) for t in (g_q, g_k, g_v)], dim=3).reshape(b, s, -1)  # [h, 3, d] rows
    grads["attn.c_attn.weight"] = g_qkv.reshape(b * s, -1).T @ ln_1.reshape(b * s, -1)
    grads["attn.c_attn.bias"] = g_qkv.sum((0, 1))
    return grads, g_qkv @ w["attn.c_attn.weight"]


def _attention_half(xs, ranks, cfg: BlockConfig, c: Collectives):
    """(ln_1 whole, each rank's x1, ln_2 whole): what the ranks hold up to the MLP."""
    ln_1 = c.gather([_layer_norm(x_r, w["ln_1.weight"], w["ln_1.bias"]) for x_r, w in zip(xs, ranks)])
    attn = c.reduce([_rank_attention(ln_1, w, cfg, c.tp) for w in ranks])
    x1 = [x_r + a_r + w["attn.c_proj.bias"] for x_r, a_r, w in zip(xs, attn, ranks)]
    return ln_1, x1, c.gather([_layer_norm(t, w["ln_2.weight"], w["ln_2.bias"]) for t, w in zip(x1, ranks)])


def simulate_forward(x, state, cfg: BlockConfig, layout: Layout) -> list[torch.Tensor]:
    """The block forward (no dropout) as the tp ranks compute it: each rank's
    output (SP: its slice of the sequence), in x's dtype."""
    c, ranks = Collectives(layout), _simulated_ranks(state, cfg, layout)
    _, x1, ln_2 = _attention_half(c.scatter(x), ranks, cfg, c)
    mlp = c.reduce([_rank_mlp(ln_2, w) for w in ranks])
    return [t + m + w["mlp.c_proj.bias"] for t, m, w in zip(x1, mlp, ranks)]


# Parameters applied to the replicated region: under SP each rank's gradient is
# a partial sum over its slice of the sequence, all-reduced over tp.
REGION_PARAMS = ("ln_1.weight", "ln_1.bias", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_proj.bias")


def simulate_backward(x, grad_out, state, cfg: BlockConfig, layout: Layout, sum_region_grads: bool = True):
    """The block backward (no dropout) as the tp ranks compute it: (each rank's
    input gradient, each rank's parameter-gradient shards in the fusion's qkv
    order). sum_region_grads=False leaves out SP's all-reduce of the region's
    parameter gradients (a test shows it is needed)."""
    c, ranks = Collectives(layout), _simulated_ranks(state, cfg, layout)
    xs, gs = c.scatter(x), c.scatter(grad_out)
    ln_1, x1, ln_2 = _attention_half(xs, ranks, cfg, c)   # recomputed, as the fusion's backward does

    grads = [{} for _ in ranks]
    g_full = c.gather(gs)                                   # backward of the reduce-scatter (SP)
    partial_ln_2 = []
    for r, w in enumerate(ranks):   # MLP: each rank its 4e/tp slice of the hidden
        hid = ln_2 @ w["mlp.c_fc.weight"].T + w["mlp.c_fc.bias"]
        g_h = (g_full @ w["mlp.c_proj.weight"]) * _gelu_tanh_grad(hid)
        grads[r]["mlp.c_proj.weight"] = g_full.reshape(-1, cfg.n_embd).T @ gelu_tanh(hid).reshape(-1, hid.shape[-1])
        grads[r]["mlp.c_proj.bias"] = gs[r].sum((0, 1))
        grads[r]["mlp.c_fc.weight"] = g_h.reshape(-1, g_h.shape[-1]).T @ ln_2.reshape(-1, cfg.n_embd)
        grads[r]["mlp.c_fc.bias"] = g_h.sum((0, 1))
        partial_ln_2.append(g_h @ w["mlp.c_fc.weight"])
    g_x1 = []
    for r, (g_ln_2, w) in enumerate(zip(c.reduce(partial_ln_2), ranks)):
        g, grads[r]["ln_2.weight"], grads[r]["ln_2.bias"] = _layer_norm_backward(g_ln_2, x1[r], w["ln_2.weight"])
        g_x1.append(gs[r] + g)
    g_x1_full = c.gather(g_x1)
    partial_ln_1 = []
    for r, w in enumerate(ranks):   # attention: each rank its heads
        rank_grads, partial = _rank_attention_backward(g_x1_full, ln_1, w, cfg, c.tp)
        grads[r].update(rank_grads)
        grads[r]["attn.c_proj.bias"] = g_x1[r].sum((0, 1))
        partial_ln_1.append(partial)
    grad_x = []
    for r, (g_ln_1, w) in enumerate(zip(c.reduce(partial_ln_1), ranks)):
        g, grads[r]["ln_1.weight"], grads[r]["ln_1.bias"] = _layer_norm_backward(g_ln_1, xs[r], w["ln_1.weight"])
        grad_x.append(g_x1[r] + g)
    if layout.sp and sum_region_grads:
        for name in REGION_PARAMS:
            total = sum(g[name] for g in grads)
            for g in grads:
                g[name] = total
    return grad_x, grads
