"""One rank's pieces of the block, timed on one GPU at that rank's local shapes,
for tp 1, 2, 4, 8 (and 5, for nanogpt's 25 heads): the calibration `tpfuser plan --predict` reads
(tpfuser/predict/calibration.py describes the file).

    TPFUSER_COMMIT=$(git rev-parse HEAD) python3 tools/calibrate.py \
        [--preset gpt3 nanogpt] [--tp 1 2 4 5 8] [--json results/calibration/h200.json]

bf16, eager PyTorch, no collective (row-parallel partial sums left unreduced).
Each piece is captured K times in a CUDA graph (a replay of ~3 ms), timed over
--samples replays with CUDA events: the median over K. The pieces: the four
GEMMs forward (F.linear) whole and cut in 2, 4, 8 along the tokens, their
weight- and input-gradient matmuls cut alike (a cut weight gradient
accumulates, addmm_); flash attention (scaled_dot_product_attention, causal,
the preset's dropout, the rank's heads; backward: forward+backward less
forward, autograd); the rest as the rank's eager ops (LayerNorms, q/k/v split,
bias+GELU, bias+dropout+residual, their backwards), the sequence-split ones
again on s/tp rows (sp). Then the rank's whole pass in plain PyTorch, forward
and forward+backward, graphed alike: what the pieces' sum is checked against.
And each GEMM (whole, 4 chunks) beside a copy loop on 32 CTAs on another
stream (Triton), over alone: a rough stand-in for the SMs and memory traffic
of NCCL's kernels (theirs cross NVLink too; this one does not).

The JSON is rewritten after each preset and tp (a killed run keeps what it
measured, "complete": false); a short table is printed last. About a minute
on an H200 for both presets. --device cpu: a dry run of the script itself
(perf_counter, no graphs), its times meaningless.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpfuser.config import PRESETS, Layout, preset  # noqa: E402
from tpfuser.block.form import LINEARS  # noqa: E402
from tpfuser.predict.calibration import CHUNKS, FORMAT, SEQUENCE_SPLIT, Calibration, check_sums  # noqa: E402

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_loop(src, dst, per_cta, loops, BLOCK: tl.constexpr):
        base = tl.program_id(0) * per_cta
        for _i in range(loops):
            for off in range(0, per_cta, BLOCK):
                idx = base + off + tl.arange(0, BLOCK)
                tl.store(dst + idx, tl.load(src + idx))
except Exception:   # noqa: BLE001 (no Triton: the slowdown is not measured)
    triton = None

HOG_CTAS, HOG_PER_CTA = 32, 1 << 20     # 32 CTAs of 16 warps, 4 MiB of fp32 each (128 MiB: past the L2)
BESIDE_CHUNKS = (1, 4)


class Timer:
    """ms of one call of fn, by name: CUDA-graph replays timed with events (cuda), or perf_counter (cpu);
    with beside, also its time beside the copy loop over alone (None without Triton or on the cpu)."""

    def __init__(self, device: str, samples: int, target_ms: float = 3.0):
        self.device, self.samples, self.target_ms, self.hog, self.notes = device, samples, target_ms, None, []
        if device == "cuda":
            self.events, self.side = [torch.cuda.Event(enable_timing=True) for _ in range(2)], torch.cuda.Stream()

    def _events_ms(self, run) -> float:
        self.events[0].record()
        run()
        self.events[1].record()
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1])

    def _graph(self, fn, k: int):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):   # warm-up off the capturing stream, as torch.cuda.graph's docs ask
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(k):
                fn()
        g.replay()
        return g

    def __call__(self, name: str, fn, beside: bool = False):
        fn()
        if self.device == "cpu":
            ms = statistics.median(_wall_ms(fn) for _ in range(self.samples))
            return (ms, None) if beside else ms
        k = max(1, min(50, round(self.target_ms / max(self._events_ms(fn), 1e-3))))   # a replay of ~3 ms
        try:
            g = self._graph(fn, k)
        except RuntimeError as e:   # timed eagerly instead (its launches included), and said so in the file
            self.notes.append(f"{name}: not capturable ({str(e).splitlines()[0][:200]}); timed eagerly")
            ms = statistics.median(self._events_ms(fn) for _ in range(self.samples))
            return (ms, None) if beside else ms
        ms = max(statistics.median(self._events_ms(g.replay) / k for _ in range(self.samples)), 1e-4)
        ratio = self._beside(g, k, ms) if beside else None
        del g
        return (ms, ratio) if beside else ms

    def _beside(self, g, k: int, ms: float) -> float | None:
        """The graph's replay while the copy loop runs on another stream (launched first, ~3x as long)."""
        if triton is None:
            return None
        if self.hog is None:
            src = torch.zeros(HOG_CTAS * HOG_PER_CTA, device="cuda")
            dst = torch.empty_like(src)
            self.hog = lambda loops: _copy_loop[(HOG_CTAS,)](src, dst, HOG_PER_CTA, loops, BLOCK=4096, num_warps=16)
            self.hog(1)   # compiled here, not in a timing
            self.hog_ms = max(self._events_ms(lambda: self.hog(4)) / 4, 1e-3)
        loops, times = math.ceil(3 * ms * k / self.hog_ms) + 1, []
        for _ in range(max(3, self.samples // 3)):
            torch.cuda.synchronize()
            with torch.cuda.stream(self.side):
                self.hog(loops)
            times.append(self._events_ms(g.replay) / k)
            torch.cuda.synchronize()
        return statistics.median(times) / ms


def _wall_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _chunked(fn_of_rows, rows: int, n: int):
    """fn run on each of n row-chunks [i rows/n, (i+1) rows/n) of the tokens, in one call."""
    step = rows // n
    return lambda: [fn_of_rows(slice(i * step, (i + 1) * step)) for i in range(n)]


def measure(cfg, tp: int, timer: Timer, device: str, beside: bool) -> dict:
    """Every piece at tp's local shapes (tp, and sp where the sequence splits) and the whole pass (tp)."""
    b, s, e, d, p = cfg.batch, cfg.seq, cfg.n_embd, cfg.head_dim, cfg.dropout
    hl, el, fl, T = cfg.n_head // tp, cfg.n_embd // tp, 4 * cfg.n_embd // tp, cfg.batch * cfg.seq
    kw = {"device": device, "dtype": torch.bfloat16}
    r = lambda *shape: torch.randn(*shape, **kw)   # noqa: E731
    P = {"ln_1.weight": r(e), "ln_1.bias": r(e), "attn.c_attn.weight": r(3 * el, e) * e ** -0.5,
         "attn.c_attn.bias": r(3 * el), "attn.c_proj.weight": r(e, el) * el ** -0.5, "attn.c_proj.bias": r(e),
         "ln_2.weight": r(e), "ln_2.bias": r(e), "mlp.c_fc.weight": r(fl, e) * e ** -0.5, "mlp.c_fc.bias": r(fl),
         "mlp.c_proj.weight": r(e, fl) * fl ** -0.5, "mlp.c_proj.bias": r(e)}
    h, y, g_act, u, g_y, g_e, g_qkv = r(T, e), r(T, el), r(T, fl), r(T, fl), r(T, el), r(T, e), r(T, 3 * el)
    qkv = r(b, s, hl, 3, d)
    q, k, v = (t.transpose(1, 2).contiguous() for t in qkv.unbind(3))
    gq, gk, gv = (r(b, hl, s, d) for _ in range(3))
    io = {"attn.c_attn": (h, g_qkv), "attn.c_proj": (y, g_e), "mlp.c_fc": (h, r(T, fl)), "mlp.c_proj": (g_act, g_e)}
    bias = {"attn.c_attn": P["attn.c_attn.bias"], "mlp.c_fc": P["mlp.c_fc.bias"]}
    fwd, bwd, ratios = {}, {}, {"forward": {}, "backward": {}}

    def gemm(kind, name, make, store):   # every chunk count; beside the copy loop at BESIDE_CHUNKS
        store[name] = {}
        for n in CHUNKS:
            ms, ratio = timer(f"{name} /{n}", make(n), beside=True) if beside and n in BESIDE_CHUNKS else (
                timer(f"{name} /{n}", make(n)), None)
            store[name][str(n)] = ms
            if ratio is not None:
                ratios[kind].setdefault(name, {})[str(n)] = ratio

    def wgrad(gout, inp, acc, n):   # the tokens are the contraction: a cut one accumulates (addmm_)
        step = T // n
        parts = [(gout[i * step:(i + 1) * step].t(), inp[i * step:(i + 1) * step]) for i in range(n)]
        return lambda: [torch.mm(*parts[0], out=acc)] + [acc.addmm_(a, c) for a, c in parts[1:]]

    for lin in LINEARS:
        (inp, gout), w = io[lin], P[f"{lin}.weight"]
        gemm("forward", lin, lambda n: _chunked(lambda rs: F.linear(inp[rs], w, bias.get(lin)), T, n), fwd)
        gemm("backward", f"{lin}.dgrad", lambda n: _chunked(lambda rs: torch.mm(gout[rs], w), T, n), bwd)
        acc = torch.empty(w.shape, **kw)
        gemm("backward", f"{lin}.wgrad", lambda n: wgrad(gout, inp, acc, n), bwd)

    yb = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    qa, ka, va = (t.detach().requires_grad_(True) for t in (q, k, v))
    gy = r(b, s, hl, d).transpose(1, 2)   # the upstream gradient as autograd hands it over (a view)

    def attention_step():
        return torch.autograd.grad(F.scaled_dot_product_attention(qa, ka, va, dropout_p=p, is_causal=True),
                                   (qa, ka, va), gy)
    for store, name, fn in (
            (fwd, "qkv_split", lambda: [t.transpose(1, 2).contiguous() for t in qkv.unbind(3)]),
            (fwd, "attention", lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)),
            (fwd, "heads_join", lambda: yb.transpose(1, 2).reshape(b, s, el)),
            (fwd, "gelu", lambda: F.gelu(u, approximate="tanh")),
            (bwd, "attention", attention_step),   # forward and backward: less the forward below
            (bwd, "heads_join", lambda: g_y.view(b, s, hl, d).transpose(1, 2)),   # a view, as autograd's
            (bwd, "qkv_split", lambda: (torch.stack([t.transpose(1, 2) for t in (gq, gk, gv)], dim=3), g_qkv.sum(0))),
            (bwd, "gelu", lambda: torch.ops.aten.gelu_backward(g_act, u, approximate="tanh").sum(0))):
        store[name] = timer(f"{'backward ' if store is bwd else ''}{name}", fn)
    bwd["attention"] = max(bwd["attention"] - fwd["attention"], 1e-4)
    out = {"tp": {"forward": fwd, "backward": bwd}}
    if tp > 1 and cfg.seq % tp == 0:   # sequence parallelism splits the sequence over tp
        out["sp"] = {"forward": dict(fwd), "backward": dict(bwd)}
    for par, rows in (("tp", T), ("sp", T // tp)):   # the sequence-split pieces (SEQUENCE_SPLIT) on their rows
        if par not in out:
            continue
        xr, ar, gr = r(rows, e), r(rows, e), r(rows, e)
        mask = torch.rand(rows, e, device=device) > p
        ln = torch.ops.aten.native_layer_norm(xr, [e], P["ln_1.weight"], P["ln_1.bias"], 1e-5)
        for name in SEQUENCE_SPLIT:
            if name.startswith("ln_"):
                wt, bs_ = P[f"{name}.weight"], P[f"{name}.bias"]
                f_fn = lambda: F.layer_norm(xr, (e,), wt, bs_, 1e-5)   # noqa: E731
                b_fn = lambda: torch.ops.aten.native_layer_norm_backward(   # noqa: E731  (+ the residual's gradient)
                    gr, xr, [e], ln[1], ln[2], wt, bs_, [True, True, True])[0] + gr
            else:   # bias + dropout + residual; backward: dropout's and the bias's gradient
                bias_ = P[{"resid_attn": "attn.c_proj.bias", "resid_mlp": "mlp.c_proj.bias"}[name]]
                f_fn = lambda: xr + F.dropout(ar + bias_, p)   # noqa: E731
                b_fn = lambda: (torch.ops.aten.native_dropout_backward(gr, mask, 1 / (1 - p))   # noqa: E731
                                if p > 0 else gr).sum(0)
            out[par]["forward"][name] = timer(f"{par} {name}", f_fn)
            out[par]["backward"][name] = timer(f"{par} backward {name}", b_fn)
    if tp == 1:
        out["sp"] = json.loads(json.dumps(out["tp"]))
    out["whole"] = whole(cfg, tp, P, timer, kw)
    if beside:
        out["beside_copy"] = {kind: v for kind, v in ratios.items() if v}
    return out


def whole(cfg, tp, P, timer: Timer, kw) -> dict:
    """The rank's pass in plain PyTorch at TP local shapes, no collective; forward, and forward+backward."""
    b, s, e, d, p = cfg.batch, cfg.seq, cfg.n_embd, cfg.head_dim, cfg.dropout
    hl, el = cfg.n_head // tp, cfg.n_embd // tp
    W = {k: v.detach().requires_grad_(True) for k, v in P.items()}
    x, grad = torch.randn(b, s, e, **kw).requires_grad_(True), torch.randn(b, s, e, **kw)

    def forward():
        h = F.layer_norm(x, (e,), W["ln_1.weight"], W["ln_1.bias"], 1e-5)
        qkv = F.linear(h, W["attn.c_attn.weight"], W["attn.c_attn.bias"]).view(b, s, hl, 3, d)
        q, k, v = (t.transpose(1, 2).contiguous() for t in qkv.unbind(3))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).transpose(1, 2).reshape(b, s, el)
        x1 = x + F.dropout(F.linear(y, W["attn.c_proj.weight"]) + W["attn.c_proj.bias"], p)
        hid = F.gelu(F.linear(F.layer_norm(x1, (e,), W["ln_2.weight"], W["ln_2.bias"], 1e-5),
                              W["mlp.c_fc.weight"], W["mlp.c_fc.bias"]), approximate="tanh")
        return x1 + F.dropout(F.linear(hid, W["mlp.c_proj.weight"]) + W["mlp.c_proj.bias"], p)
    fwd = timer("whole forward", forward)
    train = timer("whole forward+backward", lambda: torch.autograd.grad(forward(), [x, *W.values()], grad))
    return {"forward_ms": fwd, "train_ms": train, "backward_ms": max(train - fwd, 1e-4)}


def _clocks() -> dict:
    """The SM clock now, its maximum and the memory clock, MHz (nvidia-smi; None where it cannot say)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem", "-i", "0",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20).stdout
        values = [float(v) for v in out.strip().split(",")]
    except (OSError, subprocess.SubprocessError, ValueError):
        values = [None] * 3
    return dict(zip(("sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz"), values))


def header(args, device: str) -> dict:
    from tpfuser.verify.meshes import git_commit
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run: times meaningless)"
    return {"format": FORMAT, "stand_in": False, "complete": False, "gpu": gpu,
            **(_clocks() if device == "cuda" else {"sm_clock_mhz": None}),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python3 tools/calibrate.py " + " ".join(sys.argv[1:]),
            "commit": os.environ.get("TPFUSER_COMMIT") or git_commit(os.path.dirname(os.path.abspath(__file__))) or "unknown",
            "timing": f"CUDA graph replays, CUDA events, median of {args.samples}" if device == "cuda" else "perf_counter",
            "presets": {}, "skipped": {}, "failed": {}}


def write(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _table(data: dict, path: str) -> None:
    """The pieces' sum against the whole pass, per preset and tp (calibration.check_sums), kept in the file too."""
    cal = Calibration(data, path)   # the reader's own check of what was written
    data["check"] = {name: check_sums(cal, name) for name in data["presets"]}
    write(path, data)
    print(f"\ncalibration {path} ({data['gpu']}, {data['wall_s']:.0f} s): pieces' sum vs the whole pass, ms")
    print(f"  {'preset':<9}{'tp':>3}  {'pass':<9}{'pieces':>9}{'whole':>9}{'error':>9}  GEMMs")
    for name in data["presets"]:
        for row in data["check"][name]:
            passes = cal.pieces(name, row["tp"], False).passes[row["pass"]]
            gemms = sum(v["1"] for v in passes.values() if isinstance(v, dict))
            print(f"  {name:<9}{row['tp']:>3}  {row['pass']:<9}{row['pieces_ms']:9.3f}{row['whole_ms']:9.3f}"
                  f"{100 * row['error']:+8.1f}%  {gemms:.3f}{'' if row['within'] else '  OFF (over 10 %)'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", nargs="+", default=["gpt3", "nanogpt"], choices=sorted(PRESETS))
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2, 4, 5, 8],
                    help="each that divides the preset's heads (5: the only one > 1 nanogpt's 25 heads take)")
    ap.add_argument("--json", default=None, help="default: results/calibration/<gpu>.json (h200.json on an H200)")
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--no-beside", action="store_true", help="skip the GEMMs' slowdown beside the copy loop")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (--device cpu for a dry run)", file=sys.stderr)
        return 2
    data = header(args, args.device)
    slug = "cpu" if args.device == "cpu" else next((k for k in ("h200", "h100", "a100") if k in data["gpu"].lower()),
                                                    "".join(c for c in data["gpu"].lower() if c.isalnum()))
    path = args.json or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                     "results", "calibration", f"{slug}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    timer, t0 = Timer(args.device, args.samples), time.perf_counter()
    for name in args.preset:
        cfg = preset(name, dtype="bf16")
        fields = ("batch", "seq", "n_embd", "n_head", "dropout", "dtype")
        data["presets"][name] = {"config": {k: getattr(cfg, k) for k in fields}, "tp": {}}
        for tp in args.tp:
            try:
                Layout(1, tp).check(cfg)
            except ValueError as e:   # this tp does not split the block (nanogpt's 25 heads over 8)
                data["skipped"].setdefault(name, {})[str(tp)] = str(e)
                print(f"{name} tp {tp}: skipped ({e})", flush=True)
                continue
            try:
                data["presets"][name]["tp"][str(tp)] = measure(cfg, tp, timer, args.device,
                                                               not args.no_beside and args.device == "cuda")
                status = "done"
            except Exception as e:   # noqa: BLE001 (kept in the file; the other sizes go on)
                status = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                data["failed"].setdefault(name, {})[str(tp)] = status
            print(f"{name} tp {tp}: {status} ({time.perf_counter() - t0:.0f} s)", flush=True)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            data["wall_s"], data["notes"] = time.perf_counter() - t0, timer.notes
            write(path, data)
    data["complete"] = True
    if args.device == "cuda":
        data["sm_clock_mhz_after"] = _clocks()["sm_clock_mhz"]
    write(path, data)
    try:
        _table(data, path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 1 if data["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
