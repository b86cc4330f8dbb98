"""tools/summarize.py, the suite's last table, on what runs 18, 20 and 21 wrote
(copies in tests/data; tests/data/README.md) (CPU)."""
import json
import os
import shutil
import subprocess
import sys

RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "2026-12-03-h200")


def _summarize(folder):
    run = subprocess.run([sys.executable, "tools/summarize.py", str(folder)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-500:]
    return run.stdout, json.load(open(os.path.join(folder, "summary.json")))


def test_memory_and_time_lines_of_a_training_benchmark(tmp_path):
    shutil.copy(f"{RUNS}/run21/bench_nanogpt_train.json", tmp_path)
    text, summary = _summarize(tmp_path)
    line = next(ln for ln in text.splitlines() if "fwd+bwd nvfuser-graph" in ln)
    assert "1.111 ms, x0.37 eager" in line and "pool 326 MiB, held 360 MiB" in line
    assert "peak" not in line        # a replay's peak above baseline reads 0: not shown
    eager = next(ln for ln in text.splitlines() if "fwd+bwd eager " in ln)
    assert "peak 262 MiB, saved 181 MiB, held 354 MiB" in eager
    assert summary["bench_nanogpt_train"]["results"]["eager"]["reserved_mib"] == 354.0


def test_a_cut_mesh_job_says_which_dtype_never_ran(tmp_path):
    (tmp_path / "mesh").mkdir()
    sys.path.insert(0, "tools")
    import mesh_suite
    report = json.load(open(f"{RUNS}/run20/mesh/tiny_2x4_sp.json"))
    summary = {"tiny_2x4_sp": {"rc": 124, "seconds": 476.1, **mesh_suite.summarize(report)}}
    (tmp_path / "mesh" / "mesh_summary.json").write_text(json.dumps(summary))
    text, _ = _summarize(tmp_path)
    assert "mesh tiny_2x4_sp bf16  NOT RUN: the job ended first" in text
    assert "mesh tiny_2x4_sp fp32  8/8 ranks ok" in text


def test_overlap_rows_and_the_one_head_probe_are_in_the_table(tmp_path):
    shutil.copy(f"{RUNS}/run18/overlap_tp1.json", tmp_path)
    (tmp_path / "onehead_tp2_h2.txt").write_text(
        "noise from torchrun\n"
        "rank 0: select    heads 2 tp 2: ran, max error 0.0e+00\n"
        "rank 1: select    heads 2 tp 2: ran, max error 0.0e+00\n"
        "rank 0: slice     heads 2 tp 2: FAILED: INTERNAL ASSERT | Expected (stride)==(expected) . Found 24 vs 8.\n")
    text, summary = _summarize(tmp_path)
    assert "overlap tp 1 row-parallel all-reduce x4" in text and "4 posted, ok" in text
    assert len(summary["overlap"]) == 6
    assert summary["onehead"] == [
        {"case": "select heads 2 tp 2", "result": "ran, max error 0.0e+00"},
        {"case": "slice heads 2 tp 2", "result": "FAILED: INTERNAL ASSERT | Expected (stride)==(expected) . Found 24 vs 8."}]
    assert "one head: slice heads 2 tp 2" in text and "Found 24 vs 8" in text
