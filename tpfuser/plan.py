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
over dp. The schedule (fusion.py), the weight slicer (shard.py), the `plan`
command and the tests all read the placements below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpfuser.config import BlockConfig, Layout
from tpfuser.reference import param_shapes

# A placement maps a tensor dimension to the mesh axis that splits it.
DP, TP = "dp", "tp"
Placement = dict[int, str]

PARAM_PLACEMENTS: dict[str, Placement] = {
    "ln_1.weight": {}, "ln_1.bias": {},
    "attn.c_attn.weight": {0: TP}, "attn.c_attn.bias": {0: TP},   # column-parallel
    "attn.c_proj.weight": {1: TP}, "attn.c_proj.bias": {},         # row-parallel
    "ln_2.weight": {}, "ln_2.bias": {},
    "mlp.c_fc.weight": {0: TP}, "mlp.c_fc.bias": {0: TP},           # column-parallel
    "mlp.c_proj.weight": {1: TP}, "mlp.c_proj.bias": {},            # row-parallel
}

ACTIVATION_PLACEMENTS: dict[str, Placement] = {
    "x": {0: DP},                      # [b, s, e]
    "out": {0: DP},                    # [b, s, e]
    "resid_attn_keep": {0: DP},        # [b, s, e], replicated over tp as in Megatron
    "resid_mlp_keep": {0: DP},         # [b, s, e]
    "attn_keep": {0: DP, 1: TP},       # [b, h, s, s], heads split over tp
}

# What the training forward saves for backward (fusion.saved_names). Inside
# attention and the MLP the tp layout is the forward's: heads, or the 4e hidden.
SAVED_PLACEMENTS: dict[str, Placement] = {
    "ln_1.mean": {0: DP}, "ln_1.rstd": {0: DP},        # [b, s] float
    "q": {0: DP, 1: TP}, "k": {0: DP, 1: TP}, "v": {0: DP, 1: TP},   # [b, h, s, d], heads over tp
    "sdpa_out": {0: DP, 1: TP},                         # [b, h, s, d] (bf16 only)
    "sdpa_lse": {0: DP, 1: TP},                         # [b, h, s] float
    "sdpa_seed": {}, "sdpa_offset": {},                 # flash attention's philox state, per rank
    "x1": {0: DP},                                      # [b, s, e] float: the residual after attention
    "ln_2.mean": {0: DP}, "ln_2.rstd": {0: DP},
    "mlp_h": {0: DP, 2: TP},                            # [b, s, 4e] before GELU, 4e over tp
}

def saved_specs(cfg: BlockConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (global shape, dtype) of what the training forward saves, in the
    order the backward takes them. dtype: "block" (bf16/fp32), "f32", "u64" or "bool".
    The fusion's dropout masks are saved (one byte an element, as eager PyTorch
    saves them), not drawn again: nvFuser 0.2.36 fails to compile the hash in the
    meshed backward (NOTES.md). Flash attention's (bf16) is replayed from its philox state."""
    b, s, e, h, d = cfg.batch, cfg.seq, cfg.n_embd, cfg.n_head, cfg.head_dim
    specs = {"ln_1.mean": ((b, s), "f32"), "ln_1.rstd": ((b, s), "f32"),
             **{name: ((b, h, s, d), "block") for name in ("q", "k", "v")}}
    if cfg.dtype == "bf16":
        specs |= {"sdpa_out": ((b, h, s, d), "block"), "sdpa_lse": ((b, h, s), "f32"),
                  "sdpa_seed": ((2,), "u64"), "sdpa_offset": ((), "u64")}
    specs |= {"x1": ((b, s, e), "f32"), "ln_2.mean": ((b, s), "f32"), "ln_2.rstd": ((b, s), "f32"),
              "mlp_h": ((b, s, 4 * e), "block")}
    if cfg.dropout > 0:
        specs |= {"resid_attn_keep": ((b, s, e), "bool"), "resid_mlp_keep": ((b, s, e), "bool")}
        if cfg.dtype == "fp32":
            specs |= {"attn_keep": ((b, h, s, s), "bool")}
    return specs


def saved_bytes_per_rank(cfg: BlockConfig, layout: Layout) -> int:
    """What the training forward keeps for backward on one rank (the input x, kept by autograd, included)."""
    sizes = {"block": cfg.torch_dtype.itemsize, "f32": 4, "u64": 8, "bool": 1}
    total = 0
    specs = saved_specs(cfg) | {"x": ((cfg.batch, cfg.seq, cfg.n_embd), "block")}
    where = placements(layout)
    for name, (shape, dtype) in specs.items():
        total += math.prod(local_shape(shape, where[name], layout)) * sizes[dtype]
    return total


# Backward: the upstream gradient and the input gradient are laid out like the
# output and the input; every parameter gradient like its parameter. Parameter
# gradients are replicated over dp: the backward runs on each dp rank's tp row
# and the runtime sums them over dp after it (fusion.build_backward says why);
# the input gradient's tp partial sums (from the two column-parallel linears)
# are all-reduced over tp inside it, where Megatron reduces them.
GRAD_PLACEMENTS: dict[str, Placement] = {
    "grad_out": {0: DP}, "grad_x": {0: DP},
    **{f"grad.{name}": placement for name, placement in PARAM_PLACEMENTS.items()},
}

# Intermediates of the backward that the schedule places too, where the
# collectives go (as nvFuser's own sequence-parallel backward test does):
# the gradients at the row-parallel linears' outputs and the recomputed
# LayerNorm outputs, which the linears' gradients read whole (under SP:
# all-gathered), and the gradients at the LayerNorms' outputs, the
# column-parallel linears' input gradients summed over tp (all-reduced; under
# SP reduce-scattered).
BACKWARD_INTERMEDIATES: dict[str, Placement] = {
    "g.mlp.c_proj.out": {0: DP}, "g.attn.c_proj.out": {0: DP},   # [b, s, e]
    "ln_2.out": {0: DP}, "ln_1.out": {0: DP},                     # [b, s, e]
    "g.ln_2.out": {0: DP}, "g.ln_1.out": {0: DP},                 # [b, s, e] float
}

PLACEMENTS: dict[str, Placement] = {**PARAM_PLACEMENTS, **ACTIVATION_PLACEMENTS, **SAVED_PLACEMENTS,
                                    **GRAD_PLACEMENTS, **BACKWARD_INTERMEDIATES}

# Sequence parallelism: what tensor parallelism replicates over tp (the block's
# input and output, LayerNorms, residuals, residual dropouts) is split on the
# sequence over tp instead. Inside attention and the MLP nothing changes.
SP_OVERRIDES: dict[str, Placement] = {
    name: {0: DP, 1: TP} for name in ("x", "out", "resid_attn_keep", "resid_mlp_keep", "ln_1.mean", "ln_1.rstd",
                                      "x1", "ln_2.mean", "ln_2.rstd", "grad_out", "grad_x", "g.ln_2.out", "g.ln_1.out")}


def placements(layout: Layout) -> dict[str, Placement]:
    """Every named tensor's placement under this layout's parallelism."""
    return {**PLACEMENTS, **SP_OVERRIDES} if layout.sp else PLACEMENTS


def local_shape(shape: tuple[int, ...], placement: Placement, layout: Layout) -> tuple[int, ...]:
    sizes = {DP: layout.dp, TP: layout.tp}
    out = list(shape)
    for dim, axis in placement.items():
        if out[dim] % sizes[axis]:
            raise ValueError(f"dimension {dim} of size {out[dim]} is not divisible by {axis}={sizes[axis]}")
        out[dim] //= sizes[axis]
    return tuple(out)


@dataclass(frozen=True)
class Collective:
    kind: str               # "allreduce", "allgather" or "reducescatter"
    axis: str               # mesh axis of the team
    where: str              # "after <op>" or "before <op>"
    shape: tuple[int, ...]  # the tensor unsharded over the team (per dp rank)
    dtype_bytes: int
    team: int               # ranks in the team

    @property
    def bytes_per_rank(self) -> int:
        """Size of the tensor the collective produces (all-reduce, all-gather) or consumes (reduce-scatter)."""
        return math.prod(self.shape) * self.dtype_bytes

    @property
    def wire_bytes_per_rank(self) -> int:
        """What each rank sends with ring algorithms: 2(n-1)/n of the tensor for an
        all-reduce, (n-1)/n for an all-gather or a reduce-scatter."""
        factor = 2 if self.kind == "allreduce" else 1
        return factor * (self.team - 1) * self.bytes_per_rank // self.team


def collectives(cfg: BlockConfig, layout: Layout) -> list[Collective]:
    """The forward's collectives over tp, in order; none over dp. Tensor
    parallel: an all-reduce after each row-parallel linear. Sequence parallel:
    an all-gather of the sequence before each column-parallel linear and a
    reduce-scatter after each row-parallel one (the same bytes on the wire).
    With tp == 1 the teams have one rank and move nothing."""
    b, s, e = cfg.batch // layout.dp, cfg.seq, cfg.n_embd
    nbytes, tp = cfg.torch_dtype.itemsize, layout.tp
    if not layout.sp:
        return [Collective("allreduce", TP, "after attn.c_proj", (b, s, e), nbytes, tp),
                Collective("allreduce", TP, "after mlp.c_proj", (b, s, e), nbytes, tp)]
    return [Collective("allgather", TP, "before attn.c_attn", (b, s, e), nbytes, tp),
            Collective("reducescatter", TP, "after attn.c_proj", (b, s, e), nbytes, tp),
            Collective("allgather", TP, "before mlp.c_fc", (b, s, e), nbytes, tp),
            Collective("reducescatter", TP, "after mlp.c_proj", (b, s, e), nbytes, tp)]


def backward_collectives(cfg: BlockConfig, layout: Layout) -> list[Collective]:
    """The backward's collectives over tp, in Megatron's order (the MLP's first).
    Tensor parallel: an all-reduce of the input gradient's partial sums after
    each column-parallel linear (the row-parallel ones need none). Sequence
    parallel: an all-gather of the upstream gradient before each row-parallel
    linear, an all-gather of the LayerNorm output (recomputed on the rank's part
    of the sequence) for each column-parallel weight gradient, and a
    reduce-scatter of each column-parallel input gradient. Then, when dp > 1,
    the one all-reduce over dp of all this rank's parameter gradients, in fp32,
    after the fusion (through torch.distributed: runtime.ShardedBlock.backward)."""
    b, s, e = cfg.batch // layout.dp, cfg.seq, cfg.n_embd
    nbytes, tp = cfg.torch_dtype.itemsize, layout.tp
    out = []
    for row, column in (("mlp.c_proj", "mlp.c_fc"), ("attn.c_proj", "attn.c_attn")):
        if layout.sp:
            out += [Collective("allgather", TP, f"before {row} backward", (b, s, e), nbytes, tp),
                    Collective("allgather", TP, f"before {column} weight gradient", (b, s, e), nbytes, tp),
                    Collective("reducescatter", TP, f"after {column} input gradient", (b, s, e), nbytes, tp)]
        else:
            out.append(Collective("allreduce", TP, f"after {column} input gradient", (b, s, e), nbytes, tp))
    if layout.dp > 1:
        n = sum(math.prod(local_shape(shape, PARAM_PLACEMENTS[name], layout)) for name, shape in param_shapes(cfg).items())
        out.append(Collective("allreduce", DP, "after the backward fusion (every parameter gradient, by the runtime)", (n,), 4, layout.dp))
    return out


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
