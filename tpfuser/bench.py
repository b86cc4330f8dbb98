"""Benchmark of the block forward: nvFuser against eager PyTorch and
torch.compile, in one process, interleaved, CUDA-event timed, with the
compute floor (matmul FLOPs over the bf16 matmul rate measured in the same
run, at the block's own GEMM shapes).

    python -m tpfuser.bench --preset nanogpt --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tpfuser.commlog import error_line
from tpfuser.config import Layout, preset
from tpfuser.plan import forward_flops
from tpfuser.reference import Block, gelu_tanh, make_block, make_input

IMPLS = ("nvfuser", "nvfuser-nomesh", "eager", "compile")
# Each timing sample is this many back-to-back calls (throughput, as a
# training loop sees it); samples of the implementations are interleaved.
CALLS_PER_SAMPLE = 10


def eager_forward(block: Block, x: torch.Tensor, p: float) -> torch.Tensor:
    """nanoGPT's training forward (dropout on), as a user would run it."""
    b, s, e = x.shape
    h = block.cfg.n_head
    q, k, v = block.attn.c_attn(block.ln_1(x)).split(e, dim=2)
    q, k, v = (t.view(b, s, h, e // h).transpose(1, 2) for t in (q, k, v))  # (b, h, s, d)
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).transpose(1, 2).reshape(b, s, e)
    x = x + F.dropout(block.attn.c_proj(y), p)
    return x + F.dropout(block.mlp.c_proj(gelu_tanh(block.mlp.c_fc(block.ln_2(x)))), p)


def _time(fn, start, end, calls: int = 1) -> float:
    """ms per call over `calls` back-to-back calls."""
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def matmul_rate(cfg, reps: int = 50) -> float:
    """bf16 FLOP/s of the block's four GEMMs at their own shapes (b*s rows)."""
    m, e = cfg.batch * cfg.seq, cfg.n_embd
    shapes = [(m, e, 3 * e), (m, e, e), (m, e, 4 * e), (m, 4 * e, e)]
    mats = [(torch.randn(mm, k, device="cuda", dtype=torch.bfloat16),
             torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for mm, k, n in shapes]
    flops = sum(2 * mm * k * n for mm, k, n in shapes)

    def run():
        for a, w in mats:
            F.linear(a, w)
    for _ in range(5):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = [_time(run, start, end) for _ in range(reps)]
    return flops / (statistics.median(times) * 1e-3)


def saved_activation_bytes(step_forward, params) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward,
    parameters excluded (they exist anyway)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step_forward()
    del out
    return sum(seen.values())


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device memory bandwidth, bytes/s, of a device-to-device copy (read + write)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = statistics.median(_time(lambda: b.copy_(a), start, end) for _ in range(reps))
    return 2 * nbytes / (ms * 1e-3)


def bench(preset_name: str = "nanogpt", impls=IMPLS, iters: int = 100, warmup: int = 20, dropout=None,
          progress: bool = True, train: bool = False) -> dict:
    overrides = {"dtype": "bf16"} | ({} if dropout is None else {"dropout": dropout})
    cfg = preset(preset_name, **overrides)
    for impl in impls:
        if impl not in IMPLS:
            raise ValueError(f"implementation {impl!r}: must be one of {IMPLS} on one GPU "
                             f"(dtensor needs several GPUs: see the multi-GPU issue)")
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarking needs a CUDA GPU")
    ref = make_block(cfg, dtype=torch.bfloat16, device="cuda")
    x = make_input(cfg, dtype=torch.bfloat16, device="cuda")
    memory, failed = {}, {}
    if not train:
        fns = _forward_fns(cfg, ref, x, impls)
        ctx = torch.no_grad()
    else:
        fns, memory, failed = _train_fns(cfg, ref, x, impls)
        ctx = torch.enable_grad()
    with ctx:
        for name, fn in list(fns.items()):
            try:
                for _ in range(warmup):
                    fn()
            except Exception as e:  # e.g. nvFuser failing to compile: report it, time the others
                failed[name] = f"{type(e).__name__}: {error_line(e)}"
                del fns[name]
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = {name: [] for name in fns}
        t0 = time.time()
        for i in range(iters):  # interleaved: every implementation once per round
            for name, fn in fns.items():
                times[name].append(_time(fn, start, end, CALLS_PER_SAMPLE))
            if progress and (i + 1) % max(1, iters // 10) == 0:
                print(f"\r  {i + 1}/{iters} rounds ({time.time() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
    rate = matmul_rate(cfg)
    bandwidth = copy_bandwidth()
    # A backward does two matmuls for each of the forward's (input and weight gradients).
    flops = forward_flops(cfg)["total"] * (3 if train else 1)
    floor_ms = flops / rate * 1e3
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"median_ms": med, "min_ms": min(ts), "max_ms": max(ts), "runs": len(ts),
                      "tflops": flops / (med * 1e-3) / 1e12, "fraction_of_matmul_rate": floor_ms / med}
    if "eager" in rows:
        for r in rows.values():
            r["ratio_to_eager"] = r["median_ms"] / rows["eager"]["median_ms"]
    for name, mem in memory.items():
        rows[name].update(mem)
    return {"preset": preset_name, "config": cfg.__dict__, "pass": "forward+backward" if train else "forward", "mesh": "1x1",
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "timing": f"CUDA events over {CALLS_PER_SAMPLE} back-to-back calls per sample, {iters} interleaved samples each",
            "matmul_tflops_measured": rate / 1e12, "copy_gbps_measured": bandwidth / 1e9, "matmul_gflop": flops / 1e9,
            "compute_floor_ms": floor_ms, "results": rows, "failed": failed}


def _forward_fns(cfg, ref, x, impls):
    fns = {}
    for impl, mesh in (("nvfuser", True), ("nvfuser-nomesh", False)):
        if impl in impls:
            from tpfuser.runtime import ShardedBlock
            nv = ShardedBlock(cfg, Layout(1, 1), mesh=mesh).load(ref.state_dict())
            steps = iter(range(1 << 30))
            fns[impl] = lambda nv=nv, steps=steps: nv(x, 1234, next(steps) % 100_000)["out"]
    if "eager" in impls:
        fns["eager"] = lambda: eager_forward(ref, x, cfg.dropout)
    if "compile" in impls:
        compiled = torch.compile(eager_forward)
        fns["compile"] = lambda: compiled(ref, x, cfg.dropout)
    return fns


def _train_fns(cfg, ref, x, impls):
    """One training step each (forward, backward, gradients dropped), and its
    peak memory and saved-activation bytes."""
    from tpfuser.runtime import TPBlock
    grad = torch.randn_like(x)
    fns, memory, forwards, failed = {}, {}, {}, {}
    for impl, mesh in (("nvfuser", True), ("nvfuser-nomesh", False)):
        if impl in impls:
            model = TPBlock(cfg, mesh=mesh).load_full_state_dict(ref.state_dict())
            forwards[impl] = (lambda m=model: m(x), list(model.parameters()))
    params = list(ref.parameters())
    if "eager" in impls:
        forwards["eager"] = (lambda: eager_forward(ref, x, cfg.dropout), params)
    if "compile" in impls:
        compiled = torch.compile(eager_forward)
        forwards["compile"] = (lambda: compiled(ref, x, cfg.dropout), params)
    for impl, (fwd, ps) in forwards.items():
        def step(fwd=fwd, ps=ps):
            fwd().backward(grad)
            for p in ps:
                p.grad = None
        try:
            for _ in range(3):
                step()
        except Exception as e:  # e.g. nvFuser failing to compile: report it, time the others
            failed[impl] = f"{type(e).__name__}: {error_line(e)}"
            continue
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        memory[impl] = {"peak_mib_above_baseline": (torch.cuda.max_memory_allocated() - base) / 2**20,
                        "saved_activation_mib": saved_activation_bytes(fwd, ps) / 2**20}
        fns[impl] = step
    return fns, memory, failed


REPORT_KEYS = {"preset": str, "config": dict, "pass": str, "mesh": str, "gpu": str, "torch": str, "timing": str,
               "matmul_tflops_measured": float, "matmul_gflop": float, "compute_floor_ms": float, "results": dict}
RESULT_KEYS = {"median_ms": float, "min_ms": float, "max_ms": float, "runs": int, "tflops": float,
               "fraction_of_matmul_rate": float}


def validate_report(rep: dict) -> dict:
    """Check a bench report's schema (the JSON the plot and the README read); return it."""
    def check(obj, keys, where):
        for key, kind in keys.items():
            if key not in obj:
                raise ValueError(f"{where}: missing key {key!r}")
            if not isinstance(obj[key], kind) and not (kind is float and isinstance(obj[key], int)):
                raise ValueError(f"{where}.{key}: expected {kind.__name__}, got {type(obj[key]).__name__}")
    if "forward_matmul_gflop" in rep:   # the key's name in reports before 2026-12-02's last run
        rep.setdefault("matmul_gflop", rep["forward_matmul_gflop"])
    check(rep, REPORT_KEYS, "report")
    if not rep["results"]:
        raise ValueError("report.results: no implementation")
    for name, row in rep["results"].items():
        check(row, RESULT_KEYS, f"report.results[{name!r}]")
        if not row["min_ms"] <= row["median_ms"] <= row["max_ms"]:
            raise ValueError(f"report.results[{name!r}]: expected min <= median <= max")
    return rep


def format_table(rep: dict) -> str:
    lines = [f"{rep['preset']} {rep['pass']} on {rep['gpu']} (mesh {rep['mesh']}): "
             f"floor {rep['compute_floor_ms']:.3f} ms at {rep['matmul_tflops_measured']:.0f} TFLOP/s measured"
             + (f"; copy {rep['copy_gbps_measured']:.0f} GB/s" if "copy_gbps_measured" in rep else ""),
             f"{'impl':<16}{'median ms':>10}{'min':>8}{'max':>8}{'TFLOP/s':>9}{'of floor':>9}{'vs eager':>9}"]
    if any("peak_mib_above_baseline" in r for r in rep["results"].values()):
        lines[1] += f"{'peak MiB':>10}{'saved MiB':>10}"
    for name, r in rep["results"].items():
        line = (f"{name:<16}{r['median_ms']:>10.3f}{r['min_ms']:>8.3f}{r['max_ms']:>8.3f}{r['tflops']:>9.0f}"
                f"{r['fraction_of_matmul_rate']:>9.2f}{r.get('ratio_to_eager', float('nan')):>9.2f}")
        if "peak_mib_above_baseline" in r:
            line += f"{r['peak_mib_above_baseline']:>10.1f}{r['saved_activation_mib']:>10.1f}"
        lines.append(line)
    for name, why in rep.get("failed", {}).items():
        lines.append(f"{name:<16}failed: {why[:160]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tpfuser-bench")
    ap.add_argument("--preset", default="nanogpt")
    ap.add_argument("--impl", default=",".join(IMPLS))
    ap.add_argument("--iters", type=int, default=100, help="samples per implementation")
    ap.add_argument("--dropout", type=float, default=None)
    ap.add_argument("--train", action="store_true", help="forward+backward (a training step) instead of forward")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="also plot the report here")
    args = ap.parse_args(argv)
    try:
        rep = bench(args.preset, tuple(args.impl.split(",")), args.iters, dropout=args.dropout, train=args.train)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    validate_report(rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    if args.png:
        from tpfuser.plot import plot_reports
        plot_reports([rep], args.png)
    print(format_table(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
