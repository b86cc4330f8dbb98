import json

from tpfuser.cli import main
from tpfuser.config import Layout, preset
from tpfuser.parallel.placements import forward_flops
from tpfuser.parallel.report import plan_report


def test_gpt3_tp8_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "--preset", "gpt3", "--tp", "8", "--json", str(path)]) == 0
    rep = json.loads(path.read_text())
    tensors = {t["name"]: t for t in rep["tensors"]}
    assert tensors["attn.c_attn.weight"]["local_shape"] == [4608, 12288]
    assert tensors["attn.c_attn.weight"]["sharding"] == {"0": "tp"}
    assert tensors["mlp.c_proj.weight"]["local_shape"] == [12288, 6144]
    b, s, e = 1, 2048, 12288
    assert [(c["kind"], c["axis"]) for c in rep["collectives"]] == [("allreduce", "tp")] * 2
    assert all(c["shape"] == [b, s, e] and c["tensor_bytes"] == b * s * e * 2 for c in rep["collectives"])
    assert rep["collectives_over_dp"] == 0
    out = capsys.readouterr().out
    assert "(4608, 12288)" in out and "allreduce over tp after attn.c_proj" in out


def test_flops_by_hand():
    # tiny: b4 s16 e64, 1x1: qkv 2*64*64*192, attn (causal half) 2*4*16*16*64, proj 2*64*64*64,
    # fc and proj2 2*64*64*256 each, with b*s = 64 rows.
    f = forward_flops(preset("tiny"), Layout(1, 1))
    assert f["attn.c_attn"] == 2 * 64 * 64 * 192
    assert f["attention"] == 2 * 4 * 16 * 16 * 64
    assert f["attn.c_proj"] == 2 * 64 * 64 * 64
    assert f["mlp.c_fc"] == f["mlp.c_proj"] == 2 * 64 * 64 * 256
    assert f["total"] == sum(v for k, v in f.items() if k != "total")
    g = forward_flops(preset("gpt3"), Layout(1, 8))
    assert g["total"] * 8 == forward_flops(preset("gpt3"))["total"]


def test_param_bytes_per_rank():
    rep = plan_report(preset("tiny"), Layout(2, 4))
    e = 64
    full = (4 * e + 3 * e * e + 3 * e + e * e + e + 4 * e * e + 4 * e + 4 * e * e + e) * 2
    sharded = (3 * e * e + 3 * e + e * e + 4 * e * e + 4 * e + 4 * e * e) * 2
    assert rep["param_bytes_per_rank"] == full - sharded + sharded // 4


def test_plan_rejects_bad_mesh(capsys):
    assert main(["plan", "--preset", "nanogpt", "--tp", "2"]) == 2
    assert "n_head=25: must be divisible by tp=2" in capsys.readouterr().err


def test_saved_for_backward_bytes_by_hand():
    from tpfuser.parallel.placements import saved_bytes_per_rank
    cfg = preset("tiny", dtype="fp32")   # rows b*s = 64, e = 64, fp32: no flash-attention state
    stats, x, x1 = 4 * 64 * 4, 64 * 64 * 4, 64 * 64 * 4
    qkv, mlp_h = 64 * 192 * 4, 64 * 256 * 4   # q, k, v: 3 x [4, 8, 16, 8], as many elements as qkv
    masks, attn_mask = 2 * 64 * 64, 4 * 8 * 16 * 16   # bool: the two residual dropouts, the attention's [b, h, s, s]
    assert saved_bytes_per_rank(cfg, Layout(1, 1)) == stats + x + x1 + qkv + mlp_h + masks + attn_mask
    assert saved_bytes_per_rank(cfg, Layout(1, 2)) == stats + x + x1 + qkv // 2 + mlp_h // 2 + masks + attn_mask // 2
    assert saved_bytes_per_rank(cfg, Layout(2, 1)) == (stats + x + x1 + qkv + mlp_h + masks + attn_mask) // 2
    # Sequence parallel: the replicated region's tensors (stats, x, x1, residual masks) split over tp too.
    assert saved_bytes_per_rank(cfg, Layout(1, 2, sp=True)) == (stats + x + x1 + masks + qkv + mlp_h + attn_mask) // 2
    # Without dropout nothing is saved for it; bf16 keeps no attention mask (flash attention replays its own).
    assert saved_bytes_per_rank(cfg.replace(dropout=0.0), Layout(1, 1)) == stats + x + x1 + qkv + mlp_h
    bf16 = saved_bytes_per_rank(preset("tiny", dtype="bf16"), Layout(1, 1))
    flash = 4 * 8 * 16 * 8 * 2 + 4 * 8 * 16 * 4 + 2 * 8 + 8   # sdpa_out, its logsumexp, philox seed and offset
    assert bf16 == stats + (x + qkv + mlp_h) // 2 + x1 + masks + flash


def test_gpt3_tp8_sequence_parallel_plan(tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", "--preset", "gpt3", "--tp", "8", "--sp", "--json", str(path)]) == 0
    rep = json.loads(path.read_text())
    assert rep["parallelism"] == "tp+sp"
    tensors = {t["name"]: t for t in rep["tensors"]}
    assert tensors["x"]["local_shape"] == [1, 256, 12288] and tensors["x"]["sharding"] == {"0": "dp", "1": "tp"}
    assert tensors["attn.c_attn.weight"]["local_shape"] == [4608, 12288]   # inside attention: as under TP
    size = 2048 * 12288 * 2
    assert [(c["kind"], c["where"]) for c in rep["collectives"]] == [
        ("allgather", "before attn.c_attn"), ("reducescatter", "after attn.c_proj"),
        ("allgather", "before mlp.c_fc"), ("reducescatter", "after mlp.c_proj")]
    assert all(c["tensor_bytes"] == size and c["wire_bytes_per_rank"] == 7 * size // 8 for c in rep["collectives"])
    saved = rep["saved_for_backward_bytes_per_rank_by_parallelism"]
    assert saved["tp+sp"] < saved["tp"]


def test_tp_allreduce_wire_bytes():
    from tpfuser.parallel.collectives import forward_collectives as collectives
    (first, _) = collectives(preset("gpt3"), Layout(1, 8))
    assert first.wire_bytes_per_rank == 2 * 7 * first.tensor_bytes // 8


def test_backward_collectives():
    """Megatron's backward over tp: TP all-reduces each column-parallel input
    gradient; SP gathers the upstream gradient and the LayerNorm output and
    reduce-scatters the input gradient, for the MLP then attention."""
    from tpfuser.parallel.collectives import backward_collectives
    cfg = preset("gpt3")
    tp = backward_collectives(cfg, Layout(1, 8))
    assert [(c.kind, c.where) for c in tp] == [("allreduce", "after mlp.c_fc input gradient"),
                                               ("allreduce", "after attn.c_attn input gradient")]
    sp = backward_collectives(cfg, Layout(1, 8, sp=True))
    assert [c.kind for c in sp] == (["allgather", "allgather", "reducescatter"] + ["allreduce"] * 3) * 2
    # SP: the tp-replicated parameters' gradients are sums over sequence shards, all-reduced over tp
    summed = [c.where.split()[0] for c in sp if c.kind == "allreduce"]
    assert summed == ["ln_2.weight", "ln_2.bias", "mlp.c_proj.bias", "ln_1.weight", "ln_1.bias", "attn.c_proj.bias"]
    assert all(c.shape == (12288,) and c.team == 8 for c in sp if c.kind == "allreduce")
    assert all(c.shape == (1, 2048, 12288) and c.team == 8 for c in tp + sp if c.kind != "allreduce" or c in tp)
    assert backward_collectives(preset("nanogpt"), Layout(2, 2))[0].shape == (8, 128, 1600)   # per dp rank
    # dp > 1: then one all-reduce over dp of the rank's parameter gradients, in fp32, after the fusion
    e = 64
    tiny_shards = (3 * e * e + 3 * e + 4 * e * e + 4 * e + e * e + 4 * e * e) // 2 + 6 * e   # c_proj biases, LNs whole
    last = backward_collectives(preset("tiny"), Layout(2, 2))[-1]
    assert (last.kind, last.axis, last.team, last.shape, last.dtype_bytes) == ("allreduce", "dp", 2, (tiny_shards,), 4)
    assert all(c.axis == "tp" for c in backward_collectives(preset("tiny"), Layout(1, 2)))


def test_committed_gpt3_tp8_plan_is_what_the_command_prints(capsys):
    """docs/plan_gpt3_tp8.md shows the plan (issue: sequence parallelism); it must not drift from the code."""
    import re
    text = open("docs/plan_gpt3_tp8.md").read()
    blocks = re.findall(r"```\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2
    for block, extra in zip(blocks, ([], ["--sp"])):
        assert main(["plan", "--preset", "gpt3", "--tp", "8", *extra]) == 0
        assert capsys.readouterr().out == block


def test_backward_intermediates_are_placed_where_the_collectives_go():
    """Under SP the linears' gradients read the recomputed LayerNorm outputs and the
    row-parallel output gradients whole (all-gathered: replicated over tp), and the
    LayerNorm output gradients come out split on the sequence (reduce-scattered).
    (The recomputed LayerNorm outputs are ln_N.out.whole: ln_N.out is now the
    forward's cut-point tensor, split on the sequence under SP.)"""
    from tpfuser.parallel.placements import DP, TP, placements
    sp, tp = placements(Layout(2, 4, sp=True)), placements(Layout(2, 4))
    for name in ("ln_1.out.whole", "ln_2.out.whole", "g.attn.c_proj.out", "g.mlp.c_proj.out"):
        assert sp[name] == tp[name] == {0: DP}, name
    for name in ("g.ln_1.out", "g.ln_2.out"):
        assert sp[name] == {0: DP, 1: TP} and tp[name] == {0: DP}, name


def test_chunks_sets_every_chunked_linear_and_one_runs_them_whole(tmp_path):
    """--chunks N overrides an overlapped schedule's chunk count; --chunks 1 is the
    same schedule with every linear whole (a sweep's first point), not a refusal."""
    for n, want in ((2, 2), (1, 1)):
        path = tmp_path / f"plan{n}.json"
        assert main(["plan", "--preset", "gpt3", "--tp", "8", "--schedule", "megatron-overlap", "--chunks", str(n),
                     "--json", str(path)]) == 0
        rep = json.loads(path.read_text())
        assert rep["schedule"]["name"] == f"megatron-overlap/{n}"
        assert {c.get("chunks", 1) for c in rep["collectives"] + rep["backward_collectives"]} == {want}
        assert {lin["overlap"] for lin in rep["schedule"]["linears"].values()} == ({"fusions"} if n > 1 else {"none"})
