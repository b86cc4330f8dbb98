"""The bench's newer peers: torch.compile's max-autotune and Thunder
(bench/thunder_peer.py), on the CPU. Their registration, their refusals and
skips without CUDA or without Thunder, a failed training step kept as that
implementation's entry, and the legacy `nvfuser` alias against what Thunder's
own source imports (read where lightning-thunder is installed:
`pip install -e '.[peers]'`; skipped otherwise)."""
import ast
import importlib.util
import pathlib

import pytest
import torch

import tpfuser.bench.thunder_peer as thunder_peer
from tpfuser.bench.impls import IMPLS, check_impls, default_impls, unavailable
from tpfuser.bench.report import add_ratios, format_table
from tpfuser.config import Layout, preset
from tpfuser.verify.reference import make_block, make_input, sdpa_forward

NEW = ("compile-max-autotune", "thunder", "thunder-graph")
INSTALL = "pip install -e '.[peers]'"
THUNDER = importlib.util.find_spec("thunder")


def test_the_new_peers_are_registered_asked_for_by_name_and_count_as_peers():
    assert set(NEW) <= set(IMPLS)
    for layout in (Layout(), Layout(1, 2), Layout(2, 1)):
        assert not set(NEW) & set(default_impls(layout))   # --impl only: max-autotune's first call takes minutes
        check_impls(NEW, layout)
        check_impls(NEW, layout, train=True)
    rows = {"eager": {"median_ms": 2.0}, "nvfuser-graph": {"median_ms": 1.0}, "thunder-graph": {"median_ms": 1.5},
            "compile-max-autotune": {"median_ms": 1.6}}
    assert add_ratios(rows) == "thunder-graph" and rows["nvfuser-graph"]["ratio_to_best_peer"] == pytest.approx(2 / 3)


def test_max_autotune_is_torch_compiles_mode_with_each_call_a_new_graph_step(monkeypatch):
    """Built as reduce-overhead is, in its own mode (recorded: nothing compiles here)."""
    from tpfuser.bench.impls import forward_fns
    from tpfuser.parallel.schedules import SCHEDULES
    made, marks = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: made.append((fn, mode)) or (lambda *a: mode))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    fns = forward_fns(preset("tiny"), None, None, ["compile-max-autotune", "compile-reduce-overhead"], Layout(), 0,
                      None, SCHEDULES["megatron"])
    assert made == [(sdpa_forward, "reduce-overhead"), (sdpa_forward, "max-autotune")]
    assert fns["compile-max-autotune"]() == "max-autotune" and len(marks) == 1


def test_without_thunder_its_peers_are_skipped_in_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "thunder" else real(name, *a))
    why = unavailable("thunder")
    assert why == f"lightning-thunder is not installed ({INSTALL})" and unavailable("thunder-graph") == why
    assert unavailable("eager") is None and unavailable("compile-max-autotune") is None
    import tpfuser.bench.run as run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # (refused before any GPU work)
    with pytest.raises(RuntimeError, match=r"nothing to time: thunder: lightning-thunder is not installed \(pip "
                                           r"install -e '\.\[peers\]'\); thunder-graph: "):
        run.bench("tiny", ["thunder", "thunder-graph"], iters=1)
    rep = {"preset": "tiny", "pass": "forward", "gpu": "made up", "mesh": "1x1", "compute_floor_ms": 1.0,
           "matmul_tflops_measured": 1.0, "results": {"eager": {"median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0,
                                                               "tflops": 1.0, "fraction_of_matmul_rate": 0.5}},
           "skipped": {"thunder": why}}
    assert format_table(rep).splitlines()[-1].split() == ["thunder", "skipped:", *why.split()]


def test_thunders_peers_refuse_without_a_gpu_at_their_first_call(monkeypatch):
    monkeypatch.setattr(thunder_peer, "thunder_missing", lambda: None)   # as if installed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    call = thunder_peer.thunder_forward(None, 0.1, True, None)   # built at its first call, not here
    with pytest.raises(RuntimeError) as e:
        call()
    assert "need a CUDA GPU" in str(e.value) and "\n" not in str(e.value)


def test_a_failed_training_step_is_that_implementations_entry(monkeypatch):
    """Thunder's CUDA-graph transform failing a training step (as its assertion
    reads) fails thunder-graph alone: the other peers' steps are still timed."""
    import tpfuser.bench.impls as impls
    from tpfuser.parallel.schedules import SCHEDULES

    def jit(block, p, graphs):
        def forward(x):
            if graphs:
                raise AssertionError("called on augmented forward twice without backward in between")
            return sdpa_forward(block, x, p)
        return forward
    monkeypatch.setattr(thunder_peer, "thunder_block", jit)
    monkeypatch.setattr(impls, "_warm_then_memory", lambda step: [step() for _ in range(2)] and {})  # (no CUDA)
    cfg = preset("tiny", dropout=0.0)
    ref, x = make_block(cfg), make_input(cfg)
    said = []
    fns, memory, failed = impls.train_fns(cfg, ref, x, ["thunder", "thunder-graph"], Layout(), 0, None,
                                          SCHEDULES["megatron"], announce=said.append)
    assert said == ["warming up thunder", "warming up thunder-graph"]   # a warm-up that never ends names itself
    assert failed == {"thunder-graph": "AssertionError: called on augmented forward twice without backward in between"}
    assert list(fns) == ["thunder"] and memory["thunder"]["saved_activation_mib"] > 0
    fns["thunder"]()
    assert all(p.grad is None for p in ref.parameters())   # each step's gradients made, then dropped


def _thunder_source() -> pathlib.Path:
    if THUNDER is None:
        pytest.skip(f"lightning-thunder is not installed ({INSTALL})")
    return pathlib.Path(THUNDER.submodule_search_locations[0])


def legacy_nvfuser_imports(root: pathlib.Path) -> tuple[set[str], list[str]]:
    """What Thunder's source (not its tests or benchmarks) takes from the legacy
    `nvfuser` module where nvfuser_direct 0.2.34 or later is importable: names
    of `from nvfuser import ...`, and the places of a bare `import nvfuser`
    (whose attributes no list can cover). Left out: the branches Thunder takes
    only without nvfuser_direct (`else:` of its DIRECT_BINDINGS_SUPPORTED_VERSION
    test, `except ImportError:` after importing nvfuser_direct)."""
    names, bare = set(), []
    for path in sorted(root.rglob("*.py")):
        if {"tests", "benchmarks"} & set(path.relative_to(root).parts):
            continue
        skip = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "DIRECT_BINDINGS_SUPPORTED_VERSION" in ast.unparse(node.test):
                skip |= {id(n) for branch in node.orelse for n in ast.walk(branch)}
            if isinstance(node, ast.Try) and "nvfuser_direct" in ast.unparse(node.body[0]):
                skip |= {id(n) for h in node.handlers for n in ast.walk(h)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module == "nvfuser":
                names |= {alias.name for alias in node.names}
            if isinstance(node, ast.Import) and any(a.name == "nvfuser" and a.asname is None for a in node.names):
                bare.append(f"{path.relative_to(root)}:{node.lineno}")
    return names, bare


def test_the_alias_holds_what_thunders_source_imports_from_the_legacy_module():
    needed, bare = legacy_nvfuser_imports(_thunder_source())
    assert needed and bare == []
    modules = {}
    assert thunder_peer.alias_legacy_nvfuser(modules)
    assert all(callable(getattr(modules["nvfuser"], name, None)) for name in needed), needed


def test_the_alias_is_put_only_where_there_is_no_nvfuser_module():
    held = {"nvfuser": object()}
    assert not thunder_peer.alias_legacy_nvfuser(held) and set(held) == {"nvfuser"}


def test_the_aliased_function_gives_what_thunder_documents():
    """thunder/executors/nvfuserex_impl.py's compute_contiguity (its docstring's
    two examples) is `tuple(tuple(x) for x in compute_tensor_descriptor(shape, stride))`."""
    modules = {}
    thunder_peer.alias_legacy_nvfuser(modules)
    td = modules["nvfuser"].compute_tensor_descriptor
    assert tuple(tuple(x) for x in td((1, 2, 3), (6, 3, 1))) == ((None, True, True), (2, 1, 0))
    assert tuple(tuple(x) for x in td((2, 3, 4), (12, 1, 3))) == ((True, True, True), (2, 0, 1))


def test_thunder_traces_the_peers_block_on_the_cpu():
    """The module Thunder's peers jit (BlockForward), with Thunder's CPU
    executors (nvFuser's needs CUDA): the reference's forward and gradients,
    its parameters the block's own (the bench drops their gradients after each step)."""
    _thunder_source()
    import thunder
    cfg = preset("tiny", dropout=0.0)
    ref, x = make_block(cfg), make_input(cfg)
    jitted = thunder.jit(thunder_peer.BlockForward(ref, 0.0))
    assert {id(p) for p in jitted.parameters()} == {id(p) for p in ref.parameters()}
    xg, grad = x.clone().requires_grad_(True), torch.randn_like(x)
    jitted(xg).backward(grad)
    got = {name: p.grad.clone() for name, p in ref.named_parameters()} | {"x": xg.grad.clone()}
    for t in (xg, *ref.parameters()):
        t.grad = None
    want = sdpa_forward(ref, xg, 0.0)
    want.backward(grad)
    torch.testing.assert_close(jitted(x), want.detach(), rtol=0, atol=1e-6)   # float32, the same ops: rounding only
    for name, p in [*ref.named_parameters(), ("x", xg)]:
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-5)
    dropped = thunder.jit(thunder_peer.BlockForward(ref, 0.5))(x)   # its dropout traced too
    assert dropped.shape == x.shape and not torch.equal(dropped, want)
