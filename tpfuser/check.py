"""Checking a rank's fusion outputs against the PyTorch reference block.

The reference runs in float32 on this rank's batch slice, with the weights
and input the fusion got (rounded to bf16 first when the fusion runs in bf16),
and applies the very dropout masks the fusion drew: the residual masks come
back as fusion outputs; in bf16 the attention dropout lives inside flash
attention, which the reference replays by restoring the CUDA generator and
calling the same ATen kernel.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from tpfuser.config import BlockConfig, Layout
from tpfuser.reference import Masks, make_block, make_input
from tpfuser.dropout import keep_mask, stream_key
from tpfuser.plan import placements
from tpfuser.runtime import ShardedBlock, mask_shape
from tpfuser.shard import local_slice

# Relative L2 error allowed on the block output, per dtype.
TOLERANCES = {
    # bf16 rounds every stored activation (8 mantissa bits, ~4e-3 relative);
    # errors of a few such roundings through the block stay under 1e-2.
    "bf16": 1e-2,
    # fp32 throughout, TF32 off: only the order of summation differs.
    "fp32": 1e-5,
}


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double().cpu(), expected.double().cpu()
    return (torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e)).item()


def flash_replay(p: float, rng_state: torch.Tensor):
    """Attention through ATen's flash kernel in bf16, its dropout replayed from rng_state."""
    def attention(q, k, v):
        torch.cuda.set_rng_state(rng_state)
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q.bfloat16(), k.bfloat16(), v.bfloat16(), p, True)[0]
        return out.float()
    return attention


@dataclass
class CheckResult:
    preset: str
    dtype: str
    dropout: float
    mesh: str
    rank: int
    rel_err: float
    tolerance: float
    # Error of the branches alone ((out - x) against (expected - x)): the
    # residual x dominates `out`, so this is the sharper signal.
    branch_rel_err: float = float("nan")
    keep_rates: dict = field(default_factory=dict)
    mask_digests: dict = field(default_factory=dict)   # to compare masks across ranks cheaply
    # Elements where the fusion's mask differs from the rank's slice of the
    # unsharded mask (dropout.keep_mask on the global shape): 0 when sharding-independent.
    mask_mismatches: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.rel_err <= self.tolerance and not any(self.mask_mismatches.values())

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def oracle_masks(cfg: BlockConfig, rng_seed: int, rng_offset: int, device) -> Masks:
    """The unsharded run's keep-masks, computed with torch from (seed, offset)
    alone (dropout.keep_mask): what every rank's fusion must draw a slice of.
    In bf16 the attention dropout is flash attention's own (flash_replay)."""
    def draw(stream):
        return keep_mask(stream_key(rng_seed, rng_offset, stream), cfg.dropout, mask_shape(cfg, stream), device=device)
    return Masks(resid_attn=draw("resid_attn"), resid_mlp=draw("resid_mlp"),
                 attn=draw("attn") if cfg.dtype == "fp32" else None)


def _mask_mismatches(tensors: dict[str, torch.Tensor], masks: Masks, layout: Layout, rank: int) -> dict[str, int]:
    """For each keep-mask among `tensors` (names ending in _keep): how many of its
    elements differ from this rank's slice of the oracle's mask."""
    return {name: int((t != local_slice(getattr(masks, name.removesuffix("_keep")), placements(layout)[name],
                                        layout, rank)).sum().item())
            for name, t in tensors.items() if name.endswith("_keep")}


def _rank_part(t: torch.Tensor, block: ShardedBlock) -> torch.Tensor:
    """This rank's part of a tensor covering its dp rank's batch slice."""
    return t.chunk(block.layout.tp, dim=1)[block.tp_rank] if block.layout.sp else t


def check_forward(cfg: BlockConfig, layout: Layout = Layout(), rank: int = 0, preset_name: str = "",
                  rng_seed: int = 1234, rng_offset: int = 0, weight_seed: int = 0) -> CheckResult:
    """Run this rank's fusion and compare its output with the reference's slice."""
    if cfg.dropout > 0 and layout.tp > 1 and cfg.dtype == "bf16":
        raise NotImplementedError("bf16 attention dropout at tp > 1 cannot be checked: flash attention draws "
                                  "it from each rank's own generator; use fp32 or --dropout 0")
    device = torch.device("cuda", torch.cuda.current_device())
    block = ShardedBlock(cfg, layout, rank, check=True, device=device)
    ref = make_block(cfg, seed=weight_seed)
    x = make_input(cfg)
    if cfg.dtype == "bf16":  # the reference sees exactly the values the fusion sees
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.bfloat16().float())
        x = x.bfloat16().float()
    block.load(ref.state_dict())

    rng_state = torch.cuda.get_rng_state()
    outs = block(block.shard_input(x), rng_seed, rng_offset)
    out = outs["out"]

    masks, attention = None, None
    if cfg.dropout > 0:
        masks = oracle_masks(cfg, rng_seed, rng_offset, device)
        if cfg.dtype == "bf16":
            attention = flash_replay(cfg.dropout, rng_state)
    elif cfg.dtype == "bf16":
        attention = flash_replay(0.0, rng_state)
    ref = ref.to(device)
    with torch.no_grad():
        # The reference sees this dp rank's whole sequences (attention needs
        # them); under sequence parallelism the rank's output is a slice of it.
        x_dp = x.chunk(layout.dp, dim=0)[block.dp_rank].to(device)
        expected = _rank_part(ref(x_dp, masks and masks.batch_slice(layout.dp, block.dp_rank), attention), block)

    x_local = _rank_part(x_dp, block)
    result = CheckResult(preset_name, cfg.dtype, cfg.dropout, f"{layout.dp}x{layout.tp}", rank,
                         rel_l2(out, expected), TOLERANCES[cfg.dtype],
                         rel_l2(out.float() - x_local, expected - x_local))
    result.mask_mismatches = _mask_mismatches(outs, masks, layout, rank)
    for name, t in outs.items():
        if name.endswith("_keep"):
            result.keep_rates[name] = t.float().mean().item()
            flat = t.flatten().to(torch.int64)
            result.mask_digests[name] = int((flat * torch.arange(1, flat.numel() + 1, device=flat.device)).sum() % (1 << 61))
    if attention is not None:
        result.notes.append("attention through ATen flash attention, dropout replayed from the CUDA generator")
    return result


# Relative L2 error allowed on every gradient. bf16: gradients pass through
# several bf16 roundings (activations, matmul outputs) and sums over b*s rows.
GRAD_TOLERANCES = {"bf16": 2e-2, "fp32": 1e-5}


def check_backward(cfg: BlockConfig, layout: Layout = Layout(), rank: int = 0, mesh: bool = True,
                   rng_seed: int = 1234, rng_offset: int = 5, dp_group=None) -> dict:
    """This rank's gradients (input and every parameter shard) against the
    matching slices of reference autograd's, with the fusion's dropout masks.
    Returns {tensor: rel L2 error}. Parameter gradients are summed over dp
    (after the fusion, over dp_group), so on a dp x 1 mesh each rank's must
    equal the whole batch's. Raises if a saved dropout mask differs from the oracle's."""
    from tpfuser.fusion import saved_names
    from tpfuser.reference import PARAM_NAMES
    from tpfuser.shard import qkv_heads_interleaved
    device = torch.device("cuda", torch.cuda.current_device())
    ref = make_block(cfg)
    x, grad_out = make_input(cfg), make_input(cfg, seed=2)
    if cfg.dtype == "bf16":
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.bfloat16().float())
        x, grad_out = x.bfloat16().float(), grad_out.bfloat16().float()
    block = ShardedBlock(cfg, layout, rank, check=True, device=device, mesh=mesh,
                         dp_group=dp_group).load(ref.state_dict())
    xl, gl = block.shard_input(x), block.shard_input(grad_out)
    rng_state = torch.cuda.get_rng_state()
    named, saved = block.forward_train(xl, rng_seed, rng_offset)
    grad_x, grads = block.backward(gl, xl, saved)

    ref = ref.to(device)
    masks = oracle_masks(cfg, rng_seed, rng_offset, device) if cfg.dropout > 0 else None
    # The masks the backward took are the oracle's, bit for bit.
    for name, wrong in _mask_mismatches(dict(zip(saved_names(cfg), saved)), masks, layout, rank).items():
        if wrong:
            raise AssertionError(f"saved dropout mask {name}: {wrong} elements differ from the oracle's")
    where = placements(layout)
    attention = flash_replay(cfg.dropout, rng_state) if cfg.dtype == "bf16" else None
    xr = x.to(device).requires_grad_(True)
    out = ref(xr, masks, attention)
    out.backward(grad_out.to(device))
    errors = {"out": rel_l2(named["out"], local_slice(out.detach(), where["out"], layout, rank)),
              "x": rel_l2(grad_x, local_slice(xr.grad, where["grad_x"], layout, rank))}
    ref_grads = dict(ref.named_parameters())
    for name, g in zip(PARAM_NAMES, grads):
        r = ref_grads[name].grad
        if name.startswith("attn.c_attn"):   # the fusion's rows are head by head
            r = qkv_heads_interleaved(r, cfg.n_head)
        errors[name] = rel_l2(g, local_slice(r, where[f"grad.{name}"], layout, rank))
    return errors
