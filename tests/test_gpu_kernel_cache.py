"""The kernel cache on the GPU (runtime/kernel_cache.py): a first process with
TPFUSER_KERNEL_CACHE fills a slot with nvFuser's kernels; a second, from that
slot, compiles none with NVRTC (its trace says) and returns the first's
outputs bit for bit; without the variable nothing is written."""
import json
import os
import subprocess
import sys

import pytest
import torch

CHILD = r"""
import json, os, sys, torch
sys.path.insert(0, os.getcwd())
from tpfuser.config import preset
from tpfuser.runtime.block import ShardedBlock
from tpfuser.runtime import kernel_cache
from tpfuser.verify.reference import make_block, make_input
cfg = preset("tiny", dtype="bf16")
torch.manual_seed(0)
block = ShardedBlock(cfg).load(make_block(cfg).state_dict())
out = block(make_input(cfg).to("cuda", torch.bfloat16), 7, 0)["out"]
torch.save(out.cpu(), sys.argv[1])
print(json.dumps({"slot": kernel_cache.active()}), flush=True)
import ctypes
ctypes.CDLL(None).fflush(None)   # nvFuser's trace is C stdio; the exit skips teardown (as bench --startup's child)
os._exit(0)
"""


def _run(tmp_path, name, cache):
    env = {k: v for k, v in os.environ.items() if k != "TPFUSER_KERNEL_CACHE"}
    trace = tmp_path / f"{name}.trace.json"
    env["NVFUSER_TRACE"] = str(trace)
    if cache:
        env["TPFUSER_KERNEL_CACHE"] = str(cache)
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / f"{name}.pt")], env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    slot = json.loads(done.stdout.strip().splitlines()[-1])["slot"]
    # NVRTC's own compile (its scope opens only for a real compile: a kernel read from the
    # database skips it, though the NVRTC step around it still shows in the trace)
    nvrtc = trace.read_text(errors="replace").count('"executor_utils::Nvrtc::CompileProgram", "ph": "B"') \
        if trace.exists() else None
    return slot, torch.load(tmp_path / f"{name}.pt"), nvrtc


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_second_process_reads_the_kernels_back_and_computes_the_same(tmp_path, record):
    cache = tmp_path / "cache"
    slot, first, compiled = _run(tmp_path, "first", cache)
    assert slot and os.path.isfile(os.path.join(slot, "nvfuser_kernel_db", "db.csv"))
    kernels = [f for f in os.listdir(os.path.join(slot, "nvfuser_kernel_db")) if f.endswith(".cubin")]
    assert len(kernels) >= 2 and compiled >= 2   # the opening fusion's kernel and the block's
    again, second, recompiled = _run(tmp_path, "second", cache)
    record(kernels_cached=len(kernels), nvrtc_first=compiled, nvrtc_second=recompiled)
    assert again == slot and recompiled == 0 and torch.equal(first, second)
    _, cold, cold_compiled = _run(tmp_path, "cold", None)
    assert torch.equal(cold, first) and cold_compiled == compiled - 1   # no opening fusion without the cache
