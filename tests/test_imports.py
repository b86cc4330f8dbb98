"""Every `from tpfuser.X import name` in the package, the tests and the tools,
function bodies included, names something X has: many run only on a GPU
(under a launcher, in a benchmark), where a stale import would cost device time."""
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
    for path in sorted([*ROOT.glob("tpfuser/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("tools/*.py")]):
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
