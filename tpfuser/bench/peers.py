"""The tensor-parallel peer a PyTorch user would pick instead of tpfuser:
DTensor's `parallelize_module` with `ColwiseParallel` / `RowwiseParallel`
on the reference block, over the same tp mesh.

As for the fusion, c_attn's rows are reordered head by head first
(shard.qkv_heads_interleaved), so that the column-parallel split gives each
rank whole heads of q, k and v; each rank then runs attention on its heads.
DTensor inserts the two all-reduces after the row-parallel linears. Its
forward is the reference's `sdpa_forward(block, x, p, heads_interleaved=True)`.
Under sequence parallelism, torchtitan's plan: the LayerNorms
`SequenceParallel`, an all-gather before each column-parallel linear and a
reduce-scatter after each row-parallel one. `dtensor-async` is that block
under torch.compile with Inductor's micro-pipeline pass (torch's asynchronous
tensor parallelism), which cuts each all-gather + matmul and matmul +
reduce-scatter into P2P steps over the tp group's symmetric memory.
"""

from __future__ import annotations

import copy

import torch

from tpfuser.parallel.placements import PARAM_PLACEMENTS
from tpfuser.verify.reference import Block, sdpa_forward
from tpfuser.parallel.shard import qkv_blocked, qkv_heads_interleaved

# Deferred: torch.distributed.tensor.parallel (DTensor's machinery, about 0.4 s to
# import), in dtensor_block, and torch's symmetric memory, in dtensor_peers: only
# the DTensor peers (tp > 1) need them.

# DTensor's names for the plan's linears: a weight split on its output rows is
# column-parallel, one split on its input columns row-parallel (placements.PARAM_PLACEMENTS).
TP_PLAN_NAMES = {name.removesuffix(".weight"): {0: "colwise", 1: "rowwise"}[dim]
                 for name, placement in PARAM_PLACEMENTS.items() if name.endswith(".weight")
                 for dim in placement}


# The peers built here, by the bench's name (bench/impls.py).
DTENSOR_IMPLS = ("dtensor", "dtensor-async")


def dtensor_block(ref: Block, tp_mesh, sequence_parallel: bool = False) -> Block:
    """A copy of the reference block whose four linears are sharded over tp_mesh
    (a 1-D torch DeviceMesh); LayerNorms stay replicated plain parameters, or
    with sequence_parallel run on each rank's part of the sequence (dim 1 of
    the block's input and output, as tpfuser's SP splits it)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    block = copy.deepcopy(ref)
    with torch.no_grad():
        for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
            p.copy_(qkv_heads_interleaved(p, ref.cfg.n_head))
    if not sequence_parallel:
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        return parallelize_module(block, tp_mesh, {name: styles[kind]() for name, kind in TP_PLAN_NAMES.items()})
    styles = {"colwise": lambda: ColwiseParallel(input_layouts=Shard(1)),
              "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1))}
    plan = {name: styles[kind]() for name, kind in TP_PLAN_NAMES.items()}
    return parallelize_module(block, tp_mesh, {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(), **plan})


def dtensor_peers(ref: Block, impls, tp_mesh, sequence_parallel: bool, p: float) -> dict:
    """The DTensor peers among impls: {name: (forward of x, the block's parameters)}.
    dtensor-async (sequence_parallel only; bench/impls.check_impls refuses it
    otherwise) sets Inductor's `_micro_pipeline_tp` for the process and enables
    symmetric memory for the tp group, as torchtitan does; symmetric memory
    creates no NVLink multicast object where TORCH_SYMM_MEM_DISABLE_MULTICAST=1."""
    out = {}
    for impl in (i for i in DTENSOR_IMPLS if i in impls):
        block = dtensor_block(ref, tp_mesh, sequence_parallel)

        def forward(block, x):
            return sdpa_forward(block, x, p, heads_interleaved=True)
        if impl == "dtensor-async":
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group
            torch._inductor.config._micro_pipeline_tp = True   # read when the first call compiles
            enable_symm_mem_for_group(tp_mesh.get_group().group_name)
            forward = torch.compile(forward)
        out[impl] = (lambda x, block=block, forward=forward: forward(block, x), list(block.parameters()))
    return out


def full_grads(block: Block) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, gathered from its shards, nanoGPT layout."""
    out = {}
    for name, p in block.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = qkv_blocked(g, block.cfg.n_head) if name.startswith("attn.c_attn") else g
    return out
