"""The cuts that spare nvFuser's segmenter (NOTES.md, "The first call"): each
dropout mask a fusion of its own, each LayerNorm's backward two fusions, and
under sequence parallelism the reduce-scattered partial sums that cross a cut
declared sequence-major (no GPU needed: the fusions' definitions)."""

import pytest

from tpfuser.block.forward import mask_cuts
from tpfuser.block.form import PARTIAL_SUMS
from tpfuser.config import Layout, preset
from tpfuser.parallel import passes
from tpfuser.parallel.passes import build_backward, build_forward
from tpfuser.parallel.schedules import SCHEDULES, default_schedule


@pytest.mark.parametrize("dtype, masks", [("bf16", ["resid_attn_keep", "resid_mlp_keep"]),
                                          ("fp32", ["resid_attn_keep", "resid_mlp_keep", "attn_keep"])])
def test_each_mask_is_a_fusion_of_its_own(dtype, masks):
    """Two masks in one fusion are two unconnected graphs, which nvFuser only
    segments (1.6-2.0 s of a first call, NOTES.md): one fusion each, first."""
    cfg = preset("tiny", dtype=dtype)
    for schedule in ("megatron", "megatron-cut-linears", "megatron-sp-cut-linears"):
        layout = SCHEDULES[schedule].layout(1, 1)
        pieces = build_forward(cfg, layout, train=True, schedule=schedule).pieces
        assert [list(p.outputs) for p in pieces[:len(masks)]] == [[m] for m in masks], schedule
        assert not any(name.endswith("_keep") for p in pieces[len(masks):] for name in p.outputs)
    assert mask_cuts(cfg) == {"masks"} | {f"masks.{m.removesuffix('_keep')}" for m in masks[1:]}
    assert mask_cuts(preset("tiny", dtype=dtype, dropout=0.0)) == set()


def test_each_layernorm_backward_is_two_fusions():
    """Its parameters' gradients (sums over the rows), then its input's gradient
    (a sum over each row) with the residual's: each a kernel's worth."""
    pieces = {p.point: p for p in build_backward(preset("tiny"), Layout(), schedule="megatron-cut-linears").pieces}
    assert list(pieces["grad:mlp.c_fc.in.out"].outputs) == ["grad.ln_2.weight", "grad.ln_2.bias"]
    assert list(pieces["grad:ln_2"].outputs) == ["g.x1"]
    assert list(pieces["grad:attn.c_attn.in.out"].outputs) == ["grad.ln_1.weight", "grad.ln_1.bias"]
    assert list(pieces["grad:ln_1"].outputs) == ["grad_x"]
    assert "mlp.c_fc.grad_in" in pieces["grad:ln_2"].inputs and "attn.c_attn.grad_in" in pieces["grad:ln_1"].inputs


def test_the_default_schedules_cut_at_every_linear():
    assert default_schedule(Layout(1, 2)).name == "megatron-cut-linears"
    assert default_schedule(Layout(1, 2, sp=True)).name == "megatron-sp-cut-linears"


def test_sequence_major_where_nvfuser_reduce_scatters(monkeypatch):
    """Under SP a partial sum made by nvFuser's reduce-scatter leaves its fusion
    sequence-major (on the GPU the next one refused its strides); the chunked
    linears' come from torch, contiguous. The fusion that reads one is told so."""
    assert SCHEDULES["megatron-sp-cut-linears"].form().seq_major == set(PARTIAL_SUMS)
    assert SCHEDULES["megatron-sp-overlap"].form().seq_major == set()   # every linear chunked
    assert SCHEDULES["megatron-cut-linears"].form().seq_major == set()  # no SP: all-reduced, whole
    called = []
    real = passes.allocate_outermost
    monkeypatch.setattr(passes, "allocate_outermost", lambda tv, dim: (called.append(dim), real(tv, dim)))
    cfg = preset("tiny", dtype="fp32")
    # attn.c_proj.out and mlp.c_proj.out in the forward; in the backward each column-parallel
    # linear's input gradient, read by its LayerNorm's two fusions: the sequence, dimension 1.
    # At tp 1 there is no reduce-scatter (nothing split over a team of one).
    for layout, want in ((Layout(1, 2, sp=True), 6), (Layout(2, 2, sp=True), 6), (Layout(1, 1, sp=True), 0)):
        called.clear()
        build_forward(cfg, layout, train=True, schedule="megatron-sp-cut-linears")
        build_backward(cfg, layout, schedule="megatron-sp-cut-linears")
        assert called == [1] * want, layout


def test_fusions_defined_alike_compile_once(monkeypatch):
    """The two residual masks (their stream's key and starts are inputs) are one
    fusion run twice; a fusion that carries a layout of the schedule's, runs
    under other options or declares an input in another memory order has no twin."""
    import torch

    from tpfuser.runtime import shared
    cfg, device = preset("tiny", dtype="bf16"), torch.device("cuda", 0)
    for layout in (Layout(), Layout(2, 2), Layout(1, 2, sp=True)):
        shared.forget_fusions()
        run = shared.shared_pass(cfg, "train", layout, False, 0, default_schedule(layout), device)
        twins = {p.point: p.twin.point for p in run.pieces if p.twin is not None}
        assert twins == {"masks.resid_mlp": ""}, layout
        assert not any(p.twin for p in shared.shared_pass(cfg, "backward", layout, False, 0,
                                                          default_schedule(layout), device).pieces)
    run = build_forward(cfg, Layout(), train=True)
    first, second = run.pieces[0], run.pieces[1]
    assert passes.share_twins(run, default_schedule(Layout()).form(), lambda point: {}) == 1
    assert second.twin is first and first.twin is None
    calls = []
    first.fd.execute = lambda inputs, **options: calls.append((inputs, options)) or ["mask"]
    assert second.execute([7, 0], _enable_options=["x"]) == ["mask"] and calls == [([7, 0], {"_enable_options": ["x"]})]
    run = build_forward(cfg, Layout(), train=True)
    assert passes.share_twins(run, default_schedule(Layout()).form(),
                                       lambda point: {"_enable_options": [point]}) == 0
    run = build_forward(cfg, Layout(), train=True)
    run.pieces[1].laid_out = True
    assert passes.share_twins(run, default_schedule(Layout()).form(), lambda point: {}) == 0
    run = build_forward(cfg, Layout(), train=True)   # an input declared in another memory order
    monkeypatch.setattr(passes, "declared_order", lambda name, *_: (0,) if name == "key.resid_mlp" else None)
    assert passes.share_twins(run, default_schedule(Layout()).form(), lambda point: {}) == 0
    shared.forget_fusions()


def test_the_column_linears_alone_skip_nvfusers_meta_inference():
    """Only the fusions of a linear with its bias, under the default schedules:
    the rest keep nvFuser's stride inference."""
    import torch

    from tpfuser.runtime.block import ShardedBlock
    cfg = preset("tiny")
    for layout in (Layout(), Layout(1, 2, sp=True)):
        block = ShardedBlock(cfg, layout, device=torch.device("cpu"))
        for kind in ("forward", "train", "backward"):
            run = block.pass_of(kind)
            skipped = {p.point for p in run.pieces
                       if "infer_contiguity" in block._piece_options(run, p).get("_disable_options", [])}
            assert skipped == ({"attn.c_attn", "mlp.c_fc"} if kind != "backward" else set()), (layout, kind)
    # not where the linear shares its fusion, nor where it runs in chunks, nor in the sublayer cuts
    cuts = [c for c in SCHEDULES["megatron-cut-linears"].cuts if c != "attn.c_attn.out"]
    fewer = SCHEDULES["megatron-cut-linears"].replace(name="fewer", cuts=tuple(cuts))
    assert "_disable_options" not in fewer.options("attn.c_attn") and fewer.options("mlp.c_fc")
    assert fewer.options("mlp.c_fc") == {"_disable_options": ["infer_contiguity"]}
    for name in ("megatron", "megatron-overlap", "megatron-whole"):
        assert not any(SCHEDULES[name].options(p) for p in SCHEDULES[name].fusion_points()), name


def test_pytorchs_meta_linear_with_a_bias_imports_dynamo():
    """Why they skip it: the first meta linear with a bias (nvFuser's inference
    of a linear's output strides) imports torch._dynamo, a second or more of a
    cold first call; without a bias it does not. The day this fails, the
    option can go (Schedule.options)."""
    import subprocess
    import sys
    code = ("import sys, torch; m = lambda *s: torch.empty(*s, device='meta'); "
            "torch.nn.functional.linear(m(2, 3, 4), m(5, 4){}); print('torch._dynamo' in sys.modules)")
    seen = [subprocess.run([sys.executable, "-c", code.format(bias)], capture_output=True, text=True,
                           timeout=120).stdout.strip() for bias in (", m(5)", "")]
    assert seen == ["True", "False"]
