"""Parse NVFUSER_DUMP=communication output and compare the posted collectives
with the plan's. Usage: python tools/collectives.py LOG PRESET DP TP DTYPE > JSON"""
import json
import re
import sys

from tpfuser.config import Layout, preset
from tpfuser.plan import collectives

log, name, dp, tp, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
posted = []
for line in open(log, errors="replace"):
    if "Posting Communication" not in line and "Communication" not in line:
        continue
    kind = re.search(r"type=(\w+)", line)
    team = re.search(r"team=\(([\d ]+)\)", line)
    shapes = re.findall(r"(input|output)_tensor\s*\[([\d, ]*)\]", line)
    if kind and team:
        posted.append({"kind": kind.group(1).lower(), "team": [int(t) for t in team.group(1).split()],
                       "shapes": {k: [int(v) for v in s.replace(",", " ").split()] for k, s in shapes},
                       "line": line.strip()[:400]})
cfg = preset(name, dtype=dtype, dropout=0.0)
plan = [{"kind": c.kind, "axis": c.axis, "shape": list(c.shape)} for c in collectives(cfg, Layout(dp, tp))]
first = posted[0] if posted else None
match = bool(first) and first["kind"] == plan[0]["kind"] and first["team"] == list(range(tp)) \
    and first["shapes"].get("output") == plan[0]["shape"]
json.dump({"posted": posted, "planned": plan, "first_matches_plan": match}, sys.stdout, indent=1)
print()
