"""The tensor-parallel peer a PyTorch user would pick instead of tpfuser:
DTensor's `parallelize_module` with `ColwiseParallel` / `RowwiseParallel`
on the reference block, over the same tp mesh.

As for the fusion, c_attn's rows are reordered head by head first
(shard.qkv_heads_interleaved), so that the column-parallel split gives each
rank whole heads of q, k and v; each rank then runs attention on its heads.
DTensor inserts the two all-reduces after the row-parallel linears. Its
forward is the reference's `sdpa_forward(block, x, p, heads_interleaved=True)`.
"""

from __future__ import annotations

import copy

import torch

from tpfuser.parallel.placements import PARAM_PLACEMENTS
from tpfuser.verify.reference import Block
from tpfuser.parallel.shard import qkv_blocked, qkv_heads_interleaved

# Deferred: torch.distributed.tensor.parallel (DTensor's machinery, about 0.4 s to
# import), in dtensor_block: only the dtensor peer (tp > 1) needs it.

# DTensor's names for the plan's linears: a weight split on its output rows is
# column-parallel, one split on its input columns row-parallel (placements.PARAM_PLACEMENTS).
TP_PLAN_NAMES = {name.removesuffix(".weight"): {0: "colwise", 1: "rowwise"}[dim]
                 for name, placement in PARAM_PLACEMENTS.items() if name.endswith(".weight")
                 for dim in placement}


def dtensor_block(ref: Block, tp_mesh) -> Block:
    """A copy of the reference block whose four linears are sharded over tp_mesh
    (a 1-D torch DeviceMesh); LayerNorms stay replicated plain parameters."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    block = copy.deepcopy(ref)
    with torch.no_grad():
        for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
            p.copy_(qkv_heads_interleaved(p, ref.cfg.n_head))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return parallelize_module(block, tp_mesh, {name: styles[kind]() for name, kind in TP_PLAN_NAMES.items()})


def full_grads(block: Block) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, gathered from its shards, nanoGPT layout."""
    out = {}
    for name, p in block.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = qkv_blocked(g, block.cfg.n_head) if name.startswith("attn.c_attn") else g
    return out
