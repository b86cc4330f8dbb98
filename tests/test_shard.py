"""Slicing, the c_attn reordering, and the float64 simulation of the tp ranks."""
import pytest
import torch

from tpfuser.config import Layout, preset
from tpfuser.parallel.placements import placements
from tpfuser.verify.reference import make_block, make_input
from tpfuser.parallel.shard import gather, local_slice, qkv_blocked, qkv_heads_interleaved, rank_params, fusion_params
from tests.simulation import simulate_forward

PLACEMENTS = placements(Layout())   # tensor parallelism alone
MESHES = [Layout(1, 1), Layout(1, 2), Layout(2, 1), Layout(2, 2), Layout(1, 8), Layout(2, 4)]
MESH_IDS = [f"{m.dp}x{m.tp}" for m in MESHES]


def test_qkv_reorder_gives_each_tp_rank_whole_heads():
    h, d, e, tp = 8, 4, 32, 4
    # Row r of the blocked weight is tagged with (which of q/k/v, head, row in head).
    tags = torch.tensor([[i, hh, j] for i in range(3) for hh in range(h) for j in range(d)], dtype=torch.float64)
    w = torch.cat([tags, torch.zeros(3 * e, e - 3, dtype=torch.float64)], 1)
    inter = qkv_heads_interleaved(w, h)
    for rank in range(tp):
        shard = local_slice(inter, PLACEMENTS["attn.c_attn.weight"], Layout(1, tp), rank)
        heads = shard[:, 1].reshape(h // tp, 3, d)
        which = shard[:, 0].reshape(h // tp, 3, d)
        assert torch.equal(heads, (torch.arange(h // tp) + rank * h // tp).view(-1, 1, 1).expand_as(heads).double())
        assert torch.equal(which, torch.arange(3).view(1, 3, 1).expand_as(which).double())
    assert torch.equal(qkv_blocked(inter, h), w)
    b = torch.arange(3 * e, dtype=torch.float64)
    assert torch.equal(qkv_blocked(qkv_heads_interleaved(b, h), h), b)


def test_qkv_reorder_rejects_bad_rows():
    with pytest.raises(ValueError, match="c_attn has 10 rows: expected a multiple of 3 \\* n_head = 6"):
        qkv_heads_interleaved(torch.zeros(10, 4), 2)


@pytest.mark.parametrize("layout", MESHES, ids=MESH_IDS)
def test_slices_reassemble_exactly(layout):
    cfg = preset("tiny")
    params = fusion_params(make_block(cfg).state_dict(), cfg)
    for name, t in params.items():
        shards = [local_slice(t, PLACEMENTS[name], layout, r) for r in range(layout.world_size)]
        assert torch.equal(gather(shards, PLACEMENTS[name], layout), t), name
    x = make_input(cfg)
    shards = [local_slice(x, PLACEMENTS["x"], layout, r) for r in range(layout.world_size)]
    assert all(s.shape == (cfg.batch // layout.dp, cfg.seq, cfg.n_embd) for s in shards)
    assert torch.equal(gather(shards, PLACEMENTS["x"], layout), x)


def test_gather_catches_disagreeing_replicas():
    layout = Layout(1, 2)
    with pytest.raises(AssertionError, match="replicas over tp differ"):
        gather([torch.zeros(3), torch.ones(3)], {}, layout)


def test_rank_params_shapes_gpt3_tp8():
    """gpt3's shards at tp 8 (on the meta device: shapes without 7 GB of weights)."""
    from tpfuser.block.tensors import param_shapes
    cfg = preset("gpt3")
    state = {name: torch.empty(shape, device="meta") for name, shape in param_shapes(cfg).items()}
    shards = rank_params(fusion_params(state, cfg), Layout(1, 8), 3)
    e = 12288
    assert [tuple(s.shape) for s in shards] == [
        (e,), (e,), (3 * e // 8, e), (3 * e // 8,), (e, e // 8), (e,), (e,), (e,), (4 * e // 8, e), (4 * e // 8,),
        (e, 4 * e // 8), (e,)]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_simulation_equals_reference_float64(tp):
    cfg = preset("tiny")
    block = make_block(cfg, dtype=torch.float64)
    x = make_input(cfg, dtype=torch.float64)
    ranks = simulate_forward(x, block.state_dict(), cfg, Layout(1, tp))
    assert all(torch.equal(r, ranks[0]) for r in ranks)   # the replicated output, the same on every rank
    err = ((ranks[0] - block(x)).norm() / block(x).norm()).item()
    assert err < 1e-10


def test_tp_simulation_detects_a_wrong_slicing():
    """The simulation is sensitive: the blocked (unreordered) c_attn at tp=2 gives wrong heads."""
    cfg = preset("tiny")
    block = make_block(cfg, dtype=torch.float64)
    x = make_input(cfg, dtype=torch.float64)
    state = dict(block.state_dict())
    for name in ("attn.c_attn.weight", "attn.c_attn.bias"):   # undo the reorder fusion_params applies
        state[name] = qkv_blocked(state[name], cfg.n_head)
    err = ((simulate_forward(x, state, cfg, Layout(1, 2))[0] - block(x)).norm() / block(x).norm()).item()
    assert err > 1e-3
