"""nvFuser 0.2.36 at one head per rank: the q/k/v split and its gradient's assembly, in each form.

    torchrun --nproc-per-node TP tools/repro_one_head.py HEADS [FORM ...]      (a GPU per rank)
    torchrun --nproc-per-node TP -m tpfuser.dist.sharegpu --script tools/repro_one_head.py HEADS [FORM ...]
                                                             (ranks sharing a GPU)

qkv [b, s, h*3d] (rows head by head: [h, 3, d], as the block orders them) is
split over tp on its heads; q, k and v are taken out of it and attention-like
products made, (q k^T) v; the backward part assembles g_qkv [b, s, h*3d] from
g_q, g_k, g_v [b, h, s, d]. Each rank compares with torch.

Forms (default: all):
  slice   q, k, v as slices of the (b, s, h, 3d) view, g_qkv by cat: the block's
          form. With h == tp (one head per rank) it fails in 0.2.36 (on an
          H200, docs/history.md): the slice is a view whose size-1
          head axis the stride validator skips,
          "Expected (stride)==(expected_stride_if_contiguous). Found 24 vs 8".
  select  q, k, v by select on the 3-axis of the (b, s, h, 3, d) view (SelectOp
          is not an alias in alias_analysis.cpp: a kernel writes a fresh tensor);
          g_qkv by cat.
  onehot  q, k, v as sums over the 3-axis of (b, s, h, 3, d) times a one-hot of
          iota(3) (no slice, no select); g_qkv as the sum of g_q, g_k, g_v
          broadcast on the 3-axis times their one-hots (no cat: pointwise).
  onehot_in  onehot with the one-hots the rows of an input, the identity [3, 3]
          replicated on the mesh (in case iota's tensors, which no input
          reaches, have no mesh for the multi-device passes).
Each form is bounded by FORM_S seconds (env ONE_HEAD_FORM_S, default 120), or
less where the launcher's bound comes first (launch.STACKS_AT_VAR): a rank still
in it then prints its stacks and exits 1. Outside the forms (start-up, exit) a
rank prints its stacks at the launcher's time (launch.arm_stack_dumps), and
`kill -USR1` prints them at any time. Each stage is a line on stderr, with the
seconds since the rank started.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import time

import torch
from nvfuser_direct import DataType, FusionDefinition, ParallelType

FORMS = ("select", "onehot", "onehot_in", "slice")   # the one expected to fail last
B, S, D = 2, 8, 8
FORM_S = float(os.environ.get("ONE_HEAD_FORM_S", "120"))
START = time.monotonic()


def _line(text: str, file=None) -> None:
    """text and its newline in one write: the ranks share one log, and under
    PYTHONUNBUFFERED print writes the two apart, so another rank's line can
    fall between them."""
    file = file or sys.stdout
    file.write(text + "\n")
    file.flush()


def _stage(what: str) -> None:
    _line(f"[rank {os.environ.get('RANK', '?')} +{time.monotonic() - START:.1f} s] {what}", sys.stderr)


def _form_bound_s() -> float:
    """FORM_S, or the time left before the launcher wants the stacks, if sooner."""
    from tpfuser.dist.launch import stacks_due_in_s
    left = stacks_due_in_s()
    return FORM_S if left is None else min(FORM_S, left)


def _one_hot(fd, i: int, eye=None):
    """[1, 1, 1, 3, 1] float: 1 at i on the 3-axis (row i of eye when given, else from iota)."""
    if eye is not None:
        hot = fd.ops.select(eye, fd.define_scalar(i, dtype=DataType.Int), dim=0)
    else:
        hot = fd.ops.cast(fd.ops.eq(fd.ops.iota(fd.define_scalar(3, dtype=DataType.Int)), i), DataType.Float)
    return fd.ops.broadcast_in_dim(hot, shape=[1, 1, 1, 3, 1], broadcast_dims=[3])


def _take(fd, qkv, heads: int, i: int, form: str, eye=None):
    """Part i (q, k or v) of qkv [b, s, h*3d] as (b, h, s, d)."""
    if form == "slice":
        t = fd.ops.reshape(qkv, new_shape=[B, S, heads, 3 * D])
        t = fd.ops.slice(t, start_indices=[0, 0, 0, i * D], end_indices=[B, S, heads, (i + 1) * D])
    else:
        t = fd.ops.reshape(qkv, new_shape=[B, S, heads, 3, D])
        t = fd.ops.select(t, fd.define_scalar(i, dtype=DataType.Int), dim=3) if form == "select" else \
            fd.ops.sum(fd.ops.mul(t, _one_hot(fd, i, eye)), dims=[3])
    return fd.ops.permute(t, dims=[0, 2, 1, 3])


def _assemble(fd, grads, heads: int, form: str, eye=None):
    """g_qkv [b, s, h*3d] from g_q, g_k, g_v, each (b, h, s, d)."""
    parts = [fd.ops.permute(g, dims=[0, 2, 1, 3]) for g in grads]          # (b, s, h, d)
    if form.startswith("onehot"):
        spread = [fd.ops.mul(fd.ops.broadcast_in_dim(g, shape=[B, S, heads, 3, D], broadcast_dims=[0, 1, 2, 4]),
                             _one_hot(fd, i, eye)) for i, g in enumerate(parts)]
        g5 = fd.ops.add(fd.ops.add(spread[0], spread[1]), spread[2])       # (b, s, h, 3, d)
        return fd.ops.reshape(g5, new_shape=[B, S, heads * 3 * D])
    cat = fd.ops.cat(parts, dim=3, manual_padding=0)                      # (b, s, h, 3d)
    return fd.ops.reshape(cat, new_shape=[B, S, heads * 3 * D])


def define(fd: FusionDefinition, heads: int, tp: int, form: str, mesh=None) -> None:
    """Inputs qkv [b, s, h*3d], g_q, g_k, g_v [b, h, s, d] (and for onehot_in the
    identity [3, 3]); outputs (q k^T) v and g_qkv, every tensor but the identity
    split over tp on its heads when a mesh is given."""
    qkv = fd.define_tensor(shape=[B, S, heads * 3 * D], contiguity=True, dtype=DataType.Float)
    grads = [fd.define_tensor(shape=[B, heads, S, D], contiguity=True, dtype=DataType.Float) for _ in range(3)]
    eye = fd.define_tensor(shape=[3, 3], contiguity=True, dtype=DataType.Float) if form == "onehot_in" else None
    q, k, v = (_take(fd, qkv, heads, i, "onehot" if eye is not None else form, eye) for i in range(3))
    out = fd.ops.matmul(fd.ops.matmul(q, fd.ops.permute(k, dims=[0, 1, 3, 2])), v)   # (b, h, s, d)
    g_qkv = _assemble(fd, grads, heads, form, eye)
    fd.add_output(out)
    fd.add_output(g_qkv)
    if mesh is None:
        return
    if eye is not None:
        eye.set_device_mesh(mesh)   # replicated
    for tv, dim in ((qkv, 2), *((g, 1) for g in grads), (out, 1), (g_qkv, 2)):
        tv.set_device_mesh(mesh)
        tv.outer_split(dim, tp)
        tv.axis(dim).parallelize(ParallelType.mesh_x)


def expected(qkv, grads, heads):
    """torch: (q k^T) v and g_qkv on the whole tensors."""
    view = qkv.view(B, S, heads, 3, D)
    q, k, v = (view[:, :, :, i].transpose(1, 2) for i in range(3))
    g_qkv = torch.stack([g.transpose(1, 2) for g in grads], dim=3).reshape(B, S, heads * 3 * D)
    return (q @ k.transpose(-1, -2)) @ v, g_qkv


def main(argv: list[str]) -> int:
    import nvfuser_direct as nvf

    from tpfuser.dist.launch import arm_stack_dumps
    from tpfuser.verify.commlog import error_message
    arm_stack_dumps()
    heads, forms = int(argv[0]), argv[1:] or list(FORMS)
    _stage("imports done; starting nvFuser's communicator")
    comm = nvf.multidevice.Communicator.instance()
    tp, rank = comm.size(), comm.rank()
    _stage(f"communicator up: rank {rank} of {tp}")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mesh = nvf.multidevice.DeviceMesh(torch.arange(tp))
    torch.manual_seed(0)
    qkv = torch.randn(B, S, heads * 3 * D, device="cuda")
    grads = [torch.randn(B, heads, S, D, device="cuda") for _ in range(3)]
    want_out, want_g = expected(qkv, grads, heads)
    _stage("inputs and torch's answer made")
    for form in forms:
        faulthandler.dump_traceback_later(_form_bound_s(), exit=True)   # a hung form ends the rank (exit 1)
        try:
            _stage(f"{form}: defining")
            with FusionDefinition() as fd:
                define(fd, heads, tp, form, mesh)
            _stage(f"{form}: executing")
            inputs = [qkv.chunk(tp, 2)[rank].contiguous(), *(g.chunk(tp, 1)[rank].contiguous() for g in grads)]
            out, g_qkv = fd.execute(inputs + ([torch.eye(3, device="cuda")] if form == "onehot_in" else []))
            err = max((out - want_out.chunk(tp, 1)[rank]).abs().max().item(),
                      (g_qkv - want_g.chunk(tp, 2)[rank]).abs().max().item())
            _line(f"rank {rank}: {form:9} heads {heads} tp {tp}: ran, max error {err:.1e}")
        except Exception as e:   # the whole message, backtraces dropped: nested segment errors name their input
            message = error_message(e, limit=1500).replace("\n", " | ")
            _line(f"rank {rank}: {form:9} heads {heads} tp {tp}: FAILED: {message}")
        faulthandler.cancel_dump_traceback_later()
        arm_stack_dumps()   # the launcher's time again, for what follows
    # Rank 0 serves nvFuser's store, and a form may need no collective: leaving
    # unbarriered, it could end before another rank had reached the store.
    _stage("every form done; waiting for every rank")
    comm.barrier()
    _stage("every rank done; exiting")
    sys.stdout.flush()
    os._exit(0)   # nvFuser's communicator at interpreter exit is not needed here


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
