"""Where a fresh process's first training step (or forward) goes, fusion by fusion.

One process: the module's construction and weights timed apart, then the first
call with each fusion's first execute timed (GPU synchronized), and nvFuser's
trace split per execute: segmenting, compileFusionParallel's wall time, the
kernels it compiled, NVRTC's summed and longest time. JSON on stdout.

    python3 tools/probes/first_call_probe.py --preset nanogpt --schedule megatron-cut-linears [--forward]
        [--no-twins]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tpfuser.bench.startup import CALLING, COMPILING, SEGMENTING, TRACE_EVENT  # noqa: E402  (bench --startup's)

PHASES = {SEGMENTING: "segmenting_s", COMPILING: "compile_wall_s"}


def closed_scopes(text: str) -> list[tuple[str, str, float, float, bool, float]]:
    """Every closed scope of an NVFUSER_TRACE text: (name, thread, begin, end
    in us, whether it is the outermost of its name on its thread, its own
    time in us: its span less the scopes directly inside it on its thread)."""
    spans, stacks = [], {}
    for m in TRACE_EVENT.finditer(text):
        stack = stacks.setdefault(m["tid"], [])
        if m["ph"] == "B":
            stack.append([m["name"], float(m["ts"]), 0.0])   # name, begin, time of the scopes inside
        elif stack:
            opened, begun, nested = stack.pop()
            end = float(m["ts"])
            if stack:
                stack[-1][2] += end - begun
            spans.append((opened, m["tid"], begun, end, not any(n == opened for n, *_ in stack), end - begun - nested))
    return spans


def split(text: str) -> list[dict]:
    """One row per outermost execute, in time order, on whatever thread ran it
    (the backward runs on autograd's): its wall time, its segmenting and
    compile wall time on that thread, the kernels compiled and NVRTC's time
    on any thread inside its window, and its wall time on its thread by the
    scope it was spent in, innermost (`self_s`, by name, nested scopes
    excluded; `untraced_s`: in the execute's own scope, in none inside it)."""
    spans = closed_scopes(text)
    calls = sorted((b, e, tid, mine) for n, tid, b, e, outer, mine in spans if n == CALLING and outer)
    rows = []
    for b, e, caller, mine_of_call in calls:
        inside = [(n, tid, sb, se, outer) for n, tid, sb, se, outer, _ in spans if sb >= b and se <= e]
        row = {"wall_s": (e - b) * 1e-6}
        for scope, key in PHASES.items():
            row[key] = sum(se - sb for n, tid, sb, se, outer in inside if n == scope and tid == caller and outer) * 1e-6
        own = {}
        for n, tid, sb, se, _, mine in spans:
            if tid == caller and sb >= b and se <= e and (sb, se) != (b, e):
                own[n] = own.get(n, 0.0) + mine * 1e-6
        row["self_s"] = dict(sorted(own.items(), key=lambda item: -item[1]))
        row["untraced_s"] = mine_of_call * 1e-6
        nvrtc = [se - sb for n, _, sb, se, _ in inside if n == "executor_utils::NVRTC"]
        row["kernels"] = sum(1 for n, *_ in inside if n == "KernelExecutor::compile")
        row["nvrtc_compiles"] = sum(1 for n, *_ in inside if n == "executor_utils::Nvrtc::CompileProgram")   # (not read back)
        row["nvrtc_sum_s"], row["nvrtc_max_s"] = sum(nvrtc) * 1e-6, max(nvrtc, default=0.0) * 1e-6
        row["kernel_compile_sum_s"] = sum(se - sb for n, _, sb, se, _ in inside if n == "KernelExecutor::compile") * 1e-6
        rows.append(row)
    return rows


def top_functions(profiler: cProfile.Profile, count: int = 15) -> list[str]:
    """The `count` functions with the most cumulative time, a line each."""
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(count)
    lines = [line.strip() for line in text.getvalue().splitlines()]
    begin = next((i for i, line in enumerate(lines) if line.startswith("ncalls")), len(lines))
    return [line for line in lines[begin + 1:] if line][:count]


def summary_line(d: dict) -> str:
    """One run's result in a line (the GPU suite's firstcall step and its summary)."""
    return (f"{d['first_call_s']:.1f} s after construct {d['construct_s']:.1f} + load {d['load_s']:.1f} "
            f"(import nvfuser_direct {d.get('import_nvfuser_s', float('nan')):.1f}); "
            f"segmenting {d['segmenting_s']:.1f}, compile wall {d['compile_wall_s']:.1f}, {d['kernels']} kernels, "
            f"NVRTC {d['nvrtc_sum_s']:.1f} summed")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--line", metavar="JSON", help="print an earlier run's result (its JSON) in a line, and stop")
    ap.add_argument("--preset", default="nanogpt")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--schedule", default="megatron-cut-linears")
    ap.add_argument("--forward", action="store_true", help="the forward alone, not the training step")
    ap.add_argument("--no-twins", action="store_true",
                    help="every fusion compiled, those defined alike too (passes.share_twins)")
    args = ap.parse_args()
    if args.line:
        with open(args.line) as f:
            print(summary_line(json.load(f)))
        return 0
    folder = tempfile.mkdtemp(prefix="first-call-")
    trace = os.path.join(folder, "trace.json")
    os.environ["NVFUSER_TRACE"] = trace
    os.environ.pop("TPFUSER_KERNEL_CACHE", None)   # cold, and no fusion of its own among the block's
    clock = [time.perf_counter()]

    def lap():
        import torch
        torch.cuda.synchronize()
        now = time.perf_counter()
        spent, clock[0] = now - clock[0], now
        return spent

    import torch
    out = {"schedule": args.schedule, "pass": "forward" if args.forward else "train",
           "twins": not args.no_twins,
           "NVFUSER_NUM_THREADS": os.environ.get("NVFUSER_NUM_THREADS", "(8)"), "import_torch_s": lap()}
    import nvfuser_direct  # noqa: F401
    out["import_nvfuser_s"] = lap()
    from tpfuser.config import preset
    from tpfuser.runtime.module import TPBlock
    from tpfuser.verify.reference import make_block, make_input
    from tpfuser.runtime import shared
    if args.no_twins:
        shared.share_twins = lambda *a: 0
    out["import_s"] = out["import_torch_s"] + out["import_nvfuser_s"] + lap()
    cfg = preset(args.preset, dtype=args.dtype, dropout=0.1)
    ref = make_block(cfg, dtype=torch.bfloat16, device="cuda", drawn_on="cuda")
    x = make_input(cfg, dtype=torch.bfloat16, device="cuda", drawn_on="cuda")
    grad = torch.randn_like(x)
    out["setup_s"] = lap()
    profiler = cProfile.Profile()
    profiler.enable()   # the construction and the load, by function (where the build's seconds go)
    model = TPBlock(cfg, schedule=args.schedule)
    out["construct_s"] = lap()
    model.load_full_state_dict(ref.state_dict())
    out["load_s"] = lap()
    profiler.disable()
    out["build_profile"] = top_functions(profiler)
    runner = model.runner
    order = []
    for kind in ("forward",) if args.forward else ("train", "backward"):
        for piece in runner.pass_of(kind).pieces:
            def timed(inputs, _execute=piece.execute, _name=f"{kind}:{piece.point or 'start'}", **kw):
                lap()
                result = _execute(inputs, **kw)
                order.append((_name, lap()))
                return result
            piece.execute = timed
    xg = x.detach().requires_grad_(True)
    begun = time.perf_counter()
    if args.forward:
        runner(x, 1234, 0)   # as bench --startup's forward: dropout on
    else:
        model(xg).backward(grad)
    lap()
    out["first_call_s"] = time.perf_counter() - begun
    ctypes = __import__("ctypes")
    ctypes.CDLL(None).fflush(None)
    with open(trace, errors="replace") as f:
        rows = split(f.read())
    # one trace row per execute of ours, in order, unless other fusions ran too (a chunked
    # linear's chunks): then the rows are kept apart, unmatched
    out["matched"] = len(rows) == len(order)
    out["pieces"] = [{"piece": name, "execute_s": s, **(rows[i] if out["matched"] else {})}
                     for i, (name, s) in enumerate(order)]
    if not out["matched"]:
        out["executes"] = rows
    for key in ("segmenting_s", "compile_wall_s", "nvrtc_sum_s", "kernel_compile_sum_s", "kernels"):
        out[key] = sum(r.get(key, 0) for r in rows)
    from tpfuser.verify.meshes import environment   # after the measurement: date, GPU, versions, command, commit
    out["environment"] = environment("python3 tools/probes/first_call_probe.py " + " ".join(sys.argv[1:]))
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
