"""`tpfuser show`: a pass's fusions for people (a summary by the block's tensor
names), and nvFuser's text of them, optionally labelled with those names."""

from __future__ import annotations

import re

from tpfuser.parallel.linear_schedule import EXECUTOR_OVERLAPS
from tpfuser.parallel.passes import Pass

_TV = re.compile(r"\bT(\d+)_([gl])_")


def _tv_number(tv) -> str | None:
    m = re.match(r"T(\d+)_", str(tv))
    return m.group(1) if m else None


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def pass_summary(built: Pass, schedule=None, beside: dict | None = None) -> str:
    """A pass in a line per fusion: what goes in and out by the block's names,
    which operations nvFuser hands to ATen (the GEMMs, flash attention) and
    how many it fuses into kernels of its own between them; beside: {cut point:
    collectives.Collective} of the fusions the runtime runs with their collective
    beside the GEMM instead (runtime/chunked.chunked_pieces), said so on their line."""
    head = (f"{built.kind} pass, {built.cfg.dtype}, batch {built.cfg.batch}: {len(built.pieces)} fusion(s)"
            + (f" under schedule {schedule.name}" if schedule is not None else "")
            + ("" if built.meshed else ", without a device mesh"))
    lines = [head]
    for i, piece in enumerate(built.pieces):
        text = piece.fd.fusion.print_math()
        body = text[text.index("%kernel_math"):] if "%kernel_math" in text else text
        aten = {"linear": _count(r"= linear\(", body), "matmul": _count(r"= matmul\(", body),
                "flash attention": _count(r"= sdpa", body)}
        begins = f"from {piece.point!r}" if piece.point else "first"
        run_by_aten = ", ".join(f"{n} {k}" for k, n in aten.items() if n)
        if schedule is not None and "fuse_matmul" in schedule.options(piece.point).get("_enable_options", ()):
            run_by_aten += " (or nvFuser's own matmul kernel: fuse_matmul)"
        lines.append(f"  fusion {i} ({begins}): {', '.join(piece.inputs)} -> {', '.join(piece.outputs)}; "
                     f"{_count(r'(?m)^T[0-9]+_l', body)} fused" + (f"; run by ATen: {run_by_aten};" if run_by_aten else ""))
        if c := (beside or {}).get(piece.point):
            lines.append(f"    run instead by {RUNNERS[c.algorithm]}: its {c.kind} {c.where} "
                         + (f"as a ring of {c.chunks} steps, P2P by {c.backend} (a loop of nvFuser's host IR)"
                            if c.algorithm == "ring" else f"in {c.chunks} chunks, a fusion (or stream) each"))
    lines.append("(A -> B: its inputs and outputs; fused: the tensor expressions nvFuser fuses into kernels around "
                 "what ATen runs. `--ir` prints each fusion's text, `--names` labels it with these names)")
    return "\n".join(lines)


def pass_text(built: Pass, names: bool = False) -> str:
    """nvFuser's text of every fusion of the pass; with names, each input's and
    output's TensorView labelled with the block's name for it (T3[ln_1.weight])."""
    out = []
    for i, piece in enumerate(built.pieces):
        text = piece.fd.fusion.print_math()
        if names:
            label = {_tv_number(tv): name for name, tv in [*piece.inputs.items(), *piece.outputs.items(),
                                                            *piece.placed.items()] if tv.is_tensor()}
            text = _TV.sub(lambda m: f"T{m[1]}[{label[m[1]]}]_{m[2]}_" if m[1] in label else m[0], text)
        out.append(f"# fusion {i}" + (f" (from cut point {piece.point!r})" if piece.point else "") + "\n" + text)
    return "\n".join(out)


RUNNERS = {"fusions": "runtime/chunked.SideStreamChunks", "streams": "runtime/chunked.StreamAxisChunks",
           "ring": "runtime/chunked.RingSteps (parallel/ring.py's fusion, nvFuser's MultiDeviceExecutor)"}


def host_ir_text(cfg, layout, schedule) -> str:
    """What to run to see the host IR of a schedule's stream-chunked linears:
    nvFuser 0.2.36 lowers a fusion to host IR when it first runs, on the ranks
    of its mesh, so the text comes from a run (NVFUSER_DUMP=host_ir)."""
    streams = schedule.overlapped(*EXECUTOR_OVERLAPS)
    if not streams:
        return (f"schedule {schedule.name!r} has no linear on nvFuser's stream axis (overlap 'streams' or 'ring'): "
                f"nothing is lowered to host IR")
    return (f"schedule {schedule.name!r} lowers {', '.join(streams)} to host IR when they first run. "
            f"nvFuser 0.2.36 prints it then:\n  NVFUSER_DUMP=host_ir tpfuser check --preset <P> --dp {layout.dp} "
            f"--tp {layout.tp} --schedule {schedule.name} --forward-only --share-gpu")
