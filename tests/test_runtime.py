"""Bad input is a clear error before any GPU work (these run on the CPU)."""
import pytest
import torch

from tpfuser.cli import NO_GPU, main
from tpfuser.config import Layout, preset
from tpfuser.block.inputs import rng_input_names
from tpfuser.block.forward import saved_names
from tpfuser.block.tensors import PARAM_NAMES
from tpfuser.verify.reference import make_block
from tpfuser.parallel.schedules import SCHEDULES
from tpfuser.runtime.block import ShardedBlock
from tpfuser.dist.world import check_world
from tests.hand_shards import megatron_shard


@pytest.fixture
def block():
    return ShardedBlock(preset("tiny", dtype="fp32"), Layout(2, 2), rank=3, device=torch.device("cuda", 0))


def test_world_size_must_match_mesh():
    with pytest.raises(ValueError, match=r"world size 3 != dp\*tp = 2\*2 = 4; launch exactly 4 ranks"):
        check_world(Layout(2, 2), 3)


def test_more_local_ranks_than_gpus():
    with pytest.raises(ValueError, match="8 ranks on this node but only 1 CUDA device"):
        check_world(Layout(1, 8), 8, local_gpus=1, local_ranks=8)


def test_rank_outside_mesh():
    with pytest.raises(ValueError, match=r"rank=4: must be in \[0, 4\) for mesh 2x2"):
        ShardedBlock(preset("tiny"), Layout(2, 2), rank=4)


def test_load_rejects_wrong_param_shape(block):
    state = dict(make_block(preset("tiny")).state_dict())
    state["mlp.c_fc.weight"] = state["mlp.c_fc.weight"][:, :10]
    with pytest.raises(ValueError, match=r"mlp.c_fc.weight: expected shape \(256, 64\), got \(256, 10\)"):
        block.load(state)


def test_load_rejects_missing_param(block):
    state = dict(make_block(preset("tiny")).state_dict())
    del state["ln_2.bias"]
    with pytest.raises(ValueError, match=r"state_dict lacks \['ln_2.bias'\]"):
        block.load(state)


def test_load_shards_checks_local_shape_dtype_device(block):
    shards = [torch.zeros(block.local_param_shape(n)) for n in block.forward_pass.inputs if n in PARAM_NAMES]
    assert len(shards) == len(PARAM_NAMES)
    with pytest.raises(ValueError, match=r"ln_1.weight: expected a CUDA tensor \(got device cpu\) for rank 3 of mesh 2x2"):
        block.load_shards(shards)
    with pytest.raises(ValueError, match=r"attn.c_attn.weight: expected shape \(96, 64\) \(got \(3, 3\)\)"):
        block._validate("attn.c_attn.weight", torch.zeros(3, 3), block.local_param_shape("attn.c_attn.weight"))
    with pytest.raises(ValueError, match=r"shards: expected a list of 12 tensors \(ln_1.weight, .*\), got 5"):
        block.load_shards(shards[:5])


def test_input_validation_names_the_tensor(block):
    block._params = []  # pretend loaded: input validation comes first
    with pytest.raises(ValueError, match=r"x: expected shape \(2, 16, 64\) \(got \(4, 16, 64\)\), dtype torch.float32 "
                                         r"\(got torch.bfloat16\), a CUDA tensor \(got device cpu\)"):
        block(torch.zeros(4, 16, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x: expected a torch.Tensor, got list"):
        block([1, 2])


def test_run_before_load(block):
    with pytest.raises(RuntimeError, match="no parameters: call load"):
        block(torch.zeros(2, 16, 64))


def test_shard_input_is_this_ranks_batch_slice():
    b = ShardedBlock(preset("tiny", dtype="fp32"), Layout(2, 2), rank=3, device=torch.device("cpu"))
    x = torch.arange(4.0).view(4, 1, 1).expand(4, 16, 64)
    assert torch.equal(b.shard_input(x)[:, 0, 0], torch.tensor([2.0, 3.0]))


def test_eval_mode_is_the_same_runner_with_fusions_without_dropout():
    """TPBlock's eval mode: the runner's own fusions built with dropout 0 (no keys,
    no masks saved), beside the training ones, each built once."""
    cfg = preset("tiny", dtype="fp32", dropout=0.1)
    b = ShardedBlock(cfg, Layout(2, 2), rank=3, device=torch.device("cpu"))
    assert b.mode_cfg(True) is cfg and b.mode_cfg(False) == cfg.replace(dropout=0.0)
    assert b.pass_of("forward", True) is b.forward_pass
    no_dropout = b.pass_of("forward", False)
    assert no_dropout is not b.forward_pass and b.pass_of("forward", False) is no_dropout   # built once
    assert rng_input_names(cfg) and not rng_input_names(b.mode_cfg(False))
    assert len(no_dropout.inputs) == len(b.forward_pass.inputs) - len(rng_input_names(cfg))   # over its fusions
    whole = ShardedBlock(cfg, Layout(2, 2), rank=3, device=torch.device("cpu"), schedule="megatron-whole")
    assert len(whole.pass_of("forward", False).pieces[0].fd.fusion.inputs()) == \
        len(whole.forward_pass.pieces[0].fd.fusion.inputs()) - len(rng_input_names(cfg))   # the one fusion's
    assert set(saved_names(cfg)) - set(saved_names(b.mode_cfg(False))) == {"attn_keep", "resid_attn_keep",
                                                                            "resid_mlp_keep"}
    plain = ShardedBlock(cfg.replace(dropout=0.0), device=torch.device("cpu"))
    assert plain.pass_of("forward", False) is plain.forward_pass   # nothing to switch off


@pytest.mark.parametrize("schedule", ["megatron-whole", "megatron"])
def test_module_modes_route_to_their_fusions(monkeypatch, schedule):
    """TPBlock eval -> train -> eval, each with a backward, then eval under no_grad:
    which pass each call runs (its fusions' execute faked: no GPU), how many
    inputs it gets (keys and masks only with dropout), each pass built once,
    one training step taken. Under the single-fusion schedule a pass is one
    call; under the default one each of its fusions is called in turn and the
    pass's inputs (what it reads from outside) are counted."""
    from tpfuser.runtime.module import TPBlock
    cfg = preset("tiny", dtype="fp32")
    model = TPBlock(cfg, device=torch.device("cpu"), schedule=schedule)
    monkeypatch.setattr(model.runner, "_validate", lambda *args: None)
    model.load_full_state_dict(make_block(cfg).state_dict())
    calls, runner, n = [], model.runner, len(PARAM_NAMES)
    params = dict(zip(PARAM_NAMES, model.shards))
    x = torch.zeros(1, requires_grad=True)

    def fake(piece, key):
        def execute(inputs, *options, **more):
            calls.append((*key, len(inputs)))
            # the backward's gradients shaped as what they are the gradients of (autograd checks)
            return [torch.zeros_like(x) if name == "grad_x" else
                    torch.zeros_like(params[name.removeprefix("grad.")]) if name.startswith("grad.") else
                    torch.zeros(1) for name in piece.outputs]
        return execute
    for kind in ("forward", "train", "backward"):
        for dropout in (True, False):
            for piece in runner.pass_of(kind, dropout).pieces:
                monkeypatch.setattr(piece, "execute", fake(piece, (kind, dropout)))
    for mode in ("eval", "train", "eval"):
        getattr(model, mode)()
        model(x).sum().backward()
    with torch.no_grad():
        model.eval()(x)
    keys, masks = len(rng_input_names(cfg)), 3
    biases = 4   # the backward no longer takes the linears' biases (their gradients are row sums: never read)
    expected = [("train", False, 1 + n), ("backward", False, 2 + n - biases + len(saved_names(runner.mode_cfg(False)))),
                ("train", True, 1 + n + keys), ("backward", True, 2 + n - biases + len(saved_names(cfg))),
                ("train", False, 1 + n), ("backward", False, 2 + n - biases + len(saved_names(runner.mode_cfg(False)))),
                ("forward", False, 1 + n)]
    assert [len(runner.pass_of(kind, dropout).inputs) for kind, dropout, _ in expected] == [m for *_, m in expected]
    pieces = [(kind, dropout) for kind, dropout, _ in expected for _ in runner.pass_of(kind, dropout).pieces]
    assert [(kind, dropout) for kind, dropout, _ in calls] == pieces
    if schedule == "megatron-whole":   # one fusion a pass: its inputs are the pass's
        assert calls == expected
    assert len(saved_names(cfg)) - len(saved_names(runner.mode_cfg(False))) == masks
    assert len(runner._passes) == 6 and model.step == 1


@pytest.mark.parametrize("layout, rank", [(Layout(1, 2), 1), (Layout(2, 4), 6)], ids=["1x2 rank 1", "2x4 rank 6"])
def test_rank_shards_are_megatrons_slices(layout, rank):
    """rank_shards against Megatron-LM's column and row splits cut by hand (a dp
    rank holds its tp column's shards: rank 6 of 2x4 is tp rank 2), in the block's dtype."""
    from tpfuser.runtime.weights import rank_shards
    cfg = preset("tiny", dtype="bf16")
    state = make_block(cfg).state_dict()
    shards = rank_shards(state, cfg, layout, rank)
    tp_rank = rank % layout.tp
    for name, got in zip(PARAM_NAMES, shards, strict=True):
        want = megatron_shard(state, name, cfg, layout.tp, tp_rank).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    with pytest.raises(ValueError, match=r"state_dict lacks \['ln_1.weight'\]"):
        rank_shards({k: v for k, v in state.items() if k != "ln_1.weight"}, cfg, layout, rank)


def test_check_without_gpu_says_so_in_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["check", "--preset", "tiny"]) == 2
    assert capsys.readouterr().err == f"error: {NO_GPU}\n"


def test_show_prints_the_fusion(capsys):
    """show prints a summary of the pass's fusions (verify.inspect.pass_summary); --ir nvFuser's text."""
    assert main(["show", "--preset", "tiny", "--dp", "2", "--tp", "2", "--ir"]) == 0
    out = capsys.readouterr().out
    assert "linear(" in out and "DeviceMesh{{0 1}{2 3}}" in out
    assert main(["show", "--preset", "tiny", "--dp", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("forward pass, bf16, batch 4: 11 fusion(s)") and aten_calls(out) == {"linear": 4, "flash attention": 1}
    assert "linear(" not in out and "%kernel_math" not in out


def test_main_job_without_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["main", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    lines = out.rstrip().splitlines()
    assert lines[0].startswith("tiny: one GPT-2 block, batch 4, seq 16, n_embd 64, 8 heads of 8")
    assert "allreduce over tp after attn.c_proj" in out and "matmul FLOPs per rank" in out   # the plan
    assert aten_calls(out) == {"linear": 4, "flash attention": 1}                          # the fusions, in brief
    assert "%kernel_math" not in out and len(lines) < 60                                   # not their IR
    assert lines[-1].startswith(NO_GPU) and "`tpfuser show --preset tiny --ir`" in lines[-1]


def aten_calls(summary: str) -> dict[str, int]:
    """What pass_summary says ATen runs, summed over its fusions' lines "run by ATen: 2 linear, ..."."""
    import re
    total = {}
    for line in re.findall(r"run by ATen: ([^;]*);", summary):
        for part in line.split(", "):
            count, what = part.split(" ", 1)
            total[what] = total.get(what, 0) + int(count)
    return total


def test_fusion_summary_counts_what_aten_runs():
    """fp32 writes attention out: two matmuls instead of flash attention (pass_summary;
    it counts no reductions and gaps).
    The single fusion's line, and the default schedule's fusions summed."""
    from tpfuser.parallel.passes import build_forward
    from tpfuser.verify.inspect import pass_summary
    cfg = preset("tiny", dtype="fp32")
    whole = pass_summary(build_forward(cfg, Layout(1, 1), schedule="megatron-whole"), SCHEDULES["megatron-whole"])
    assert "run by ATen: 4 linear, 2 matmul;" in whole and "flash" not in whole
    assert "1 fusion(s) under schedule megatron-whole" in whole
    text = pass_summary(build_forward(cfg, Layout(1, 1)), SCHEDULES["megatron"])
    assert aten_calls(text) == {"linear": 4, "matmul": 2} and "flash" not in text


def test_fusion_summary_says_where_fuse_matmul_may_take_a_linear():
    """A fusion whose schedule turns fuse_matmul on (speed-fm-c_fc: c_fc
    with its GELU) is said to be ATen's or nvFuser's own matmul kernel's; the rest ATen's alone."""
    from tpfuser.parallel.passes import build_forward
    from tpfuser.parallel.schedules import load_schedule
    from tpfuser.verify.inspect import pass_summary
    schedule = load_schedule("tools/schedules/speed-fm-c_fc.json")
    text = pass_summary(build_forward(preset("tiny", dtype="bf16"), Layout(), schedule=schedule), schedule)
    marked = [line for line in text.splitlines() if "nvFuser's own matmul kernel" in line]
    assert len(marked) == 1 and "(from 'mlp.c_fc')" in marked[0] and "mlp_act" in marked[0]


def test_check_table_one_line_a_rank_and_case():
    """The table `check` (and the main job on a GPU) prints from every rank's results."""
    from tpfuser.verify.check import RankReport
    from tpfuser.verify.meshes import format_checks
    good = RankReport("tiny", "bf16", 0.1, "1x2", False, 0,
                      forward={"rel_err": 2e-3, "branch_rel_err": 4e-2, "tolerance": 1e-2,
                               "mask_mismatches": {"resid_attn_keep": 0}, "wrong_stream_branch_rel_err": 0.16},
                      backward={"worst": 5e-3, "tolerance": 2e-2, "mask_mismatches": {"resid_attn_keep": 0}},
                      collectives={"forward": {"posted": [1, 2], "planned": [1, 2], "matches": True}})
    report = {"environment": {"gpu": "H200", "gpus_shared": 1}, "preset": "tiny", "mesh": "1x2", "sp": False,
              "cases": [{"dtype": "bf16", "dropout": 0.1,
                         "ranks": [good.as_dict(), {"rank": 1, "ok": False, "error": "nvFuser said no"}]}],
              "ok": False}
    lines = format_checks(report).splitlines()
    graphed = RankReport(**{**{k: v for k, v in good.as_dict().items() if k != "ok"},
                            "graphs": {"forward equal": True, "train step equal": False}})
    report["cases"][0]["ranks"][1] = graphed.as_dict()
    assert format_checks(report).splitlines()[3].endswith("2/2 graphs NOT: train step equal  FAIL")
    assert "timings here are not speed figures" in lines[0]
    assert lines[2].split() == ["bf16", "0.10", "0", "2.0e-03", "1.0e-02", "4.0e-02", "1.6e-01", "5.0e-03", "2.0e-02",
                                "equal", "2/2", "ok"]
    assert lines[3].split()[:4] == ["bf16", "0.10", "1", "FAILED:"] and "nvFuser said no" in lines[3]
    assert lines[-1] == "SOME RANK FAILED"


def test_bench_refuses_what_this_machine_cannot_run(capsys):
    """Each refusal names the thing, what it needs and what came, before any GPU work."""
    cases = [
        (["--impl", "dtensor"], "implementation 'dtensor': needs tp > 1"),
        (["--impl", "dtensor-async"], "implementation 'dtensor-async': needs tp > 1"),
        (["--tp", "2", "--preset", "tiny", "--impl", "dtensor-async"],
         "implementation 'dtensor-async': needs sequence parallelism (--sp)"),
        (["--impl", "flash"], "implementation 'flash': must be one of"),
        (["--dp", "2", "--impl", "nvfuser-nomesh", "--preset", "tiny"], "'nvfuser-nomesh': one GPU only, the mesh is 2x1"),
        (["--tp", "3", "--preset", "tiny"], "n_head=8: must be divisible by tp=3"),
    ]
    if torch.cuda.device_count() < 2:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        cases.append((["--tp", "2", "--preset", "tiny"], f"a 1x2 mesh needs 2 GPUs, one per rank; this machine has {n}"))
    for argv, message in cases:
        assert main(["bench", *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    if not torch.cuda.is_available():
        assert main(["bench", "--impl", "eager"]) == 2
        assert "benchmarking needs a CUDA GPU" in capsys.readouterr().err


def test_bench_default_implementations_follow_the_mesh():
    from tpfuser.bench.run import default_impls
    graphs = ("nvfuser", "nvfuser-graph", "eager", "eager-graph", "compile", "compile-reduce-overhead")
    assert default_impls(Layout(1, 1)) == ("nvfuser", "nvfuser-graph", "nvfuser-nomesh", "eager", "eager-graph",
                                           "compile", "compile-reduce-overhead")
    assert default_impls(Layout(2, 1)) == graphs
    assert default_impls(Layout(1, 8)) == graphs + ("dtensor",)


def test_comm_floor_by_hand():
    """gpt3 at tp 8: two all-reduces of 48 MiB forward, each rank sending 2 * 7/8 of it;
    a training step adds the backward's two; at 450 GB/s of bus bandwidth."""
    from tpfuser.bench.run import comm_floor_ms
    wire = 2 * 7 / 8 * 2048 * 12288 * 2
    assert comm_floor_ms(preset("gpt3"), Layout(1, 8), 450e9, train=False) == pytest.approx(2 * wire / 450e9 * 1e3)
    assert comm_floor_ms(preset("gpt3"), Layout(1, 8), 450e9, train=True) == pytest.approx(4 * wire / 450e9 * 1e3)
    assert comm_floor_ms(preset("gpt3"), Layout(1, 8, sp=True), 450e9, train=False) == pytest.approx(2 * wire / 450e9 * 1e3)
    # with dp 2, the dp gradient sum is not in the floor, and each tp team moves half the batch
    assert comm_floor_ms(preset("nanogpt"), Layout(2, 1), 450e9, train=True) == 0


def test_kernel_summary_by_hand():
    """Two calls: 3 kernels each, 0.15 ms of GPU time a call of a 0.4 ms call, the rest idle."""
    from tpfuser.bench.run import kernel_summary
    kernels = [("gemm", 100.0), ("ln", 20.0), ("gelu", 30.0)] * 2
    s = kernel_summary(kernels, calls=2, median_ms=0.4, top=2)
    assert s["kernels_per_call"] == 3 and s["kernel_ms_per_call"] == pytest.approx(0.15)
    assert s["idle_ms_per_call"] == pytest.approx(0.25)
    assert s["top_kernels_ms_per_call"] == [["gemm", pytest.approx(0.1)], ["gelu", pytest.approx(0.03)]]
    assert [(n, c) for n, _, c in s["kernels"]] == [("gemm", 1), ("gelu", 1), ("ln", 1)]   # all, with launches
    assert kernel_summary(kernels, calls=2, median_ms=0.1)["idle_ms_per_call"] == 0.0   # never negative


def test_readme_transcript_is_what_main_prints(capsys):
    """The fresh-clone transcript of `make` (docs/main-transcript.md, linked
    from the README) shows what the main job prints today."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the main job checks instead")
    doc = open("docs/main-transcript.md").read()
    start = doc.index("    .venv/bin/tpfuser main\n") + len("    .venv/bin/tpfuser main\n")
    shown = [line[4:] for line in doc[start:].rstrip().splitlines()]
    assert main(["main"]) == 0
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert shown == printed


def test_enable_reaches_every_fusion_call_and_nothing_is_passed_by_default(monkeypatch):
    """A schedule's enable_options (was ShardedBlock(enable=...); bench's
    nvfuser-graph-fm: fuse_matmul) turns the options on for every fusion of the
    forward, the training forward and the backward alike."""
    cfg = preset("tiny", dtype="fp32")
    for enable, want in (((), {}), (("fuse_matmul",), {"_enable_options": ["fuse_matmul"]})):
        block = ShardedBlock(cfg, device=torch.device("cpu"), schedule=SCHEDULES["megatron"].replace(enable_options=enable))
        block._validate = lambda *args: None
        block.load(make_block(cfg).state_dict())
        seen, fusions = [], 0
        for kind in ("forward", "train", "backward"):
            for piece in block.pass_of(kind, True).pieces:
                outs = [torch.zeros(1)] * len(piece.outputs)

                def execute(inputs, _disable_options=None, outs=outs, **options):
                    seen.append(options)
                    return outs
                monkeypatch.setattr(piece, "execute", execute)   # (undone after: the passes are shared)
                fusions += 1
        x = torch.zeros(cfg.batch, cfg.seq, cfg.n_embd)
        block(x)
        _, saved = block.forward_train(x)
        block.backward(x, x, saved)
        assert fusions > 3 and seen == [want] * fusions


def test_enable_as_a_bare_string_is_refused():
    """enable_options is a schedule field now: a bare string is refused where the schedule is made."""
    with pytest.raises(ValueError, match=r"'enable_options': expected a list of strings, got 'fuse_matmul'"):
        SCHEDULES["megatron"].replace(enable_options="fuse_matmul")
    with pytest.raises(ValueError, match=r"'enable_options': expected a list of strings, got 'fuse_matmul'"):
        ShardedBlock(preset("tiny"), device=torch.device("cpu"), schedule={"enable_options": "fuse_matmul"})


def test_kernel_summary_says_where_the_gpu_waits():
    """With start times, the idle time before each activity is added up by its
    name (two calls: a copy, 4 us before the GEMM, 5 before the LayerNorm, the
    second call's copy 66 us after the first's end; a second stream's kernel
    inside the GEMM adds no gap)."""
    from tpfuser.bench.run import kernel_summary
    from tpfuser.bench.report import format_table
    kernels = []
    for call in range(2):
        t = call * 200.0
        kernels += [("copy", 5.0, t + 11.0), ("gemm", 100.0, t + 20.0), ("side", 10.0, t + 50.0), ("ln", 20.0, t + 125.0)]
    s = kernel_summary(kernels, calls=2, median_ms=0.2)
    before = dict(s["idle_before_ms_per_call"])
    assert before["copy"] == pytest.approx((211 - 145) / 2 / 1e3)   # the second call's copy after the first's ln
    assert before["gemm"] == pytest.approx(4 / 1e3) and before["ln"] == pytest.approx(5 / 1e3)
    assert "side" not in before or before["side"] == 0.0
    assert kernel_summary([(n, us) for n, us, _ in kernels], calls=2, median_ms=0.2).get("idle_before_ms_per_call") is None
    rep = {"preset": "tiny", "pass": "forward", "gpu": "g", "mesh": "1x1", "compute_floor_ms": 0.1,
           "matmul_tflops_measured": 1.0, "results": {"x": {"median_ms": 0.2, "min_ms": 0.2, "max_ms": 0.2,
                                                            "tflops": 1.0, "fraction_of_matmul_rate": 0.5,
                                                            "profile": s}}}
    assert "idle most before: copy 0.033, ln 0.005, gemm 0.004" in format_table(rep)
