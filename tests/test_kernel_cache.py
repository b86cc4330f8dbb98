"""The opt-in kernel cache (runtime/kernel_cache.py): a folder per nvFuser
version, GPU and CUDA; a slot per live process (flock), never two at once;
off by default; off with one line where it cannot be set up; the fusions then
run with nvFuser's kernel_db option; bench --startup's children run cold.
CPU: the GPU's part (nvFuser opening its database) is faked."""
import os
import subprocess
import sys

import pytest
import torch

from tpfuser.bench import startup
from tpfuser.config import Layout, preset
from tpfuser.runtime import kernel_cache
from tpfuser.runtime.block import ShardedBlock


@pytest.fixture
def fresh(monkeypatch):
    """The module's once-a-process decision, undone around the test."""
    monkeypatch.setattr(kernel_cache, "_state", {"asked": None, "slot": None, "lock": None})
    yield kernel_cache._state
    if kernel_cache._state["lock"] is not None:
        kernel_cache.release(kernel_cache._state["lock"])


def test_a_folder_per_nvfuser_version_gpu_and_cuda(tmp_path):
    base = dict(root=str(tmp_path), nvfuser_version="0.2.36", gpu="NVIDIA H200", capability=(9, 0), cuda="13.0")
    one = kernel_cache.cache_folder(**base)
    assert one == str(tmp_path / "nvfuser-0.2.36" / "nvidia-h200-sm90-cuda13.0")
    for change in ({"nvfuser_version": "0.2.37"}, {"gpu": "NVIDIA H100"}, {"capability": (10, 0)}, {"cuda": "12.8"}):
        assert kernel_cache.cache_folder(**{**base, **change}) != one, change


def test_no_two_live_processes_hold_one_slot(tmp_path):
    first = kernel_cache.claim_slot(str(tmp_path), slots=2)
    second = kernel_cache.claim_slot(str(tmp_path), slots=2)   # another open file: flock tells them apart
    assert first[0] != second[0] and {os.path.basename(s) for s, _ in (first, second)} == {"slot-0", "slot-1"}
    assert kernel_cache.claim_slot(str(tmp_path), slots=2) is None   # all held
    held_elsewhere = subprocess.run([sys.executable, "-c", f"""
import sys; sys.path.insert(0, {os.getcwd()!r})
from tpfuser.runtime.kernel_cache import claim_slot
print(claim_slot({str(tmp_path)!r}, slots=3)[0])"""], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.basename(held_elsewhere) == "slot-2"
    kernel_cache.release(first[1])
    again = kernel_cache.claim_slot(str(tmp_path), slots=2)   # a slot given back is taken again: its kernels reused
    assert again[0] == first[0]
    kernel_cache.release(again[1])
    kernel_cache.release(second[1])


def test_off_by_default_and_on_with_the_variable(fresh, monkeypatch, tmp_path):
    monkeypatch.delenv(kernel_cache.CACHE_VAR, raising=False)
    assert kernel_cache.active() is None and kernel_cache.options() == {}
    fresh.update(asked=None)
    opened = []
    monkeypatch.setenv(kernel_cache.CACHE_VAR, str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_this_gpu", lambda: ("NVIDIA H200", (9, 0), "13.0", "0.2.36"))
    monkeypatch.setattr(kernel_cache, "open_database", opened.append)
    slot = kernel_cache.active()
    assert slot.startswith(str(tmp_path / "nvfuser-0.2.36")) and opened == [slot]
    assert kernel_cache.options() == {"_enable_options": ["kernel_db"]}
    block = ShardedBlock(preset("tiny", dtype="fp32"), Layout(1, 1), device=torch.device("cpu"))
    run = block.pass_of("forward")
    assert all("kernel_db" in block._piece_options(run, piece)["_enable_options"] for piece in run.pieces)


def test_a_cache_that_cannot_be_set_up_is_off_saying_why(fresh, monkeypatch, tmp_path, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(kernel_cache.CACHE_VAR, str(blocked))   # a file where the folder would go
    monkeypatch.setattr(kernel_cache, "_this_gpu", lambda: ("NVIDIA H200", (9, 0), "13.0", "0.2.36"))
    assert kernel_cache.active() is None and kernel_cache.options() == {}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kernel cache off" in err and str(blocked) in err


def test_open_database_puts_tmpdir_back_and_says_where_it_failed(monkeypatch, tmp_path):
    """TMPDIR names the slot only while the small fusion runs: put back (or unset again)
    when it fails, here made to fail on every machine (a GPU's would run it)."""
    pytest.importorskip("nvfuser_direct")
    seen = []

    def fails(*args, **kwargs):
        seen.append(os.environ.get("TMPDIR"))
        raise RuntimeError("the fusion's input, refused")
    monkeypatch.setattr(kernel_cache.torch, "ones", fails)
    for before in ("/somewhere", None):
        if before is None:
            monkeypatch.delenv("TMPDIR", raising=False)
        else:
            monkeypatch.setenv("TMPDIR", before)
        with pytest.raises(RuntimeError, match="the fusion's input, refused"):
            kernel_cache.open_database(str(tmp_path))
        assert os.environ.get("TMPDIR") == before and seen[-1] == str(tmp_path)


def test_startup_children_run_cold(monkeypatch):
    seen = {}

    def run(cmd, env, **kwargs):
        seen.update(env)
        return subprocess.CompletedProcess(cmd, 1, "", "boom")
    monkeypatch.setattr(startup.subprocess, "run", run)
    monkeypatch.setenv(kernel_cache.CACHE_VAR, "/cache")
    assert startup.CACHE_VAR == kernel_cache.CACHE_VAR
    startup._run_child({"impl": "nvfuser", "pass": "forward"}, 5)
    assert kernel_cache.CACHE_VAR not in seen and "TORCHINDUCTOR_CACHE_DIR" in seen


def test_a_database_that_does_not_open_gives_its_slot_back(fresh, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(kernel_cache.CACHE_VAR, str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_this_gpu", lambda: ("NVIDIA H200", (9, 0), "13.0", "0.2.36"))

    def fails(slot):
        raise RuntimeError(f"nvFuser did not open its kernel database in {slot}")
    monkeypatch.setattr(kernel_cache, "open_database", fails)
    assert kernel_cache.active() is None and "kernel cache off (RuntimeError: nvFuser did not open" in \
        capsys.readouterr().err
    folder = kernel_cache.cache_folder(str(tmp_path), "0.2.36", "NVIDIA H200", (9, 0), "13.0")
    slot, fd = kernel_cache.claim_slot(folder, slots=1)   # slot-0 free again
    kernel_cache.release(fd)


def test_any_failure_leaves_it_off_and_nvfusers_own_database_is_refused(fresh, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(kernel_cache.CACHE_VAR, str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_this_gpu", lambda: ("NVIDIA H200", (9, 0), "13.0", "0.2.36"))
    monkeypatch.setattr(kernel_cache, "open_database", lambda slot: {}["no such key"])   # not an OSError
    assert kernel_cache.active() is None and kernel_cache.options() == {}
    assert "kernel cache off (KeyError" in capsys.readouterr().err
    fresh.update(asked=None)
    monkeypatch.setattr(kernel_cache, "open_database", lambda slot: None)
    monkeypatch.setenv("NVFUSER_ENABLE", "kernel_db")
    assert kernel_cache.active() is None and "NVFUSER_ENABLE has kernel_db" in capsys.readouterr().err


def test_a_process_takes_its_own_slot_again(fresh, monkeypatch, tmp_path):
    """By its label (a dtype's check) or its local rank, where free: a rerun finds its kernels."""
    monkeypatch.setenv("TPFUSER_PROCESS", "bf16")
    slot, fd = kernel_cache.claim_slot(str(tmp_path), prefer=kernel_cache._preferred_slot())
    assert os.path.basename(slot) == "slot-bf16"
    taken = kernel_cache.claim_slot(str(tmp_path), prefer="bf16")   # held: a numbered one instead
    assert os.path.basename(taken[0]) == "slot-0"
    kernel_cache.release(fd)
    kernel_cache.release(taken[1])
    monkeypatch.delenv("TPFUSER_PROCESS")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert kernel_cache._preferred_slot() == "rank3"
