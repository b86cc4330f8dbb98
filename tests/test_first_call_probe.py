"""tools/probes/first_call_probe.py's trace split: per execute on the calling
thread, its segmenting and compile wall time (the caller's), and the kernels
compiled and NVRTC's time on any thread inside its window."""
import glob
import os
import sys

from tpfuser.config import Layout, preset
from tpfuser.parallel.schedules import load_schedule

sys.path.insert(0, "tools/probes")
import first_call_probe  # noqa: E402

EVENT = '{{ "name": "{}", "ph": "{}", "pid": 1, "tid": {}, "ts": {} }},'
RUN, SEG, COMPILE = first_call_probe.CALLING, "SegmentCandidateFinder::SegmentCandidateFinder", \
    "FusionKernelRuntime::compileFusionParallel"
KERNEL, NVRTC = "KernelExecutor::compile", "executor_utils::NVRTC"


def test_each_execute_gets_its_own_segmenting_compile_and_kernels():
    events = [(RUN, "B", 7, 0), (SEG, "B", 7, 100), (SEG, "E", 7, 1_000_100),
              (COMPILE, "B", 7, 1_000_200),
              (COMPILE, "B", 9, 1_000_300), (KERNEL, "B", 9, 1_000_400), (NVRTC, "B", 9, 1_000_500),
              (NVRTC, "E", 9, 1_500_500), (KERNEL, "E", 9, 1_600_000), (COMPILE, "E", 9, 1_600_100),
              (COMPILE, "B", 11, 1_000_300), (KERNEL, "B", 11, 1_000_400), (NVRTC, "B", 11, 1_000_500),
              (NVRTC, "E", 11, 1_250_500), (KERNEL, "E", 11, 1_300_000), (COMPILE, "E", 11, 1_300_100),
              (COMPILE, "E", 7, 1_700_200), (RUN, "E", 7, 2_000_000),
              (RUN, "B", 7, 3_000_000), (COMPILE, "B", 7, 3_000_100), (KERNEL, "B", 7, 3_000_200),
              (NVRTC, "B", 7, 3_000_300), (NVRTC, "E", 7, 3_100_300), (KERNEL, "E", 7, 3_200_000),
              (COMPILE, "E", 7, 3_200_100), (RUN, "E", 7, 3_500_000)]
    text = "{\n\"traceEvents\": [\n" + "\n".join(EVENT.format(*e) for e in events)
    first, second = first_call_probe.split(text)
    assert abs(first["wall_s"] - 2.0) < 1e-9 and abs(first["segmenting_s"] - 1.0) < 1e-9
    assert abs(first["compile_wall_s"] - 0.7) < 1e-9   # the caller's, not the workers' 0.6 + 0.3 on top
    assert first["kernels"] == 2 and abs(first["nvrtc_sum_s"] - 0.75) < 1e-9 and abs(first["nvrtc_max_s"] - 0.5) < 1e-9
    assert second["kernels"] == 1 and second["segmenting_s"] == 0 and abs(second["wall_s"] - 0.5) < 1e-9
    # the caller's wall time by the scope it was spent in (the workers' scopes are not the caller's)
    assert abs(first["self_s"][SEG] - 1.0) < 1e-9 and abs(first["self_s"][COMPILE] - 0.7) < 1e-9
    assert set(first["self_s"]) == {SEG, COMPILE} and abs(first["untraced_s"] - 0.3) < 1e-9
    assert abs(second["self_s"][COMPILE] - 0.0002) < 1e-9 and abs(second["self_s"][NVRTC] - 0.1) < 1e-9
    assert abs(second["self_s"][KERNEL] - 0.0998) < 1e-9 and abs(second["untraced_s"] - 0.3) < 1e-9


def test_time_is_put_in_the_innermost_scope_as_nvfuser_nests_them():
    """nvFuser 0.2.36 nests segmenting and the heuristics' meta inference two
    and three scopes under the execute (results/2026-12-06c/run51's trace):
    each gets its own time, its parents what is left to them."""
    get, ctor, heur, meta = ("FusionExecutorCache::getKernelRuntimeFor", "FusionKernelRuntime::FusionKernelRuntime",
                             "FusionKernelRuntime::getMaybeHeuristicsFor", "inferOutputMetaTensor")
    events = [(RUN, "B", 7, 0), (get, "B", 7, 100_000), (ctor, "B", 7, 200_000), (SEG, "B", 7, 300_000),
              (SEG, "E", 7, 800_000), (ctor, "E", 7, 900_000), (heur, "B", 7, 1_000_000), (meta, "B", 7, 1_100_000),
              (meta, "E", 7, 3_100_000), (heur, "E", 7, 3_200_000), (get, "E", 7, 3_300_000),
              (COMPILE, "B", 7, 3_400_000), (COMPILE, "E", 7, 3_600_000), (RUN, "E", 7, 4_000_000)]
    text = "{\n\"traceEvents\": [\n" + "\n".join(EVENT.format(*e) for e in events)
    (row,) = first_call_probe.split(text)
    want = {meta: 2.0, SEG: 0.5, get: 0.3, ctor: 0.2, heur: 0.2, COMPILE: 0.2}
    assert list(row["self_s"]) == list(want) and all(abs(row["self_s"][k] - v) < 1e-9 for k, v in want.items())
    assert abs(row["untraced_s"] - 0.6) < 1e-9 and abs(sum(row["self_s"].values()) + row["untraced_s"] - 4.0) < 1e-9


def test_the_backward_on_autograds_thread_is_counted():
    events = [(RUN, "B", 7, 0), (SEG, "B", 7, 100), (SEG, "E", 7, 500_100), (RUN, "E", 7, 1_000_000),
              (RUN, "B", 12, 2_000_000), (SEG, "B", 12, 2_000_100), (SEG, "E", 12, 2_300_100),
              (COMPILE, "B", 12, 2_300_200), (KERNEL, "B", 13, 2_300_300), (KERNEL, "E", 13, 2_400_000),
              (COMPILE, "E", 12, 2_500_000), (RUN, "E", 12, 3_000_000)]
    text = "{\n\"traceEvents\": [\n" + "\n".join(EVENT.format(*e) for e in events)
    forward, backward = first_call_probe.split(text)
    assert abs(forward["segmenting_s"] - 0.5) < 1e-9 and forward["kernels"] == 0
    assert abs(backward["segmenting_s"] - 0.3) < 1e-9 and backward["kernels"] == 1
    assert abs(backward["compile_wall_s"] - 0.1998) < 1e-9


def test_a_scope_nested_in_one_of_its_name_is_counted_once():
    """An execute inside an execute (and segmenting inside segmenting) on one
    thread: one row, its time the outer scope's, not the sum of both."""
    events = [(RUN, "B", 7, 0), (SEG, "B", 7, 100), (SEG, "B", 7, 200_000), (SEG, "E", 7, 500_000),
              (SEG, "E", 7, 1_000_100), (RUN, "B", 7, 1_100_000), (RUN, "E", 7, 1_500_000), (RUN, "E", 7, 2_000_000)]
    text = "{\n\"traceEvents\": [\n" + "\n".join(EVENT.format(*e) for e in events)
    (row,) = first_call_probe.split(text)
    assert abs(row["wall_s"] - 2.0) < 1e-9 and abs(row["segmenting_s"] - 1.0) < 1e-9


def test_every_probe_schedule_file_loads_and_fits_its_block():
    """tools/schedules/*.json, named by the GPU suite's steps: a file that
    does not load would cost a device call to find out."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "tools", "schedules", "*.json")))
    assert len(files) >= 12
    names = set()
    for path in files:
        schedule = load_schedule(path)
        names.add(schedule.name)
        if not schedule.name.startswith("onehead-"):   # those are for one head per rank, refused on purpose
            sp = schedule.sequence_parallel   # an SP schedule runs on a tp > 1 mesh (the suite's tiny 1x2 SP)
            schedule.check(preset("tiny" if sp else "nanogpt"), Layout(tp=2, sp=True) if sp else Layout())
    assert len(names) == len(files)   # each file its own name: the reports name the schedule, not its file
