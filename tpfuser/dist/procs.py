"""The process table, from Linux's /proc (empty or None elsewhere): what the
launcher (launch.run_bounded) needs to find every process a run started, to
tell whether each still runs, and to say what a rank was doing."""

from __future__ import annotations

import os


def stat_fields(path: str) -> list[str] | None:
    """A /proc stat file's fields after "pid (comm) ": [0] state (stat's 3rd),
    [1] parent pid, [2] process group, [11] and [12] user and system CPU ticks,
    [19] start time; None if the process or thread is gone."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def processes() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (parent pid, process group, state, start time) of every process, from
    Linux's /proc; empty elsewhere."""
    table = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit() and (fields := stat_fields(f"/proc/{entry}/stat")) is not None:   # (or ended meanwhile)
            table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0], fields[19])
    return table


def tree(root: int) -> dict[int, str]:
    """pid -> start time of root, its process group and every descendant: torchrun
    starts each rank in a session of its own, out of reach of a signal to its group."""
    table = processes()
    found = {pid: row[3] for pid, row in table.items() if pid == root or row[1] == root}
    todo = list(found)
    while todo:
        parent = todo.pop()
        for pid, row in table.items():
            if row[0] == parent and pid not in found:
                found[pid] = row[3]
                todo.append(pid)
    return found


def threads_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds) of every thread of pid, from /proc."""
    threads = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return threads
    for tid in tids:
        fields = stat_fields(f"/proc/{pid}/task/{tid}/stat")
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if fields is not None:
            threads[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return threads


LABEL_VAR = "TPFUSER_PROCESS"   # the label of a run_bounded_all process that is no rank (e.g. a dtype's check)


def rank_of(pid: int) -> str | None:
    """The RANK a process was started with (a launcher's rank), else its
    LABEL_VAR, or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    found = dict(v.decode(errors="replace").split("=", 1) for v in env if v.startswith((b"RANK=", f"{LABEL_VAR}=".encode())))
    return found.get("RANK", found.get(LABEL_VAR))


def alive(tracked: dict[int, str]) -> list[int]:
    """The tracked processes still running (not zombies, and not a new process that reuses the pid)."""
    table = processes()
    return [pid for pid, start in tracked.items() if pid in table and table[pid][3] == start and table[pid][2] != "Z"]
