"""tools/gpu_suite.sh, read on the CPU: its header lists every step it defines
(and no other), and it runs from the repository alone: every file of ours it
names exists, and nothing outside the repository (a `.nvf/` helper) is called."""
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUITE = ROOT / "tools" / "gpu_suite.sh"


def header_steps(text: str) -> set[str]:
    """The step names the header's list gives ("#   name  what it does", or "#   a, b, c  ...")."""
    steps = set()
    for line in text.split("set -uo pipefail")[0].splitlines():
        m = re.match(r"#   ([a-z0-9]+(?:, [a-z0-9]+)*)\s{2,}\S", line)
        if m:
            steps |= set(m.group(1).split(", "))
    return steps


def defined_steps(text: str) -> set[str]:
    return set(re.findall(r"^step_([a-z0-9]+)\(\) \{", text, re.M))


def test_the_header_lists_every_step_and_only_those():
    text = SUITE.read_text()
    assert len(defined_steps(text)) > 10
    assert header_steps(text) == defined_steps(text)


def test_a_step_missing_from_the_header_is_found():
    text = SUITE.read_text() + "\nstep_newone() {\n  :\n}\n"
    assert defined_steps(text) - header_steps(text) == {"newone"}


def test_the_suite_runs_from_the_repository_alone():
    text = SUITE.read_text()
    assert subprocess.run(["bash", "-n", str(SUITE)]).returncode == 0
    assert ".nvf/" not in text
    named = set(re.findall(r"(?<![\w/.$])((?:tools|tests|tpfuser)/[\w./*-]*\w)", text))
    assert named and {p for p in named if not list(ROOT.glob(p))} == set()
