"""Which GPU tests have passed on a GPU, by the JUnit files committed under results/.

    python3 tools/gpu_coverage.py [--since RUN] [RESULTS_DIR]

Collects the tests marked gpu (pytest --collect-only, no GPU needed) and prints
each with the runs whose JUnit file says it passed, then the ones no run
passed. --since RUN counts only runs at or after RUN (e.g. run19: the runs at
the current code); run folders are ordered by their number. Exit code 1 when
a test has not passed: the GPU suite is not yet shown to pass.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET


def gpu_test_ids() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests",
                          "-p", "no:cacheprovider"], capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def run_number(path: str) -> int:
    m = re.search(r"/run(\d+)", path)
    return int(m.group(1)) if m else -1


def passed_in(results: str, since: int = -1) -> dict[str, list[str]]:
    """{test id: [run, ...]} for every test a committed JUnit file reports passed."""
    passed: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(results, "**", "*.xml"), recursive=True), key=run_number):
        if run_number(path) < since:
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            if not case.get("classname") or any(case.find(k) is not None for k in ("failure", "error", "skipped")):
                continue
            test = case.get("classname").replace(".", "/") + ".py::" + case.get("name")
            passed.setdefault(test, []).append(f"run{run_number(path)}")
    return passed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="?", default="results")
    p.add_argument("--since", default="run0", help="count runs from this one on (runN)")
    args = p.parse_args(argv)
    since = int(args.since.removeprefix("run"))
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
