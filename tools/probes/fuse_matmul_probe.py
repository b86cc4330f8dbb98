"""Does nvFuser 0.2.36's own matmul kernel (`fuse_matmul`) take a linear and its
neighbours' pointwise work at the block's shapes, and is it as fast as ATen's GEMM?

    python3 tools/probes/fuse_matmul_probe.py [--preset nanogpt] [--json out.json]

One GPU, no mesh, bf16. Each case is a small fusion written here (not the
block's): a linear alone, with its bias, in 2D or 3D, then with the epilogues
the block would give it (c_fc: bias + GELU-tanh; a row-parallel c_proj: bias +
residual). Shapes are symbolic, or (`static`) declared as the block declares
them, every extent given (a batch of 1 then a Broadcast dimension). Each runs
as nvFuser runs it by default (ATen's GEMM, nvFuser's kernels around it), with
fuse_matmul, and with nvFuser's own matmul kernel made to take it (MODES);
against PyTorch eager on the same inputs (the oracle: max abs error). Times:
the median of CUDA-event times taken in turn, a call of each mode per round,
so that a GPU drifting at its power cap moves every mode alike. A case that
fails says where nvFuser raised (its first line). Kernels: the names one
profiled call ran.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F
from nvfuser_direct import DataType, FusionDefinition

from tpfuser.config import preset


def gelu_tanh(fd, x):   # GELU, tanh approximation, on fp32 values
    c = math.sqrt(2.0 / math.pi)
    inner = fd.ops.mul(fd.ops.add(x, fd.ops.mul(fd.ops.mul(fd.ops.mul(x, x), x), 0.044715)), c)
    return fd.ops.mul(fd.ops.mul(x, 0.5), fd.ops.add(fd.ops.tanh(inner), 1.0))


SQUEEZES = ("last", "early")   # where a squeezed case broadcasts its batch of 1 back (define)


def define(case: str, dims: int, shapes=None, squeeze: str | None = None) -> FusionDefinition:
    """The fusion of one case; shapes: (x, w, bias, res) as declared, or None
    (symbolic). squeeze: x's leading extent-1 dimension (a static batch of 1,
    a Broadcast) squeezed before the linear, which runs on 2D operands (the
    matmul scheduler admits a squeeze between an input and its linear: a way
    round gpt3's failure), and broadcast back "last" (the epilogue in 2D too,
    res squeezed alike) or "early" (right after the linear, the epilogue in
    3D, as the block's fusions would write it)."""
    bf16 = DataType.BFloat16
    x_shape, w_shape, b_shape, r_shape = shapes or ([-1] * dims, [-1, -1], [-1], [-1] * dims)
    with FusionDefinition() as fd:
        x = fd.define_tensor(list(x_shape), contiguity=True, dtype=bf16)
        w = fd.define_tensor(list(w_shape), contiguity=True, dtype=bf16)
        bias = fd.define_tensor(list(b_shape), contiguity=True, dtype=bf16) if case != "linear" else None
        res = fd.define_tensor(list(r_shape), contiguity=True, dtype=bf16) if case == "bias+residual" else None

        def unsqueezed(y):   # (m, n) -> (1, m, n)
            return fd.ops.broadcast_in_dim(y, shape=[1, *x_shape[1:-1], w_shape[0]], broadcast_dims=[1, 2])

        def linear(a, b=None):
            y = fd.ops.linear(fd.ops.squeeze(a, dims=[0]) if squeeze else a, w, b)
            return unsqueezed(y) if squeeze == "early" else y
        if squeeze == "last" and res is not None:
            res = fd.ops.squeeze(res, dims=[0])
        if case in ("linear", "linear+bias"):
            y = linear(x, bias)
        elif case == "bias+gelu":   # c_fc: bias and GELU in the epilogue
            y = fd.ops.cast(gelu_tanh(fd, fd.ops.cast(linear(x, bias), DataType.Float)), bf16)
        else:   # a row-parallel linear's output: its bias added after the GEMM, then the residual
            y = fd.ops.add(fd.ops.add(fd.ops.cast(linear(x), DataType.Float), fd.ops.cast(bias, DataType.Float)),
                           fd.ops.cast(res, DataType.Float))
            y = fd.ops.cast(y, bf16)
        fd.add_output(unsqueezed(y) if squeeze == "last" else y)
    return fd


def reference(case: str):
    """What the case's fusion computes, in PyTorch."""
    def torch_fn(x, w, bias=None, res=None):
        if case in ("linear", "linear+bias"):
            return F.linear(x, w, bias)
        if case == "bias+gelu":
            return F.gelu(F.linear(x, w, bias).float(), approximate="tanh").to(x.dtype)
        return (F.linear(x, w).float() + bias.float() + res.float()).to(x.dtype)
    return torch_fn


# How nvFuser runs each case. fuse_matmul alone lets its matmul scheduler take a linear, but ATen's GEMM
# (ExprEval) comes first for a lone one; with matmul_expr_eval off nvFuser's own matmul kernel must take it.
MODES = {"aten": {}, "fuse_matmul": {"_enable_options": ["fuse_matmul"]},
         "nvfuser_matmul": {"_enable_options": ["fuse_matmul"], "_disable_options": ["matmul_expr_eval"]}}


def timed_ms(fns: dict, iters: int) -> dict:
    """{name: median ms} of each callable, timed in turn: a call of each per round,
    the round's order rotated each time (no place in it favoured)."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {name: [] for name in fns}
    order = list(fns.items())
    for i in range(iters):
        for name, fn in order[i % len(order):] + order[:i % len(order)]:
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def kernels(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    where = next((ln for ln in lines if ".cpp:" in ln or ".h:" in ln), "")
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}" + (f" [{where[:200]}]" if where else "")


def run_case(case: str, dims: int, m_shape, k: int, n: int, iters: int, static: bool = False,
             squeeze: str | None = None) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*m_shape, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    res = torch.randn(*m_shape, n, device="cuda", generator=gen).to(torch.bfloat16)
    inputs = [x, w] + ([bias] if case != "linear" else []) + ([res] if case == "bias+residual" else [])
    torch_fn = reference(case)
    want = torch_fn(*inputs)
    shapes = (x.shape, w.shape, bias.shape, res.shape) if static else None
    out = {"case": case, "dims": dims, "static": static, "squeeze": squeeze, "m": list(m_shape), "k": k, "n": n,
           "eager_kernels": kernels(lambda: torch_fn(*inputs))}
    calls = {"eager": lambda: torch_fn(*inputs)}
    for mode, opts in MODES.items():   # a definition of its own each: nvFuser's kernel cache keys on the inputs only
        try:   # nvFuser may refuse the definition itself
            call = (lambda fd, o: lambda: fd.execute(inputs, **o))(define(case, dims, shapes, squeeze), opts)
            got = call()[0]
            out[mode] = {"ok": True, "max_abs_err": (got.float() - want.float()).abs().max().item(),
                         "kernels": kernels(call)}
            calls[mode] = call
        except Exception as e:   # nvFuser's own error, recorded: what this probe is for
            out[mode] = {"ok": False, "error": first_line(e)}
        torch.cuda.synchronize()
    for name, ms in timed_ms(calls, iters).items():
        if name == "eager":
            out["eager_ms"] = ms
        else:
            out[name]["ms"] = ms
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="+", default=["nanogpt"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from tpfuser.verify.meshes import environment   # date, GPU, versions, command, commit
    command = "python3 tools/probes/fuse_matmul_probe.py " + " ".join(sys.argv[1:] if argv is None else argv)
    env, rows = environment(command), []
    for name in args.preset:
        cfg = preset(name)
        e, tokens = cfg.n_embd, (cfg.batch, cfg.seq)
        for case, dims, k, n, static in (
                ("linear", 2, e, 4 * e, False), ("linear+bias", 2, e, 4 * e, False), ("linear+bias", 3, e, 4 * e, False),
                ("bias+gelu", 2, e, 4 * e, False), ("bias+gelu", 3, e, 4 * e, False), ("bias+residual", 3, 4 * e, e, False),
                ("bias+gelu", 3, e, 4 * e, True), ("bias+residual", 3, 4 * e, e, True)):   # static: as the block
            m_shape = (tokens[0] * tokens[1],) if dims == 2 else tokens
            for squeeze in (None, *SQUEEZES) if static and tokens[0] == 1 else (None,):
                row = {"preset": name, **run_case(case, dims, m_shape, k, n, args.iters, static, squeeze)}
                rows.append(row)
                cells = [f"{mode} " + (f"{row[mode]['ms']:.4f} ms err {row[mode]['max_abs_err']:.2g}"
                                       if row[mode]["ok"] else row[mode]["error"][:160]) for mode in MODES]
                form = " static" * static + (f" squeezed, back {squeeze}" if squeeze else "")
                print(f"{name} {case} {dims}d{form}: eager {row['eager_ms']:.4f} ms | " + " | ".join(cells), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"environment": env, "gpu": env["gpu"], "torch": env["torch"], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
