"""The bench's times against plan --predict's (tpfuser/bench/predicted.py) on
made-up reports, every figure worked out by hand."""
import pytest

from tpfuser.bench.predicted import compare, format_rows, measured_comm, predicted_comm

JOB = {"preset": "gpt3", "tp": 8, "schedule": "megatron"}


def _bench(medians: dict, comm_by_rank=None, shared: int = 0) -> dict:
    results = {impl: {"median_ms": ms} for impl, ms in medians.items()}
    if comm_by_rank is not None:
        for row in results.values():
            row["profile"] = {"comm_by_rank": comm_by_rank}
    return {"results": results, "gpus_shared": shared}


def _comm(ms: float, exposed: float) -> dict:
    row = {"ms_per_call": ms, "exposed_ms_per_call": exposed}
    return {"allreduce": row, "total": row}


PREDICTION = {
    "forward": {"pass_ms": 1.8, "pieces": [
        {"piece": "ln_1", "kind": "pointwise", "comm_ms": 0.0, "exposed_ms": 0.0},
        {"piece": "allreduce after attn.c_proj", "kind": "collective", "comm_ms": 0.2, "exposed_ms": 0.2},
        {"piece": "allreduce after mlp.c_proj", "kind": "collective", "comm_ms": 0.25, "exposed_ms": 0.1}]},
    "backward": {"pass_ms": 4.0, "pieces": [
        {"piece": "allreduce of the input gradient of mlp.c_fc", "kind": "collective", "comm_ms": 0.3,
         "exposed_ms": 0.3}]},
}


def test_each_pass_against_the_model():
    forward = _bench({"nvfuser": 2.5, "nvfuser-graph": 2.0, "dtensor": 3.0}, [_comm(0.4, 0.3), _comm(0.6, 0.5)])
    train = _bench({"nvfuser": 7.0})          # a schedule that cannot be captured: the called block
    row = compare(JOB, forward, train, PREDICTION)
    assert row["impl"] == {"forward": "nvfuser-graph", "step": "nvfuser"}
    assert row["passes"]["forward"] == pytest.approx({"measured_ms": 2.0, "predicted_ms": 1.8, "off": 2.0 / 1.8 - 1,
                                                      "flagged": True})
    assert row["passes"]["step"]["predicted_ms"] == pytest.approx(5.8)
    assert row["passes"]["step"]["off"] == pytest.approx(7.0 / 5.8 - 1)
    assert row["passes"]["backward"]["measured_ms"] == pytest.approx(5.0)    # step less forward
    assert row["passes"]["backward"]["off"] == pytest.approx(0.25)
    assert row["flagged"] == ["forward", "backward", "step"]
    measured, predicted = measured_comm(forward), predicted_comm(PREDICTION)
    assert set(measured) == set(predicted) == {"allreduce", "total"}
    for kind in ("allreduce", "total"):
        assert measured[kind] == pytest.approx({"ms": 0.5, "exposed_ms": 0.4})    # the mean of the two ranks
        assert predicted[kind] == pytest.approx({"ms": 0.45, "exposed_ms": 0.3})  # the two collectives' sum
    assert row["comm"]["step"]["predicted"]["total"] == pytest.approx({"ms": 0.75, "exposed_ms": 0.6})
    assert "note" not in row


def test_within_the_tolerance_is_not_flagged_and_what_is_missing_is_a_dash():
    row = compare(JOB, _bench({"nvfuser-graph": 1.9}), None, PREDICTION)
    assert row["passes"]["forward"]["off"] == pytest.approx(1.9 / 1.8 - 1)   # +5.6 %
    assert row["flagged"] == []
    assert row["passes"]["step"] == {"measured_ms": None, "predicted_ms": pytest.approx(5.8), "off": None,
                                     "flagged": False}
    lines = format_rows([row]).splitlines()
    assert lines[-1] == "0 of 1 rows off by more than 10 %"
    assert lines[-2].split()[:6] == ["gpt3", "8", "megatron", "1.900", "1.800", "+5.6%"]
    assert lines[-2].split()[-1] == "nvfuser-graph"


def test_a_flagged_row_is_marked_and_named():
    row = compare(JOB, _bench({"nvfuser-graph": 2.0}), _bench({"nvfuser-graph": 5.9}), PREDICTION)
    table = format_rows([row])
    assert "+11.1%!" in table
    assert table.splitlines()[-1] == "1 of 1 rows off by more than 10 %: gpt3 tp 8 megatron (forward)"   # step +1.7 %


def test_shared_gpus_say_the_times_are_not_speed_figures():
    row = compare(JOB, _bench({"nvfuser": 9.0}, shared=1), None, PREDICTION)
    assert row["gpus_shared"] == 1 and "not speed figures" in row["note"]
    assert format_rows([row]).startswith("NOTE: ranks shared GPUs: these times are not speed figures")
    assert not format_rows([compare(JOB, _bench({"nvfuser": 9.0}), None, None)]).startswith("NOTE")
