"""Reading what nvFuser reports: the collectives it posted
(NVFUSER_DUMP=communication), compared with the plan's, and the line of an
error that says what went wrong."""

from __future__ import annotations

import ctypes
import math
import os
import re
import sys
import tempfile
from contextlib import contextmanager


def parse_communication_log(text: str) -> list[dict]:
    """Every 'Posting Communication ...' line: kind, team, tensor shapes."""
    posted = []
    for line in text.splitlines():
        if "Posting Communication" not in line:
            continue
        kind = re.search(r"type=(\w+)", line)
        team = re.search(r"team=\(([\d ]+)\)", line)
        shapes = re.findall(r"(input|output)_tensor\s*\[([\d, ]*)\]", line)
        dtype = re.search(r"output=T\d+_\w_(\w+?)\[", line)   # e.g. T68_g_float[...]: the element type sent
        if kind and team:
            posted.append({"kind": kind.group(1).lower(), "team": [int(t) for t in team.group(1).split()],
                           "shapes": {k: [int(v) for v in s.replace(",", " ").split()] for k, s in shapes},
                           "dtype": dtype.group(1) if dtype else None, "line": line.strip()[:400]})
    return posted


def parse_host_ir_programs(text: str) -> list[dict]:
    """Every host IR program nvFuser printed (NVFUSER_DUMP=host_ir, when a MultiDeviceExecutor is built)
    that sends or receives: its steps (the extent of the stream loop holding its P2P communications)
    and each P2P communication once (type, backend, elements per rank of its buffer: a device-split
    axis counts one, reduction and broadcast axes none)."""
    programs = []
    for body in re.findall(r"%HostIrContainer \{(.*?)\} // %HostIrContainer", text, flags=re.S):
        p2p, steps = {}, None
        for block in re.split(r"\n\s*FOR streamIdx in ", body)[1:]:
            extent = int(re.match(r"\S+?\{(\d+)\}", block).group(1))
            for ident, kind, buffer, backend in re.findall(
                    r"P2PCommunication (\d+) \(type=(\w+), buffer=T\d+_\w+?\[([^\]]*)\][^\n]*?backend=(\w+)\)", block):
                axes = [a.strip() for a in buffer.split(",")]
                numel = math.prod(int(re.search(r"\{(\d+)\}", a).group(1)) for a in axes
                                  if a and not a.startswith(("ideviceIdx", "r", "b")))
                p2p[ident] = {"type": kind, "backend": backend.lower(), "numel": numel}
                steps = extent
        if p2p:
            programs.append({"steps": steps, "p2p": sorted(p2p.values(), key=lambda c: c["type"])})
    return programs


def compare_rings(programs: list[dict], planned) -> dict:
    """Are the P2P programs nvFuser lowered the planned rings (collectives.Collective with algorithm
    "ring"): for each, a loop of `chunks` steps holding one send and one receive of a rank's chunk
    (tensor / tp elements) by its backend? Order is not compared."""
    want = [{"steps": c.chunks, "p2p": [{"type": t, "backend": c.backend, "numel": math.prod(c.shape) // c.team}
                                        for t in ("recv", "send")]} for c in planned]

    def key(p):
        return p["steps"], tuple((c["type"], c["backend"], c["numel"]) for c in p["p2p"])
    return {"planned": want, "lowered": programs, "matches": sorted(map(key, programs)) == sorted(map(key, want))}


def compare_collectives(posted: list[dict], planned, team: list[int]) -> dict:
    """Are the posted collectives the planned ones: the same kinds, each with the
    same number of elements (of the larger of input and output: the unsharded
    tensor; a collective planned in N chunks, N times its Nth) and as many
    times, each over `team` (the rank's tp row: none over dp)? Order is not
    compared: nvFuser's segmenter may post independent collectives in another
    order than the plan lists them (the SP backward's all-reduces of
    LayerNorm gradients between its all-gathers, seen);
    `in_order` says whether it kept the plan's. `posted` as parsed from the log
    (with shapes), or as stored in a report (with numel)."""
    want = [{"kind": c.kind, "numel": math.prod(c.shape) // getattr(c, "chunks", 1)}
            for c in planned for _ in range(getattr(c, "chunks", 1))]
    got = [{"kind": p["kind"], "team": p["team"], "dtype": p.get("dtype"),
            "numel": p["numel"] if "numel" in p else
            max(math.prod(p["shapes"].get(k, [0])) for k in ("input", "output"))} for p in posted]

    def key(c):
        return c["kind"], c["numel"]
    same = all(g["team"] == team for g in got)
    return {"planned": want, "posted": got,
            "matches": same and sorted(map(key, got)) == sorted(map(key, want)),
            "in_order": same and list(map(key, got)) == list(map(key, want))}


@contextmanager
def captured_communications():
    """Yields a list that, after the body, holds the collectives nvFuser posted
    in it (parse_communication_log of what NVFUSER_DUMP=communication printed)
    and the P2P programs it lowered ("kind": "p2p program", parse_host_ir_programs).
    The process's stdout and stderr go to a file meanwhile; what is not a
    posted collective is written back to stdout afterwards."""
    posted: list[dict] = []
    libc = ctypes.CDLL(None)
    sys.stdout.flush(), sys.stderr.flush(), libc.fflush(None)
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1), os.dup2(tmp.fileno(), 2)
        try:
            yield posted
        finally:
            sys.stdout.flush(), sys.stderr.flush(), libc.fflush(None)
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            posted.extend(parse_communication_log(text))
            posted.extend({"kind": "p2p program", **p} for p in parse_host_ir_programs(text))
            text = re.sub(r"%HostIrContainer \{.*?\} // %HostIrContainer\n?", "", text, flags=re.S)
            rest = "".join(line + "\n" for line in text.splitlines() if "Posting Communication" not in line)
            if rest:
                sys.stdout.write(rest)
                sys.stdout.flush()


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


def error_message(e: BaseException, limit: int = 4000) -> str:
    """The whole message of an exception without the C++ backtraces nvFuser
    appends ("Exception raised from" and its "frame #" lines): a nested segment
    error keeps the lines that name the failing input, which error_line cuts."""
    kept = [ln.rstrip() for ln in str(e).splitlines()
            if ln.strip() and not ln.lstrip().startswith(("Exception raised from", "frame #"))]
    return "\n".join(kept)[:limit] or type(e).__name__
