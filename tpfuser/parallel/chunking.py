"""Whether each collective of a chunked linear runs in the schedule's stream
chunks or whole, and why whole (what nvFuser 0.2.36 does not lower, what is
not built): schedules.py's, in a module of its own (re-exported there)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpfuser.parallel.schedules import Schedule


# Why a collective of a chunked linear runs whole, by (overlap form, phase, collective kind).
_NOT_LOWERED = ("nvFuser 0.2.36 does not lower a reduce-scatter chunked on its stream axis "
                "(it asserts: docs/overlap.md)")
_FEEDS_WEIGHT_GRADIENT = ("the gathered gradient feeds the weight gradient too: chunking the gather and both "
                          "matmuls is not built")
_WHOLE_LAYERNORM = "the weight gradient reads the whole gathered LayerNorm output: not chunked"
_WHOLE = {
    ("streams", "forward", "reducescatter"): _NOT_LOWERED,
    ("streams", "backward", "reducescatter"): _NOT_LOWERED,
    ("streams", "backward", "allreduce"): ("nvFuser's stream axis is applied to the forward's linears only here "
                                           "(the fusions form chunks the backward's)"),
    **{(form, "backward", "allgather"): _FEEDS_WEIGHT_GRADIENT for form in ("streams", "fusions")},
    **{(form, "backward weight", "allgather"): _WHOLE_LAYERNORM for form in ("streams", "fusions")},
}


def collective_chunks(schedule: Schedule, linear: str, kind: str, phase: str) -> tuple[int, str]:
    """(stream chunks, why it runs whole if it does) of one of a linear's collectives
    (phase: "forward", "backward", or "backward weight" for the gather its weight
    gradient reads) under the schedule."""
    plan = schedule.linears[linear]
    if plan.chunks == 1:
        return 1, ""
    why = _WHOLE.get((plan.overlap, phase, kind), "")
    return (1, why) if why else (plan.chunks, "")
