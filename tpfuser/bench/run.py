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
implementation left the allocator holding (reserved, from an emptied cache).
More peers a user would pick, by --impl: compile-max-autotune (torch.compile's
max-autotune mode, its CUDA graphs too), thunder and thunder-graph (Thunder with
its nvFuser executor, and its CUDA-graph transform: bench/thunder_peer.py, an
optional extra, skipped in one line where it is not installed).

--profile: what each call's time goes to, kernel by kernel, against what its
work takes at the rates measured here, and the GPU's idle gaps between kernels
(bench/roofline.py); on a mesh, each rank's communication from its own trace,
by kind, and the part of it no compute ran beside (measure.exposed_comm).
Each rank's median is kept beside the slowest rank's samples' (median_ms_by_rank)."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from tpfuser.bench.impls import check_impls, default_impls, forward_fns, train_fns, unavailable
from tpfuser.bench.measure import (CALLS_PER_SAMPLE, allreduce_busbw, comm_floor_ms, copy_bandwidth,
                                   exposed_comm, failure, kernel_summary, matmul_rate, profile_kernels,
                                   profile_launches, sample)
from tpfuser.bench.report import add_ratios
from tpfuser.bench.roofline import roofline
from tpfuser.bench.thunder_peer import THUNDER_IMPLS, thunder_note
from tpfuser.config import Layout, preset
from tpfuser.parallel.collectives import forward_collectives
from tpfuser.parallel.placements import forward_flops, placements
from tpfuser.parallel.schedules import default_schedule, load_schedule
from tpfuser.parallel.shard import local_slice
from tpfuser.verify.reference import make_block, make_input


def _every_rank(value, world: int) -> list:
    """Each rank's value (any picklable), in rank order; every rank calls it alike."""
    if world == 1:
        return [value]
    every: list = [None] * world
    dist.all_gather_object(every, value)
    return every


def _slowest_rank(every: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per implementation and sample, the largest time over the ranks (a step
    takes as long as its slowest rank); an implementation that failed on some
    rank is left out. every: each rank's times (_every_rank)."""
    return {name: [max(rank[name][i] for rank in every) for i in range(len(samples))]
            for name, samples in every[0].items() if all(name in rank for rank in every)}


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
    skipped = {impl: why for impl in impls if (why := unavailable(impl))}   # an optional peer not installed
    impls = tuple(impl for impl in impls if impl not in skipped)
    if not impls:
        raise RuntimeError("nothing to time: " + "; ".join(f"{impl}: {why}" for impl, why in skipped.items()))
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
        fns, memory, failed = train_fns(cfg, ref, x, impls, layout, rank, groups, schedule, announce=phase)
        ctx = torch.enable_grad()
    warm = {"built_s": time.perf_counter() - began, "each_s": {}}   # (the training steps' first calls are built's)
    with ctx:
        for name, fn in list(fns.items()):
            if not train:   # (a training step's warm-up is train_fns', announced there)
                phase(f"warming up {name}")   # a compile that never ends shows whose it is
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
        launches = {name: profile_launches(fn, CALLS_PER_SAMPLE) for name, fn in fns.items()} if profile else {}
    by_rank = _every_rank(times, layout.world_size)
    times = _slowest_rank(by_rank)
    # Each rank's communication from its own trace (rank 0's kernels are the profile's)
    comm_by_rank = _every_rank({name: exposed_comm(k, CALLS_PER_SAMPLE) for name, k in kernels.items()},
                               layout.world_size)
    phase("the floor's matmul rate")
    rate = matmul_rate(cfg)
    bandwidth = copy_bandwidth()
    # Matmul FLOPs per GPU of the block's work (its global FLOPs over dp * tp);
    # a backward does two matmuls for each of the forward's.
    per_pass = 3 if train else 1
    flops = forward_flops(cfg, layout)["total"] * per_pass
    floor_ms = flops / rate * 1e3
    # The floor's FLOPs by kind, counted as the floor counts them, for each kind's kernels (roofline)
    attention = forward_flops(cfg, layout)["attention"] * per_pass
    kind_flops = {"gemm": flops - attention, "attention": attention}
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"median_ms": med, "min_ms": min(ts), "max_ms": max(ts), "runs": len(ts),
                      "host_ms": statistics.median(host[name]),   # this rank's
                      "tflops": flops / (med * 1e-3) / 1e12, "fraction_of_matmul_rate": floor_ms / med,
                      "median_ms_by_rank": [statistics.median(rank[name]) for rank in by_rank]}
    best_peer = add_ratios(rows)
    for name in rows:   # (an implementation that failed on another rank has no row)
        rows[name].update(memory.get(name, {}))
        if name in kernels:
            rows[name]["profile"] = kernel_summary(kernels[name], CALLS_PER_SAMPLE, rows[name]["median_ms"])
            rows[name]["profile"]["roofline"] = roofline(kernels[name], launches[name], CALLS_PER_SAMPLE, rate,
                                                         bandwidth, kind_flops)
            rows[name]["profile"]["comm_by_rank"] = [rank.get(name) for rank in comm_by_rank]
    rep = {"preset": preset_name, "config": cfg.__dict__, "pass": "forward+backward" if train else "forward",
           "mesh": f"{layout.dp}x{layout.tp}", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "timing": f"CUDA events over {CALLS_PER_SAMPLE} back-to-back calls per sample, {iters} interleaved "
                     f"samples each" + (", the slowest rank's" if layout.world_size > 1 else "")
                     + "; host_ms: the median time to issue a call (rank 0's); the graphed implementations copy "
                     "the input into their graph's buffer each call, but eager-graph, captured on it",
           "matmul_tflops_measured": rate / 1e12, "copy_gbps_measured": bandwidth / 1e9, "matmul_gflop": flops / 1e9,
           "compute_floor_ms": floor_ms, "best_peer": best_peer, "results": rows, "failed": failed,
           "skipped": skipped,
           "warmup_s": warm,
           "schedule": schedule.as_dict()}
    if any(impl in rows for impl in THUNDER_IMPLS):   # (Thunder imported: one of its peers ran)
        rep["thunder"] = thunder_note()
    if schedule.chunked() and torch.cuda.device_count() < layout.world_size:
        rep["note"] = ("ranks share a GPU: the times say what chunking costs the GEMMs at a rank's shapes, "
                       "not what overlap gains")
    if layout.tp > 1:
        busbw = allreduce_busbw(forward_collectives(cfg, layout)[0].tensor_bytes, groups.tp, layout.tp)
        rep["allreduce_busbw_gbps"] = busbw / 1e9
        rep["comm_floor_ms"] = comm_floor_ms(cfg, layout, busbw, train)
    return rep
