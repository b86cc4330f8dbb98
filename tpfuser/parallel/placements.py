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
(`placement`); the schedule (schedule.py), the weight slicer (shard.py), the
`plan` command and the tests all read `placements`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tpfuser.config import BlockConfig, Layout
from tpfuser.block.tensors import param_shapes
from tpfuser.block.tensors import TENSORS, TP_DIMS, Tensor, saved
from tpfuser.parallel.chunking import collective_chunks

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
    over dp after it (schedule.build_pass says why)."""
    return {t.name: placement(t, layout.sp) for t in TENSORS}


def local_shape(shape: tuple[int, ...], placement: Placement, layout: Layout) -> tuple[int, ...]:
    sizes = axis_sizes(layout)
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
    linear: str = ""        # the linear whose collective it is (its input gradient's, in the backward)
    chunks: int = 1         # stream chunks along the tokens, each beside another chunk's GEMM
    whole_because: str = ""   # where the schedule chunks the linear but this collective runs whole: why

    @property
    def tensor_bytes(self) -> int:
        """Size of the tensor the collective produces (all-reduce, all-gather) or consumes (reduce-scatter)."""
        return math.prod(self.shape) * self.dtype_bytes

    @property
    def wire_bytes_per_rank(self) -> int:
        """What each rank sends with ring algorithms: 2(n-1)/n of the tensor for an
        all-reduce, (n-1)/n for an all-gather or a reduce-scatter."""
        factor = 2 if self.kind == "allreduce" else 1
        return factor * (self.team - 1) * self.tensor_bytes // self.team


# The block's linears in order, by the dimension tensor parallelism splits
# their weight on: its output rows (column-parallel) or its input columns
# (row-parallel). The collectives follow from them.
LINEARS: list[tuple[str, str]] = [(name.removesuffix(".weight"), "column" if dim == 0 else "row")
                                  for name, placement in PARAM_PLACEMENTS.items() if name.endswith(".weight")
                                  for dim in placement]


def _chunked(c: Collective, schedule, phase: str) -> Collective:
    """c as the schedule runs it: its stream chunks, or why it runs whole (chunking.collective_chunks)."""
    if schedule is None or not c.linear:
        return c
    chunks, why = collective_chunks(schedule, c.linear, c.kind, phase)
    return dataclasses.replace(c, chunks=chunks, whole_because=why)


def collectives(cfg: BlockConfig, layout: Layout, schedule=None) -> list[Collective]:
    """The forward's collectives over tp, in order; none over dp. Tensor
    parallel: an all-reduce after each row-parallel linear. Sequence parallel:
    an all-gather of the sequence before each column-parallel linear and a
    reduce-scatter after each row-parallel one (the same bytes on the wire).
    With tp == 1 the teams have one rank and move nothing. With a schedule,
    each as it runs: in chunks, or whole and why."""
    whole = ((cfg.batch // layout.dp, cfg.seq, cfg.n_embd), cfg.torch_dtype.itemsize, layout.tp)
    out = []
    for linear, kind in LINEARS:
        if kind == "column" and layout.sp:
            out.append(Collective("allgather", TP, f"before {linear}", *whole, linear=linear))
        elif kind == "row":
            out.append(Collective("reducescatter" if layout.sp else "allreduce", TP, f"after {linear}", *whole,
                                  linear=linear))
    return [_chunked(c, schedule, "forward") for c in out]


def backward_collectives(cfg: BlockConfig, layout: Layout, schedule=None) -> list[Collective]:
    """The backward's collectives over tp, in Megatron's order (the MLP's first):
    for each row-parallel linear and the column-parallel one before it, walked
    backwards. Tensor parallel: an all-reduce of the input gradient's partial
    sums after each column-parallel linear (the row-parallel ones need none).
    Sequence parallel: an all-gather of the upstream gradient before each
    row-parallel linear, an all-gather of the LayerNorm output (recomputed on
    the rank's part of the sequence) for each column-parallel weight gradient,
    and a reduce-scatter of each column-parallel input gradient; and an all-reduce
    of each gradient tp does not split (LayerNorms, row-parallel biases), each
    rank's being a sum over its part of the sequence only. Then, when
    dp > 1, the one all-reduce over dp of all this rank's parameter gradients,
    in fp32, after the fusion (through torch.distributed: runtime.ShardedBlock.backward).
    With a schedule, each as it runs: in chunks, or whole and why."""
    whole = ((cfg.batch // layout.dp, cfg.seq, cfg.n_embd), cfg.torch_dtype.itemsize, layout.tp)
    pairs = [(row, column) for (column, c), (row, r) in zip(LINEARS, LINEARS[1:]) if (c, r) == ("column", "row")]
    out = []
    for row, column in reversed(pairs):
        if layout.sp:
            out += [Collective("allgather", TP, f"before {row} backward", *whole, linear=row),
                    Collective("allgather", TP, f"before {column} weight gradient", *whole, linear=column),
                    Collective("reducescatter", TP, f"after {column} input gradient", *whole, linear=column)]
            out += [Collective("allreduce", TP, f"{name} gradient (partial sums over the sequence shards)",
                               shape, 4, layout.tp)   # summed in fp32 (ops.sum_rows, the LayerNorm backward)
                    for name, shape in _sequence_summed_params(cfg, row)]
        else:
            out.append(Collective("allreduce", TP, f"after {column} input gradient", *whole, linear=column))
    if layout.dp > 1:
        n = sum(math.prod(local_shape(shape, PARAM_PLACEMENTS[name], layout)) for name, shape in param_shapes(cfg).items())
        out.append(Collective("allreduce", DP, "after the backward fusion (every parameter gradient, by the runtime)", (n,), 4, layout.dp))
    return [_chunked(c, schedule, "backward" if "weight gradient" not in c.where else "backward weight")
            for c in out]


def _sequence_summed_params(cfg: BlockConfig, row: str) -> list[tuple[str, tuple[int, ...]]]:
    """Under sequence parallelism, the parameters of the region that ends with
    the row-parallel linear `row` which tp does not split (its LayerNorm, its
    bias): each rank's gradient is a sum over its part of the sequence only,
    so the backward all-reduces it over tp (Megatron sums them the same way,
    outside its fusions). Parameter order as in PARAM_PLACEMENTS."""
    regions, region = {}, []   # the parameters up to and including each row-parallel linear's bias
    for name in PARAM_PLACEMENTS:
        region.append(name)
        if name.endswith(".bias") and (name.removesuffix(".bias"), "row") in LINEARS:
            regions[name.removesuffix(".bias")], region = region, []
    if row not in regions:
        raise ValueError(f"{row}: not a row-parallel linear with a bias ({', '.join(regions)})")
    shapes = param_shapes(cfg)
    return [(name, shapes[name]) for name in regions[row] if TP not in PARAM_PLACEMENTS[name].values()]


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
