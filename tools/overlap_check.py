"""The overlapped linears (parallel.overlapped.row_parallel_overlapped,
parallel.overlapped.allgather_column_parallel_overlapped) on every rank, for each number
of chunks, against the same linear computed whole in float64 and against the
1-chunk fusion (the chunking should change no sum: 1e-6 in fp32), with the
communications nvFuser posted (NVFUSER_DUMP=communication, counted per call).

    TPFUSER_DEFAULT_STREAM_SHIM=$(python3 -c "from tpfuser.dist.sharegpu import build_default_stream_shim as b; print(b())") \
    torchrun --standalone --nproc-per-node 2 -m tpfuser.dist.sharegpu --script \
        tools/overlap_check.py [--chunks 1 2 4] [--json OUT.json]

(ranks sharing a GPU, each set up by tpfuser.dist.sharegpu; the preloaded shim
lets ranks past the GPUs run nvFuser 0.2.36's host IR, which takes a rank's
global index for its CUDA device: sharegpu.check_host_ir_device)

Shapes: nanogpt's MLP c_proj (row-parallel, tokens b*s = 2048) and c_fc under
sequence parallelism (all-gather then column-parallel). Ranks sharing a GPU
check correctness only; the overlap's speed needs a GPU per rank.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("NVFUSER_DUMP", "communication")
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
import torch  # noqa: E402

from tpfuser.verify.oracle import rel_l2  # noqa: E402
from tpfuser.verify.commlog import captured_communications, error_line, error_message  # noqa: E402
from tpfuser.dist.sharegpu import check_host_ir_device  # noqa: E402
from tpfuser.parallel.overlapped import (OVERLAP_OPTIONS, allgather_column_parallel_overlapped,  # noqa: E402
                                         row_parallel_overlapped, run_allgather_overlapped)


def token_blocks(m: torch.Tensor, chunks: int):
    """The row-parallel fusion's streams' parts of [t, n]: blocks of tokens."""
    return m.chunk(chunks)


def gathered_streams(m: torch.Tensor, tp: int, chunks: int):
    """The all-gather fusion's streams' parts of [t, n], its tokens (tp, chunk, row):
    stream i's part is chunk i of every rank's slice."""
    return m.reshape(tp, chunks, -1, m.shape[-1]).unbind(1)


def _verdict(outs: dict, chunks: int, exact: torch.Tensor, by_stream) -> dict:
    """The chunked output (outs[chunks]) against the whole linear and the 1-chunk
    fusion (outs[1]); each stream's part's error (by_stream: a tensor's rows as
    the streams' parts), so that a wrong part is named; and whether a second
    call (outs["again"]) gave the same bits (a race would show there)."""
    out = outs[chunks]
    return {"rel_err": rel_l2(out, exact), "vs_one_chunk": rel_l2(out, outs[1]), "posted": outs[f"posted{chunks}"],
            "chunk_rel_errs": [rel_l2(a, b) for a, b in zip(by_stream(out), by_stream(exact))],
            "second_call_equal": torch.equal(out, outs["again"])}


def row_parallel(rank, tp, chunks, t, e, dtype):
    torch.manual_seed(0)
    h = torch.randn(t, 4 * e, dtype=dtype)
    w = torch.randn(e, 4 * e, dtype=dtype) / (4 * e) ** 0.5
    exact = h.double() @ w.double().T
    h_local, w_local = (m.chunk(tp, dim=1)[rank].contiguous().cuda() for m in (h, w))
    outs = {}
    for n in sorted({1, chunks}):
        of = row_parallel_overlapped(t, 4 * e, e, tp, n, dtype)
        with captured_communications() as posted:
            (outs[n],) = of.fd.execute([h_local, w_local], **OVERLAP_OPTIONS)
        outs[n], outs[f"posted{n}"] = outs[n].cpu(), len(posted)
    (again,) = of.fd.execute([h_local, w_local], **OVERLAP_OPTIONS)
    outs["again"] = again.cpu()
    return _verdict(outs, chunks, exact, lambda m: token_blocks(m, chunks))


def allgather_column(rank, tp, chunks, t, e, dtype):
    torch.manual_seed(1)
    x = torch.randn(t, e, dtype=dtype)                        # the tokens, rank-major over tp
    w = torch.randn(4 * e, e, dtype=dtype) / e ** 0.5
    b = torch.randn(4 * e, dtype=dtype) * 0.1
    exact = x.double() @ w.double().T + b.double()
    outs = {}
    for n in sorted({1, chunks}):
        of = allgather_column_parallel_overlapped(t, e, 4 * e, tp, n, dtype)
        local = x.chunk(tp, dim=0)[rank].reshape(n, 1, t // (n * tp), e).contiguous().cuda()   # its slice, in chunks
        with captured_communications() as posted:
            (out,) = run_allgather_overlapped(of, [local, w.cuda(), b.cuda()])
        # [n, tp, rows, 4e] -> the tokens rank-major: (tp, n, rows) -> t
        outs[n] = out.cpu().permute(1, 0, 2, 3).reshape(t, 4 * e)
        outs[f"posted{n}"] = len(posted)
    (again,) = run_allgather_overlapped(of, [local, w.cuda(), b.cuda()])
    outs["again"] = again.cpu().permute(1, 0, 2, 3).reshape(t, 4 * e)
    return _verdict(outs, chunks, exact, lambda m: gathered_streams(m, tp, chunks))


def main() -> int:
    ap = argparse.ArgumentParser(prog="overlap_check")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--n-embd", type=int, default=1600)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", choices=["row", "allgather"], default=None, help="one of the two linears")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()
    import nvfuser_direct as nvf
    comm = nvf.multidevice.Communicator.instance()
    tp, rank = comm.size(), comm.rank()
    try:   # every rank refuses, so that none waits in a collective for the refused ones
        check_host_ir_device(tp - 1, torch.cuda.device_count())
    except ValueError as e:
        print(f"overlap_check: rank {rank}: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rows = []
    linears = {"row": ("row-parallel all-reduce", row_parallel), "allgather": ("all-gather column-parallel", allgather_column)}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    for kind, fn in [linears[args.only]] if args.only else linears.values():
        for chunks in args.chunks:
            row = {"kind": kind, "tp": tp, "chunks": chunks, "rank": rank}
            try:
                row |= fn(rank, tp, chunks, args.tokens, args.n_embd, dtype)
                bound = 1e-5 if dtype == torch.float32 else 1e-2   # bf16: the output rounded, sums in fp32
                row["ok"] = row["rel_err"] < bound and row["vs_one_chunk"] < bound / 10 and row["second_call_equal"]
            except Exception as e:  # noqa: BLE001 - reported, the other cases run
                row |= {"ok": False, "error": f"{type(e).__name__}: {error_line(e)}", "error_message": error_message(e)}
            rows.append(row)
            print(f"rank {rank} tp {tp} {kind:<28} chunks {chunks}: " +
                  (f"error {row['error'][:300]}" if "error" in row else
                   f"rel err {row['rel_err']:.1e}, vs 1 chunk {row['vs_one_chunk']:.1e}, "
                   f"{row['posted']} communications posted, {'ok' if row['ok'] else 'FAIL'}"
                   + ("" if row["ok"] else f" (per stream's part {', '.join(f'{x:.1e}' for x in row['chunk_rel_errs'])}"
                      f"; a second call {'gave the same bits' if row['second_call_equal'] else 'DIFFERED'})")),
                  flush=True)
            if args.json and rank == 0:
                with open(args.json, "w") as f:
                    json.dump({"rows": rows, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                               "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}, f,
                              indent=1)
    sys.stdout.flush()
    os._exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
