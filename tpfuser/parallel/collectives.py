"""The block's collectives as values: one record per collective of each pass,
derived once from the layout and the schedule.

Megatron-LM's regions (Korthikanti et al., 2022, table 1), per tensor-parallel
linear, each transition named once by its `site`:

  forward   column-parallel: "input"   all-gathered before the GEMM (SP only)
            row-parallel:    "output"  all-reduced (TP) or reduce-scattered (SP) after it
  backward  row-parallel:    "grad_output"   the upstream gradient all-gathered before
                                             both gradient GEMMs (SP only)
            column-parallel: "weight_input"  the LayerNorm output all-gathered again
                                             for the weight gradient (SP only)
            column-parallel: "grad_input"    the input gradient's partial sums all-reduced
                                             (TP) or reduce-scattered (SP)
            "param_grad"     a parameter tp does not split, summed over the sequence
                             shards (SP only: the LayerNorms, the row-parallel biases)
            "dp_grads"       every parameter gradient summed over dp (the runtime's, dp > 1)

How each runs is the schedule's (`algorithm`): "whole" (one collective),
"fusions" or "streams" (cut into `chunks` along the tokens, each beside
another chunk's GEMM), or "ring" (nvFuser's P2P decomposition: `chunks` = tp
steps, each a send/recv of one rank's chunk beside the GEMM on the chunk in
hand, by NCCL or the copy engine: `backend`). Where the schedule asks for an
algorithm that this collective cannot take, it runs whole and `whole_because`
says why. The plan report, the timeline model, the check's comparison with
what nvFuser posted and the runtime's chunked linears all read these records.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from tpfuser.block.tensors import param_shapes
from tpfuser.config import BlockConfig, Layout
from tpfuser.parallel.placements import DP, LINEAR_STYLES, PARAM_PLACEMENTS, TP, local_shape

KINDS = ("allreduce", "allgather", "reducescatter")
PHASES = ("forward", "backward")
SITES = ("input", "output", "grad_output", "weight_input", "grad_input", "param_grad", "dp_grads")
ALGORITHMS = ("whole", "fusions", "streams", "ring")

# The tensor each linear's collective moves, by (linear, site): the block's names (block/tensors.py).
TENSORS = {
    ("attn.c_attn", "input"): "ln_1.out", ("mlp.c_fc", "input"): "ln_2.out",
    ("attn.c_proj", "output"): "attn.c_proj.out", ("mlp.c_proj", "output"): "mlp.c_proj.out",
    ("attn.c_proj", "grad_output"): "g.attn.c_proj.out", ("mlp.c_proj", "grad_output"): "g.mlp.c_proj.out",
    ("attn.c_attn", "weight_input"): "ln_1.out.whole", ("mlp.c_fc", "weight_input"): "ln_2.out.whole",
    ("attn.c_attn", "grad_input"): "attn.c_attn.grad_in", ("mlp.c_fc", "grad_input"): "mlp.c_fc.grad_in",
}


@dataclass(frozen=True)
class Collective:
    """One collective of one pass on one rank's team."""

    kind: str                # KINDS
    axis: str                # the mesh axis of the team: "tp" or "dp"
    phase: str               # PHASES
    site: str                # SITES: where in the pass it sits
    linear: str              # the linear whose collective it is; param_grad: the row-parallel linear ending the region
    tensor: str              # what it moves (block/tensors.py's name; param_grad: the parameter's)
    shape: tuple[int, ...]   # the tensor unsharded over the team (per dp rank)
    dtype_bytes: int
    team: int                # ranks in the team
    algorithm: str = "whole"   # ALGORITHMS
    chunks: int = 1          # stream chunks, or a ring's steps (tp)
    backend: str = "nccl"    # nvFuser's communicator backend: nccl, or cuda (the copy engine) for a ring
    whole_because: str = ""  # the schedule asked for another algorithm and this one cannot take it: why

    @property
    def tensor_bytes(self) -> int:
        """Size of the tensor the collective produces (all-reduce, all-gather) or consumes (reduce-scatter)."""
        return math.prod(self.shape) * self.dtype_bytes

    @property
    def wire_bytes_per_rank(self) -> int:
        """What each rank sends with ring algorithms (NCCL's, or nvFuser's P2P ring alike):
        2(n-1)/n of the tensor for an all-reduce, (n-1)/n for an all-gather or a reduce-scatter."""
        factor = 2 if self.kind == "allreduce" else 1
        return factor * (self.team - 1) * self.tensor_bytes // self.team

    @property
    def p2p_steps(self) -> int:
        """A ring's steps that send and receive (one of its `chunks` steps is the rank's own chunk); 0 otherwise."""
        return self.team - 1 if self.algorithm == "ring" else 0

    @property
    def step_bytes(self) -> int:
        """What one step of a ring sends (and receives): one rank's chunk of the tensor."""
        return self.tensor_bytes // self.team

    @property
    def where(self) -> str:
        """The collective in words, for people (never parsed)."""
        return {"input": f"before {self.linear}", "output": f"after {self.linear}",
                "grad_output": f"before {self.linear} backward",
                "weight_input": f"before {self.linear} weight gradient",
                "grad_input": f"after {self.linear} input gradient",
                "param_grad": f"{self.tensor} gradient (partial sums over the sequence shards)",
                "dp_grads": "after the backward fusion (every parameter gradient, by the runtime)"}[self.site]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["shape"] = list(self.shape)
        out |= {"where": self.where, "tensor_bytes": self.tensor_bytes, "wire_bytes_per_rank": self.wire_bytes_per_rank}
        if self.algorithm == "ring":
            out |= {"p2p_steps": self.p2p_steps, "step_bytes": self.step_bytes}
        if not self.whole_because:
            out.pop("whole_because")
        return out


# Why a collective of a chunked linear runs whole, by what it is and the algorithm asked.
NOT_LOWERED = ("nvFuser 0.2.36 does not lower a reduce-scatter chunked on its stream axis "
               "(it asserts: docs/overlap.md)")
FEEDS_WEIGHT_GRADIENT = ("the gathered gradient feeds the weight gradient too: chunking the gather and both "
                         "matmuls is not built")
RING_FEEDS_WEIGHT_GRADIENT = ("the gathered gradient feeds the weight gradient too, and nvFuser's ring returns the "
                              "product, not the gathered tensor (docs/overlap.md)")
WHOLE_LAYERNORM = "the weight gradient reads the whole gathered LayerNorm output: not chunked"
ONE_RANK = "a ring over a team of one sends nothing: the linear runs whole"
STREAMS_FORWARD_ONLY = ("nvFuser's stream axis is applied to the forward's linears only here "
                        "(the fusions form chunks the backward's)")


def whole_because(algorithm: str, kind: str, phase: str, site: str) -> str:
    """Why a linear's collective runs whole although its schedule chunks the linear ('' where it does not)."""
    if site == "weight_input":
        return WHOLE_LAYERNORM
    if site == "grad_output":
        return RING_FEEDS_WEIGHT_GRADIENT if algorithm == "ring" else FEEDS_WEIGHT_GRADIENT
    if algorithm == "streams" and kind == "reducescatter":
        return NOT_LOWERED
    if algorithm == "streams" and phase == "backward":
        return STREAMS_FORWARD_ONLY
    return ""


def _as_run(c: Collective, schedule, tp: int) -> Collective:
    """c as the schedule runs it: its algorithm, chunks (a ring's: tp steps) and backend, or whole and why."""
    if schedule is None or not c.linear or c.site == "param_grad":
        return c
    plan = schedule.linears[c.linear]
    if plan.overlap == "none":
        return c
    why = whole_because(plan.overlap, c.kind, c.phase, c.site) or (ONE_RANK if plan.overlap == "ring" and tp == 1
                                                                   else "")
    if why:
        return replace(c, whole_because=why)
    return replace(c, algorithm=plan.overlap, chunks=tp if plan.overlap == "ring" else plan.chunks,
                   backend=plan.collective)


def _pairs() -> list[tuple[str, str]]:
    """(column-parallel linear, the row-parallel one after it): attention's and the MLP's."""
    names = list(LINEAR_STYLES)
    return [(col, row) for col, row in zip(names, names[1:])
            if (LINEAR_STYLES[col], LINEAR_STYLES[row]) == ("column", "row")]


def forward_collectives(cfg: BlockConfig, layout: Layout, schedule=None) -> list[Collective]:
    """The forward's collectives over tp, in order; none over dp. Tensor
    parallel: an all-reduce after each row-parallel linear. Sequence parallel:
    an all-gather of the sequence before each column-parallel linear and a
    reduce-scatter after each row-parallel one (the same bytes on the wire).
    With tp == 1 the teams have one rank and move nothing."""
    whole = ((cfg.batch // layout.dp, cfg.seq, cfg.n_embd), cfg.torch_dtype.itemsize, layout.tp)
    out = []
    for linear, style in LINEAR_STYLES.items():
        if style == "column" and layout.sp:
            out.append(Collective("allgather", TP, "forward", "input", linear, TENSORS[linear, "input"], *whole))
        elif style == "row":
            out.append(Collective("reducescatter" if layout.sp else "allreduce", TP, "forward", "output", linear,
                                  TENSORS[linear, "output"], *whole))
    return [_as_run(c, schedule, layout.tp) for c in out]


def backward_collectives(cfg: BlockConfig, layout: Layout, schedule=None) -> list[Collective]:
    """The backward's collectives, in Megatron's order (the MLP's first). Tensor
    parallel: an all-reduce of each column-parallel linear's input gradient.
    Sequence parallel: the upstream gradient all-gathered before each
    row-parallel linear's gradients, the LayerNorm output all-gathered again
    for each column-parallel weight gradient, each column-parallel input
    gradient reduce-scattered, and each gradient tp does not split (the
    LayerNorms', the row-parallel biases') all-reduced, each rank's being a sum
    over its part of the sequence only, in fp32. Then, when dp > 1, one
    all-reduce over dp of every parameter gradient of the rank, in fp32, after
    the backward's fusions (runtime.ShardedBlock.backward)."""
    whole = ((cfg.batch // layout.dp, cfg.seq, cfg.n_embd), cfg.torch_dtype.itemsize, layout.tp)
    out = []
    for column, row in reversed(_pairs()):
        if layout.sp:
            out += [Collective("allgather", TP, "backward", "grad_output", row, TENSORS[row, "grad_output"], *whole),
                    Collective("allgather", TP, "backward", "weight_input", column, TENSORS[column, "weight_input"],
                               *whole),
                    Collective("reducescatter", TP, "backward", "grad_input", column, TENSORS[column, "grad_input"],
                               *whole)]
            out += [Collective("allreduce", TP, "backward", "param_grad", row, name, shape, 4, layout.tp)
                    for name, shape in sequence_summed_params(cfg, row)]
        else:
            out.append(Collective("allreduce", TP, "backward", "grad_input", column, TENSORS[column, "grad_input"],
                                  *whole))
    if layout.dp > 1:
        n = sum(math.prod(local_shape(shape, PARAM_PLACEMENTS[name], layout))
                for name, shape in param_shapes(cfg).items())
        out.append(Collective("allreduce", DP, "backward", "dp_grads", "", "every parameter gradient", (n,), 4,
                              layout.dp))
    return [_as_run(c, schedule, layout.tp) for c in out]


def sequence_summed_params(cfg: BlockConfig, row: str) -> list[tuple[str, tuple[int, ...]]]:
    """Under sequence parallelism, the parameters of the region that ends with
    the row-parallel linear `row` which tp does not split (its LayerNorm, its
    bias): each rank's gradient is a sum over its part of the sequence only,
    so the backward all-reduces it over tp (Megatron sums them the same way,
    outside its fusions). Parameter order as in PARAM_PLACEMENTS."""
    ends = {f"{linear}.bias": linear for linear, style in LINEAR_STYLES.items() if style == "row"}
    regions, region = {}, []   # the parameters up to and including each row-parallel linear's bias
    for name in PARAM_PLACEMENTS:
        region.append(name)
        if name in ends:
            regions[ends[name]], region = region, []
    if row not in regions:
        raise ValueError(f"{row}: not a row-parallel linear with a bias ({', '.join(regions)})")
    shapes = param_shapes(cfg)
    return [(name, shapes[name]) for name in regions[row] if TP not in PARAM_PLACEMENTS[name].values()]


def all_collectives(cfg: BlockConfig, layout: Layout, schedule=None) -> list[Collective]:
    """Both passes' collectives, the forward's first."""
    return forward_collectives(cfg, layout, schedule) + backward_collectives(cfg, layout, schedule)


def cut_point(site: str, linear: str) -> str:
    """The cut point where the fusion a runner takes over begins: the linear's own in the forward (site input or
    output), its input-gradient matmul's in the backward (grad_input)."""
    return f"grad:{linear}.in" if site == "grad_input" else linear


def runner_sites(style: str) -> list[tuple[str, str, str]]:
    """(phase, site, kind) of the collectives a runner may take over from a linear of this style (column, row,
    column-sp, row-sp): the forward's gather or reduction, a column-parallel input gradient's reduction."""
    sp = style.endswith("-sp")
    reduce = "reducescatter" if sp else "allreduce"
    if style.startswith("column"):
        return ([("forward", "input", "allgather")] if sp else []) + [("backward", "grad_input", reduce)]
    return [("forward", "output", reduce)]


def runs_beside_gemm(c: Collective) -> bool:
    """Whether the runtime runs this collective with its linear's GEMM, chunked or as a ring (a fusion of its own
    replaced by the runner of its algorithm): the forward's gathers and reductions and the backward's input
    gradients' reductions."""
    return c.algorithm != "whole" and c.site in ("input", "output", "grad_input")
