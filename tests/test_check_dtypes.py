"""`tpfuser check --dtype fp32 bf16` on one GPU: each dtype in a process of its
own, side by side (verify/dtypes.py), one table and JSON; the processes run at
once under one bound (launch.run_bounded_all). CPU: the children faked, or
plain Python."""
import json
import os
import sys
import time

import pytest

import tpfuser.cli as cli
from tpfuser.config import Layout, preset
from tpfuser.dist import launch
from tpfuser.verify import dtypes


def _args(argv):
    args, unknown = cli._parser(argv).parse_known_args(argv)
    assert not unknown
    cfgs, layout, schedule = cli._check_cfgs(args)
    args.schedule = schedule
    return args, cfgs, layout


@pytest.mark.parametrize("more", [[], ["--schedule", "megatron-overlap", "--chunks", "2", "--dropout", "0.25",
                                       "--n-head", "4", "--forward-only", "--collectives", "--graphs"]])
def test_a_childs_command_is_this_check_for_one_dtype(tmp_path, more):
    args, cfgs, layout = _args(["check", "--preset", "tiny", "--dtype", "fp32", "bf16", *more])
    schedule_file = tmp_path / "schedule.json"
    schedule_file.write_text(json.dumps(args.schedule.as_dict()))
    for cfg in cfgs:
        cmd = dtypes.child_command(args, cfg, str(schedule_file), str(tmp_path / "out.json"))
        assert cmd[:3] == [sys.executable, "-m", "tpfuser.cli"]
        child, (child_cfg,), child_layout = _args(cmd[3:])
        assert child_cfg == cfg and child_layout == layout
        assert child.schedule.as_dict() == args.schedule.as_dict()
        assert (child.forward_only, child.collectives, child.graphs) == (args.forward_only, args.collectives,
                                                                        args.graphs)
        assert child.json == str(tmp_path / "out.json")


def test_side_by_side_only_where_the_gpu_holds_them_all():
    cfgs = [preset("nanogpt", dtype="fp32"), preset("nanogpt", dtype="bf16")]
    need = sum(launch.shared_gpu_bytes(cfg, Layout()) for cfg in cfgs)
    assert dtypes.side_by_side_refusal(cfgs, Layout(), need) is None
    why = dtypes.side_by_side_refusal(cfgs, Layout(), need - 1)
    assert "GiB of GPU memory" in why and "\n" not in why
    assert dtypes.side_by_side_refusal(cfgs, Layout(), None)
    assert dtypes.side_by_side_refusal(cfgs[:1], Layout(), need)
    assert dtypes.side_by_side_refusal(cfgs, Layout(1, 2), need)


def _case(dtype, ok):
    rank = {"rank": 0, "ok": ok, "forward": {"rel_err": 1e-7, "tolerance": 1e-5, "branch_rel_err": 1e-7,
                                             "mask_mismatches": {}},
            "backward": None, "collectives": None}
    return {"dtype": dtype, "dropout": 0.1, "ranks": [rank]}


def test_one_table_and_json_of_every_dtype_in_the_order_asked(tmp_path, monkeypatch, capsys):
    args, cfgs, layout = _args(["check", "--preset", "tiny", "--dtype", "fp32", "bf16",
                                "--json", str(tmp_path / "all.json")])
    ran = []

    def children(cmds, env, timeout_s, stdouts=None, labels=None):   # bf16's passes, fp32's process dies without a result
        ran.extend(cmds)
        out = cmds[1][cmds[1].index("--json") + 1]
        with open(out, "w") as f:
            json.dump({"cases": [_case("bf16", True)]}, f)
        return [-9, 0]
    monkeypatch.setattr(dtypes, "run_bounded_all", children)
    monkeypatch.setenv("TPFUSER_TIMEOUT_S", "30")
    assert dtypes.check_side_by_side(cfgs, layout, args) == 1
    assert [cmd[cmd.index("--dtype") + 1] for cmd in ran] == ["fp32", "bf16"]
    text = capsys.readouterr().out
    assert text.index("fp32") < text.index("bf16") and "exited -9, no result written" in text
    assert "SOME RANK FAILED" in text
    report = json.loads((tmp_path / "all.json").read_text())
    assert [c["dtype"] for c in report["cases"]] == ["fp32", "bf16"] and not report["ok"] and report["side_by_side"]

    def late(cmds, env, timeout_s, stdouts=None, labels=None):
        return [None, None]
    monkeypatch.setattr(dtypes, "run_bounded_all", late)
    assert dtypes.check_side_by_side(cfgs, layout, args) == 124
    assert capsys.readouterr().out.count("did not finish in 30 s (TPFUSER_TIMEOUT_S sets the bound)") == 2

    def ended(cmds, env, timeout_s, stdouts=None, labels=None):   # fp32 done, then this process is told to end
        assert labels == ["fp32", "bf16"] and "NVFUSER_MASTER_PORT" not in env
        with open(cmds[0][cmds[0].index("--json") + 1], "w") as f:
            json.dump({"cases": [_case("fp32", True)]}, f)
        raise launch.Ended(15)
    monkeypatch.setattr(dtypes, "run_bounded_all", ended)
    monkeypatch.setenv("NVFUSER_MASTER_PORT", "29500")
    with pytest.raises(launch.Ended):
        dtypes.check_side_by_side(cfgs, layout, args)
    text = capsys.readouterr().out
    assert "fp32  0.10    0" in text and "was ended with this check, no result written" in text
    kept = json.loads((tmp_path / "all.json").read_text())
    assert kept["cases"][0]["ranks"][0]["ok"] and not kept["cases"][1]["ranks"][0]["ok"]

    def broken(cmds, env, timeout_s, stdouts=None, labels=None):   # a child's half-written result, then a failure
        with open(cmds[0][cmds[0].index("--json") + 1], "w") as f:
            f.write("{}")
        raise FileNotFoundError("no such interpreter")
    monkeypatch.setattr(dtypes, "run_bounded_all", broken)
    with pytest.raises(FileNotFoundError):   # the failure itself, not one of gathering the results
        dtypes.check_side_by_side(cfgs, layout, args)
    assert "did not run to its end (FileNotFoundError here)" in capsys.readouterr().out

    def both_pass(cmds, env, timeout_s, stdouts=None, labels=None):
        for cmd, dtype in zip(cmds, ("fp32", "bf16")):
            with open(cmd[cmd.index("--json") + 1], "w") as f:
                json.dump({"cases": [_case(dtype, True)]}, f)
        return [0, 0]
    monkeypatch.setattr(dtypes, "run_bounded_all", both_pass)
    assert dtypes.check_side_by_side(cfgs, layout, args) == 0
    assert "all ranks within tolerance" in capsys.readouterr().out


def test_commands_run_at_once_under_one_bound(tmp_path, monkeypatch):
    """The commands run side by side (each is running while the other sleeps),
    and those past the bound are ended together: one grace for all, not one each."""
    sleep = [sys.executable, "-c", "import sys, time; open(sys.argv[1], 'w').write(str(time.time())); time.sleep(2.0); "
             "open(sys.argv[1], 'a').write(' ' + str(time.time())); sys.exit(3)"]
    assert launch.run_bounded_all([sleep + [str(tmp_path / "a.t")], sleep + [str(tmp_path / "b.t")]], {},
                                  timeout_s=60) == [3, 3]
    (a0, a1), (b0, b1) = (map(float, (tmp_path / n).read_text().split()) for n in ("a.t", "b.t"))
    assert b0 < a1 and a0 < b1   # their sleeps overlap, however long each took to start
    # deaf to SIGTERM (each notes when it came): each takes the whole grace, then SIGKILL
    late = [sys.executable, "-c", "import os, signal, sys, time; "
            "signal.signal(signal.SIGTERM, lambda *a: open(sys.argv[1] + '.term', 'w').write(str(time.time()))); "
            "open(sys.argv[1], 'w').write(str(os.getpid())); print(os.environ.get('TPFUSER_PROCESS'), flush=True); "
            "[time.sleep(60) for _ in range(10)]"]
    quick = [sys.executable, "-c", "print('hi')"]
    outs = [open(tmp_path / f"{i}.out", "w") for i in range(3)]
    monkeypatch.setattr(launch, "WATCH_S", 0.2)   # (what the late ones do is not asked here)
    codes = launch.run_bounded_all([quick, late + [str(tmp_path / "a.pid")], late + [str(tmp_path / "b.pid")]], {},
                                   timeout_s=3, grace_s=4, stdouts=outs, labels=["quick", "bf16", "fp32"])
    for out in outs:
        out.close()
    assert codes == [0, None, None]
    terms = [float((tmp_path / f"{n}.pid.term").read_text()) for n in "ab"]
    assert abs(terms[0] - terms[1]) < 2   # told together (one after the other: a grace of 4 s apart)
    for name in ("a.pid", "b.pid"):
        pid = int((tmp_path / name).read_text())
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert [(tmp_path / f"{i}.out").read_text() for i in range(3)] == ["hi\n", "bf16\n", "fp32\n"]


def test_check_of_two_dtypes_on_one_gpu_goes_side_by_side(monkeypatch, capsys):
    import torch
    seen = []
    monkeypatch.setattr(cli, "_cuda_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=0: (free[0], 2 * free[0]))
    monkeypatch.setattr(cli, "check_side_by_side", lambda cfgs, layout, args: seen.append("side") or 0)
    monkeypatch.setattr(cli, "run_checks", lambda cfgs, layout, args: seen.append("one process") or 0)
    monkeypatch.setattr(cli, "check_launch", lambda *a, **k: None)
    free = [1 << 40]
    assert cli.main(["check", "--preset", "tiny", "--dtype", "fp32", "bf16"]) == 0
    assert cli.main(["check", "--preset", "tiny", "--dtype", "fp32"]) == 0
    free[0] = 1 << 20
    assert cli.main(["check", "--preset", "tiny", "--dtype", "fp32", "bf16"]) == 0
    assert seen == ["side", "one process", "one process"]
    assert "fp32, bf16 one after another: together they need" in capsys.readouterr().err


def test_the_children_get_their_own_port_and_one_communication_dump(monkeypatch):
    monkeypatch.setenv("NVFUSER_MASTER_PORT", "29500")
    monkeypatch.setenv("NVFUSER_DUMP", "segmented_fusion,communication")
    args, _, _ = _args(["check", "--preset", "tiny", "--dtype", "fp32", "bf16", "--collectives"])
    env = dtypes.child_environment(args)
    assert "NVFUSER_MASTER_PORT" not in env and env["NVFUSER_DUMP"] == "segmented_fusion"   # check adds its own
    args.collectives = False
    assert dtypes.child_environment(args)["NVFUSER_DUMP"] == "segmented_fusion,communication"


def test_a_second_signal_while_ending_does_not_leave_a_process_behind(tmp_path):
    import signal
    import subprocess
    import threading
    deaf = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                             "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, start_new_session=True)
    assert deaf.stdout.readline() == b"up\n"
    before = signal.signal(signal.SIGTERM, launch._raise_ended)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()   # mid-grace: ignored there
        launch._end_all([deaf], grace_s=1.5)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert deaf.poll() == -signal.SIGKILL
