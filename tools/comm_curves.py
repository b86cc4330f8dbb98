"""The machine's own communication curves, nccl-tests style, as the JSON that
`tpfuser plan --predict --comm-table` reads (tpfuser/predict/comm.py, read_comm_table):

    torchrun --standalone --nproc-per-node N tools/comm_curves.py --out DIR [--teams 2 4 8]
        [--min-bytes 65536] [--max-bytes 268435456] [--iters 20] [--reps 5] [--device cpu]

For each team size t (the ranks 0..t-1 of the launch, one GPU each), bf16,
message sizes doubling from --min-bytes to --max-bytes: all_reduce,
all_gather_into_tensor and reduce_scatter_tensor (NCCL, as nccl-tests'
all_reduce_perf, all_gather_perf and reduce_scatter_perf), a ring step of
send/recv (every rank sends to the next rank and receives from the previous
one at once: batch_isend_irecv, as nccl-tests' sendrecv_perf), and the copy
engine's ring step (every rank copies to the next rank's GPU at once,
tensor.copy_ between devices: a peer copy, cudaMemcpyPeerAsync). Each size:
three warm-up operations, then --reps samples of --iters back-to-back
operations timed by CUDA events; the median sample, the slowest rank's.

busbw (nccl-tests' doc/PERFORMANCE.md) is size / time times BUS_FACTORS:
2 (n-1)/n for an all-reduce (size: its buffer), (n-1)/n for an all-gather (its
output) and a reduce-scatter (its input), 1 for a send/recv or copy-engine step
(size: what each rank sends). DIR/comm_table_tp<t>.json holds one table per
kind: allreduce, allgather, reducescatter, and a ring's steps: sendrecv and
copyengine (predict/comm.py's ALL_KINDS; tools/multigpu.py hands plan those it
takes). Every rank needs NVLink multicast off (MULTICAST_OFF in
its environment); nothing here creates a multicast object. --device cpu: a
dry run of the script itself over gloo (no copy engine; perf_counter), its
figures meaningless.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

KINDS = ("allreduce", "allgather", "reducescatter", "sendrecv", "copyengine")
BUS_FACTORS = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
               "reducescatter": lambda n: (n - 1) / n, "sendrecv": lambda n: 1.0, "copyengine": lambda n: 1.0}
# The machines run with NVLink multicast off (NCCL's NVLS algorithms, torch's symmetric memory multicast).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
ELEMENT_BYTES = 2   # bf16


def multicast_left_on(environ) -> list[str]:
    """The MULTICAST_OFF variables that environ does not set so ("NAME=value wanted")."""
    return [f"{k}={v}" for k, v in MULTICAST_OFF.items() if environ.get(k) != v]


def busbw_gbps(kind: str, size: int, ms: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth, GB/s (1e9 B/s), of one operation of `size` bytes in `ms` over `ranks`."""
    return size / (ms * 1e-3) * BUS_FACTORS[kind](ranks) / 1e9


def message_sizes(lo: int, hi: int, team: int) -> list[int]:
    """Sizes doubling from lo to hi, each cut down to whole bf16 elements per rank of the team (an
    all-gather's output and a reduce-scatter's input split evenly), none repeated."""
    out, size = [], lo
    while size <= hi:
        whole = size - size % (team * ELEMENT_BYTES)
        if whole > 0 and whole not in out:
            out.append(whole)
        size *= 2
    return out


def table(kind: str, sizes: list[int], ms: list[float], ranks: int) -> dict:
    """One kind's table as read_comm_table reads it (sizes, busbw_gbps, ranks), the times beside."""
    return {"sizes": list(sizes), "busbw_gbps": [busbw_gbps(kind, s, t, ranks) for s, t in zip(sizes, ms)],
            "ranks": ranks, "time_ms": list(ms)}


def comm_json(tables: dict, source: str, about: dict) -> dict:
    return {"source": source, "tables": tables, **about}


def keep_kinds(source: str, target: str, kinds) -> None:
    """A file of this script's with the tables of `kinds` alone (those a reader takes), into target;
    nothing where source is not a file."""
    if os.path.isfile(source):
        with open(source) as f:
            data = json.load(f)
        with open(target, "w") as f:
            json.dump({**data, "tables": {k: t for k, t in data["tables"].items() if k in kinds}}, f, indent=1)


def _operation(kind, size, group, rank, team, dev):
    """A callable of one operation of `kind` on `size` bytes over the team, on this rank's device."""
    import torch
    import torch.distributed as dist
    n = size // ELEMENT_BYTES
    if kind == "allreduce":
        t = torch.ones(n, dtype=torch.bfloat16, device=dev)
        return lambda: dist.all_reduce(t, group=group)
    if kind in ("allgather", "reducescatter"):
        whole = torch.ones(n, dtype=torch.bfloat16, device=dev)
        part = torch.ones(n // team, dtype=torch.bfloat16, device=dev)
        if kind == "allgather":
            return lambda: dist.all_gather_into_tensor(whole, part, group=group)
        return lambda: dist.reduce_scatter_tensor(part, whole, group=group)
    nxt, prev = (rank + 1) % team, (rank - 1) % team
    send = torch.ones(n, dtype=torch.bfloat16, device=dev)
    if kind == "sendrecv":
        recv = torch.empty_like(send)

        def step():
            ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prev, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return step
    there = torch.empty(n, dtype=torch.bfloat16, device=torch.device("cuda", nxt))   # the next rank's GPU
    return lambda: there.copy_(send, non_blocking=True)


def _time_ms(fn, iters: int, reps: int, cuda: bool) -> float:
    import torch
    for _ in range(3):
        fn()
    if not cuda:   # the dry run's
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
        return statistics.median(samples)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def measure_team(team: int, sizes: list[int], iters: int, reps: int, dev) -> dict:
    """Every kind's table over ranks 0..team-1 (the others wait); every rank of the launch calls it."""
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    group = dist.new_group(list(range(team)))   # (every rank takes part in making it)
    tables = {}
    if rank < team:
        for kind in KINDS if dev.type == "cuda" else KINDS[:-1]:   # (the copy engine: between GPUs)
            ms = []
            for size in sizes:
                dist.barrier(group=group)
                op = _operation(kind, size, group, rank, team, dev)
                t = torch.tensor([_time_ms(op, iters, reps, dev.type == "cuda")], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                ms.append(t.item())
            tables[kind] = table(kind, sizes, ms, team)
            if rank == 0:
                print(f"tp {team} {kind}: " + ", ".join(f"{s >> 10} KiB {b:.0f}" for s, b in
                                                        zip(sizes, tables[kind]["busbw_gbps"])) + " GB/s", flush=True)
    dist.barrier()
    return tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the folder for comm_table_tp<t>.json")
    ap.add_argument("--teams", type=int, nargs="+", default=None, help="team sizes (default: the launch's world)")
    ap.add_argument("--min-bytes", type=int, default=64 << 10)
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "0"))
    teams = args.teams or [world]
    why = ("needs MULTICAST_OFF in the environment: " + ", ".join(multicast_left_on(os.environ))
           if multicast_left_on(os.environ) else
           "run it under torchrun, one rank per GPU" if world < 2 else
           f"--teams {teams}: each must be 2 to the world ({world})" if not all(2 <= t <= world for t in teams) else
           f"--min-bytes {args.min_bytes}, --max-bytes {args.max_bytes}: expected 0 < min <= max"
           if not 0 < args.min_bytes <= args.max_bytes else None)
    if why:
        print(f"error: comm_curves: {why}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
        gpu, nccl = torch.cuda.get_device_name(), ".".join(map(str, torch.cuda.nccl.version()))
    else:
        dev, gpu, nccl = torch.device("cpu"), "cpu (a dry run of the script: no figure means anything)", None
        dist.init_process_group("gloo")
    try:
        for team in teams:
            sizes = message_sizes(args.min_bytes, args.max_bytes, team)
            tables = measure_team(team, sizes, args.iters, args.reps, dev)
            if rank == 0:
                about = {"gpu": gpu, "ranks": team, "world": world, "dtype": "bf16", "torch": torch.__version__,
                         "nccl": nccl, "timing": f"median of {args.reps} samples of {args.iters} back-to-back "
                                                 f"operations, the slowest rank's", "environment": dict(MULTICAST_OFF)}
                source = f"tools/comm_curves.py on {team} x {gpu}, NCCL {nccl}, bf16"
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"comm_table_tp{team}.json"), "w") as f:
                    json.dump(comm_json(tables, source, about), f, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
