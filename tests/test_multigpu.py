"""tools/multigpu.py without a GPU: the jobs it plans for a machine of N GPUs,
the environment of every process it starts (NVLink multicast off), its
commands, the run loop (bounds, a bench after its check only, a later call
going on where one stopped) on stand-in commands, and its table on made-up
reports."""
import json
import os
import sys
from types import SimpleNamespace

import pytest

from tpfuser.config import Layout
from tpfuser.dist.launch import torchrun_command
from tpfuser.parallel.schedules import SCHEDULES

sys.path.insert(0, "tools")
import multigpu  # noqa: E402
from comm_curves import MULTICAST_OFF  # noqa: E402

TP_SCHEDULES = [s for s in SCHEDULES if not SCHEDULES[s].sequence_parallel]


def _args(**given):
    return SimpleNamespace(**{"share_gpu": False, "step_s": 420.0, "iters": 30, "skip": [], "cold": False,
                              "redo": False, "deadline_s": 1e9, **given})


def test_the_jobs_of_eight_gpus():
    jobs, left = multigpu.plan_jobs(8, ["gpt3", "nanogpt"], list(SCHEDULES))
    names = [j.name for j in jobs]
    gpt3 = {f"gpt3_tp{tp}_{s}" for tp in (2, 4, 8) for s in SCHEDULES}
    nano = {f"nanogpt_tp5_{s}" for s in TP_SCHEDULES}      # 25 heads: tp 5 only, and no SP (seq 128)
    peers = {f"gpt3_tp{tp}_{p}" for tp in (2, 4, 8) for p in ("peers", "peers-sp")} | {"nanogpt_tp5_peers"}
    assert set(names) == gpt3 | nano | peers and len(names) == len(set(names))
    assert [j.tp for j in jobs] == sorted((j.tp for j in jobs), reverse=True)       # widest first
    assert names[:2] == ["gpt3_tp8_megatron-cut-linears", "gpt3_tp8_megatron-sp-cut-linears"]   # the defaults
    assert dict(left)["nanogpt_tp8_*"].startswith("n_head=25: must be divisible by tp=8")
    assert dict(left)["nanogpt_tp5_megatron-sp-ring"].startswith("seq=128: must be divisible by tp=5")
    assert "gpt3_tp5_*" in dict(left)


def test_fewer_gpus_fewer_tps_and_one_head_per_rank_left_out():
    jobs, _ = multigpu.plan_jobs(4, ["gpt3", "nanogpt"], list(SCHEDULES))
    assert {j.tp for j in jobs} == {2, 4} and {j.preset for j in jobs} == {"gpt3"}
    jobs, left = multigpu.plan_jobs(8, ["tiny"], ["megatron"])
    assert {j.tp for j in jobs} == {2, 4}
    assert "one head per rank" in dict(left)["tiny_tp8_*"]


def test_every_process_runs_with_multicast_off_down_to_the_ranks(monkeypatch):
    environ = {"NCCL_NVLS_ENABLE": "1", "PATH": "/bin", "NVFUSER_MASTER_PORT": "1"}   # as if left on
    jobs, _ = multigpu.plan_jobs(8, ["gpt3", "nanogpt"], list(SCHEDULES))
    steps = multigpu.plan_steps(jobs, "gpu_out/x", _args(), environ)
    assert len(steps) == 2 * 4 + 4 * sum(j.schedule is not None for j in jobs) + 2 * sum(j.schedule is None for j in jobs)
    assert [s.id for s in steps[:2]] == ["comm/tp8", "calibrate/tp8"]   # each tp's curves and pieces before its jobs
    assert steps[2 + 4 * len(SCHEDULES) + 4].id == "comm/tp5"   # (gpt3 at tp 8: every schedule, 4 steps each; 2 peers)
    for step in steps:
        assert {k: step.env.get(k) for k in MULTICAST_OFF} == MULTICAST_OFF, step.id
        assert "NVFUSER_MASTER_PORT" not in step.env
        assert step.env["TPFUSER_KERNEL_CACHE"] == os.path.join(multigpu.ROOT, "gpu_out/x-kernels")   # beside OUT
    assert not any("TPFUSER_KERNEL_CACHE" in s.env for s in multigpu.plan_steps(jobs, "o", _args(cold=True), {}))
    cmd, env = torchrun_command(Layout(1, 8), ["check"], steps[-1].env)   # a tpfuser launch keeps them
    assert {k: env[k] for k in MULTICAST_OFF} == MULTICAST_OFF


def test_the_commands_of_a_job():
    jobs = [multigpu.Job("gpt3", 8, "megatron-sp-ring"), multigpu.Job("gpt3", 8, "megatron"),
            multigpu.Job("gpt3", 8, None, sp=True)]
    steps = {s.id: s for s in multigpu.plan_steps(jobs, "o", _args(skip=["comm", "calibrate"]), {})}
    ring = "gpt3_tp8_megatron-sp-ring"
    assert steps[f"{ring}/check"].cmd[2:] == ["tpfuser.cli", "check", "--preset", "gpt3", "--tp", "8", "--schedule",
                                              "megatron-sp-ring", "--dtype", "bf16", "--collectives", "--json",
                                              f"o/{ring}/check.json"]
    fwd = steps[f"{ring}/fwd"]
    assert fwd.after == f"{ring}/check" and "--train" not in fwd.cmd and "--profile" in fwd.cmd
    assert fwd.cmd[fwd.cmd.index("--impl") + 1] == "nvfuser"               # a ring cannot be captured
    graphed = steps["gpt3_tp8_megatron/train"].cmd
    assert graphed[graphed.index("--impl") + 1] == "nvfuser,nvfuser-graph" and "--train" in graphed
    peers = steps["gpt3_tp8_peers-sp/fwd"].cmd
    assert "--sp" in peers and peers[peers.index("--impl") + 1] == "dtensor,dtensor-async"
    assert not any(s.kind in ("comm", "calibrate") for s in steps.values())
    shared = multigpu.plan_steps(jobs, "o", _args(share_gpu=True), {})
    assert all("--share-gpu" in s.cmd for s in shared if s.kind in ("check", "fwd", "train", "peers"))
    assert not any(s.kind == "comm" for s in shared)       # ranks on one GPU: no link to measure


def test_predict_reads_the_machines_curves_and_calibration_where_they_came(tmp_path):
    step = multigpu.plan_steps([multigpu.Job("gpt3", 8, "megatron")], str(tmp_path), _args(), {})[-1]
    assert step.kind == "predict" and multigpu.command(step) == step.cmd          # neither came
    (tmp_path / "comm").mkdir()
    curves = {"source": "made up", "tables": {k: {"sizes": [1024], "busbw_gbps": [1.0], "ranks": 8}
                                              for k in ("allreduce", "allgather", "reducescatter", "sendrecv",
                                                        "latency")}}
    (tmp_path / "comm" / "comm_table_tp8.json").write_text(json.dumps(curves))
    (tmp_path / "calibration_tp8.json").write_text(json.dumps({"presets": {}}))   # no gpt3 in it: left out
    cmd = multigpu.command(step)
    assert cmd == step.cmd + ["--comm-table", f"{tmp_path}/comm/plan_tp8.json"]
    assert set(json.loads((tmp_path / "comm" / "plan_tp8.json").read_text())["tables"]) == {
        "allreduce", "allgather", "reducescatter", "sendrecv"}                      # the kinds plan reads


def _stand_in(tmp_path, name, code, kind="check", after=None):
    return multigpu.Step(name, kind, [sys.executable, "-c", code], 30, multigpu.run_env(dict(os.environ), 30, "o"),
                         after=after)


def test_the_run_loop_skips_a_bench_whose_check_failed_and_goes_on_where_it_stopped(tmp_path):
    seen = tmp_path / "env.json"
    steps = [_stand_in(tmp_path, "j/check", "raise SystemExit(1)"),
             _stand_in(tmp_path, "j/fwd", "raise SystemExit(0)", "fwd", after="j/check"),
             _stand_in(tmp_path, "k/check", f"import json, os; json.dump(dict(os.environ), open({str(seen)!r}, 'w'))")]
    multigpu.run_steps(steps, str(tmp_path), _args())
    records = multigpu.read_records(f"{tmp_path}/steps.jsonl")
    assert records["j/check"]["rc"] == 1 and records["j/fwd"] == {"step": "j/fwd", "skipped": "j/check did not pass"}
    assert records["k/check"]["rc"] == 0
    env = json.loads(seen.read_text())
    assert {k: env[k] for k in MULTICAST_OFF} == MULTICAST_OFF and env["TPFUSER_TIMEOUT_S"] == "30"
    seen.unlink()
    multigpu.run_steps(steps, str(tmp_path), _args())                  # all recorded: none runs again
    assert not seen.exists() and len(open(f"{tmp_path}/steps.jsonl").readlines()) == 3
    multigpu.run_steps(steps, str(tmp_path), _args(deadline_s=100, redo=True))   # too little time: none starts
    assert not seen.exists()


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f)


def test_the_table_of_made_up_reports(tmp_path):
    job, peers = multigpu.Job("gpt3", 8, "megatron"), multigpu.Job("gpt3", 8, None)
    env = {"gpu": "H100", "torch": "2.x", "nvfuser": "0.2.36"}
    _write(f"{tmp_path}/{job.name}/bench.json", {"pass": "forward", "gpus_shared": 0, "environment": env,
                                                 "results": {"nvfuser-graph": {"median_ms": 2.0}}})
    _write(f"{tmp_path}/{job.name}/check.json", {"ok": True})
    _write(f"{tmp_path}/{job.name}/plan.json", {"prediction": {"forward": {"pass_ms": 2.5, "pieces": []},
                                                               "backward": {"pass_ms": 5.0, "pieces": []}}})
    _write(f"{tmp_path}/{peers.name}/bench.json", {"pass": "forward", "results": {"dtensor": {"median_ms": 3.0}},
                                                   "failed": {}})
    with open(f"{tmp_path}/steps.jsonl", "w") as f:
        f.write(json.dumps({"step": f"{job.name}/train", "rc": None, "log": "x.log"}) + "\n")
    data, text = multigpu.table([job, peers], [("nanogpt_tp8_*", "n_head=25")], str(tmp_path),
                                multigpu.environment(8, ["--gpus", "8"]))
    assert data["environment"]["gpu"] == "H100" and data["environment"]["gpus"] == 8
    assert data["rows"][0]["passes"]["forward"]["off"] == pytest.approx(-0.2) and data["rows"][0]["flagged"] == [
        "forward"]
    lines = text.splitlines()
    assert lines[0].endswith(f"8 x H100, torch 2.x, nvFuser 0.2.36, commit {data['environment']['commit']}")
    assert "checks (bf16, every rank against the reference, collectives as planned): 1 of 1 passed" in lines
    assert "peers gpt3_tp8_peers forward: dtensor 3.000 ms" in lines
    assert f"step {job.name}/train: exit None (x.log)" in lines and lines[-1] == "left out: nanogpt_tp8_*: n_head=25"


@pytest.mark.parametrize("argv, message", [
    ([], "this machine has 0 GPU(s), a tp of 2 or more needs 2 (--gpus N --dry-run: the steps for N)"),
    (["--gpus", "4"], "--gpus 4: this machine has 0; --share-gpu runs the ranks on them (not for speed)"),
    (["--gpus", "1", "--dry-run"], "--gpus 1: a tp of 2 or more needs 2 GPUs or more"),
    (["--gpus", "2", "--dry-run", "--schedules", "megatron,mine"], "--schedules: mine: not among megatron,"),
    (["--gpus", "2", "--dry-run", "--out", "/tmp/elsewhere"], "--out /tmp/elsewhere: expected a folder inside"),
], ids=["no-gpu", "too-few", "one", "schedule", "out"])
def test_refusals_are_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(multigpu.torch.cuda, "is_available", lambda: False)
    assert multigpu.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: multigpu: {message}") and err.count("\n") == 1


def test_a_dry_run_prints_the_steps_and_runs_none(capsys, monkeypatch):
    monkeypatch.setattr(multigpu, "run_steps", lambda *a: pytest.fail("a dry run ran a step"))
    assert multigpu.main(["--gpus", "2", "--share-gpu", "--dry-run", "--presets", "tiny",
                          "--schedules", "megatron-cut-linears,megatron-sp-ring"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("multigpu: 2 GPUs, 4 jobs, 13 steps, tp [2]; ranks share the GPU(s): no time here "
                               "is a speed figure; every step's environment: NCCL_NVLS_ENABLE=0 "
                               "TORCH_SYMM_MEM_DISABLE_MULTICAST=1")
    assert lines[1].startswith("calibrate/tp2 (bound 420 s): ")
    assert lines[1].endswith("tools/calibrate.py --preset tiny --tp 2 --json results/tmp/multigpu/calibration_tp2.json")
    assert any(l.startswith("tiny_tp2_megatron-sp-ring/fwd (bound 420 s, after tiny_tp2_megatron-sp-ring/check)")
               and l.endswith("--share-gpu --json results/tmp/multigpu/tiny_tp2_megatron-sp-ring/bench.json")
               for l in lines)


def test_predict_runs_on_the_cpu_with_the_machines_curves(tmp_path):
    """The predict step for real (tpfuser plan --predict, the committed calibration), on curves
    made up as tools/comm_curves.py writes them, and its prediction in the table without a measurement."""
    job = multigpu.Job("gpt3", 8, "megatron")
    out = os.path.relpath(tmp_path, multigpu.ROOT)
    steps = multigpu.plan_steps([job], out, _args(skip=["comm", "calibrate", "check", "fwd", "train", "peers"]),
                                dict(os.environ))
    assert [s.kind for s in steps] == ["predict"]
    sizes = [1 << 20, 64 << 20]
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "comm_table_tp8.json").write_text(json.dumps({"source": "made up", "tables": {
        k: {"sizes": sizes, "busbw_gbps": [50.0, 300.0], "ranks": 8} for k in
        ("allreduce", "allgather", "reducescatter", "sendrecv", "copyengine")}}))
    calibration = os.path.join(multigpu.ROOT, "results", "calibration", "h100.json")   # as if measured here
    (tmp_path / "calibration_tp8.json").write_text(open(calibration).read())
    cwd = os.getcwd()
    try:
        os.chdir(multigpu.ROOT)
        multigpu.run_steps(steps, out, _args())
    finally:
        os.chdir(cwd)
    record = multigpu.read_records(f"{tmp_path}/steps.jsonl")[f"{job.name}/predict"]
    assert record["rc"] == 0, open(os.path.join(multigpu.ROOT, record["log"])).read()[-2000:]
    data, text = multigpu.table([job], [], str(tmp_path), multigpu.environment(8, []))
    row = data["rows"][0]
    assert row["passes"]["forward"]["measured_ms"] is None and row["passes"]["forward"]["predicted_ms"] > 0
    assert row["interconnect"].endswith("+given") and row["calibration"].endswith("calibration_tp8.json")
    assert "checks (bf16, every rank against the reference, collectives as planned): 0 of 0 passed" in text
