"""The P2P ring schedules on the CPU: their collectives as the plan lists them,
the refusals, and the host IR programs nvFuser lowers for the ring fusions
(parallel/ring.py) read back and compared step by step with the plan.

nvFuser's MultiDeviceExecutor prints its host IR program (NVFUSER_DUMP=host_ir)
while it is built, before it first touches CUDA, so the lowering is seen on a
machine without a GPU; the constructor then fails there, in a child process."""
import os
import subprocess
import sys
import textwrap

import pytest

from tpfuser.config import Layout, preset
from tpfuser.parallel.collectives import backward_collectives, forward_collectives
from tpfuser.parallel.schedules import SCHEDULES, load_schedule
from tpfuser.verify.commlog import compare_rings, parse_host_ir_programs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rings(colls):
    return [(c.phase, c.site, c.linear, c.kind, c.chunks, c.backend) for c in colls if c.algorithm == "ring"]


@pytest.mark.parametrize("name, backend", [("megatron-sp-ring", "nccl"), ("megatron-sp-ring-ce", "cuda")])
def test_the_ring_schedules_plan_a_ring_of_tp_steps_where_nvfuser_lowers_one(name, backend):
    cfg, layout = preset("gpt3"), Layout(1, 8, sp=True)
    forward = forward_collectives(cfg, layout, SCHEDULES[name])
    backward = backward_collectives(cfg, layout, SCHEDULES[name])
    assert _rings(forward) == [("forward", "input", "attn.c_attn", "allgather", 8, backend),
                               ("forward", "output", "attn.c_proj", "reducescatter", 8, backend),
                               ("forward", "input", "mlp.c_fc", "allgather", 8, backend),
                               ("forward", "output", "mlp.c_proj", "reducescatter", 8, backend)]
    assert _rings(backward) == [("backward", "grad_input", "mlp.c_fc", "reducescatter", 8, backend),
                                ("backward", "grad_input", "attn.c_attn", "reducescatter", 8, backend)]
    whole = {(c.site, c.linear): c.whole_because for c in backward if c.site in ("grad_output", "weight_input")}
    assert len(whole) == 4 and all(whole.values())   # each says why it runs whole
    ring = next(c for c in forward if c.algorithm == "ring")
    assert (ring.p2p_steps, ring.step_bytes * 8) == (7, ring.tensor_bytes)


def test_a_ring_is_refused_under_tensor_parallelism_and_with_other_than_tp_steps():
    with pytest.raises(ValueError, match=r"^schedule field 'linears.mlp.c_fc.overlap': .*no P2P form of an "
                                         r"all-reduce.*megatron-sp-ring"):
        load_schedule({"base": "megatron", "linears": {"mlp.c_fc": {"overlap": "ring"}}})
    three = load_schedule({"base": "megatron-sp-ring", "linears": {"mlp.c_fc": {"chunks": 3}}})
    with pytest.raises(ValueError, match=r"'linears.mlp.c_fc.chunks': expected 4 \(a ring runs one step per rank"):
        three.check(preset("tiny"), Layout(1, 4, sp=True))
    load_schedule({"base": "megatron-sp-ring", "linears": {"mlp.c_fc": {"chunks": 4}}}).check(
        preset("tiny"), Layout(1, 4, sp=True))
    with pytest.raises(ValueError, match="is sequence-parallel but the layout is not"):
        SCHEDULES["megatron-sp-ring"].check(preset("tiny"), Layout(1, 2))


# Builds the ring fusions of tiny's block at tp 2 (b 4, s 16, e 64: a rank's 32 tokens), as the runtime
# builds them (runtime/chunked.RingSteps): c_attn's all-gather + linear, c_proj's linear + reduce-scatter
# (its W^T, [e/tp, e]) and the backward's input-gradient matmul + reduce-scatter of c_fc ([4e/tp, e]).
_BUILD = textwrap.dedent("""
    import sys, torch
    from tpfuser.parallel.ring import allgather_linear, matmul_reducescatter, ring_executor
    backend, tp, tokens, e = sys.argv[1], 2, 4 * 16 // 2, 64
    for form, fd in (("allgather", allgather_linear(tp, tokens, e, 3 * e // tp, torch.bfloat16)),
                     ("reducescatter", matmul_reducescatter(tp, tokens, e // tp, e, torch.bfloat16)),
                     ("reducescatter", matmul_reducescatter(tp, tokens, 4 * e // tp, e, torch.bfloat16))):
        try:
            ring_executor(fd, form, backend)
        except Exception as err:   # no GPU: the constructor fails after the lowering printed its program
            print("BUILD FAILED", type(err).__name__, flush=True)
""")


@pytest.mark.parametrize("backend", ["nccl", "cuda"])
def test_nvfuser_lowers_each_ring_to_the_planned_p2p_steps(backend):
    env = {**os.environ, "NVFUSER_DUMP": "host_ir", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", _BUILD, backend], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    programs = parse_host_ir_programs(run.stdout + run.stderr)
    assert len(programs) == 3, run.stdout[-2000:] + run.stderr[-2000:]
    name = {"nccl": "megatron-sp-ring", "cuda": "megatron-sp-ring-ce"}[backend]
    cfg, layout = preset("tiny"), Layout(1, 2, sp=True)
    schedule = SCHEDULES[name]
    planned = [c for c in forward_collectives(cfg, layout, schedule) + backward_collectives(cfg, layout, schedule)
               if c.algorithm == "ring" and (c.phase, c.linear) in
               {("forward", "attn.c_attn"), ("forward", "attn.c_proj"), ("backward", "mlp.c_fc")}]
    assert len(planned) == 3
    result = compare_rings(programs, planned)
    assert result["matches"], result
    # each a loop of tp steps holding one send and one receive of a rank's chunk of tokens x e
    assert all(p["steps"] == 2 and [c["type"] for c in p["p2p"]] == ["recv", "send"] for p in programs)
    assert {c["numel"] for p in programs for c in p["p2p"]} == {32 * 64}


def test_a_program_with_other_steps_or_another_backend_is_not_the_plan():
    cfg, layout = preset("tiny"), Layout(1, 2, sp=True)
    (ring,) = [c for c in forward_collectives(cfg, layout, SCHEDULES["megatron-sp-ring"]) if c.linear == "attn.c_attn"]
    good = {"steps": 2, "p2p": [{"type": "recv", "backend": "nccl", "numel": 2048},
                                {"type": "send", "backend": "nccl", "numel": 2048}]}
    assert compare_rings([good], [ring])["matches"]
    assert not compare_rings([{**good, "steps": 4}], [ring])["matches"]
    assert not compare_rings([{**good, "p2p": [{**c, "backend": "cuda"} for c in good["p2p"]]}], [ring])["matches"]
    assert not compare_rings([], [ring])["matches"]


def test_the_documented_reproducer_still_fails_as_docs_overlap_says():
    """docs/overlap.md's reproducer of the weight split over the mesh inside a ring: the day nvFuser
    lowers it, this fails and the ring can take the block's placement as it is."""
    text = open(os.path.join(ROOT, "docs", "overlap.md")).read()
    code = textwrap.dedent(text.split("```python\n", 1)[1].split("```", 1)[0])
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode != 0 and "IndexError: unordered_map::at" in run.stderr, run.stderr[-2000:]


def test_show_says_which_fusions_the_ring_runs_instead(capsys):
    from tpfuser.cli import main
    for backward, points in ((False, ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]),
                             (True, ["grad:mlp.c_fc.in", "grad:attn.c_attn.in"])):
        assert main(["show", "--preset", "tiny", "--tp", "2", "--sp", "--schedule", "megatron-sp-ring-ce"]
                    + (["--backward"] if backward else [])) == 0
        lines = capsys.readouterr().out.splitlines()
        ringed = [lines[i - 1].split("(from ")[1].split("'")[1] for i, line in enumerate(lines)
                  if "runtime/chunked.RingSteps" in line]
        assert ringed == points
        assert all("as a ring of 2 steps, P2P by cuda" in line for line in lines if "RingSteps" in line)
    assert main(["show", "--preset", "tiny", "--tp", "2", "--sp"]) == 0
    assert "run instead" not in capsys.readouterr().out


def test_graphs_refuse_a_ring_schedule_before_any_gpu_work(capsys):
    from tpfuser.cli import main
    assert main(["check", "--preset", "tiny", "--tp", "2", "--sp", "--schedule", "megatron-sp-ring", "--graphs"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --graphs: schedule 'megatron-sp-ring' runs attn.c_attn, ") and err.count("\n") == 1
    assert "cannot capture in a CUDA graph" in err


def test_plan_json_holds_every_collective_as_a_record(tmp_path):
    import json
    from tpfuser.cli import main
    path = tmp_path / "plan.json"
    assert main(["plan", "--preset", "gpt3", "--tp", "8", "--sp", "--schedule", "megatron-sp-ring",
                 "--json", str(path)]) == 0
    rep = json.loads(path.read_text())
    records = rep["collectives"] + rep["backward_collectives"]
    fields = {"linear", "phase", "site", "kind", "tensor", "shape", "tensor_bytes", "wire_bytes_per_rank", "axis",
              "team", "algorithm", "chunks", "backend"}
    assert records and all(fields <= set(r) for r in records)
    rings = [r for r in records if r["algorithm"] == "ring"]
    assert len(rings) == 6 and all((r["chunks"], r["p2p_steps"], r["step_bytes"]) == (8, 7, 2048 * 12288 * 2 // 8)
                                   for r in rings)
    assert all(r["whole_because"] for r in records if r["site"] in ("grad_output", "weight_input"))


def test_only_rank_0_must_show_the_lowered_rings():
    """nvFuser prints the host IR on device 0 only: the other ranks' rings are unseen, not mismatched;
    rank 0 without its programs is a mismatch."""
    from tpfuser.verify.check import compare_with_plan
    cfg, layout, schedule = preset("tiny"), Layout(1, 2, sp=True), SCHEDULES["megatron-sp-ring"]
    posted = {"forward": []}   # the forward posts no NCCL collective under the ring schedule, and no program here
    assert compare_with_plan(posted, cfg, layout, 1, schedule)["forward"]["matches"] is True
    assert compare_with_plan(posted, cfg, layout, 1, schedule)["forward"]["rings"]["matches"] is None
    assert compare_with_plan(posted, cfg, layout, 0, schedule)["forward"]["matches"] is False
    program = {"kind": "p2p program", "steps": 2, "p2p": [{"type": t, "backend": "nccl", "numel": 2048}
                                                          for t in ("recv", "send")]}
    assert compare_with_plan({"forward": [program] * 4}, cfg, layout, 0, schedule)["forward"]["matches"] is True


def test_a_ring_runs_on_one_dp_row_and_a_team_of_one_runs_whole():
    with pytest.raises(ValueError, match=r"overlap 'ring' .* runs on a 1 x tp mesh, got 2x2: nvFuser 0.2.36 numbers"):
        SCHEDULES["megatron-sp-ring"].check(preset("tiny"), Layout(2, 2, sp=True))
    colls = forward_collectives(preset("nanogpt"), Layout(1, 1, sp=True), SCHEDULES["megatron-sp-ring"])
    assert {c.algorithm for c in colls} == {"whole"} and all("team of one" in c.whole_because for c in colls)


def test_the_check_table_shows_each_phases_rings():
    from tpfuser.verify.check import RankReport
    from tpfuser.verify.meshes import format_checks
    program = {"steps": 2, "p2p": []}

    def rank(r, lowered, matches):
        rings = {"planned": [program] * 4 if lowered is not None else 4, "lowered": lowered, "matches": matches}
        return RankReport("tiny", "fp32", 0.1, "1x2", True, r,
                          forward={"rel_err": 2e-8, "branch_rel_err": 5e-7, "tolerance": 1e-5, "mask_mismatches": {}},
                          collectives={"forward": {"posted": [], "planned": [], "matches": matches is not False,
                                                   "rings": rings}}).as_dict()
    report = {"environment": {"gpu": "H100", "gpus_shared": 1}, "preset": "tiny", "mesh": "1x2", "sp": True,
              "cases": [{"dtype": "fp32", "dropout": 0.1,
                         "ranks": [rank(0, [program] * 4, True), rank(1, None, None), rank(1, [program] * 3, False)]}],
              "ok": False}
    lines = format_checks(report).splitlines()
    assert lines[2].endswith("0/0+r4/4  ok") and lines[3].endswith("0/0+r?/4  ok")
    assert lines[4].endswith("0/0+r3/4!  FAIL")


def test_bench_refuses_a_graph_of_a_ring_schedule_and_leaves_it_out_by_default(capsys, monkeypatch):
    from tpfuser.bench import cli as bench_cli
    from tpfuser.cli import main
    assert main(["bench", "--schedule", "megatron-sp-ring", "--impl", "nvfuser-graph"]) == 2
    assert "implementation 'nvfuser-graph': schedule 'megatron-sp-ring' runs" in capsys.readouterr().err
    seen = {}
    monkeypatch.setattr(bench_cli, "check_impls", lambda impls, *a, **k: seen.setdefault("impls", list(impls)))
    monkeypatch.setattr(bench_cli, "check_launch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no further")))
    assert main(["bench", "--schedule", "megatron-sp-ring"]) == 2
    assert "nvfuser" in seen["impls"] and not any(i.startswith("nvfuser-graph") for i in seen["impls"])
