"""Putting the block's passes on the dp x tp mesh: `build_pass` defines a pass
(block/forward.py, block/backward.py) as its fusions and places every tensor
that enters or leaves each, or that the pass names for placement, as
placements.placements(layout) says; nvFuser propagates the sharding to the
rest and inserts the collectives.

Derived splits: a row-parallel linear's output that leaves its fusion (the
pass cut right after the linear) has its reduction axis split over tp too, as
nvFuser's own reduce-scatter test writes it; without that split nvFuser 0.2.36
accepts the fusion and returns wrong numbers (a reduce-scatter whose output is
not summed). `validate` refuses any linear output left split without it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import nvfuser_direct as nvf
from nvfuser_direct import ParallelType

from tpfuser.block.backward import backward_order, define_backward
from tpfuser.block.form import BACKWARD_CUTS, FORWARD_CUTS, PARTIAL_SUMS, Form
from tpfuser.block.forward import define_forward, forward_order, forward_outputs, mask_cuts
from tpfuser.block.inputs import declared_order, input_definer
from tpfuser.block.pieces import Piece, build_pieces
from tpfuser.config import BlockConfig, Layout
from tpfuser.parallel.placements import DP, TP, axis_sizes, placements
from tpfuser.parallel.schedules import default_schedule, load_schedule

MESH_AXIS = {DP: ParallelType.mesh_y, TP: ParallelType.mesh_x}


@dataclass
class Pass:
    """One pass of the block (a forward or the backward) as fusions, in order,
    and the names it returns, in order. meshed: placed on a mesh."""

    kind: str                       # "forward", "train" (a forward saving for backward) or "backward"
    cfg: BlockConfig
    pieces: list[Piece]
    outputs: list[str]
    meshed: bool = False
    options: dict = field(default_factory=dict)   # fd.execute's keywords for every fusion of the pass

    @property
    def inputs(self) -> list[str]:
        """What the pass reads from outside (not made by an earlier fusion of it), in first-read order."""
        made, out = set(), []
        for piece in self.pieces:
            out += [name for name in piece.inputs if name not in made and name not in out]
            made |= set(piece.outputs)
        return out

    def text(self) -> str:
        """The fusions' math as nvFuser prints it (no GPU needed), one after another."""
        return "\n".join(piece.fd.fusion.print_math() for piece in self.pieces)


def make_mesh(layout: Layout, row: int | None = None):
    """The dp x tp mesh; with `row`, that dp rank's 1-D mesh of tp devices."""
    if row is not None:
        return nvf.multidevice.DeviceMesh(torch.arange(row * layout.tp, (row + 1) * layout.tp))
    return nvf.multidevice.DeviceMesh(torch.arange(layout.world_size).reshape(layout.dp, layout.tp))


def apply_placement(tv, placement: dict[int, str], layout: Layout, split_unit_axes: bool = False,
                    reduction_over: str | None = None) -> dict[int, str]:
    """Split tv's dimensions over the mesh axes `placement` names (outer
    splits, device-parallel); reduction_over: also its reduction axis (the
    last of a linear's output) over that mesh axis. A mesh axis of one device
    is left unsplit unless split_unit_axes: the tensor is the same, but nvFuser
    0.2.36 then posts collectives over a team of one (NOTES-history.md).
    Returns the splits made: {dimension: mesh axis}."""
    sizes = axis_sizes(layout)
    splits = dict(placement)
    if reduction_over is not None:
        splits[len(tv.get_logical_domain()) - 1] = reduction_over
    made = {}
    for dim in sorted(splits, reverse=True):   # the highest first, so that lower indices stay valid
        if sizes[splits[dim]] == 1 and not split_unit_axes:
            continue
        tv.outer_split(dim, sizes[splits[dim]])
        tv.axis(dim).parallelize(MESH_AXIS[splits[dim]])
        made[dim] = splits[dim]
    return made


def placer(layout: Layout, row: int | None = None, split_unit_axes: bool = False, seq_major=frozenset()):
    """close(piece) for block/pieces.py: every tensor that enters or leaves the
    fusion, or that it names for placement, on the mesh as placements(layout)
    says (with `row`: that dp rank's tp devices alone, the dp splits left out);
    scalars stay host values, the dropout keys' 0-d tensors are replicated.
    An input named in seq_major (Form.seq_major) whose sequence is split over
    tp is declared sequence-major, as the reduce-scatter that made it left it;
    the outputs of its fusion are then allocated in their loop order, as every
    fusion declares its inputs (nvFuser had laid them out as that input: NOTES.md)."""
    mesh = make_mesh(layout, row)
    where = placements(layout)

    def close(piece: Piece) -> None:
        sequence_major_input = False
        named = [*piece.inputs.items(), *piece.outputs.items(), *piece.placed.items()]
        for name, tv in named:
            if not tv.is_tensor():
                continue
            tv.set_device_mesh(mesh)
            if name.startswith("key."):
                continue
            placement = {dim: axis for dim, axis in where[name].items() if row is None or axis != DP}
            reduced = TP if name in PARTIAL_SUMS and name in piece.outputs else None
            split = apply_placement(tv, placement, layout, split_unit_axes, reduced)
            if name in seq_major and name in piece.inputs and TP in split.values():
                allocate_outermost(tv, next(dim for dim, axis in split.items() if axis == TP))
                sequence_major_input = piece.laid_out = True
        if sequence_major_input:   # nvFuser would lay the outputs out as that input: the next fusions read them in order
            for tv in piece.outputs.values():
                tv.set_allocation_domain(tv.get_loop_domain(), True)
        validate(piece)
    return close


def allocate_outermost(tv, dim: int) -> None:
    """Declare tv's elements laid out with logical dimension `dim` outermost
    (its mesh split first), the others in their loop order after it."""
    target = str(tv.get_logical_domain()[dim])
    loop = tv.get_loop_domain()
    first = [i for i, ax in enumerate(loop)
             if str(ax) == target or (ax.definition() is not None and str(ax.definition().input(0)) == target)]
    tv.set_allocation_domain([loop[i] for i in first] + [ax for i, ax in enumerate(loop) if i not in first], True)


def validate(piece: Piece) -> None:
    """Refuse a linear's (or matmul's) output that leaves the fusion split over
    the mesh while the axis it sums over is split over devices and the sum
    over them is not part of it: nvFuser 0.2.36 takes such a fusion and
    returns partial sums (the module's docstring)."""
    for name, tv in piece.outputs.items():
        expr = tv.definition()
        kind = str(expr).split("=", 1)[1].split("(", 1)[0].strip() if expr is not None and "=" in str(expr) else ""
        if kind not in ("linear", "matmul"):
            continue
        contracted = {"linear": (-1, -1), "matmul": (-1, -2)}[kind]
        summed_over_devices = any(_split_over_devices(expr.input(i), axis) for i, axis in enumerate(contracted))
        axes = [str(ax) for ax in tv.get_loop_domain()]
        split = any(ax.startswith("ideviceIdx") for ax in axes)
        if summed_over_devices and split and not any(ax.startswith("rdeviceIdx") for ax in axes):
            raise ValueError(f"{name}: a {kind}'s output split over the mesh, its contracted axis split over "
                             f"devices but its reduction axis not: nvFuser 0.2.36 would return partial sums "
                             f"(split the reduction axis over the same mesh axis)")


def _split_over_devices(tv, logical_axis: int) -> bool:
    """Whether one of tv's logical axes is split over a mesh axis (a device-parallel loop axis made from it)."""
    target = str(tv.get_logical_domain()[logical_axis])
    return any(str(ax).startswith("ideviceIdx") and ax.definition() is not None
               and str(ax.definition().input(0)) == target for ax in tv.get_loop_domain())


def build_pass(cfg: BlockConfig, form: Form, kind: str = "forward", layout: Layout | None = None,
               check: bool = False, dp_rank: int | None = None, split_unit_axes: bool = False,
               outputs=None) -> Pass:
    """Define one pass and, with a layout, put it on its mesh.

    kind "forward" or "train" (the forward that also returns what the
    backward needs; check: also the keep-masks): on the whole dp x tp mesh.
    kind "backward": on dp rank `dp_rank`'s tp devices alone, on its b/dp rows
    of the batch; its parameter gradients are sums over those rows, and the
    runtime sums them over dp (as DDP does). Inside the fusion, nvFuser 0.2.36
    would all-reduce a sum over the mesh's dp axis within the tp team
    instead: its lowering of an all-reduce takes the team along mesh_x
    whatever the axis reduced (read in its source, not seen run;
    NOTES-history.md). outputs: the backward's subset (define_backward)."""
    if layout is not None:
        layout.check(cfg)
    if kind == "backward":
        if layout is not None:
            cfg = cfg.replace(batch=cfg.batch // layout.dp)
        close = placer(layout, row=dp_rank or 0, split_unit_axes=split_unit_axes, seq_major=form.seq_major) \
            if layout else None
        pieces, _ = build_pieces(lambda b: define_backward(b, cfg, form, outputs), input_definer(cfg, form),
                                 form.cuts & set(BACKWARD_CUTS), backward_order(cfg), close,
                                 hints=form.hints & set(BACKWARD_CUTS))
        names = [name for piece in pieces for name in piece.outputs if name.startswith("grad")]
        return Pass(kind, cfg, pieces, names, meshed=layout is not None,
                    # nvFuser's resize scheduler fails on the q, k, v concatenation of a sharded
                    # backward (upstream issue 4890); its own test turns it off too.
                    options={"_disable_options": ["resize_scheduler"]} if layout is not None else {})
    train = kind == "train"
    if kind not in ("forward", "train"):
        raise ValueError(f"kind={kind!r}: expected forward, train or backward")
    close = placer(layout, split_unit_axes=split_unit_axes, seq_major=form.seq_major) if layout else None
    cuts = (form.cuts & set(FORWARD_CUTS)) - {"masks"} | (mask_cuts(cfg) if form.masks == "fusion" else set())
    pieces, _ = build_pieces(lambda b: define_forward(b, cfg, form, check, train), input_definer(cfg, form),
                             cuts, forward_order(cfg, check, train), close, hints=form.hints & set(FORWARD_CUTS))
    return Pass(kind, cfg, pieces, forward_outputs(cfg, check, train), meshed=layout is not None)


def share_twins(run: Pass, form: Form, options_of: Callable[[str], dict]) -> int:
    """Have each fusion of the pass that is defined exactly as an earlier one
    run on that one's compiled kernels (Piece.twin), so that nvFuser segments
    and compiles it once: the same printed math (operations, shapes, dtypes,
    mesh splits), every input declared in the same memory order, no layout of
    the schedule's own in either (placer), and the same execute options
    (options_of(cut point)). E.g. the two residual dropout masks, whose
    streams and starts are inputs. How many fusions found a twin."""
    first: dict[tuple, Piece] = {}
    for piece in run.pieces:
        if piece.laid_out:
            continue
        orders = tuple(declared_order(name, run.cfg, form) for name in piece.inputs)
        options = json.dumps(options_of(piece.point), sort_keys=True)
        piece.twin = first.setdefault((piece.fd.fusion.print_math(), orders, options), piece)
        if piece.twin is piece:
            piece.twin = None
    return sum(piece.twin is not None for piece in run.pieces)


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


def _resolved(schedule, layout: Layout | None):
    from_layout = layout if layout is not None else Layout()
    return default_schedule(from_layout) if schedule is None else load_schedule(schedule)


def build_forward(cfg: BlockConfig, layout: Layout | None = None, check: bool = False, train: bool = False,
                  schedule=None) -> Pass:
    """The forward pass under a schedule (default: the layout's, default_schedule),
    on the layout's mesh (None: no mesh)."""
    schedule = _resolved(schedule, layout)
    if layout is not None:
        schedule.check(cfg, layout)
    return build_pass(cfg, schedule.form(), "train" if train else "forward", layout, check=check,
                      split_unit_axes=schedule.split_unit_axes)


def build_backward(cfg: BlockConfig, layout: Layout | None = None, outputs=None, dp_rank: int = 0,
                   schedule=None) -> Pass:
    """The backward pass under a schedule, on dp rank `dp_rank`'s tp devices (build_pass)."""
    schedule = _resolved(schedule, layout)
    if layout is not None:
        schedule.check(cfg, layout)
    return build_pass(cfg, schedule.form(), "backward", layout, dp_rank=dp_rank,
                      split_unit_axes=schedule.split_unit_axes, outputs=outputs)
