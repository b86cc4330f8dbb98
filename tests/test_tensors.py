"""The table of the block's tensors (tpfuser/block/tensors.py) and the placements that
follow from their dimensions (plan.placement)."""
import pytest

from tpfuser.config import Layout, preset
from tpfuser.parallel.placements import DP, TP, placements
from tpfuser.block.tensors import PARAM_NAMES
from tpfuser.verify.reference import make_block
from tpfuser.block.tensors import BY_NAME, TENSORS, dim_sizes, saved, tensors


def test_names_are_unique_and_dims_known():
    assert len(BY_NAME) == len(TENSORS)
    known = set(dim_sizes(preset("tiny")))
    assert all(set(t.dims) <= known for t in TENSORS)


def test_parameters_are_the_reference_blocks():
    cfg = preset("tiny")
    state = make_block(cfg).state_dict()
    assert list(state) == list(PARAM_NAMES)
    assert all(tuple(state[n].shape) == BY_NAME[n].shape(cfg) for n in PARAM_NAMES)


@pytest.mark.parametrize("name, tp, sp", [
    ("attn.c_attn.weight", {0: TP}, {0: TP}),          # column-parallel: output rows
    ("attn.c_proj.weight", {1: TP}, {1: TP}),          # row-parallel: input columns
    ("attn.c_proj.bias", {}, {}),                      # added once, after the reduction
    ("mlp.c_fc.bias", {0: TP}, {0: TP}),
    ("x", {0: DP}, {0: DP, 1: TP}),                    # replicated over tp; SP splits the sequence
    ("q", {0: DP, 1: TP}, {0: DP, 1: TP}),             # heads over tp, whole sequence under SP
    ("mlp_h", {0: DP, 2: TP}, {0: DP, 2: TP}),
    ("attn_keep", {0: DP, 1: TP}, {0: DP, 1: TP}),
    ("g.mlp.c_proj.out", {0: DP}, {0: DP}),            # read whole by the weight gradient (SP: gathered)
    ("g.ln_1.out", {0: DP}, {0: DP, 1: TP}),           # reduce-scattered under SP
    ("grad.mlp.c_proj.weight", {1: TP}, {1: TP}),
    ("sdpa_seed", {}, {}),
], ids=lambda v: v if isinstance(v, str) else None)
def test_placements_follow_from_the_dims(name, tp, sp):
    assert placements(Layout(2, 4))[name] == tp
    assert placements(Layout(2, 4, sp=True))[name] == sp


def test_saved_depend_on_dtype_and_dropout():
    names = lambda **kw: [t.name for t in saved(preset("tiny", **kw))]   # noqa: E731
    assert names(dtype="bf16", dropout=0.0) == ["ln_1.mean", "ln_1.rstd", "q", "k", "v", "sdpa_out", "sdpa_lse",
                                                "sdpa_seed", "sdpa_offset", "x1", "ln_2.mean", "ln_2.rstd", "mlp_h"]
    assert names(dtype="fp32", dropout=0.1)[-3:] == ["resid_attn_keep", "resid_mlp_keep", "attn_keep"]
    assert [t.name for t in tensors(preset("tiny", dtype="bf16"), "mask")] == ["resid_attn_keep", "resid_mlp_keep"]


def test_flash_layout_is_the_heads_inside_the_sequence_in_bf16_only():
    from tpfuser.block.tensors import memory_order
    bf16, fp32 = preset("tiny", dtype="bf16"), preset("tiny", dtype="fp32")
    laid = {t.name: memory_order(t, bf16) for t in tensors(bf16) if memory_order(t, bf16) is not None}
    assert laid == {name: (0, 2, 1, 3) for name in ("q", "k", "v", "sdpa_out")}   # (b, h, s, d) held as (b, s, h, d)
    assert all(memory_order(t, fp32) is None for t in tensors(fp32))
