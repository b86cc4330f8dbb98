"""bench --startup's reading of nvFuser's trace (bench/startup.py): the
calling thread's wall time in the segmenter and in compiling kernels, the
compile's worker threads (which open the same scope) not added on top."""
from tpfuser.bench.startup import format_startup, trace_phases

EVENT = '{{ "name": "{}", "ph": "{}", "pid": 1, "tid": {}, "ts": {} }},'
RUN, SEG, COMPILE = ("FusionExecutorCache::runFusionWithInputs", "SegmentCandidateFinder::SegmentCandidateFinder",
                     "FusionKernelRuntime::compileFusionParallel")


def _trace(*events) -> str:
    return "{\n\"traceEvents\": [\n" + "\n".join(EVENT.format(*e) for e in events)   # cut short: no closing ]


def test_the_callers_wall_time_not_the_workers_sum():
    text = _trace((RUN, "B", 7, 0), (SEG, "B", 7, 100), (SEG, "E", 7, 2_000_100),
                  (COMPILE, "B", 7, 3_000_000), (COMPILE, "B", 9, 3_000_010), (COMPILE, "E", 9, 4_000_010),
                  (COMPILE, "B", 11, 3_000_020), (COMPILE, "E", 11, 4_500_020), (COMPILE, "E", 7, 4_600_000),
                  (RUN, "E", 7, 5_000_000),
                  (RUN, "B", 7, 6_000_000), (COMPILE, "B", 7, 6_000_100), (COMPILE, "E", 7, 6_500_100))
    phases = trace_phases(text)
    assert abs(phases["segmenting_s"] - 2.0) < 1e-9
    assert abs(phases["compiling_kernels_s"] - (1.6 + 0.5)) < 1e-9   # two fusions' compiles, the caller's wall time


def test_the_backward_on_autograds_thread_counts_too():
    """A training step: the forward's execute on the caller's thread, the backward's
    on autograd's device thread; a worker thread's compile scope not added."""
    text = _trace((RUN, "B", 7, 0), (SEG, "B", 7, 100), (SEG, "E", 7, 1_000_100), (RUN, "E", 7, 2_000_000),
                  (RUN, "B", 12, 3_000_000), (SEG, "B", 12, 3_000_100), (SEG, "E", 12, 3_500_100),
                  (COMPILE, "B", 12, 3_600_000), (COMPILE, "B", 13, 3_600_100), (COMPILE, "E", 13, 3_900_000),
                  (COMPILE, "E", 12, 4_000_000), (RUN, "E", 12, 4_100_000))
    phases = trace_phases(text)
    assert abs(phases["segmenting_s"] - 1.5) < 1e-9
    assert abs(phases["compiling_kernels_s"] - 0.4) < 1e-9


def test_a_thread_id_given_again_to_a_worker_is_not_counted_twice():
    text = _trace((RUN, "B", 7, 0), (COMPILE, "B", 7, 100), (COMPILE, "B", 9, 200), (COMPILE, "E", 9, 500_200),
                  (COMPILE, "E", 7, 1_000_100), (RUN, "E", 7, 1_100_000),
                  (RUN, "B", 9, 2_000_000), (RUN, "E", 9, 2_100_000),            # 9 ran an execute too, later
                  (RUN, "B", 12, 3_000_000), (COMPILE, "B", 12, 3_000_100),
                  (COMPILE, "B", 9, 3_000_200), (COMPILE, "E", 9, 3_500_200),   # ... and works for 12's compile
                  (COMPILE, "E", 12, 4_000_100), (RUN, "E", 12, 4_100_000))
    assert abs(trace_phases(text)["compiling_kernels_s"] - 2.0) < 1e-9


def test_a_table_row_for_every_implementation_failed_or_not():
    row = {"impl": "nvfuser", "pass": "forward", "import_s": 3.0, "build_s": 2.0, "first_call_s": 7.0,
           "second_call_s": 0.002, "segmenting_s": 2.5, "compiling_kernels_s": 4.0}
    rep = {"preset": "nanogpt", "config": {"dtype": "bf16", "dropout": 0.1}, "schedule": {"name": "megatron"},
           "gpu": "H200", "rows": [row, {"impl": "compile", "pass": "forward", "error": "exit 1: boom"}]}
    text = format_startup(rep)
    assert "nvfuser" in text and "9.0" in text and "FAILED: exit 1: boom" in text


def test_the_command_fails_when_no_implementation_was_measured(monkeypatch, capsys, tmp_path):
    """Every fresh process failed: the table and JSON are still written, and the exit status says so."""
    import torch
    from tpfuser import cli
    from tpfuser.bench import cli as bench_cli
    rows = {"all": [{"impl": "nvfuser", "pass": "forward", "error": "exit 1: boom"}],
            "some": [{"impl": "nvfuser", "pass": "forward", "import_s": 1.0, "build_s": 1.0, "first_call_s": 1.0,
                      "second_call_s": 0.001}, {"impl": "eager", "pass": "forward", "error": "exit 1: boom"}]}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")   # (the report's environment)
    for which, want in (("all", 1), ("some", 0)):
        monkeypatch.setattr(bench_cli, "run_startup", lambda *a, **k: {
            "kind": "startup", "preset": "tiny", "config": {"dtype": "bf16", "dropout": 0.1},
            "schedule": {"name": "megatron"}, "gpu": None, "rows": rows[which]})
        out = tmp_path / f"{which}.json"
        assert cli.main(["bench", "--startup", "--preset", "tiny", "--json", str(out)]) == want, which
        assert out.exists() and "FAILED: exit 1: boom" in capsys.readouterr().out
