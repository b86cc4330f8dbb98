"""The sharding plan, as data: which tensor dimension each mesh axis splits.

Megatron-LM tensor parallelism (Shoeybi et al., 2019) on a dp x tp mesh:

  qkv    = ln_1(x) @ W_attn^T   W_attn split by output rows (column-parallel):
                                each tp rank owns whole heads of q, k and v.
  y_attn = attn   @ W_proj^T    W_proj split by input columns (row-parallel):
                                partial sums, all-reduced over tp, bias added once.
  h      = ln_2(.) @ W_fc^T     column-parallel (the 4e MLP hidden split over tp).
  y_mlp  = gelu(h) @ W_proj2^T  row-parallel, all-reduced over tp.

LayerNorms, residuals and the residual dropouts are replicated over tp. The
batch is split over dp everywhere and never resharded; weights are replicated
over dp. Each tensor's placement follows from its dimensions in tensors.py
(`placement`); the schedule (passes.py), the weight slicer (shard.py), the
`plan` command and the tests all read `placements`.
"""

from __future__ import annotations

import math

from tpfuser.config import BlockConfig, Layout
from tpfuser.block.form import LINEARS
from tpfuser.block.tensors import TENSORS, TP_DIMS, Tensor, saved

# A placement maps a tensor dimension to the mesh axis that splits it.
DP, TP = "dp", "tp"
Placement = dict[int, str]

def placement(tensor: Tensor, sp: bool = False) -> Placement:
    """Which mesh axis splits each dimension of a tensor (tensors.py): the batch
    over dp; heads, the heads' concatenation, c_attn's rows and the MLP hidden
    over tp; with sequence parallelism the sequence over tp too, where tensor
    parallelism would replicate it."""
    where = {}
    for i, dim in enumerate(tensor.dims):
        if dim == "b":
            where[i] = DP
        elif dim in TP_DIMS or (dim == "s" and sp and tensor.seq_split):
            where[i] = TP
    return where


PARAM_PLACEMENTS: dict[str, Placement] = {t.name: placement(t) for t in TENSORS if t.role == "param"}


def axis_sizes(layout: Layout) -> dict[str, int]:
    """How many ranks each mesh axis has."""
    return {DP: layout.dp, TP: layout.tp}


def axis_coords(layout: Layout, rank: int) -> dict[str, int]:
    """Where a rank sits on each mesh axis."""
    return dict(zip((DP, TP), layout.rank_coords(rank)))


def saved_specs(cfg: BlockConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (global shape, dtype) of what the training forward saves, in the
    order the backward takes them (tensors.saved). The fusion's dropout masks
    are saved (one byte an element, as eager PyTorch saves them), not drawn
    again: nvFuser 0.2.36 fails to compile the hash in the meshed backward
    (NOTES-history.md). Flash attention's (bf16) is replayed from its philox state."""
    return {t.name: (t.shape(cfg), t.dtype) for t in saved(cfg)}


def saved_bytes_per_rank(cfg: BlockConfig, layout: Layout) -> int:
    """What the training forward keeps for backward on one rank (the input x, kept by autograd, included)."""
    sizes = {"block": cfg.torch_dtype.itemsize, "f32": 4, "u64": 8, "bool": 1}
    total = 0
    specs = saved_specs(cfg) | {"x": ((cfg.batch, cfg.seq, cfg.n_embd), "block")}
    where = placements(layout)
    for name, (shape, dtype) in specs.items():
        total += math.prod(local_shape(shape, where[name], layout)) * sizes[dtype]
    return total


def placements(layout: Layout) -> dict[str, Placement]:
    """Every named tensor's placement under this layout's parallelism.
    Parameter gradients are laid out like their parameters and replicated over
    dp: the backward runs on each dp rank's tp row and the runtime sums them
    over dp after it (passes.build_pass says why)."""
    return {t.name: placement(t, layout.sp) for t in TENSORS}


def local_shape(shape: tuple[int, ...], placement: Placement, layout: Layout) -> tuple[int, ...]:
    sizes = axis_sizes(layout)
    out = list(shape)
    for dim, axis in placement.items():
        if out[dim] % sizes[axis]:
            raise ValueError(f"dimension {dim} of size {out[dim]} is not divisible by {axis}={sizes[axis]}")
        out[dim] //= sizes[axis]
    return tuple(out)


# The block's linears in order (block/form.py), each with the parallel style its weight's split
# gives it: its output rows over tp (column-parallel) or its input columns (row-parallel).
LINEAR_STYLES: dict[str, str] = {linear: "column" if PARAM_PLACEMENTS[f"{linear}.weight"] == {0: TP} else "row"
                                 for linear in LINEARS}


def forward_flops(cfg: BlockConfig, layout: Layout = Layout()) -> dict[str, int]:
    """Matmul FLOPs of the forward per rank (2 per multiply-add). Attention
    counts the causal half of q k^T and probs v, as flash attention computes."""
    b, s, e, f = cfg.batch // layout.dp, cfg.seq, cfg.n_embd, 4 * cfg.n_embd
    tp = layout.tp
    flops = {
        "attn.c_attn": 2 * b * s * e * 3 * e // tp,
        "attention": 2 * 2 * b * s * s * e // tp // 2,
        "attn.c_proj": 2 * b * s * e * e // tp,
        "mlp.c_fc": 2 * b * s * e * f // tp,
        "mlp.c_proj": 2 * b * s * f * e // tp,
    }
    flops["total"] = sum(flops.values())
    return flops
