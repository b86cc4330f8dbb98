"""A row-parallel product's output that leaves its fusion split over the mesh
must carry its reduction axis's split too (parallel/passes.py): nvFuser
0.2.36 takes the fusion without it and returns partial sums. The schedule
derives that split where a pass is cut after such a product, and validate()
refuses a linear output left without it."""
import pytest
import torch
from nvfuser_direct import DataType, FusionDefinition, ParallelType

from tpfuser.block.pieces import Piece
from tpfuser.config import Layout, preset
from tpfuser.parallel.passes import PARTIAL_SUMS, build_backward, build_forward, make_mesh, validate


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_a_cut_after_a_partial_sum_splits_its_reduction_axis(sp):
    schedule = "megatron-sp-cut-linears" if sp else "megatron-cut-linears"
    outputs = {}
    for built in (build_forward(preset("tiny"), Layout(1, 2, sp), schedule=schedule),
                  build_backward(preset("tiny"), Layout(1, 2, sp), schedule=schedule)):
        for piece in built.pieces:
            outputs |= {name: str(tv) for name, tv in piece.outputs.items() if name in PARTIAL_SUMS}
    assert set(outputs) == set(PARTIAL_SUMS)
    assert all("rdeviceIdx.x" in text for text in outputs.values()), outputs


def _linear(reduction_split: bool) -> Piece:
    with FusionDefinition() as fd:
        a = fd.define_tensor([16, 8], contiguity=True, dtype=DataType.Float)
        w = fd.define_tensor([4, 8], contiguity=True, dtype=DataType.Float)
        out = fd.ops.linear(a, w)
        fd.add_output(out)
        mesh = make_mesh(Layout(1, 2), row=0)
        for tv, dim in ((a, 1), (w, 1)):   # the contraction split over tp
            tv.set_device_mesh(mesh)
            tv.outer_split(dim, 2)
            tv.axis(dim).parallelize(ParallelType.mesh_x)
        out.set_device_mesh(mesh)
        if reduction_split:
            out.outer_split(2, 2)
            out.axis(2).parallelize(ParallelType.mesh_x)
        out.outer_split(0, 2)              # its tokens over tp: a reduce-scatter
        out.axis(0).parallelize(ParallelType.mesh_x)
    return Piece("", fd, outputs={"out": out})


def test_a_linear_output_split_without_its_reduction_axis_is_refused():
    validate(_linear(reduction_split=True))
    with pytest.raises(ValueError, match="out: a linear's output split over the mesh.*partial sums"):
        validate(_linear(reduction_split=False))
