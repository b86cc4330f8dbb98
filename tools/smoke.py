import os, sys, traceback, json
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
import torch
from tpfuser.config import preset, Layout
from tpfuser.check import check_forward
res = []
for name in ["tiny", "nanogpt"]:
    for dt in ["fp32", "bf16"]:
        for p in [0.0, 0.1]:
            try:
                r = check_forward(preset(name, dtype=dt, dropout=p), preset_name=name)
                print(name, dt, p, r.as_dict(), flush=True)
            except Exception as e:
                print(name, dt, p, "FAIL", repr(e)[:2000], flush=True); traceback.print_exc()
