"""Rules the rest of the suite let a plausible bug through (a mutation audit):
one test each, CPU only."""
import json
import os

import pytest
import torch

from tpfuser.config import Layout, preset
from tpfuser.parallel.overlap_model import check_rates
from tpfuser.parallel.collectives import backward_collectives, forward_collectives
from tpfuser.parallel.schedules import SCHEDULES, load_schedule
from tpfuser.parallel.shard import gather
from tpfuser.predict import calibration, comm
from tpfuser.predict.command import in_the_way
from tpfuser.predict.timeline import attach

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(ROOT, "tests", "data", "calibration_standin.json")


def test_chunks_divide_the_ranks_own_tokens_not_the_batchs():
    """tiny: batch 4, seq 16. At dp 2 a rank holds 2 x 16 = 32 tokens: 32 chunks fit, 64 do not."""
    cfg = preset("tiny")
    sched = load_schedule({"base": "megatron-overlap", "linears": {"mlp.c_proj": {"chunks": 32}}})
    sched.check(cfg, Layout(2, 2))
    too_many = load_schedule({"base": "megatron-overlap", "linears": {"mlp.c_proj": {"chunks": 64}}})
    with pytest.raises(ValueError, match="32"):
        too_many.check(cfg, Layout(2, 2))
    too_many.check(cfg, Layout(1, 2))   # 64 tokens at dp 1


def test_mesh_false_and_streams_are_refused_where_they_do_not_run():
    cfg = preset("tiny")
    single = load_schedule({"base": "megatron", "mesh": False})
    single.check(cfg, Layout(1, 1))
    for layout in (Layout(2, 1), Layout(1, 2)):
        with pytest.raises(ValueError, match="mesh=false needs a 1x1 layout"):
            single.check(cfg, layout)
    streams = SCHEDULES["megatron-overlap-streams"]
    streams.check(cfg, Layout(1, 2))
    for dp in (2, 4):
        with pytest.raises(ValueError, match="overlap 'streams'.* runs on a 1 x tp mesh"):
            streams.check(cfg, Layout(dp, 2))


def test_the_layernorm_gather_of_the_weight_gradient_runs_whole_under_sp_overlap():
    cfg, layout, sched = preset("gpt3"), Layout(1, 8, True), SCHEDULES["megatron-sp-overlap"]
    (gather,) = [c for c in backward_collectives(cfg, layout, sched) if (c.site, c.linear) == ("weight_input", "mlp.c_fc")]
    assert (gather.chunks, gather.algorithm) == (1, "whole") and "whole gathered LayerNorm output" in gather.whole_because
    (forward,) = [c for c in forward_collectives(cfg, layout, sched) if c.linear == "mlp.c_fc"]
    assert (forward.chunks, forward.algorithm) == (4, "fusions")


def test_sp_parameter_gradients_are_placed_in_their_regions():
    """The row linear's bias gradient (mlp.c_proj) is summed after ln_2's backward, attn.c_proj's after ln_1's."""
    slots = attach(backward_collectives(preset("gpt3"), Layout(1, 8, True)))
    ln2 = {c.where for c in slots[("param", "ln_2")]}
    ln1 = {c.where for c in slots[("param", "ln_1")]}
    assert any(w.startswith("mlp.c_proj.bias") for w in ln2) and any(w.startswith("ln_2.") for w in ln2)
    assert any(w.startswith("attn.c_proj.bias") for w in ln1) and not any(w.startswith("mlp.") for w in ln1)


def test_a_beside_ratio_far_below_one_is_refused(tmp_path):
    data = json.load(open(STANDIN))
    data["presets"]["gpt3"]["tp"]["8"]["beside_copy"] = {"forward": {"mlp.c_proj": {"4": 0.2}}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(calibration.CalibrationError, match="beside_copy.forward.mlp.c_proj.4': expected a slowdown"):
        calibration.read_calibration(str(path))
    data["presets"]["gpt3"]["tp"]["8"]["beside_copy"]["forward"]["mlp.c_proj"]["4"] = 1.07
    path.write_text(json.dumps(data))
    calibration.read_calibration(str(path))


def test_a_comm_table_json_named_for_a_kind_keeps_that_kind_only(tmp_path):
    path = tmp_path / "t.json"
    table = {"sizes": [1 << 20, 1 << 21], "busbw_gbps": [40.0, 60.0]}
    path.write_text(json.dumps({"tables": {"allreduce": table, "allgather": table}}))
    assert sorted(comm.read_comm_table(str(path))) == ["allgather", "allreduce"]
    assert list(comm.read_comm_table(f"allgather={path}")) == ["allgather"]
    with pytest.raises(ValueError, match="no table for reducescatter in it"):
        comm.read_comm_table(f"reducescatter={path}")


@pytest.mark.parametrize("rate", [float("inf"), float("nan"), 0.0, -1.0])
def test_a_rate_that_is_not_positive_and_finite_is_refused(rate):
    with pytest.raises(ValueError, match="must be a positive, finite rate"):
        check_rates(rate, None, given=True)


def _summary(compute, exposed):
    pieces = [{"piece": "gemm", "kind": "gemm", "compute_ms": compute, "slowdown_ms": 0.0, "exposed_ms": 0.0},
              {"piece": "allreduce", "kind": "collective", "compute_ms": 0.0, "slowdown_ms": 0.0,
               "exposed_ms": exposed}]
    return {"pieces": pieces, "compute_ms": compute, "slowdown_ms": 0.0, "exposed_ms": exposed,
            "pass_ms": compute + exposed, "comm_ms": exposed, "comm_whole_ms": exposed,
            "events": [{"lane": "comm", "alone_ms": exposed}]}


def test_what_stands_in_the_way_is_the_collective_when_compute_alone_fits():
    way = in_the_way(_summary(1.0, 1.0), 1.5)       # compute (+ 0.1 x exposed) 1.1 <= 1.5: hiding would do
    assert way["compute_alone_meets_goal"] and way["stands_in_the_way"] == "allreduce"
    way = in_the_way(_summary(1.6, 0.5), 1.5)       # compute alone is over it
    assert not way["compute_alone_meets_goal"] and way["stands_in_the_way"] == "gemm"
    assert in_the_way(_summary(1.0, 0.4), 1.5) is None


def test_gather_refuses_dp_replicas_that_differ():
    layout = Layout(2, 2)
    same = [torch.ones(3)] * 4
    assert torch.equal(gather(same, {}, layout), torch.ones(3))
    odd = [torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(3)]   # dp rank 1's replicas
    with pytest.raises(AssertionError, match="replicas over dp differ between dp ranks 0 and 1"):
        gather(odd, {}, layout)


def test_full_grads_undo_the_fusions_qkv_order():
    """1x1 on the CPU: gradients in the fusion's layout (c_attn head by head) come back in
    nanoGPT's (blocked [Q; K; V]) exactly; c_attn's shape is the same in both orders."""
    from tpfuser.block.tensors import PARAM_NAMES, param_shapes
    from tpfuser.parallel.shard import fusion_params, rank_params
    from tpfuser.runtime.module import TPBlock
    cfg = preset("tiny", dtype="fp32")
    grads = {n: torch.randn(s, generator=torch.Generator().manual_seed(i))
             for i, (n, s) in enumerate(param_shapes(cfg).items())}
    module = TPBlock(cfg, Layout(1, 1), device=torch.device("cpu"))
    shards = rank_params(fusion_params(grads, cfg), Layout(1, 1), 0)
    module.shards = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(g)) for g in shards])
    for p, g in zip(module.shards, shards):
        p.grad = g
    got = module.full_grads()
    assert list(got) == list(PARAM_NAMES)
    for name in PARAM_NAMES:
        assert torch.equal(got[name], grads[name]), name
    assert not torch.equal(module.shards[PARAM_NAMES.index("attn.c_attn.weight")].grad, grads["attn.c_attn.weight"])
