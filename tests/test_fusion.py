"""The fusions build on the CPU; their structure and every TensorView's
sharding are what the plan says (read from the TensorViews' IterDomains)."""
import re

import pytest

from tpfuser.config import PRESETS, Layout, preset
from tpfuser.block.dropout import keep_threshold
from tpfuser.block.inputs import rng_input_names
from tpfuser.block.tensors import BY_NAME, PARAM_NAMES
from tpfuser.parallel.placements import placements
from tpfuser.parallel.passes import build_forward, loop_sharding
from tpfuser.parallel.schedules import SCHEDULES

MESHES = [Layout(1, 1), Layout(1, 2), Layout(2, 1), Layout(2, 2), Layout(1, 8), Layout(2, 4)]
MESHES = MESHES + [Layout(m.dp, m.tp, sp=True) for m in MESHES]
MESH_IDS = [f"{m.dp}x{m.tp}" + ("sp" if m.sp else "") for m in MESHES]


def count(pattern, text):
    return len(re.findall(pattern, text))


def schedules_for(layout):
    """The layout's default schedule (its passes cut into several fusions, the
    masks drawn by a fusion of their own) and the single-fusion form of it
    (masks inline, no cuts), which writes the fusions as they were before the
    schedules: a test checks both."""
    name = "megatron-sp" if layout is not None and layout.sp else "megatron"
    return [SCHEDULES[name], SCHEDULES[f"{name}-whole"]]


def named_tensors(built):
    """Every TensorView entering or leaving one of the pass's fusions, by name
    (the first fusion's where several have it), the dropout scalars left out."""
    named = {}
    for piece in built.pieces:
        for name, tv in [*piece.inputs.items(), *piece.outputs.items()]:
            if not name.startswith(("key.", "start.")):
                named.setdefault(name, tv)
    return named


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["p0", "p0.1"])
def test_forward_structure(name, dtype, dropout):
    """Counted over all the pass's fusions, under the default schedule and its single-fusion form."""
    cfg = preset(name, dtype=dtype, dropout=dropout)
    for schedule in schedules_for(Layout(1, 1)):
        ff = build_forward(cfg, Layout(1, 1), schedule=schedule)
        text = ff.text()
        assert count(r"= linear\(", text) == 4, schedule.name
        if dtype == "bf16":
            assert count(r"sdpa", text.lower()) >= 1 and count(r"= matmul\(", text) == 0
        else:  # written-out attention: q k^T and probs v
            assert count(r"sdpa", text.lower()) == 0 and count(r"= matmul\(", text) == 2
        # Residual dropouts always; the attention-probability dropout is drawn in
        # the fusion only in fp32 (in bf16 it lives inside flash attention).
        expected_masks = 0 if dropout == 0 else (2 if dtype == "bf16" else 3)
        assert count(rf"< {keep_threshold(0.1)}", text) == expected_masks   # hash < (1 - p) 2**32
        assert "rng_uniform" not in text                                     # philox is sharding-dependent
        # the tensors x and the parameters, then (with dropout) the dropout scalars rng_input_names
        assert sorted(ff.inputs) == sorted(["x", *PARAM_NAMES, *rng_input_names(cfg)])
    assert list(ff.pieces[0].inputs) == ["x", *PARAM_NAMES, *rng_input_names(cfg)]   # the single fusion's order
    assert bool(rng_input_names(cfg)) == (dropout > 0)


def test_check_mode_outputs_the_masks():
    ff = build_forward(preset("tiny", dtype="fp32"), Layout(1, 1), check=True)
    assert list(ff.outputs) == ["out", "attn_keep", "resid_attn_keep", "resid_mlp_keep"]
    ff = build_forward(preset("tiny", dtype="bf16"), Layout(1, 1), check=True)
    assert list(ff.outputs) == ["out", "resid_attn_keep", "resid_mlp_keep"]


def expected_loop(shape, placement, layout, split_unit_axes=False):
    """The loop domain the schedule gives: each placed dimension split over
    its mesh axis, unless that axis has one device (and not split_unit_axes)."""
    sizes = {"dp": layout.dp, "tp": layout.tp}
    kinds = {"dp": "mesh_y", "tp": "mesh_x"}
    axes = []
    for dim, extent in enumerate(shape):
        if dim in placement and (sizes[placement[dim]] > 1 or split_unit_axes):
            n = sizes[placement[dim]]
            axes += [(kinds[placement[dim]], n), ("", extent // n)]
        else:
            axes.append(("", extent))
    return axes


def mesh_text(layout):
    rows = [" ".join(str(layout.tp * i + j) for j in range(layout.tp)) for i in range(layout.dp)]
    return "DeviceMesh{" + "".join("{" + r + "}" for r in rows) + "}"


@pytest.mark.parametrize("split_unit_axes", [False, True], ids=["", "unitsplits"])
@pytest.mark.parametrize("layout", MESHES, ids=MESH_IDS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_every_tensorview_is_sharded_as_planned(layout, dtype, split_unit_axes):
    """Every tensor entering or leaving each fusion of the pass (the cut points'
    tensors too, shaped as tensors.py says), under both schedules."""
    cfg = preset("tiny", dtype=dtype)
    from tpfuser.parallel.report import activation_shapes
    from tpfuser.block.tensors import param_shapes
    shapes = {**param_shapes(cfg), **activation_shapes(cfg)}
    for schedule in schedules_for(layout):
        ff = build_forward(cfg, layout, check=True, schedule=schedule.replace(split_unit_axes=split_unit_axes))
        named = named_tensors(ff)
        assert set(named) <= set(placements(Layout()))
        for name, tv in named.items():
            mesh, axes = loop_sharding(tv)
            assert mesh == mesh_text(layout), name
            shape = shapes[name] if name in shapes else BY_NAME[name].shape(cfg)
            assert axes == expected_loop(shape, placements(layout)[name], layout, split_unit_axes), name


def test_sp_splits_the_sequence_of_the_replicated_region_only():
    for schedule in schedules_for(Layout(1, 4, sp=True)):
        built = build_forward(preset("tiny"), Layout(1, 4, sp=True), check=True, schedule=schedule)
        ff = named_tensors(built)   # (built kept: its TensorViews die with it)
        assert loop_sharding(ff["x"])[1] == [("", 4), ("mesh_x", 4), ("", 4), ("", 64)]   # dp of one: no split
        assert loop_sharding(ff["resid_mlp_keep"])[1][1] == ("mesh_x", 4)
        assert loop_sharding(ff["attn.c_attn.weight"])[1][0] == ("mesh_x", 4)   # unchanged from TP


def test_sp_rejects_indivisible_sequence():
    with pytest.raises(ValueError, match="seq=16: must be divisible by tp=3 under sequence parallelism"):
        build_forward(preset("tiny", n_head=6, n_embd=48), Layout(1, 3, sp=True))


def test_sharded_build_rejects_indivisible_mesh():
    with pytest.raises(ValueError, match="n_head=25: must be divisible by tp=2"):
        build_forward(preset("nanogpt"), Layout(1, 2))


@pytest.mark.parametrize("dtype, dropout, scalars", [("bf16", 0.1, 4), ("fp32", 0.1, 6), ("bf16", 0.0, 0)],
                         ids=["bf16", "fp32", "no_dropout"])
def test_dropout_scalar_inputs(dtype, dropout, scalars):
    """Tensors x and the 12 parameters, then a key per stream the fusion draws
    and where the rank's slices begin: batch and sequence (residual masks), and
    in fp32 the head (attention mask; in bf16 flash attention draws its own)."""
    cfg = preset("tiny", dtype=dtype, dropout=dropout)
    whole = build_forward(cfg, Layout(1, 1), schedule="megatron-whole")   # one fusion takes them all
    assert len(whole.pieces[0].fd.fusion.inputs()) == 13 + scalars == 13 + len(rng_input_names(cfg))
    assert len(build_forward(cfg, Layout(1, 1)).inputs) == 13 + scalars   # the default's fusions, together


@pytest.mark.parametrize("form, forward_has, backward_has", [
    ("slice", {"slice"}, {"cat"}), ("select", {"select"}, {"cat"}), ("onehot", set(), set()),
    ("view", {"slice"}, {"cat"})])
def test_qkv_split_forms_build_at_one_head_per_rank(form, forward_has, backward_has):
    """The schedule's qkv_split (was TPFUSER_QKV_SPLIT), the experiment for one head per rank:
    each form builds on tiny's 1x8 and 2x4 SP meshes and takes q, k and v out of
    qkv, and puts their gradients back, by its own ops only (over all the
    pass's fusions, under both schedules). Whether nvFuser runs
    them is the GPU's to say (tools/repro_one_head.py, then the mesh suite)."""
    from tpfuser.parallel.passes import build_backward
    for layout in (Layout(1, 8), Layout(2, 4, sp=True)):
        cfg = preset("tiny", dtype="bf16")
        for schedule in schedules_for(layout):
            schedule = schedule.replace(qkv_split=form)
            forward = build_forward(cfg, layout, train=True, schedule=schedule).text()
            backward = build_backward(cfg, layout, schedule=schedule).text()
            assert {op for op in ("slice", "select") if op in forward} == forward_has
            assert {op for op in ("cat",) if op in backward} == backward_has


def test_qkv_split_view_computes_nothing_on_q_k_v(monkeypatch):
    """qkv_split "view": q, k and v are qkv's slices as they are (slice's three
    multiplications by one, each a kernel of its own, are gone), and the
    backward declares them with free strides (views of qkv arrive strided)
    where slice's declares them contiguous; sdpa_out (b, h, s, d too) stays
    contiguous in both."""
    import tpfuser.block.forward as forward
    from tpfuser.parallel.passes import build_backward
    cfg, layout = preset("tiny", dtype="bf16"), Layout(1, 2)
    bhsd = f"shape={[cfg.batch, cfg.n_head, cfg.seq, cfg.head_dim]}"
    laid = []
    monkeypatch.setattr(forward, "lay_out", lambda tv, order, lay_out=forward.lay_out: laid.append(order) or
                        lay_out(tv, order))
    layouts = {}
    for form, muls, free in (("slice", 3, 0), ("view", 0, 3)):
        schedule = SCHEDULES["megatron"].replace(qkv_split=form)
        laid.clear()
        assert build_forward(cfg, layout, train=True, schedule=schedule).text().count("* double(1)") == muls
        layouts[form] = len(laid)
        declared = [line for piece in build_backward(cfg, layout, schedule=schedule).pieces
                    for line in str(piece.fd).splitlines() if bhsd in line]
        assert len(declared) == 4   # q, k, v, sdpa_out
        assert sum("contiguity=[False, False, False, False]" in line for line in declared) == free
        assert sum("contiguity=[True, True, True, True]" in line for line in declared) == 4 - free
        # all four in flash attention's order (b, s, h, d), which nvFuser gives the gradients of q, k, v,
        # the views' whatever flash_layout says
        assert all("stride_order=[3, 1, 2, 0]" in line for line in declared)
    # a view is not laid out (a layout of its own would be a copy): of q, k, v and sdpa_out, sdpa_out only
    assert layouts["slice"] == 4 * layouts["view"] > 0
    unlaid = SCHEDULES["megatron"].replace(qkv_split="view", flash_layout=False)
    declared = [line for piece in build_backward(cfg, layout, schedule=unlaid).pieces
                for line in str(piece.fd).splitlines() if bhsd in line and "contiguity=[False" in line]
    assert len(declared) == 3 and all("stride_order=[3, 1, 2, 0]" in line for line in declared)


def test_qkv_split_view_needs_no_experimental_flag_but_one_head_per_rank_still_does():
    """'view' ran forward and backward on a GPU (NOTES.md): a schedule takes it as
    it is; it lifts no refusal, one head per rank's included (known_failure)."""
    from tpfuser.parallel.schedules import known_failure
    view = SCHEDULES["megatron"].replace(qkv_split="view")
    assert view.qkv_split == "view" and not view.experimental
    one_head = preset("tiny", dtype="bf16", n_head=2)
    assert "one head per rank" in known_failure(one_head, Layout(1, 2), view)
    assert known_failure(one_head, Layout(1, 2), view.replace(experimental=True)) is None


def test_hash_ints_is_checked_where_it_is_set():
    """A schedule file or a Form naming an integer type the hash has no form for is refused in one line."""
    from tpfuser.block.form import Form
    from tpfuser.parallel.schedules import load_schedule
    with pytest.raises(ValueError, match=re.escape("'hash_ints': expected one of int64, uint64, got 'uint32'")):
        load_schedule({"hash_ints": "uint32"})
    with pytest.raises(ValueError, match=re.escape("hash_ints='int32': expected one of int64, uint64")):
        Form(hash_ints="int32")
    assert load_schedule({"hash_ints": "uint64"}).form().hash_ints == "uint64"


def test_qkv_split_is_checked_where_it_is_set():
    """The q/k/v split is the schedule's qkv_split field (TPFUSER_QKV_SPLIT is
    gone): a wrong one is refused where the schedule (or the Form) is made."""
    from tpfuser.block.form import Form
    from tpfuser.parallel.schedules import load_schedule
    with pytest.raises(ValueError, match=re.escape("'qkv_split': expected one of slice, select, onehot, view, got 'slices'")):
        load_schedule({"qkv_split": "slices"})
    with pytest.raises(ValueError, match=re.escape("'qkv_split': expected one of slice, select, onehot, view, got 'slices'")):
        SCHEDULES["megatron"].replace(qkv_split="slices")
    with pytest.raises(ValueError, match=re.escape("qkv_split='slices': expected one of slice, select, onehot, view")):
        Form(qkv_split="slices")


@pytest.mark.parametrize("dp, tp", [(1, 1), (1, 2), (2, 1)])
def test_unit_axes_split_only_where_asked(dp, tp):
    """By default no split over a mesh axis of one device (no collective over a
    team of one), and only those left out; split_unit_axes=True splits every
    placement, of one device or more."""
    from tpfuser.parallel.passes import build_backward, build_forward
    cfg, layout = preset("tiny"), Layout(dp, tp)
    for schedule in schedules_for(layout):   # the text of all the pass's fusions
        for build in (lambda s: build_forward(cfg, layout, train=True, schedule=s),
                      lambda s: build_backward(cfg, layout, schedule=s)):
            split = build(schedule.replace(split_unit_axes=True)).text()
            unsplit = build(schedule).text()
            assert "deviceIdx.x" in split   # every placement split, of one device or more
            assert ("deviceIdx.x" in unsplit) == (tp > 1)
            assert ("deviceIdx.y" in unsplit) == (dp > 1 and "deviceIdx.y" in split)
            assert "DeviceMesh" in unsplit   # still on the mesh


def test_every_point_a_schedule_offers_options_for_begins_a_fusion():
    """fusion_points (what fusion_options may name) is exactly where the passes'
    fusions begin, for every named schedule: an option it takes is applied."""
    from tpfuser.parallel.passes import build_backward, build_forward
    for name, schedule in SCHEDULES.items():
        layout = Layout(1, 1, sp=schedule.sequence_parallel)
        passes = [build(preset("tiny", dtype=dtype), layout, schedule=schedule, **train)
                  for dtype in ("bf16", "fp32")   # (fp32 draws the attention's mask too)
                  for build, train in ((build_forward, {"train": True}), (build_backward, {}))]
        assert {p.point for ps in passes for p in ps.pieces} == schedule.fusion_points(), name


def test_inline_masks_schedules_draw_each_mask_where_it_is_applied():
    """megatron-inline-masks (and its SP twin) are the default's cuts with no
    mask fusions: each keep-mask is drawn (the hash's xors) inside the fusion
    that applies it, after its linear's output; the training forward still
    returns both masks for the backward."""
    from tpfuser.parallel.schedules import default_schedule
    cfg = preset("tiny", dtype="bf16")
    for layout in (Layout(1, 2), Layout(1, 2, sp=True)):
        default, inline = default_schedule(layout), SCHEDULES["megatron-sp-inline-masks" if layout.sp
                                                               else "megatron-inline-masks"]
        assert inline.cuts == default.cuts and inline.masks == "inline" != default.masks
        points = {s.name: [p.point for p in build_forward(cfg, layout, train=True, schedule=s).pieces]
                  for s in (default, inline)}
        assert {"masks", "masks.resid_mlp"} <= set(points[default.name])
        assert points[inline.name] == [p for p in points[default.name] if not p.startswith("masks")]
        run = build_forward(cfg, layout, train=True, schedule=inline)
        hashing = [p.point for p in run.pieces if "^" in p.fd.fusion.print_math()]
        assert hashing == ["attn.c_proj.out", "mlp.c_proj.out"]
        assert {"resid_attn_keep", "resid_mlp_keep"} <= set(run.outputs)
