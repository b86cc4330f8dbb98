"""Where a call's GPU time goes, kernel by kernel, against what its work must
take at the rates the bench measures (the block's GEMMs' matmul rate, a
device-to-device copy's rate), and the GPU's idle gaps between kernels.

A kernel's work is known only where the profiler recorded the ATen op that
launched it (`record_shapes`): a GEMM op's FLOPs from its shapes (exactly), any
other op's input bytes (a lower bound of what it moves: the profiler records
no output shapes). Kernels launched by no ATen op (replayed from a CUDA graph,
nvFuser's own kernels, the Triton kernels torch.compile writes) have
their time and kind but no work: `unknown`, never a guess. A kind's total
(GEMMs, attention) is set against the plan's FLOPs for that kind, as the
compute floor counts. Pure Python: the tests feed it made-up events.
"""

from __future__ import annotations

import math
import re

# A kernel's kind, from its name: the first pattern that matches (case ignored), else "other".
# attention before gemm: flash attention's kernels are built on CUTLASS.
KIND_PATTERNS = (("collective", r"nccl"),
                 ("attention", r"flash|fmha|attention|sdpa"),
                 ("gemm", r"gemm|nvjet|xmma|cutlass|wgmma|cublas|triton_tem_\w*mm|nvfuser_matmul"))

# ATen ops whose FLOPs follow from their input shapes: the (a, b) operands' positions.
GEMM_OPS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::_addmm_activation": (1, 2),
            "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}

# The profiler's dtype names (its `dtypes()`), bytes per element.
DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
               "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
               "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::complex<float>": 8, "c10::complex<double>": 16}

# What each kernel's `basis` means (kept in the report beside the figures).
BASES = {"flops": "its op's GEMM FLOPs, from the recorded shapes, at the measured matmul rate",
         "input_bytes": "its op's input bytes, from the recorded shapes, at the measured copy rate "
                        "(outputs are not recorded: a lower bound of what it moves)",
         "shared": "its op launched other kernels too: the op's work is counted on its longest one",
         "unknown": "no ATen op with shapes launched it (a CUDA-graph replay, nvFuser's or Triton's own "
                    "launch) or its shapes' dtypes are not known: its work is not known here"}


def kernel_kind(name: str) -> str:
    for kind, pattern in KIND_PATTERNS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def op_flops(op: str | None, shapes) -> int | None:
    """2 M K N (times the batch) of a GEMM op from its input shapes; None for any other op."""
    if op not in GEMM_OPS or not shapes:
        return None
    i, j = GEMM_OPS[op]
    if max(i, j) >= len(shapes):
        return None
    a, b = shapes[i], shapes[j]
    if len(a) < 2 or len(a) != len(b) or a[-1] != b[-2]:
        return None
    return 2 * math.prod(a) * b[-1]


def input_bytes(shapes, dtypes) -> int | None:
    """Bytes of an op's tensor inputs; None where a tensor's dtype is not known."""
    if not shapes or dtypes is None or len(dtypes) != len(shapes):
        return None
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        if dtype in ("", "Scalar", "ScalarList", "TensorList") or (not shape and dtype not in DTYPE_BYTES):
            continue   # a scalar argument, not memory the kernel reads
        if dtype not in DTYPE_BYTES:
            return None
        total += math.prod(shape) * DTYPE_BYTES[dtype]
    return total


def attach_ops(kernels: list[tuple], launches: list[tuple]) -> list[dict]:
    """The timed pass's kernels (name, us, start us) with the op each was
    launched by, from a second pass recorded with shapes (name, op, op id,
    shapes, dtypes), in start order each. The k-th launch of a name in one pass
    is the k-th in the other; a name launched a different number of times in
    the two passes gets no op."""
    by_name: dict[str, list[tuple]] = {}
    for launch in launches:
        by_name.setdefault(launch[0], []).append(launch)
    timed: dict[str, int] = {}
    for name, *_ in kernels:
        timed[name] = timed.get(name, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for name, us, start in sorted(kernels, key=lambda k: k[2]):
        k = seen.get(name, 0)
        seen[name] = k + 1
        row = {"name": name, "us": us, "start": start, "op": None, "op_id": None, "shapes": None, "dtypes": None}
        if len(by_name.get(name, ())) == timed[name]:
            _, op, op_id, shapes, dtypes = by_name[name][k]
            row.update(op=op, op_id=op_id, shapes=shapes, dtypes=dtypes)
        out.append(row)
    return out


def gaps(kernels: list[tuple], calls: int) -> dict:
    """The GPU's idle gaps between kernels (name, us, start us): time after
    every kernel so far ended and before the next began (kernels that overlap,
    on several streams, leave none). Per call: their sum and count; the largest
    one, ms. The wait before the first kernel profiled is not seen."""
    ordered = sorted(kernels, key=lambda k: k[2])
    found = []
    if ordered:
        ended = ordered[0][2] + ordered[0][1]
        for _, us, start in ordered[1:]:
            if start > ended:
                found.append(start - ended)
            ended = max(ended, start + us)
    return {"sum_ms_per_call": sum(found) / calls / 1e3, "count_per_call": len(found) / calls,
            "largest_ms": max(found, default=0.0) / 1e3}


def roofline(kernels: list[tuple], launches: list[tuple], calls: int, matmul_flops_per_s: float,
             copy_bytes_per_s: float, kind_flops: dict[str, float] | None = None) -> dict:
    """Where `calls` calls' GPU time went: kernels (name, us, start us) as
    timed, launches (name, op, op id, shapes, dtypes) from a pass recorded
    with shapes (attach_ops). Each kernel per call: its time, its work where
    known (BASES), what that work takes at the measured rates, and the ratio
    of the two; launches alike (name, op, shapes) are one entry, the longest
    first. Each kind's total, set against kind_flops (the FLOPs per call the
    compute floor counts for a kind, e.g. {"gemm": ..., "attention": ...})
    where given. The idle gaps between kernels (gaps)."""
    launches = attach_ops(kernels, launches)
    by_op: dict = {}
    for launch in launches:   # an op that launched several kernels counts its work once, on its longest
        if launch["op_id"] is not None:
            by_op.setdefault(launch["op_id"], []).append(launch)
    counted = {id(max(group, key=lambda r: r["us"])) for group in by_op.values()}
    entries: dict = {}
    for launch in launches:
        key = (launch["name"], launch["op"], repr(launch["shapes"]))
        entry = entries.setdefault(key, {"name": launch["name"][:100], "kind": kernel_kind(launch["name"]),
                                         "op": launch["op"], "shapes": launch["shapes"], "us": 0.0, "count": 0,
                                         "flops": 0, "bytes": 0, "basis": "unknown"})
        entry["us"] += launch["us"]
        entry["count"] += 1
        if launch["op_id"] is None:
            continue
        if id(launch) not in counted:
            if entry["basis"] == "unknown":
                entry["basis"] = "shared"
            continue
        flops = op_flops(launch["op"], launch["shapes"])
        nbytes = None if flops is not None else input_bytes(launch["shapes"], launch["dtypes"])
        if flops is not None:
            entry["flops"] += flops
            entry["basis"] = "flops"
        elif nbytes is not None:
            entry["bytes"] += nbytes
            entry["basis"] = "input_bytes"
    rows = []
    for e in sorted(entries.values(), key=lambda e: -e["us"]):
        row = {"name": e["name"], "kind": e["kind"], "op": e["op"], "shapes": e["shapes"],
               "launches_per_call": e["count"] / calls, "ms_per_call": e["us"] / calls / 1e3, "basis": e["basis"]}
        if e["basis"] == "flops":
            row["flops_per_call"] = e["flops"] / calls
            row["bound_ms_per_call"] = row["flops_per_call"] / matmul_flops_per_s * 1e3
        elif e["basis"] == "input_bytes":
            row["bytes_per_call"] = e["bytes"] / calls
            row["bound_ms_per_call"] = row["bytes_per_call"] / copy_bytes_per_s * 1e3
        if row.get("bound_ms_per_call"):
            row["ratio"] = row["ms_per_call"] / row["bound_ms_per_call"]
        rows.append(row)
    kinds = {}
    for row in rows:
        k = kinds.setdefault(row["kind"], {"ms_per_call": 0.0, "kernels_per_call": 0.0, "unknown_ms_per_call": 0.0})
        k["ms_per_call"] += row["ms_per_call"]
        k["kernels_per_call"] += row["launches_per_call"]
        if row["basis"] == "unknown":
            k["unknown_ms_per_call"] += row["ms_per_call"]
    for kind, flops in (kind_flops or {}).items():
        if kind in kinds and flops:
            kinds[kind]["floor_flops_per_call"] = flops
            kinds[kind]["bound_ms_per_call"] = flops / matmul_flops_per_s * 1e3
            kinds[kind]["ratio"] = kinds[kind]["ms_per_call"] / kinds[kind]["bound_ms_per_call"]
    return {"kernels": rows, "kinds": kinds, "gaps": gaps(kernels, calls), "bases": BASES,
            "kind_patterns": {kind: pattern for kind, pattern in KIND_PATTERNS}}
