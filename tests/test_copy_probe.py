"""tools/probes/copy_probe.py (the 5 copy kernels a training step made on the H200,
2026-12-03; docs/history.md): which op launched each copy, and through which of
our lines (CPU, on stand-in events)."""
import os
import sys
from types import SimpleNamespace as NS

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "probes"))
import copy_probe  # noqa: E402

COPY = "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel"


def test_each_copy_is_named_once_by_the_op_that_launched_it():
    copy = NS(name="aten::copy_", kernels=[NS(name=COPY)], cpu_children=[], input_shapes=[[16, 25, 128, 64]],
              stack=["tpfuser/runtime.py(320): backward_inputs", "tools/probes/copy_probe.py(60): step"])
    contiguous = NS(name="aten::contiguous", kernels=[NS(name=COPY)], cpu_children=[copy], input_shapes=[[16]],
                    stack=copy.stack)
    gemm = NS(name="aten::mm", kernels=[NS(name="nvjet_sm90_tst")], cpu_children=[], input_shapes=[], stack=[])
    found = copy_probe.copy_launches([contiguous, copy, gemm])
    assert len(found) == 1   # the parent that only passes its child's kernel on is not counted again
    assert found[0]["op"] == "aten::copy_" and found[0]["shapes"] == [[16, 25, 128, 64]]
    assert found[0]["ours"] == ["tpfuser/runtime.py(320): backward_inputs"]


def test_a_copy_tied_to_its_launch_call_is_named_by_the_op_around_it():
    copy = NS(name="aten::copy_", kernels=[], cpu_children=[], input_shapes=[[4, 8]],
              stack=["tpfuser/fusion.py(700): execute"])
    launch = NS(name="cudaLaunchKernel", kernels=[NS(name=COPY)], cpu_children=[], cpu_parent=copy, stack=[])
    (found,) = copy_probe.copy_launches([copy, launch])
    assert found["op"] == "aten::copy_" and found["ours"] == ["tpfuser/fusion.py(700): execute"]
