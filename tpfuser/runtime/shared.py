"""Every pass built in this process, by what defines it: blocks that would
define the same fusions (the bench's implementations, a test's blocks, a
module rebuilt) share them, and nvFuser compiles them once (its cache is a
fusion's own); within a pass, so do fusions defined alike (share_twins).
forget_fusions() empties it."""

from __future__ import annotations

import json

import torch

from tpfuser.config import BlockConfig, Layout
from tpfuser.parallel.passes import Pass, build_pass, share_twins
from tpfuser.parallel.schedules import Schedule

_PASSES: dict[tuple, Pass] = {}


def shared_pass(cfg: BlockConfig, kind: str, layout: Layout | None, check: bool, dp_rank: int,
                schedule: Schedule, device: torch.device) -> Pass:
    """build_pass's pass for a block under `schedule`, built at the first ask
    in this process, the same object after. Per device (nvFuser compiles for
    one) and per nvFuser options the schedule runs its fusions with: a fusion
    compiled under some options is not reused under others."""
    options = json.dumps([schedule.enable_options, schedule.disable_options, schedule.fusion_options], sort_keys=True)
    form = schedule.form()
    dp_rank = dp_rank if kind == "backward" else 0   # (a forward is the whole mesh's: build_pass reads no dp rank)
    key = (cfg, form, kind, layout, check, dp_rank, schedule.split_unit_axes, str(device), options)
    if key not in _PASSES:
        built = build_pass(cfg, form, kind, layout, check=check, dp_rank=dp_rank,
                           split_unit_axes=schedule.split_unit_axes)
        share_twins(built, form, schedule.options)
        _PASSES[key] = built
    return _PASSES[key]


def forget_fusions() -> int:
    """Drop every shared pass (blocks holding one keep theirs); how many there were."""
    count = len(_PASSES)
    _PASSES.clear()
    return count
