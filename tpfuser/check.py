"""Checking every rank's outputs and gradients against the PyTorch reference.

One process (the only one, or rank 0) runs the reference block once, in
float32 on its GPU, on the global batch: the forward, and the backward from a
fixed upstream gradient. It sees the weights and input the fusion sees
(rounded to bf16 first when the fusion runs in bf16) and applies the very
dropout masks the ranks draw:
  - the fusion's hash masks, from (seed, offset) alone (dropout.keep_mask);
  - flash attention's (bf16), by replaying each (dp, tp) rank's stream
    (dropout.flash_seed) through ATen's flash kernel on that rank's rows and heads.
It hands every rank its slices of the weights, input and expected results
(through files in a folder of this machine when there are several ranks: the
checks run their ranks on one machine). Every rank then runs its fusions on its
slices and compares, masks bit for bit. Where the fusion runs in bf16 with
dropout, the reference also replays the wrong streams (each rank another rank's)
and the check must tell that run apart: the attention-dropout check is not vacuous.
In bf16 the same block also runs in eager PyTorch in bf16 (same masks, same
flash streams): 1.5x its own error on a tensor against the reference is that
tensor's bf16 bound where it exceeds the fixed one (tolerance()).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch

from tpfuser.commlog import captured_communications, compare_collectives
from tpfuser.config import BlockConfig, Layout
from tpfuser.dropout import flash_seed, keep_mask, stream_key
from tpfuser.plan import DP, backward_collectives, collectives, local_shape, placements
from tpfuser.fusion import saved_names
from tpfuser.reference import PARAM_NAMES, Block, Masks, make_block, make_input
from tpfuser.runtime import ShardedBlock, mask_shape, seeded_cuda_generator
from tpfuser.shard import fusion_params, local_slice, rank_params, slice_starts
from tpfuser.tensors import tensors

# Every bound the checks (and the GPU tests) apply: (dtype, quantity) -> (bound, why).
# "out" and "grad" are relative L2 errors, "wrong_stream" a factor.
BOUNDS: dict[tuple[str, str], tuple[float, str]] = {
    ("bf16", "out"): (1e-2, "bf16 rounds every stored activation (8 mantissa bits, ~4e-3 relative); "
                            "a few such roundings through the block stay under 1e-2"),
    ("fp32", "out"): (1e-5, "fp32 throughout, TF32 off: only the order of summation differs"),
    ("bf16", "grad"): (2e-2, "gradients pass through several bf16 roundings (activations, matmul outputs) "
                             "and sums over b*s rows"),
    ("fp32", "grad"): (1e-5, "as the output: only the order of summation differs"),
    ("bf16", "eager_margin"): (1.5, "a bf16 check allows each tensor this many times eager PyTorch's own bf16 "
                                    "error on it (the same block, masks and flash streams, against the same "
                                    "float32 reference) where that exceeds the fixed bound: the fusion rounds at "
                                    "other points than eager; gpt3's rows of 12288 put eager's output at 9.4e-3 "
                                    "(CPU, dropout 0, tools/bf16_eager_error.py), the fusion's at 1.1e-2 (run 23), "
                                    "past the fixed 1e-2"),
    ("bf16", "wrong_stream"): (2.0, "replaying the wrong ranks' flash-attention streams must raise the branch "
                                    "error (out - x) this many times over the right replay's; measured (run 9): "
                                    "nanogpt 25x, tiny 3.1-4.1x (its bf16 output rounding is already 4% of its "
                                    "small branch: weights of std 0.02 over e = 64)"),
}


def bound(dtype: str, quantity: str) -> float:
    return BOUNDS[dtype, quantity][0]


def tolerance(dtype: str, quantity: str, eager: float | None = None) -> float:
    """A check's bound on a tensor of `quantity` ("out" or "grad"): the fixed one,
    or where eager PyTorch's own error on that tensor is given and the margin
    times it is larger, that."""
    fixed = bound(dtype, quantity)
    return fixed if eager is None else max(fixed, bound(dtype, "eager_margin") * eager)


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
    import torch.distributed as dist
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


@dataclass
class RankReport:
    """One rank's check of one case: forward, backward and the collectives nvFuser posted."""

    preset: str
    dtype: str
    dropout: float
    mesh: str
    sp: bool
    rank: int
    forward: dict = field(default_factory=dict)
    backward: dict | None = None
    collectives: dict | None = None
    graphs: dict | None = None   # {what: bool}: replays equal to the called block, new masks at the next offset
    seconds: dict = field(default_factory=dict)   # wall time per phase, a fusion's first call (its compile) included

    @property
    def ok(self) -> bool:
        fwd = self.forward
        ok = fwd["rel_err"] <= fwd["tolerance"] and not any(fwd["mask_mismatches"].values())
        if "wrong_stream_branch_rel_err" in fwd:
            ok &= fwd["wrong_stream_branch_rel_err"] >= bound("bf16", "wrong_stream") * fwd["branch_rel_err"]
        if self.backward is not None:
            bwd = self.backward
            within = not bwd["over_bound"] if "over_bound" in bwd else bwd["worst"] <= bwd["tolerance"]   # (older reports)
            ok &= within and not any(bwd["mask_mismatches"].values())
        if self.collectives is not None:
            ok &= all(phase["matches"] for phase in self.collectives.values())
        if self.graphs is not None:
            ok &= all(self.graphs.values())
        return bool(ok)

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _mask_mismatches(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, int]:
    """For each keep-mask among `tensors`: how many elements differ from the oracle's slice."""
    return {name: int((tensors[name] != mask).sum().item()) for name, mask in expected.items() if name in tensors}


def check(case: Case, rank: int = 0, backward: bool = True, mesh: bool = True, dp_group=None,
          record_collectives: bool = False, preset_name: str = "", graphs: bool = False,
          device: torch.device | None = None, split_unit_axes: bool = False,
          progress: Callable[[str], None] | None = None) -> RankReport:
    """Run this rank's fusions on its slices and compare with the reference's.

    The forward is the checking fusion (its masks as outputs); with `backward`,
    also the training forward and the backward (parameter gradients summed over
    dp after the fusion, over dp_group). record_collectives: capture what nvFuser
    posts in each (needs NVFUSER_DUMP=communication set before the process
    started) and compare it with the plan. graphs: also replay the forward (and
    the training step) from CUDA graphs (graphs.py) and compare them with the
    called block bit for bit. Needs torch.distributed initialized when the
    mesh has several ranks. device: the current CUDA device unless given.
    split_unit_axes=True: the block's fusions split over a mesh axis of one
    device too (fusion.schedule), the graphed ones as well. progress: told
    each phase as it ends (a run that hangs then shows where)."""
    cfg, layout = case.cfg, case.layout
    device = device or torch.device("cuda", torch.cuda.current_device())
    clock = [time.perf_counter()]

    def lap(phase: str) -> None:   # the seconds since the last lap, once the GPU is done
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        clock.append(time.perf_counter())
        report.seconds[phase] = round(clock[-1] - clock[-2], 2)
        if progress:
            progress(f"{phase} done in {report.seconds[phase]:.1f} s")

    report = RankReport(preset_name, cfg.dtype, cfg.dropout, f"{layout.dp}x{layout.tp}", layout.sp, rank)
    exp = expectations(case, rank, device, backward)
    eager = {name.removeprefix("eager."): float(t) for name, t in exp.items() if name.startswith("eager.")}
    lap("reference")
    block = ShardedBlock(cfg, layout, rank, check=True, device=device, mesh=mesh, dp_group=dp_group,
                         split_unit_axes=split_unit_axes)
    block.load_shards([exp[f"param.{n}"] for n in PARAM_NAMES])
    x, grad_out = exp["x"].to(cfg.torch_dtype), exp["grad_out"].to(cfg.torch_dtype)
    masks = rank_masks(case, rank, device)
    capture = captured_communications if record_collectives else (lambda: nullcontext([]))
    posted = {}

    with capture() as posted["forward"]:
        outs = block(x, case.rng_seed, case.rng_offset)
    lap("forward")
    out, xf = outs["out"], exp["x"]
    report.forward = {"rel_err": rel_l2(out, exp["out"]), "branch_rel_err": rel_l2(out.float() - xf, exp["out"] - xf),
                      "tolerance": tolerance(cfg.dtype, "out", eager.get("out")),
                      "mask_mismatches": _mask_mismatches(outs, masks),
                      "keep_rates": {n: outs[n].float().mean().item() for n in masks}}
    if eager:
        report.forward["eager_rel_err"] = eager["out"]
    if "out.wrong_stream" in exp:
        report.forward["wrong_stream_branch_rel_err"] = rel_l2(out.float() - xf, exp["out.wrong_stream"] - xf)

    if backward:
        with capture() as posted["training forward"]:
            named, saved = block.forward_train(x, case.rng_seed, case.rng_offset)
        lap("training forward")
        with capture() as posted["backward"]:
            grad_x, grads = block.backward(grad_out, x, saved)
        lap("backward")
        errors = {"out": rel_l2(named["out"], exp["out"]), "x": rel_l2(grad_x, exp["grad_x"])}
        errors |= {n: rel_l2(g, exp[f"grad.{n}"]) for n, g in zip(PARAM_NAMES, grads)}
        # each tensor its own bound (bf16: from its own eager error); the worst is the largest error
        eager_names = {n: n if n == "out" else f"grad.{n}" for n in errors}   # eager_errors' names
        tolerances = {n: tolerance(cfg.dtype, "grad", eager.get(eager_names[n])) for n in errors}
        worst = max(errors, key=errors.get)
        report.backward = {"errors": errors, "tolerances": tolerances, "worst": errors[worst], "worst_tensor": worst,
                           "tolerance": tolerances[worst], "over_bound": [n for n in errors if errors[n] > tolerances[n]],
                           "mask_mismatches": _mask_mismatches(dict(zip(saved_names(cfg), saved)), masks)}
        if eager:
            report.backward["eager_errors"] = {n: eager[eager_names[n]] for n in errors}
    if graphs:
        report.graphs = graph_equality(case, rank, exp, outs, backward, dp_group, mesh, split_unit_axes)
        lap("graphs")
    if record_collectives:
        report.collectives = compare_with_plan(posted, cfg, layout, rank, split_unit_axes)
    return report


def compare_with_plan(posted: dict[str, list[dict]], cfg: BlockConfig, layout: Layout, rank: int,
                      split_unit_axes: bool = False) -> dict:
    """Each phase's posted collectives (forward, training forward, backward)
    against the plan's over tp, on the rank's tp row (commlog.compare_collectives).
    Without the splits over a mesh axis of one device (the default), tp == 1
    plans none: nvFuser then posts nothing over that team of one."""
    planned = {"forward": collectives(cfg, layout), "training forward": collectives(cfg, layout),
               "backward": [c for c in backward_collectives(cfg, layout) if c.axis != DP]}
    if layout.tp == 1 and not split_unit_axes:
        planned = {phase: [] for phase in planned}
    dp_rank, _ = layout.rank_coords(rank)
    team = [dp_rank * layout.tp + t for t in range(layout.tp)]
    return {phase: compare_collectives(posted[phase], planned[phase], team) for phase in posted}


def graph_equality(case: Case, rank: int, exp: dict, host_outs: dict, backward: bool, dp_group,
                   mesh: bool, split_unit_axes: bool = False) -> dict[str, bool]:
    """Replays from CUDA graphs against a called block with the same device keys,
    bit for bit, at the case's (seed, offset); with dropout, the next offset's
    replay must draw new masks, and the device keys the host keys' masks."""
    from tpfuser.graphs import GraphedForward, GraphedTrainStep
    cfg, layout = case.cfg, case.layout
    shards = [exp[f"param.{n}"] for n in PARAM_NAMES]
    x, grad_out = exp["x"].to(cfg.torch_dtype), exp["grad_out"].to(cfg.torch_dtype)
    seed, offset = case.rng_seed, case.rng_offset

    # One block, called and graphed: its fusions compile once (compile time bounds the mesh checks).
    called = ShardedBlock(cfg, layout, rank, check=True, mesh=mesh, dp_group=dp_group,
                          keys_on_device=True, split_unit_axes=split_unit_axes).load_shards(shards)
    outs = {k: v.clone() for k, v in called(x, seed, offset).items()}
    result = {}
    masks = [n for n in outs if n != "out"]
    if masks:
        result["device keys draw the host keys' masks"] = all(torch.equal(outs[n], host_outs[n]) for n in masks)
    forward = GraphedForward(called)
    replayed = {k: v.clone() for k, v in forward(x, seed, offset).items()}
    result["forward equal"] = all(torch.equal(replayed[k], v) for k, v in outs.items())
    if cfg.dropout > 0:
        result["forward next offset differs"] = not all(torch.equal(forward(x, seed, offset + 1)[n], replayed[n])
                                                        for n in masks)
    if backward:
        named, saved = called.forward_train(x, seed, offset)
        c_grad_x, c_grads = called.backward(grad_out, x, saved)
        out, grad_x, grads = GraphedTrainStep(called)(x, grad_out, seed, offset)
        result["train step equal"] = (torch.equal(out, named["out"]) and torch.equal(grad_x, c_grad_x)
                                      and all(torch.equal(a, b) for a, b in zip(grads, c_grads)))
    return result


def check_forward(cfg: BlockConfig, layout: Layout = Layout(), rank: int = 0, preset_name: str = "",
                  **seeds) -> RankReport:
    """The forward alone (check)."""
    return check(Case(cfg, layout, **seeds), rank, backward=False, preset_name=preset_name)


def check_backward(cfg: BlockConfig, layout: Layout = Layout(), rank: int = 0, mesh: bool = True,
                   dp_group=None, **seeds) -> dict[str, float]:
    """{tensor: rel L2 error} of this rank's gradients (check); raises if a saved mask differs from the oracle's."""
    report = check(Case(cfg, layout, **seeds), rank, mesh=mesh, dp_group=dp_group)
    wrong = {n: c for n, c in report.backward["mask_mismatches"].items() if c}
    if wrong:
        raise AssertionError(f"saved dropout masks differ from the oracle's: {wrong}")
    return report.backward["errors"]
