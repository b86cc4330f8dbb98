"""The benchmark's report: its JSON schema and its table. Pure Python, read by
run.py (which writes reports), plot.py and the tests (which read them)."""

from __future__ import annotations

# Parts of the block's work timed alone beside the implementations (run.py,
# --impl gemms,gemms+attention): never a peer.
WORK_ONLY = ("gemms", "gemms+attention")


REPORT_KEYS = {"preset": str, "config": dict, "pass": str, "mesh": str, "gpu": str, "torch": str, "timing": str,
               "matmul_tflops_measured": float, "matmul_gflop": float, "compute_floor_ms": float, "results": dict}
RESULT_KEYS = {"median_ms": float, "min_ms": float, "max_ms": float, "runs": int, "tflops": float,
               "fraction_of_matmul_rate": float}


def validate_report(rep: dict) -> dict:
    """Check a bench report's schema (the JSON the plot and the README read); return it."""
    def check(obj, keys, where, what="an object"):
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected {what}, got {type(obj).__name__}")
        for key, kind in keys.items():
            if key not in obj:
                raise ValueError(f"{where}: missing key {key!r}")
            value = obj[key]
            if kind in (int, float):   # an int is a float's value; JSON's true is neither
                ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
            else:
                ok = isinstance(value, kind)
            if not ok:
                raise ValueError(f"{where}.{key}: expected {kind.__name__}, got {type(value).__name__}")
    if "forward_matmul_gflop" in rep:   # the key's earlier name (results/ keeps reports with it)
        rep.setdefault("matmul_gflop", rep["forward_matmul_gflop"])
    check(rep, REPORT_KEYS, "report")
    if not rep["results"]:
        raise ValueError("report.results: no implementation")
    for name, row in rep["results"].items():
        check(row, RESULT_KEYS, f"report.results[{name!r}]", "an object of timings")
        if not row["min_ms"] <= row["median_ms"] <= row["max_ms"]:
            raise ValueError(f"report.results[{name!r}]: expected min <= median <= max")
    return rep


def add_ratios(rows: dict) -> str | None:
    """Each row's median as a ratio to eager's and to the fastest peer's (what a
    user would pick instead of tpfuser: every implementation not nvfuser*, nor
    a part of the block's work timed alone, WORK_ONLY).
    Returns that peer's name, or None without peers."""
    if "eager" in rows:
        for r in rows.values():
            r["ratio_to_eager"] = r["median_ms"] / rows["eager"]["median_ms"]
    peers = [name for name in rows if not name.startswith("nvfuser") and name not in WORK_ONLY]
    if not peers:
        return None
    best = min(peers, key=lambda n: rows[n]["median_ms"])
    for r in rows.values():
        r["ratio_to_best_peer"] = r["median_ms"] / rows[best]["median_ms"]
    return best


def roofline_lines(roof: dict, w: int, top: int = 4) -> list[str]:
    """An implementation's time per call by kernel kind (against the floor's
    FLOPs of that kind), its idle gaps, and its longest kernels against their
    work where it is known (bench/roofline.py)."""
    kinds = []
    for kind, k in roof["kinds"].items():
        part = f"{kind} {k['ms_per_call']:.3f} ms"
        if "ratio" in k:
            part += f" ({k['ratio']:.2f}x its floor)"
        elif k["unknown_ms_per_call"]:
            part += f" ({k['unknown_ms_per_call']:.3f} of unknown work)"
        kinds.append(part)
    g = roof["gaps"]
    lines = [f"{'':<{w}}by kind: " + ", ".join(kinds) + f"; idle gaps {g['sum_ms_per_call']:.3f} ms "
             f"({g['count_per_call']:.1f} a call, largest {g['largest_ms']:.3f})"]
    for k in roof["kernels"][:top]:
        against = (f"{k['ratio']:.2f}x its {k['basis'].replace('_', ' ')} at the measured rate" if "ratio" in k
                   else "work " + k["basis"])
        lines.append(f"{'':<{w}}  {k['name'][:56]:<56} {k['kind']:<10}{k['ms_per_call']:>8.3f} ms  {against}")
    return lines


def format_table(rep: dict) -> str:
    w = max([24, *(len(n) + 1 for n in (*rep["results"], *rep.get("failed", {}), *rep.get("skipped", {})))])
    lines = [f"{rep['preset']} {rep['pass']} on {rep['gpu']} (mesh {rep['mesh']}): "
             f"floor {rep['compute_floor_ms']:.3f} ms at {rep['matmul_tflops_measured']:.0f} TFLOP/s measured"
             + (f"; copy {rep['copy_gbps_measured']:.0f} GB/s" if "copy_gbps_measured" in rep else "")
             + (f"; communication floor {rep['comm_floor_ms']:.3f} ms at {rep['allreduce_busbw_gbps']:.0f} GB/s "
                f"all-reduce bus bandwidth over tp" if "comm_floor_ms" in rep else ""),
             (f"vs peer: to {rep['best_peer']}, the fastest peer\n" if rep.get("best_peer") else "") +
             f"{'impl':<{w}}{'median ms':>10}{'min':>8}{'max':>8}{'TFLOP/s':>9}{'of floor':>9}{'vs eager':>9}{'vs peer':>8}"]
    if rep.get("gpus_shared"):
        lines[0] += (f"\nthe {rep['mesh']} ranks shared {rep['gpus_shared']} GPU(s) (--share-gpu): "
                     f"these timings are not speed figures")
    host = all("host_ms" in r for r in rep["results"].values())   # (earlier reports lack it)
    if host:
        lines[1] += f"{'host ms':>9}"
    if any("peak_mib_above_baseline" in r for r in rep["results"].values()):
        lines[1] += f"{'peak MiB':>10}{'saved MiB':>10}{'pool MiB':>10}{'held MiB':>10}"
    for name, r in rep["results"].items():
        line = (f"{name:<{w}}{r['median_ms']:>10.3f}{r['min_ms']:>8.3f}{r['max_ms']:>8.3f}{r['tflops']:>9.0f}"
                f"{r['fraction_of_matmul_rate']:>9.2f}{r.get('ratio_to_eager', float('nan')):>9.2f}"
                f"{r.get('ratio_to_best_peer', float('nan')):>8.2f}" + (f"{r['host_ms']:>9.3f}" if host else ""))
        if "peak_mib_above_baseline" in r:
            line += (f"{r['peak_mib_above_baseline']:>10.1f}{r.get('saved_activation_mib', float('nan')):>10.1f}"
                     f"{r.get('graph_pool_mib', float('nan')):>10.1f}{r.get('reserved_mib', float('nan')):>10.1f}")
        lines.append(line)
    for name, why in rep.get("failed", {}).items():
        lines.append(f"{name:<{w}}failed: {why[:160]}")
    for name, why in rep.get("skipped", {}).items():
        lines.append(f"{name:<{w}}skipped: {why}")
    if rep.get("thunder"):
        lines.append(f"thunder: {rep['thunder']}")
    for name, r in rep["results"].items():
        if "profile" in r:
            p = r["profile"]
            lines.append(f"{name:<{w}}{p['kernels_per_call']:.0f} kernels a call, GPU busy {p['kernel_ms_per_call']:.3f} ms, "
                         f"idle {p['idle_ms_per_call']:.3f} ms; most: " +
                         ", ".join(f"{k[:40]} {ms:.3f}" for k, ms in p["top_kernels_ms_per_call"][:3]) +
                         ("; idle most before: " + ", ".join(f"{k[:40]} {ms:.3f}" for k, ms in p["idle_before_ms_per_call"])
                          if p.get("idle_before_ms_per_call") else ""))
            if "roofline" in p:
                lines += roofline_lines(p["roofline"], w)
            ranks = [c["total"] for c in p.get("comm_by_rank") or () if c and c["total"]["ms_per_call"] > 0]
            if ranks:   # each rank's own trace (measure.exposed_comm)
                lines.append(f"{'':<{w}}communication a call, rank by rank: " + ", ".join(
                    f"{c['ms_per_call']:.3f} ms ({c['exposed_ms_per_call']:.3f} exposed)" for c in ranks))
    warm = rep.get("warmup_s")
    if warm:
        lines.append(f"warm-up {warm['total_s']:.1f} s (building {warm['built_s']:.1f}, then each: "
                     + ", ".join(f"{n} {t:.1f}" for n, t in warm["each_s"].items()) + ")")
    return "\n".join(lines)
