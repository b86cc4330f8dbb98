"""The sharded block as an nn.Module (`TPBlock`): each rank's parameters are
its shards, and autograd runs the block's backward fusions."""

from __future__ import annotations

from typing import Optional

import torch

from tpfuser.block.dropout import check_rng
from tpfuser.block.tensors import PARAM_NAMES
from tpfuser.config import BlockConfig, Layout, check_flags
from tpfuser.dist.world import gather_output
from tpfuser.parallel.schedules import Schedule, default_schedule, load_schedule
from tpfuser.parallel.shard import qkv_blocked
from tpfuser.runtime.block import ShardedBlock
from tpfuser.runtime.graphs import GraphedTraining, GraphedBlockFunction
from tpfuser.runtime.weights import from_hf_gpt2


class _BlockFunction(torch.autograd.Function):
    """autograd glue: forward and backward fusions of one ShardedBlock."""

    @staticmethod
    def forward(ctx, block: ShardedBlock, rng_seed: int, rng_offset: int, dropout: bool, x, *params):
        named, saved = block.forward_train(x, rng_seed, rng_offset, params, dropout=dropout)
        ctx.block, ctx.dropout = block, dropout
        ctx.saved_names = block.saved_names(dropout)
        ctx.names = ["x", *PARAM_NAMES, *ctx.saved_names]   # what save_for_backward holds, in order
        ctx.save_for_backward(x, *params, *saved)
        return named["out"]

    @staticmethod
    def backward(ctx, grad_out):
        held = dict(zip(ctx.names, ctx.saved_tensors))
        params = [held[name] for name in PARAM_NAMES]
        saved = [held[name] for name in ctx.saved_names]
        grad_x, grads = ctx.block.backward(grad_out, held["x"], saved, params=params, dropout=ctx.dropout)
        return (None, None, None, None, grad_x, *grads)


class TPBlock(torch.nn.Module):
    """The sharded block as an nn.Module: its parameters are this rank's shards
    (PARAM_NAMES order, c_attn rows head by head), so `loss.backward()` leaves
    each rank its gradient shards. Parameter gradients are summed over dp after
    the backward fusion, over dp_group (as for a loss summed over the global batch).

    Each training-mode call draws fresh dropout masks: the rng offset is a
    step counter, the seed fixed at construction.

    graphs=True: a training-mode call replays a CUDA graph of the training
    forward, and its backward one of the backward (graphs.GraphedTraining),
    captured at the first call; one step at a time (forward, then backward).
    The output is a view of a buffer the next step overwrites. Eval-mode calls
    are not graphed. schedule: as ShardedBlock's (graphs=True reads the
    dropout keys from the device, whatever the schedule says)."""

    def __init__(self, cfg: BlockConfig, layout: Layout = Layout(), rank: int = 0, rng_seed: int = 0,
                 device: torch.device | str | int | None = None, dp_group=None, graphs: bool = False,
                 schedule: Schedule | str | dict | None = None):
        super().__init__()
        check_flags(graphs=graphs)
        check_rng("rng_seed", rng_seed)   # (the first step's masks are drawn from it: refused now, not then)
        self.cfg, self.layout, self.rank = cfg, layout, rank
        schedule = default_schedule(layout) if schedule is None else load_schedule(schedule)
        if graphs:
            schedule = schedule.replace(keys_on_device=True)
        self.runner = ShardedBlock(cfg, layout, rank, device=device, dp_group=dp_group, schedule=schedule)
        self.graphs = graphs
        self._graphed = None   # graphs.GraphedTraining, made at the first training-mode call
        self.shards = torch.nn.ParameterList()
        self.rng_seed, self.step = rng_seed, 0

    def load_full_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> "TPBlock":
        """Take a nanoGPT Block state_dict (global); keep this rank's shards as parameters."""
        self.runner.load(state, strict)
        self.shards = torch.nn.ParameterList([torch.nn.Parameter(t) for t in self.runner.params])
        self._graphed = None   # new parameters: a graph captured on the old ones is dropped
        return self

    def load_hf_gpt2(self, state: dict[str, torch.Tensor], layer: Optional[int] = None,
                     strict: bool = True) -> "TPBlock":
        """Take Hugging Face GPT-2 weights (weights.from_hf_gpt2); keep this rank's shards as parameters."""
        return self.load_full_state_dict(from_hf_gpt2(state, self.cfg, layer, strict))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Training mode: dropout with the next step's masks. Eval mode: the same
        runner's fusions without dropout (built at the first eval call), no step;
        without autograd (torch.no_grad) the inference forward, which saves nothing."""
        if not self.training and not torch.is_grad_enabled():
            return self.runner(x, self.rng_seed, self.step, dropout=False, params=list(self.shards))["out"]
        offset = self.step
        if self.training:
            self.step += 1
            if self.graphs:
                if self._graphed is None:
                    self._graphed = GraphedTraining(self.runner)
                return GraphedBlockFunction.apply(self._graphed, self.rng_seed, offset, x, *self.shards)
        return _BlockFunction.apply(self.runner, self.rng_seed, offset, self.training, x, *self.shards)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Global parameter gradients in nanoGPT's layout (blocked c_attn), for checking.
        Gathers the other ranks' shards through torch.distributed when the world is larger than one."""
        out = {}
        for name, p in zip(PARAM_NAMES, self.shards):
            g = p.grad
            if self.layout.world_size > 1:
                g = gather_output(g, self.layout, name)
            if name.startswith("attn.c_attn"):
                g = qkv_blocked(g, self.cfg.n_head)
            out[name] = g
        return out

