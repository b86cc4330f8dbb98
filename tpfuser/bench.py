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
(tpfuser/peers.py). In a training step with dp > 1 every implementation sums
its parameter gradients over dp (world.sum_over_group, as DDP would).

Each is also timed replayed from a CUDA graph: nvfuser-graph (tpfuser.graphs,
new masks each replay), eager-graph (eager captured by hand) and
compile-reduce-overhead (torch.compile's CUDA-graph mode); the table gives each
implementation's ratio to eager and to the fastest peer (benchreport.add_ratios),
and in a training step the memory a graph's pool holds and what every
implementation left the allocator holding (reserved, from an emptied cache).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tpfuser.benchreport import WORK_ONLY, add_ratios, format_table, validate_report
from tpfuser.commlog import error_line
from tpfuser.config import Layout, preset
from tpfuser.meshcheck import environment
from tpfuser.plan import backward_collectives, collectives, forward_flops, placements
from tpfuser.reference import make_block, make_input, sdpa_forward
from tpfuser.shard import local_slice

# WORK_ONLY (benchreport): not implementations of the block but parts of its
# work, timed in the same loop (--impl only; one GPU, forward): what the floor's
# GEMMs and attention take under the conditions the block runs in (the floor
# itself is measured apart, after the loop: matmul_rate). Never a peer.
IMPLS = ("nvfuser", "nvfuser-split", "nvfuser-graph", "nvfuser-graph-fm", "nvfuser-graph-split",
         "nvfuser-nomesh",
         "eager", "eager-graph", "compile", "compile-reduce-overhead", "dtensor", *WORK_ONLY)
# Replayed from a CUDA graph: nvfuser-graph* (tpfuser.graphs), eager-graph (eager
# captured by hand) and compile-reduce-overhead (torch.compile's own CUDA-graph
# mode). Asked for by --impl only: nvfuser-graph-fm, nvfuser-graph with
# nvFuser's own matmul kernels (fuse_matmul), their neighbours' pointwise work
# fused in, where ATen's run otherwise; *-split, the block split over a mesh
# axis of one device too (collectives over a team of one: fusion.schedule; the
# default until run 30, timed as *-unsplit's counterpart in runs 25-29).
NVFUSER_CALLED = {"nvfuser": {}, "nvfuser-split": {"split_unit_axes": True},
                  "nvfuser-nomesh": {"mesh": False}}                    # impl: ShardedBlock's options
NVFUSER_GRAPHED = {"nvfuser-graph": {}, "nvfuser-graph-fm": {"enable": ("fuse_matmul",)},
                   "nvfuser-graph-split": {"split_unit_axes": True}}


def default_impls(layout: Layout) -> tuple[str, ...]:
    """What a user would compare on this mesh: each called and replayed from a
    CUDA graph; the fusion without a mesh on one GPU; DTensor's tensor
    parallelism where tp > 1."""
    if layout.world_size == 1:
        return ("nvfuser", "nvfuser-graph", "nvfuser-nomesh", "eager", "eager-graph", "compile",
                "compile-reduce-overhead")
    return ("nvfuser", "nvfuser-graph", "eager", "eager-graph", "compile", "compile-reduce-overhead") + \
        (("dtensor",) if layout.tp > 1 else ())


def check_impls(impls, layout: Layout, train: bool = False) -> None:
    for impl in impls:
        if impl not in IMPLS:
            raise ValueError(f"implementation {impl!r}: must be one of {IMPLS}")
        if impl == "dtensor" and layout.tp == 1:
            raise ValueError("implementation 'dtensor': needs tp > 1 (DTensor's tensor parallelism "
                             "over several GPUs; --tp N)")
        if impl in WORK_ONLY and (layout.world_size > 1 or train):
            raise ValueError(f"implementation {impl!r}: the block's forward work on one GPU only, "
                             f"not {'a training step' if train else f'a {layout.dp}x{layout.tp} mesh'}")
        if impl == "nvfuser-nomesh" and layout.world_size > 1:
            raise ValueError(f"implementation 'nvfuser-nomesh': one GPU only, the mesh is {layout.dp}x{layout.tp}")
# Each timing sample is this many back-to-back calls (throughput, as a
# training loop sees it); samples of the implementations are interleaved.
CALLS_PER_SAMPLE = 10


def failure(e: BaseException) -> str:
    """One line for an implementation that failed; a failed CUDA-graph capture
    raises its own error over the cause, which follows it."""
    line = f"{type(e).__name__}: {error_line(e)}"
    return line + (f" (after {type(e.__context__).__name__}: {error_line(e.__context__)})" if e.__context__ else "")


def _sample(fn, start, end, calls: int = 1) -> tuple[float, float]:
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


def _time(fn, start, end, calls: int = 1) -> float:
    """GPU ms per call over `calls` back-to-back calls."""
    return _sample(fn, start, end, calls)[0]


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
    times = [_time(run, start, end) for _ in range(reps)]
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
    ms = statistics.median(_time(lambda: b.copy_(a), start, end) for _ in range(reps))
    return 2 * nbytes / (ms * 1e-3)


def allreduce_busbw(nbytes: int, group, team: int, reps: int = 20) -> float:
    """All-reduce bus bandwidth over `group`, bytes/s: a ring all-reduce sends
    2 (n-1)/n of the tensor per rank, so time = that / bandwidth (nccl-tests' busbw)."""
    import torch.distributed as dist
    t = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        dist.all_reduce(t, group=group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = statistics.median(_time(lambda: dist.all_reduce(t, group=group), start, end) for _ in range(reps))
    return 2 * (team - 1) / team * nbytes / (ms * 1e-3)


def comm_floor_ms(cfg, layout: Layout, busbw: float, train: bool) -> float:
    """The plan's bytes over tp (forward; and backward in a training step) at
    the measured bus bandwidth, without overlap. The dp sum of the gradients is
    not counted (it can overlap the next step's forward, as DDP does)."""
    colls = collectives(cfg, layout) + (backward_collectives(cfg, layout) if train else [])
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


def profile_kernels(fn, calls: int) -> list[tuple[str, float, float]]:
    """(name, microseconds, start microseconds) of the GPU activities (kernels,
    copies, fills) of `calls` calls of fn (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us(), e.time_range.start) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def _slowest_rank(times: dict[str, list[float]], world: int) -> dict[str, list[float]]:
    """Per implementation and sample, the largest time over the ranks (a step
    takes as long as its slowest rank); an implementation that failed on some
    rank is left out."""
    if world == 1:
        return times
    import torch.distributed as dist
    every: list = [None] * world
    dist.all_gather_object(every, times)
    return {name: [max(rank[name][i] for rank in every) for i in range(len(times[name]))]
            for name in times if all(name in rank for rank in every)}


def bench(preset_name: str = "nanogpt", impls=None, iters: int = 100, warmup: int = 20, dropout=None,
          progress: bool = True, train: bool = False, layout: Layout = Layout(), rank: int = 0, groups=None,
          profile: bool = False) -> dict:
    """Time the implementations on this rank; with dp * tp > 1, under a launcher,
    torch.distributed initialized and `groups` from world.rank_groups. profile:
    also say what each call's time goes to (kernel_summary, rank 0's)."""
    overrides = {"dtype": "bf16"} | ({} if dropout is None else {"dropout": dropout})
    cfg = preset(preset_name, **overrides)
    layout.check(cfg)
    impls = tuple(impls or default_impls(layout))
    check_impls(impls, layout, train)
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarking needs a CUDA GPU")
    ref = make_block(cfg, dtype=torch.bfloat16, device="cuda")
    x = local_slice(make_input(cfg, dtype=torch.bfloat16, device="cuda"), placements(layout)["x"], layout, rank)
    memory, failed = {}, {}

    def phase(what):   # its start, on the clock a GPU monitor's samples carry (nvidia-smi's timestamp)
        if progress:
            print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)
    phase("building and warming up")
    if not train:
        fns = _forward_fns(cfg, ref, x, impls, layout, rank, groups)
        ctx = torch.no_grad()
    else:
        fns, memory, failed = _train_fns(cfg, ref, x, impls, layout, rank, groups)
        ctx = torch.enable_grad()
    with ctx:
        for name, fn in list(fns.items()):
            try:
                for _ in range(warmup):
                    fn()
            except Exception as e:  # e.g. nvFuser failing to compile: report it, time the others
                failed[name] = failure(e)
                del fns[name]
        torch.cuda.synchronize()
        phase(f"timing: {iters} rounds of {', '.join(fns)}")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = {name: [] for name in fns}
        host = {name: [] for name in fns}
        t0 = time.time()
        for i in range(iters):  # interleaved: every implementation once per round
            for name, fn in fns.items():
                gpu_ms, host_ms = _sample(fn, start, end, CALLS_PER_SAMPLE)
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
           "compute_floor_ms": floor_ms, "best_peer": best_peer, "results": rows, "failed": failed}
    if layout.tp > 1:
        busbw = allreduce_busbw(collectives(cfg, layout)[0].bytes_per_rank, groups.tp, layout.tp)
        rep["allreduce_busbw_gbps"] = busbw / 1e9
        rep["comm_floor_ms"] = comm_floor_ms(cfg, layout, busbw, train)
    return rep


def _step_offsets():
    """A new dropout offset for each call, as a training loop's step counter."""
    return itertools.cycle(range(100_000))


def _reduce_overhead(ref, x, p):
    """The reference block's forward under torch.compile's CUDA-graph mode; each
    call marked a new step for its graph trees (no earlier step's outputs or
    pending backward kept)."""
    reduced = torch.compile(sdpa_forward, mode="reduce-overhead")

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        return reduced(ref, x, p)
    return call


def _forward_fns(cfg, ref, x, impls, layout, rank, groups):
    fns = {}
    for impl, options in NVFUSER_CALLED.items():
        if impl in impls:
            from tpfuser.runtime import ShardedBlock
            nv = ShardedBlock(cfg, layout, rank, **options).load(ref.state_dict())
            fns[impl] = lambda nv=nv, steps=_step_offsets(): nv(x, 1234, next(steps))["out"]
    for impl, options in NVFUSER_GRAPHED.items():
        if impl in impls:
            from tpfuser.graphs import GraphedForward
            from tpfuser.runtime import ShardedBlock
            block = ShardedBlock(cfg, layout, rank, keys_on_device=True, **options).load(ref.state_dict())
            fns[impl] = lambda graphed=GraphedForward(block), steps=_step_offsets(): \
                graphed(x, 1234, next(steps))["out"]
    if "eager" in impls:
        fns["eager"] = lambda: sdpa_forward(ref, x, cfg.dropout)
    if "eager-graph" in impls:
        fns["eager-graph"] = graphed_callable(lambda: sdpa_forward(ref, x, cfg.dropout))
    if "compile" in impls:
        compiled = torch.compile(sdpa_forward)
        fns["compile"] = lambda: compiled(ref, x, cfg.dropout)
    if "compile-reduce-overhead" in impls:
        fns["compile-reduce-overhead"] = _reduce_overhead(ref, x, cfg.dropout)
    if "dtensor" in impls:
        from tpfuser.peers import dtensor_block
        block = dtensor_block(ref, groups.tp_mesh)
        fns["dtensor"] = lambda: sdpa_forward(block, x, cfg.dropout, heads_interleaved=True)
    for impl in WORK_ONLY:
        if impl in impls:
            fns[impl] = _work_fn(cfg, ref, attention=impl == "gemms+attention")
    return fns


def _work_fn(cfg, ref, attention: bool):
    """The block's four linears alone (the floor's GEMM shapes, on the block's
    weights, no bias, and random activations), and with `attention` its
    causal attention too (SDPA with the block's dropout, on random q, k, v):
    work every implementation runs, whatever else it fuses or not."""
    b, s, h, d = cfg.batch, cfg.seq, cfg.n_head, cfg.head_dim
    linears = [ref.attn.c_attn, ref.attn.c_proj, ref.mlp.c_fc, ref.mlp.c_proj]
    gen = torch.Generator("cuda").manual_seed(1)
    acts = [torch.randn(b * s, lin.in_features, device="cuda", dtype=torch.bfloat16, generator=gen) for lin in linears]
    qkv = torch.randn(3, b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    def run():
        for lin, a in zip(linears, acts):
            F.linear(a, lin.weight)
        if attention:
            F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], dropout_p=cfg.dropout, is_causal=True)
    return run


class graphed_callable:
    """fn captured in a CUDA graph at the first call (after warm-up on a side
    stream), replayed after: eager PyTorch as a user would graph it by hand.
    Its dropout draws new masks each replay (PyTorch's philox is graph-safe).
    pool_bytes: what the capture reserved."""

    def __init__(self, fn):
        self.fn, self.graph, self.pool_bytes = fn, None, 0

    def __call__(self):
        if self.graph is None:
            from tpfuser.graphs import clear_cublas_workspaces, warm_up
            warm_up(self.fn, times=3)
            before = torch.cuda.memory_reserved()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.fn()
            clear_cublas_workspaces()
            self.pool_bytes = torch.cuda.memory_reserved() - before
        self.graph.replay()


def _train_fns(cfg, ref, x, impls, layout, rank, groups):
    """One training step each (forward, backward, parameter gradients summed
    over dp when dp > 1, then dropped), and its peak memory and saved-activation bytes."""
    from tpfuser.runtime import TPBlock
    from tpfuser.world import sum_over_group
    grad = torch.randn_like(x)
    x = x.detach().requires_grad_(True)   # as inside a model: every implementation computes the input's gradient
    fns, memory, forwards, failed = {}, {}, {}, {}
    for impl, options in NVFUSER_CALLED.items():
        if impl in impls:
            model = TPBlock(cfg, layout, rank, dp_group=groups.dp if groups else None, **options)
            model.load_full_state_dict(ref.state_dict())
            forwards[impl] = (lambda m=model: m(x), list(model.parameters()), False)   # its backward sums over dp
    params = list(ref.parameters())
    if "eager" in impls:
        forwards["eager"] = (lambda: sdpa_forward(ref, x, cfg.dropout), params, True)
    if "compile" in impls:
        compiled = torch.compile(sdpa_forward)
        forwards["compile"] = (lambda: compiled(ref, x, cfg.dropout), params, True)
    if "compile-reduce-overhead" in impls:
        forwards["compile-reduce-overhead"] = (_reduce_overhead(ref, x, cfg.dropout), params, True)
    if "dtensor" in impls:
        from tpfuser.peers import dtensor_block
        block = dtensor_block(ref, groups.tp_mesh)
        forwards["dtensor"] = (lambda: sdpa_forward(block, x, cfg.dropout, heads_interleaved=True), list(block.parameters()), True)
    for impl, (fwd, ps, sum_dp) in forwards.items():
        def step(fwd=fwd, ps=ps, sum_dp=sum_dp and layout.dp > 1):
            fwd().backward(grad)
            if sum_dp:
                local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in ps]
                sum_over_group(local, groups.dp)
            for p in ps:
                p.grad = None
            x.grad = None
        try:
            memory[impl] = _warm_then_memory(step)
        except Exception as e:  # e.g. nvFuser failing to compile: report it, time the others
            failed[impl] = failure(e)
            continue
        if impl != "compile-reduce-overhead":   # a forward left without its backward upsets its graph trees
            memory[impl]["saved_activation_mib"] = saved_activation_bytes(fwd, ps) / 2**20
        fns[impl] = step
    graphed = _graphed_train_fns(cfg, ref, x, grad, impls, layout, rank, groups)
    for impl, (step, pool) in graphed.items():
        try:
            memory[impl] = {**_warm_then_memory(step), "graph_pool_mib": pool() / 2**20}
        except Exception as e:
            failed[impl] = failure(e)
            continue
        fns[impl] = step
    return fns, memory, failed


def _warm_then_memory(step) -> dict[str, float]:
    """Three steps to warm up (compiles and captures included), then one more,
    in MiB: its peak allocated above what was allocated before it (a graph
    replays inside a pool made before: 0), and what the four steps left the
    caching allocator reserving, from an emptied cache: the one figure every
    implementation has, graph pools (torch.compile's reduce-overhead's too) and
    a called step's transients alike. cuBLAS's per-stream workspaces are
    cleared first, so each implementation pays for its own (torch.compile's
    reduce-overhead clears them around its capture); NCCL's buffers are outside
    the allocator and not counted."""
    from tpfuser.graphs import clear_cublas_workspaces
    torch.cuda.synchronize()
    clear_cublas_workspaces()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return {"peak_mib_above_baseline": (torch.cuda.max_memory_allocated() - base) / 2**20,
            "reserved_mib": (torch.cuda.memory_reserved() - reserved) / 2**20}


def _graphed_train_fns(cfg, ref, x, grad, impls, layout, rank, groups):
    """Training steps replayed from one CUDA graph each: {impl: (step, graph pool bytes)}.
    Gradients summed over dp after the replay where dp > 1 (a gloo group)."""
    from tpfuser.world import sum_over_group
    out = {}
    for impl, options in NVFUSER_GRAPHED.items():
        if impl in impls:
            from tpfuser.graphs import GraphedTrainStep
            from tpfuser.runtime import ShardedBlock
            block = ShardedBlock(cfg, layout, rank, keys_on_device=True, dp_group=groups.dp if groups else None,
                                 **options)
            graphed = GraphedTrainStep(block.load(ref.state_dict()))
            out[impl] = (lambda graphed=graphed, steps=_step_offsets(): graphed(x.detach(), grad, 1234, next(steps)),
                         lambda graphed=graphed: graphed.pool_bytes)
    if "eager-graph" in impls:
        import copy
        own = copy.deepcopy(ref)   # its gradients stay the graph's: the other steps set theirs to None
        params = list(own.parameters())
        x_own = x.detach().clone().requires_grad_(True)   # the input's gradient too, as the others

        def whole_step():   # the gradients made, not accumulated
            for t in (*params, x_own):
                t.grad = None
            sdpa_forward(own, x_own, cfg.dropout).backward(grad)
        captured = graphed_callable(whole_step)

        def step():
            captured()
            if layout.dp > 1:
                sum_over_group([p.grad for p in params], groups.dp)
        out["eager-graph"] = (step, lambda: captured.pool_bytes)
    return out


def add_arguments(ap) -> None:
    """bench's options, on its own parser (python -m tpfuser.bench) or tpfuser's subparser."""
    ap.add_argument("--preset", default="nanogpt")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--impl", default=None, help=f"comma-separated, of {','.join(IMPLS)} (default: what the mesh allows)")
    ap.add_argument("--iters", type=int, default=100, help="samples per implementation")
    ap.add_argument("--dropout", type=float, default=None)
    ap.add_argument("--train", action="store_true", help="forward+backward (a training step) instead of forward")
    ap.add_argument("--profile", action="store_true", help="also what each call's time goes to (GPU kernels, idle)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="also plot the report here")
    ap.add_argument("--share-gpu", action="store_true",
                    help="run dp*tp ranks on fewer GPUs: to see it run, not for speed (the ranks time-share a GPU)")


def bench_command(argv: list[str]) -> str:
    """The command line that ran this process, as its user typed it: `python3 -m
    tpfuser.bench ...` when this module was run, else `tpfuser ...` (the CLI)."""
    if argv and os.path.basename(argv[0]) == "bench.py":
        return "python3 -m tpfuser.bench " + " ".join(argv[1:])
    return "tpfuser " + " ".join(argv[1:])


def main(argv=None) -> int:
    from tpfuser.cli import ArgParser
    argv = sys.argv[1:] if argv is None else argv
    ap = ArgParser(prog="tpfuser bench")
    add_arguments(ap)
    return run(ap.parse_args(argv), argv)


def run(args, argv) -> int:
    """The benchmark of parsed options; argv, bench's own, is what ranks relaunch with."""
    from tpfuser.cli import check_writable
    rank, groups = 0, None
    impls = args.impl.split(",") if args.impl else None
    try:
        # Everything that can be refused, before the benchmark: its results must not be lost to a bad path.
        layout = Layout(args.dp, args.tp)
        if args.iters < 1:
            raise ValueError(f"--iters={args.iters}: must be a positive int (samples per implementation)")
        cfg = preset(args.preset, dtype="bf16", **({} if args.dropout is None else {"dropout": args.dropout}))
        layout.check(cfg)
        check_impls(impls or (), layout, args.train)
        check_writable(args.json, "--json")
        check_writable(args.png, "--png")
        from tpfuser.world import check_launch, in_launcher
        check_launch(layout)
        if layout.world_size > 1:
            from tpfuser.launch import relaunch
            from tpfuser.world import init_rank, rank_groups
            if not in_launcher():   # one rank per GPU under torchrun, or a clear refusal
                return relaunch(layout, ["bench", *argv], share_gpu=args.share_gpu)
            rank = init_rank(layout)
            groups = rank_groups(layout, rank)
        rep = bench(args.preset, impls, args.iters, dropout=args.dropout, train=args.train, layout=layout,
                    rank=rank, groups=groups, progress=rank == 0, profile=args.profile)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rank != 0:   # every rank timed; rank 0 holds the slowest rank's samples and reports
        return 0
    from tpfuser.sharegpu import SHARED_GPU_MARK
    rep["gpus_shared"] = int(os.environ.get(SHARED_GPU_MARK, "0"))   # > 0: timings are not speed figures
    rep["environment"] = environment(bench_command(sys.argv))          # date, versions, command, commit
    validate_report(rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    if args.png:
        from tpfuser.plot import plot_reports
        plot_reports([rep], args.png)
    print(format_table(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
