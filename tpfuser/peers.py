"""The tensor-parallel peer a PyTorch user would pick instead of tpfuser:
DTensor's `parallelize_module` with `ColwiseParallel` / `RowwiseParallel`
on the reference block, over the same tp mesh.

c_attn's rows are reordered head by head first (shard.qkv_heads_interleaved),
so that DTensor's column-parallel split of its rows gives each rank whole
heads of q, k and v (the fusion splits each of q, k, v instead); each rank
then runs attention on its heads.
DTensor inserts the two all-reduces after the row-parallel linears. Its
forward is the reference's `sdpa_forward(block, x, p, heads_interleaved=True)`.
"""

from __future__ import annotations

import copy

import torch

from tpfuser.plan import LINEARS
from tpfuser.reference import Block
from tpfuser.shard import qkv_blocked, qkv_heads_interleaved

# DTensor's names for the plan's column- and row-parallel linears (plan.LINEARS).
TP_PLAN_NAMES = {name: {"column": "colwise", "row": "rowwise"}[kind] for name, kind in LINEARS}


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
