"""tools/mesh_suite.py on `check --json` reports made here (tests/mesh_reports.py:
the keys check writes, figures invented, collectives written out by hand):
verdicts recomputed under today's rules and plan, the summary and the README's
table drawn from them."""
import json
import sys

import pytest

from tests.mesh_reports import megatron_posted, mesh_report, rank_report

sys.path.insert(0, "tools")
import mesh_suite  # noqa: E402


def test_the_slowest_rank_per_phase():
    report = mesh_report(2, 2)
    for case in report["cases"]:
        for r in case["ranks"]:
            r["seconds"] = {"reference": 1.0 + r["rank"], "forward": 30.0 - r["rank"]}
    case = mesh_suite.summarize(report)["cases"]["fp32"]
    assert case["seconds"] == {"reference": 4.0, "forward": 30.0}


def test_what_the_ranks_held_at_once_beside_the_estimate():
    report = mesh_report(2, 2)
    assert mesh_suite.summarize(report)["cases"]["fp32"]["peak_gib"] is None   # reports without the key
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
    """A report stored as failed (its wrong streams told apart 3.5 times, under a
    stricter rule than today's 2) passes now; a vacuous control fails a rank."""
    report = mesh_report(2, 2, ok=False)
    assert mesh_suite.summarize(report)["ok"]
    (rank,) = [r for r in report["cases"][1]["ranks"] if r["rank"] == 0]
    assert rank["dtype"] == "bf16" and mesh_suite.passed(rank)
    rank["forward"]["wrong_stream_branch_rel_err"] = rank["forward"]["branch_rel_err"]   # a vacuous control
    assert not mesh_suite.passed(rank)
    rank["forward"]["wrong_stream_branch_rel_err"] = 3.5 * rank["forward"]["branch_rel_err"]
    rank["backward"]["mask_mismatches"]["resid_mlp_keep"] = 3
    assert not mesh_suite.passed(rank)


def test_a_failed_mesh_gives_no_verdict_on_masks_or_collectives():
    report = mesh_report(1, 8, dtypes=("fp32",))
    report["cases"][0]["ranks"] = [{"preset": "tiny", "dtype": "fp32", "dropout": 0.1, "rank": r, "ok": False,
                                    "error": "RuntimeError: Expected (stride)==(expected): found 24 vs 8"}
                                   for r in range(8)]
    case = mesh_suite.summarize(report)["cases"]["fp32"]
    assert case["ranks_ok"] == 0 and case["masks_equal"] is None and case["collectives_match"] is None
    assert "stride" in case["errors"][0]


def test_the_table_has_a_row_per_report_and_dtype(tmp_path):
    run = tmp_path / "run9"
    run.mkdir()
    for name, report in {"tiny_1x2": mesh_report(1, 2), "tiny_2x2_sp": mesh_report(2, 2, sp=True)}.items():
        (run / f"{name}.json").write_text(json.dumps(report))
    (run / "mesh_summary.json").write_text("{}")   # no cases: not a report
    lines = mesh_suite.markdown_table([str(run)]).splitlines()
    assert len(lines) == 2 + 2 * 2
    row = next(line for line in lines if line.startswith("| tiny_1x2 | fp32 |"))
    assert "| 2/2 | 2.0e-08 | 2.4e-07 | - | bit-exact | as planned | run9 (cac77df) |" in row
    bf16 = next(line for line in lines if line.startswith("| tiny_2x2_sp | bf16 |"))
    assert "| 4/4 | 3.0e-03 | 6.0e-03 | 3.5 | bit-exact | as planned |" in bf16
    assert all(len(line.split("|")) == len(lines[0].split("|")) for line in lines)


def test_stored_collectives_are_judged_by_todays_plan():
    """A report whose stored verdict on collectives failed passes when what the
    rank posted is today's plan; one all-reduce fewer fails it."""
    report = mesh_report(2, 2, sp=True, ok=False)
    for case in report["cases"]:
        for r in case["ranks"]:
            r["ok"] = False
            for phase in r["collectives"].values():
                phase["matches"] = False
    assert mesh_suite.summarize(report)["ok"]
    rank = report["cases"][0]["ranks"][3]
    rank["collectives"]["backward"]["posted"].pop()   # one all-reduce fewer than planned
    assert not mesh_suite.passed(rank)
    rank = report["cases"][0]["ranks"][2]
    rank["collectives"]["forward"]["posted"][0]["team"] = [0, 1]   # over the other dp row's tp ranks
    assert not mesh_suite.passed(rank)


def test_a_failed_graph_replay_fails_the_rank():
    rank = rank_report(2, 2, False, 2, graphs={"forward equal": True, "train step equal": True})
    assert mesh_suite.passed(rank)
    rank["graphs"]["forward equal"] = False
    assert not mesh_suite.passed(rank)


def test_a_suite_mesh_folder_is_named_by_its_run_and_later_runs_replace_earlier_rows(tmp_path):
    """The suite writes its reports under runN/mesh; a later folder's report of a
    mesh replaces an earlier one's rows, and no row is made up for a dtype a
    report never ran."""
    folders = {"run17": {"tiny_1x2_sp": mesh_report(1, 2, sp=True, dtypes=("fp32",), commit="06960ab0")},
               "run19/mesh": {"tiny_1x2_sp": mesh_report(1, 2, sp=True, commit="20b74c50")},
               "run20/mesh": {"tiny_2x4": mesh_report(2, 4, commit="20b74c50"),
                              "tiny_2x4_sp": mesh_report(2, 4, sp=True, ran=("fp32",), commit="20b74c50")}}
    for folder, reports in folders.items():
        (tmp_path / folder).mkdir(parents=True)
        for name, report in reports.items():
            (tmp_path / folder / f"{name}.json").write_text(json.dumps(report))
    assert mesh_suite.run_name(f"{tmp_path}/run20/mesh/") == "run20/mesh"
    assert mesh_suite.run_name(str(tmp_path / "run17")) == "run17"
    runs = [str(tmp_path / f) for f in folders]
    lines = mesh_suite.markdown_table(runs).splitlines()
    row = next(line for line in lines if line.startswith("| tiny_2x4 | fp32 |"))
    assert "| 8/8 | 2.0e-08 | 2.4e-07 | - | bit-exact | as planned | run20/mesh (20b74c5) |" in row
    sp_rows = [line for line in lines if line.startswith("| tiny_1x2_sp |")]
    assert len(sp_rows) == 2 and all("| run19/mesh (20b74c5) |" in line for line in sp_rows)
    assert "| run17 (06960ab) |" in mesh_suite.markdown_table(runs[:1])   # what it replaced
    assert not any(line.startswith("| tiny_2x4_sp | bf16 |") for line in lines)


def test_a_job_cut_before_all_its_dtypes_ran_fails():
    """A job whose fp32 case passed on every rank and whose bf16 case never ran."""
    summary = mesh_suite.summarize(mesh_report(2, 4, sp=True, ran=("fp32",)))
    assert summary["cases"]["fp32"]["ranks_ok"] == 8 and summary["missing"] == ["bf16"]
    assert summary["cases"]["fp32"]["seconds"] == {}        # reports without times
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
    """At 2x1 a run with the unit-axis splits posts tp's all-reduces over a team
    of one, a run without them none; each passes by its own plan and would fail
    by the other's. A report without the key (written before it) ran split."""
    with_splits = mesh_report(2, 1, dtypes=("fp32",))
    for r in with_splits["cases"][0]["ranks"]:
        r["collectives"] = {phase: {"planned": [], "posted": p, "matches": True}
                            for phase, p in megatron_posted(2, 1, False, r["rank"], unit_splits=True).items()}
    del with_splits["split_unit_axes"]
    without = mesh_report(2, 1, dtypes=("fp32",))
    assert without["split_unit_axes"] is False
    assert mesh_suite.summarize(with_splits)["ok"] and mesh_suite.summarize(without)["ok"]
    assert not mesh_suite.summarize({**with_splits, "split_unit_axes": False})["ok"]
    assert not mesh_suite.summarize({**without, "split_unit_axes": True})["ok"]


def test_collectives_are_judged_by_the_plan_of_the_schedule_the_rank_ran():
    """A report names its schedule: the default (cut at the linears) plans what
    megatron-sp does; the overlapped schedule plans chunked collectives, which
    these ranks (unchunked) did not post. Reports without the key are megatron's."""
    rank = rank_report(2, 2, True, 3)
    assert "schedule" not in rank and mesh_suite.passed(rank)
    rank["schedule"] = "megatron-sp-cut-linears"
    assert mesh_suite.passed(rank)
    rank["schedule"] = "megatron-sp-overlap"
    assert not mesh_suite.passed(rank)


def test_a_job_name_is_checked_before_the_gpu_is_asked_for(tmp_path):
    with pytest.raises(SystemExit, match="'tiny_9x9': neither a group"):
        mesh_suite.main(str(tmp_path / "out"), ["tiny_9x9"])
    assert not (tmp_path / "out").exists()
