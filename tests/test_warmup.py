"""cuBLAS's start-up on a thread beside the first compiles (runtime/warmup.py)."""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from tpfuser.runtime import warmup


def test_nothing_starts_without_a_cuda_device(monkeypatch):
    monkeypatch.setattr(warmup, "_threads", {})
    before = threading.active_count()
    assert not warmup.start(torch.device("cpu"), torch.float32)
    if not torch.cuda.is_available():
        assert not warmup.start(torch.device("cuda", 0), torch.float32)
    assert warmup._threads == {} and threading.active_count() == before
    warmup.wait()   # nothing to join


CHILD = r"""
import json, os, sys, threading, time, torch
sys.path.insert(0, os.getcwd())
from tpfuser.config import preset
from tpfuser.runtime import warmup
from tpfuser.runtime.block import ShardedBlock
from tpfuser.verify.reference import make_block, make_input
cfg = preset("tiny", dtype="bf16")
block = ShardedBlock(cfg)
began = {index: thread.name for index, thread in warmup._threads.items()}
again = warmup.start(block.device, torch.bfloat16)   # once per device
block.load(make_block(cfg).state_dict())
out = block(make_input(cfg).to("cuda", torch.bfloat16), 7, 0)["out"]
left = [t.name for t in threading.enumerate() if t.name.startswith("tpfuser-cublas-start")]
print(json.dumps({"began": began, "again": again, "left": left, "errors": [repr(e) for e in warmup.errors.values()],
                  "finite": bool(out.isfinite().all())}), flush=True)
os._exit(0)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_block_starts_cublas_on_a_thread_and_joins_it_by_its_first_call_s_end(record):
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=400,
                          env={k: v for k, v in os.environ.items() if k != "TPFUSER_KERNEL_CACHE"})
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    record(**seen)
    assert seen["began"] == {"0": "tpfuser-cublas-start-0"} and seen["again"] is False
    assert seen["left"] == [] and seen["errors"] == [] and seen["finite"]
