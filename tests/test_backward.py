"""Backward: the float64 simulation of the tp ranks against autograd on the
unsharded reference, and the backward fusion's structure and shardings."""
import pytest
import torch

from tpfuser.config import Layout, preset
from tpfuser.block.dropout import keep_threshold
from tpfuser.parallel.placements import DP, PARAM_PLACEMENTS, placements
from tpfuser.block.tensors import PARAM_NAMES
from tpfuser.verify.reference import make_block, make_input
from tpfuser.parallel.shard import fusion_params, local_slice
from tests.simulation import simulate_backward, simulate_forward

from tests.test_fusion import MESH_IDS, MESHES  # noqa: E402  (TP and SP meshes)


def float64_case():
    """tiny, float64: (cfg, reference block, input, upstream gradient)."""
    cfg = preset("tiny")
    return (cfg, make_block(cfg, dtype=torch.float64), make_input(cfg, dtype=torch.float64),
            make_input(cfg, seed=9, dtype=torch.float64))


def reference_grads(cfg, block, x, grad_out):
    x = x.clone().requires_grad_(True)
    block.zero_grad()
    block(x).backward(grad_out)
    return x.grad, {n: p.grad for n, p in block.named_parameters()}


def assert_rank_grads_are_slices(rank_grads, reference, cfg, layout):
    """Each rank's parameter gradient is its slice of the reference gradient (fusion's qkv order)."""
    full = fusion_params(reference, cfg)
    for r in range(layout.world_size):
        for name in PARAM_NAMES:
            expected = local_slice(full[name], PARAM_PLACEMENTS[name], layout, r)
            assert rel(rank_grads[r][name], expected) < 1e-10, (r, name)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_backward_simulation_equals_autograd_float64(tp):
    cfg, block, x, grad_out = float64_case()
    gx_ref, gp_ref = reference_grads(cfg, block, x, grad_out)
    gx, rank_grads = simulate_backward(x, grad_out, block.state_dict(), cfg, Layout(1, tp))
    assert all(rel(g, gx_ref) < 1e-10 for g in gx)
    assert_rank_grads_are_slices(rank_grads, gp_ref, cfg, Layout(1, tp))


def test_backward_simulation_is_sensitive():
    """Dropping one rank's partial sum (a missing all-reduce) is caught."""
    cfg, block, x, grad_out = float64_case()
    gx_ref, _ = reference_grads(cfg, block, x, grad_out)
    state = dict(block.state_dict())
    state["mlp.c_fc.weight"] = state["mlp.c_fc.weight"].clone()
    state["mlp.c_fc.weight"][128:] = 0      # rank 1 of 2 contributes nothing through fc
    gx, _ = simulate_backward(x, grad_out, state, cfg, Layout(1, 2))
    assert rel(gx[0], gx_ref) > 1e-3


def saved_shapes(cfg):
    """What the training forward saves, name -> global shape (tensors.saved)."""
    from tpfuser.block.tensors import saved
    return {t.name: list(t.shape(cfg)) for t in saved(cfg)}


# The linears' biases: their gradients are row sums of the upstream gradient,
# so the backward never read them; it no longer takes them as inputs.
UNREAD_BIASES = ("attn.c_attn.bias", "attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias")


@pytest.mark.parametrize("layout", MESHES, ids=MESH_IDS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_backward_builds_and_is_sharded_as_planned(layout, dtype):
    """Under both schedules (tests.test_fusion.schedules_for): the single fusion's
    inputs and outputs in order; every fusion's tensors sharded as planned."""
    from tpfuser.block.backward import backward_output_names
    from tpfuser.block.forward import saved_names
    from tpfuser.block.tensors import BY_NAME, param_shapes
    from tpfuser.parallel.passes import build_backward, build_forward, loop_sharding
    from tests.test_fusion import expected_loop, mesh_text, named_tensors, schedules_for
    cfg = preset("tiny", dtype=dtype)
    shapes = {**param_shapes(cfg), **saved_shapes(cfg), **{f"grad.{n}": v for n, v in param_shapes(cfg).items()},
              "x": (4, 16, 64), "grad_out": (4, 16, 64), "grad_x": (4, 16, 64)}
    # (the recomputed LayerNorm outputs are ln_N.out.whole: ln_N.out is now the forward's cut-point tensor)
    intermediates = ("g.mlp.c_proj.out", "g.attn.c_proj.out", "ln_2.out.whole", "ln_1.out.whole", "g.ln_2.out",
                     "g.ln_1.out")
    shapes |= {name: (4, 16, 64) for name in intermediates}
    inputs = ["grad_out", "x", *[n for n in PARAM_NAMES if n not in UNREAD_BIASES], *saved_names(cfg)]
    for schedule in schedules_for(layout):
        bf = build_backward(cfg, layout, schedule=schedule)
        ff = build_forward(cfg, layout, train=True, schedule=schedule)
        assert sorted(bf.outputs) == sorted(backward_output_names())
        assert sorted(bf.inputs) == sorted(inputs)
        if len(bf.pieces) == 1:   # the single fusion, in its order
            assert list(bf.outputs) == backward_output_names() == ["grad_x", *[f"grad.{n}" for n in PARAM_NAMES]]
            assert list(bf.inputs) == inputs
        assert list(ff.outputs) == ["out", *saved_names(cfg)]
        assert sorted(name for piece in bf.pieces for name in piece.placed) == sorted(intermediates)
        forward = named_tensors(ff)
        for name in ff.outputs:
            if name != "out":
                assert loop_sharding(forward[name]) == (mesh_text(layout), expected_loop(
                    shapes[name], placements(layout)[name], layout)), name
        # The backward runs on dp rank 0's tp row (a 1-D mesh) on its b/dp rows: no dp split.
        row_mesh = "DeviceMesh{" + " ".join(str(i) for i in range(layout.tp)) + "}"
        named = {**named_tensors(bf), **{n: tv for piece in bf.pieces for n, tv in piece.placed.items()}}
        for name, tv in named.items():
            placement = placements(layout)[name]
            shape = list(shapes[name] if name in shapes else BY_NAME[name].shape(cfg))   # (the cut points' tensors)
            if placement.get(0) == DP:
                shape[0] //= layout.dp
            expected = expected_loop(shape, {d: a for d, a in placement.items() if a != DP}, layout)
            assert loop_sharding(tv) == (row_mesh, expected), (schedule.name, name)


def test_backward_runs_on_the_ranks_tp_row():
    """The backward of dp rank r: a 1-D mesh of that row's tp devices, b/dp rows, no dp split."""
    from tpfuser.parallel.passes import build_backward, loop_sharding
    from tests.test_fusion import named_tensors, schedules_for
    cfg = preset("tiny")
    for schedule in schedules_for(Layout(2, 2)):
        built = build_backward(cfg, Layout(2, 2), dp_rank=1, schedule=schedule)   # kept: its TensorViews die with it
        row1 = named_tensors(built)
        mesh, axes = loop_sharding(row1["q"])
        assert mesh == "DeviceMesh{2 3}" and axes == [("", 2), ("mesh_x", 2), ("", 4), ("", 16), ("", 8)]   # [b/dp, h, s, d]
        assert loop_sharding(row1["grad.mlp.c_fc.weight"]) == ("DeviceMesh{2 3}", [("mesh_x", 2), ("", 128), ("", 64)])
        built0 = build_backward(cfg, Layout(2, 2), dp_rank=0, schedule=schedule)
        assert loop_sharding(named_tensors(built0)["x"])[0] == "DeviceMesh{0 1}"


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_sp_simulation_equals_reference_float64(tp):
    cfg, block, x, grad_out = float64_case()
    out = torch.cat(simulate_forward(x, block.state_dict(), cfg, Layout(1, tp, sp=True)), dim=1)
    assert rel(out, block(x).detach()) < 1e-10
    gx_ref, gp_ref = reference_grads(cfg, block, x, grad_out)
    gx, rank_grads = simulate_backward(x, grad_out, block.state_dict(), cfg, Layout(1, tp, sp=True))
    assert rel(torch.cat(gx, dim=1), gx_ref) < 1e-10
    assert_rank_grads_are_slices(rank_grads, gp_ref, cfg, Layout(1, tp, sp=True))


def test_sp_simulation_needs_the_tp_all_reduce_of_partial_grads():
    """Without summing the LayerNorm gradients over the sequence slices, they are wrong."""
    cfg, block, x, grad_out = float64_case()
    _, gp_ref = reference_grads(cfg, block, x, grad_out)
    _, rank_grads = simulate_backward(x, grad_out, block.state_dict(), cfg, Layout(1, 2, sp=True),
                                      sum_region_grads=False)
    assert rel(rank_grads[0]["ln_1.weight"], gp_ref["ln_1.weight"]) > 1e-3


def test_fp32_backward_takes_the_masks_and_recomputes_attention_once():
    """The forward draws each mask once (two residual, one attention) and saves it;
    the backward takes them as bool inputs and draws none. The probabilities are
    computed once: 8 matmuls of linear gradients, q k^T, probs v, and 4 of the attention backward
    (counted over all the pass's fusions, under both schedules)."""
    from tpfuser.parallel.passes import build_backward, build_forward
    from tests.test_fusion import named_tensors, schedules_for
    cfg = preset("tiny", dtype="fp32")
    for schedule in schedules_for(Layout(1, 1)):
        bf = build_backward(cfg, Layout(1, 1), schedule=schedule)
        assert build_forward(cfg, Layout(1, 1), train=True, schedule=schedule).text().count(
            f"< {keep_threshold(0.1)}") == 3
        text = bf.text()
        assert f"< {keep_threshold(0.1)}" not in text
        inputs = named_tensors(bf)
        for name in ("resid_attn_keep", "resid_mlp_keep", "attn_keep"):
            assert "_g_bool[" in str(inputs[name]), name
        assert text.count("= matmul(") == 14, schedule.name


def test_backward_subset_keeps_only_what_its_outputs_need():
    """define_backward(outputs=...) for bisecting: the MLP's c_proj bias gradient
    needs no matmul (c_fc's bias does); unknown names are refused. Under the
    single-fusion schedule: a cut pass's earlier fusion returns what crosses
    its cut (the residual gradient, through every matmul of the MLP) whatever
    the outputs asked."""
    from tpfuser.block.backward import backward_output_names
    from tpfuser.parallel.passes import build_backward
    from tests.test_fusion import schedules_for
    cfg = preset("tiny", dtype="fp32")
    bias = build_backward(cfg, Layout(1, 1), outputs=["grad.mlp.c_proj.bias"], schedule="megatron-whole")
    assert list(bias.outputs) == ["grad.mlp.c_proj.bias"]
    text = bias.text()
    assert "matmul(" not in text
    assert "matmul(" in build_backward(cfg, Layout(1, 1), outputs=["grad.mlp.c_fc.bias"],
                                       schedule="megatron-whole").text()   # through c_proj
    assert list(build_backward(cfg, schedule="megatron-whole").outputs) == backward_output_names()
    assert sorted(build_backward(cfg).outputs) == sorted(backward_output_names())   # the default's, fusion by fusion
    for schedule in schedules_for(Layout(1, 1)):
        assert list(build_backward(cfg, Layout(1, 1), outputs=["grad.mlp.c_proj.bias"],
                                   schedule=schedule).outputs) == ["grad.mlp.c_proj.bias"]
        with pytest.raises(ValueError, match="grad.nope"):
            build_backward(cfg, outputs=["grad.nope"], schedule=schedule)


def test_backward_reductions_each_reduce_one_axis():
    """The sums over the rows (b, s) go one axis at a time: nvFuser 0.2.36 lowers a
    sum over a device-split axis and another axis at once to a wrong-sized copy
    (ops.sum_rows). Every reduction of the backward reduces a single axis."""
    import re
    from tpfuser.parallel.passes import build_backward
    from tests.test_fusion import schedules_for
    for dtype in ("bf16", "fp32"):
        for schedule in schedules_for(Layout(1, 1)):   # all the pass's fusions
            lines = build_backward(preset("tiny", dtype=dtype), Layout(1, 1), schedule=schedule).text().splitlines()
            outputs = [lines[i - 1] for i, ln in enumerate(lines) if ln.strip().startswith("= reduction(")]
            assert len(outputs) >= 10, dtype    # the bias and LayerNorm sums at least
            for tv in outputs:
                assert len(re.findall(r"\br[A-Za-z.]*\d+\{", tv)) == 1, tv


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_backward_reads_the_saved_heads_as_the_forward_writes_them(dtype):
    """In bf16 the backward declares q, k, v and the attention output in flash
    attention's layout (b, s, h, d) (the forward writes them so: checked on the
    GPU), every other input contiguous; runtime/block.py's laid_out hands them
    over uncopied."""
    from tpfuser.parallel.passes import build_backward
    from tpfuser.runtime.block import laid_out
    from tests.test_fusion import schedules_for
    cfg = preset("tiny", dtype=dtype)
    for schedule in schedules_for(Layout(1, 2)):   # every fusion of the pass, each its own inputs
        bf = build_backward(cfg, Layout(1, 2), schedule=schedule)
        ordered = {}
        for piece in bf.pieces:
            defined = [line for line in repr(piece.fd).splitlines() if "define_tensor" in line]   # in definition order
            tensors = [name for name, tv in piece.inputs.items() if tv.is_tensor()]
            assert len(defined) == len(tensors)
            ordered |= {name: line.split("stride_order=")[1].rstrip(")") for name, line in zip(tensors, defined)
                        if "stride_order" in line}
        expected = ["q", "k", "v", "sdpa_out"] if dtype == "bf16" else []
        assert ordered == {name: "[3, 1, 2, 0]" for name in expected}
    held = torch.randn(4, 16, 8, 8).permute(0, 2, 1, 3)   # (b, h, s, d) over (b, s, h, d) memory
    assert laid_out(held, (0, 2, 1, 3)).data_ptr() == held.data_ptr()
    moved = laid_out(held.contiguous(), (0, 2, 1, 3))
    assert moved.permute(0, 2, 1, 3).is_contiguous() and torch.equal(moved, held)
    cycled = laid_out(torch.randn(2, 3, 5), (2, 0, 1))   # an order that is not its own inverse
    assert cycled.shape == (2, 3, 5) and cycled.permute(2, 0, 1).is_contiguous()


def stubbed_block(cfg, monkeypatch, schedule=None):
    """A CPU ShardedBlock whose backward_inputs can run: the parameters' and
    inputs' checks, which want CUDA tensors, stubbed."""
    from tpfuser.runtime.block import ShardedBlock
    block = ShardedBlock(cfg, device=torch.device("cpu"), schedule=schedule)
    monkeypatch.setattr(block, "checked_params", lambda params=None: [])
    monkeypatch.setattr(block, "validate_input", lambda name, t: None)
    return block


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_backward_inputs_hand_the_saved_heads_over_as_they_lie(dtype, monkeypatch):
    """ShardedBlock.backward_inputs (the parameters' and inputs' checks, which
    want CUDA tensors, stubbed): in bf16 q, k, v and the attention output held
    as (b, s, h, d) pass uncopied; in fp32 they are made contiguous, as the
    fp32 backward declares them."""
    cfg = preset("tiny", dtype=dtype)
    block = stubbed_block(cfg, monkeypatch)
    names = block.saved_names()
    saved = [torch.zeros(shape) if len(shape) != 4 else
             torch.zeros(shape[0], shape[2], shape[1], shape[3]).permute(0, 2, 1, 3)   # (b, h, s, d) over (b, s, h, d)
             for shape in saved_shapes(cfg).values()]
    inputs = block.backward_inputs(torch.zeros(4, 16, 64), torch.zeros(4, 16, 64), saved)   # by name
    handed = {name: inputs[name] for name in names}
    heads = [name for name in names if name in ("q", "k", "v", "sdpa_out")]
    assert len(heads) == (4 if dtype == "bf16" else 3)
    for name, t in zip(names, saved):
        if name in heads and dtype == "bf16":
            assert handed[name].data_ptr() == t.data_ptr(), name
        else:
            assert handed[name].is_contiguous(), name


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_backward_inputs_take_q_k_v_views_of_qkv_as_they_are(dtype, monkeypatch):
    """qkv_split "view": the training forward saves q, k, v as views of qkv,
    which the backward declares with free strides in flash order (bf16). They
    pass uncopied; in fp32 (declared in their logical order, which a view of
    qkv is not in) they are made contiguous. A copy each was what the view
    form's training step had run (NOTES.md)."""
    from tpfuser.parallel.schedules import SCHEDULES
    cfg = preset("tiny", dtype=dtype)
    schedule = SCHEDULES["megatron-cut-linears"].replace(qkv_split="view")
    block = stubbed_block(cfg, monkeypatch, schedule)
    b, s, h, d = cfg.batch, cfg.seq, cfg.n_head, cfg.head_dim
    qkv = torch.randn(b, s, h, 3 * d)   # the rows [h, 3, d] of (b, s, 3e), as forward.split_heads views them
    views = {name: qkv[..., i * d:(i + 1) * d].permute(0, 2, 1, 3) for i, name in enumerate("qkv")}
    names = block.saved_names()
    saved = [views[name] if name in views else torch.zeros(shape)
             for name, shape in zip(names, saved_shapes(cfg).values())]
    inputs = block.backward_inputs(torch.zeros(b, s, cfg.n_embd), torch.zeros(b, s, cfg.n_embd), saved)
    for name, view in views.items():
        assert torch.equal(inputs[name], view), name
        if dtype == "bf16":
            assert inputs[name].data_ptr() == view.data_ptr() and inputs[name].stride() == view.stride(), name
        else:
            assert inputs[name].is_contiguous() and inputs[name].data_ptr() != view.data_ptr(), name
    laid = stubbed_block(cfg, monkeypatch, schedule.replace(qkv_split="slice"))
    dense = laid.backward_inputs(torch.zeros(b, s, cfg.n_embd), torch.zeros(b, s, cfg.n_embd), saved)
    assert all(dense[name].data_ptr() != view.data_ptr() for name, view in views.items())   # slice: laid out densely


def test_q_k_v_views_at_a_batch_of_one_build_and_pass_uncopied():
    """A batch of 1 (gpt3's) is a Broadcast dimension, whose contiguity nvFuser
    wants None: the view form's backward declares q, k, v so and builds in both
    dtypes; laid_out ignores the stride of a one-element dimension (here 1,
    out of flash order) and hands such a view over uncopied."""
    from tpfuser.parallel.passes import build_backward
    from tpfuser.parallel.schedules import SCHEDULES
    from tpfuser.runtime.block import laid_out
    schedule = SCHEDULES["megatron-cut-linears"].replace(qkv_split="view")
    for dtype in ("bf16", "fp32"):
        cfg = preset("tiny", dtype=dtype, batch=1)
        bhsd = f"shape={[1, cfg.n_head, cfg.seq, cfg.head_dim]}"
        declared = [line for piece in build_backward(cfg, Layout(1, 2), schedule=schedule).pieces
                    for line in str(piece.fd).splitlines() if bhsd in line and "define_tensor" in line]
        assert sum("contiguity=[None, False, False, False]" in line for line in declared) == 3, declared
    s, h, d = 16, 8, 8
    view = torch.randn(s, h, 3 * d)[..., :d].unsqueeze(0).permute(0, 2, 1, 3)   # (1, h, s, d) over (s, h, d)
    view = view.as_strided(view.shape, (1,) + view.stride()[1:])
    assert laid_out(view, (0, 2, 1, 3), dense=False).data_ptr() == view.data_ptr()
    assert laid_out(view, (0, 2, 1, 3)).data_ptr() != view.data_ptr()   # dense: laid out, a copy
