"""tools/summarize.py, the GPU suite's last table, on a suite's output folder
made here (reports in the schemas the suite's steps write, figures invented)."""
import json
import os
import runpy
import sys

from tests.mesh_reports import mesh_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _summarize(folder, monkeypatch, capsys):
    """The script run in this process on `folder`: its table, and the summary.json it wrote."""
    monkeypatch.setattr(sys, "argv", ["summarize.py", str(folder)])
    monkeypatch.setattr(sys, "path", list(sys.path))   # (the script puts tools/probes on it)
    runpy.run_path(os.path.join(ROOT, "tools", "summarize.py"), run_name="__main__")
    return capsys.readouterr().out, json.load(open(os.path.join(folder, "summary.json")))


def _row(ms, **extra):
    return {"median_ms": ms, "min_ms": ms, "max_ms": ms, "runs": 10, "tflops": 1.0, "fraction_of_matmul_rate": 0.5,
            **extra}


def test_memory_and_time_lines_of_a_training_benchmark(tmp_path, monkeypatch, capsys):
    bench = {"compute_floor_ms": 0.5, "results": {
        "eager": _row(3.0, ratio_to_eager=1.0, peak_mib_above_baseline=262.0, saved_activation_mib=181.0,
                      reserved_mib=354.0),
        "nvfuser-graph": _row(1.111, ratio_to_eager=0.37, peak_mib_above_baseline=0.0, graph_pool_mib=326.0,
                              reserved_mib=360.0)},
        "failed": {"compile": "RuntimeError: out of memory"}}
    (tmp_path / "bench_nanogpt_train.json").write_text(json.dumps(bench))
    text, summary = _summarize(tmp_path, monkeypatch, capsys)
    line = next(ln for ln in text.splitlines() if "fwd+bwd nvfuser-graph" in ln)
    assert "1.111 ms, x0.37 eager" in line and "pool 326 MiB, held 360 MiB" in line
    assert "peak" not in line        # a replay's peak above baseline reads 0: not shown
    eager = next(ln for ln in text.splitlines() if "fwd+bwd eager " in ln)
    assert "3.000 ms, x1.00 eager, 0.50 of floor (0.500 ms), peak 262 MiB, saved 181 MiB, held 354 MiB" in eager
    assert "bench nanogpt_train compile" in text and "FAILED: RuntimeError: out of memory" in text
    assert summary["bench_nanogpt_train"]["results"]["eager"]["reserved_mib"] == 354.0


def test_a_cut_mesh_job_says_which_dtype_never_ran(tmp_path, monkeypatch, capsys):
    (tmp_path / "mesh").mkdir()
    monkeypatch.syspath_prepend(os.path.join(ROOT, "tools"))
    import mesh_suite
    summary = {"tiny_2x4_sp": {"rc": 124, "seconds": 476.1,
                               **mesh_suite.summarize(mesh_report(2, 4, sp=True, ran=("fp32",)))}}
    (tmp_path / "mesh" / "mesh_summary.json").write_text(json.dumps(summary))
    text, _ = _summarize(tmp_path, monkeypatch, capsys)
    assert "mesh tiny_2x4_sp bf16  NOT RUN: the job ended first" in text
    assert "mesh tiny_2x4_sp fp32  8/8 ranks ok, out 2.0e-08, grads 2.4e-07, masks equal, collectives as planned" in text


def test_overlap_rows_and_the_one_head_probe_are_in_the_table(tmp_path, monkeypatch, capsys):
    rows = [{"kind": kind, "tp": 1, "chunks": chunks, "rank": 0, "rel_err": 6.4e-7, "vs_one_chunk": 0.0,
             "posted": chunks, "ok": True} for kind in ("row-parallel all-reduce", "all-gather column-parallel")
            for chunks in (1, 2, 4)]
    rows[-1] = {**rows[-1], "ok": False, "error": "RuntimeError: a made-up failure"}
    (tmp_path / "overlap_tp1.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "onehead_tp2_h2.txt").write_text(
        "noise from torchrun\n"
        "rank 0: select    heads 2 tp 2: ran, max error 0.0e+00\n"
        "rank 1: select    heads 2 tp 2: ran, max error 0.0e+00\n"
        "rank 0: slice     heads 2 tp 2: FAILED: INTERNAL ASSERT | Expected (stride)==(expected) . Found 24 vs 8.\n")
    text, summary = _summarize(tmp_path, monkeypatch, capsys)
    assert "overlap tp 1 row-parallel all-reduce x4" in text and "4 posted, ok" in text
    assert "overlap tp 1 all-gather column-parallel x4" in text and "FAILED: RuntimeError: a made-up failure" in text
    assert len(summary["overlap"]) == 6
    assert summary["onehead"] == [
        {"case": "select heads 2 tp 2", "result": "ran, max error 0.0e+00"},
        {"case": "slice heads 2 tp 2", "result": "FAILED: INTERNAL ASSERT | Expected (stride)==(expected) . Found 24 vs 8."}]
    assert "one head: slice heads 2 tp 2" in text and "Found 24 vs 8" in text
