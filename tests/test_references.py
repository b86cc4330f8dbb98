"""Every module, file and `module.name` that a docstring, comment, help text,
README or docs/ page names exists (STYLE.md: words in code stay true), and no
docstring, comment or help text carries a run number, a date, a session or one
of our issue numbers (those belong to NOTES.md, results/ and commit messages).

What is checked, to stay free of false alarms:
- paths under tpfuser/, tools/, tests/, docs/ or results/ (globs match something;
  `tests/x.py::name` names a function or class there);
- a bare `name.py` or `name.sh`: some file of the repository is called so;
- `module.name` where module is one of ours (a module or package of tpfuser, a
  tool, a test helper), `Class.name` where Class is one of tpfuser's, and
  `tpfuser.a.b...` in full: the name resolves;
- `word.name_with_underscore` (or `word.UPPER`, `word._private`) where word is
  none of ours, nothing importable, no variable-like word and no tensor of the
  block: a module that no longer exists (`old_module.build_it`).
Not checked: NOTES*.md, docs/history.md and results/ (the lab notebook and the
history name what existed then), fenced code in Markdown (dotted names there
are variables), string literals that are not help texts.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
HISTORY = ("NOTES.md", "NOTES-history.md", "docs/history.md")   # name what existed then
SELF = "tests/test_references.py"   # its words are the patterns it looks for
# Stale references in files another change owns (parallel/, predict/, runtime/chunked.py),
# left for it: "path: reference". Empty it as they are fixed.
ALLOWED: set[str] = set()
# Paths of other repositories that the words name as such: "path: reference".
EXTERNAL = {f"tpfuser/parallel/{name}.py: tests/python/multidevice/test_overlap.py"   # NVIDIA/Fuser's
            for name in ("overlapped", "ring")}
# Folders the programs make at run time (ignored by git): named, never committed.
MADE = {"results/tmp/multigpu"}
# Words that stand for a value in prose (`self.saved_names`, `args.json`, `fd.ops`), never a module.
VARIABLES = {"self", "cls", "args", "fd", "b", "x", "e", "g", "t", "out", "key", "masks", "model", "block", "gpt",
             "nanogpt", "reference_block", "nanogpt_block", "gpt2_block", "gpt2_lm_head_model", "schedule", "cfg",
             "layout", "rep", "report", "row", "r", "p", "os", "sys", "np", "nn", "F", "torch", "dist", "monkeypatch"}
EXTENSIONS = {"py", "md", "json", "jsonl", "sh", "c", "cpp", "h", "cu", "so", "csv", "txt", "png", "xml", "log",
              "toml", "gz", "out", "pt", "yaml", "nsys", "rep"}
PATH = re.compile(r"(?<![\w/.$-])((?:tpfuser|tools|tests|docs|results)/[\w./*-]*[\w*])(::\w+)?")
BARE = re.compile(r"(?<![\w/.$-])([A-Za-z_][\w-]*\.(?:py|sh))\b")
DOTTED = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\.([A-Za-z_]\w*)\b(?!\.)")
FULL = re.compile(r"(?<![\w.])(tpfuser(?:\.\w+)+)")
DATED = re.compile(r"\b(?:runs? \d+\b|20\d\d-\d\d-\d\d\b|(?<!upstream )issues? \d+\b|"
                   r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) session\b)")


def _sources(root: pathlib.Path) -> list[pathlib.Path]:
    files = [*root.glob("tpfuser/**/*.py"), *root.glob("tools/**/*.py"), *root.glob("tests/*.py"),
             *root.glob("tools/**/*.sh"), *root.glob("*.md"), *root.glob("docs/*.md"), *root.glob("tools/**/*.md"),
             *root.glob("tests/data/*.md"), *root.glob("tests/data/*.py"), *root.glob("tpfuser/**/*.c"),
             *[p for p in (root / "Makefile",) if p.exists()]]
    return sorted(p for p in files if str(p.relative_to(root)) not in (*HISTORY, SELF))


def prose(path: pathlib.Path) -> list[tuple[int, str, bool]]:
    """(line, text, whether dotted names count) of what a file says in words:
    a Python file's comments, docstrings and help texts, a script's comments,
    a Markdown page's text (fenced code: paths only), a C file's lines (paths only)."""
    text = path.read_text()
    if path.suffix == ".py":
        found = [(t.start[0], t.string, True) for t in tokenize.generate_tokens(io.StringIO(text).readline)
                 if t.type == tokenize.COMMENT]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc is not None:
                    found.append((node.body[0].lineno, doc, True))
            elif isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "help":
                        found += [(kw.value.lineno, s.value, True) for s in ast.walk(kw.value)
                                  if isinstance(s, ast.Constant) and isinstance(s.value, str)]
        return found
    if path.suffix == ".md":
        found, fenced = [], False
        for i, line in enumerate(text.splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            found.append((i, line, not fenced))
        return found
    if path.suffix == ".c":   # its comments are most of it; its code names no file of ours
        return [(i, line, False) for i, line in enumerate(text.splitlines(), 1)]
    return [(i, line[line.index("#"):], True) for i, line in enumerate(text.splitlines(), 1) if "#" in line]


class Names:
    """What the repository defines: its files, our modules' names and our classes' members."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.basenames = {p.name for p in root.rglob("*") if ".git" not in p.parts}
        self.modules: dict[str, list[pathlib.Path]] = {}
        for p in [*root.glob("tpfuser/**/*.py"), *root.glob("tools/**/*.py"), *root.glob("tests/*.py")]:
            self.modules.setdefault(p.stem if p.stem != "__init__" else p.parent.name, []).append(p)
        self.classes: dict[str, set[str]] = {}
        self.defined: dict[pathlib.Path, set[str]] = {}
        self.class_members: dict[pathlib.Path, set[str]] = {}   # of the classes each module defines
        for paths in self.modules.values():
            for p in paths:
                self.defined[p] = self._defines(p)

    def _defines(self, path: pathlib.Path) -> set[str]:
        tree = ast.parse(path.read_text())
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                members = self.classes.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        members.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                    for sub in ast.walk(item):   # self.name = ... in its methods
                        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                            members.add(sub.attr)
                if any(not (isinstance(b, ast.Name) and b.id in ("object", "Exception", "ValueError")) for b in node.bases):
                    members.add("*")   # inherits from elsewhere (nn.Module, a dataclass of ours): anything may be
                self.class_members.setdefault(path, set()).update(members - {"*"})
        return names

    def module_has(self, module: str, name: str) -> bool:
        """A name the module defines, a submodule of the package, or a member of a
        class the module defines (`block.load`: a ShardedBlock, runtime/block.py's)."""
        for p in self.modules[module]:
            if name in self.defined[p] or name in self.class_members.get(p, ()):
                return True
            if p.name == "__init__.py" and (p.parent / f"{name}.py").exists():
                return True
            if p.name == "__init__.py" and (p.parent / name).is_dir():
                return True
        return False


def _importable(word: str) -> bool:
    try:
        return importlib.util.find_spec(word) is not None
    except (ImportError, ValueError):
        return False


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _test_defined(path: pathlib.Path, name: str) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name
               for n in ast.walk(ast.parse(path.read_text())))


def stale_references(root: pathlib.Path = ROOT) -> list[str]:
    names = Names(root)
    from tpfuser.block.tensors import TENSORS
    tensor_words = {t.name.split(".")[0] for t in TENSORS} | {"grad", "param", "eager"}
    module_methods = set(dir(__import__("torch").nn.Module))
    bad = []
    for path in _sources(root):
        rel = str(path.relative_to(root))
        for line, text, dotted in prose(path):
            found = []
            for m in PATH.finditer(text):
                target = m.group(1).rstrip(".")
                matches = list(root.glob(target)) if "*" in target else [root / target] if (root / target).exists() else []
                if not matches:
                    found.append(target)
                elif m.group(2) and target.endswith(".py") and not _test_defined(matches[0], m.group(2)[2:]):
                    found.append(target + m.group(2))
            found += [m.group(1) for m in BARE.finditer(text) if m.group(1) not in names.basenames]
            found += [m.group(1) for m in FULL.finditer(text) if not _resolves(m.group(1).rstrip("."))]
            if dotted:
                for m in DOTTED.finditer(text):
                    head, name = m.groups()
                    if name in EXTENSIONS or head == "tpfuser" or head in tensor_words:
                        continue
                    if head in names.modules:   # (a word that is also a variable's: a member of one of our classes)
                        ok = names.module_has(head, name) or (
                            head in VARIABLES and any(name in members for members in names.classes.values()))
                    elif head in names.classes:
                        ok = name in names.classes[head] or "*" in names.classes[head]
                    elif head in VARIABLES or _importable(head) or name in module_methods:
                        ok = True
                    else:   # a module by its looks: a snake_case, private or constant name after a plain word
                        ok = not (head.islower() and ("_" in name.strip("_") or name.startswith("_") or name.isupper()))
                    if not ok:
                        found.append(f"{head}.{name}")
            bad += [f"{rel}:{line}: {ref}" for ref in found if f"{rel}: {ref}" not in ALLOWED | EXTERNAL
                    and ref not in MADE]
    return bad


def dated_words(root: pathlib.Path = ROOT) -> list[str]:
    """Run numbers, dates, sessions and our issue numbers in the code's own words
    (docstrings, comments, help texts)."""
    bad = []
    for path in _sources(root):
        if path.suffix == ".md":
            continue
        rel = str(path.relative_to(root))
        for line, text, _ in prose(path):
            bad += [f"{rel}:{line}: {m.group(0)}" for m in DATED.finditer(text) if f"{rel}: {m.group(0)}" not in ALLOWED]
    return bad


def test_every_name_in_the_words_exists():
    assert stale_references() == []


def test_no_run_number_or_date_in_the_codes_words():
    assert dated_words() == []


def test_stale_names_and_dates_are_found(tmp_path, monkeypatch):
    import tests.test_references as me
    (tmp_path / "tpfuser").mkdir()
    (tmp_path / "tpfuser" / "ops.py").write_text("def dropout():\n    pass\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_ops.py").write_text("def test_dropout():\n    pass\n")
    (tmp_path / "tpfuser" / "stale.py").write_text(
        '"""Built by old_module.build_it (old_module.py); see tpfuser/gone.py, ops.dropout and ops.gone,\n'
        'tests/test_ops.py::test_dropout and tests/test_ops.py::test_gone; args.json is a value."""\n'
        "import argparse\n\n\n"
        "def f(p):\n"
        "    p.add_argument('--x', help='as on the H200 (run 58, 2026-12-07)')   # cf. tools/none.sh\n")
    monkeypatch.setattr(me, "ROOT", tmp_path)
    assert sorted(me.stale_references(tmp_path)) == sorted([
        "tpfuser/stale.py:1: tpfuser/gone.py", "tpfuser/stale.py:1: tests/test_ops.py::test_gone",
        "tpfuser/stale.py:1: old_module.py", "tpfuser/stale.py:1: old_module.build_it", "tpfuser/stale.py:1: ops.gone",
        "tpfuser/stale.py:7: tools/none.sh"])
    assert me.dated_words(tmp_path) == ["tpfuser/stale.py:7: run 58", "tpfuser/stale.py:7: 2026-12-07"]
