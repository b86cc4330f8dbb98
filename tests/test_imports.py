"""Every `from tpfuser.<module> import <name>` in the package, the tests and
the tools (tools/probes too), function bodies included, names something the
module has: many run only on a GPU (under a launcher, in a benchmark), where a
stale import would cost device time. And the package's structure, read from the source: no import
circle, top-level imports down the layers, an oracle that imports nothing of
the package, function-level imports only of what is heavy or optional (each
module says why at its top), no module over 350 lines."""
import ast
import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _is_module(name: str) -> bool:   # `from tpfuser import launch`
    try:
        importlib.import_module(name)
        return True
    except ModuleNotFoundError:
        return False


def stale_imports() -> list[str]:
    bad = []
    for path in sorted([*ROOT.glob("tpfuser/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("tools/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tpfuser":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name) and not _is_module(f"{node.module}.{alias.name}"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {alias.name}")
    return bad


def test_every_tpfuser_import_resolves():
    assert stale_imports() == []


def test_a_stale_import_is_found(tmp_path, monkeypatch):
    import tests.test_imports as me
    fake = tmp_path / "tpfuser"
    fake.mkdir()
    (fake / "stale.py").write_text("def f():\n    from tpfuser.dist.launch import dp_group\n")
    monkeypatch.setattr(me, "ROOT", tmp_path)
    assert me.stale_imports() == ["tpfuser/stale.py:2: from tpfuser.dist.launch import dp_group"]


# ---------------------------------------------------------------------------
# The package's import structure, from the source (ast; nothing imported).

# Lowest first: a module imports at its top only from its own layer or lower ones.
# config and outputs are every layer's; predict sits above parallel, beside dist.
LAYERS = (("tpfuser", "tpfuser.config", "tpfuser.outputs"), ("tpfuser.block",), ("tpfuser.parallel",),
          ("tpfuser.predict", "tpfuser.dist"), ("tpfuser.runtime",), ("tpfuser.verify",), ("tpfuser.bench",),
          ("tpfuser.cli", "tpfuser.bench.__main__"))
# What a function may import (deferred, with its reason at the module's top): the
# heavy or optional dependencies, and the modules that import nvFuser (NVFUSER_MODULES).
DEFERRABLE = ("nvfuser_direct", "torch.distributed", "torch.profiler", "matplotlib", "transformers", "triton",
              "thunder")   # (thunder: lightning-thunder, an optional peer of the bench)
# The package's modules that import nvFuser at their top (directly or through another).
NVFUSER_MODULES = {"tpfuser.block.backward", "tpfuser.block.forward", "tpfuser.block.inputs", "tpfuser.block.ops",
                   "tpfuser.block.pieces", "tpfuser.parallel.overlapped", "tpfuser.parallel.ring", "tpfuser.parallel.passes",
                   "tpfuser.runtime.block", "tpfuser.runtime.chunked", "tpfuser.runtime.graphs",
                   "tpfuser.runtime.module", "tpfuser.runtime.shared", "tpfuser.verify.check", "tpfuser.verify.inspect",
                   "tpfuser.verify.oracle"}
# More deferred imports, by file, in two files another change holds at present:
# startup.py's child process times its own imports (import_s), so its _child's
# are on purpose; plot.py's bench.report and run_startup's torch could move to
# their module's top.
ELSEWHERE = {"tpfuser/bench/plot.py": {"tpfuser.bench.report"},
             "tpfuser/bench/startup.py": {"torch", "tpfuser.config", "tpfuser.parallel.schedules",
                                          "tpfuser.verify.reference"}}
# What must import no nvFuser (plan, every refusal: under a launcher without CUDA its import aborts at exit).
WITHOUT_NVFUSER = ("tpfuser.cli", "tpfuser.bench.cli", "tpfuser.parallel.schedules", "tpfuser.parallel.placements",
                   "tpfuser.parallel.report", "tpfuser.predict.calibration", "tpfuser.predict.comm",
                   "tpfuser.predict.command", "tpfuser.predict.plot", "tpfuser.predict.timeline")
MAX_LINES = 350


def _modules(root) -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(root.glob("tpfuser/**/*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(node, module: str, is_package: bool) -> list[str]:
    """The module names an Import or ImportFrom node names (relative ones resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".")[:len(module.split(".")) - node.level + is_package]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _imports(path: pathlib.Path, module: str, top_only: bool, type_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) of each import in the file: at its top level (through if/try
    blocks, not `if TYPE_CHECKING:` unless type_only) or, top_only=False, those inside functions only."""
    found = []

    def visit(nodes, in_function):
        for node in nodes:
            if _is_type_checking(node) and not type_only:
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)) and in_function != top_only:
                found.extend((node.lineno, m) for m in _imported(node, module, path.name == "__init__.py"))
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(ast.iter_child_nodes(node), inner)
    visit(ast.parse(path.read_text()).body, False)
    return found


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """tpfuser module -> the tpfuser modules its top-level imports run (their packages included);
    type_only: those under `if TYPE_CHECKING:` too."""
    modules = _modules(ROOT)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for _, imported in _imports(path, name, top_only=True, type_only=type_only):
            parts = imported.split(".")
            edges |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules.keys()
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports (its first module repeated at the end), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None
    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _layer(module: str) -> int:
    return max(i for i, names in enumerate(LAYERS) for n in names if module == n or module.startswith(n + "."))


def _subpackage(module: str) -> str:
    return (module.split(".") + [""])[1]


def layer_violations() -> list[str]:
    """Top-level imports of a higher layer, or between predict and dist (side by side)."""
    return [f"{a} imports {b}" for a, edges in sorted(import_graph().items()) for b in sorted(edges)
            if _layer(b) > _layer(a) or {_subpackage(a), _subpackage(b)} == {"predict", "dist"}]


def stray_deferred_imports() -> list[str]:
    """Function-level imports of anything but DEFERRABLE, NVFUSER_MODULES (and ELSEWHERE's)."""
    bad = []
    for name, path in _modules(ROOT).items():
        rel = str(path.relative_to(ROOT))
        for line, imported in _imports(path, name, top_only=False):
            if imported in NVFUSER_MODULES or imported in ELSEWHERE.get(rel, ()):
                continue
            if any(imported == d or imported.startswith(d + ".") for d in DEFERRABLE):
                continue
            if imported.rpartition(".")[0] in NVFUSER_MODULES | ELSEWHERE.get(rel, set()):
                continue   # `from X import name`: the name itself, not a module
            bad.append(f"{rel}:{line}: {imported}")
    return bad


def reference_imports_from_the_package() -> list[str]:
    path = ROOT / "tpfuser" / "verify" / "reference.py"
    return [f"{line}: {m}" for top_only in (True, False)
            for line, m in _imports(path, "tpfuser.verify.reference", top_only) if m.split(".")[0] == "tpfuser"]


def test_no_import_circle_among_the_packages_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_import_circle_even_through_type_only_imports():
    cycle = find_cycle(import_graph(type_only=True))
    assert cycle is None, "import circle (type-only imports included): " + " -> ".join(cycle)


def test_top_level_imports_go_down_the_layers():
    assert layer_violations() == []


def test_the_oracle_imports_nothing_of_the_package():
    """reference.py is what the fusions are checked against: a bug it shared
    with them would pass unseen (its annotations' BlockConfig is TYPE_CHECKING's)."""
    assert reference_imports_from_the_package() == []


def test_every_function_level_import_is_a_deferred_heavy_one():
    assert stray_deferred_imports() == []


def test_the_listed_nvfuser_modules_do_import_it_and_the_rest_do_not():
    graph, modules = import_graph(), _modules(ROOT)
    direct = {name for name, path in modules.items()
              if any(m.split(".")[0] == "nvfuser_direct" for _, m in _imports(path, name, top_only=True))}
    reach = {}

    def imports_nvfuser(name):
        if name not in reach:
            reach[name] = False
            reach[name] = name in direct or any(imports_nvfuser(m) for m in graph[name])
        return reach[name]
    assert {name for name in modules if imports_nvfuser(name)} == NVFUSER_MODULES
    assert not NVFUSER_MODULES & set(WITHOUT_NVFUSER)


def test_every_module_is_at_most_350_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules(ROOT).values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_each_structure_check_finds_what_it_is_for(tmp_path, monkeypatch):
    """A circle, an upward import, the oracle importing the package, a stray
    function-level import and a long module, each in a scratch package."""
    import tests.test_imports as me
    fake = tmp_path / "tpfuser"
    (fake / "verify").mkdir(parents=True)
    (fake / "block").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "block" / "__init__.py").write_text("")
    (fake / "verify" / "__init__.py").write_text("")
    (fake / "block" / "a.py").write_text("from tpfuser.block import b\n")
    (fake / "block" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from tpfuser.verify import reference\nimport tpfuser.block.a\n")
    (fake / "verify" / "reference.py").write_text("import torch\n\n\ndef f():\n    import json\n"
                                                  "    from . import helper\n")
    (fake / "verify" / "helper.py").write_text("from tpfuser.block.a import x\n" + "y = 1\n" * MAX_LINES)
    monkeypatch.setattr(me, "ROOT", tmp_path)
    assert me.find_cycle(me.import_graph()) == ["tpfuser.block.a", "tpfuser.block.b", "tpfuser.block.a"]
    assert me.find_cycle({"x": {"y"}, "y": set()}) is None
    assert me.layer_violations() == []                   # TYPE_CHECKING's import of verify counts for nothing
    (fake / "block" / "b.py").write_text("import tpfuser.verify.helper\n")
    assert me.layer_violations() == ["tpfuser.block.b imports tpfuser.verify", "tpfuser.block.b imports tpfuser.verify.helper"]
    assert me.reference_imports_from_the_package() == ["6: tpfuser.verify", "6: tpfuser.verify.helper"]
    assert me.stray_deferred_imports() == ["tpfuser/verify/reference.py:5: json",
                                           "tpfuser/verify/reference.py:6: tpfuser.verify",
                                           "tpfuser/verify/reference.py:6: tpfuser.verify.helper"]
    (fake / "verify" / "reference.py").write_text("def f():\n    import matplotlib.pyplot\n"
                                                  "    from tpfuser.runtime.block import ShardedBlock\n")
    assert me.stray_deferred_imports() == []             # a heavy one, and a module that imports nvFuser
    assert me.reference_imports_from_the_package() == ["3: tpfuser.runtime.block", "3: tpfuser.runtime.block.ShardedBlock"]


def test_the_package_face_imports_nothing_until_a_name_is_used():
    """`import tpfuser` brings neither torch nor nvFuser in and changes no
    environment; each public name resolves at its first use; an unknown one
    is refused naming the public ones."""
    import subprocess
    import sys
    probe = ("import os, sys; before = dict(os.environ); import tpfuser; "
             "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'nvfuser_direct')], 'heavy import'; "
             "assert dict(os.environ) == before, 'environment changed'; "
             "names = [getattr(tpfuser, n) for n in tpfuser.__all__]; "
             "assert tpfuser.ShardedBlock.__name__ == 'ShardedBlock'; "
             "tpfuser.nope")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert "AttributeError: module 'tpfuser' has no attribute 'nope' (its public names: Block, BlockConfig" in done.stderr
