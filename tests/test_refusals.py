"""Every refusal of the command line, as a user meets it: exit status 2, one
line on stderr naming the thing, nothing on stdout (no work done first), no
traceback, and the files it was given left as they were. Each case runs
in-process through `tpfuser.cli.main(argv)`; a few also end to end in a fresh
`python -m tpfuser.cli`, where an exit-time abort (nvFuser's, under a launcher
without CUDA) or a blocked open would show."""
import os
import stat
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tpfuser import BlockConfig, Layout, ShardedBlock, TPBlock, load_schedule, preset, rank_shards
from tpfuser.cli import main

NO_CUDA = not torch.cuda.is_available()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "TPFUSER_SINGLE_PROCESS", "TPFUSER_TIMEOUT_S")
TORCHRUN_2 = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
              "MASTER_ADDR": "localhost", "MASTER_PORT": "29511"}
DIR = "{tmp}"   # a directory that exists
with open(os.path.join(ROOT, "tests", "data", "calibration_standin.json")) as f:
    STANDIN = f.read()   # made up, not measured (tests/data/README.md)
# Files each case's folder holds, by placeholder: what each holds (None: a named pipe; "->x": a link to x).
FILES = {"{fifo}": None, "{file}": "", "{dangling}": "->gone/plan.json", "{notjson}": "median 1.0 ms\n",
         "{truncated}": '{"base": "megatron", "linears": {', "{list}": "[1, 2]",
         "{chunks_true}": '{"base": "megatron-overlap", "linears": {"mlp.c_proj": {"chunks": true}}}',
         "{chunks_ok}": '{"base": "megatron-overlap", "name": "mine"}',
         "{plain}": '{"base": "megatron-cut-linears", "name": "plain"}',
         "{style_int}": '{"base": "megatron", "linears": {"mlp.c_proj": {"style": 3}}}',
         "{calibration}": STANDIN}


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
    ("check_one_head_per_rank", ["check", "--preset", "tiny", "--tp", "8"], {},
     ["n_head=8 over tp=8 is one head per rank"], False),
    ("main_one_head_per_rank", ["main", "--preset", "tiny", "--tp", "8"], {}, ["n_head=8 over tp=8 is one head per rank"],
     False),
    ("bench_impl_twice", ["bench", "--impl", "eager,compile,eager"], {}, ["implementation 'eager': named twice"], False),
    ("plan_bandwidth_and_comm_table", ["plan", "--preset", "gpt3", "--tp", "8", "--bandwidth", "100", "--comm-table",
                                       "{notjson}", "--calibration", "{calibration}"], {},
     ["--bandwidth=100 and --comm-table: give one"], False),
    ("bench_startup_png", ["bench", "--startup", "--png", "{tmp}/s.png"], {},
     ["--png: not taken with --startup (one first call per fresh process"], False),
    ("bench_startup_iters", ["bench", "--startup", "--iters", "100"], {}, ["--iters: not taken with --startup"], False),
    ("bench_iters_negative", ["bench", "--iters", "-3"], {}, ["--iters=-3: expected a positive int"], False),
    ("show_dropout", ["show", "--dropout", "1.5"], {}, ["dropout=1.5: must be in [0, 1)"], False),
    ("bench_dropout", ["bench", "--dropout", "-0.1"], {}, ["dropout=-0.1: must be in [0, 1)"], False),
    ("plan_json_empty", ["plan", "--json", ""], {}, ["--json='': an empty path; give a file name"], False),
    ("plan_json_proc", ["plan", "--json", "/proc/x.json"], {}, ["--json='/proc/x.json': no file can be written in '/proc'"],
     False),
    ("plan_json_directory", ["plan", "--json", DIR], {}, ["is a directory; give a file name"], False),
    ("plan_json_dev_stdout", ["plan", "--json", "/dev/stdout"], {},
     ["--json='/dev/stdout': a device or stream, not a file to write whole; use - for standard output"], False),
    ("plan_json_is_the_schedule_file", ["plan", "--schedule-file", "{chunks_ok}", "--json", "{chunks_ok}"], {},
     ["--json=", "chunks_ok': the same file as --schedule-file=", "give another file name"], False),
    ("plan_png_is_the_json", ["plan", "--preset", "gpt3", "--tp", "8", "--predict", "--json", "{tmp}/p.out",
                              "--png", "{tmp}/p.out", "--calibration", "{calibration}"], {},
     ["--png=", "p.out': the same file as --json="], False),
    ("plan_json_is_the_calibration", ["plan", "--preset", "gpt3", "--tp", "8", "--predict", "--json",
                                      "{calibration}", "--calibration", "{calibration}"], {},
     ["--json=", "calibration': the same file as --calibration="], False),
    ("bench_json_is_the_impl_schedule", ["bench", "--preset", "tiny", "--impl", "nvfuser@{plain}", "--json",
                                         "{plain}"], {}, ["plain': the same file as --impl="], False),
    ("plan_predict_chunks_not_calibrated", ["plan", "--preset", "gpt3", "--tp", "8", "--predict", "--schedule",
                                            "megatron-overlap", "--chunks", "16", "--calibration", "{calibration}"], {},
     ["--chunks=16: calibration ", "was timed at chunks 1, 2, 4, 8, the schedule asks 16"], False),
    ("plan_schedule_empty", ["plan", "--schedule", ""], {},
     ["--schedule='': an empty value; give one, or leave the option out for its default"], False),
    ("plan_schedule_file_empty", ["plan", "--schedule-file", ""], {}, ["--schedule-file='': an empty value"], False),
    ("plan_calibration_empty", ["plan", "--preset", "gpt3", "--tp", "8", "--calibration", ""], {},
     ["--calibration='': an empty value"], False),
    ("bench_impl_empty", ["bench", "--impl", ""], {}, ["tpfuser bench: --impl='': an empty value"], False),
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
    ("bench_preset", ["bench", "--preset", "gpt4"], {}, ["argument --preset: invalid choice: 'gpt4'"], False),
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
    ("bench_startup_no_gpu", ["bench", "--startup", "--preset", "tiny"], {}, ["benchmarking needs a CUDA GPU",
                                                                             "--startup's fresh processes"], True),
    ("torchrun_show_no_cuda", ["show"], TORCHRUN_2,
     ["under a launcher (WORLD_SIZE=2) on a machine without a CUDA device"], True),
    ("torchrun_bench_no_cuda", ["bench", "--preset", "tiny", "--tp", "2"], TORCHRUN_2,
     ["under a launcher (WORLD_SIZE=2) on a machine without a CUDA device"], True),
    ("plan_json_fifo", ["plan", "--json", "{fifo}"], {}, ["--json=", "not a regular file (a pipe, socket or device)"], False),
    ("bench_json_fifo", ["bench", "--preset", "tiny", "--json", "{fifo}"], {}, ["not a regular file"], False),
    ("check_json_fifo", ["check", "--json", "{fifo}"], {}, ["not a regular file"], False),
    ("plan_json_dangling", ["plan", "--json", "{dangling}"], {}, ["a symbolic link to 'gone/plan.json', which does not exist"],
     False),
    ("bench_json_dangling", ["bench", "--preset", "tiny", "--json", "{dangling}"], {}, ["which does not exist"], False),
    ("plan_json_parent_is_a_file", ["plan", "--json", "{file}/plan.json"], {}, ["does not exist", "is a file, not a folder"],
     False),
    ("plan_json_trailing_slash", ["plan", "--json", "{tmp}/plan/"], {}, ["a folder's name; give a file name"], False),
    ("plan_json_name_too_long", ["plan", "--json", "{tmp}/" + "p" * 300], {}, ["its name is 300 bytes long"], False),
    ("plan_png_dash", ["plan", "--predict", "--calibration", "{calibration}", "--png", "-"], {}, ["--png='-': an image is not written to standard output"],
     False),
    ("bench_png_dash", ["bench", "--preset", "tiny", "--png", "-"], {}, ["--png='-': an image is not written"], False),
    ("plan_chunks_zero", ["plan", "--schedule", "megatron-overlap", "--chunks", "0"], {},
     ["chunks", "expected a positive int", "got 0"], False),
    ("plan_chunks_no_chunked_linear", ["plan", "--chunks", "4"], {}, ["--chunks=4: schedule 'megatron-cut-linears' chunks no linear"],
     False),
    ("plan_chunks_not_dividing", ["plan", "--schedule", "megatron-overlap", "--chunks", "3"], {},
     ["--chunks=3: expected a divisor of the rank's tokens (b/dp x s) = 64"], False),
    ("bench_chunks_not_dividing", ["bench", "--preset", "tiny", "--schedule", "megatron-overlap", "--chunks", "3"], {},
     ["--chunks=3: expected a divisor of the rank's tokens (b/dp x s) = 64"], False),
    ("plan_sp_schedule_file", ["plan", "--sp", "--schedule-file", "{chunks_ok}"], {},
     ["--sp with --schedule-file=", "which is not sequence-parallel"], False),
    ("plan_schedule_file_directory", ["plan", "--schedule-file", "{tmp}"], {}, ["--schedule-file=", "not a file"], False),
    ("plan_schedule_file_fifo", ["plan", "--schedule-file", "{fifo}"], {}, ["--schedule-file=", "not a file"], False),
    ("plan_schedule_file_not_json", ["plan", "--schedule-file", "{notjson}"], {}, ["not readable as JSON"], False),
    ("plan_schedule_file_truncated", ["plan", "--schedule-file", "{truncated}"], {}, ["not readable as JSON"], False),
    ("plan_schedule_file_a_list", ["plan", "--schedule-file", "{list}"], {}, ["expected a JSON object of fields"], False),
    ("plan_schedule_chunks_true", ["plan", "--schedule-file", "{chunks_true}"], {},
     ["'linears.mlp.c_proj.chunks': expected a positive int", "got True"], False),
    ("show_schedule_style_int", ["show", "--schedule-file", "{style_int}"], {},
     ["'linears.mlp.c_proj.style': expected 'row' or 'row-sp'", "got 3"], False),
    ("plan_n_head_zero", ["plan", "--n-head", "0"], {}, ["n_head=0: must be a positive int"], False),
    ("plan_dp_negative", ["plan", "--dp", "-1"], {}, ["dp=-1: must be a positive int"], False),
    ("check_n_head_not_dividing", ["check", "--n-head", "3", "--dtype", "fp32"], {}, ["n_embd=64: must be divisible by n_head=3"],
     False),
    ("plan_overlap_zero", ["plan", "--overlap", "0"], {}, ["--overlap=0: must be a positive number of chunks"], False),
    ("plan_bandwidth_nan", ["plan", "--overlap", "2", "--bandwidth", "nan"], {}, ["--bandwidth=nan: must be a positive"],
     False),
    ("plan_calibration_fifo", ["plan", "--predict", "--calibration", "{fifo}"], {}, ["calibration", "not a file"], False),
]


# Also run end to end, each in a fresh process: the refusal of a launch without
# CUDA (nvFuser imported there would abort the process at exit), argparse's own
# exit, a named pipe (a blocking open would hang).
END_TO_END = ["torchrun_show_no_cuda", "no_command", "plan_json_fifo"]


def _fill(arg: str, tmp) -> str:
    for placeholder in FILES:
        arg = arg.replace(placeholder, os.path.join(str(tmp), placeholder.strip("{}")))
    return arg.replace(DIR, str(tmp))


def _make_files(tmp):
    for placeholder, text in FILES.items():
        path = os.path.join(str(tmp), placeholder.strip("{}"))
        if text is None:
            os.mkfifo(path)
        elif text.startswith("->"):
            os.symlink(text[2:], path)
        else:
            with open(path, "w") as f:
                f.write(text)


def _state(tmp):
    """Each entry of the folder: its kind, and a link's target or a file's text (what a refusal must keep)."""
    out = {}
    for name in os.listdir(tmp):
        p = os.path.join(str(tmp), name)
        st = os.lstat(p)
        out[name] = (stat.S_IFMT(st.st_mode), os.readlink(p) if os.path.islink(p) else
                     open(p).read() if stat.S_ISREG(st.st_mode) else None)
    return out


def _assert_one_line_refusal(returncode, out, err, words):
    assert returncode == 2, (returncode, err[-2000:])
    assert "Traceback" not in err + out and "Exception occurred" not in err, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    for w in words:
        assert w in lines[0], lines[0]
    assert out == "", "work was done before the refusal"


def _unblocker(tmp, seconds=30.0):
    """A timer that opens the folder's pipe after `seconds`: a command blocked opening it
    (for writing or reading) then goes on, and the test fails instead of hanging.
    (A refusal takes well under a second of CPU, far less than `seconds` even on a loaded machine.)"""
    fired = []

    def open_pipe():
        fired.append(os.open(os.path.join(str(tmp), "fifo"), os.O_RDWR | os.O_NONBLOCK))
    timer = threading.Timer(seconds, open_pipe)
    timer.fired = fired
    return timer


@pytest.mark.parametrize("argv, env, words, cpu_only", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refusal_is_one_clear_line(tmp_path, monkeypatch, capfd, argv, env, words, cpu_only):
    if cpu_only and not NO_CUDA:
        pytest.skip("a refusal of a machine without CUDA")
    _make_files(tmp_path)
    before = _state(tmp_path)
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    timer = _unblocker(tmp_path)
    if any("{fifo}" in a for a in argv):
        timer.start()
    try:
        code = main([_fill(a, tmp_path) for a in argv])
    except SystemExit as e:   # argparse's refusals exit
        code = e.code
    finally:
        timer.cancel()
    for fd in timer.fired:
        os.close(fd)
    assert not timer.fired, "the command blocked opening the named pipe"
    out, err = capfd.readouterr()
    _assert_one_line_refusal(code, out, err, words)
    assert _state(tmp_path) == before, "a refused command made, replaced or removed something in the folder"


def _run(argv, env, tmp, timeout_s=120):
    """`python -m tpfuser.cli argv` in a fresh process; returncode None if it ran past timeout_s (blocked)."""
    environ = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS} | env
    environ["PYTHONPATH"] = os.pathsep.join([ROOT, environ.get("PYTHONPATH", "")])
    argv = [_fill(a, tmp) for a in argv]
    try:
        return subprocess.run([sys.executable, "-m", "tpfuser.cli", *argv], env=environ, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        text = [t.decode(errors="replace") if isinstance(t, bytes) else t or "" for t in (e.stdout, e.stderr)]
        return subprocess.CompletedProcess(e.cmd, None, *text)


@pytest.fixture(scope="module")
def end_to_end(tmp_path_factory):
    """The END_TO_END cases at once (each a Python start-up and an import of torch), in one folder."""
    tmp = tmp_path_factory.mktemp("refusals")
    _make_files(tmp)
    before = _state(tmp)
    cases = [c for c in CASES if c[0] in END_TO_END and (not c[4] or NO_CUDA)]
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip((c[0] for c in cases), pool.map(lambda c: _run(c[1], c[2], tmp), cases)))
    return done, before, _state(tmp)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in END_TO_END], ids=lambda c: c[0])
def test_refusal_end_to_end(end_to_end, case):
    name, _, _, words, cpu_only = case
    if cpu_only and not NO_CUDA:
        pytest.skip("a refusal of a machine without CUDA")
    r = end_to_end[0][name]
    _assert_one_line_refusal(r.returncode, r.stdout, r.stderr, words)


def test_refusals_end_to_end_leave_the_folder_as_it_was(end_to_end):
    _, before, after = end_to_end
    assert after == before


@pytest.mark.skipif(not NO_CUDA, reason="the benchmark would run")
def test_refused_run_leaves_no_file(tmp_path, capfd):
    """Paths are tried before the work; a file made by trying is removed when the run is then refused."""
    out = tmp_path / "report.json"
    assert main(["bench", "--preset", "tiny", "--impl", "eager", "--json", str(out)]) == 2
    assert "benchmarking needs a CUDA GPU" in capfd.readouterr().err
    assert not out.exists()


def test_plan_json_is_written(tmp_path):
    """The end-to-end control: the same command line, not refused, exits 0 and writes its file."""
    out = tmp_path / "plan.json"
    r = _run(["plan", "--json", str(out)], {}, tmp_path)
    assert r.returncode == 0 and out.read_text().startswith("{")


TINY = preset("tiny", dtype="fp32")
CPU = torch.device("cpu")
# (id, what raises, the words its one line must hold)
API_CASES = [
    ("layout_tp_str", lambda: Layout(tp="2"), "tp='2': must be a positive int, got a str"),
    ("layout_dp_bool", lambda: Layout(dp=True), "dp=True: must be a positive int, got a bool"),
    ("layout_sp_int", lambda: Layout(sp=1), "sp=1: must be a bool (True or False), got an int"),
    ("config_batch_str", lambda: BlockConfig(batch="4", seq=16, n_embd=64, n_head=8),
     "batch='4': must be a positive int, got a str"),
    ("config_n_head_bool", lambda: BlockConfig(4, 16, 64, True), "n_head=True: must be a positive int, got a bool"),
    ("config_dropout_str", lambda: BlockConfig(4, 16, 64, 8, dropout="0.1"),
     "dropout='0.1': must be a number in [0, 1), got a str"),
    ("config_dropout_bool", lambda: BlockConfig(4, 16, 64, 8, dropout=False),
     "dropout=False: must be a number in [0, 1), got a bool"),
    ("config_dtype_torch", lambda: BlockConfig(4, 16, 64, 8, dtype=torch.float32),
     "dtype=torch.float32: must be one of ['bf16', 'fp32'] (its name, not a torch.dtype)"),
    ("preset_override_str", lambda: preset("tiny", seq="16"), "seq='16': must be a positive int, got a str"),
    ("preset_unknown_field", lambda: preset("tiny", heads=4),
     "preset('tiny'): BlockConfig has no field 'heads'; expected some of batch, seq, n_embd, n_head, dropout, dtype"),
    ("preset_not_str", lambda: preset(["tiny"]), "preset=['tiny']: must be one of ['gpt3', 'nanogpt', 'tiny'], got a list"),
    ("rank_coords_str", lambda: Layout(2, 2).rank_coords("1"),
     "rank='1': must be an int in [0, 4) for mesh 2x2, got a str"),
    ("block_rank_str", lambda: ShardedBlock(TINY, Layout(1, 2), rank="1"), "rank='1': expected an int in [0, 2)"),
    ("block_rank_bool", lambda: ShardedBlock(TINY, Layout(1, 2), rank=True), "rank=True: expected an int in [0, 2)"),
    ("block_rank_beyond", lambda: ShardedBlock(TINY, Layout(1, 2), rank=2), "rank=2: must be in [0, 2) for mesh 1x2"),
    ("block_cfg_a_name", lambda: ShardedBlock("tiny"), "cfg='tiny': expected a BlockConfig"),
    ("schedule_an_int", lambda: load_schedule(42), "schedule=42: expected a name ("),
    ("schedule_chunks_true", lambda: load_schedule({"base": "megatron-overlap", "linears": {"mlp.c_proj": {"chunks": True}}}),
     "schedule field 'linears.mlp.c_proj.chunks': expected a positive int"),
    ("schedule_options_no_fusion_takes", lambda: load_schedule(
        {"base": "megatron", "fusion_options": {"attn.c_attn.out": {"disable_options": ["infer_contiguity"]}}}),
     "schedule field 'fusion_options.attn.c_attn.out': expected a point a fusion of this schedule begins at"),
    ("block_check_a_string", lambda: ShardedBlock(TINY, check="yes", device=CPU),
     "check='yes': expected True or False, got a str"),
    ("module_graphs_a_string", lambda: TPBlock(TINY, graphs="no", device=CPU),
     "graphs='no': expected True or False, got a str"),
    ("shard_input_a_local_batch", lambda: ShardedBlock(TINY, Layout(2, 1), device=CPU).shard_input(
        torch.zeros(3, 16, 64)), "x: cannot split dimension 0 of its shape (3, 16, 64) over dp=2"),
    ("load_shards_none", lambda: ShardedBlock(TINY, device=CPU).load_shards(None),
     "shards: expected a list of 12 tensors (ln_1.weight, "),
    ("shard_input_a_list", lambda: ShardedBlock(TINY, device=CPU).shard_input([[0.0]]),
     "x: expected a torch.Tensor (the global one), got list"),
    ("rank_shards_heads_tp", lambda: rank_shards({}, TINY, Layout(1, 3), 0), "n_head=8: must be divisible by tp=3"),
    ("schedule_base_a_list", lambda: load_schedule({"base": ["megatron"]}),
     "schedule field 'base': expected a named schedule (megatron, "),
    ("schedule_cuts_null", lambda: load_schedule({"cuts": None}),
     "schedule field 'cuts': expected a list of strings, got None"),
    ("schedule_hints_an_int", lambda: load_schedule({"segment_hints": 5}),
     "schedule field 'segment_hints': expected a list of strings, got 5"),
    ("schedule_named_as_another", lambda: load_schedule({"base": "megatron-overlap", "name": "megatron"}),
     "schedule field 'name': expected a name of its own (it is not that named schedule), got 'megatron'"),
]


@pytest.mark.parametrize("make, words", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_python_api_refusal_is_one_line_naming_the_field(make, words):
    """The Python API's refusals: a stray string or bool where an int (or a
    bool) is expected is a ValueError naming the field, what was expected and
    what came, before any work; never a TypeError from deep inside."""
    with pytest.raises(ValueError) as err:
        make()
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)
