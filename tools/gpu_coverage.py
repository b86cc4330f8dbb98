"""Which GPU tests have passed on a GPU, by the JUnit files committed under results/.

    python3 tools/gpu_coverage.py [--since RUN] [RESULTS_DIR]
    python3 tools/gpu_coverage.py --split K [-k EXPR] [--tests PATH ...]

Collects the tests marked gpu (pytest --collect-only, no GPU needed) and prints
each with the runs whose JUnit file says it passed, then the ones no run
passed. --since RUN counts only runs at or after RUN (e.g. run19: the runs at
the current code); run folders are ordered by their number. Exit code 1 when
a test has not passed: the GPU suite is not yet shown to pass.

--split K prints the GPU tests (narrowed by -k, from --tests) as K lines of
test ids, balanced by the seconds each took in its latest committed run (one
never run counts as the slowest known): tools/gpu_suite.sh runs one pytest per
line at once (TEST_JOBS=K), the suite being compile-bound.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET


def gpu_test_ids(paths=("tests",), k: str = "") -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", *paths,
                          *(["-k", k] if k else []), "-p", "no:cacheprovider"],
                         capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def run_number(path: str) -> int:
    m = re.search(r"(?:^|/)run(\d+)", path)
    return int(m.group(1)) if m else -1


def _passed_cases(results: str, since: int = -1):
    """(run folder, test id, seconds) of every passed case in the committed JUnit files, by run number."""
    for path in sorted(glob.glob(os.path.join(results, "**", "*.xml"), recursive=True), key=run_number):
        if run_number(path) < since:
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            if not case.get("classname") or any(case.find(k) is not None for k in ("failure", "error", "skipped")):
                continue
            test = case.get("classname").replace(".", "/") + ".py::" + case.get("name")
            yield f"run{run_number(path)}", test, float(case.get("time", 0))


def passed_in(results: str, since: int = -1) -> dict[str, list[str]]:
    """{test id: [run, ...]} for every test a committed JUnit file reports passed."""
    passed: dict[str, list[str]] = {}
    for run, test, _ in _passed_cases(results, since):
        passed.setdefault(test, []).append(run)
    return passed


def split(ids: list[str], seconds: dict[str, float], k: int) -> list[list[str]]:
    """The tests in k groups of near-equal total seconds (longest first, each to the
    lightest group); a test without a time counts as the slowest known. Groups keep
    the tests' order, empty ones are dropped."""
    guess = max(seconds.values(), default=1.0)
    groups: list[list[str]] = [[] for _ in range(k)]
    load = [0.0] * k
    for test in sorted(ids, key=lambda t: -seconds.get(t, guess)):
        i = load.index(min(load))
        groups[i].append(test)
        load[i] += seconds.get(test, guess)
    return [sorted(g, key=ids.index) for g in groups if g]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="?", default="results")
    p.add_argument("--since", default="run0", help="count runs from this one on (runN)")
    p.add_argument("--split", type=int, metavar="K", help="print the tests as K balanced lines of ids instead")
    p.add_argument("-k", default="", help="with --split: pytest's -k expression")
    p.add_argument("--tests", nargs="+", default=["tests"], help="with --split: the test files or folders")
    args = p.parse_args(argv)
    since = int(args.since.removeprefix("run"))
    if args.split is not None:
        if args.split < 1:
            p.error(f"--split: expected a number of groups of at least 1, got {args.split}")
        seconds = {test: s for _, test, s in _passed_cases(args.results, since)}   # the latest run's
        ids = gpu_test_ids(args.tests, args.k)
        if not ids:
            print(f"no GPU test in {' '.join(args.tests)}{' for -k ' + args.k if args.k else ''}", file=sys.stderr)
            return 1
        for group in split(ids, seconds, args.split):
            print(" ".join(group))
        return 0
    passed = passed_in(args.results, since)
    ids = gpu_test_ids()
    missing = [t for t in ids if t not in passed]
    for t in ids:
        if t in passed:
            print(f"passed  {t}  ({', '.join(sorted(set(passed[t]), key=run_number))})")
    for t in missing:
        print(f"NOT YET {t}")
    print(f"{len(ids) - len(missing)} of {len(ids)} GPU tests passed in a committed run from run{since} on")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
