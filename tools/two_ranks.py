"""Two ranks sharing the one lent GPU (see ../shared/device/README.md).

  dp: a 2x1 mesh (data parallel only) runs to the end; each rank checks its
      output against its batch slice of the reference.      -> $OUT/dp_rank{r}.json
  tp: a 1x2 mesh; nvFuser posts its first tp collective before NCCL refuses
      two ranks on one GPU. Run with NVFUSER_DUMP=communication and parse the
      log with tools/collectives.py.
  sp: the same with sequence parallelism (the first collective: an all-gather).
  dpbwd: a 2x1 mesh, training forward and backward; each rank's gradients
      against the whole batch's reference autograd.         -> $OUT/dpbwd_rank{r}.json
  tpbwd, spbwd: the backward fusion alone on a 1x2 mesh (TP, SP), on zero
      inputs of this rank's shapes, up to its first collective.

Run: torchrun --standalone --nproc-per-node 2 tools/two_ranks.py dp|dpbwd|tp|sp|tpbwd|spbwd
"""
import json
import os
import sys

# Every rank uses GPU 0; only rank 0 serves nvFuser's store.
os.environ["LOCAL_RANK"] = "0"
os.environ["LOCAL_WORLD_SIZE"] = "1"
os.environ["NVFUSER_MASTER_ADDR"] = "localhost" if os.environ.get("RANK", "0") == "0" else "127.0.0.1"
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

import torch  # noqa: E402

from tpfuser.check import check_forward  # noqa: E402
from tpfuser.commlog import error_line  # noqa: E402
from tpfuser.config import Layout, preset  # noqa: E402

mode = sys.argv[1]
rank = int(os.environ["RANK"])
torch.cuda.set_device(0)
out_dir = os.environ.get("OUT", ".")
if mode == "dp":
    results = []
    for name, dtype, p in [("tiny", "fp32", 0.1), ("tiny", "bf16", 0.1), ("nanogpt", "fp32", 0.0),
                           ("nanogpt", "fp32", 0.1), ("nanogpt", "bf16", 0.1)]:
        try:
            r = check_forward(preset(name, dtype=dtype, dropout=p), Layout(2, 1), rank, name).as_dict()
        except Exception as e:  # report, and go on with the next case
            r = {"preset": name, "dtype": dtype, "dropout": p, "mesh": "2x1", "rank": rank, "ok": False,
                 "error": str(e).splitlines()[0][:300]}
        print(f"rank {rank}: {r}", flush=True)
        results.append(r)
    with open(os.path.join(out_dir, f"dp_rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
elif mode == "dpbwd":
    # 2x1: each rank's gradients against the whole batch's reference. Each
    # rank's backward runs on its own tp row; the parameter gradients are
    # summed over dp after it, here through gloo (NCCL refuses two ranks on one GPU).
    import torch.distributed as dist
    from tpfuser.check import GRAD_TOLERANCES, check_backward
    from tpfuser.launch import dp_group
    dist.init_process_group("gloo")
    cfg = preset("tiny", dtype="fp32")
    r = {"preset": "tiny", "dtype": "fp32", "dropout": cfg.dropout, "mesh": "2x1", "rank": rank,
         "tolerance": GRAD_TOLERANCES["fp32"], "ok": False}
    try:
        r["errors"] = check_backward(cfg, Layout(2, 1), rank, dp_group=dp_group(Layout(2, 1), rank))
        r["worst_tensor"], r["worst"] = max(r["errors"].items(), key=lambda kv: kv[1])
        r["ok"] = r["worst"] <= r["tolerance"]
    except Exception as e:
        r["error"] = error_line(e)
    print(f"rank {rank}: {r}", flush=True)
    with open(os.path.join(out_dir, f"dpbwd_rank{rank}.json"), "w") as f:
        json.dump(r, f, indent=1)
elif mode in ("tpbwd", "spbwd"):
    from tpfuser.plan import local_shape, placements, saved_specs
    from tpfuser.runtime import ShardedBlock
    layout = Layout(1, 2, sp=mode == "spbwd")
    cfg = preset("tiny", dtype="bf16", dropout=0.0)
    block = ShardedBlock(cfg, layout, rank, device=torch.device("cuda", 0))
    from tpfuser.reference import PARAM_NAMES
    block.load_shards([torch.zeros(block.local_param_shape(n), device="cuda", dtype=cfg.torch_dtype) for n in PARAM_NAMES])
    kinds = {"block": cfg.torch_dtype, "f32": torch.float32, "u64": torch.uint64, "bool": torch.bool}
    where = placements(layout)
    saved = [torch.zeros(local_shape(tuple(shape), where[name], layout), device="cuda", dtype=kinds[kind])
             for name, (shape, kind) in saved_specs(cfg).items()]
    x = torch.zeros(block.input_shape(), device="cuda", dtype=cfg.torch_dtype)
    try:
        block.backward(x, x, saved)
        print(f"rank {rank}: backward finished (unexpected on one GPU)", flush=True)
    except Exception as e:
        print(f"rank {rank}: stopped: {error_line(e, context=0)[:300]}", flush=True)
elif mode in ("tp", "sp"):
    try:
        check_forward(preset("tiny", dtype="fp32", dropout=0.0), Layout(1, 2, sp=mode == "sp"), rank, "tiny")
        print(f"rank {rank}: tp run finished (unexpected on one GPU)", flush=True)
    except Exception as e:
        print(f"rank {rank}: stopped as expected: {str(e).splitlines()[0][:200]}", flush=True)
sys.stdout.flush()
os._exit(0)  # skip nvFuser's multi-device teardown (see ../shared/device/README.md)
