"""Schedules: how the block is put on the mesh and run, as one plain value.

A schedule names, for each of the block's linears, its parallel style
(Megatron-LM's column- or row-parallel, with sequence parallelism's
all-gather in or reduce-scatter out) and how its collective runs (in stream
chunks along the tokens, overlapped with the GEMM, or whole); and, for the
whole block, where its passes are cut into fusions, how the dropout masks
and q, k, v are written, and nVFuser's options. The fusion definitions know
none of it (block/); parallel/passes.py applies it.

    SCHEDULES["megatron"]                                  # the named ones
    load_schedule("megatron-sp")                           # a name, a dict or a JSON file's path
    load_schedule({"base": "megatron", "linears": {"mlp.c_proj": {"chunks": 4, "overlap": "fusions"}}})

Each field is checked where the schedule is made (one line: the field, what was expected, what came).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from tpfuser.block.form import (BACKWARD_CUTS, FORWARD_CUTS, HASH_INTS, LINEARS, MASK_FORMS, MASK_POINTS, QKV_SPLITS,
                                Form)
from tpfuser.block.form import PARTIAL_SUMS
from tpfuser.config import BlockConfig, Layout, frozen, thawed
from tpfuser.outputs import read_json
from tpfuser.parallel.collectives import cut_point, runner_sites, whole_because
from tpfuser.parallel.linear_schedule import (COLUMN, EXECUTOR_OVERLAPS, ROW, ChunksRefused, LinearSchedule,
                                              refuse as _refuse)
from tpfuser.parallel.placements import LINEAR_STYLES


@dataclass(frozen=True)
class Schedule:
    """The whole block's schedule; `linears` by name (LINEARS). cuts: where the
    passes are cut into fusions (FORWARD_CUTS, BACKWARD_CUTS); a chunked linear
    adds its own (fusion_cuts). segment_hints: points kept inside one fusion
    where nvFuser's segmenter is told to end a kernel (Form.hints; 1x1 only).
    masks, qkv_split, flash_layout, keys_on_device, hash_ints: block/form.py's. split_unit_axes: also split over a mesh axis of
    one device (parallel/passes.apply_placement). enable_options, disable_options: nvFuser's, for every fusion (a
    chunk's too; overlap "streams" runs its host IR with its own); fusion_options: more for some fusions, by the cut
    point each begins at ("" the first), e.g. {"mlp.c_fc.out": {"disable_options": ["infer_contiguity"]}}.
    mesh=False: the fusions without a device mesh (1x1 only), run by nvFuser's single-device executor.
    experimental: run what nvFuser 0.2.36 is known to fail (known_failure), to try a way round it."""

    name: str
    linears: dict = field(default_factory=dict)
    cuts: tuple[str, ...] = ()
    segment_hints: tuple[str, ...] = ()
    masks: str = "fusion"
    qkv_split: str = "slice"
    flash_layout: bool = True
    keys_on_device: bool = False
    hash_ints: str = "int64"
    split_unit_axes: bool = False
    enable_options: tuple[str, ...] = ()
    disable_options: tuple[str, ...] = ()
    fusion_options: dict = field(default_factory=dict)
    mesh: bool = True
    experimental: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            _refuse("name", "a non-empty string", self.name)
        if not isinstance(self.linears, dict) or set(self.linears) != set(LINEARS):
            _refuse("linears", f"an entry for each of {', '.join(LINEARS)}",
                    sorted(self.linears) if isinstance(self.linears, dict) else self.linears)
        for linear, plan in self.linears.items():
            if not isinstance(plan, LinearSchedule):
                _refuse(f"linears.{linear}", "a LinearSchedule", plan)
            plan.check(linear)
        sp = {plan.sequence_parallel for plan in self.linears.values()}
        if len(sp) > 1:
            _refuse("linears", "every linear sequence-parallel ('-sp' styles) or none (the regions between "
                    "them are either split over the sequence or not)", {k: v.style for k, v in self.linears.items()})
        for name in ("cuts", "segment_hints", "enable_options", "disable_options"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                _refuse(name, "a list of strings", value)
            object.__setattr__(self, name, tuple(value))
        if not isinstance(self.fusion_options, dict):
            _refuse("fusion_options", "an object of {cut point: {enable_options, disable_options}}", self.fusion_options)
        for name in ("linears", "fusion_options"):   # copies that cannot change in place: a named schedule is shared
            object.__setattr__(self, name, frozen(getattr(self, name), f"schedule {self.name!r}: its {name}"))
        for point, opts in self.fusion_options.items():
            if point not in ("",) + FORWARD_CUTS + BACKWARD_CUTS + MASK_POINTS:
                _refuse(f"fusion_options.{point}", "a cut point a fusion begins at ('' for a pass's first)", point)
            if not isinstance(opts, dict) or set(opts) - {"enable_options", "disable_options"} or not all(
                    isinstance(v, (list, tuple)) and all(isinstance(o, str) for o in v) for v in opts.values()):
                _refuse(f"fusion_options.{point}", "an object of enable_options and/or disable_options, "
                        "each a list of nvFuser option names", opts)
        if unknown := [c for c in self.cuts if c not in FORWARD_CUTS + BACKWARD_CUTS]:
            _refuse("cuts", f"cut points among {', '.join(FORWARD_CUTS + BACKWARD_CUTS)}", unknown)
        taken = self.fusion_points() - (executor := self.executor_points())
        if missing := sorted(set(self.fusion_options) - taken):   # options for no fusion: taken, never applied
            apart = (f" and takes options at ({missing[0]}, overlap {self.linears[missing[0]].overlap!r}, runs in "
                     f"nvFuser's MultiDeviceExecutor with options of its own)" if missing[0] in executor else "")
            _refuse(f"fusion_options.{missing[0]}", f"a point a fusion of this schedule begins at{apart}: one of "
                    + ", ".join(repr(p) for p in sorted(taken)), missing[0])
        hintable = tuple(c for c in FORWARD_CUTS + BACKWARD_CUTS if c != "masks")   # ("masks": nothing crosses it)
        if [c for c in self.segment_hints if c not in hintable] or set(self.segment_hints) & self.fusion_cuts():
            _refuse("segment_hints", f"points among {', '.join(hintable)}, none of them a cut", self.segment_hints)
        if self.masks not in MASK_FORMS:
            _refuse("masks", f"one of {', '.join(MASK_FORMS)}", self.masks)
        if self.qkv_split not in QKV_SPLITS:
            _refuse("qkv_split", f"one of {', '.join(QKV_SPLITS)}", self.qkv_split)
        if self.hash_ints not in HASH_INTS:
            _refuse("hash_ints", f"one of {', '.join(HASH_INTS)}", self.hash_ints)
        for name in ("flash_layout", "keys_on_device", "split_unit_axes", "mesh", "experimental"):
            if not isinstance(getattr(self, name), bool):
                _refuse(name, "true or false", getattr(self, name))

    @property
    def sequence_parallel(self) -> bool:
        return any(plan.sequence_parallel for plan in self.linears.values())

    def chunked(self) -> dict[str, LinearSchedule]:
        """The linears whose collectives run beside their GEMMs: in chunks, or as a ring."""
        return {name: plan for name, plan in self.linears.items() if plan.overlap != "none"}

    def overlapped(self, *forms: str) -> list[str]:
        """The linears whose collective runs in one of these overlap forms (OVERLAPS), in LINEARS order."""
        return [name for name, plan in self.linears.items() if plan.overlap in forms]

    def fusion_cuts(self) -> frozenset[str]:
        """Every cut: the schedule's, and around each chunked linear (a fusion of
        its own): before and after it in the forward, and before and after a
        column-parallel linear's input-gradient matmul in the backward."""
        cuts = set(self.cuts)
        for linear in self.chunked():
            cuts |= {linear, f"{linear}.out"}
            if linear in COLUMN:
                cuts |= {f"grad:{linear}.in", f"grad:{linear}.in.out"}
        return frozenset(cuts)

    def executor_points(self) -> frozenset[str]:
        """The cut points whose fusion the runtime hands to nvFuser's MultiDeviceExecutor (EXECUTOR_OVERLAPS) with
        options of its own: a linear's collective it runs there, not whole (collectives.whole_because)."""
        return frozenset(cut_point(site, linear) for linear, plan in self.chunked().items()
                         if plan.overlap in EXECUTOR_OVERLAPS for phase, site, kind in runner_sites(plan.style)
                         if not whole_because(plan.overlap, kind, phase, site))

    def fusion_points(self) -> frozenset[str]:
        """The points a fusion begins at in some pass: "" (a pass's first), every
        cut, and where the masks are drawn by fusions of their own, "masks" and MASK_POINTS."""
        return self.fusion_cuts() | {""} | ({"masks", *MASK_POINTS} if self.masks == "fusion" else set())

    def form(self) -> Form:
        """How the fusions are written under this schedule (block/form.py)."""
        seq_major = {n for n, lin in PARTIAL_SUMS.items() if self.sequence_parallel and lin not in self.chunked()}
        return Form(self.fusion_cuts(), self.masks, frozenset(self.segment_hints), self.qkv_split, self.flash_layout,
                    self.keys_on_device, seq_major, self.hash_ints)

    def replace(self, **changes) -> "Schedule":
        return dataclasses.replace(self, **changes)

    def layout(self, dp: int, tp: int) -> Layout:
        return Layout(dp, tp, sp=self.sequence_parallel)

    def check(self, cfg: BlockConfig, layout: Layout) -> None:
        """Refuse, in one line, what this schedule cannot do for this block on this mesh."""
        if (rings := self.overlapped("ring")) and layout.dp != 1:
            raise ValueError(f"schedule {self.name!r}: overlap 'ring' ({', '.join(rings)}) runs on a 1 x tp mesh, got "
                             f"{layout.dp}x{layout.tp}: nvFuser 0.2.36 numbers a ring's peers by the global rank "
                             f"modulo tp (csrc/host_ir/pass/stream_parallel_type.cpp), so dp row 1's ranks wait on "
                             f"row 0's; docs/overlap.md")
        if (streams := self.overlapped("streams")) and layout.dp != 1:
            raise ValueError(f"schedule {self.name!r}: overlap 'streams' ({', '.join(streams)}) runs on a 1 x tp "
                             f"mesh (nvFuser 0.2.36's host IR lowering, tried on one dp row only), got "
                             f"{layout.dp}x{layout.tp}; overlap 'fusions' runs on any mesh")
        if layout.sp != self.sequence_parallel:
            raise ValueError(f"schedule {self.name!r} is {'' if self.sequence_parallel else 'not '}sequence-parallel "
                             f"but the layout is {'' if layout.sp else 'not '}(sp={layout.sp}): use a "
                             f"{'megatron-sp' if layout.sp else 'megatron'}-style schedule, or the layout "
                             f"schedule.layout(dp, tp) gives")
        if self.segment_hints and layout.world_size != 1 and not self.experimental:
            raise ValueError(f"schedule {self.name!r}: segment_hints on a {layout.dp}x{layout.tp} mesh: tried on "
                             f"1x1 only (what crosses a hint is not placed on the mesh; experimental: true runs it)")
        if not self.mesh and layout.world_size != 1:
            raise ValueError(f"schedule {self.name!r}: mesh=false needs a 1x1 layout, got {layout.dp}x{layout.tp}")
        for linear, plan in self.chunked().items():
            if plan.overlap == "ring":   # a step per rank: the rank's part of the sequence, whatever its length
                if plan.chunks not in (1, layout.tp):
                    raise ValueError(f"schedule field 'linears.{linear}.chunks': expected {layout.tp} (a ring runs "
                                     f"one step per rank of tp = {layout.tp}) or left out, got {plan.chunks}")
                continue
            rows = cfg.seq // layout.tp if plan.sequence_parallel else cfg.batch // layout.dp * cfg.seq
            what = "the rank's part of the sequence (s/tp)" if plan.sequence_parallel else "the rank's tokens (b/dp x s)"
            if rows % plan.chunks:
                raise ChunksRefused(linear, what, rows, plan.chunks)

    def options(self, point: str) -> dict:
        """fd.execute's option keywords for the fusion beginning at cut `point`. A column linear cut off alone
        skips nvFuser's stride inference on meta tensors (meta addmm imports torch._dynamo: 1.4-2.1 s; NOTES.md)."""
        extra = dict(self.fusion_options.get(point, {}))
        if point in COLUMN and point not in self.chunked() and {point, f"{point}.out"} <= set(self.cuts):
            extra["disable_options"] = [*extra.get("disable_options", ()), "infer_contiguity"]
        out = {}
        for key, every in (("_enable_options", self.enable_options), ("_disable_options", self.disable_options)):
            names = [*every, *extra.get(key.lstrip("_"), ())]
            if names:
                out[key] = names
        return out

    def as_dict(self) -> dict:
        return thawed(dataclasses.asdict(self))


def _megatron(name: str, sp: bool, chunked: dict | None = None, **block) -> Schedule:
    """Megatron-LM's styles for every linear; chunked: {linear: (chunks, overlap[, collective])}."""
    suffix = "-sp" if sp else ""
    linears = {linear: LinearSchedule(LINEAR_STYLES[linear] + suffix, *(chunked or {}).get(linear, ()))
               for linear in LINEARS}
    return Schedule(name, linears, **block)


# The sublayers' boundary: the forward cut before the MLP's first linear, the backward before attention's.
SUBLAYER_CUTS = ("mlp.c_fc", "grad:attn.c_proj")
ALL_CUTS = tuple(c for c in FORWARD_CUTS if c != "masks") + BACKWARD_CUTS

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    # Megatron-LM's tensor parallelism (Shoeybi et al., 2019).
    _megatron("megatron", sp=False, cuts=SUBLAYER_CUTS),
    # ... with sequence parallelism in the regions it replicates (Korthikanti et al., 2022).
    _megatron("megatron-sp", sp=True, cuts=SUBLAYER_CUTS),
    # Each pass one fusion, its masks drawn inside it: the form before the cuts, kept to compare.
    _megatron("megatron-whole", sp=False, masks="inline"),
    _megatron("megatron-sp-whole", sp=True, masks="inline"),
    # Cut before and after every linear: each a fusion of its own (what an overlap experiment starts from).
    _megatron("megatron-cut-linears", sp=False, cuts=ALL_CUTS),
    _megatron("megatron-sp-cut-linears", sp=True, cuts=ALL_CUTS),
    # ... each dropout mask drawn inside the fusion that applies it: two kernels fewer a forward, replayed
    # faster, at the cost of a first call about twice as long (NOTES.md).
    _megatron("megatron-inline-masks", sp=False, cuts=ALL_CUTS, masks="inline"),
    _megatron("megatron-sp-inline-masks", sp=True, cuts=ALL_CUTS, masks="inline"),
    # Overlap, each chunk a fusion on a side stream: under TP the row-parallel linears' all-reduces
    # and (backward) the column-parallel ones' input-gradient all-reduces; under SP the all-gathers
    # before the column-parallel linears and the reduce-scatters after the row-parallel ones (and
    # after the column-parallel input gradients).
    _megatron("megatron-overlap", sp=False, cuts=SUBLAYER_CUTS,
              chunked={linear: (4, "fusions") for linear in LINEARS}),
    _megatron("megatron-sp-overlap", sp=True, cuts=SUBLAYER_CUTS,
              chunked={linear: (4, "fusions") for linear in LINEARS}),
    # Overlap on nvFuser's stream axis (host IR, as its own overlap tests): the row-parallel
    # all-reduces under TP; the all-gathers under SP (its reduce-scatters run whole: not lowered).
    _megatron("megatron-overlap-streams", sp=False, cuts=SUBLAYER_CUTS,
              chunked={linear: (4, "streams") for linear in ROW}),
    _megatron("megatron-sp-overlap-streams", sp=True, cuts=SUBLAYER_CUTS,
              chunked={linear: (4, "streams") for linear in LINEARS}),
    # nvFuser's P2P decompositions (sequence parallelism): all-gather + GEMM before the column-parallel
    # linears, GEMM + reduce-scatter after the row-parallel ones and the column-parallel input
    # gradients, a step per rank; by NCCL's send/recv, or by the copy engine (CUDA IPC, no SMs taken).
    _megatron("megatron-sp-ring", sp=True, cuts=SUBLAYER_CUTS,
              chunked={linear: (1, "ring", "nccl") for linear in LINEARS}),
    _megatron("megatron-sp-ring-ce", sp=True, cuts=SUBLAYER_CUTS,
              chunked={linear: (1, "ring", "cuda") for linear in LINEARS}),
)}


ONE_HEAD_REPRODUCER = "tools/repro_one_head.py"


def known_failure(cfg: BlockConfig, layout: Layout, schedule: Schedule | None = None) -> str | None:
    """Why nvFuser 0.2.36 cannot run this block on this mesh (a line), or None. One head per rank: every
    form of the q/k/v split fails inside nvFuser (docs/one-head.md); experimental=true runs it anyway."""
    if schedule is not None and schedule.experimental:
        return None
    if layout.tp > 1 and cfg.n_head // layout.tp == 1:
        return (f"n_head={cfg.n_head} over tp={layout.tp} is one head per rank, which nvFuser 0.2.36 fails in "
                f"every form tried (a stride check on the 1-long head axis; docs/one-head.md, reproducer "
                f"{ONE_HEAD_REPRODUCER}): use a tp that leaves each rank 2 heads or more")
    return None


def default_schedule(layout: Layout) -> Schedule:
    """Cut at every linear: the fastest first call and replay measured (NOTES.md)."""
    return SCHEDULES["megatron-sp-cut-linears" if layout.sp else "megatron-cut-linears"]


_FIELDS = {f.name for f in dataclasses.fields(Schedule)}
_LINEAR_FIELDS = {f.name for f in dataclasses.fields(LinearSchedule)}


def schedule_from_dict(data: dict) -> Schedule:
    """A schedule from plain data: any field of Schedule, `linears` by name with
    any of LinearSchedule's fields, and `base`, the named schedule the others
    change (default "megatron")."""
    if not isinstance(data, dict):
        _refuse("(the schedule)", "a JSON object of fields", type(data).__name__)
    if unknown := sorted(set(data) - _FIELDS - {"base"}):
        _refuse(unknown[0], f"one of {', '.join(sorted(_FIELDS | {'base'}))}", data[unknown[0]])
    base_name = data.get("base", "megatron")
    if not isinstance(base_name, str) or base_name not in SCHEDULES:
        _refuse("base", f"a named schedule ({', '.join(SCHEDULES)})", base_name)
    linears = dict((base := SCHEDULES[base_name]).linears)
    if not isinstance(given := data.get("linears", {}), dict):
        _refuse("linears", "an object of linears by name", given)
    for linear, fields in given.items():
        if linear not in LINEARS:
            _refuse(f"linears.{linear}", f"a linear among {', '.join(LINEARS)}", linear)
        if not isinstance(fields, dict):
            _refuse(f"linears.{linear}", f"an object of {', '.join(sorted(_LINEAR_FIELDS))}", fields)
        if bad := sorted(set(fields) - _LINEAR_FIELDS):
            _refuse(f"linears.{linear}.{bad[0]}", f"one of {', '.join(sorted(_LINEAR_FIELDS))}", fields[bad[0]])
        linears[linear] = dataclasses.replace(linears[linear], **fields)
    block = {k: v for k, v in data.items() if k not in ("base", "linears")}
    block.setdefault("name", f"{base_name}+custom" if data.keys() - {"base"} else base_name)
    if (made := dataclasses.replace(base, linears=linears, **block)).name in SCHEDULES and made != SCHEDULES[made.name]:
        _refuse("name", "a name of its own (it is not that named schedule)", made.name)
    return made


def load_schedule(spec) -> Schedule:
    """A Schedule from a Schedule (checked again), a SCHEDULES name, a dict or a JSON file's path (str or path-like)."""
    if isinstance(spec, (Schedule, dict)):
        return dataclasses.replace(spec) if isinstance(spec, Schedule) else schedule_from_dict(spec)
    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(f"schedule={spec!r}: expected a name ({', '.join(SCHEDULES)}), a dict or a JSON file")
    if spec in SCHEDULES:
        return SCHEDULES[spec]
    if isinstance(spec, str) and not os.path.isfile(spec):
        raise ValueError(f"schedule {spec!r}: not a named schedule ({', '.join(SCHEDULES)}) nor a file")
    return schedule_from_dict(read_json(os.fspath(spec), "schedule file", max_bytes=1 << 20))   # a few hundred bytes
