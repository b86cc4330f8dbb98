"""Slicing tensors to ranks, the c_attn reordering, and a float64 simulation
of the tensor-parallel ranks that uses the very same slicing.

A rank's slice of a tensor is `local_slice(t, placement, layout, rank)`: for
each dimension its placement names, the tensor is cut into equal contiguous
chunks along that mesh axis (nvFuser's `outer_split`) and the rank keeps the
chunk of its coordinate. The runtime, the tests and the simulation all call it.
"""

from __future__ import annotations

import math

import torch

from tpfuser.config import BlockConfig, Layout
from tpfuser.plan import DP, TP, Placement, PARAM_PLACEMENTS, axis_coords, axis_sizes
from tpfuser.reference import LN_EPS, PARAM_NAMES, gelu_tanh


def local_slice(t: torch.Tensor, placement: Placement, layout: Layout, rank: int) -> torch.Tensor:
    """This rank's contiguous chunk of a global tensor."""
    coords = axis_coords(layout, rank)
    sizes = axis_sizes(layout)
    for dim, axis in placement.items():
        n = sizes[axis]
        if t.shape[dim] % n:
            raise ValueError(f"cannot split dimension {dim} of size {t.shape[dim]} over {axis}={n}")
        t = t.chunk(n, dim=dim)[coords[axis]]
    return t.contiguous()


def slice_starts(shape, placement: Placement, layout: Layout, rank: int) -> list[int]:
    """Where this rank's chunk (local_slice) begins in the global tensor, per dimension."""
    coords = axis_coords(layout, rank)
    sizes = axis_sizes(layout)
    return [coords[placement[d]] * (n // sizes[placement[d]]) if d in placement else 0
            for d, n in enumerate(shape)]


def gather(shards: list[torch.Tensor], placement: Placement, layout: Layout) -> torch.Tensor:
    """Inverse of local_slice: reassemble the global tensor from every rank's shard
    (ranks in order). Ranks that hold replicas of a chunk must agree exactly."""
    by_coords = {layout.rank_coords(r): s for r, s in enumerate(shards)}
    dp_dims = [d for d, a in placement.items() if a == DP]
    tp_dims = [d for d, a in placement.items() if a == TP]
    rows = []
    for i in range(layout.dp):
        row = [by_coords[(i, j)] for j in range(layout.tp)]
        if tp_dims:
            rows.append(torch.cat(row, dim=tp_dims[0]))
        else:
            for j, r in enumerate(row[1:], 1):
                if not torch.equal(r, row[0]):
                    raise AssertionError(f"replicas over tp differ between tp ranks 0 and {j} (dp rank {i})")
            rows.append(row[0])
    if dp_dims:
        return torch.cat(rows, dim=dp_dims[0])
    for i, r in enumerate(rows[1:], 1):
        if not torch.equal(r, rows[0]):
            raise AssertionError(f"replicas over dp differ between dp ranks 0 and {i}")
    return rows[0]


def qkv_heads_interleaved(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder nanoGPT's c_attn rows from blocked [Q; K; V] ([3, h, d]) to head
    by head ([h, 3, d]), the order the fusion takes, so that an outer split of
    the rows over tp gives each rank whole heads of q, k and v.
    Works on the weight [3e, e] and on the bias [3e]."""
    three_e = t.shape[0]
    if three_e % (3 * n_head):
        raise ValueError(f"c_attn has {three_e} rows: expected a multiple of 3 * n_head = {3 * n_head}")
    d = three_e // (3 * n_head)
    rest = t.shape[1:]
    return t.reshape(3, n_head, d, *rest).transpose(0, 1).reshape(three_e, *rest).contiguous()


def qkv_blocked(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of qkv_heads_interleaved."""
    three_e = t.shape[0]
    d = three_e // (3 * n_head)
    rest = t.shape[1:]
    return t.reshape(n_head, 3, d, *rest).transpose(0, 1).reshape(three_e, *rest).contiguous()


def fusion_params(state: dict[str, torch.Tensor], cfg: BlockConfig) -> dict[str, torch.Tensor]:
    """The global parameters in the fusion's convention, from a nanoGPT-style state_dict."""
    out = {name: state[name] for name in PARAM_NAMES}
    for name in ("attn.c_attn.weight", "attn.c_attn.bias"):
        out[name] = qkv_heads_interleaved(out[name], cfg.n_head)
    return out


def rank_params(fparams: dict[str, torch.Tensor], layout: Layout, rank: int) -> list[torch.Tensor]:
    """This rank's parameter shards, in PARAM_NAMES order."""
    return [local_slice(fparams[name], PARAM_PLACEMENTS[name], layout, rank) for name in PARAM_NAMES]


def _simulated_ranks(state, cfg: BlockConfig, layout: Layout) -> list[dict[str, torch.Tensor]]:
    """Every tp rank's parameter shards by name, through the runtime's slicing."""
    layout.check(cfg)
    fparams = fusion_params(state, cfg)
    return [dict(zip(PARAM_NAMES, rank_params(fparams, layout, r))) for r in range(layout.world_size)]


# ---------------------------------------------------------------------------
# A float64 simulation of the tp ranks: each rank computes on its shards only;
# the all-reduce is a sum of the ranks' partial projections.

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


def simulate_tp_forward(x: torch.Tensor, state: dict[str, torch.Tensor], cfg: BlockConfig, tp: int) -> torch.Tensor:
    """The block forward (no dropout) as tp ranks compute it, in the dtype of x.

    Each rank gets its shards through rank_params (the runtime's slicing);
    the partial sums of the row-parallel projections are added (the all-reduce)
    and the replicated bias is added once after the sum."""
    ranks = _simulated_ranks(state, cfg, Layout(dp=1, tp=tp))
    _, x1, ln_2 = _tp_attention_half(x, ranks, cfg, tp)
    return x1 + sum(_rank_mlp(ln_2, w) for w in ranks) + ranks[0]["mlp.c_proj.bias"]


def _tp_attention_half(x, ranks, cfg: BlockConfig, tp: int):
    """(ln_1, x1, ln_2): the activations every tp rank holds up to the MLP."""
    w0 = ranks[0]
    ln_1 = _layer_norm(x, w0["ln_1.weight"], w0["ln_1.bias"])
    x1 = x + sum(_rank_attention(ln_1, w, cfg, tp) for w in ranks) + w0["attn.c_proj.bias"]
    return ln_1, x1, _layer_norm(x1, w0["ln_2.weight"], w0["ln_2.bias"])


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


def simulate_tp_backward(x, grad_out, state, cfg: BlockConfig, tp: int):
    """The block backward (no dropout) as tp ranks compute it, in x's dtype.

    Returns (grad_x, [per-rank dict of parameter-gradient shards, fusion's qkv
    order]). Each rank computes the replicated parts (LayerNorms, residuals)
    itself; the only cross-rank step is the sum of the partial input gradients
    of the two column-parallel linears (Megatron's backward all-reduces)."""
    ranks = _simulated_ranks(state, cfg, Layout(dp=1, tp=tp))
    ln_1, x1, ln_2 = _tp_attention_half(x, ranks, cfg, tp)   # recomputed, as the fusion's backward does

    grads = [{} for _ in range(tp)]
    g_ln_2 = 0
    for r, w in enumerate(ranks):  # MLP: each rank its 4e/tp slice of the hidden
        hid = ln_2 @ w["mlp.c_fc.weight"].T + w["mlp.c_fc.bias"]
        g_h = (grad_out @ w["mlp.c_proj.weight"]) * _gelu_tanh_grad(hid)
        grads[r]["mlp.c_proj.weight"] = grad_out.reshape(-1, cfg.n_embd).T @ gelu_tanh(hid).reshape(-1, hid.shape[-1])
        grads[r]["mlp.c_proj.bias"] = grad_out.sum((0, 1))
        grads[r]["mlp.c_fc.weight"] = g_h.reshape(-1, g_h.shape[-1]).T @ ln_2.reshape(-1, cfg.n_embd)
        grads[r]["mlp.c_fc.bias"] = g_h.sum((0, 1))
        g_ln_2 = g_ln_2 + g_h @ w["mlp.c_fc.weight"]                         # the all-reduce over tp
    g_x1 = grad_out
    for r, w in enumerate(ranks):
        g, grads[r]["ln_2.weight"], grads[r]["ln_2.bias"] = _layer_norm_backward(g_ln_2, x1, w["ln_2.weight"])
        if r == 0:
            g_x1 = grad_out + g
    g_ln_1 = 0
    for r, w in enumerate(ranks):  # attention: each rank its heads
        rank_grads, partial = _rank_attention_backward(g_x1, ln_1, w, cfg, tp)
        grads[r].update(rank_grads)
        grads[r]["attn.c_proj.bias"] = g_x1.sum((0, 1))
        g_ln_1 = g_ln_1 + partial                                            # the all-reduce over tp
    grad_x = None
    for r, w in enumerate(ranks):
        g, grads[r]["ln_1.weight"], grads[r]["ln_1.bias"] = _layer_norm_backward(g_ln_1, x, w["ln_1.weight"])
        if r == 0:
            grad_x = g_x1 + g
    return grad_x, grads


# ---------------------------------------------------------------------------
# Sequence parallelism (tp ranks hold sequence slices outside attention and the
# MLP): all-gather of the sequence before the column-parallel linears,
# reduce-scatter after the row-parallel ones; backward the other way round.

def _seq_slices(t: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    from tpfuser.plan import placements
    return [local_slice(t, placements(layout)["x"], layout, r) for r in range(layout.tp)]


def _all_gather_seq(slices: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(slices, dim=1)


def _reduce_scatter_seq(partials: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(sum(partials).chunk(len(partials), dim=1))


def _sp_attention_half(xs, ranks, cfg: BlockConfig, tp: int):
    """(ln_1 gathered, each rank's x1 slice, ln_2 gathered) under sequence parallelism."""
    ln_1 = _all_gather_seq([_layer_norm(x_r, w["ln_1.weight"], w["ln_1.bias"]) for x_r, w in zip(xs, ranks)])
    attn = _reduce_scatter_seq([_rank_attention(ln_1, w, cfg, tp) for w in ranks])
    x1 = [x_r + a_r + w["attn.c_proj.bias"] for x_r, a_r, w in zip(xs, attn, ranks)]
    return ln_1, x1, _all_gather_seq([_layer_norm(t, w["ln_2.weight"], w["ln_2.bias"]) for t, w in zip(x1, ranks)])


def simulate_sp_forward(x, state, cfg: BlockConfig, tp: int) -> list[torch.Tensor]:
    """The forward (no dropout) as tp sequence-parallel ranks compute it: each
    rank's output slice [b, s/tp, e], from its input slice and its shards."""
    layout = Layout(dp=1, tp=tp, sp=True)
    ranks = _simulated_ranks(state, cfg, layout)
    _, x1, ln_2 = _sp_attention_half(_seq_slices(x, layout), ranks, cfg, tp)
    mlp = _reduce_scatter_seq([_rank_mlp(ln_2, w) for w in ranks])
    return [t + m + w["mlp.c_proj.bias"] for t, m, w in zip(x1, mlp, ranks)]


def simulate_sp_backward(x, grad_out, state, cfg: BlockConfig, tp: int):
    """The backward (no dropout) under sequence parallelism: (each rank's grad_x
    slice, each rank's parameter-gradient shards). Gradients of the parameters
    used on sequence slices (LayerNorms, row-parallel biases) are partial per
    rank and summed over tp (an all-reduce)."""
    layout = Layout(dp=1, tp=tp, sp=True)
    ranks = _simulated_ranks(state, cfg, layout)
    xs, gs = _seq_slices(x, layout), _seq_slices(grad_out, layout)
    ln_1, x1, ln_2 = _sp_attention_half(xs, ranks, cfg, tp)   # recomputed, as the fusion's backward does

    grads = [{} for _ in range(tp)]
    g_full = _all_gather_seq(gs)                               # backward of the reduce-scatter
    partial_ln_2 = []
    for r, w in enumerate(ranks):
        hid = ln_2 @ w["mlp.c_fc.weight"].T + w["mlp.c_fc.bias"]
        g_h = (g_full @ w["mlp.c_proj.weight"]) * _gelu_tanh_grad(hid)
        grads[r]["mlp.c_proj.weight"] = g_full.reshape(-1, cfg.n_embd).T @ gelu_tanh(hid).reshape(-1, hid.shape[-1])
        grads[r]["mlp.c_proj.bias"] = gs[r].sum((0, 1))
        grads[r]["mlp.c_fc.weight"] = g_h.reshape(-1, g_h.shape[-1]).T @ ln_2.reshape(-1, cfg.n_embd)
        grads[r]["mlp.c_fc.bias"] = g_h.sum((0, 1))
        partial_ln_2.append(g_h @ w["mlp.c_fc.weight"])
    g_x1 = []
    for r, (g_ln_2, w) in enumerate(zip(_reduce_scatter_seq(partial_ln_2), ranks)):
        g, grads[r]["ln_2.weight"], grads[r]["ln_2.bias"] = _layer_norm_backward(g_ln_2, x1[r], w["ln_2.weight"])
        g_x1.append(gs[r] + g)
    g_x1_full = _all_gather_seq(g_x1)
    partial_ln_1 = []
    for r, w in enumerate(ranks):
        rank_grads, partial = _rank_attention_backward(g_x1_full, ln_1, w, cfg, tp)
        grads[r].update(rank_grads)
        grads[r]["attn.c_proj.bias"] = g_x1[r].sum((0, 1))
        partial_ln_1.append(partial)
    grad_x = []
    for r, (g_ln_1, w) in enumerate(zip(_reduce_scatter_seq(partial_ln_1), ranks)):
        g, grads[r]["ln_1.weight"], grads[r]["ln_1.bias"] = _layer_norm_backward(g_ln_1, xs[r], w["ln_1.weight"])
        grad_x.append(g_x1[r] + g)
    for name in SP_PARTIAL_GRADS:                              # the all-reduce over tp
        total = sum(g[name] for g in grads)
        for g in grads:
            g[name] = total
    return grad_x, grads


# Parameters applied to sequence slices under SP: their gradients are partial per tp rank.
SP_PARTIAL_GRADS = ("ln_1.weight", "ln_1.bias", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_proj.bias")
