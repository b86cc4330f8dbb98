"""tools/probes/fuse_matmul_probe.py on the CPU: the fusions its GPU run times.
Its `static` cases declare every extent, as the block's fusions do; a batch of
1 is then a Broadcast dimension, the premise of its gpt3 reproducer (NOTES.md:
nvFuser's matmul scheduler throws on it)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools", "probes"))
import fuse_matmul_probe as probe  # noqa: E402


def _inputs(math: str) -> list[str]:
    return [line.strip() for line in math.split("Inputs:")[1].split("Outputs:")[0].strip().splitlines()]


def test_static_shapes_make_a_batch_of_one_a_broadcast_where_symbolic_ones_do_not():
    gpt3 = ((1, 2048, 12288), (49152, 12288), (49152,), (1, 2048, 49152))
    static = _inputs(probe.define("bias+gelu", 3, gpt3).fusion.print_math())
    symbolic = _inputs(probe.define("bias+gelu", 3).fusion.print_math())
    assert static[0] == "T0_g___bfloat[bS0{1}, iS1{2048}, iS2{12288}]"
    assert "bS" not in " ".join(symbolic) and "{i0}" in symbolic[0]
    nano = ((16, 128, 768), (3072, 768), (3072,), (16, 128, 3072))
    assert "bS" not in " ".join(_inputs(probe.define("bias+gelu", 3, nano).fusion.print_math()))


def test_every_case_builds_with_the_epilogue_it_names():
    for case, ops in (("linear", ["linear"]), ("linear+bias", ["linear"]), ("bias+gelu", ["linear", "tanh"]),
                      ("bias+residual", ["linear", "+"])):
        math = probe.define(case, 3).fusion.print_math()
        assert all(op in math for op in ops), case
        assert len(_inputs(math)) == {"linear": 2, "bias+residual": 4}.get(case, 3), case


@pytest.mark.parametrize("squeeze", probe.SQUEEZES)
def test_the_squeezed_forms_run_a_2d_linear_between_the_blocks_3d_shapes(squeeze):
    """The way round a static batch of 1: the linear on 2D operands (no
    Broadcast dimension for the matmul scheduler to map), the fusion's input
    and output still 3D as the block's, the residual read 2D (broadcast back
    last) or 3D (early)."""
    gpt3 = ((1, 2048, 49152), (12288, 49152), (12288,), (1, 2048, 12288))
    math = probe.define("bias+residual", 3, gpt3, squeeze=squeeze).fusion.print_math()
    assert ("squeeze( T3_g" in math) == (squeeze == "last")   # the residual, T3, squeezed where the epilogue is 2D
    operand = next(line for line in math.splitlines() if "= linear(" in line)   # the linear's first operand
    assert operand.count("{") == 2   # (m, k): no batch dimension
    assert "squeeze(" in math and _inputs(math)[0].startswith("T0_g___bfloat[bS0{1}")
    assert "bS" in math.split("Outputs:")[1].split("%kernel_math")[0]   # the output 3D, its batch broadcast back
    unsqueezed = probe.define("bias+residual", 3, gpt3).fusion.print_math()
    assert next(line for line in unsqueezed.splitlines() if "= linear(" in line).count("{") == 3
