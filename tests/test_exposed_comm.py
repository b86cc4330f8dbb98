"""The bench's communication from a profiler trace (bench/measure.py
comm_kind, exposed_comm) on made-up activities: names as NCCL and CUPTI give
them, times in microseconds, chosen so that each answer is worked out by hand."""
import pytest

from tpfuser.bench.measure import comm_kind, exposed_comm

GEMM = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT"


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "allreduce"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "allgather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reducescatter"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "sendrecv"),
    ("ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclWorkElem)", "allreduce"),   # NCCL before 2.19's names
    ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
    ("Memcpy PtoP (Device -> Device)", "copyengine"),
    ("Memcpy DtoD (Device -> Device)", None),   # a copy on the GPU itself: the rank's own work
    (GEMM, None),
], ids=lambda v: str(v)[:24])
def test_each_activity_is_named_for_what_it_moves(name, kind):
    assert comm_kind(name) == kind


def test_exposed_time_is_what_no_compute_runs_beside():
    kernels = [
        (GEMM, 100.0, 0.0),                                   # compute 0-100
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 50.0, 80.0),      # 80-130: 30 alone
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 50.0, 200.0),  # 200-250: all alone
        ("Memcpy PtoP (Device -> Device)", 100.0, 300.0),     # 300-400 beside compute 320-350: 70 alone
        ("triton_poi_fused_add_0", 30.0, 320.0),
        ("ncclDevKernel_AllGather_RING_LL", 100.0, 500.0),    # 500-600 and 550-650: each alone,
        ("ncclDevKernel_SendRecv", 100.0, 550.0),             # their union 150
    ]
    out = exposed_comm(kernels, calls=2)                      # per call: each figure halved
    ms = lambda us: us / 2 / 1e3                              # noqa: E731
    assert out["allreduce"] == pytest.approx({"ms_per_call": ms(50), "exposed_ms_per_call": ms(30),
                                              "count_per_call": 0.5})
    assert out["reducescatter"]["exposed_ms_per_call"] == pytest.approx(ms(50))
    assert out["copyengine"]["exposed_ms_per_call"] == pytest.approx(ms(70))
    assert out["allgather"]["exposed_ms_per_call"] == pytest.approx(ms(100))
    assert out["sendrecv"]["exposed_ms_per_call"] == pytest.approx(ms(100))
    assert out["total"] == pytest.approx({"ms_per_call": ms(50 + 50 + 100 + 150),
                                          "exposed_ms_per_call": ms(30 + 50 + 70 + 150)})


def test_no_communication_is_a_total_of_nothing():
    assert exposed_comm([(GEMM, 10.0, 0.0)], calls=1) == {"total": {"ms_per_call": 0.0, "exposed_ms_per_call": 0.0}}
