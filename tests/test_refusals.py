"""Every refusal of the command line, as a user meets it: run in a subprocess,
exit status 2, one line on stderr naming the thing, nothing on stdout (no work
done first), no traceback, no nvFuser abort. The cases of issue 16 among them."""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

NO_CUDA = not torch.cuda.is_available()
TIMEOUT = ["TPFUSER_TIMEOUT_S"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "TPFUSER_SINGLE_PROCESS", "TPFUSER_TIMEOUT_S")
TORCHRUN_2 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
              "MASTER_ADDR": "localhost", "MASTER_PORT": "29511"}
DIR = "{tmp}"   # a directory that exists


# (id, argv, extra environment, words the one line must hold, runs only without CUDA)
CASES = [
    ("show_heads_tp", ["show", "--preset", "nanogpt", "--tp", "2"], {}, ["n_head=25: must be divisible by tp=2"], False),
    ("plan_heads_tp", ["plan", "--preset", "nanogpt", "--tp", "2"], {}, ["n_head=25: must be divisible by tp=2"], False),
    ("main_heads_tp", ["main", "--preset", "nanogpt", "--tp", "2"], {}, ["n_head=25: must be divisible by tp=2"], False),
    ("check_heads_tp", ["check", "--preset", "nanogpt", "--tp", "2"], {}, ["n_head=25: must be divisible by tp=2"], False),
    ("bench_heads_tp", ["bench", "--tp", "2"], {}, ["n_head=25: must be divisible by tp=2"], False),
    ("show_sp_heads", ["show", "--sp", "--tp", "3"], {}, ["n_head=8: must be divisible by tp=3"], False),
    ("plan_batch_dp", ["plan", "--preset", "gpt3", "--dp", "2"], {}, ["batch=1: must be divisible by dp=2"], False),
    ("show_dp_zero", ["show", "--dp", "0"], {}, ["dp=0: must be a positive int"], False),
    ("bench_dp_zero", ["bench", "--dp", "0"], {}, ["dp=0: must be a positive int"], False),
    ("bench_tp_negative", ["bench", "--tp", "-1"], {}, ["tp=-1: must be a positive int"], False),
    ("bench_iters_zero", ["bench", "--iters", "0"], {}, ["--iters=0: expected a positive int"], False),
    ("bench_iters_negative", ["bench", "--iters", "-3"], {}, ["--iters=-3: expected a positive int"], False),
    ("show_dropout", ["show", "--dropout", "1.5"], {}, ["dropout=1.5: must be in [0, 1)"], False),
    ("bench_dropout", ["bench", "--dropout", "-0.1"], {}, ["dropout=-0.1: must be in [0, 1)"], False),
    ("plan_json_empty", ["plan", "--json", ""], {}, ["--json='': an empty path; give a file name"], False),
    ("plan_json_proc", ["plan", "--json", "/proc/x.json"], {}, ["--json='/proc/x.json': no file can be written in '/proc'"],
     False),
    ("plan_json_directory", ["plan", "--json", DIR], {}, ["is a directory; give a file name"], False),
    ("plan_json_no_such_dir", ["plan", "--json", "/no/such/dir/plan.json"], {},
     ["--json='/no/such/dir/plan.json': its folder '/no/such/dir' does not exist"], False),
    ("bench_json_proc", ["bench", "--preset", "tiny", "--json", "/proc/x.json"], {},
     ["--json='/proc/x.json': no file can be written in '/proc'"], False),
    ("bench_json_empty", ["bench", "--preset", "tiny", "--json", ""], {}, ["--json='': an empty path"], False),
    ("bench_png_directory", ["bench", "--preset", "tiny", "--png", DIR], {}, ["--png=", "is a directory"], False),
    ("bench_png_proc", ["bench", "--preset", "tiny", "--png", "/proc/x.png"], {}, ["--png='/proc/x.png': no file can be written in '/proc'"],
     False),
    ("show_dtype", ["show", "--dtype", "fp16"], {}, ["tpfuser show: argument --dtype: invalid choice: 'fp16'"], False),
    ("show_tp_not_int", ["show", "--tp", "x"], {}, ["argument --tp: invalid int value: 'x'"], False),
    ("plan_preset", ["plan", "--preset", "gpt4"], {}, ["argument --preset: invalid choice: 'gpt4'"], False),
    ("bench_preset", ["bench", "--preset", "gpt4"], {}, ["preset='gpt4': must be one of ['gpt3', 'nanogpt', 'tiny']"], False),
    ("bench_unknown_option", ["bench", "--frob"], {}, ["tpfuser bench: unrecognized arguments: --frob"], False),
    ("no_command", [], {}, ["the following arguments are required: command"], False),
    ("unknown_command", ["frob"], {}, ["argument command: invalid choice: 'frob'"], False),
    ("bench_impl", ["bench", "--impl", "flash"], {}, ["implementation 'flash': must be one of"], False),
    ("bench_dtensor_tp1", ["bench", "--impl", "dtensor"], {}, ["implementation 'dtensor': needs tp > 1"], False),
    ("timeout_abc", ["bench", "--preset", "tiny", "--tp", "2"], {"TPFUSER_TIMEOUT_S": "abc"},
     ["TPFUSER_TIMEOUT_S='abc': must be a positive number of seconds"], False),
    ("timeout_zero", ["bench", "--preset", "tiny", "--tp", "2"], {"TPFUSER_TIMEOUT_S": "0"},
     ["TPFUSER_TIMEOUT_S='0': must be a positive number of seconds"], False),
    ("timeout_negative", ["bench", "--preset", "tiny", "--tp", "2"], {"TPFUSER_TIMEOUT_S": "-5"},
     ["TPFUSER_TIMEOUT_S='-5': must be a positive number of seconds"], False),
    ("rank_beyond_world", ["show"], {"RANK": "2", "WORLD_SIZE": "2"},
     ["RANK=2 with WORLD_SIZE=2: a rank must be below its world size"], False),
    ("rank_not_int", ["plan"], {"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x': must be an int"], False),
    ("world_not_mesh", ["bench", "--preset", "tiny", "--tp", "2"], {"RANK": "0", "WORLD_SIZE": "3"},
     ["WORLD_SIZE=3 != dp*tp = 1*2 = 2; launch exactly 2 ranks"], False),
    ("check_world_not_mesh", ["check", "--dp", "2"], {"RANK": "1", "WORLD_SIZE": "4"},
     ["WORLD_SIZE=4 != dp*tp = 2*1 = 2"], False),
    ("bench_needs_gpus", ["bench", "--preset", "tiny", "--tp", "2"], {},
     ["a 1x2 mesh needs 2 GPUs, one per rank; this machine has 0"], True),
    ("check_no_gpu", ["check"], {}, ["no CUDA device here: running the fusions needs a CUDA GPU"], True),
    ("bench_no_gpu", ["bench", "--preset", "tiny", "--impl", "eager"], {}, ["benchmarking needs a CUDA GPU"], True),
    ("torchrun_show_no_cuda", ["show"], TORCHRUN_2,
     ["under a launcher (WORLD_SIZE=2) on a machine without a CUDA device"], True),
    ("torchrun_bench_no_cuda", ["bench", "--preset", "tiny", "--tp", "2"], TORCHRUN_2,
     ["under a launcher (WORLD_SIZE=2) on a machine without a CUDA device"], True),
]


def _run(argv, env, tmp):
    environ = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS} | env
    argv = [a.replace(DIR, str(tmp)) for a in argv]
    return subprocess.run([sys.executable, "-m", "tpfuser.cli", *argv], env=environ, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case at once (each is a Python start-up and an import of torch)."""
    tmp = tmp_path_factory.mktemp("refusals")
    cases = [c for c in CASES if not c[4] or NO_CUDA]
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        done = pool.map(lambda c: _run(c[1], c[2], tmp), cases)
        return dict(zip((c[0] for c in cases), done))


def test_at_least_25_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("argv, env, words, cpu_only", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refusal_is_one_clear_line(runs, request, argv, env, words, cpu_only):
    if cpu_only and not NO_CUDA:
        pytest.skip("a refusal of a machine without CUDA")
    r = runs[request.node.callspec.id]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr + r.stdout and "Exception occurred" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]
    assert r.stdout == "", "work was done before the refusal"


@pytest.mark.skipif(not NO_CUDA, reason="the benchmark would run")
def test_refused_run_leaves_no_file(tmp_path):
    """Paths are tried before the work; a file made by trying is removed when the run is then refused."""
    out = tmp_path / "report.json"
    r = _run(["bench", "--preset", "tiny", "--impl", "eager", "--json", str(out)], {}, tmp_path)
    assert r.returncode == 2 and "benchmarking needs a CUDA GPU" in r.stderr
    assert not out.exists()


def test_plan_json_is_written(tmp_path):
    out = tmp_path / "plan.json"
    r = _run(["plan", "--json", str(out)], {}, tmp_path)
    assert r.returncode == 0 and out.read_text().startswith("{")
