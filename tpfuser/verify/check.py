"""Checking every rank's outputs and gradients against the PyTorch reference
(verify/oracle.py runs it once and hands each rank its slices). Every rank
runs its fusions, under the schedule asked for, on its slices and compares:
the output and gradients within the bounds below, the dropout masks bit for
bit, and (bf16 with dropout) the output far from what the wrong ranks'
flash-attention streams give. A tensor's bf16 bound is 1.5x eager PyTorch's
own error on it where that exceeds the fixed one (tolerance()).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import torch

from tpfuser.block.tensors import BY_NAME, PARAM_NAMES
from tpfuser.config import BlockConfig, Layout
from tpfuser.parallel.collectives import backward_collectives, forward_collectives
from tpfuser.parallel.placements import DP
from tpfuser.parallel.schedules import Schedule, default_schedule, load_schedule
from tpfuser.runtime.block import ShardedBlock
from tpfuser.runtime.graphs import GraphedForward, GraphedTrainStep
from tpfuser.verify.commlog import captured_communications, compare_collectives, compare_rings
from tpfuser.verify.oracle import Case, expectations, rank_masks, rel_l2

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
                                    "(CPU, dropout 0, tools/probes/bf16_eager_error.py), the fusion's at 1.1e-2 "
                                    "(measured on the H200, 2026-12-03; docs/history.md), past the fixed 1e-2"),
    ("bf16", "wrong_stream"): (2.0, "replaying the wrong ranks' flash-attention streams must raise the branch "
                                    "error (out - x) this many times over the right replay's; measured on the H200 "
                                    "(2026-12-03; docs/history.md): nanogpt 25x, tiny 3.1-4.1x (its bf16 output "
                                    "rounding is already 4% of its small branch: weights of std 0.02 over e = 64)"),
}


def bound(dtype: str, quantity: str) -> float:
    return BOUNDS[dtype, quantity][0]


def tolerance(dtype: str, quantity: str, eager: float | None = None) -> float:
    """A check's bound on a tensor of `quantity` ("out" or "grad"): the fixed one,
    or where eager PyTorch's own error on that tensor is given and the margin
    times it is larger, that."""
    fixed = bound(dtype, quantity)
    return fixed if eager is None else max(fixed, bound(dtype, "eager_margin") * eager)


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
    schedule: str = ""
    repeats: dict | None = None   # {what: bool}: a second call equal to the first, bit for bit
    peak_gib: dict | None = None   # {phase: GiB}: the most torch's allocator held, in the reference, then the block

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
            ok &= all(v for v in self.graphs.values() if isinstance(v, bool))
        if self.repeats is not None:
            ok &= all(self.repeats.values())
        return bool(ok)

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _mask_mismatches(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, int]:
    """For each keep-mask among `tensors`: how many elements differ from the oracle's slice."""
    return {name: int((tensors[name] != mask).sum().item()) for name, mask in expected.items() if name in tensors}


def check(case: Case, rank: int = 0, backward: bool = True, dp_group=None, record_collectives: bool = False,
          preset_name: str = "", graphs: bool = False, device: torch.device | None = None,
          schedule: Schedule | str | dict | None = None, progress: Callable[[str], None] | None = None) -> RankReport:
    """Run this rank's fusions on its slices and compare with the reference's.

    The forward is the checking fusion (its masks as outputs); with `backward`,
    also the training forward and the backward (parameter gradients summed over
    dp after the fusion, over dp_group). record_collectives: capture what nvFuser
    posts in each (needs NVFUSER_DUMP=communication set before the process
    started) and compare it with the plan. graphs: also replay the forward (and
    the training step) from CUDA graphs (graphs.py) and compare them with the
    called block bit for bit. Needs torch.distributed initialized when the
    mesh has several ranks. device: the current CUDA device unless given.
    schedule: the block's (default: the layout's, schedules.default_schedule).
    Every pass is called twice and its second call must equal its first bit
    for bit (a race between streams shows there; flash attention's backward
    runs its deterministic kernel for it). progress: told each phase as it
    ends (a run that hangs then shows where)."""
    cfg, layout = case.cfg, case.layout
    schedule = default_schedule(layout) if schedule is None else load_schedule(schedule)
    device = device or torch.device("cuda", torch.cuda.current_device())
    _peak_gib(device)   # the count starts here
    clock = [time.perf_counter()]

    def lap(phase: str) -> None:   # the seconds since the last lap, once the GPU is done
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        clock.append(time.perf_counter())
        report.seconds[phase] = round(clock[-1] - clock[-2], 2)
        if progress:
            progress(f"{phase} done in {report.seconds[phase]:.1f} s")

    report = RankReport(preset_name, cfg.dtype, cfg.dropout, f"{layout.dp}x{layout.tp}", layout.sp, rank,
                        schedule=schedule.name, repeats={})
    exp = expectations(case, rank, device, backward)
    eager = {name.removeprefix("eager."): float(t) for name, t in exp.items() if name.startswith("eager.")}
    lap("reference")
    peak = {"reference": _peak_gib(device)}
    block = ShardedBlock(cfg, layout, rank, check=True, device=device, dp_group=dp_group, schedule=schedule)
    block.load_shards([exp[f"param.{n}"] for n in PARAM_NAMES])
    x, grad_out = exp["x"].to(cfg.torch_dtype), exp["grad_out"].to(cfg.torch_dtype)
    masks = rank_masks(case, rank, device)
    capture = captured_communications if record_collectives else (lambda: nullcontext([]))
    posted = {}

    with capture() as posted["forward"]:
        outs = block(x, case.rng_seed, case.rng_offset)
    lap("forward")
    again = block(x, case.rng_seed, case.rng_offset)
    report.repeats["forward"] = all(torch.equal(again[k], v) for k, v in outs.items())
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
        with capture() as posted["backward"], deterministic_attention():
            grad_x, grads = block.backward(grad_out, x, saved)
        lap("backward")
        named_2, saved_2 = block.forward_train(x, case.rng_seed, case.rng_offset)
        with deterministic_attention():
            grad_x_2, grads_2 = block.backward(grad_out, x, saved_2)
        written = [not BY_NAME[name].unwritten for name in block.saved_names()]
        report.repeats["training forward"] = (torch.equal(named_2["out"], named["out"]) and all(
            torch.equal(a, b) for a, b, w in zip(saved_2, saved, written) if w))
        report.repeats["backward"] = torch.equal(grad_x_2, grad_x) and all(
            torch.equal(a, b) for a, b in zip(grads_2, grads))
        errors = {"out": rel_l2(named["out"], exp["out"]), "x": rel_l2(grad_x, exp["grad_x"])}
        errors |= {n: rel_l2(g, exp[f"grad.{n}"]) for n, g in zip(PARAM_NAMES, grads)}
        # each tensor its own bound (bf16: from its own eager error); the worst is the largest error
        eager_names = {n: n if n == "out" else f"grad.{n}" for n in errors}   # eager_errors' names
        tolerances = {n: tolerance(cfg.dtype, "grad", eager.get(eager_names[n])) for n in errors}
        worst = max(errors, key=errors.get)
        report.backward = {"errors": errors, "tolerances": tolerances, "worst": errors[worst], "worst_tensor": worst,
                           "tolerance": tolerances[worst], "over_bound": [n for n in errors if errors[n] > tolerances[n]],
                           "mask_mismatches": _mask_mismatches(dict(zip(block.saved_names(), saved)), masks)}
        if eager:
            report.backward["eager_errors"] = {n: eager[eager_names[n]] for n in errors}
    if graphs:
        report.graphs = graph_equality(case, rank, exp, outs, backward, dp_group, schedule)
        lap("graphs")
    if record_collectives:
        report.collectives = compare_with_plan(posted, cfg, layout, rank, schedule)
    if device.type == "cuda":
        report.peak_gib = {**peak, "block": _peak_gib(device)}
    return report


def _peak_gib(device: torch.device) -> float | None:
    """The most memory torch's allocator has held on device since the last call (None off CUDA)."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    return round(peak / 2**30, 2)


CUBLAS_WORKSPACE_VAR = "CUBLAS_WORKSPACE_CONFIG"


@contextmanager
def deterministic_attention():
    """Around a backward whose second call must equal its first: ATen's flash
    attention backward sums its query gradient with atomics unless torch's
    deterministic algorithms are on and not warn-only (warn-only, it warns and
    keeps the atomics: attention_backward.cu; gpt3's second call differed so).
    On, torch refuses a cuBLAS call unless CUBLAS_WORKSPACE_CONFIG is one of
    its deterministic settings: set for the while when unset (the block's
    GEMMs each run on one stream, where cuBLAS gives the same bits anyway).
    Any other op without a deterministic kernel then raises instead of
    differing silently."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    workspace = os.environ.get(CUBLAS_WORKSPACE_VAR)
    if workspace is None:
        os.environ[CUBLAS_WORKSPACE_VAR] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        if workspace is None:
            os.environ.pop(CUBLAS_WORKSPACE_VAR, None)


def compare_with_plan(posted: dict[str, list[dict]], cfg: BlockConfig, layout: Layout, rank: int,
                      schedule: Schedule | None = None) -> dict:
    """Each phase's posted collectives (forward, training forward, backward)
    against the plan's over tp, on the rank's tp row (commlog.compare_collectives).
    Without the splits over a mesh axis of one device (the default), tp == 1
    plans none: nvFuser then posts nothing over that team of one."""
    schedule = schedule or default_schedule(layout)
    planned = {"forward": forward_collectives(cfg, layout, schedule),
               "training forward": forward_collectives(cfg, layout, schedule),
               "backward": [c for c in backward_collectives(cfg, layout, schedule) if c.axis != DP]}
    if layout.tp == 1 and not schedule.split_unit_axes:
        planned = {phase: [] for phase in planned}
    dp_rank, _ = layout.rank_coords(rank)
    team = [dp_rank * layout.tp + t for t in range(layout.tp)]
    out = {}
    for phase in posted:
        rings = [c for c in planned[phase] if c.algorithm == "ring"]
        out[phase] = compare_collectives([p for p in posted[phase] if p["kind"] != "p2p program"],
                                         [c for c in planned[phase] if c.algorithm != "ring"], team)
        programs = [p for p in posted[phase] if p["kind"] == "p2p program"]
        if rank != 0 and not programs:   # nvFuser prints host IR on device 0 only (csrc/host_ir/evaluator.cpp)
            out[phase]["rings"] = {"planned": len(rings), "lowered": None, "matches": None,
                                   "unseen": "nvFuser prints the host IR program on device 0 only: rank 0's stands "
                                             "for the tp row (the program is the same on every rank)"}
        elif rings or programs:
            out[phase]["rings"] = compare_rings(programs, rings)
            out[phase]["matches"] = out[phase]["matches"] and out[phase]["rings"]["matches"]
    return out


def graph_equality(case: Case, rank: int, exp: dict, host_outs: dict, backward: bool, dp_group,
                   schedule: Schedule) -> dict[str, bool]:
    """Replays from CUDA graphs against a called block with the same device keys,
    bit for bit, at the case's (seed, offset); with dropout, the next offset's
    replay must draw new masks, and the device keys the host keys' masks."""
    cfg, layout = case.cfg, case.layout
    shards = [exp[f"param.{n}"] for n in PARAM_NAMES]
    x, grad_out = exp["x"].to(cfg.torch_dtype), exp["grad_out"].to(cfg.torch_dtype)
    seed, offset = case.rng_seed, case.rng_offset

    # One block, called and graphed: its fusions compile once (compile time bounds the mesh checks).
    called = ShardedBlock(cfg, layout, rank, check=True, dp_group=dp_group,
                          schedule=schedule.replace(keys_on_device=True)).load_shards(shards)
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


def check_backward(cfg: BlockConfig, layout: Layout = Layout(), rank: int = 0, dp_group=None, schedule=None,
                   **seeds) -> dict[str, float]:
    """{tensor: rel L2 error} of this rank's gradients (check); raises if a saved mask differs from the oracle's."""
    report = check(Case(cfg, layout, **seeds), rank, dp_group=dp_group, schedule=schedule)
    wrong = {n: c for n, c in report.backward["mask_mismatches"].items() if c}
    if wrong:
        raise AssertionError(f"saved dropout masks differ from the oracle's: {wrong}")
    return report.backward["errors"]
