"""Which way of writing and scheduling the training fusions does nvFuser
compile and run correctly? One GPU, 1x1 layout; every variant against
reference autograd, the stage that failed (training forward or backward) named.
Writes $OUT/backward_variants.json and prints a line per variant.

    source .nvf/setup.sh; PYTHONPATH=$PWD python3 tools/backward_variants.py
"""
import json
import os
import time

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
import torch  # noqa: E402

import tpfuser.fusion as fusion  # noqa: E402
from tpfuser.check import GRAD_TOLERANCES, check_backward  # noqa: E402
from tpfuser.config import Layout, preset  # noqa: E402
from tpfuser.fusion import DataType, ScheduleOptions  # noqa: E402
from tpfuser.runtime import ShardedBlock  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False


def weight_grad_batched(fd, g, a, b, s):
    """g^T a without merging b and s: one [n_out, n_in] product per batch row, summed over b."""
    per_row = fd.ops.matmul(fd.ops.permute(g, dims=[0, 2, 1]), a)       # (b, n_out, n_in)
    return fd.ops.sum(fd.ops.cast(per_row, DataType.Float), dims=[0], keepdim=False, dtype=DataType.Null)


def input_grad_3d(fd, g, w, b, s):
    return fd.ops.matmul(g, w)                                          # (b, s, n_out) @ (n_out, n_in)


FLAT = (fusion._weight_grad, fusion._input_grad)
BATCHED = (weight_grad_batched, input_grad_3d)
VARIANTS = {
    "no mesh": (dict(mesh=False), FLAT),
    "mesh, explicit outputs (default)": (dict(), FLAT),
    "1-D mesh, inputs only (as nvFuser's test)": (dict(train_options=ScheduleOptions(outputs=False, flat_dp1=True)), FLAT),
    "mesh, no [b*s] reshape": (dict(), BATCHED),
    "mesh, inputs only, no [b*s] reshape": (dict(train_options=ScheduleOptions(outputs=False)), BATCHED),
    "1-D mesh, inputs only, no [b*s] reshape": (dict(train_options=ScheduleOptions(outputs=False, flat_dp1=True)), BATCHED),
}


def stage_of_failure(cfg, kwargs):
    """Re-run the two stages separately to say which one nvFuser refused."""
    block = ShardedBlock(cfg, Layout(), 0, check=True, device=torch.device("cuda"), **kwargs)
    from tpfuser.reference import make_block, make_input
    block.load(make_block(cfg).state_dict())
    x = block.shard_input(make_input(cfg))
    try:
        _, saved = block.forward_train(x, 1, 5)
    except Exception:
        return "training forward"
    try:
        block.backward(x, x, saved, 1, 5)
    except Exception:
        return "backward"
    return "neither (on rerun)"


rows = []
passed_tiny_bf16 = set()
for cfg_name, dtype in (("tiny", "fp32"), ("tiny", "bf16"), ("nanogpt", "bf16")):
    cfg = preset(cfg_name, dtype=dtype)
    for variant, (kwargs, (wg, ig)) in VARIANTS.items():
        if cfg_name == "nanogpt" and variant not in passed_tiny_bf16:
            continue
        fusion._weight_grad, fusion._input_grad = wg, ig
        row = {"preset": cfg_name, "dtype": dtype, "variant": variant}
        start = time.perf_counter()
        try:
            errors = check_backward(cfg, Layout(1, 1), **kwargs)
            row["worst"] = max(errors.values())
            row["ok"] = row["worst"] <= GRAD_TOLERANCES[dtype]
            row["errors"] = errors
        except Exception as e:  # nvFuser compile errors: keep the lines that say where
            row["ok"] = False
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            row["error"] = " | ".join([ln for ln in lines if ".cpp" in ln or "Error" in ln][:3] or lines[:3])[:600]
            row["stage"] = stage_of_failure(cfg, kwargs)
        row["seconds"] = round(time.perf_counter() - start, 1)
        if row["ok"] and cfg_name == "tiny" and dtype == "bf16":
            passed_tiny_bf16.add(variant)
        rows.append(row)
        status = (f"worst rel err {row['worst']:.2e} {'ok' if row['ok'] else 'FAIL'}" if "worst" in row
                  else f"ERROR in {row['stage']}: {row['error'][:220]}")
        print(f"{cfg_name:<8}{dtype:<5}{variant:<44}{row['seconds']:>6}s  {status}", flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "backward_variants.json"), "w") as f:
            json.dump(rows, f, indent=1)
