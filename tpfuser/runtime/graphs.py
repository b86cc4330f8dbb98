"""CUDA graphs: one rank's forward, or its whole training step, captured once
and replayed.

    block = ShardedBlock(cfg, layout, rank, schedule=SCHEDULES["megatron"].replace(keys_on_device=True))
    block.load(state)
    forward = GraphedForward(block)
    out = forward(x, rng_seed, rng_offset)["out"]        # overwritten by the next call
    step = GraphedTrainStep(block)
    out, grad_x, grads = step(x, grad_out, rng_seed, rng_offset)
    model = TPBlock(cfg, layout, rank, graphs=True)       # nn.Module: GraphedTraining under autograd

Called, nvFuser's multi-device path launches each segment and posts each
collective from the host, 0.3-0.5 ms a call on nanogpt (NOTES-history.md); a replay
launches the captured work at once, the NCCL collectives included. What
changes from call to call is written into device memory before each replay:
the inputs (copied into the static ones), the dropout keys (the block writes
them into the tensor its fusions read: keys_on_device) and flash attention's
seed (the CUDA generator is registered with the graph and read at replay; the
block seeds it per rank and call, as a called block does). So a replay is
meant to equal a called block with the same (seed, offset) bit for bit, and
consecutive steps draw new masks; tests/test_gpu_graphs.py checks both.

The first call captures, after two warm-up calls on a side stream (nvFuser
compiles its kernels and NCCL makes its communicators there: neither may
happen under capture). A graph reads the tensors it captured: parameters
updated in place (an optimizer's step) are seen, parameters replaced
(load() again) are refused. The dp sum of the gradients is captured when the
dp group is NCCL's; a gloo group sums through the host, after the replay.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuser.dist.world import sum_over_group
from tpfuser.parallel.linear_schedule import graphs_refused
from tpfuser.runtime.block import ShardedBlock


def _check_block(block: ShardedBlock) -> None:
    if refused := graphs_refused(block.schedule):
        raise ValueError(refused)
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA graphs need a CUDA device; none is visible")
    if block.cfg.dropout > 0 and not block.keys_on_device:
        raise ValueError(f"dropout={block.cfg.dropout}: a graph needs the dropout keys on the device (a "
                         "schedule with keys_on_device=true), or its masks would be frozen at capture")


def _dp_backend(block: ShardedBlock) -> str | None:
    """The backend that sums the gradients over dp (None: dp is 1); refused without a group."""
    if block.layout.dp == 1:
        return None
    if block.dp_group is None:
        raise ValueError(f"dp={block.layout.dp}: the gradients are summed over dp; build the block (ShardedBlock "
                         f"or TPBlock) with dp_group=world.dp_group(layout, rank)")
    return dist.get_backend(block.dp_group)


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's workspaces, which it keeps per stream (32 MiB each on
    Hopper by default) for as long as the process lives: the side stream's of
    a warm-up would otherwise stay reserved beside the graph's own, made in
    its pool at capture; and the graph's, once captured, must not serve later
    calls outside the graph. torch.compile's CUDA-graph trees clear them around
    each capture for the same reasons (clear_cublas_manager)."""
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()


def warm_up(body, times: int = 2) -> None:
    """Run body on a side stream (as before a capture: nvFuser compiles, NCCL
    connects); then release the cached memory, cuBLAS's side-stream workspace
    included, so that what a capture reserves next can be read off
    memory_reserved (torch.cuda.graph empties the cache on entry too, which
    would otherwise hide it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    clear_cublas_workspaces()
    torch.cuda.empty_cache()


class _Graphed:
    def __init__(self, block: ShardedBlock):
        _check_block(block)
        self.block = block
        self.graph = None
        self._param_ptrs = None
        self.pool_bytes = 0   # what the graph's memory pool reserved at capture

    def _static_input(self) -> torch.Tensor:
        """A buffer of this rank's input shape: what a graph reads, the caller's tensor copied in."""
        return torch.zeros(self.block.input_shape(), dtype=self.block.cfg.torch_dtype, device=self.block.device)

    def _params_unchanged(self, params=None) -> None:
        params = self.block.checked_params(None) if params is None else params
        if [p.data_ptr() for p in params] != self._param_ptrs:
            raise ValueError("the block's parameters were replaced since the graph was captured "
                             "(load() again?): update them in place, or make a new graphed block")

    def _prepare_capture(self, rng_seed: int, rng_offset: int, body) -> int:
        """Before a capture: the keys written (the capture reads their tensor, never
        writes it), the parameters noted, body warmed up; returns the memory
        reserved then, against which the graph's pool is measured."""
        self.block.rng_inputs(rng_seed, rng_offset)
        self._param_ptrs = [p.data_ptr() for p in self.block.checked_params(None)]
        warm_up(body)
        return torch.cuda.memory_reserved(self.block.device)

    def _capture(self, rng_seed: int, rng_offset: int, body) -> object:
        before = self._prepare_capture(rng_seed, rng_offset, body)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            held = body()
        clear_cublas_workspaces()
        self.pool_bytes = torch.cuda.memory_reserved(self.block.device) - before
        return held

    def _replay(self, rng_seed: int, rng_offset: int, params=None) -> None:
        self._params_unchanged(params)
        block = self.block
        block.rng_inputs(rng_seed, rng_offset)            # writes this call's keys (keys_on_device)
        with block.attention_stream(rng_seed, rng_offset):   # flash attention's seed, read by the replay
            self.graph.replay()


class GraphedForward(_Graphed):
    """A ShardedBlock's forward (its outputs by name), from a CUDA graph."""

    def __init__(self, block: ShardedBlock):
        super().__init__(block)
        self.x = self._static_input()
        self.outputs: dict[str, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor, rng_seed: int = 0, rng_offset: int = 0) -> dict[str, torch.Tensor]:
        """This rank's outputs, in static buffers the next call overwrites (clone to keep them)."""
        self.block.validate_input("x", x)
        self.x.copy_(x)
        if self.graph is None:
            self.outputs = self._capture(rng_seed, rng_offset, lambda: self.block(self.x, rng_seed, rng_offset))
        self._replay(rng_seed, rng_offset)
        return self.outputs


class GraphedTrainStep(_Graphed):
    """A ShardedBlock's training step, forward_train then backward, from one CUDA graph:
    (out, grad of x, [grad of each parameter shard in PARAM_NAMES order], summed over dp)."""

    def __init__(self, block: ShardedBlock):
        super().__init__(block)
        self.x, self.grad_out = self._static_input(), self._static_input()
        backend = _dp_backend(block)
        self.dp_sum_captured = backend == "nccl"
        self.dp_sum_after = backend is not None and not self.dp_sum_captured
        self.held = None

    def _body(self, rng_seed, rng_offset):
        named, saved = self.block.forward_train(self.x, rng_seed, rng_offset)
        grad_x, grads = self.block.backward(self.grad_out, self.x, saved, sum_over_dp=self.dp_sum_captured)
        return named["out"], grad_x, grads

    def __call__(self, x: torch.Tensor, grad_out: torch.Tensor, rng_seed: int = 0, rng_offset: int = 0):
        """(out, grad_x, grads) in static buffers the next call overwrites (clone to keep them);
        the gradients are new tensors when a gloo group sums them after the replay."""
        self.block.validate_input("x", x)
        self.block.validate_input("grad_out", grad_out)
        self.x.copy_(x)
        self.grad_out.copy_(grad_out)
        if self.graph is None:
            self.held = self._capture(rng_seed, rng_offset, lambda: self._body(rng_seed, rng_offset))
        self._replay(rng_seed, rng_offset)
        out, grad_x, grads = self.held
        if self.dp_sum_after:
            grads = sum_over_group(grads, self.block.dp_group)
        return out, grad_x, grads


class GraphedTraining(_Graphed):
    """The training forward and the backward as two CUDA graphs sharing one memory
    pool, for autograd (TPBlock(graphs=True)): forward() replays the first,
    backward() the second, on the activations the first saved. They hold one
    step: the backward of a forward that another forward has since
    overwritten is refused (it would silently use the newer activations)."""

    def __init__(self, block: ShardedBlock):
        super().__init__(block)
        _dp_backend(block)   # refused here, not at the first backward, without a group
        self.x, self.grad_out = self._static_input(), self._static_input()
        self.backward_graph = None
        self.generation = 0   # forwards replayed so far: the activations held are the last one's

    def forward(self, x: torch.Tensor, rng_seed: int, rng_offset: int, params=None) -> tuple[torch.Tensor, int]:
        """(out, a static buffer; this forward's generation, for its backward)."""
        self.block.validate_input("x", x)
        self.x.copy_(x.detach())
        if self.graph is None:
            self._capture_both(rng_seed, rng_offset)
        self._replay(rng_seed, rng_offset, params)
        self.generation += 1
        return self.out, self.generation

    def backward(self, grad_out: torch.Tensor, generation: int):
        """(grad of x, parameter-shard gradients summed over dp), new tensors (autograd may keep them)."""
        if generation != self.generation:
            raise RuntimeError(f"graph mode holds one step's activations: this backward's forward (step "
                               f"{generation}) was overwritten by a later forward (step {self.generation}); "
                               f"run each backward before the next training-mode forward")
        self.block.validate_input("grad_out", grad_out)
        self.grad_out.copy_(grad_out)
        self.backward_graph.replay()
        grad_x, grads = self.grad_x.clone(), [g.clone() for g in self.grads]
        if self.block.layout.dp > 1:
            grads = self.block.sum_over_dp(grads)
        return grad_x, grads

    def _capture_both(self, rng_seed, rng_offset):
        block = self.block
        self.graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        held = {}

        def forward():
            named, held["saved"] = block.forward_train(self.x, rng_seed, rng_offset)
            return named["out"]

        def backward():
            return block.backward(self.grad_out, self.x, held["saved"], sum_over_dp=False)
        before = self._prepare_capture(rng_seed, rng_offset, lambda: (forward(), backward()))
        with torch.cuda.graph(self.graph):
            self.out = forward()
        # The forward's workspace goes back to the shared pool, where the backward's capture may place
        # tensors: the forward's scratch writes at its next replay may then overwrite them. Only the
        # backward's outputs can be there (the forward's are held), and backward() clones them at once.
        clear_cublas_workspaces()
        self.saved = held["saved"]   # the backward graph reads them where the forward graph writes them
        with torch.cuda.graph(self.backward_graph, pool=self.graph.pool()):
            self.grad_x, self.grads = backward()
        clear_cublas_workspaces()
        self.pool_bytes = torch.cuda.memory_reserved(block.device) - before


class GraphedBlockFunction(torch.autograd.Function):
    """autograd glue of TPBlock(graphs=True): the replays of a GraphedTraining."""

    @staticmethod
    def forward(ctx, graphed: GraphedTraining, rng_seed: int, rng_offset: int, x, *params):
        out, ctx.generation = graphed.forward(x, rng_seed, rng_offset, params)
        ctx.graphed = graphed
        return out.detach()   # a new tensor on the static buffer

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grads = ctx.graphed.backward(grad_out, ctx.generation)
        return (None, None, None, grad_x, *grads)
