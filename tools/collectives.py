"""Parse NVFUSER_DUMP=communication output and compare the posted collectives
with the plan's. Usage: python tools/collectives.py LOG PRESET DP TP DTYPE [sp] [bwd] > JSON"""
import json
import sys

from tpfuser.commlog import compare_first, parse_communication_log
from tpfuser.config import Layout, preset

log, name, dp, tp, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
sp, bwd = "sp" in sys.argv[6:], "bwd" in sys.argv[6:]
posted = parse_communication_log(open(log, errors="replace").read())
json.dump(compare_first(posted, preset(name, dtype=dtype, dropout=0.0), Layout(dp, tp, sp), bwd), sys.stdout, indent=1)
print()
