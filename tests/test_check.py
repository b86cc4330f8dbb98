"""The checker's oracle, on the CPU (fp32: no flash attention): every rank's
slices of the one reference run reassemble into it, and the masks a rank is
checked against are its slices of the unsharded masks."""
import pytest
import torch

from tpfuser.verify.check import RankReport
from tpfuser.verify.oracle import Case, oracle_masks, rank_masks, rank_slices, reference
from tpfuser.config import Layout, preset
from tpfuser.block.forward import saved_names
from tpfuser.parallel.placements import placements
from tpfuser.block.tensors import PARAM_NAMES
from tpfuser.runtime.block import MASKED
from tpfuser.parallel.shard import gather

LAYOUTS = [Layout(1, 1), Layout(2, 2), Layout(1, 4, sp=True), Layout(2, 4, sp=True)]


@pytest.fixture(scope="module")
def tiny_reference():
    case = Case(preset("tiny", dtype="fp32"))
    return reference(case, torch.device("cpu"))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_rank_slices_reassemble_the_reference(tiny_reference, layout):
    case = Case(preset("tiny", dtype="fp32"), layout)
    ranks = [rank_slices(tiny_reference, case, r) for r in range(layout.world_size)]
    where = placements(layout)
    for name in ("x", "grad_out", "out", "grad_x", "grad.attn.c_attn.weight", "grad.mlp.c_proj.weight"):
        assert torch.equal(gather([r[name] for r in ranks], where[name], layout), tiny_reference[name]), name
    # the parameters a rank gets are its shards of the fusion's (heads interleaved) weights
    assert torch.equal(gather([r["param.attn.c_attn.weight"] for r in ranks], where["attn.c_attn.weight"], layout),
                       tiny_reference["param.attn.c_attn.weight"])


def _gpt2_block(x, w, n_head):
    """GPT-2's block written out with torch.nn.functional (no dropout), apart from
    the reference's modules: y = x + attn(ln_1(x)); out = y + mlp(ln_2(y))."""
    F = torch.nn.functional
    b, s, e = x.shape
    h = F.layer_norm(x, (e,), w["ln_1.weight"], w["ln_1.bias"])
    q, k, v = F.linear(h, w["attn.c_attn.weight"], w["attn.c_attn.bias"]).split(e, dim=2)
    q, k, v = (t.view(b, s, n_head, e // n_head).transpose(1, 2) for t in (q, k, v))   # (b, h, s, d)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, e)
    y = x + F.linear(att, w["attn.c_proj.weight"], w["attn.c_proj.bias"])
    m = F.gelu(F.linear(F.layer_norm(y, (e,), w["ln_2.weight"], w["ln_2.bias"]), w["mlp.c_fc.weight"],
                        w["mlp.c_fc.bias"]), approximate="tanh")
    return y + F.linear(m, w["mlp.c_proj.weight"], w["mlp.c_proj.bias"])


def test_the_reference_backward_is_the_block_autograd():
    """The reference's output and every gradient (fp32) against autograd of the
    block written out in float64, from the same weights, input and upstream gradient."""
    from tpfuser.parallel.shard import qkv_blocked
    cfg = preset("tiny", dtype="fp32", dropout=0.0)
    ref = reference(Case(cfg), torch.device("cpu"))
    blocked = {n: qkv_blocked(ref[f"param.{n}"], cfg.n_head) if n.startswith("attn.c_attn") else ref[f"param.{n}"]
               for n in PARAM_NAMES}   # back to nanoGPT's [q; k; v] rows
    w = {n: t.double().requires_grad_() for n, t in blocked.items()}
    x = ref["x"].double().requires_grad_()
    out = _gpt2_block(x, w, cfg.n_head)
    out.backward(ref["grad_out"].double())

    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    assert err(ref["out"], out.detach()) < 1e-6
    assert err(ref["grad_x"], x.grad) < 1e-5
    for n in PARAM_NAMES:
        got = ref[f"grad.{n}"]
        got = qkv_blocked(got, cfg.n_head) if n.startswith("attn.c_attn") else got
        assert err(got, w[n].grad) < 1e-5, n


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_rank_masks_are_slices_of_the_unsharded_masks(layout):
    case = Case(preset("tiny", dtype="fp32"), layout, rng_offset=3)
    full = oracle_masks(case, "cpu")
    where = placements(layout)
    for stream, name in MASKED.items():
        parts = [rank_masks(case, r, "cpu")[name] for r in range(layout.world_size)]
        assert torch.equal(gather(parts, where[name], layout), getattr(full, stream)), name


def test_bf16_ranks_are_checked_against_flash_attention_not_a_hash_mask():
    case = Case(preset("tiny", dtype="bf16"), Layout(1, 2))
    assert "attn_keep" not in rank_masks(case, 0, "cpu")
    assert case.has_wrong_stream_control and not Case(preset("tiny", dtype="bf16", dropout=0.0)).has_wrong_stream_control


def _report(**forward):
    base = {"rel_err": 1e-8, "branch_rel_err": 1e-3, "tolerance": 1e-5, "mask_mismatches": {"m": 0}}
    return RankReport("tiny", "bf16", 0.1, "1x2", False, 0, forward={**base, **forward})


def test_a_rank_fails_on_error_masks_or_a_vacuous_wrong_stream_control():
    assert _report().ok
    assert not _report(rel_err=2e-5).ok
    assert not _report(mask_mismatches={"m": 1}).ok
    assert _report(wrong_stream_branch_rel_err=2.5e-3).ok
    assert not _report(wrong_stream_branch_rel_err=1.5e-3).ok    # the wrong streams were not told apart
    r = _report()
    r.collectives = {"forward": {"matches": False}}
    assert not r.ok
    r = _report()
    r.graphs = {"forward equal": True, "forward next offset differs": False}   # a replay that froze its masks
    assert not r.ok
    r.graphs["forward next offset differs"] = True
    assert r.ok


def test_bounds_are_ordered_by_precision_and_each_carries_its_reason():
    """fp32's output bound below bf16's, bf16's output below its gradients'; each
    entry a positive bound with a reason beside it (STYLE: every tolerance says why)."""
    from tpfuser.verify.check import BOUNDS, bound
    assert {q for _, q in BOUNDS} == {"out", "grad", "wrong_stream", "eager_margin"}
    for (dtype, quantity), (value, why) in BOUNDS.items():
        assert bound(dtype, quantity) == value > 0 and isinstance(why, str) and why.strip(), (dtype, quantity)
    assert bound("fp32", "out") < bound("bf16", "out") < bound("bf16", "grad")


def test_a_bf16_bound_grows_to_the_margin_over_eagers_own_error():
    from tpfuser.verify.check import bound, tolerance
    assert tolerance("bf16", "out") == tolerance("bf16", "out", 1e-3) == bound("bf16", "out")
    assert tolerance("bf16", "out", 0.019) == pytest.approx(bound("bf16", "eager_margin") * 0.019)
    assert tolerance("bf16", "grad", 0.01) == bound("bf16", "grad")


def _math_attention(case, device, wrong_stream=False):
    """flash_attention's stand-in on the CPU (dropout 0): causal softmax attention."""
    def attention(q, k, v):
        y = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        return y.float()
    return attention


def test_bf16_reference_carries_eagers_own_errors_to_every_rank(monkeypatch):
    """In bf16 the reference also runs the block in eager bf16: its error on the
    output and on each gradient goes to every rank."""
    import tpfuser.verify.oracle as oracle_module
    monkeypatch.setattr(oracle_module, "flash_attention", _math_attention)
    case = Case(preset("tiny", dtype="bf16", dropout=0.0), Layout(1, 2))
    ref = reference(case, torch.device("cpu"))
    eager = {n.removeprefix("eager."): float(t) for n, t in ref.items() if n.startswith("eager.")}
    assert set(eager) == {"out", "grad.x"} | {f"grad.{n}" for n in PARAM_NAMES}
    assert all(1e-4 < e < 0.1 for e in eager.values()), eager   # bf16's rounding, not a mistake (tiny: 2.4e-3 out)
    assert len(set(eager.values())) > 5                         # each tensor its own
    for r in range(2):
        mine = rank_slices(ref, case, r)
        assert {n: float(mine[f"eager.{n}"]) for n in eager} == eager
        assert mine["param.ln_1.weight"].dtype == torch.bfloat16
    # the eager run leaves the reference's own figures alone: they equal a run without it
    monkeypatch.setattr(oracle_module, "eager_errors", lambda *args: {})
    plain = reference(case, torch.device("cpu"))
    assert all(torch.equal(plain[n], ref[n]) for n in plain), [n for n in plain if not torch.equal(plain[n], ref[n])]
    fp32 = reference(Case(preset("tiny", dtype="fp32", dropout=0.0)), torch.device("cpu"))
    assert "eager.out" not in fp32


def test_a_bf16_report_is_bounded_by_the_margin_over_eager(monkeypatch):
    import tpfuser.verify.check as check_module
    import tpfuser.verify.oracle as oracle_module
    monkeypatch.setattr(oracle_module, "flash_attention", _math_attention)
    monkeypatch.setitem(check_module.BOUNDS, ("bf16", "eager_margin"), (100.0, "large, so that it wins here"))
    case = Case(preset("tiny", dtype="bf16", dropout=0.0))
    real_expectations = check_module.expectations

    def expectations(*args, **kwargs):
        _ExactBlock.exp = real_expectations(*args, **kwargs)
        return _ExactBlock.exp
    _ExactBlock.masks, _ExactBlock.perturb = {}, None
    monkeypatch.setattr(check_module, "expectations", expectations)
    monkeypatch.setattr(check_module, "ShardedBlock", _ExactBlock)
    report = check_module.check(case, device=torch.device("cpu"))
    eager_out, eager = report.forward["eager_rel_err"], report.backward["eager_errors"]
    assert report.forward["tolerance"] == pytest.approx(100 * eager_out) and 100 * eager_out > 1e-2
    tolerances = report.backward["tolerances"]
    assert tolerances == {n: pytest.approx(max(2e-2, 100 * e)) for n, e in eager.items()}   # each tensor its own
    assert len(set(tolerances.values())) > 5 and report.ok


def test_each_gradient_is_held_to_its_own_bound_and_the_worst_is_the_nearest_to_it(monkeypatch):
    """A gradient whose eager error is small keeps the fixed bound though another's
    is large: c_fc's weight 3% off fails (eager's 1e-4: the bound stays 2e-2)
    while ln_1's weight 5% off passes under its own bound (eager's 5e-2: 7.5e-2),
    and the report names c_fc as over its bound, ln_1 as the largest error."""
    import tpfuser.verify.check as check_module
    import tpfuser.verify.oracle as oracle_module
    case = Case(preset("tiny", dtype="bf16", dropout=0.0))
    real_expectations = check_module.expectations

    def expectations(*args, **kwargs):
        exp = real_expectations(*args, **kwargs)
        exp |= {k: torch.tensor(1e-4) for k in exp if k.startswith("eager.")}
        exp["eager.grad.ln_1.weight"] = torch.tensor(0.05)   # 1.5x: a bound of 0.075
        _ExactBlock.exp = exp
        return exp
    monkeypatch.setattr(oracle_module, "flash_attention", _math_attention)
    monkeypatch.setattr(check_module, "expectations", expectations)
    monkeypatch.setattr(check_module, "ShardedBlock", _ExactBlock)
    _ExactBlock.masks, _ExactBlock.perturb = {}, {"mlp.c_fc.weight": 1.03, "ln_1.weight": 1.05}
    report = check_module.check(case, device=torch.device("cpu"))
    bwd = report.backward
    assert bwd["tolerances"]["ln_1.weight"] == pytest.approx(0.075) and bwd["tolerances"]["mlp.c_fc.weight"] == 2e-2
    assert bwd["errors"]["ln_1.weight"] == pytest.approx(0.05, rel=1e-5)
    assert bwd["errors"]["mlp.c_fc.weight"] == pytest.approx(0.03, rel=1e-5) and bwd["over_bound"] == ["mlp.c_fc.weight"]
    assert not report.ok and bwd["worst_tensor"] == "ln_1.weight" and bwd["tolerance"] == pytest.approx(0.075)
    from tpfuser.verify.meshes import format_checks
    table = format_checks({"environment": {"gpu": "cpu", "gpus_shared": 0}, "preset": "tiny", "mesh": "1x1", "sp": False,
                           "ok": False, "cases": [{"dtype": "bf16", "dropout": 0.0, "ranks": [report.as_dict()]}]})
    assert "FAIL (over their bounds: mlp.c_fc.weight)" in table
    _ExactBlock.perturb = {"ln_1.weight": 1.05}   # alone, within its own bound
    assert check_module.check(case, device=torch.device("cpu")).ok


class _ExactBlock:
    """A stand-in for ShardedBlock that returns the reference's own figures
    (perturbed where asked): check()'s comparison and report run on the CPU."""
    exp: dict = {}
    masks: dict = {}
    perturb: str | dict | None = None   # a gradient 1% off, or {gradient: factor}

    def __init__(self, cfg, *args, **kwargs):
        self.cfg = cfg

    def load_shards(self, shards):
        assert len(shards) == len(PARAM_NAMES)

    def saved_names(self, dropout=True):
        return saved_names(self.cfg)

    def __call__(self, x, seed, offset):
        return {"out": self.exp["out"], **self.masks}

    def forward_train(self, x, seed, offset):
        return {"out": self.exp["out"]}, [self.masks.get(n, torch.zeros(1)) for n in saved_names(self.cfg)]

    def backward(self, grad_out, x, saved):
        factors = self.perturb if isinstance(self.perturb, dict) else {self.perturb: 1.01}
        grads = [self.exp[f"grad.{n}"] * factors.get(n, 1.0) for n in PARAM_NAMES]
        return self.exp["grad_x"], grads


@pytest.mark.parametrize("perturb", [None, "mlp.c_fc.weight"])
def test_check_compares_every_output_and_times_every_phase(monkeypatch, perturb):
    import tpfuser.verify.check as check_module
    case = Case(preset("tiny", dtype="fp32"))
    real_expectations = check_module.expectations

    def expectations(*args, **kwargs):
        _ExactBlock.exp = real_expectations(*args, **kwargs)
        return _ExactBlock.exp
    _ExactBlock.masks = rank_masks(case, 0, torch.device("cpu"))
    _ExactBlock.perturb = perturb
    monkeypatch.setattr(check_module, "expectations", expectations)
    monkeypatch.setattr(check_module, "ShardedBlock", _ExactBlock)
    report = check_module.check(case, device=torch.device("cpu"))
    assert list(report.seconds) == ["reference", "forward", "training forward", "backward"]
    assert all(t >= 0 for t in report.seconds.values())
    assert report.forward["rel_err"] == 0 and not any(report.forward["mask_mismatches"].values())
    if perturb is None:
        assert report.ok and report.backward["worst"] == 0
    else:   # one gradient 1% off: named, and the rank fails
        assert not report.ok and report.backward["worst_tensor"] == perturb
        assert report.backward["worst"] == pytest.approx(0.01, rel=1e-6)


@pytest.mark.parametrize("split", [None, True])
def test_unit_splits_schedule_reaches_the_check(monkeypatch, tmp_path, split):
    """A schedule file with "split_unit_axes": true reaches check() through the
    real command (cli.cmd_check, meshes.run_checks) in its schedule (which hands
    it to both ShardedBlocks it builds; run on a GPU by tests/test_gpu.py);
    without it, False (the default; docs/history.md)."""
    import json

    import tpfuser.verify.check
    from tpfuser import cli
    from tpfuser.verify import meshes
    seen = {}

    def fake_check(case, rank, **options):
        seen.update(options)
        raise RuntimeError("no GPU here")

    flag = []
    if split:
        path = tmp_path / "unit_splits.json"
        path.write_text(json.dumps({"base": "megatron", "split_unit_axes": True}))
        flag = ["--schedule-file", str(path)]
    monkeypatch.setattr(tpfuser.verify.check, "check", fake_check)
    monkeypatch.setattr(cli, "_cuda_count", lambda: 1)      # past the refusal of a machine without a GPU
    monkeypatch.setattr(meshes, "init_rank", lambda layout: 0)   # which would pick the GPU
    out = tmp_path / "report.json"
    assert cli.main(["check", "--preset", "tiny", "--dtype", "fp32", "--json", str(out), *flag]) == 1
    report = json.loads(out.read_text())
    assert "no GPU here" in report["cases"][0]["ranks"][0]["error"]
    assert seen["schedule"].split_unit_axes is bool(split)
    assert report["split_unit_axes"] is bool(split)


def test_a_checked_rank_says_on_stderr_where_it_is(monkeypatch, capsys):
    """Each rank's case prints its phases as they end, and a failure at once,
    on stderr: a mesh run that hangs after one rank failed (the others waiting
    in a collective) shows which rank stopped where (tiny 2x4 SP bf16 ran out
    its time bound three times without a line)."""
    import argparse

    import tpfuser.verify.check
    from tpfuser.verify import meshes
    from tpfuser.config import Layout, preset
    from tpfuser.parallel.schedules import SCHEDULES

    def fake_check(case, rank, progress=None, **options):
        progress("forward done in 1.0 s")
        raise RuntimeError("NCCL error: the peer went away")

    monkeypatch.setattr(tpfuser.verify.check, "check", fake_check)
    args = argparse.Namespace(forward_only=False, collectives=False, preset="tiny", schedule=SCHEDULES["megatron-sp"])
    report = meshes._check_case(preset("tiny", dtype="bf16"), Layout(2, 4, True), 5, args, None)
    assert not report["ok"] and "the peer went away" in report["error"]
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == ["rank 5: bf16: started", "rank 5: bf16: forward done in 1.0 s"]
    assert lines[2].startswith("rank 5: bf16: failed: ") and "the peer went away" in lines[2]


def test_check_hands_split_unit_axes_to_both_its_blocks(monkeypatch):
    """check() builds its block, and graph_equality its called-and-graphed one,
    with the split_unit_axes of the schedule it was given."""
    import tpfuser.verify.check as check_mod
    from tpfuser.parallel.schedules import SCHEDULES
    seen = []

    class Stop(Exception):
        pass

    def fake_block(*args, **options):
        seen.append(options["schedule"].split_unit_axes)
        raise Stop

    class Anything(dict):
        def __missing__(self, key):
            return torch.zeros(1)

    monkeypatch.setattr(check_mod, "ShardedBlock", fake_block)
    monkeypatch.setattr(check_mod, "expectations", lambda *args: {})
    case = Case(preset("tiny", dtype="fp32", dropout=0.1))
    split = SCHEDULES["megatron"].replace(split_unit_axes=True)
    with pytest.raises(Stop):
        check_mod.check(case, device=torch.device("cpu"), schedule=split)
    with pytest.raises(Stop):
        check_mod.graph_equality(case, 0, Anything(), {}, False, None, split)
    with pytest.raises(Stop):
        check_mod.check(case, device=torch.device("cpu"))
    assert seen == [True, True, False]


def test_no_collectives_planned_over_a_team_of_one_without_unit_splits():
    """Without the unit-axis splits (the default), nvFuser posts nothing over
    tp == 1 (seen on the GPU at 2x1: 0/0), and the plan it is compared with says
    so; with the splits it plans tp's all-reduces; with tp > 1 the plan is unchanged."""
    from tpfuser.verify.check import compare_with_plan
    from tpfuser.parallel.schedules import SCHEDULES
    cfg = preset("tiny", dtype="fp32", dropout=0.1)
    nothing = {"forward": [], "training forward": [], "backward": []}
    for sp in (False, True):
        layout = Layout(2, 1, sp)
        assert all(r["matches"] for r in compare_with_plan(nothing, cfg, layout, 1).values())
        assert not any(r["matches"] for r in compare_with_plan(nothing, cfg, layout, 1, SCHEDULES["megatron-sp" if sp else "megatron"].replace(split_unit_axes=True)).values())
    assert not any(r["matches"] for r in compare_with_plan(nothing, cfg, Layout(1, 2), 0).values())


class _RepeatingBlock(_ExactBlock):
    """_ExactBlock whose every training forward returns fresh bits in `changes`:
    an unwritten placeholder (tensors.py: sdpa_offset) or a real output."""
    changes: str = ""
    calls = 0

    def forward_train(self, x, seed, offset):
        _RepeatingBlock.calls += 1
        named, saved = super().forward_train(x, seed, offset)
        names = self.saved_names()
        if self.changes == "out":
            named = {"out": named["out"] + 1e-3 * _RepeatingBlock.calls}
        elif self.changes in names:
            saved[names.index(self.changes)] = torch.full((), _RepeatingBlock.calls)
        return named, saved


@pytest.mark.parametrize("changes, repeats", [("sdpa_offset", True), ("out", False), ("ln_1.mean", False)])
def test_a_second_call_must_equal_the_first_except_where_nothing_was_written(monkeypatch, changes, repeats):
    import tpfuser.verify.check as check_module
    case = Case(preset("tiny", dtype="bf16", dropout=0.0))
    real_expectations = check_module.expectations

    def expectations(*args, **kwargs):
        _ExactBlock.exp = real_expectations(*args, **kwargs)
        return _ExactBlock.exp
    import tpfuser.verify.oracle as oracle_module
    monkeypatch.setattr(oracle_module, "flash_attention", _math_attention)
    monkeypatch.setattr(check_module, "expectations", expectations)
    monkeypatch.setattr(check_module, "ShardedBlock", _RepeatingBlock)
    _RepeatingBlock.masks, _RepeatingBlock.perturb, _RepeatingBlock.changes = {}, None, changes
    report = check_module.check(case, device=torch.device("cpu"))
    assert report.repeats["training forward"] is repeats
    assert report.repeats["forward"] and report.repeats["backward"]


@pytest.mark.parametrize("workspace", [None, ":16:8"])
def test_the_repeat_checks_backward_runs_torchs_deterministic_kernels_then_restores(monkeypatch, workspace):
    """Deterministic algorithms on and not warn-only inside (warn-only, ATen's
    flash attention backward keeps its atomics), cuBLAS's workspace setting
    one torch accepts; torch's flags and the environment as they were after."""
    import os

    from tpfuser.verify.check import CUBLAS_WORKSPACE_VAR, deterministic_attention
    if workspace is None:
        monkeypatch.delenv(CUBLAS_WORKSPACE_VAR, raising=False)
    else:
        monkeypatch.setenv(CUBLAS_WORKSPACE_VAR, workspace)
    torch.use_deterministic_algorithms(False)
    with deterministic_attention():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ[CUBLAS_WORKSPACE_VAR] in (":4096:8", ":16:8")
    assert not torch.are_deterministic_algorithms_enabled()
    assert os.environ.get(CUBLAS_WORKSPACE_VAR) == workspace
