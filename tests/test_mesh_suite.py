"""tools/mesh_suite.py on the reports the H200 wrote (run 9, and the runs each
test names; copies in tests/data, tests/data/README.md): verdicts under
today's rules, and the README's table drawn from them."""
import glob
import json
import os
import sys

import pytest

sys.path.insert(0, "tools")
import mesh_suite  # noqa: E402

RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "2026-12-03-h200")
RUN9 = os.path.join(RUNS, "run9")


def _report(name):
    return json.load(open(f"{RUN9}/{name}.json"))


def test_the_slowest_rank_per_phase():
    report = _report("tiny_2x2")
    for case in report["cases"]:
        for r in case["ranks"]:
            r["seconds"] = {"reference": 1.0 + r["rank"], "forward": 30.0 - r["rank"]}
    case = mesh_suite.summarize(report)["cases"]["fp32"]
    assert case["seconds"] == {"reference": 4.0, "forward": 30.0}


def test_what_the_ranks_held_at_once_beside_the_estimate():
    report = _report("tiny_2x2")
    assert mesh_suite.summarize(report)["cases"]["fp32"]["peak_gib"] is None   # reports from before the key
    for case in report["cases"]:
        for r in case["ranks"]:   # rank 0 holds the reference, then every rank its block
            r["peak_gib"] = {"reference": 9.0 if r["rank"] == 0 else 0.5, "block": 1.5 + r["rank"]}
    summary = mesh_suite.summarize(report)
    assert summary["cases"]["fp32"]["peak_gib"] == 12.0   # blocks 1.5 + 2.5 + 3.5 + 4.5 over rank 0's reference 9
    report["cases"][0]["ranks"][0]["peak_gib"]["reference"] = 20.0   # while it runs, the others hold nothing yet
    assert mesh_suite.summarize(report)["cases"]["fp32"]["peak_gib"] == 20.0
    table = mesh_suite.format_summary({"tiny_2x2": {**summary, "seconds": 40, "estimate_gib": 4.0}})
    assert "GiB est/peak" in table and "  4.0/12.0" in table


def test_verdicts_are_recomputed_from_the_figures():
    # written under the old 5x wrong-stream rule (tiny: 3.1-4.1x), passing under today's 2x
    tiny = _report("tiny_2x2")
    assert not tiny["ok"]
    assert mesh_suite.summarize(tiny)["ok"]
    (rank,) = [r for r in tiny["cases"][1]["ranks"] if r["rank"] == 0]
    rank["forward"]["wrong_stream_branch_rel_err"] = rank["forward"]["branch_rel_err"]   # a vacuous control
    assert not mesh_suite.passed(rank)


def test_a_failed_mesh_gives_no_verdict_on_masks_or_collectives():
    case = mesh_suite.summarize(_report("tiny_1x8"))["cases"]["fp32"]
    assert case["ranks_ok"] == 0 and case["masks_equal"] is None and case["collectives_match"] is None
    assert "stride" in case["errors"][0]


def test_the_table_has_a_row_per_report_and_dtype():
    lines = mesh_suite.markdown_table([RUN9]).splitlines()
    reports = [p for p in glob.glob(f"{RUN9}/*.json") if "cases" in json.load(open(p))]
    assert len(lines) == 2 + 2 * len(reports)
    row = next(line for line in lines if line.startswith("| tiny_1x2 | fp32 |"))
    assert "| 2/2 | 2.0e-08 | 2.4e-07 | - | bit-exact | as planned | run9 (cac77df) |" in row
    assert all(len(line.split("|")) == len(lines[0].split("|")) for line in lines)


def test_stored_collectives_are_judged_by_todays_plan():
    """Run 17's SP reports failed on collectives against the plan they were written
    with (no all-reduces of the tp-replicated gradients); today's plan has them."""
    report = json.load(open(f"{RUNS}/run17/tiny_2x2_sp.json"))
    assert not report["ok"]
    assert mesh_suite.summarize(report)["ok"]
    rank = report["cases"][0]["ranks"][3]
    rank["collectives"]["backward"]["posted"].pop()   # one all-reduce fewer than nvFuser posted
    assert not mesh_suite.passed(rank)


def test_a_failed_graph_replay_fails_the_rank():
    rank = json.load(open(f"{RUNS}/run15/graphs_2x2.json"))["cases"][1]["ranks"][2]
    assert rank["graphs"] and mesh_suite.passed(rank)
    rank["graphs"][next(iter(rank["graphs"]))] = False
    assert not mesh_suite.passed(rank)


def test_a_suite_mesh_folder_is_named_by_its_run_and_later_runs_replace_earlier_rows():
    """Runs 19 and 20 wrote their reports under runN/mesh; run 19's tiny 1x2 SP
    (fp32 and bf16) replaces run 17's (fp32 only) in the table."""
    assert mesh_suite.run_name(f"{RUNS}/run20/mesh/") == "run20/mesh"
    assert mesh_suite.run_name(RUN9) == "run9"
    runs = [f"{RUNS}/run17", f"{RUNS}/run19/mesh", f"{RUNS}/run20/mesh"]
    lines = mesh_suite.markdown_table(runs).splitlines()
    row = next(line for line in lines if line.startswith("| tiny_2x4 | fp32 |"))
    assert "| 8/8 | 2.2e-08 | 2.7e-07 | - | bit-exact | as planned | run20/mesh (20b74c5) |" in row
    sp_rows = [line for line in lines if line.startswith("| tiny_1x2_sp |")]
    assert len(sp_rows) == 2 and all("| run19/mesh (20b74c5) |" in line for line in sp_rows)
    assert "| run17 (06960ab) |" in mesh_suite.markdown_table(runs[:1])   # what it replaced
    # the SP job ran fp32 only (its bf16 case ended at the call's bound): no bf16 row is made up
    assert not any(line.startswith("| tiny_2x4_sp | bf16 |") for line in lines)


def test_a_job_cut_before_all_its_dtypes_ran_fails():
    """Run 20's tiny 2x4 SP: its fp32 case passed on every rank, its bf16 case never ran."""
    report = json.load(open(f"{RUNS}/run20/mesh/tiny_2x4_sp.json"))
    summary = mesh_suite.summarize(report)
    assert summary["cases"]["fp32"]["ranks_ok"] == 8 and summary["missing"] == ["bf16"]
    assert summary["cases"]["fp32"]["seconds"] == {}        # reports before this session carry no times
    assert not summary["ok"]
    assert "tiny_2x4_sp        bf16  not run" in mesh_suite.format_summary({"tiny_2x4_sp": {**summary, "seconds": 476}})


def test_jobs_are_picked_by_group_name_and_dtype():
    assert [mesh_suite.job_name(*j[:4]) for j in mesh_suite.pick_jobs(["nanogpt"])] == ["nanogpt_1x5", "nanogpt_2x1"]
    (job,) = mesh_suite.pick_jobs(["tiny_2x4_sp:bf16"])
    assert job == ("tiny", 2, 4, True, ["bf16"])
    assert mesh_suite.pick_jobs(["tiny_2x4_sp"])[0][4] == ["fp32", "bf16"]
    for bad in ("tiny:bf16", "gpt3_1x8:fp32", "tiny_9x9"):
        try:
            mesh_suite.pick_jobs([bad])
        except SystemExit as e:
            assert bad.partition(":")[0] in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_reports_are_judged_by_the_plan_of_the_fusions_they_ran():
    """A 2x1 run with the unit-axis splits (run 17: all-reduces over a team of
    one posted) and one without (run 28: none) both pass, each by its own
    plan; judged by the other's, each would fail."""
    with_splits = json.load(open(f"{RUNS}/run17/tiny_2x1_sp.json"))
    without = json.load(open(f"{RUNS}/run28/nounit_tiny_2x1.json"))
    assert "split_unit_axes" not in with_splits and without["split_unit_axes"] is False
    assert mesh_suite.summarize(with_splits)["ok"] and mesh_suite.summarize(without)["ok"]
    assert not mesh_suite.summarize({**with_splits, "split_unit_axes": False})["ok"]
    assert not mesh_suite.summarize({**without, "split_unit_axes": True})["ok"]


def test_collectives_are_judged_by_the_plan_of_the_schedule_the_rank_ran():
    """A report names its schedule: the default (cut at the linears) plans what
    megatron-sp does; the overlapped schedule plans chunked collectives, which
    these ranks (run 17, unchunked) did not post. Reports without the key are megatron's."""
    rank = json.load(open(f"{RUNS}/run17/tiny_2x2_sp.json"))["cases"][0]["ranks"][3]
    assert "schedule" not in rank and mesh_suite.passed(rank)
    rank["schedule"] = "megatron-sp-cut-linears"
    assert mesh_suite.passed(rank)
    rank["schedule"] = "megatron-sp-overlap"
    assert not mesh_suite.passed(rank)


def test_a_job_name_is_checked_before_the_gpu_is_asked_for(tmp_path):
    with pytest.raises(SystemExit, match="'tiny_9x9': neither a group"):
        mesh_suite.main(str(tmp_path / "out"), ["tiny_9x9"])
    assert not (tmp_path / "out").exists()
