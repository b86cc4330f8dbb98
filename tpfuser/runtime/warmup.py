"""cuBLAS's start-up, paid beside nvFuser's first compiles.

A process's first matmul waits for cuBLAS to start: 1.6-2.0 s on an H100,
the block's first linear in a cold first call. `start(device, dtype)` pays it
on a thread of its own while the block is built and its first fusions
compile: that thread needs the GIL only to call in (torch releases it inside
the op), and the main thread's compiles run in C++. `wait()` joins the
thread; a block calls it before its first call returns, so nothing of it is
in flight when a CUDA graph is captured. Once per device in a process.
"""

from __future__ import annotations

import threading

import torch

_threads: dict[int, threading.Thread] = {}
errors: dict[int, BaseException] = {}   # a start-up that failed here, by device: the first linear pays it instead


def _run(device: torch.device, dtype: torch.dtype) -> None:
    try:
        with torch.cuda.device(device):
            a = torch.zeros(16, 16, device=device, dtype=dtype)
            torch.nn.functional.linear(a, a, a[0])   # cuBLASLt (a bias epilogue), as a linear with bias runs
            torch.matmul(a, a.t())                   # cuBLAS, as the backward's matmuls run
            torch.cuda.current_stream(device).synchronize()
    except BaseException as e:   # noqa: BLE001 (kept for the caller: the warm-up is only ever a head start)
        errors[device.index] = e


def start(device: torch.device, dtype: torch.dtype) -> bool:
    """Begin cuBLAS's start-up for `device` on a thread, unless it began
    already in this process; whether this call began it."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    if index in _threads:
        return False
    _threads[index] = thread = threading.Thread(target=_run, args=(device, dtype), daemon=True,
                                                name=f"tpfuser-cublas-start-{index}")
    thread.start()
    return True


def wait() -> None:
    """Join every warm-up thread still running."""
    for thread in _threads.values():
        if thread.is_alive():
            thread.join()
