"""Benchmark of the block, forward or a training step: nvFuser against eager
PyTorch, torch.compile and (tp > 1) DTensor tensor parallelism, interleaved,
CUDA-event timed, with the compute floor (matmul FLOPs per GPU over the bf16
matmul rate measured in the same run) and, with tp > 1, the communication
floor (the plan's bytes over the all-reduce bus bandwidth measured over tp).

    tpfuser bench --preset nanogpt --json out.json          # one GPU
    tpfuser bench --preset gpt3 --tp 8 --json out.json      # runs itself under torchrun, a rank per GPU

On a dp x tp mesh every rank times its share; a sample is the slowest rank's.
eager and compile run the whole block on the rank's b/dp rows (no tensor
parallelism); dtensor is the reference block parallelized by PyTorch over tp
(tpfuser/bench/peers.py). In a training step with dp > 1 every implementation sums
its parameter gradients over dp (world.sum_over_group, as DDP would).

Each is also timed replayed from a CUDA graph: nvfuser-graph (tpfuser.runtime.graphs,
new masks each replay), eager-graph (eager captured by hand) and
compile-reduce-overhead (torch.compile's CUDA-graph mode); the table gives each
implementation's ratio to eager and to the fastest peer (report.add_ratios),
and in a training step the memory a graph's pool holds and what every
implementation left the allocator holding (reserved, from an emptied cache)."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from tpfuser.bench.impls import check_impls, default_impls, forward_fns, train_fns
from tpfuser.bench.measure import (CALLS_PER_SAMPLE, allreduce_busbw, comm_floor_ms, copy_bandwidth, failure,
                                   kernel_summary, matmul_rate, profile_kernels, sample)
from tpfuser.bench.report import add_ratios
from tpfuser.config import Layout, preset
from tpfuser.parallel.placements import collectives, forward_flops, placements
from tpfuser.parallel.schedules import default_schedule, load_schedule
from tpfuser.parallel.shard import local_slice
from tpfuser.verify.reference import make_block, make_input


def _slowest_rank(times: dict[str, list[float]], world: int) -> dict[str, list[float]]:
    """Per implementation and sample, the largest time over the ranks (a step
    takes as long as its slowest rank); an implementation that failed on some
    rank is left out."""
    if world == 1:
        return times
    every: list = [None] * world
    dist.all_gather_object(every, times)
    return {name: [max(rank[name][i] for rank in every) for i in range(len(times[name]))]
            for name in times if all(name in rank for rank in every)}


def bench(preset_name: str = "nanogpt", impls=None, iters: int = 100, warmup: int = 20, dropout=None,
          progress: bool = True, train: bool = False, layout: Layout = Layout(), rank: int = 0, groups=None,
          profile: bool = False, schedule=None) -> dict:
    """Time the implementations on this rank; with dp * tp > 1, under a launcher,
    torch.distributed initialized and `groups` from world.rank_groups. profile:
    also say what each call's time goes to (kernel_summary, rank 0's)."""
    overrides = {"dtype": "bf16"} | ({} if dropout is None else {"dropout": dropout})
    cfg = preset(preset_name, **overrides)
    layout.check(cfg)
    schedule = default_schedule(layout) if schedule is None else load_schedule(schedule)
    schedule.check(cfg, layout)
    impls = tuple(impls or default_impls(layout))
    check_impls(impls, layout, train, schedule, cfg)
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarking needs a CUDA GPU")
    ref = make_block(cfg, dtype=torch.bfloat16, device="cuda")
    x = local_slice(make_input(cfg, dtype=torch.bfloat16, device="cuda"), placements(layout)["x"], layout, rank)
    memory, failed = {}, {}

    def phase(what):   # its start, on the clock a GPU monitor's samples carry (nvidia-smi's timestamp)
        if progress:
            print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)
    phase("building and warming up")
    began = time.perf_counter()
    if not train:
        fns = forward_fns(cfg, ref, x, impls, layout, rank, groups, schedule)
        ctx = torch.no_grad()
    else:
        fns, memory, failed = train_fns(cfg, ref, x, impls, layout, rank, groups, schedule)
        ctx = torch.enable_grad()
    warm = {"built_s": time.perf_counter() - began, "each_s": {}}   # (the training steps' first calls are built's)
    with ctx:
        for name, fn in list(fns.items()):
            began_one = time.perf_counter()
            try:
                for _ in range(warmup):
                    fn()
                torch.cuda.synchronize()
            except Exception as e:  # e.g. nvFuser failing to compile: report it, time the others
                failed[name] = failure(e)
                del fns[name]
            warm["each_s"][name] = time.perf_counter() - began_one
        torch.cuda.synchronize()
        warm["total_s"] = time.perf_counter() - began
        if progress:
            print(f"  warm-up {warm['total_s']:.1f} s: building {warm['built_s']:.1f}, then "
                  + ", ".join(f"{n} {t:.1f}" for n, t in warm["each_s"].items()), file=sys.stderr, flush=True)
        phase(f"timing: {iters} rounds of {', '.join(fns)}")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = {name: [] for name in fns}
        host = {name: [] for name in fns}
        t0 = time.time()
        for i in range(iters):  # interleaved: every implementation once per round
            for name, fn in fns.items():
                gpu_ms, host_ms = sample(fn, start, end, CALLS_PER_SAMPLE)
                times[name].append(gpu_ms)
                host[name].append(host_ms)
            if progress and (i + 1) % max(1, iters // 10) == 0:
                print(f"\r  {i + 1}/{iters} rounds ({time.time() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        if profile:
            phase("profiling")
        kernels = {name: profile_kernels(fn, CALLS_PER_SAMPLE) for name, fn in fns.items()} if profile else {}
    times = _slowest_rank(times, layout.world_size)
    phase("the floor's matmul rate")
    rate = matmul_rate(cfg)
    bandwidth = copy_bandwidth()
    # Matmul FLOPs per GPU of the block's work (its global FLOPs over dp * tp);
    # a backward does two matmuls for each of the forward's.
    flops = forward_flops(cfg, layout)["total"] * (3 if train else 1)
    floor_ms = flops / rate * 1e3
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"median_ms": med, "min_ms": min(ts), "max_ms": max(ts), "runs": len(ts),
                      "host_ms": statistics.median(host[name]),   # this rank's
                      "tflops": flops / (med * 1e-3) / 1e12, "fraction_of_matmul_rate": floor_ms / med}
    best_peer = add_ratios(rows)
    for name in rows:   # (an implementation that failed on another rank has no row)
        rows[name].update(memory.get(name, {}))
        if name in kernels:
            rows[name]["profile"] = kernel_summary(kernels[name], CALLS_PER_SAMPLE, rows[name]["median_ms"])
    rep = {"preset": preset_name, "config": cfg.__dict__, "pass": "forward+backward" if train else "forward",
           "mesh": f"{layout.dp}x{layout.tp}", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "timing": f"CUDA events over {CALLS_PER_SAMPLE} back-to-back calls per sample, {iters} interleaved "
                     f"samples each" + (", the slowest rank's" if layout.world_size > 1 else "")
                     + "; host_ms: the median time to issue a call (rank 0's)",
           "matmul_tflops_measured": rate / 1e12, "copy_gbps_measured": bandwidth / 1e9, "matmul_gflop": flops / 1e9,
           "compute_floor_ms": floor_ms, "best_peer": best_peer, "results": rows, "failed": failed,
           "warmup_s": warm,
           "schedule": schedule.as_dict()}
    if schedule.chunked() and torch.cuda.device_count() < layout.world_size:
        rep["note"] = ("ranks share a GPU: the times say what chunking costs the GEMMs at a rank's shapes, "
                       "not what overlap gains")
    if layout.tp > 1:
        busbw = allreduce_busbw(collectives(cfg, layout)[0].tensor_bytes, groups.tp, layout.tp)
        rep["allreduce_busbw_gbps"] = busbw / 1e9
        rep["comm_floor_ms"] = comm_floor_ms(cfg, layout, busbw, train)
    return rep
