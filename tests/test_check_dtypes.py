"""`tpfuser check --dtype fp32 bf16` on one GPU: each dtype in a process of its
own, side by side (verify/dtypes.py), one table and JSON; the processes run at
once under one bound (launch.run_bounded_all). CPU: the children faked, or
plain Python."""
import json
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

    def children(cmds, env, timeout_s, stdouts=None):   # bf16's passes, fp32's process dies without a result
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
    assert text.index("fp32") < text.index("bf16") and "exit -9, no result written" in text
    assert "SOME RANK FAILED" in text
    report = json.loads((tmp_path / "all.json").read_text())
    assert [c["dtype"] for c in report["cases"]] == ["fp32", "bf16"] and not report["ok"] and report["side_by_side"]

    def late(cmds, env, timeout_s, stdouts=None):
        return [None, None]
    monkeypatch.setattr(dtypes, "run_bounded_all", late)
    assert dtypes.check_side_by_side(cfgs, layout, args) == 1
    assert capsys.readouterr().out.count("did not finish in 30 s (TPFUSER_TIMEOUT_S sets the bound)") == 2

    def both_pass(cmds, env, timeout_s, stdouts=None):
        for cmd, dtype in zip(cmds, ("fp32", "bf16")):
            with open(cmd[cmd.index("--json") + 1], "w") as f:
                json.dump({"cases": [_case(dtype, True)]}, f)
        return [0, 0]
    monkeypatch.setattr(dtypes, "run_bounded_all", both_pass)
    assert dtypes.check_side_by_side(cfgs, layout, args) == 0
    assert "all ranks within tolerance" in capsys.readouterr().out


def test_commands_run_at_once_under_one_bound(tmp_path):
    sleep = [sys.executable, "-c", "import time, sys; time.sleep(1.0); sys.exit(3)"]
    begun = time.monotonic()
    assert launch.run_bounded_all([sleep, sleep], {}, timeout_s=30) == [3, 3]
    assert time.monotonic() - begun < 1.9   # side by side, not one after the other
    marker = tmp_path / "late"
    late = [sys.executable, "-c", f"import time; time.sleep(60); open({str(marker)!r}, 'w')"]
    quick = [sys.executable, "-c", "print('hi')"]
    with open(tmp_path / "quick.out", "w") as out, open(tmp_path / "late.out", "w") as late_out:
        begun = time.monotonic()
        assert launch.run_bounded_all([quick, late], {}, timeout_s=2, grace_s=1, stdouts=[out, late_out]) == [0, None]
    assert time.monotonic() - begun < 20 and not marker.exists()
    assert (tmp_path / "quick.out").read_text() == "hi\n"


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
