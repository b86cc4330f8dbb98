"""tools/repro_one_head.py, the one-head-per-rank probe: each form builds on a
1x8 mesh at one head per rank, and does what its name says (CPU: definitions only)."""
import sys

import pytest
import torch

sys.path.insert(0, "tools")
import repro_one_head  # noqa: E402


@pytest.mark.parametrize("form, ops", [
    ("slice", {"slice", "cat("}), ("select", {"select", "cat("}),
    ("onehot", {"iota"}), ("onehot_in", {"select"})])
def test_each_form_uses_its_ops_and_no_other(form, ops):
    import nvfuser_direct as nvf
    from nvfuser_direct import FusionDefinition
    with FusionDefinition() as fd:
        repro_one_head.define(fd, 8, 8, form, nvf.multidevice.DeviceMesh(torch.arange(8)))
    text = str(fd)
    assert {op for op in ("slice", "select", "cat(", "iota") if op in text} == ops


def test_the_oracle_puts_each_gradient_where_its_part_came_from():
    b, s, d, h = repro_one_head.B, repro_one_head.S, repro_one_head.D, 4
    qkv = torch.randn(b, s, h * 3 * d, dtype=torch.float64)
    grads = [torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3)]
    out, g_qkv = repro_one_head.expected(qkv, grads, h)
    rows = g_qkv.view(b, s, h, 3, d)
    for i, g in enumerate(grads):
        assert torch.equal(rows[:, :, :, i].transpose(1, 2), g)
    q, k, v = (qkv.view(b, s, h, 3, d)[:, :, :, i].transpose(1, 2) for i in range(3))
    assert torch.allclose(out, torch.einsum("bhst,bhtd->bhsd", torch.einsum("bhsd,bhtd->bhst", q, k), v))
