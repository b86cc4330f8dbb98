"""The bench's measured times against `tpfuser plan --predict`'s, one schedule
at one tp a row. Pure Python on the reports' JSON:

    row = compare({"preset": "gpt3", "tp": 8, "schedule": "megatron-sp"},
                  forward=bench_report, train=bench_train_report, prediction=plan_report["prediction"])
    print(format_rows([row, ...]))

Each pass measured against predicted: forward (the bench's forward median:
each sample the slowest rank's), step (the training step's median against
the predicted forward + backward) and backward (step less forward, on both
sides); off = measured / predicted - 1, flagged past TOLERANCE. The
implementation measured is the first of MEASURED that ran: nvfuser-graph (the
calibration's pieces were replayed from CUDA graphs too), else nvfuser
(called: the ring and streams schedules cannot be captured). Beside each
pass, its communication: by kind, the ranks' mean ms per call and exposed
ms from their own traces (bench --profile's comm_by_rank:
measure.exposed_comm), and the model's collectives by kind (comm_ms,
exposed_ms of its pieces); these say where a flagged pass's difference lies
(the collectives' curves, or the compute's calibration). Where the ranks
shared GPUs (the bench report's gpus_shared) the row says that its times are
not speed figures.
"""

from __future__ import annotations

import statistics

TOLERANCE = 0.10   # the issue's: a prediction within 10 % of the measurement
MEASURED = ("nvfuser-graph", "nvfuser")
PASSES = ("forward", "backward", "step")
NOT_SPEED = "ranks shared GPUs: these times are not speed figures"


def measured_impl(report: dict | None) -> str | None:
    """The implementation compared: the first of MEASURED with a result in a bench report."""
    results = (report or {}).get("results", {})
    return next((impl for impl in MEASURED if impl in results), None)


def _median(report: dict | None) -> tuple[str | None, float | None]:
    impl = measured_impl(report)
    return impl, (report["results"][impl]["median_ms"] if impl else None)


def measured_comm(report: dict | None) -> dict:
    """{kind: {"ms", "exposed_ms"}} per call, each the mean over the ranks' traces; {} without them."""
    impl = measured_impl(report)
    ranks = [r for r in ((report or {}).get("results", {}).get(impl, {}).get("profile", {})
                         .get("comm_by_rank") or []) if r]
    kinds = sorted({kind for r in ranks for kind in r})
    return {kind: {"ms": statistics.fmean(r.get(kind, {}).get("ms_per_call", 0.0) for r in ranks),
                   "exposed_ms": statistics.fmean(r.get(kind, {}).get("exposed_ms_per_call", 0.0) for r in ranks)}
            for kind in kinds}


def predicted_comm(prediction: dict | None, passes=("forward",)) -> dict:
    """{kind: {"ms", "exposed_ms"}} of the model's collectives over the passes, by kind ("total": all)."""
    out: dict[str, dict] = {}
    for kind_of_pass in passes:
        for piece in (prediction or {}).get(kind_of_pass, {}).get("pieces", []):
            if piece["kind"] != "collective":
                continue
            for kind in (piece["piece"].split()[0], "total"):
                row = out.setdefault(kind, {"ms": 0.0, "exposed_ms": 0.0})
                row["ms"] += piece["comm_ms"]
                row["exposed_ms"] += piece["exposed_ms"]
    return out


def _pass(measured: float | None, predicted: float | None) -> dict:
    off = measured / predicted - 1 if measured is not None and predicted else None
    return {"measured_ms": measured, "predicted_ms": predicted, "off": off,
            "flagged": off is not None and abs(off) > TOLERANCE}


def compare(job: dict, forward: dict | None = None, train: dict | None = None,
            prediction: dict | None = None) -> dict:
    """One row: job's preset, tp and schedule; the bench's forward and training-step reports
    (None where none came), plan --predict's prediction (its JSON's "prediction")."""
    fwd_impl, fwd_ms = _median(forward)
    step_impl, step_ms = _median(train)
    pf = (prediction or {}).get("forward", {}).get("pass_ms")
    pb = (prediction or {}).get("backward", {}).get("pass_ms")
    predicted = {"forward": pf, "backward": pb, "step": pf + pb if pf is not None and pb is not None else None}
    measured = {"forward": fwd_ms, "step": step_ms,
                "backward": step_ms - fwd_ms if fwd_ms is not None and step_ms is not None else None}
    passes = {k: _pass(measured[k], predicted[k]) for k in PASSES}
    shared = max(int((r or {}).get("gpus_shared", 0)) for r in (forward, train))
    return {**{k: job[k] for k in ("preset", "tp", "schedule")}, "impl": {"forward": fwd_impl, "step": step_impl},
            "passes": passes, "flagged": [k for k in PASSES if passes[k]["flagged"]],
            "comm": {"forward": {"measured": measured_comm(forward), "predicted": predicted_comm(prediction)},
                     "step": {"measured": measured_comm(train),
                              "predicted": predicted_comm(prediction, ("forward", "backward"))}},
            "gpus_shared": shared, **({"note": NOT_SPEED} if shared else {})}


def _ms(v: float | None) -> str:
    return f"{v:8.3f}" if v is not None else f"{'-':>8}"


def _off(p: dict) -> str:
    if p["off"] is None:
        return f"{'-':>8}"
    return f"{100 * p['off']:+7.1f}%" + ("!" if p["flagged"] else " ")


def _exposed(comm: dict) -> str:
    m, p = comm["measured"].get("total", {}), comm["predicted"].get("total", {})
    return f"{_ms(m.get('exposed_ms'))} /{_ms(p.get('exposed_ms'))}"


def format_rows(rows: list[dict]) -> str:
    """The table: each pass's measured and predicted ms and how far off (! past TOLERANCE), the
    exposed communication measured / predicted (forward; step), and what each row measured."""
    shared = any(r["gpus_shared"] for r in rows)
    lines = ([f"NOTE: {NOT_SPEED} (--share-gpu): what the table shows is that each part runs, nothing more"]
             if shared else [])
    lines.append(f"measured (the bench's median, the slowest rank's) against plan --predict, ms per rank; "
                 f"! off by more than {100 * TOLERANCE:.0f} %")
    head = "".join(f"{short + ' meas':>10}{'pred':>9}{'off':>8} " for short in ("fwd", "bwd", "step"))
    lines.append(f"{'preset':<8}{'tp':>3} {'schedule':<28}{head}  {'exposed fwd meas / pred':>24}"
                 f"  {'exposed step meas / pred':>24}  measured")
    for r in rows:
        cells = "".join(f"  {_ms(r['passes'][k]['measured_ms'])} {_ms(r['passes'][k]['predicted_ms'])}"
                        f"{_off(r['passes'][k])}" for k in PASSES)
        impls = sorted({i for i in r["impl"].values() if i}) or ["nothing"]
        lines.append(f"{r['preset']:<8}{r['tp']:>3} {r['schedule']:<28}{cells}  {_exposed(r['comm']['forward']):>24}"
                     f"  {_exposed(r['comm']['step']):>24}  {','.join(impls)}")
    flagged = [r for r in rows if r["flagged"]]
    lines.append(f"{len(flagged)} of {len(rows)} rows off by more than {100 * TOLERANCE:.0f} %"
                 + (": " + "; ".join(f"{r['preset']} tp {r['tp']} {r['schedule']} ({', '.join(r['flagged'])})"
                                     for r in flagged) if flagged else ""))
    return "\n".join(lines)
