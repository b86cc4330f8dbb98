"""The process world starts in an explicit call (tpfuser/dist/world.py), never at import."""
import os
import subprocess
import sys

import pytest
import torch

from tpfuser.dist import world

WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NVFUSER_MASTER_ADDR", "NVFUSER_MASTER_PORT",
              "OMPI_COMM_WORLD_SIZE", world.SINGLE_PROCESS_MARK)


def test_importing_tpfuser_changes_no_environment():
    """Even where CUDA exists (faked here): importing every module leaves os.environ as it was."""
    code = """
import os, pkgutil, importlib, torch
torch.cuda.is_available = lambda: True
before = dict(os.environ)
import tpfuser
for m in pkgutil.iter_modules(tpfuser.__path__):
    importlib.import_module("tpfuser." + m.name)
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print("CHANGED", changed)
"""
    env = {k: v for k, v in os.environ.items() if k not in WORLD_VARS}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "CHANGED []" in out.stdout, out.stdout + out.stderr


@pytest.fixture
def no_world():
    """No world variables during the test, and the environment as it was after it
    (monkeypatch.delenv of an absent variable would not undo what the code sets,
    and a world left described makes nvFuser start its Communicator at exit)."""
    saved = dict(os.environ)
    for name in WORLD_VARS:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_process_alone_describes_a_world_of_one(no_world, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert world.describe_single_process()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1")
    assert int(os.environ["NVFUSER_MASTER_PORT"]) > 0
    assert not world.in_launcher()              # its own description, not a launcher's
    assert not world.describe_single_process()   # once


def test_nothing_is_described_under_a_launcher_or_without_cuda(no_world, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not world.describe_single_process() and "WORLD_SIZE" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not world.describe_single_process() and "RANK" not in os.environ
