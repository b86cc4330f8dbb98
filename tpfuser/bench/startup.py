"""`tpfuser bench --startup`: what a user waits for before the first result.

Each implementation's forward (or, with --train, training step) runs in a fresh process:
its imports, the module's construction (weights loaded), the first call (what
compiles) and a second call, timed with the GPU synchronized. torch.compile
gets fresh inductor and Triton cache folders, so that nothing compiled by an
earlier process is reused. nvFuser's first call is split, from its own trace
(NVFUSER_TRACE), into segmenting (SegmentCandidateFinder: the search for
kernels), compiling kernels (compileFusionParallel: NVRTC, several threads)
and the rest. One GPU, no mesh beyond 1x1.

    python3 -m tpfuser.bench.startup '{"impl": "nvfuser", "pass": "forward", ...}'   # one child
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

STARTUP_IMPLS = ("nvfuser", "compile", "compile-reduce-overhead", "eager")
CHILD_TIMEOUT_S = 600
CACHE_VAR = "TPFUSER_KERNEL_CACHE"   # runtime/kernel_cache.py's (not imported: it imports torch, the child times that)
TRACE_EVENT = re.compile(   # one event of an NVFUSER_TRACE file (tools/probes/first_call_probe.py reads it too)
    r'\{ "name": "(?P<name>[^"]*)", "ph": "(?P<ph>[BE])", "pid": \d+, "tid": (?P<tid>\d+), '
                    r'"ts": (?P<ts>[0-9.]+) \}')
SEGMENTING = "SegmentCandidateFinder::SegmentCandidateFinder"
COMPILING = "FusionKernelRuntime::compileFusionParallel"
CALLING = "FusionExecutorCache::runFusionWithInputs"   # begins on the thread that called execute


def trace_phases(text: str) -> dict[str, float]:
    """Wall seconds nvFuser's callers spent in its segmenter and in compiling
    kernels, from an NVFUSER_TRACE file's text (complete or cut short: read
    line by line). A caller is a thread that ran an execute: the training
    step's backward runs on autograd's device thread, not the one that called
    the forward. Outermost scopes only, inside an execute on the same thread:
    the compile's worker threads open the same scope again, in the caller's time."""
    stacks: dict[str, list[tuple[str, float]]] = {}
    spent = {SEGMENTING: 0.0, COMPILING: 0.0}
    for m in TRACE_EVENT.finditer(text):
        stack = stacks.setdefault(m["tid"], [])
        if m["ph"] == "B":
            stack.append((m["name"], float(m["ts"])))
            continue
        if not stack:
            continue
        name, begun = stack.pop()
        # inside an execute on this thread (a worker's scopes are not; a thread id the
        # system gave again to a worker neither), and not inside one of its own name
        if name in spent and any(n == CALLING for n, _ in stack) and not any(n == name for n, _ in stack):
            spent[name] += (float(m["ts"]) - begun) * 1e-6
    return {"segmenting_s": spent[SEGMENTING], "compiling_kernels_s": spent[COMPILING]}


def _child_command(spec: dict) -> list[str]:
    return [sys.executable, "-m", "tpfuser.bench.startup", json.dumps(spec)]


def run_startup(preset_name: str, cfg, layout, schedule, impls=None, train: bool = False,
                timeout_s: float = CHILD_TIMEOUT_S, progress=print) -> dict:
    """Every implementation's forward (train: its training step), each in a fresh process."""
    impls = tuple(impls or STARTUP_IMPLS)
    bad = [i for i in impls if i.partition("@")[0] not in STARTUP_IMPLS or ("@" in i and not i.startswith("nvfuser@"))]
    if bad:
        raise ValueError(f"--startup --impl {bad[0]!r}: expected some of {', '.join(STARTUP_IMPLS)}")
    if layout.world_size != 1:
        raise ValueError(f"--startup: one GPU, a 1x1 mesh (got {layout.dp}x{layout.tp}); each rank of a larger "
                         f"mesh compiles the same way, its own fusions")
    from tpfuser.parallel.schedules import load_schedule   # (torch: the child times its own imports)
    rows = []
    for impl in impls:
        for kind in ("train",) if train else ("forward",):
            base, _, own = impl.partition("@")   # nvfuser@NAME: under a schedule of its own
            spec = {"impl": base, "pass": kind, "preset": preset_name, "dropout": cfg.dropout,
                    "dtype": cfg.dtype, "schedule": (load_schedule(own) if own else schedule).as_dict()}
            progress(f"[{time.strftime('%H:%M:%S')}] startup: {impl} {kind} in a fresh process", file=sys.stderr)
            rows.append({**_run_child(spec, timeout_s), "impl": impl,
                         **({"schedule": spec["schedule"]["name"]} if base == "nvfuser" else {})})
            progress(f"  {_row_line(rows[-1])}", file=sys.stderr)
    import torch
    return {"kind": "startup", "preset": preset_name, "config": cfg.__dict__, "mesh": "1x1",
            "schedule": schedule.as_dict(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "rows": rows,
            "timing": "wall seconds in a fresh process each, the GPU synchronized after each step; "
                      "torch.compile with empty inductor and Triton caches"}


def _run_child(spec: dict, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="tpfuser-startup-") as folder:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(folder, "triton"), PYTHONUNBUFFERED="1")
        env.pop(CACHE_VAR, None)   # cold: nvFuser's kernels compiled, not read back (runtime/kernel_cache.py)
        trace = os.path.join(folder, "nvfuser_trace.json")
        if spec["impl"] == "nvfuser":
            env["NVFUSER_TRACE"] = trace
        row = {"impl": spec["impl"], "pass": spec["pass"]}
        try:
            done = subprocess.run(_child_command(spec), env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {**row, "error": f"no result within {timeout_s:.0f} s"}
        results = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not results:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return {**row, "error": f"exit {done.returncode}: {tail[:300]}"}
        row |= json.loads(results[-1])
        if os.path.exists(trace):
            with open(trace, errors="replace") as f:
                row |= trace_phases(f.read())
            row["other_first_call_s"] = row["first_call_s"] - row["segmenting_s"] - row["compiling_kernels_s"]
        return row


def _row_line(row: dict) -> str:
    if "error" in row:
        return f"{row['impl']} {row['pass']}: FAILED: {row['error']}"
    line = (f"{row['impl']} {row['pass']}: build {row['build_s']:.1f} s, first call {row['first_call_s']:.1f} s, "
            f"second {row['second_call_s'] * 1e3:.1f} ms")
    if "segmenting_s" in row:
        line += f" (segmenting {row['segmenting_s']:.1f} s, compiling kernels {row['compiling_kernels_s']:.1f} s)"
    return line


def format_startup(rep: dict) -> str:
    """The report as a table: seconds to the first result, per implementation and pass."""
    w = max([24, *(len(r["impl"]) for r in rep["rows"])])
    lines = [f"first call, {rep['preset']} {rep['config']['dtype']} dropout {rep['config']['dropout']}, "
             f"1x1, schedule {rep['schedule']['name']}, on {rep['gpu']} (a fresh process each)",
             f"{'implementation':<{w}} {'pass':<8} {'import':>7} {'build':>7} {'1st call':>9} {'build+1st':>10} "
             f"{'segment':>8} {'kernels':>8} {'2nd call':>9}"]
    for r in rep["rows"]:
        if "error" in r:
            lines.append(f"{r['impl']:<{w}} {r['pass']:<8} FAILED: {r['error'][:200]}")
            continue
        seg = f"{r['segmenting_s']:8.1f}" if "segmenting_s" in r else f"{'-':>8}"
        ker = f"{r['compiling_kernels_s']:8.1f}" if "compiling_kernels_s" in r else f"{'-':>8}"
        lines.append(f"{r['impl']:<{w}} {r['pass']:<8} {r['import_s']:7.1f} {r['build_s']:7.1f} {r['first_call_s']:9.1f} "
                     f"{r['build_s'] + r['first_call_s']:10.1f} {seg} {ker} {r['second_call_s'] * 1e3:7.1f}ms")
    lines.append("seconds; segment and kernels: nvFuser's first call split by its trace (the rest: everything else)")
    return "\n".join(lines)


def _child(spec: dict) -> dict:
    """One implementation's pass in this (fresh) process: the seconds of each step."""
    clock = [time.perf_counter()]

    def lap() -> float:
        torch.cuda.synchronize()
        clock.append(time.perf_counter())
        return clock[-1] - clock[-2]

    import torch
    from tpfuser.config import preset
    from tpfuser.parallel.schedules import schedule_from_dict
    from tpfuser.verify.reference import make_block, make_input, sdpa_forward
    out = {"import_s": time.perf_counter() - clock[0]}
    torch.cuda.init()
    cfg = preset(spec["preset"], dtype=spec["dtype"], dropout=spec["dropout"])
    ref = make_block(cfg, dtype=torch.bfloat16, device="cuda", drawn_on="cuda")
    x = make_input(cfg, dtype=torch.bfloat16, device="cuda", drawn_on="cuda")
    grad = torch.randn_like(x)
    train = spec["pass"] == "train"
    out["setup_s"] = lap()   # CUDA, the weights and the input: every implementation's, not timed against it
    if spec["impl"] == "nvfuser":
        schedule = schedule_from_dict({k: v for k, v in spec["schedule"].items()})
        if train:
            from tpfuser.runtime.module import TPBlock
            model = TPBlock(cfg, schedule=schedule).load_full_state_dict(ref.state_dict())
            xg = x.detach().requires_grad_(True)

            def call():
                model(xg).backward(grad)
        else:
            from tpfuser.runtime.block import ShardedBlock
            block = ShardedBlock(cfg, schedule=schedule).load(ref.state_dict())

            def call():
                block(x, 1234, 0)
    else:
        fn = sdpa_forward
        if spec["impl"] != "eager":
            mode = "reduce-overhead" if spec["impl"] == "compile-reduce-overhead" else None
            fn = torch.compile(sdpa_forward, mode=mode)
        xg = x.detach().requires_grad_(train)

        def call():
            if spec["impl"] == "compile-reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            with torch.set_grad_enabled(train):
                y = fn(ref, xg, cfg.dropout)
                if train:
                    y.backward(grad)
                    for t in (xg, *ref.parameters()):   # as a training loop (and the bench): made, not summed
                        t.grad = None
    out["build_s"] = lap()
    call()
    out["first_call_s"] = lap()
    call()
    out["second_call_s"] = lap()
    return out


if __name__ == "__main__":
    result = _child(json.loads(sys.argv[1]))
    print(json.dumps(result), flush=True)
    import ctypes
    ctypes.CDLL(None).fflush(None)   # nvFuser's trace is C stdio: flushed before the exit that skips teardown
    os._exit(0)   # (nvFuser's multi-device objects can abort in teardown, after the work: no status lost to it)
