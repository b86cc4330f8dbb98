"""What the benchmark measures with, apart from the implementations: the
sampling of back-to-back calls, the floors' rates (the block's GEMMs, device
copies, all-reduce bus bandwidth) and the profile of what a call's time goes to."""

from __future__ import annotations

import re
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tpfuser.parallel.collectives import backward_collectives, forward_collectives
from tpfuser.verify.commlog import error_line


# Each timing sample is this many back-to-back calls (throughput, as a
# training loop sees it); samples of the implementations are interleaved.
CALLS_PER_SAMPLE = 10


def failure(e: BaseException) -> str:
    """One line for an implementation that failed; a failed CUDA-graph capture
    raises its own error over the cause, which follows it."""
    line = f"{type(e).__name__}: {error_line(e)}"
    return line + (f" (after {type(e.__context__).__name__}: {error_line(e.__context__)})" if e.__context__ else "")


def sample(fn, start, end, calls: int = 1) -> tuple[float, float]:
    """(GPU ms, host ms) per call over `calls` back-to-back calls. The host's is
    the time to issue them: where it comes near the GPU's, the calls are bound
    by their host work and the GPU waits."""
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host_s = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls, host_s * 1e3 / calls


def gpu_time(fn, start, end, calls: int = 1) -> float:
    """GPU ms per call over `calls` back-to-back calls."""
    return sample(fn, start, end, calls)[0]


def matmul_rate(cfg, reps: int = 50) -> float:
    """bf16 FLOP/s of the block's four GEMMs at their own shapes (b*s rows)."""
    m, e = cfg.batch * cfg.seq, cfg.n_embd
    shapes = [(m, e, 3 * e), (m, e, e), (m, e, 4 * e), (m, 4 * e, e)]
    mats = [(torch.randn(mm, k, device="cuda", dtype=torch.bfloat16),
             torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for mm, k, n in shapes]
    flops = sum(2 * mm * k * n for mm, k, n in shapes)

    def run():
        for a, w in mats:
            F.linear(a, w)
    for _ in range(5):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = [gpu_time(run, start, end) for _ in range(reps)]
    return flops / (statistics.median(times) * 1e-3)


def saved_activation_bytes(step_forward, params) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward,
    parameters excluded (they exist anyway)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step_forward()
    del out
    return sum(seen.values())


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device memory bandwidth, bytes/s, of a device-to-device copy (read + write)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = statistics.median(gpu_time(lambda: b.copy_(a), start, end) for _ in range(reps))
    return 2 * nbytes / (ms * 1e-3)


def allreduce_busbw(nbytes: int, group, team: int, reps: int = 20) -> float:
    """All-reduce bus bandwidth over `group`, bytes/s: a ring all-reduce sends
    2 (n-1)/n of the tensor per rank, so time = that / bandwidth (nccl-tests' busbw)."""
    t = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        dist.all_reduce(t, group=group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = statistics.median(gpu_time(lambda: dist.all_reduce(t, group=group), start, end) for _ in range(reps))
    return 2 * (team - 1) / team * nbytes / (ms * 1e-3)


def comm_floor_ms(cfg, layout: Layout, busbw: float, train: bool) -> float:
    """The plan's bytes over tp (forward; and backward in a training step) at
    the measured bus bandwidth, without overlap. The dp sum of the gradients is
    not counted (it can overlap the next step's forward, as DDP does)."""
    colls = forward_collectives(cfg, layout) + (backward_collectives(cfg, layout) if train else [])
    return sum(c.wire_bytes_per_rank for c in colls if c.axis == "tp") / busbw * 1e3


def kernel_summary(kernels: list[tuple], calls: int, median_ms: float, top: int = 6) -> dict:
    """What a call's time goes to: `kernels` are (name, microseconds[, start
    microseconds]) of every GPU activity over `calls` calls; median_ms the call's
    timed median. The GPU is idle for the rest (launches, host work, waits): a
    launch-bound call has much of it. With starts, the idle GPU time before each
    activity (after the one that ended last) is added up by its name: where
    the GPU waits ("idle_before_ms_per_call", the largest three; the wait
    before the very first activity profiled is not seen)."""
    per_name: dict[str, float] = {}
    count: dict[str, int] = {}
    for name, us, *_ in kernels:
        per_name[name] = per_name.get(name, 0.0) + us
        count[name] = count.get(name, 0) + 1
    busy = sum(k[1] for k in kernels) / calls / 1e3
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])   # the longest first
    summary = {"kernels_per_call": len(kernels) / calls, "kernel_ms_per_call": busy,
               "idle_ms_per_call": max(0.0, median_ms - busy),
               "top_kernels_ms_per_call": [[name[:100], us / calls / 1e3] for name, us in ranked[:top]],
               # every activity: [name, ms per call, launches per call]
               "kernels": [[name[:100], us / calls / 1e3, count[name] / calls] for name, us in ranked]}
    if kernels and len(kernels[0]) > 2:
        before: dict[str, float] = {}
        ordered = sorted(kernels, key=lambda k: k[2])
        ended = ordered[0][2] + ordered[0][1]
        for name, us, start in ordered[1:]:
            before[name] = before.get(name, 0.0) + max(0.0, start - ended)   # streams may overlap: no gap then
            ended = max(ended, start + us)
        worst = sorted(before.items(), key=lambda kv: -kv[1])[:3]
        summary["idle_before_ms_per_call"] = [[name[:100], us / calls / 1e3] for name, us in worst]
    return summary


# NCCL's kernels by the collective in their name (ncclDevKernel_AllGather_RING_LL, ..._SendRecv);
# the copy engine's copies between GPUs are CUPTI's "Memcpy PtoP (Device -> Device)".
NCCL_KINDS = ("allreduce", "allgather", "reducescatter", "sendrecv")


def comm_kind(name: str) -> str | None:
    """The communication a GPU activity is, by its name: one of NCCL_KINDS (an
    NCCL kernel of another collective: "nccl"), "copyengine", or None (compute)."""
    low = name.lower().replace("_", "")
    if "memcpy ptop" in low:
        return "copyengine"
    if "nccl" not in low:
        return None
    return next((kind for kind in NCCL_KINDS if kind in low), "nccl")


def _merged(spans) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _alone(a: float, b: float, busy: list[list[float]]) -> float:
    """The part of [a, b] outside the merged spans `busy`."""
    return (b - a) - sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)


def exposed_comm(kernels: list[tuple], calls: int) -> dict:
    """Each kind of communication among profile_kernels' activities (comm_kind),
    per call: its GPU time (ms_per_call), how many (count_per_call), and the part
    of its time with no compute activity beside it (exposed_ms_per_call, on any
    stream); "total": the union of all of them. An NCCL kernel's time includes
    its wait for the other ranks: a rank that reaches a collective first shows
    the others' lateness as exposed time."""
    compute = _merged((start, start + us) for name, us, start in kernels if comm_kind(name) is None)
    out: dict[str, dict] = {}
    for name, us, start in kernels:
        if (kind := comm_kind(name)) is None:
            continue
        row = out.setdefault(kind, {"ms_per_call": 0.0, "exposed_ms_per_call": 0.0, "count_per_call": 0.0})
        row["ms_per_call"] += us / calls / 1e3
        row["exposed_ms_per_call"] += _alone(start, start + us, compute) / calls / 1e3
        row["count_per_call"] += 1 / calls
    comm = _merged((start, start + us) for name, us, start in kernels if comm_kind(name) is not None)
    out["total"] = {"ms_per_call": sum(b - a for a, b in comm) / calls / 1e3,
                    "exposed_ms_per_call": sum(_alone(a, b, compute) for a, b in comm) / calls / 1e3}
    return out


def profile_kernels(fn, calls: int) -> list[tuple[str, float, float]]:
    """(name, microseconds, start microseconds) of the GPU activities (kernels,
    copies, fills) of `calls` calls of fn (torch.profiler)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us(), e.time_range.start) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def profile_launches(fn, calls: int) -> list[tuple]:
    """(kernel name, op, op id, input shapes, dtypes) of each GPU activity of
    `calls` calls of fn, in start order: the ATen op that launched it, as the
    profiler links them (as its key_averages does), recorded with shapes; op
    None where no op launched it (a graph replay, nvFuser's own launches). A
    pass of its own: recording ops and shapes costs host time, which would
    widen the timed pass's gaps (profile_kernels)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return linked_launches(prof.profiler.kineto_results.events())


def linked_launches(events) -> list[tuple]:
    """profile_launches' records from the profiler's kineto events: each GPU
    activity with the CPU op whose correlation id is its linked one."""
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    ops = {}
    for e in events:   # CUDA's own host calls (cudaLaunchKernel, cuLaunchKernel) number theirs apart: not ops
        if e.device_type() == cpu and not e.is_async() and not re.match(r"cu(da)?[A-Z]", e.name()):
            ops[e.correlation_id()] = e
    out = []
    for e in sorted((e for e in events if e.device_type() == gpu), key=lambda e: e.start_ns()):
        op = ops.get(e.linked_correlation_id()) if e.linked_correlation_id() > 0 else None
        out.append((e.name(), op.name() if op else None, e.linked_correlation_id() if op else None,
                    [list(s) for s in op.shapes()] if op else None, list(op.dtypes()) if op else None))
    return out
