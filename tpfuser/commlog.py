"""Reading what nvFuser reports: the collectives it posted
(NVFUSER_DUMP=communication), compared with the plan's, and the line of an
error that says what went wrong."""

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


ERROR_MARKS = ("ASSERT FAILED", "Error from segmentation group", "NCCL error")


def error_line(e: BaseException, context: int = 1, limit: int = 600) -> str:
    """The first line of an exception that names nvFuser's assert, failing
    segment or NCCL error (else its first line), with `context` lines after it
    joined by ' | ': the message, without the C++ backtrace that follows."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    i = next((i for i, ln in enumerate(lines) if any(m in ln for m in ERROR_MARKS)), 0)
    return " | ".join(lines[i:i + 1 + context])[:limit]
