"""A digest of every fusion's printed math, to show that a change of the code
around the fusions leaves them as they were (no GPU needed).

    python3 tools/fusion_digests.py > digests.json ; python3 tools/fusion_digests.py --check tests/data/golden/fusion_digests.json
    python3 tools/fusion_digests.py --schedules megatron-whole,megatron-sp-whole   # another family of schedules

For every preset, dtype, forward (inference, checking, training) and backward,
on the meshes 1x1, 2x1, 1x2, 2x2, 1x8, 2x4 with and without sequence
parallelism (where the preset allows the mesh) and without a mesh: the sha256
of the pass's fusions' `print_math()`, one after another. The schedule is the
family's (TP, SP) pair: by default megatron and megatron-sp.
"""
import hashlib
import json
import sys

from tpfuser.config import PRESETS, Layout, preset
from tpfuser.parallel.passes import build_backward, build_forward

MESHES = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 8), (2, 4)]


def digests(schedules=("megatron", "megatron-sp")) -> dict[str, str]:
    tp_schedule, sp_schedule = schedules
    out = {}
    for name in sorted(PRESETS):
        for dtype in ("fp32", "bf16"):
            cfg = preset(name, dtype=dtype)
            layouts = [None] + [Layout(dp, tp, sp) for dp, tp in MESHES for sp in (False, True)]
            for layout in layouts:
                if layout is not None:
                    try:
                        layout.check(cfg)
                    except ValueError:
                        continue
                where = "none" if layout is None else f"{layout.dp}x{layout.tp}{'sp' if layout.sp else ''}"
                schedule = sp_schedule if layout is not None and layout.sp else tp_schedule
                fusions = {"forward": lambda: build_forward(cfg, layout, schedule=schedule),
                           "forward.check": lambda: build_forward(cfg, layout, check=True, schedule=schedule),
                           "forward.train": lambda: build_forward(cfg, layout, train=True, schedule=schedule),
                           "backward": lambda: build_backward(cfg, layout, schedule=schedule)}
                for kind, build in fusions.items():
                    text = build().text()
                    out[f"{name}/{dtype}/{where}/{kind}"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    schedules = ("megatron", "megatron-sp")
    if "--schedules" in args:
        i = args.index("--schedules")
        schedules = tuple(args[i + 1].split(","))
        del args[i:i + 2]
    now = digests(schedules)
    if args[:1] == ["--check"]:
        before = json.load(open(args[1]))
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        print(f"{len(now)} fusions, {len(changed)} changed" + "".join(f"\n  {k}" for k in changed))
        sys.exit(1 if changed else 0)
    json.dump(now, sys.stdout, indent=1, sort_keys=True)
    print()
