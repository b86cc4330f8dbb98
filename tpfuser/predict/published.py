"""Published figures the default interconnects (comm.py) are built from, each
with the public source it was copied from.

NCCL's collectives: nccl-tests output of one node of 8 H100 SXM (NVLink 4,
NVSwitch), NCCL 2.26.2, nccl-tests 2.17.9, one process driving the 8 GPUs,
float, out-of-place busbw, sizes doubling from the first. Its "ring" runs set
NCCL_ALGO=RING NCCL_NVLS_ENABLE=0 (the repository's
benchmarks/slurm_nccl_benchmark.sh): NVLink multicast off, as on the machines
this project runs on. Its "nvls" run leaves multicast on (NVLink SHARP
reduces inside the switch: busbw is then no longer what a link carries).

A ring's steps (parallel/collectives.py, algorithm "ring") are P2P transfers
of one rank's chunk between two GPUs, timed as latency + bytes / bandwidth:

* NCCL send/recv: no published sendrecv_perf output of two H100 SXM on one
  NVSwitch was found. Taken from the same node's ring all-gather instead,
  whose n-1 steps are NCCL send/recv between neighbours (nccl-tests'
  doc/PERFORMANCE.md: an all-gather's busbw is what each rank's link
  carries): the bandwidth is its busbw at its largest size, the latency its
  smallest size's time over its 7 steps.
* The copy engine (nvFuser's "cuda" backend: cudaMemcpyAsync over CUDA IPC):
  cuda-samples' p2pBandwidthLatencyTest, unidirectional P2P writes between two
  H100 SXM of one node (https://github.com/NVIDIA/nccl/issues/1264), which
  copies with cudaMemcpyPeerAsync, the copy engine
  (https://github.com/NVIDIA/nccl-tests/issues/149); the latency of one
  cudaMemcpyAsync put of 1 B over NVLink 4 on H100
  (https://github.com/meta-pytorch/torchcomms/pull/2195).
"""

from __future__ import annotations

KiB, MiB = 1 << 10, 1 << 20


def doubling(first: int, busbw: tuple[float, ...]) -> tuple[tuple[int, float], ...]:
    """(size, busbw) pairs at sizes doubling from `first`."""
    return tuple((first << i, b) for i, b in enumerate(busbw))


TOGETHER = "github.com/togethercomputer/together-nccl-tests, benchmarks/H100/results"
RING_RUN, NVLS_RUN = f"{TOGETHER}/20260305_220043", f"{TOGETHER}/20260305_221443"
RING_SETTINGS = ("NCCL_ALGO=RING NCCL_NVLS_ENABLE=0 (github.com/togethercomputer/together-nccl-tests, "
                 "benchmarks/slurm_nccl_benchmark.sh)")

ALLGATHER_RING = doubling(128 * KiB, (3.12, 6.24, 11.43, 22.02, 44.24, 88.77, 156.12, 207.36, 234.03, 278.45,
                                      298.43, 320.49, 335.70, 344.53, 350.36, 355.23, 357.90))
REDUCESCATTER_RING = doubling(128 * KiB, (3.12, 6.27, 11.76, 22.60, 44.05, 88.02, 145.53, 203.96, 247.18,
                                          284.43, 307.89, 327.04, 337.19, 346.49, 351.01, 359.62, 363.18))
# 512 KiB left out: out of place 69.2 us against 44.2 in place, an outlier.
ALLREDUCE_RING = doubling(64 * KiB, (3.21, 6.15, 12.09)) + doubling(1 * MiB, (
    39.44, 87.26, 138.26, 182.39, 231.88, 274.45, 318.55, 334.33, 347.64, 355.65, 360.07, 363.84, 366.72, 368.09))
ALLREDUCE_NVLS = doubling(1 * MiB, (43.38, 83.73, 131.03, 172.95, 233.92, 293.22, 358.97, 398.98, 421.78,
                                    437.03, 467.77, 472.84, 477.00, 479.61))

SOURCES = {
    "allgather": f"nccl-tests all_gather_perf on 8xH100 SXM, ring, 128 KiB-8 GiB ({RING_RUN}/all_gather_ring.out)",
    "reducescatter": f"nccl-tests reduce_scatter_perf on 8xH100 SXM, ring, 128 KiB-8 GiB "
                     f"({RING_RUN}/reduce_scatter_ring.out)",
    "allreduce": f"nccl-tests all_reduce_perf on 8xH100 SXM, ring, 64 KiB-8 GiB ({RING_RUN}/all_reduce_ring.out)",
    "allreduce-nvls": f"nccl-tests all_reduce_perf on 8xH100 SXM, NVLS (NVLink multicast on), 1 MiB-8 GiB "
                      f"({NVLS_RUN}/all_reduce_nvls.out); below 1 MiB the ring run's 64-256 KiB "
                      f"({RING_RUN}/all_reduce_ring.out)",
}
ON_H200 = ("every table measured on H100 SXM, taken for H200 SXM: the same NVLink 4 (18 links, 900 GB/s a GPU) "
           "and NVSwitch; no public 8xH200 figures were found; replace them with nccl-tests output from the "
           "machine (--comm-table)")

# P2P, per direction between two GPUs of one NVSwitch node: (latency in us, bandwidth in GB/s, source).
_AG_STEPS = 7   # the all-gather's steps over its 8 ranks
_AG_FLOOR_US = (_AG_STEPS / 8) * ALLGATHER_RING[0][0] / (ALLGATHER_RING[0][1] * 1e9) * 1e6
SENDRECV = (_AG_FLOOR_US / _AG_STEPS, ALLGATHER_RING[-1][1],
            f"NCCL send/recv, no published H100 sendrecv_perf found: taken from the ring all-gather's steps "
            f"({RING_RUN}/all_gather_ring.out): {ALLGATHER_RING[-1][1]:g} GB/s its busbw at 8 GiB, "
            f"{_AG_FLOOR_US / _AG_STEPS:.2f} us its 128 KiB time ({_AG_FLOOR_US:.1f} us) over its {_AG_STEPS} steps")
COPYENGINE = (3.55, 376.0,
              "copy engine: 376 GB/s, p2pBandwidthLatencyTest unidirectional P2P writes between two H100 SXM "
              "(https://github.com/NVIDIA/nccl/issues/1264), which copies by cudaMemcpyPeerAsync, the copy engine "
              "(https://github.com/NVIDIA/nccl-tests/issues/149); 3.55 us, one cudaMemcpyAsync put of 1 B over "
              "NVLink 4 on H100 (https://github.com/meta-pytorch/torchcomms/pull/2195)")
