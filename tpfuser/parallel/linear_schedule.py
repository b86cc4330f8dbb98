"""One linear's schedule: its parallel style, how its collective runs beside
its GEMM (whole, in stream chunks, or as nvFuser's P2P ring) and the
collective's backend; checked where it is made (parallel/schedules.py holds
the whole block's)."""

from __future__ import annotations

from dataclasses import dataclass

from tpfuser.parallel.placements import LINEAR_STYLES

COLUMN = tuple(linear for linear, style in LINEAR_STYLES.items() if style == "column")
ROW = tuple(linear for linear, style in LINEAR_STYLES.items() if style == "row")
# How a linear's collective runs beside its GEMM: "none" (whole), "fusions" (cut into chunks along the
# tokens, a meshed fusion per chunk, launched by the block on side streams forked and joined with CUDA
# events: each posts its own collective; CUDA graphs capture it), "streams" (the chunks on nvFuser's
# stream axis, lowered to host IR), "ring" (nvFuser's P2P decomposition: tp steps, in step i the GEMM on
# the chunk in hand while the next arrives by send/recv; sequence parallelism only). "streams" and
# "ring" run through nvFuser's MultiDeviceExecutor with options of their own and are not capturable in
# CUDA graphs in nvFuser 0.2.36.
OVERLAPS = ("none", "fusions", "streams", "ring")
EXECUTOR_OVERLAPS = ("streams", "ring")
COLLECTIVES = ("nccl", "ucc", "cuda")    # nvFuser's communicator backends (CommunicatorBackend)


def refuse(field_name: str, expected: str, got) -> None:
    raise ValueError(f"schedule field {field_name!r}: expected {expected}, got {got!r}")


@dataclass(frozen=True)
class LinearSchedule:
    """One linear: style, chunks along the tokens (1: none), how they overlap, the collective's backend."""

    style: str
    chunks: int = 1
    overlap: str = "none"
    collective: str = "nccl"

    def check(self, linear: str) -> None:
        where = f"linears.{linear}"
        kind = "column" if linear in COLUMN else "row"
        if self.style not in (kind, f"{kind}-sp"):
            refuse(f"{where}.style", f"'{kind}' or '{kind}-sp' ({linear} is {kind}-parallel: its weight's "
                    f"{'output rows' if kind == 'column' else 'input columns'} are split over tp)", self.style)
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            refuse(f"{where}.chunks", "a positive int (stream chunks along the tokens; 1: none)", self.chunks)
        if self.overlap not in OVERLAPS:
            refuse(f"{where}.overlap", f"one of {', '.join(OVERLAPS)}", self.overlap)
        if self.overlap == "ring":
            if not self.sequence_parallel:
                refuse(f"{where}.overlap", f"'none', 'fusions' or 'streams' under tensor parallelism (style "
                        f"{self.style!r}): nvFuser has no P2P form of an all-reduce; a ring needs sequence "
                        f"parallelism (the schedules megatron-sp-ring, megatron-sp-ring-ce)", self.overlap)
        elif (self.chunks == 1) != (self.overlap == "none"):
            refuse(f"{where}.overlap", "'none' with chunks 1, and 'fusions', 'streams' or 'ring' with more"
                    f" (chunks is {self.chunks})", self.overlap)
        if self.collective not in COLLECTIVES:
            refuse(f"{where}.collective", f"one of {', '.join(COLLECTIVES)} (nvFuser's communicator backends)",
                    self.collective)
        if self.collective != "nccl" and self.overlap not in EXECUTOR_OVERLAPS:
            refuse(f"{where}.collective", f"'nccl' unless overlap is one of {', '.join(EXECUTOR_OVERLAPS)} (a "
                    "fusion run by fd.execute posts its collectives through NCCL; only nvFuser's "
                    "MultiDeviceExecutor takes another)", self.collective)

    @property
    def sequence_parallel(self) -> bool:
        return self.style.endswith("-sp")


class ChunksRefused(ValueError):
    """A linear's stream chunks that do not divide what it splits on this mesh (Schedule.check)."""

    def __init__(self, linear: str, what: str, rows: int, chunks: int):
        super().__init__(f"schedule field 'linears.{linear}.chunks': expected a divisor of {what} = {rows}, "
                         f"got {chunks}")
        self.what, self.rows = what, rows


def graphs_refused(schedule) -> str | None:
    """Why a schedule's block cannot be captured in a CUDA graph (a line), or None: the linears it runs
    through nvFuser's MultiDeviceExecutor (EXECUTOR_OVERLAPS), whose capture fails in nvFuser 0.2.36."""
    if not (executor := schedule.overlapped(*EXECUTOR_OVERLAPS)):
        return None
    return (f"schedule {schedule.name!r} runs {', '.join(executor)} through nvFuser's MultiDeviceExecutor "
            f"(overlap {schedule.linears[executor[0]].overlap!r}), which nvFuser 0.2.36 cannot capture in a CUDA "
            f"graph (docs/overlap.md): run it called, or use overlap 'fusions'")
