"""The implementations the benchmark times, each a callable of one call (a
forward, or a training step): nvFuser's block under a schedule, called and
replayed from CUDA graphs, and its peers (eager PyTorch, torch.compile with and
without its CUDA graphs, DTensor's tensor parallelism and torch's async TP
(bench/peers.py), Thunder), all on the reference block's weights."""

from __future__ import annotations

import copy
import itertools
import os

import torch
import torch.nn.functional as F

from tpfuser.bench.measure import failure, saved_activation_bytes
from tpfuser.bench.peers import DTENSOR_IMPLS, dtensor_peers
from tpfuser.bench.report import WORK_ONLY
from tpfuser.bench.thunder_peer import THUNDER_IMPLS, thunder_forward, thunder_missing
from tpfuser.config import Layout
from tpfuser.dist.world import sum_over_group
from tpfuser.parallel.schedules import known_failure, load_schedule
from tpfuser.verify.reference import sdpa_forward
# Deferred: the runtime (tpfuser.runtime.block, .graphs, .module: nvFuser) is imported where a block is made:
# bench's refusals (bench/cli.py) come before any nvFuser import, which would abort the process at exit
# under a launcher without CUDA.


# WORK_ONLY (benchreport): not implementations of the block but parts of its
# work, timed in the same loop (--impl only; one GPU, forward): what the floor's
# GEMMs and attention take under the conditions the block runs in (the floor
# itself is measured apart, after the loop: matmul_rate). Never a peer.
IMPLS = ("nvfuser", "nvfuser-graph", "nvfuser-graph-fm", "nvfuser-nomesh",
         "eager", "eager-graph", "compile", "compile-reduce-overhead", "compile-max-autotune", *DTENSOR_IMPLS,
         *THUNDER_IMPLS, *WORK_ONLY)
# torch.compile's modes with its CUDA graphs (graph trees); max-autotune, by --impl only as
# Thunder's (bench/thunder_peer.py), also tunes its GEMM and Triton kernels at the first call.
GRAPH_TREES = {"compile-reduce-overhead": "reduce-overhead", "compile-max-autotune": "max-autotune"}

# nvFuser's block under the bench's schedule, called (NVFUSER_CALLED) and
# replayed from a CUDA graph (NVFUSER_GRAPHED; runtime/graphs.py), each with
# what it changes in that schedule. Asked for by --impl only: nvfuser-graph-fm, fuse_matmul on (nvFuser's
# matmul scheduler may take a linear with its neighbours where ATen's GEMM does not take it; a lone linear
# stays ATen's, and its compiles can take minutes: NOTES.md). eager-graph is eager captured by hand,
# compile-reduce-overhead torch.compile's own CUDA-graph mode.
NVFUSER_CALLED = {"nvfuser": {}, "nvfuser-nomesh": {"mesh": False}}
NVFUSER_GRAPHED = {"nvfuser-graph": {}, "nvfuser-graph-fm": {"enable_options": ("fuse_matmul",)}}


def split_impl(impl: str) -> tuple[str, str | None]:
    """("nvfuser-graph", "megatron-cut-linears") for "nvfuser-graph@megatron-cut-linears":
    an nvFuser implementation under a schedule of its own (a name or a JSON
    file), beside the bench's; (impl, None) without an @."""
    base, at, name = impl.partition("@")
    return base, (name if at else None)


def schedule_files(impls) -> list[str]:
    """The schedule files the implementations name after an @ (names of named schedules left out)."""
    return [own for own in (split_impl(impl)[1] for impl in impls) if own and os.path.isfile(own)]


def nvfuser_schedule(schedule, impl: str, graphed: bool = False):
    """The schedule an nvFuser implementation runs: the bench's (or the one its
    name gives after an @), changed as the implementation says."""
    impl, own = split_impl(impl)
    if own is not None:
        schedule = load_schedule(own)
    changes = (NVFUSER_GRAPHED if graphed else NVFUSER_CALLED)[impl]
    if "enable_options" in changes:
        changes = {"enable_options": (*schedule.enable_options, *changes["enable_options"])}
    return schedule.replace(**changes, **({"keys_on_device": True} if graphed else {}))


def default_impls(layout: Layout) -> tuple[str, ...]:
    """What a user would compare on this mesh: each called and replayed from a
    CUDA graph; the fusion without a mesh on one GPU; DTensor's tensor
    parallelism where tp > 1."""
    if layout.world_size == 1:
        return ("nvfuser", "nvfuser-graph", "nvfuser-nomesh", "eager", "eager-graph", "compile",
                "compile-reduce-overhead")
    return ("nvfuser", "nvfuser-graph", "eager", "eager-graph", "compile", "compile-reduce-overhead") + \
        (("dtensor",) if layout.tp > 1 else ())


def check_impls(impls, layout: Layout, train: bool = False, schedule=None, cfg=None) -> None:
    """Refuse an implementation the bench cannot time here, in one line naming it.
    schedule: the bench's; an nvFuser implementation's own (after an @) must
    put the block on the same mesh the same way (sequence-parallel or not),
    take the block (cfg) on it, and chunk its linears only where the bench's
    schedule does (CUDA_DEVICE_MAX_CONNECTIONS=1, set from the bench's, is the
    whole process's, every implementation's: runtime/chunked.py)."""
    twice = sorted({i for i in impls if list(impls).count(i) > 1})
    if twice:
        raise ValueError(f"implementation {twice[0]!r}: named twice in --impl (each is timed once, beside the others)")
    for impl in impls:
        base, own = split_impl(impl)
        if own is not None:
            if base not in {**NVFUSER_CALLED, **NVFUSER_GRAPHED}:
                raise ValueError(f"implementation {impl!r}: a schedule after @ is for an nvFuser implementation "
                                 f"({', '.join({**NVFUSER_CALLED, **NVFUSER_GRAPHED})}), not {base!r}")
            try:
                theirs = load_schedule(own)
            except (ValueError, OSError) as e:
                raise ValueError(f"implementation {impl!r}: {e}") from None
            if schedule is not None and theirs.sequence_parallel != schedule.sequence_parallel:
                said = {True: "sequence-parallel", False: "not sequence-parallel"}
                raise ValueError(f"implementation {impl!r}: its schedule is {said[theirs.sequence_parallel]}, "
                                 f"the bench's ({schedule.name}) {said[schedule.sequence_parallel]} (--sp): "
                                 f"the input would not be split alike")
            if schedule is not None and theirs.chunked() and not schedule.chunked():
                raise ValueError(f"implementation {impl!r}: its schedule chunks linears, the bench's does not: a "
                                 f"chunked schedule runs with CUDA_DEVICE_MAX_CONNECTIONS=1, set for the whole "
                                 f"process (every implementation's timing), from the bench's schedule: bench "
                                 f"--schedule {own} (the others then run with it too)")
            if cfg is not None:
                try:
                    theirs.check(cfg, layout)
                except ValueError as e:
                    raise ValueError(f"implementation {impl!r}: {e}") from None
                if known_failure(cfg, layout, theirs):
                    raise ValueError(f"implementation {impl!r}: {known_failure(cfg, layout, theirs)}")
            impl = base
        if impl not in IMPLS:
            raise ValueError(f"implementation {impl!r}: must be one of {IMPLS}")
        if impl in DTENSOR_IMPLS and layout.tp == 1:
            raise ValueError(f"implementation {impl!r}: needs tp > 1 (DTensor's tensor parallelism "
                             f"over several GPUs; --tp N)")
        if impl == "dtensor-async" and not layout.sp:
            raise ValueError("implementation 'dtensor-async': needs sequence parallelism (--sp): torch's async TP "
                             "overlaps the all-gather before a matmul and the reduce-scatter after one")
        if impl in WORK_ONLY and (layout.world_size > 1 or train):
            raise ValueError(f"implementation {impl!r}: the block's forward work on one GPU only, "
                             f"not {'a training step' if train else f'a {layout.dp}x{layout.tp} mesh'}")
        if impl == "nvfuser-nomesh" and layout.world_size > 1:
            raise ValueError(f"implementation 'nvfuser-nomesh': one GPU only, the mesh is {layout.dp}x{layout.tp}")


def _nvfuser(impls, kinds: dict) -> list[str]:
    """The implementations asked for that are of `kinds` (NVFUSER_CALLED or _GRAPHED), with or without an @schedule."""
    return [impl for impl in impls if split_impl(impl)[0] in kinds]


def _step_offsets():
    """A new dropout offset for each call, as a training loop's step counter."""
    return itertools.cycle(range(100_000))


def unavailable(impl: str) -> str | None:
    """Why an implementation cannot be built here (the bench skips it, in one line), or None."""
    return thunder_missing() if impl in THUNDER_IMPLS else None


def _graph_trees(ref, x, p, impl):
    """The reference block's forward under a torch.compile mode with its CUDA
    graphs (GRAPH_TREES); each call marked a new step for its graph trees (no
    earlier step's outputs or pending backward kept)."""
    compiled = torch.compile(sdpa_forward, mode=GRAPH_TREES[impl])

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(ref, x, p)
    return call


def forward_fns(cfg, ref, x, impls, layout, rank, groups, schedule):
    from tpfuser.runtime.block import ShardedBlock
    from tpfuser.runtime.graphs import GraphedForward
    fns = {}
    for impl in _nvfuser(impls, NVFUSER_CALLED):
        nv = ShardedBlock(cfg, layout, rank, schedule=nvfuser_schedule(schedule, impl)).load(ref.state_dict())
        fns[impl] = lambda nv=nv, steps=_step_offsets(): nv(x, 1234, next(steps))["out"]
    for impl in _nvfuser(impls, NVFUSER_GRAPHED):   # x copied in each call, as compile's and Thunder's graphs do
        block = ShardedBlock(cfg, layout, rank, schedule=nvfuser_schedule(schedule, impl, graphed=True))
        block.load(ref.state_dict())
        fns[impl] = lambda graphed=GraphedForward(block), steps=_step_offsets(): \
            graphed(x, 1234, next(steps))["out"]
    if "eager" in impls:
        fns["eager"] = lambda: sdpa_forward(ref, x, cfg.dropout)
    if "eager-graph" in impls:
        fns["eager-graph"] = graphed_callable(lambda: sdpa_forward(ref, x, cfg.dropout))
    if "compile" in impls:
        compiled = torch.compile(sdpa_forward)
        fns["compile"] = lambda: compiled(ref, x, cfg.dropout)
    for impl in GRAPH_TREES:
        if impl in impls:
            fns[impl] = _graph_trees(ref, x, cfg.dropout, impl)
    for impl, (forward, _) in dtensor_peers(ref, impls, groups and groups.tp_mesh, layout.sp, cfg.dropout).items():
        fns[impl] = lambda forward=forward: forward(x)
    for impl, graphs in THUNDER_IMPLS.items():
        if impl in impls:
            fns[impl] = thunder_forward(ref, cfg.dropout, graphs, x)
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
            from tpfuser.runtime.graphs import clear_cublas_workspaces, warm_up
            warm_up(self.fn, times=3)
            before = torch.cuda.memory_reserved()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.fn()
            clear_cublas_workspaces()
            self.pool_bytes = torch.cuda.memory_reserved() - before
        self.graph.replay()


def train_fns(cfg, ref, x, impls, layout, rank, groups, schedule, announce=lambda what: None):
    """One training step each (forward, backward, parameter gradients summed over dp when dp > 1, then
    dropped), its peak memory and saved-activation bytes; announce(what) as each begins its warm-up."""
    grad = torch.randn_like(x)
    x = x.detach().requires_grad_(True)   # as inside a model: every implementation computes the input's gradient
    fns, memory, forwards, failed = {}, {}, {}, {}
    from tpfuser.runtime.module import TPBlock
    for impl in _nvfuser(impls, NVFUSER_CALLED):
        model = TPBlock(cfg, layout, rank, dp_group=groups.dp if groups else None,
                        schedule=nvfuser_schedule(schedule, impl))
        model.load_full_state_dict(ref.state_dict())
        forwards[impl] = (lambda m=model: m(x), list(model.parameters()), False)   # its backward sums over dp
    params = list(ref.parameters())
    if "eager" in impls:
        forwards["eager"] = (lambda: sdpa_forward(ref, x, cfg.dropout), params, True)
    if "compile" in impls:
        compiled = torch.compile(sdpa_forward)
        forwards["compile"] = (lambda: compiled(ref, x, cfg.dropout), params, True)
    for impl in GRAPH_TREES:
        if impl in impls:
            forwards[impl] = (_graph_trees(ref, x, cfg.dropout, impl), params, True)
    for impl, graphs in THUNDER_IMPLS.items():   # (its parameters are the reference block's)
        if impl in impls:
            forwards[impl] = (thunder_forward(ref, cfg.dropout, graphs, x), params, True)
    for impl, (forward, ps) in dtensor_peers(ref, impls, groups and groups.tp_mesh, layout.sp, cfg.dropout).items():
        forwards[impl] = (lambda forward=forward: forward(x), ps, True)
    for impl, (fwd, ps, sum_dp) in forwards.items():
        def step(fwd=fwd, ps=ps, sum_dp=sum_dp and layout.dp > 1):
            fwd().backward(grad)
            if sum_dp:
                local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in ps]
                sum_over_group(local, groups.dp)
            for p in ps:
                p.grad = None
            x.grad = None
        announce(f"warming up {impl}")
        try:
            memory[impl] = _warm_then_memory(step)
        except Exception as e:  # e.g. nvFuser failing to compile: report it, time the others
            failed[impl] = failure(e)
            continue
        if impl not in (*GRAPH_TREES, "thunder-graph"):   # a forward left without its backward upsets their graphs
            memory[impl]["saved_activation_mib"] = saved_activation_bytes(fwd, ps) / 2**20
        fns[impl] = step
    graphed = _graphed_train_fns(cfg, ref, x, grad, impls, layout, rank, groups, schedule)
    for impl, (step, pool) in graphed.items():
        announce(f"warming up {impl}")
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
    from tpfuser.runtime.graphs import clear_cublas_workspaces
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


def _graphed_train_fns(cfg, ref, x, grad, impls, layout, rank, groups, schedule):
    """Training steps replayed from one CUDA graph each: {impl: (step, graph pool bytes)}.
    Gradients summed over dp after the replay where dp > 1 (a gloo group)."""
    from tpfuser.runtime.block import ShardedBlock
    from tpfuser.runtime.graphs import GraphedTrainStep
    out = {}
    for impl in _nvfuser(impls, NVFUSER_GRAPHED):
        block = ShardedBlock(cfg, layout, rank, dp_group=groups.dp if groups else None,
                             schedule=nvfuser_schedule(schedule, impl, graphed=True))
        graphed = GraphedTrainStep(block.load(ref.state_dict()))
        out[impl] = (lambda graphed=graphed, steps=_step_offsets(): graphed(x.detach(), grad, 1234, next(steps)),
                     lambda graphed=graphed: graphed.pool_bytes)
    if "eager-graph" in impls:
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
