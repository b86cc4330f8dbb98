"""`tpfuser check --json` reports made up for the CPU tests of the tools that
read them (tools/mesh_suite.py, tools/summarize.py): the keys meshes.run_checks
writes, figures invented, and the collectives of each rank written out by hand
from Megatron-LM's plan for `tiny` (b 4, s 16, e 64), not from the package's."""
from __future__ import annotations

import copy

B, S, E = 4, 16, 64


def megatron_posted(dp: int, tp: int, sp: bool, rank: int, unit_splits: bool = False) -> dict[str, list[dict]]:
    """What nvFuser posts on `rank` in each phase, by hand: under TP an all-reduce
    after each row-parallel linear (forward) and after each column-parallel input
    gradient (backward); under SP an all-gather before each column-parallel linear
    and a reduce-scatter after each row-parallel one, backward an all-gather
    before the row-parallel's and the column-parallel's weight gradient, a
    reduce-scatter of its input gradient, and an all-reduce of each sublayer's
    sequence-summed LayerNorm weight and bias and row bias ([e] each). Every one
    over the rank's tp row, of the rank's b/dp batch; nothing over a tp of one
    (unless the unit-axis splits post it anyway)."""
    team, n = [rank // tp * tp + t for t in range(tp)], B // dp * S * E
    if tp == 1 and not unit_splits:
        return {"forward": [], "training forward": [], "backward": []}

    def c(kind, numel=n):
        return {"kind": kind, "team": team, "numel": numel}
    if sp:
        forward = [c("allgather"), c("reducescatter")] * 2
        backward = [c("allgather"), c("allgather"), c("reducescatter"), *[c("allreduce", E)] * 3] * 2
    else:
        forward, backward = [c("allreduce")] * 2, [c("allreduce")] * 2
    return {"forward": forward, "training forward": copy.deepcopy(forward), "backward": backward}


FIGURES = {   # dtype: (out rel err, tolerance, branch rel err, worst gradient, its tolerance)
    "fp32": (2.0e-8, 1e-5, 4.9e-7, 2.4e-7, 1e-5),
    "bf16": (3.0e-3, 1e-2, 4.0e-3, 6.0e-3, 2e-2),
}


def rank_report(dp: int, tp: int, sp: bool, rank: int, dtype: str = "fp32", dropout: float = 0.1,
                posted: dict | None = None, **fields) -> dict:
    """One rank's case as RankReport.as_dict stores it, passing (figures within
    bounds, masks equal, the collectives posted as planned) unless fields say otherwise."""
    out, tol, branch, grad, grad_tol = FIGURES[dtype]
    masks = {"resid_attn_keep": 0, "resid_mlp_keep": 0}
    forward = {"rel_err": out, "branch_rel_err": branch, "tolerance": tol, "mask_mismatches": dict(masks)}
    if dtype == "bf16" and dropout > 0:
        forward["wrong_stream_branch_rel_err"] = 3.5 * branch   # the wrong streams' error, 3.5 times the right one's
    posted = megatron_posted(dp, tp, sp, rank) if posted is None else posted
    return {"preset": "tiny", "dtype": dtype, "dropout": dropout, "mesh": f"{dp}x{tp}", "sp": sp, "rank": rank,
            "forward": forward,
            "backward": {"errors": {"mlp.c_fc.weight": grad}, "worst": grad, "worst_tensor": "mlp.c_fc.weight",
                         "tolerance": grad_tol, "over_bound": [], "mask_mismatches": dict(masks)},
            "collectives": {phase: {"planned": [], "posted": p, "matches": True} for phase, p in posted.items()},
            "ok": True, **fields}


def mesh_report(dp: int, tp: int, sp: bool = False, dtypes=("fp32", "bf16"), ran=None, commit: str = "cac77df0",
                **fields) -> dict:
    """A mesh's report: every rank of each dtype in `ran` (default: all asked)."""
    ran = dtypes if ran is None else ran
    cases = [{"dtype": d, "dropout": 0.1, "ranks": [rank_report(dp, tp, sp, r, d) for r in range(dp * tp)]}
             for d in ran]
    return {"environment": {"date": "made up", "gpu": "MADE UP", "gpus_shared": 1, "commit": commit},
            "preset": "tiny", "mesh": f"{dp}x{tp}", "sp": sp,
            "config": [{"batch": B, "seq": S, "n_embd": E, "n_head": 8, "dropout": 0.1, "dtype": d} for d in dtypes],
            "split_unit_axes": False, "cases": cases, "ok": True, **fields}
