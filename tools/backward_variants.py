"""Which way of scheduling the training fusions does nvFuser compile and run
correctly? One GPU, 1x1 layout; every variant against reference autograd.
Writes $OUT/backward_variants.json and prints a table.

    source .nvf/setup.sh; PYTHONPATH=$PWD python3 tools/backward_variants.py
"""
import json
import os
import traceback

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
import torch  # noqa: E402

from tpfuser.check import GRAD_TOLERANCES, check_backward  # noqa: E402
from tpfuser.config import Layout, preset  # noqa: E402
from tpfuser.fusion import ScheduleOptions  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
VARIANTS = {
    "no mesh": dict(mesh=False),
    "mesh, explicit outputs (default)": dict(train_options=ScheduleOptions()),
    "mesh, inputs only": dict(train_options=ScheduleOptions(outputs=False)),
    "1-D mesh, explicit outputs": dict(train_options=ScheduleOptions(flat_dp1=True)),
    "1-D mesh, inputs only (as nvFuser's test)": dict(train_options=ScheduleOptions(outputs=False, flat_dp1=True)),
}
rows = []
for cfg_name, dtype in (("tiny", "fp32"), ("tiny", "bf16"), ("nanogpt", "bf16")):
    cfg = preset(cfg_name, dtype=dtype)
    for variant, kwargs in VARIANTS.items():
        row = {"preset": cfg_name, "dtype": dtype, "variant": variant}
        try:
            errors = check_backward(cfg, Layout(1, 1), **kwargs)
            row["worst"] = max(errors.values())
            row["ok"] = row["worst"] <= GRAD_TOLERANCES[dtype]
            row["errors"] = errors
        except Exception as e:  # nvFuser compile errors: keep the first lines
            row["ok"] = False
            row["error"] = " | ".join(str(e).strip().splitlines()[:4])[:600]
            traceback.print_exc(limit=1)
        rows.append(row)
        print(f"{cfg_name:<8}{dtype:<5}{variant:<44}" +
              (f"worst rel err {row['worst']:.2e} {'ok' if row['ok'] else 'FAIL'}" if "worst" in row
               else f"ERROR {row['error'][:150]}"), flush=True)
with open(os.path.join(os.environ.get("OUT", "."), "backward_variants.json"), "w") as f:
    json.dump(rows, f, indent=1)
