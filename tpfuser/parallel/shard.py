"""Slicing tensors to ranks and the c_attn reordering (tests/simulation.py
simulates the ranks in float64 with the very same slicing).

A rank's slice of a tensor is `local_slice(t, placement, layout, rank)`: for
each dimension its placement names, the tensor is cut into equal contiguous
chunks along that mesh axis (nvFuser's `outer_split`) and the rank keeps the
chunk of its coordinate. The runtime, the tests and the simulation all call it.
"""

from __future__ import annotations

import torch

from tpfuser.config import BlockConfig, Layout
from tpfuser.parallel.placements import DP, TP, Placement, PARAM_PLACEMENTS, axis_coords, axis_sizes
from tpfuser.block.tensors import PARAM_NAMES


def local_slice(t: torch.Tensor, placement: Placement, layout: Layout, rank: int,
                name: str = "tensor") -> torch.Tensor:
    """This rank's contiguous chunk of a global tensor (`name`: for a refusal)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor (the global one), got {type(t).__name__}")
    coords = axis_coords(layout, rank)
    sizes = axis_sizes(layout)
    for dim, axis in placement.items():
        n = sizes[axis]
        if t.dim() <= dim or t.shape[dim] % n:
            raise ValueError(f"{name}: cannot split dimension {dim} of its shape {tuple(t.shape)} over {axis}={n}; "
                             f"expected the global tensor")
        t = t.chunk(n, dim=dim)[coords[axis]]
    return t.contiguous()


def slice_starts(shape, placement: Placement, layout: Layout, rank: int) -> list[int]:
    """Where this rank's chunk (local_slice) begins in the global tensor, per dimension."""
    coords = axis_coords(layout, rank)
    sizes = axis_sizes(layout)
    return [coords[placement[d]] * (n // sizes[placement[d]]) if d in placement else 0
            for d, n in enumerate(shape)]


def gather(shards: list[torch.Tensor], placement: Placement, layout: Layout) -> torch.Tensor:
    """Inverse of local_slice: reassemble the global tensor from every rank's shard
    (ranks in order). Ranks that hold replicas of a chunk must agree exactly."""
    by_coords = {layout.rank_coords(r): s for r, s in enumerate(shards)}
    dp_dims = [d for d, a in placement.items() if a == DP]
    tp_dims = [d for d, a in placement.items() if a == TP]
    rows = []
    for i in range(layout.dp):
        row = [by_coords[(i, j)] for j in range(layout.tp)]
        if tp_dims:
            rows.append(torch.cat(row, dim=tp_dims[0]))
        else:
            for j, r in enumerate(row[1:], 1):
                if not torch.equal(r, row[0]):
                    raise AssertionError(f"replicas over tp differ between tp ranks 0 and {j} (dp rank {i})")
            rows.append(row[0])
    if dp_dims:
        return torch.cat(rows, dim=dp_dims[0])
    for i, r in enumerate(rows[1:], 1):
        if not torch.equal(r, rows[0]):
            raise AssertionError(f"replicas over dp differ between dp ranks 0 and {i}")
    return rows[0]


def qkv_heads_interleaved(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder nanoGPT's c_attn rows from blocked [Q; K; V] ([3, h, d]) to head
    by head ([h, 3, d]), the order the fusion takes, so that an outer split of
    the rows over tp gives each rank whole heads of q, k and v.
    Works on the weight [3e, e] and on the bias [3e]."""
    three_e = t.shape[0]
    if three_e % (3 * n_head):
        raise ValueError(f"c_attn has {three_e} rows: expected a multiple of 3 * n_head = {3 * n_head}")
    d = three_e // (3 * n_head)
    rest = t.shape[1:]
    return t.reshape(3, n_head, d, *rest).transpose(0, 1).reshape(three_e, *rest).contiguous()


def qkv_blocked(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of qkv_heads_interleaved."""
    three_e = t.shape[0]
    d = three_e // (3 * n_head)
    rest = t.shape[1:]
    return t.reshape(n_head, 3, d, *rest).transpose(0, 1).reshape(three_e, *rest).contiguous()


def fusion_params(state: dict[str, torch.Tensor], cfg: BlockConfig) -> dict[str, torch.Tensor]:
    """The global parameters in the fusion's convention, from a nanoGPT-style state_dict."""
    out = {name: state[name] for name in PARAM_NAMES}
    for name in ("attn.c_attn.weight", "attn.c_attn.bias"):
        out[name] = qkv_heads_interleaved(out[name], cfg.n_head)
    return out


def rank_params(fparams: dict[str, torch.Tensor], layout: Layout, rank: int) -> list[torch.Tensor]:
    """This rank's parameter shards, in PARAM_NAMES order."""
    return [local_slice(fparams[name], PARAM_PLACEMENTS[name], layout, rank, name) for name in PARAM_NAMES]
