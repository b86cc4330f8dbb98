"""Reading the collectives nvFuser posted (NVFUSER_DUMP=communication) and
comparing them with the plan's."""

from __future__ import annotations

import re

from tpfuser.config import BlockConfig, Layout
from tpfuser.plan import backward_collectives, collectives


def parse_communication_log(text: str) -> list[dict]:
    """Every 'Posting Communication ...' line: kind, team, tensor shapes."""
    posted = []
    for line in text.splitlines():
        if "Posting Communication" not in line:
            continue
        kind = re.search(r"type=(\w+)", line)
        team = re.search(r"team=\(([\d ]+)\)", line)
        shapes = re.findall(r"(input|output)_tensor\s*\[([\d, ]*)\]", line)
        if kind and team:
            posted.append({"kind": kind.group(1).lower(), "team": [int(t) for t in team.group(1).split()],
                           "shapes": {k: [int(v) for v in s.replace(",", " ").split()] for k, s in shapes},
                           "line": line.strip()[:400]})
    return posted


def compare_first(posted: list[dict], cfg: BlockConfig, layout: Layout, backward: bool = False) -> dict:
    """Does the first posted collective match the plan's first (kind, tp team, produced shape)?
    With two ranks on one GPU, NCCL refuses after the first, so only it can be seen."""
    planned = backward_collectives(cfg, layout) if backward else collectives(cfg, layout)
    plan = [{"kind": c.kind, "axis": c.axis, "shape": list(c.shape)} for c in planned]
    first = posted[0] if posted else None
    match = bool(first) and first["kind"] == plan[0]["kind"] and first["team"] == list(range(layout.tp)) \
        and first["shapes"].get("output") == plan[0]["shape"]
    return {"posted": posted, "planned": plan, "first_matches_plan": match}
