"""What a cold process's first linear waits for (issue 29: the block's first
linear took 1.4-2.0 s of a first call, runs 46-49, with nothing compiled).

Each case in a fresh process, the GPU synchronized after each step; a JSON line
each on stdout, then one of the run's environment (date, GPU, versions, commit):
  torch       F.linear: 16x16 first, then nanogpt's c_attn shape (bf16, with bias) twice
  big-first   the c_attn shape first, then 16x16
  thread      a thread's 16x16 linear, 3 s of sleep, then the c_attn shape
  thread-big  a thread of the c_attn shape's linear instead, then the same
  nvfuser     a fusion of that one linear (nvfuser_direct), executed twice, then torch's; the
              first execute's time by nvFuser's trace scope (the 15 longest, seconds, summed)

    python3 tools/probes/cublas_start_probe.py [case ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CASES = ("torch", "big-first", "thread", "thread-big", "nvfuser")
ROWS, IN, OUT = 16 * 128, 1600, 4800   # nanogpt's c_attn: (b*s, e) x (3e, e)


def child(case: str) -> dict:
    clock = [time.perf_counter()]
    import torch
    F = torch.nn.functional

    def lap() -> float:
        torch.cuda.synchronize()
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 4)

    out = {"case": case}
    torch.cuda.init()
    small = torch.zeros(16, 16, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(ROWS, IN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(OUT, IN, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(OUT, device="cuda", dtype=torch.bfloat16)
    out["setup_s"] = lap()
    if case == "torch":
        F.linear(small, small, small[0])
        out["small_first_s"] = lap()
        F.linear(x, w, b)
        out["big_after_small_s"] = lap()
    elif case == "big-first":
        F.linear(x, w, b)
        out["big_first_s"] = lap()
        F.linear(small, small, small[0])
        out["small_after_big_s"] = lap()
    elif case in ("thread", "thread-big"):
        import threading

        def body():
            F.linear(x, w, b) if case == "thread-big" else F.linear(small, small, small[0])
            torch.cuda.synchronize()
        thread = threading.Thread(target=body)
        thread.start()
        time.sleep(3.0)
        out["thread_alive_after_3s"] = thread.is_alive()
        lap()
        F.linear(x, w, b)
        out["big_after_thread_s"] = lap()
    elif case == "nvfuser":
        from nvfuser_direct import DataType, FusionDefinition
        out["import_nvfuser_s"] = lap()
        with FusionDefinition() as fd:
            tx = fd.define_tensor([ROWS, IN], dtype=DataType.BFloat16)
            tw = fd.define_tensor([OUT, IN], dtype=DataType.BFloat16)
            tb = fd.define_tensor([OUT], dtype=DataType.BFloat16)
            fd.add_output(fd.ops.linear(tx, tw, tb))
        out["define_s"] = lap()
        fd.execute([x, w, b])
        out["fusion_first_s"] = lap()
        out["first_execute_scopes"] = scopes(os.environ["NVFUSER_TRACE"])
        fd.execute([x, w, b])
        out["fusion_second_s"] = lap()
        F.linear(x, w, b)
        out["torch_after_fusion_s"] = lap()
    F.linear(x, w, b)
    out["big_again_s"] = lap()
    return out


def scopes(trace: str, count: int = 15) -> dict[str, float]:
    """Seconds in each scope of an NVFUSER_TRACE file so far, summed over its
    outermost openings on each thread (a scope inside one of its own name not
    counted twice); the `count` longest."""
    import ctypes
    ctypes.CDLL(None).fflush(None)   # the trace is C stdio
    sys.path.insert(0, os.path.dirname(__file__))
    from first_call_probe import closed_scopes
    with open(trace, errors="replace") as f:
        text = f.read()
    spent = {}
    for name, _, begun, ended, outermost in closed_scopes(text):
        if outermost:
            spent[name] = spent.get(name, 0.0) + (ended - begun) * 1e-6
    return {name: round(s, 4) for name, s in sorted(spent.items(), key=lambda kv: -kv[1])[:count]}


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2])), flush=True)
        os._exit(0)
    for case in sys.argv[1:] or CASES:
        env = dict(os.environ)
        if case == "nvfuser":
            env["NVFUSER_TRACE"] = os.path.join(tempfile.mkdtemp(prefix="cublas-start-"), "trace.json")
        done = subprocess.run([sys.executable, __file__, "--child", case], capture_output=True, text=True, timeout=300,
                              env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        print(lines[-1] if lines else json.dumps({"case": case, "error": done.stderr.strip()[-400:]}), flush=True)
    # last: importing nvFuser here first would warm the children's imports
    from tpfuser.verify.meshes import environment
    print(json.dumps({"environment": environment("python3 " + " ".join(sys.argv))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
