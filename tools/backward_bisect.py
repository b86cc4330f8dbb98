"""Which outputs of the meshed backward does nvFuser fail to compile, and why?

One GPU, 1x1 mesh, `tiny`, dropout 0.1. The whole backward in each dtype
asked, then, with --each, each output alone
(define_backward(outputs=[name]): nvFuser compiles only what that output
needs), built, scheduled on the mesh and run on the training forward's saved
tensors. Under the single-fusion schedule (megatron-whole): a cut pass's
earlier fusions return what crosses their cuts whatever the outputs asked. Parallel compilation is off, so an error is the failing segment's
own. Prints a line per case.

    source .nvf/setup.sh; PYTHONPATH=$PWD python3 tools/backward_bisect.py [seconds] [bf16,fp32] [--each]

Writes $OUT/bisect_<dtypes>.json; several can run at once (gpu_suite's bisect step does).
"""
import json
import os
import sys
import time

os.environ.setdefault("NVFUSER_DISABLE", "parallel_compile")
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
import torch  # noqa: E402

from tpfuser.verify.commlog import error_line  # noqa: E402
from tpfuser.config import Layout, preset  # noqa: E402
from tpfuser.block.backward import backward_output_names  # noqa: E402
from tpfuser.parallel.schedule import build_backward  # noqa: E402
from tpfuser.verify.reference import make_block, make_input  # noqa: E402
from tpfuser.runtime.block import ShardedBlock  # noqa: E402

SCHEDULE = "megatron-whole"   # one fusion: an output subset compiles only what it needs


def saved_inputs(cfg, layout):
    """The backward's inputs from a real training forward (which compiles on the mesh)."""
    block = ShardedBlock(cfg, layout, device=torch.device("cuda"), schedule=SCHEDULE).load(make_block(cfg).state_dict())
    x, g = block.shard_input(make_input(cfg)), block.shard_input(make_input(cfg, seed=2))
    _, saved = block.forward_train(x, 1, 5)
    return block.backward_inputs(g, x, saved)   # by name


def run_backward(cfg, layout, outputs, inputs: dict) -> None:
    """The backward (or the part of it `outputs` need), its fusions run in order on `inputs` by name."""
    built = build_backward(cfg, layout, outputs=outputs, schedule=SCHEDULE)
    env = dict(inputs)
    for piece in built.pieces:
        env.update(zip(piece.outputs, piece.execute([env[name] for name in piece.inputs], **built.options)))


def main(budget_s: float, dtypes: str, each: bool) -> None:
    """dtypes: comma-separated. Each one's whole backward is run; with
    each=True, then each output alone of those that fail."""
    deadline = time.time() + budget_s
    tag = dtypes.replace(",", "_")
    rows, path = [], os.path.join(os.environ.get("OUT", "."), f"bisect_{tag}.json")
    layout, inputs = Layout(1, 1), {}

    def run(dtype, outputs):
        cfg = preset("tiny", dtype=dtype)
        if dtype not in inputs:
            inputs[dtype] = saved_inputs(cfg, layout)
        row = {"dtype": dtype, "dropout": cfg.dropout, "outputs": outputs or "all"}
        start = time.perf_counter()
        try:
            run_backward(cfg, layout, outputs, inputs[dtype])
            row["ok"] = True
        except Exception as e:  # nvFuser's compile asserts
            row["ok"], row["error"] = False, error_line(e, context=2, limit=1200)
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        what = ",".join(outputs) if outputs else "all outputs"
        print(f"bisect {dtype} {what:<28} {row['seconds']:>5}s  "
              f"{'ok' if row['ok'] else 'FAIL ' + row['error'][:300]}", flush=True)
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
        return row["ok"]

    failed = [dtype for dtype in dtypes.split(",") if not run(dtype, None)]
    for dtype in failed if each else []:
        for name in backward_output_names():
            if time.time() > deadline:
                print("stopped: time budget spent", flush=True)
                return
            run(dtype, [name])


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--each"]
    main(float(args[0]) if args else 150, args[1] if len(args) > 1 else "bf16,fp32",
         "--each" in sys.argv)
    sys.stdout.flush()
    os._exit(0)   # nvFuser's multi-device objects can crash at interpreter exit (../shared/device/README.md)
