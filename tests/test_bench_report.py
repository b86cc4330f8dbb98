"""The benchmark's JSON schema, its table and its plot (CPU), on reports made
here in the schema bench.run writes (no measured report is read)."""
import copy
import json

import pytest
import torch

from tpfuser.bench.report import add_ratios, format_table, validate_report


def _row(ms: float, **extra) -> dict:
    return {"median_ms": ms, "min_ms": 0.9 * ms, "max_ms": 1.2 * ms, "runs": 10, "tflops": 100.0 / ms,
            "fraction_of_matmul_rate": 0.2 / ms, **extra}


def _report(medians=(("eager", 2.0), ("compile", 1.5), ("nvfuser", 1.0)), **extra) -> dict:
    """A bench report (bench.run's keys) with made-up figures: a row per (name, median ms)."""
    rows = {name: _row(ms) for name, ms in medians}
    rep = {"preset": "tiny", "config": {"batch": 4, "seq": 16, "n_embd": 64, "n_head": 8, "dropout": 0.1,
                                        "dtype": "bf16"},
           "pass": "forward", "mesh": "1x1", "gpu": "MADE UP", "torch": torch.__version__, "timing": "made up here",
           "matmul_tflops_measured": 500.0, "matmul_gflop": 1.0, "compute_floor_ms": 0.002, "results": rows, **extra}
    rep["best_peer"] = add_ratios(rows)
    return rep


PROFILE = {"kernels_per_call": 3.0, "kernel_ms_per_call": 0.5, "idle_ms_per_call": 0.1,
           "top_kernels_ms_per_call": [["gemm", 0.3], ["softmax", 0.1]]}


@pytest.mark.parametrize("extra, extra_lines", [
    ({}, 1),                                                              # the fastest peer's line
    ({"failed": {"nvfuser-graph": "RuntimeError: out of memory"}}, 2),   # and the failed one's
    ({"profile": True}, 2),                                               # and the profiled row's
], ids=["plain", "a failed impl", "a profile"])
def test_a_report_follows_the_schema_and_prints_a_line_a_row(extra, extra_lines):
    rep = _report(**{k: v for k, v in extra.items() if k != "profile"})
    if extra.get("profile"):
        rep["results"]["nvfuser"]["profile"] = PROFILE
    rep = validate_report(rep)
    assert rep["results"]["eager"]["ratio_to_eager"] == 1.0 and rep["best_peer"] == "compile"
    table = format_table(rep).splitlines()
    assert len(table) == 2 + len(rep["results"]) + extra_lines
    assert table[1] == "vs peer: to compile, the fastest peer"
    nvfuser = next(line for line in table if line.startswith("nvfuser "))
    assert nvfuser.split()[1:4] == ["1.000", "0.900", "1.200"] and nvfuser.split()[-2:] == ["0.50", "0.67"]


def test_a_report_without_eager_has_no_ratio_to_it():
    rep = validate_report(_report(medians=(("compile", 1.5), ("nvfuser", 1.0))))
    assert not any("ratio_to_eager" in r for r in rep["results"].values())


def test_the_matmul_key_of_older_reports_is_read():
    rep = _report()
    rep["forward_matmul_gflop"] = rep.pop("matmul_gflop")
    assert validate_report(rep)["matmul_gflop"] == 1.0


def test_ratios_to_eager_and_the_fastest_peer_and_the_graph_columns():
    rep = _report()
    rows = {name: {**r, "peak_mib_above_baseline": 1.0, "saved_activation_mib": 2.0} for name, r in rep["results"].items()}
    rows["nvfuser-graph"] = {**rows["eager"], "median_ms": rows["eager"]["median_ms"] / 4, "graph_pool_mib": 3.0,
                             "reserved_mib": 4.0}
    del rows["nvfuser-graph"]["saved_activation_mib"]
    rows["eager-graph"] = {**rows["eager"], "median_ms": rows["eager"]["median_ms"] / 2}
    best = add_ratios(rows)
    assert best == "eager-graph"   # the fastest that is not nvFuser's
    assert rows["nvfuser-graph"]["ratio_to_best_peer"] == 0.5 and rows["eager"]["ratio_to_eager"] == 1.0
    rep["results"], rep["best_peer"] = rows, best
    table = format_table(rep)
    assert "vs peer: to eager-graph, the fastest peer" in table and "pool MiB" in table
    graph_line = next(line for line in table.splitlines() if line.startswith("nvfuser-graph "))
    assert graph_line.split()[-4:] == ["1.0", "nan", "3.0", "4.0"]   # peak, saved (none: no autograd), pool, held
    assert "held MiB" in table
    assert add_ratios({"nvfuser": {"median_ms": 1.0}}) is None


def test_the_work_timed_alone_is_never_the_peer():
    """gemms and gemms+attention are parts of the block's work, faster than any
    whole block: were they peers, every ratio to the fastest peer would be theirs."""
    rows = {"eager": {"median_ms": 2.0}, "nvfuser-graph": {"median_ms": 1.5},
            "gemms": {"median_ms": 1.0}, "gemms+attention": {"median_ms": 1.2}}
    assert add_ratios(rows) == "eager"
    assert rows["nvfuser-graph"]["ratio_to_best_peer"] == 0.75 and rows["gemms"]["ratio_to_eager"] == 0.5


def test_the_work_timed_alone_is_refused_where_it_is_not_the_blocks():
    from tpfuser.bench.impls import check_impls
    from tpfuser.config import Layout
    check_impls(["gemms", "gemms+attention"], Layout())
    with pytest.raises(ValueError, match="'gemms'.*not a training step"):
        check_impls(["gemms"], Layout(), train=True)
    with pytest.raises(ValueError, match="'gemms\\+attention'.*not a 1x2 mesh"):
        check_impls(["gemms+attention"], Layout(1, 2))


def test_schema_errors_name_the_key():
    rep = _report()
    broken = copy.deepcopy(rep)
    del broken["compute_floor_ms"]
    with pytest.raises(ValueError, match="report: missing key 'compute_floor_ms'"):
        validate_report(broken)
    broken = copy.deepcopy(rep)
    name = next(iter(broken["results"]))
    broken["results"][name]["min_ms"] = 1e9
    with pytest.raises(ValueError, match="expected min <= median <= max"):
        validate_report(broken)


def test_plot_writes_a_png(tmp_path):
    from tpfuser.bench.plot import main
    out = tmp_path / "bench.png"
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    paths[0].write_text(json.dumps(_report()))
    paths[1].write_text(json.dumps(_report(preset="nanogpt")))
    assert main([str(out), *map(str, paths)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_against_tp_when_the_reports_span_meshes(tmp_path, monkeypatch):
    """Reports of several tp give a time-against-tp plot."""
    import matplotlib.image
    import tpfuser.bench.plot
    from tpfuser.bench.plot import main
    rep = _report()
    paths = []
    for tp in (1, 2, 4):
        r = copy.deepcopy(rep)
        r["mesh"] = f"1x{tp}"
        for row in r["results"].values():
            row.update({k: row[k] / tp for k in ("median_ms", "min_ms", "max_ms")})
        paths.append(tmp_path / f"tp{tp}.json")
        paths[-1].write_text(json.dumps(r))
    out = tmp_path / "scaling.png"
    assert main([str(out), *map(str, paths)]) == 0
    assert matplotlib.image.imread(out).shape[0] > 100
    called = []
    monkeypatch.setattr(tpfuser.bench.plot, "plot_scaling", lambda reps, path, *_: called.append(("scaling", len(reps))))
    monkeypatch.setattr(tpfuser.bench.plot, "plot_reports", lambda reps, path, *_: called.append(("bars", len(reps))))
    main([str(out), *map(str, paths)])
    main([str(out), str(paths[0])])
    assert called == [("scaling", 3), ("bars", 1)]


def test_a_shared_gpu_report_says_its_timings_are_not_speed_figures():
    rep = _report(gpus_shared=0)
    assert "not speed figures" not in format_table(rep)
    rep["gpus_shared"] = 1
    assert "ranks shared 1 GPU(s) (--share-gpu): these timings are not speed figures" in format_table(rep)


def test_a_report_says_where_it_came_from(monkeypatch):
    """Every report carries where it came from (verify.meshes.environment):
    date, nvFuser version, command, commit, and the schedule it ran under
    (which holds the q/k/v split)."""
    from tpfuser.bench.cli import bench_command
    from tpfuser.parallel.schedules import SCHEDULES
    from tpfuser.verify.meshes import environment
    assert bench_command(["/x/tpfuser/bench/__main__.py", "--preset", "nanogpt", "--train"]) == \
        "python3 -m tpfuser.bench --preset nanogpt --train"
    assert bench_command(["/usr/bin/tpfuser", "bench", "--tp", "2"]) == "tpfuser bench --tp 2"
    monkeypatch.setenv("TPFUSER_COMMIT", "abc123")
    env = environment("python3 -m tpfuser.bench --train", SCHEDULES["megatron"].as_dict())
    assert env["command"] == "python3 -m tpfuser.bench --train" and env["commit"] == "abc123"
    assert env["schedule"]["qkv_split"] == "slice" and env["schedule"]["name"] == "megatron"
    assert env["date"].startswith("20") and env["nvfuser"] != "?" and env["torch"] == torch.__version__


def test_host_column_only_when_every_row_has_it():
    """The host time to issue a call is a column where every row carries it;
    reports without it print as before."""
    rep = _report()
    assert "host ms" not in format_table(rep)
    for i, r in enumerate(rep["results"].values()):
        r["host_ms"] = 0.125 + i
    table = format_table(rep)
    assert "host ms" in next(line for line in table.splitlines() if line.startswith("impl "))
    eager = next(line for line in table.splitlines() if line.startswith("eager "))
    assert f"{0.125 + list(rep['results']).index('eager'):.3f}" in eager.split()


def test_a_sample_times_the_gpu_and_the_host_apart(monkeypatch):
    """sample's host figure is the time to issue the calls (a host clock faked
    here: each call takes 4 ms of it), its GPU figure the events' (10 ms between
    them whatever the host does)."""
    import types
    import tpfuser.bench.measure as measure
    clock = [100.0]
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class Event:
        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 10.0

    def call():
        clock[0] += 0.004
    gpu_ms, host_ms = measure.sample(call, Event(), Event(), calls=2)
    assert gpu_ms == 5.0 and host_ms == pytest.approx(4.0)


def test_the_commit_says_when_the_files_are_not_heads(tmp_path):
    """A report's commit is HEAD's only where the tracked files are HEAD's."""
    import subprocess
    from tpfuser.verify.meshes import git_commit

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    assert git_commit(str(tmp_path)) is None          # not a checkout
    git("init", "-q")
    assert git_commit(str(tmp_path)) is None          # no commit yet
    (tmp_path / "pkg").mkdir()
    (tmp_path / "tools").mkdir()
    for f in ("pkg/f.py", "tools/t.py", ".gitignore"):
        (tmp_path / f).write_text("*.log\n" if f == ".gitignore" else "a = 1\n")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    pkg = str(tmp_path / "pkg")                        # asked from the package's folder, as environment() does
    (tmp_path / "run.log").write_text("ignored")
    assert git_commit(pkg) == head
    (tmp_path / "tools" / "t.py").write_text("a = 2\n")   # a change outside the package's folder
    assert git_commit(pkg) == head + " + changes"
    git("checkout", "--", "tools/t.py")
    (tmp_path / "tools" / "new.py").write_text("b = 1\n")  # a file the old .git does not know
    assert git_commit(pkg) == head + " + changes"


def _record_blocks(monkeypatch):
    """The bench's blocks made as recorders of what they were asked to be (no nvFuser run)."""
    import tpfuser.runtime.block
    import tpfuser.runtime.graphs

    class Recorder:
        def __init__(self, cfg, layout, rank, **options):
            self.options = options

        def load(self, state):
            return self

    monkeypatch.setattr(tpfuser.runtime.block, "ShardedBlock", Recorder)
    monkeypatch.setattr(tpfuser.runtime.graphs, "GraphedForward", lambda block: block)


def test_each_nvfuser_impl_builds_its_block_with_its_options(monkeypatch):
    """bench's nvFuser implementations differ only in the schedule their
    ShardedBlock runs (mesh, nvFuser options, device keys), the bench's
    schedule changed as each says: recorded here, no GPU. The unit-axis splits
    (the nvfuser-split impls, gone) are the bench's schedule's split_unit_axes."""
    from tpfuser.bench.impls import IMPLS, NVFUSER_CALLED, NVFUSER_GRAPHED, check_impls, forward_fns
    from tpfuser.config import Layout, preset
    from tpfuser.parallel.schedules import SCHEDULES

    _record_blocks(monkeypatch)
    impls = [*NVFUSER_CALLED, *NVFUSER_GRAPHED]
    check_impls(impls, Layout())
    assert set(impls) <= set(IMPLS)
    base = SCHEDULES["megatron"]
    for schedule in (base, base.replace(split_unit_axes=True)):
        fns = forward_fns(preset("tiny"), torch.nn.Linear(1, 1), None, impls, Layout(), 0, None, schedule)
        made = {impl: fn.__defaults__[0].options for impl, fn in fns.items()}   # the block each call runs
        assert all(set(options) == {"schedule"} for options in made.values())
        made = {impl: options["schedule"] for impl, options in made.items()}
        assert made["nvfuser"] == schedule and made["nvfuser-nomesh"] == schedule.replace(mesh=False)
        assert made["nvfuser-graph"] == schedule.replace(keys_on_device=True)
        assert made["nvfuser-graph-fm"] == schedule.replace(keys_on_device=True, enable_options=("fuse_matmul",))
        assert all(s.split_unit_axes == schedule.split_unit_axes for s in made.values())


def test_the_training_benches_take_every_option_their_impls_give():
    """train_fns builds the called nvFuser impls as TPBlock(schedule=...), the
    graphed ones as ShardedBlock(schedule=...), each schedule the bench's
    changed by NVFUSER_CALLED[impl] / NVFUSER_GRAPHED[impl] (nvfuser_schedule):
    an option that is no schedule field would fail only on a GPU."""
    import dataclasses
    import inspect
    from tpfuser.bench.impls import NVFUSER_CALLED, NVFUSER_GRAPHED, nvfuser_schedule
    from tpfuser.parallel.schedules import SCHEDULES, Schedule
    from tpfuser.runtime.block import ShardedBlock
    from tpfuser.runtime.module import TPBlock
    takes = {cls: set(inspect.signature(cls.__init__).parameters) for cls in (TPBlock, ShardedBlock)}
    assert "schedule" in takes[TPBlock] and "schedule" in takes[ShardedBlock]
    fields = {f.name for f in dataclasses.fields(Schedule)}
    assert all(set(options) <= fields for options in [*NVFUSER_CALLED.values(), *NVFUSER_GRAPHED.values()])
    for name in ("megatron", "megatron-sp"):
        for impl in NVFUSER_CALLED:
            assert isinstance(nvfuser_schedule(SCHEDULES[name], impl), Schedule)
        for impl in NVFUSER_GRAPHED:
            assert nvfuser_schedule(SCHEDULES[name], impl, graphed=True).keys_on_device


def test_an_nvfuser_impl_may_run_its_own_schedule_beside_the_benchs(monkeypatch, tmp_path):
    """impl@schedule: the same implementation under another schedule, timed in
    the same loop (a name or a JSON file); refused in one line for a peer, an
    unknown schedule, or one that splits the input otherwise (SP or not)."""
    from tpfuser.bench.impls import check_impls, forward_fns, split_impl
    from tpfuser.config import Layout, preset
    from tpfuser.parallel.schedules import SCHEDULES

    _record_blocks(monkeypatch)
    own = tmp_path / "mine.json"
    own.write_text(json.dumps({"base": "megatron", "name": "mine", "cuts": []}))
    impls = ["nvfuser-graph", "nvfuser-graph@megatron-cut-linears", f"nvfuser@{own}"]
    assert split_impl(impls[1]) == ("nvfuser-graph", "megatron-cut-linears") and split_impl("eager") == ("eager", None)
    base = SCHEDULES["megatron"]
    check_impls(impls, Layout(), schedule=base)
    fns = forward_fns(preset("tiny"), torch.nn.Linear(1, 1), None, impls, Layout(), 0, None, base)
    made = {impl: fn.__defaults__[0].options["schedule"] for impl, fn in fns.items()}
    assert set(made) == set(impls)
    assert made["nvfuser-graph"] == base.replace(keys_on_device=True)
    assert made["nvfuser-graph@megatron-cut-linears"] == SCHEDULES["megatron-cut-linears"].replace(keys_on_device=True)
    assert made[f"nvfuser@{own}"].name == "mine" and made[f"nvfuser@{own}"].cuts == ()
    for bad, says in (("eager@megatron", "for an nvFuser implementation"),
                      ("nvfuser@no-such-schedule", "no-such-schedule"),
                      ("nvfuser@megatron-sp", "sequence-parallel"),
                      ("nvfuser@megatron-overlap", "CUDA_DEVICE_MAX_CONNECTIONS=1")):
        with pytest.raises(ValueError, match=says) as e:
            check_impls([bad], Layout(), schedule=base)
        assert bad in str(e.value) and "\n" not in str(e.value)
    overlap = SCHEDULES["megatron-overlap"]
    check_impls(["nvfuser@megatron-overlap"], Layout(1, 2), schedule=overlap.replace(name="mine"), cfg=preset("tiny"))
    check_impls(["nvfuser@megatron"], Layout(1, 2), schedule=overlap)   # the other way round: it runs with the var
    with pytest.raises(ValueError, match="'nvfuser@megatron-overlap'.*divisor"):   # the block on its schedule
        check_impls(["nvfuser@megatron-overlap"], Layout(1, 2), schedule=overlap, cfg=preset("tiny", batch=1, seq=3))
    one_head = preset("tiny", n_head=2)
    with pytest.raises(ValueError, match="'nvfuser@megatron-cut-linears'.*one head per rank"):
        check_impls(["nvfuser@megatron-cut-linears"], Layout(1, 2), schedule=base, cfg=one_head)


def test_startup_runs_an_nvfuser_impl_under_its_own_schedule(monkeypatch):
    """bench --startup --impl nvfuser,nvfuser@NAME: the child gets NAME's schedule, the row keeps the name."""
    import tpfuser.bench.startup as startup
    from tpfuser.config import Layout, preset
    from tpfuser.parallel.schedules import SCHEDULES
    specs = []
    monkeypatch.setattr(startup, "_run_child", lambda spec, timeout_s: specs.append(spec) or {"impl": spec["impl"], "pass": spec["pass"], "error": "not run"})
    rep = startup.run_startup("tiny", preset("tiny"), Layout(), SCHEDULES["megatron"],
                              ["nvfuser", "nvfuser@megatron-cut-linears", "compile"], progress=lambda *a, **k: None)
    assert [s["impl"] for s in specs] == ["nvfuser", "nvfuser", "compile"]
    assert [s["schedule"]["name"] for s in specs[:2]] == ["megatron", "megatron-cut-linears"]
    assert [r["impl"] for r in rep["rows"]] == ["nvfuser", "nvfuser@megatron-cut-linears", "compile"]
    assert [r.get("schedule") for r in rep["rows"]] == ["megatron", "megatron-cut-linears", None]
    with pytest.raises(ValueError, match="compile@megatron"):
        startup.run_startup("tiny", preset("tiny"), Layout(), SCHEDULES["megatron"], ["compile@megatron"])


def test_the_table_says_the_warm_up_and_keeps_long_names_aligned():
    """A row named impl@schedule is longer than the column was; the warm-up
    (building, then each implementation's warm-up calls) gets a line."""
    rep = _report()
    long = "nvfuser-graph@megatron-cut-linears"
    rep["results"][long] = dict(next(iter(rep["results"].values())))
    rep["warmup_s"] = {"built_s": 3.25, "each_s": {long: 9.5, "eager": 0.5}, "total_s": 13.25}
    table = format_table(rep).splitlines()
    rows = [line for line in table if line.split() and line.split()[0] in rep["results"]]
    assert len(rows) == len(rep["results"])
    assert len({line.index(f"{rep['results'][line.split()[0]]['median_ms']:.3f}") + len(
        f"{rep['results'][line.split()[0]]['median_ms']:.3f}") for line in rows}) == 1   # one right edge
    assert table[-1] == f"warm-up 13.2 s (building 3.2, then each: {long} 9.5, eager 0.5)"


def test_the_table_gives_each_ranks_communication_where_its_trace_has_some():
    """bench --profile on a mesh: a line of each rank's communication and its exposed part (made-up figures)."""
    rep = _report()
    name = "nvfuser"
    rep["results"][name]["profile"] = copy.deepcopy(PROFILE)
    before = format_table(rep)
    total = lambda ms, exposed: {"total": {"ms_per_call": ms, "exposed_ms_per_call": exposed}}   # noqa: E731
    rep["results"][name]["profile"]["comm_by_rank"] = [total(0.5, 0.25), total(0.625, 0.125)]
    added = [line for line in format_table(rep).splitlines() if line not in before.splitlines()]
    assert [line.strip() for line in added] == [
        "communication a call, rank by rank: 0.500 ms (0.250 exposed), 0.625 ms (0.125 exposed)"]
    rep["results"][name]["profile"]["comm_by_rank"] = [total(0.0, 0.0)]     # one GPU: nothing to say
    assert format_table(rep) == before
