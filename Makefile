# Two commands on a fresh machine:  `make` (the main job)  and  `make test`.
# The environment (.venv, Python 3.12 via .python-version) is created when absent.
PYTHON312 ?= python3.12
VENV := .venv

.PHONY: run test clean
run: $(VENV)/.ready
	$(VENV)/bin/tpfuser main

# Two pytest processes, one per core, each test file whole in one of them (its fixtures run once,
# its tests in order): the suite is CPU-bound (torch imports, fusion builds, ranks started).
test: $(VENV)/.ready
	$(VENV)/bin/python -m pytest -q -rs -n 2 --dist loadfile

$(VENV)/.ready: pyproject.toml tpfuser/__init__.py
	@command -v $(PYTHON312) >/dev/null || { echo "need $(PYTHON312): pyenv install 3.12.1 (selected by .python-version)"; exit 1; }
	test -x $(VENV)/bin/python || $(PYTHON312) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

clean:
	rm -rf $(VENV) *.egg-info
