"""The STAND-IN calibration the CPU tests read (tests/data/calibration_standin.json):
made-up roofline times, NOT measured on any GPU. The real calibration comes
from tools/calibrate.py on the GPU (results/calibration/h200.json).

    python3 tests/data/make_standin.py      # rewrites the JSON beside it

GEMMs at 693 TFLOP/s (gpt3's four forward GEMMs at tp 8 then take 1.339 ms),
x (1 + 0.04 log2 chunks) when chunked; attention at 350 TFLOP/s + 10 us, its
backward 2.5x; the rest at 1.95 TB/s of the bytes they read and write + 6 us
each (so that gpt3's tp-8 forward adds up near 1.754 ms). The whole pass: the
pieces' sum x 1.03.
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tpfuser.config import Layout, preset  # noqa: E402
from tpfuser.parallel.placements import forward_flops  # noqa: E402
from tpfuser.predict.calibration import CHUNKS, FORMAT, PIECES  # noqa: E402

GEMM_FLOPS, ATTENTION_FLOPS, BYTES_PER_S, OP_MS = 693e12, 350e12, 1.95e12, 0.006
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration_standin.json")


def _pointwise(nbytes: float) -> float:
    return nbytes / BYTES_PER_S * 1e3 + OP_MS


def pieces(cfg, tp: int, rows: int) -> dict:
    """Every piece at tp, the sequence-split ones on `rows` rows."""
    T, e, el, fl = cfg.batch * cfg.seq, cfg.n_embd, cfg.n_embd // tp, 4 * cfg.n_embd // tp
    shapes = {"attn.c_attn": (e, 3 * el), "attn.c_proj": (el, e), "mlp.c_fc": (e, fl), "mlp.c_proj": (fl, e)}
    attention = forward_flops(cfg, Layout(1, tp))["attention"] / ATTENTION_FLOPS * 1e3 + 0.01

    def gemm(k, n):
        whole = 2 * T * k * n / GEMM_FLOPS * 1e3
        return {str(c): whole * (1 + 0.04 * math.log2(c)) for c in CHUNKS}
    fwd = {"ln_1": _pointwise(rows * e * 4), "qkv_split": _pointwise(T * 3 * el * 4), "attention": attention,
           "heads_join": 0.001, "resid_attn": _pointwise(rows * e * 7), "ln_2": _pointwise(rows * e * 4),
           "gelu": _pointwise(T * fl * 4), "resid_mlp": _pointwise(rows * e * 7)}
    bwd = {"resid_mlp": _pointwise(rows * e * 5), "gelu": _pointwise(T * fl * 6), "ln_2": _pointwise(rows * e * 8),
           "resid_attn": _pointwise(rows * e * 5), "heads_join": 0.001, "attention": 2.5 * attention,
           "qkv_split": _pointwise(T * 3 * el * 6), "ln_1": _pointwise(rows * e * 8)}
    for linear, (k, n) in shapes.items():
        fwd[linear] = gemm(k, n)
        bwd[f"{linear}.dgrad"], bwd[f"{linear}.wgrad"] = gemm(n, k), gemm(n, k)
    return {"forward": {p: fwd[p] for p in PIECES["forward"]}, "backward": {p: bwd[p] for p in PIECES["backward"]}}


def standin() -> dict:
    out = {"format": FORMAT, "stand_in": True, "complete": True,
           "gpu": "STAND-IN (roofline numbers made up for the tests, not measured)", "sm_clock_mhz": None,
           "torch": "-", "cuda": "-", "date": "2026-12-04", "commit": "stand-in",
           "command": "python3 tests/data/make_standin.py", "timing": "none: a roofline", "presets": {}}
    for name, tps in (("gpt3", (1, 2, 4, 8)), ("nanogpt", (1, 5)), ("tiny", (1, 2, 4, 8))):
        cfg = preset(name)
        at = {}
        for tp in tps:
            entry = {"tp": pieces(cfg, tp, cfg.batch * cfg.seq)}
            if cfg.seq % tp == 0:
                entry["sp"] = pieces(cfg, tp, cfg.batch * cfg.seq // tp)
            fwd, bwd = (sum(v["1"] if isinstance(v, dict) else v for v in entry["tp"][k].values())
                        for k in ("forward", "backward"))
            entry["whole"] = {"forward_ms": 1.03 * fwd, "backward_ms": 1.03 * bwd, "train_ms": 1.03 * (fwd + bwd)}
            at[str(tp)] = entry
        out["presets"][name] = {"config": {k: getattr(cfg, k) for k in ("batch", "seq", "n_embd", "n_head",
                                                                        "dropout", "dtype")}, "tp": at}
    return out


if __name__ == "__main__":
    with open(PATH, "w") as f:
        json.dump(standin(), f, indent=1)
        f.write("\n")
    print(PATH)
