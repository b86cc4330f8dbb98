"""Where a call's GPU time goes (bench/roofline.py, bench --profile): on made-up
profiler events, each figure worked out by hand here, and the linking of
kernels to the ops that launched them on events the CPU profiler recorded."""
import pytest
import torch

from tpfuser.bench.report import roofline_lines
from tpfuser.bench.roofline import attach_ops, gaps, input_bytes, kernel_kind, op_flops, roofline

BF16 = "c10::BFloat16"
GEMM = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>"
REPLAYED = "nvfuser_pointwise_f0_c1_r0_g0"


@pytest.mark.parametrize("name, kind", [
    (GEMM, "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "gemm"),
    ("triton_tem_fused_addmm_0", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4>, true>", "attention"),
    ("flash_bwd_dot_do_o_kernel", "attention"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "collective"),
    (REPLAYED, "other"), ("triton_poi_fused_add_native_dropout_0", "other"),
    ("Memcpy DtoD (Device -> Device)", "other"), (ADD, "other"),
], ids=lambda v: v if v in ("gemm", "attention", "collective", "other") else None)
def test_a_kernels_kind_is_read_from_its_name(name, kind):
    assert kernel_kind(name) == kind


def test_a_gemm_ops_flops_and_another_ops_input_bytes_from_their_shapes():
    # addmm(bias [3072], a [2048, 1024], b [1024, 3072]): 2 * 2048 * 1024 * 3072
    assert op_flops("aten::addmm", [[3072], [2048, 1024], [1024, 3072], [], []]) == 12_884_901_888
    assert op_flops("aten::mm", [[2048, 4096], [4096, 1024]]) == 17_179_869_184
    assert op_flops("aten::bmm", [[8, 16, 32], [8, 32, 4]]) == 32_768
    assert op_flops("aten::mm", [[2, 3], [4, 5]]) is None              # not a product: no figure
    assert op_flops("aten::add", [[2, 3], [2, 3]]) is None
    # add(a, b, alpha): two bf16 [2048, 1024] tensors, the scalar not memory
    assert input_bytes([[2048, 1024], [2048, 1024], []], [BF16, BF16, "Scalar"]) == 8_388_608
    assert input_bytes([[4, 4], [4]], ["float", "bool"]) == 68
    assert input_bytes([[4, 4]], ["some::NewType"]) is None           # a dtype not known: no guess


def test_the_gaps_are_the_idle_time_between_kernels_overlaps_leave_none():
    # [0, 100) with [20, 30) inside it (another stream), gap 10, [110, 120), [120, 130),
    # [125, 200) overlapping it, gap 10, [210, 215): 2 calls
    kernels = [("a", 100, 0), ("n", 10, 20), ("b", 10, 110), ("c", 10, 120), ("d", 75, 125), ("e", 5, 210)]
    g = gaps(list(reversed(kernels)), calls=2)   # (order of the events does not matter)
    assert g == {"sum_ms_per_call": 0.01, "count_per_call": 1.0, "largest_ms": 0.01}
    assert gaps([], calls=1)["count_per_call"] == 0


def test_each_kernel_against_its_work_at_the_measured_rates():
    """One call: a GEMM (its op's FLOPs), the split-K reduction its op also
    launched (the op's work counted once), an add (its inputs' bytes), a kernel
    no op launched (a graph replay: unknown), and the kinds' totals against
    the plan's FLOPs."""
    kernels = [(GEMM, 100.0, 0.0), ("cublasLt::splitKreduce_kernel", 4.0, 100.0), (ADD, 10.0, 110.0),
               (REPLAYED, 20.0, 130.0)]
    launches = [(GEMM, "aten::addmm", 7, [[3072], [2048, 1024], [1024, 3072], [], []], [BF16] * 3 + ["Scalar"] * 2),
                ("cublasLt::splitKreduce_kernel", "aten::addmm", 7, [[3072], [2048, 1024], [1024, 3072], [], []],
                 [BF16] * 3 + ["Scalar"] * 2),
                (ADD, "aten::add", 9, [[2048, 1024], [2048, 1024], []], [BF16, BF16, "Scalar"]),
                (REPLAYED, None, None, None, None)]
    r = roofline(kernels, launches, calls=1, matmul_flops_per_s=1e15, copy_bytes_per_s=2e12,
                 kind_flops={"gemm": 1.0e10, "attention": 5.0e9})
    rows = {k["name"]: k for k in r["kernels"]}
    assert [k["name"] for k in r["kernels"]] == [GEMM, REPLAYED, ADD, "cublasLt::splitKreduce_kernel"]   # longest first
    gemm = rows[GEMM]
    assert gemm["basis"] == "flops" and gemm["flops_per_call"] == 12_884_901_888
    assert gemm["bound_ms_per_call"] == pytest.approx(0.012884901888)       # FLOPs / 1e15 FLOP/s
    assert gemm["ratio"] == pytest.approx(0.1 / 0.012884901888)
    assert rows["cublasLt::splitKreduce_kernel"]["basis"] == "shared" and "ratio" not in rows["cublasLt::splitKreduce_kernel"]
    add = rows[ADD]
    assert add["basis"] == "input_bytes" and add["bytes_per_call"] == 8_388_608
    assert add["bound_ms_per_call"] == pytest.approx(0.004194304)            # bytes / 2e12 B/s
    assert rows[REPLAYED]["basis"] == "unknown" and "bound_ms_per_call" not in rows[REPLAYED]
    assert r["kinds"]["gemm"]["ms_per_call"] == pytest.approx(0.104)
    assert r["kinds"]["gemm"]["bound_ms_per_call"] == pytest.approx(0.01)      # the plan's 1e10 FLOPs
    assert r["kinds"]["other"] == {"ms_per_call": pytest.approx(0.03), "kernels_per_call": 2.0,
                                   "unknown_ms_per_call": pytest.approx(0.02)}
    assert "attention" not in r["kinds"]   # no kernel of that kind: no figure against its FLOPs
    assert r["gaps"]["sum_ms_per_call"] == pytest.approx(0.016) and r["gaps"]["count_per_call"] == 2   # 6 + 10 us
    lines = roofline_lines(r, 24)
    assert len(lines) == 5   # the kinds, then the four longest kernels
    assert lines[0].split("by kind: ")[1] == ("gemm 0.104 ms (10.40x its floor), other 0.030 ms (0.020 of unknown "
                                              "work); idle gaps 0.016 ms (2.0 a call, largest 0.010)")
    assert lines[2].endswith("work unknown") and lines[3].endswith("2.38x its input bytes at the measured rate")


def test_launches_alike_are_one_entry_per_call_and_a_miscount_gets_no_op():
    """Two calls of two launches of the same add: one entry, two launches a
    call. A kernel the second pass saw a different number of times is not
    given an op (its k-th launch might be another's)."""
    kernels = [(ADD, 10.0, 0.0), (ADD, 10.0, 20.0), (ADD, 10.0, 40.0), (ADD, 10.0, 60.0), (GEMM, 50.0, 80.0)]
    add = (ADD, "aten::add", None, [[1024], [1024], []], [BF16, BF16, "Scalar"])
    launches = [add[:2] + (i,) + add[3:] for i in range(4)] + [(GEMM, "aten::mm", 9, [[4, 4], [4, 4]], [BF16] * 2)] * 2
    r = roofline(kernels, launches, calls=2, matmul_flops_per_s=1e12, copy_bytes_per_s=1e12)
    add_row = next(k for k in r["kernels"] if k["name"] == ADD)
    assert add_row["launches_per_call"] == 2 and add_row["ms_per_call"] == pytest.approx(0.02)
    assert add_row["bytes_per_call"] == 2 * 2 * 1024 * 2     # two launches a call, two bf16 [1024] inputs each
    gemm_row = next(k for k in r["kernels"] if k["name"] == GEMM)
    assert gemm_row["basis"] == "unknown" and gemm_row["op"] is None
    assert [row["op"] for row in attach_ops(kernels[:2], launches[:2])] == ["aten::add", "aten::add"]


def test_kernels_are_linked_to_the_op_the_profiler_recorded_with_shapes():
    """linked_launches on events the CPU profiler recorded (a real addmm, with
    its shapes and dtypes), and GPU events made up to link to it, to nothing,
    and to a CUDA host call that numbers its ids apart."""
    from torch.profiler import ProfilerActivity, profile
    from tpfuser.bench.measure import linked_launches
    a, w, b = (torch.randn(*s, dtype=torch.bfloat16) for s in ((8, 4), (6, 4), (6,)))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.nn.functional.linear(a, w, b)
    events = list(prof.profiler.kineto_results.events())
    addmm = next(e for e in events if e.name() == "aten::addmm")

    class Event:
        def __init__(self, name, device, corr, linked, start):
            self._v = (name, device, corr, linked, start)

        def name(self): return self._v[0]
        def device_type(self): return self._v[1]
        def correlation_id(self): return self._v[2]
        def linked_correlation_id(self): return self._v[3]
        def start_ns(self): return self._v[4]
        def is_async(self): return False
        def shapes(self): return []
        def dtypes(self): return []
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    host_call = 10_000 + addmm.correlation_id()
    made = [Event("gemm", cuda, 0, addmm.correlation_id(), 2), Event("replayed", cuda, 0, 0, 1),
            Event("cudaLaunchKernel", cpu, host_call, 0, 0), Event("launched", cuda, 0, host_call, 3)]
    out = linked_launches(events + made)
    assert out[0] == ("replayed", None, None, None, None)
    assert out[1] == ("gemm", "aten::addmm", addmm.correlation_id(), [[6], [8, 4], [4, 6], [], []],
                      [BF16, BF16, BF16, "Scalar", "Scalar"])
    assert out[2] == ("launched", None, None, None, None)   # a host call of CUDA's, not an op
