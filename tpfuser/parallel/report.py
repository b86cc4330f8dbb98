"""The `plan` report: shapes, shardings, collectives, FLOPs and bytes per rank.
Pure Python: it needs neither a GPU nor nvFuser."""

from __future__ import annotations

import dataclasses
import math

from tpfuser.block.tensors import param_shapes, tensors
from tpfuser.config import BlockConfig, Layout
from tpfuser.parallel.collectives import backward_collectives, forward_collectives
from tpfuser.parallel.placements import forward_flops, local_shape, placements, saved_bytes_per_rank
from tpfuser.parallel.schedules import Schedule, default_schedule


def activation_shapes(cfg: BlockConfig) -> dict[str, tuple[int, ...]]:
    """The forward's input, output and the dropout masks it draws (tensors.py)."""
    return {t.name: t.shape(cfg) for t in tensors(cfg) if t.name in ("x", "out") or t.role == "mask"}


def plan_report(cfg: BlockConfig, layout: Layout, preset_name: str = "", schedule: Schedule | None = None) -> dict:
    """The plan under a schedule (default: the layout's): every tensor's
    placement, each linear's collectives forward and backward as the schedule
    runs them (stream chunks, or whole and why), FLOPs and bytes per rank."""
    schedule = schedule or default_schedule(layout)
    layout.check(cfg)
    schedule.check(cfg, layout)
    nbytes = cfg.torch_dtype.itemsize
    tensors = []
    where = placements(layout)
    for kind, shapes in (("input", {"x": activation_shapes(cfg)["x"]}),
                         ("param", param_shapes(cfg)),
                         ("output", {k: v for k, v in activation_shapes(cfg).items() if k != "x"})):
        for name, shape in shapes.items():
            placement = where[name]
            tensors.append({
                "name": name, "kind": kind, "global_shape": list(shape),
                "local_shape": list(local_shape(shape, placement, layout)),
                "sharding": {str(dim): axis for dim, axis in sorted(placement.items())},
            })
    param_bytes = sum(math.prod(t["local_shape"]) * nbytes for t in tensors if t["kind"] == "param")
    def rows(colls):
        return [c.as_dict() for c in colls]
    saved = {"tp": saved_bytes_per_rank(cfg, dataclasses.replace(layout, sp=False))}
    if cfg.seq % layout.tp == 0:
        saved["tp+sp"] = saved_bytes_per_rank(cfg, dataclasses.replace(layout, sp=True))
    return {
        "preset": preset_name, "config": {**cfg.__dict__}, "schedule": schedule.as_dict(),
        "mesh": {"dp": layout.dp, "tp": layout.tp}, "parallelism": "tp+sp" if layout.sp else "tp",
        "tensors": tensors,
        "collectives": rows(forward_collectives(cfg, layout, schedule)),
        "backward_collectives": rows(backward_collectives(cfg, layout, schedule)),
        "collectives_over_dp": 0,
        "flops_per_rank": forward_flops(cfg, layout),
        "param_bytes_per_rank": param_bytes,
        "saved_for_backward_bytes_per_rank": saved_bytes_per_rank(cfg, layout),
        "saved_for_backward_bytes_per_rank_by_parallelism": saved,
    }


RING_BACKENDS = {"nccl": "NCCL send/recv", "cuda": "the copy engine, CUDA IPC"}


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def format_schedule(schedule: dict) -> list[str]:
    """The schedule in a few lines: each linear, then the block-wide choices."""
    lines = [f"schedule {schedule['name']}:"]
    for name, plan in schedule["linears"].items():
        chunked = (f", a ring: a step per rank of tp, P2P by {RING_BACKENDS.get(plan['collective'], plan['collective'])}"
                   if plan["overlap"] == "ring" else
                   f", {plan['chunks']} stream chunks ({plan['overlap']})" if plan["chunks"] > 1 else "")
        lines.append(f"  {name:<12} {plan['style']:<10}{chunked}")
    cuts = ", ".join(schedule["cuts"]) or "none"
    options = ", ".join([*(f"+{o}" for o in schedule["enable_options"]), *(f"-{o}" for o in schedule["disable_options"])])
    lines.append(f"  cut into fusions at: {cuts}; dropout masks drawn {'by fusions of their own, one a mask' if schedule['masks'] == 'fusion' else 'inline'}; "
                 f"q/k/v by {schedule['qkv_split']}"
                 + (f"; masks hashed in {schedule['hash_ints']}" if schedule.get("hash_ints", "int64") != "int64" else "")
                 + (f"; nvFuser options {options}" if options else ""))
    return lines


def format_plan(rep: dict) -> str:
    m = rep["mesh"]
    par = "tensor + sequence parallel" if rep["parallelism"] == "tp+sp" else "tensor parallel"
    lines = [f"{rep['preset'] or 'block'} on a {m['dp']} x {m['tp']} mesh (dp on mesh_y, tp on mesh_x), {par}", ""]
    if "schedule" in rep:
        lines += format_schedule(rep["schedule"]) + [""]
    lines.append(f"{'tensor':<22}{'global':<22}{'per rank':<22}sharding")
    for t in rep["tensors"]:
        shard = ", ".join(f"dim {d} over {a}" for d, a in t["sharding"].items()) or "replicated"
        lines.append(f"{t['name']:<22}{str(tuple(t['global_shape'])):<22}{str(tuple(t['local_shape'])):<22}{shard}")
    for key, what in (("collectives", "forward"), ("backward_collectives", "backward")):
        lines += ["", f"collectives ({what}; nvFuser inserts those over tp):"]
        for c in rep[key]:
            chunks = (f", as a ring of {c['chunks']} steps, {c['p2p_steps']} of them a send and a receive of "
                      f"{_fmt_bytes(c['step_bytes'])} ({RING_BACKENDS.get(c['backend'], c['backend'])})"
                      if c.get("algorithm") == "ring" else
                      f", in {c['chunks']} chunks ({c['algorithm']})" if c.get("chunks", 1) > 1 else "")
            whole = f", whole: {c['whole_because']}" if c.get("whole_because") else ""
            lines.append(f"  {c['kind']} over {c['axis']} {c['where']}: {tuple(c['shape'])}, "
                         f"{_fmt_bytes(c['tensor_bytes'])}, {_fmt_bytes(c['wire_bytes_per_rank'])} sent per rank"
                         + chunks + whole
                         + ("  (a team of one: not split over, not posted)" if c["team"] == 1 else ""))
    if m["dp"] == 1:
        lines.append("  over dp: none (dp = 1)")
    f = rep["flops_per_rank"]
    lines += ["", f"matmul FLOPs per rank: {f['total'] / 1e9:.3g} GFLOP "
              f"({', '.join(f'{k} {v / 1e9:.3g}' for k, v in f.items() if k != 'total')})",
              f"parameter bytes per rank: {_fmt_bytes(rep['param_bytes_per_rank'])}",
              "saved for backward per rank (training): "
              + ", ".join(f"{_fmt_bytes(v)} under {k}" for k, v in rep["saved_for_backward_bytes_per_rank_by_parallelism"].items())]
    return "\n".join(lines)
