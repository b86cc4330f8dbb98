"""Short table of a gpu_suite run, and $OUT/summary.json."""
import glob
import json
import os
import sys
import xml.etree.ElementTree as ET

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "probes"))
import first_call_probe  # noqa: E402  (its one-line result)

out = sys.argv[1]
summary = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__}
try:
    import nvfuser_direct
    summary["nvfuser"] = nvfuser_direct.__version__
except Exception:
    pass
rows = []
for junit in sorted(glob.glob(os.path.join(out, "gpu_tests*.xml"))):
    name = os.path.basename(junit)[len("gpu_"):-len(".xml")]
    root = ET.parse(junit).getroot()
    suite = root.find("testsuite") if root.find("testsuite") is not None else root
    t, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    summary[f"gpu_{name}"] = {"tests": t, "passed": t - f - e - s, "failed": f + e, "skipped_or_xfail": s,
                              "failed_tests": failed}
    rows.append((f"gpu {name} (1x1)", f"{t - f - e - s} passed, {f + e} failed, {s} skipped/xfail"))
    rows += [("  failed", n) for n in failed]
record = os.path.join(out, "gpu_record.jsonl")
if os.path.exists(record):
    summary["gpu_record"] = [json.loads(line) for line in open(record) if line.strip()]
    for r in summary["gpu_record"]:
        if "rel_l2" in r:
            worst = max(r["rel_l2"], key=r["rel_l2"].get)
            rows.append((f"  {r['test']}", f"worst rel L2 {r['rel_l2'][worst]:.1e} ({worst}) <= {r['tolerance']:.0e}"))
        elif "worst_rel_diff" in r:
            rows.append((f"  {r['test']}", f"losses {r['losses'][0][0]:.4f} -> {r['losses'][-1][0]:.4f}, "
                                           f"worst rel diff {r['worst_rel_diff']:.1e}"))
mesh = os.path.join(out, "mesh", "mesh_summary.json")
if os.path.exists(mesh):
    summary["mesh"] = json.load(open(mesh))
    for tag, m in sorted(summary["mesh"].items()):
        for dtype, c in m.get("cases", {}).items():
            def f(x):
                return "-" if x is None else f"{x:.1e}"
            rows.append((f"mesh {tag} {dtype}", f"{c['ranks_ok']}/{c['ranks']} ranks ok, out {f(c['worst_out'])}, "
                         f"grads {f(c['worst_grad'])}, masks {'-' if c['masks_equal'] is None else 'equal' if c['masks_equal'] else 'DIFFER'}, "
                         f"collectives {'-' if c['collectives_match'] is None else 'as planned' if c['collectives_match'] else 'NOT as planned'}"
                         + (f"; {c['errors'][0][:100]}" if c["errors"] else "")))
        for dtype in m.get("missing", []):
            rows.append((f"mesh {tag} {dtype}", "NOT RUN: the job ended first"))
        if "cases" not in m:
            rows.append((f"mesh {tag}", f"exit {m['rc']}: {m.get('error')}"))
for which in ("nanogpt", "gpt3", "nanogpt_train", "peers_nanogpt", "peers_nanogpt_train", "peers_gpt3"):
    path = os.path.join(out, f"bench_{which}.json")
    if not os.path.exists(path):
        continue
    b = json.load(open(path))
    summary[f"bench_{which}"] = b
    for name, r in b["results"].items():
        # a replayed graph allocates in its pool, made before: its peak above baseline reads 0 (not shown);
        # the captured peers have no saved-activation figure
        mem = "".join(f", {what} {r[key]:.0f} MiB" for key, what in (
            ("peak_mib_above_baseline", "peak"), ("saved_activation_mib", "saved"), ("graph_pool_mib", "pool"),
            ("reserved_mib", "held"))
            if r.get(key) is not None and r[key] == r[key] and not (key == "peak_mib_above_baseline" and r[key] == 0))
        rows.append((f"bench {which} {'fwd+bwd' if 'train' in which else 'fwd'} {name}",
                     f"{r['median_ms']:.3f} ms, "
                     + (f"x{r['ratio_to_eager']:.2f} eager, " if "ratio_to_eager" in r else "")   # (--impl without eager)
                     + f"{r['fraction_of_matmul_rate']:.2f} of floor ({b['compute_floor_ms']:.3f} ms){mem}"))
        if "profile" in r:
            p = r["profile"]
            rows.append((f"  {name}: where the time goes", f"{p['kernels_per_call']:.0f} kernels, GPU busy "
                         f"{p['kernel_ms_per_call']:.3f} ms, idle {p['idle_ms_per_call']:.3f} ms"))
    for name, why in b.get("failed", {}).items():
        rows.append((f"bench {which} {name}", f"FAILED: {why[:150]}"))
    for name, why in b.get("skipped", {}).items():   # an optional peer not installed
        rows.append((f"bench {which} {name}", f"skipped: {why}"))
    if b.get("warmup_s"):   # (earlier reports lack it)
        w = b["warmup_s"]
        rows.append((f"bench {which} warm-up", f"{w['total_s']:.1f} s (building {w['built_s']:.1f}; "
                     + ", ".join(f"{n} {t:.1f}" for n, t in w["each_s"].items()) + ")"))
for path in sorted(glob.glob(os.path.join(out, "overlap_tp*.json"))):   # tools/overlap_check.py, rank 0's rows
    overlap = json.load(open(path))["rows"]
    summary.setdefault("overlap", []).extend(overlap)
    for r in overlap:
        rows.append((f"overlap tp {r['tp']} {r['kind']} x{r['chunks']}",
                     f"FAILED: {r['error'][:150]}" if "error" in r else
                     f"rel err {r['rel_err']:.1e}, vs 1 chunk {r['vs_one_chunk']:.1e}, {r['posted']} posted, "
                     f"{'ok' if r['ok'] else 'FAIL'}"))
for path in sorted(glob.glob(os.path.join(out, "onehead_tp*_h*.txt"))):   # tools/repro_one_head.py, rank 0's lines
    for line in open(path):
        if line.startswith("rank 0: "):
            head, _, verdict = line[len("rank 0: "):].partition(": ")
            summary.setdefault("onehead", []).append({"case": " ".join(head.split()), "result": verdict.strip()})
            rows.append((f"one head: {' '.join(head.split())}", verdict.strip()[:160]))
main = os.path.join(out, "main.json")   # make's job, timed (step main)
if os.path.exists(main):
    summary["main"] = json.load(open(main))
    rows.append(("make's job (tpfuser main)", f"{summary['main']['wall_s']} s, exit {summary['main']['rc']}"))
for path in sorted(glob.glob(os.path.join(out, "firstcall_*.json"))):   # tools/probes/first_call_probe.py
    tag = os.path.basename(path)[len("firstcall_"):-len(".json")]
    try:
        d = json.load(open(path))
    except ValueError:
        rows.append((f"first call {tag}", "no result (its .err says why)"))
        continue
    summary.setdefault("firstcall", {})[tag] = d
    rows.append((f"first call {tag}", first_call_probe.summary_line(d)))
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
width = max(len(k) for k, _ in rows) if rows else 10
for k, v in rows:
    print(f"{k:<{width}}  {v}")
