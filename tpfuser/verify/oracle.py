"""The oracle's side of a check: the PyTorch reference run once on the global
batch, and each rank's slices of it.

One process (the only one, or rank 0) runs the reference block in float32 on
its GPU: the forward, and the backward from a fixed upstream gradient. It sees
the weights and input the fusion sees (rounded to bf16 first when the fusion
runs in bf16) and applies the very dropout masks the ranks draw:
  - the fusion's hash masks, from (seed, offset) alone (dropout.keep_mask);
  - flash attention's (bf16), by replaying each (dp, tp) rank's stream
    (dropout.flash_seed) through ATen's flash kernel on that rank's rows and heads.
It hands every rank its slices of the weights, input and expected results
(through files in a folder of this machine when there are several ranks: the
checks run their ranks on one machine). Where the fusion runs in bf16 with
dropout, the reference also replays the wrong streams (each rank another
rank's), so that the attention-dropout check is not vacuous. In bf16 the same
block also runs in eager PyTorch in bf16 (same masks, same flash streams):
its own error on each tensor bounds the fusion's (check.tolerance).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpfuser.block.dropout import flash_seed, keep_mask, stream_key
from tpfuser.block.tensors import PARAM_NAMES, tensors
from tpfuser.config import BlockConfig, Layout
from tpfuser.parallel.placements import local_shape, placements
from tpfuser.parallel.shard import fusion_params, local_slice, rank_params, slice_starts
from tpfuser.runtime.block import mask_shape, seeded_cuda_generator
from tpfuser.verify.reference import Block, Masks, make_block, make_input


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double().to(actual.device)
    return (torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e)).item()


@dataclass(frozen=True)
class Case:
    """What one check runs: the block and mesh, the weights' and the dropouts' seeds."""

    cfg: BlockConfig
    layout: Layout = Layout()
    weight_seed: int = 0
    rng_seed: int = 1234
    rng_offset: int = 0

    @property
    def replays_flash(self) -> bool:
        return self.cfg.dtype == "bf16"

    @property
    def has_wrong_stream_control(self) -> bool:
        return self.replays_flash and self.cfg.dropout > 0


def flash_attention(case: Case, device: torch.device, wrong_stream: bool = False):
    """The reference's attention in bf16 through ATen's flash kernel: for every
    (dp, tp) rank its rows and heads, with its dropout stream (dropout.flash_seed).
    wrong_stream: each rank's heads with the next tp rank's stream (tp > 1) or
    with a stream no rank draws (tp == 1)."""
    layout, p = case.layout, case.cfg.dropout

    def attention(q, k, v):   # (b, h, s, d) float, global
        rows = []
        for i, part in enumerate(zip(*(t.chunk(layout.dp, dim=0) for t in (q, k, v)))):
            heads = []
            for j, (qh, kh, vh) in enumerate(zip(*(t.chunk(layout.tp, dim=1) for t in part))):
                stream = ((j + 1) % layout.tp if layout.tp > 1 else 1) if wrong_stream else j
                with seeded_cuda_generator(device, flash_seed(case.rng_seed, case.rng_offset, i, stream)):
                    y = torch.ops.aten._scaled_dot_product_flash_attention(
                        qh.bfloat16(), kh.bfloat16(), vh.bfloat16(), p, True)[0]
                heads.append(y.float())
            rows.append(torch.cat(heads, dim=1))
        return torch.cat(rows, dim=0)
    return attention


def oracle_masks(case: Case, device) -> Masks | None:
    """The unsharded run's keep-masks, from (seed, offset) alone: what every
    rank's fusion must draw a slice of. In bf16 the attention dropout is flash
    attention's own (flash_attention)."""
    cfg = case.cfg
    if cfg.dropout == 0:
        return None

    def draw(stream):
        return keep_mask(stream_key(case.rng_seed, case.rng_offset, stream), cfg.dropout, mask_shape(cfg, stream),
                         device=device)
    return Masks(resid_attn=draw("resid_attn"), resid_mlp=draw("resid_mlp"),
                 attn=None if case.replays_flash else draw("attn"))


def rank_masks(case: Case, rank: int, device) -> dict[str, torch.Tensor]:
    """This rank's slice of every hash mask its fusion draws, by name (the
    masks tensors.py lists for cfg: none without dropout, no attention mask
    where flash attention draws its own)."""
    cfg, layout = case.cfg, case.layout
    where, out = placements(layout), {}
    for mask in tensors(cfg, "mask"):
        shape, placement = mask.shape(cfg), where[mask.name]
        out[mask.name] = keep_mask(stream_key(case.rng_seed, case.rng_offset, mask.stream), cfg.dropout,
                                   local_shape(shape, placement, layout),
                                   slice_starts(shape, placement, layout, rank), shape, device)
    return out


class _FullPrecision:
    """fp32 matmuls without TF32 inside the block: the reference is the oracle."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def reference(case: Case, device: torch.device, backward: bool = True) -> dict[str, torch.Tensor]:
    """The reference run on the global batch, float32 on `device`: inputs,
    parameters (the fusion's convention, shard.fusion_params), output, and with
    `backward` the gradients (the fusion's convention too)."""
    cfg = case.cfg
    with _FullPrecision():
        block = make_block(cfg, seed=case.weight_seed, device=device, drawn_on=device)
        x, grad_out = (make_input(cfg, seed=s, device=device, drawn_on=device) for s in (1, 2))
        if cfg.dtype == "bf16":   # the reference sees exactly the values the fusion sees
            with torch.no_grad():
                for p in block.parameters():
                    p.copy_(p.bfloat16().float())
            x, grad_out = x.bfloat16().float(), grad_out.bfloat16().float()
        masks = oracle_masks(case, device)
        attention = flash_attention(case, device) if case.replays_flash else None
        xr = x.clone().requires_grad_(backward)
        out = block(xr, masks, attention)
        ref = {"x": x, "grad_out": grad_out, "out": out.detach()}
        ref |= {f"param.{n}": t for n, t in fusion_params(block.state_dict(), cfg).items()}
        if case.has_wrong_stream_control:
            with torch.no_grad():
                ref["out.wrong_stream"] = block(x, masks, flash_attention(case, device, wrong_stream=True))
        if backward:
            out.backward(grad_out)
            ref["grad_x"] = xr.grad
            grads = {n: p.grad for n, p in block.named_parameters()}
            ref |= {f"grad.{n}": t for n, t in fusion_params(grads, cfg).items()}
        if cfg.dtype == "bf16":
            ref |= eager_errors(block, ref, masks, attention, backward)
    return ref


def eager_errors(block: Block, ref: dict[str, torch.Tensor], masks, attention, backward: bool) -> dict:
    """Eager PyTorch's own bf16 run of the reference block (its weights, input,
    masks and flash streams) against the float32 run, relative L2 errors over
    the whole tensors: "eager.out", and with `backward` "eager.grad.x" and
    "eager.grad.<parameter>" (0-d tensors, handed to every rank)."""
    with torch.device("meta"):
        peer = Block(block.cfg).to(torch.bfloat16)
    peer = peer.to_empty(device=ref["x"].device)
    peer.load_state_dict(block.state_dict())   # cast to bf16: the values are bf16's already
    x = ref["x"].bfloat16().requires_grad_(backward)
    bf16_attention = None if attention is None else (lambda q, k, v: attention(q, k, v).bfloat16())
    out = peer(x, masks, bf16_attention)
    errors = {"eager.out": rel_l2(out, ref["out"])}
    if backward:
        out.backward(ref["grad_out"].bfloat16())
        errors["eager.grad.x"] = rel_l2(x.grad, ref["grad_x"])
        mine = dict(block.named_parameters())
        errors |= {f"eager.grad.{n}": rel_l2(p.grad, mine[n].grad) for n, p in peer.named_parameters()}
    return {name: torch.tensor(e) for name, e in errors.items()}


def rank_slices(ref: dict[str, torch.Tensor], case: Case, rank: int) -> dict[str, torch.Tensor]:
    """What rank `rank` needs of the reference run: its parameter shards and
    input slices in the block dtype, its expected slices in float32."""
    cfg, layout = case.cfg, case.layout
    where = placements(layout)
    params = rank_params({n: ref[f"param.{n}"] for n in PARAM_NAMES}, layout, rank)
    mine = {f"param.{n}": t.to(cfg.torch_dtype) for n, t in zip(PARAM_NAMES, params)}
    for name, tensor in ref.items():
        if name.startswith("param."):
            continue
        if name.startswith("eager."):   # a number: every rank's
            mine[name] = tensor
            continue
        placement = where["out" if name == "out.wrong_stream" else name]
        mine[name] = local_slice(tensor, placement, layout, rank)
    return mine


def expectations(case: Case, rank: int, device: torch.device, backward: bool = True) -> dict[str, torch.Tensor]:
    """This rank's slices of the reference run. With several ranks, rank 0 runs the
    reference once and writes each rank's slices to a folder of this machine
    (torch.distributed, initialized by the caller, synchronizes)."""
    if case.layout.world_size == 1:
        return rank_slices(reference(case, device, backward), case, 0)
    folder = [tempfile.mkdtemp(prefix="tpfuser-check-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    path = os.path.join(folder[0], "rank{}.pt")
    if rank == 0:
        ref = reference(case, device, backward)
        for r in range(case.layout.world_size):
            torch.save({k: v.cpu() for k, v in rank_slices(ref, case, r).items()}, path.format(r))
        del ref
        torch.cuda.empty_cache()
    dist.barrier()
    mine = torch.load(path.format(rank), map_location=device)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0], ignore_errors=True)
    return mine


