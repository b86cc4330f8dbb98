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


def test_the_oracle_reads_and_writes_the_rows_head_by_head():
    """Row (head j, part i, element c) of qkv is column (3 j + i) d + c: the
    oracle's q, k, v and g_qkv checked by indexing those columns directly."""
    b, s, d, h = repro_one_head.B, repro_one_head.S, repro_one_head.D, 4
    qkv = torch.randn(b, s, h * 3 * d, dtype=torch.float64)
    grads = [torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3)]
    out, g_qkv = repro_one_head.expected(qkv, grads, h)
    for j in range(h):
        cols = [slice((3 * j + i) * d, (3 * j + i + 1) * d) for i in range(3)]
        q, k, v = (qkv[:, :, c] for c in cols)                                 # (b, s, d), head j
        assert torch.allclose(out[:, j], (q @ k.transpose(1, 2)) @ v)
        for i, c in enumerate(cols):
            assert torch.equal(g_qkv[:, :, c], grads[i][:, j])


def test_a_form_is_bounded_by_the_launchers_time_when_it_comes_first(monkeypatch):
    """Under a launcher's bound (launch.STACKS_AT_VAR) a form ends before the
    launcher ends the rank, so that the rank prints where it was itself."""
    import time

    from tpfuser.dist.launch import STACKS_AT_VAR
    monkeypatch.delenv(STACKS_AT_VAR, raising=False)
    assert repro_one_head._form_bound_s() == repro_one_head.FORM_S
    monkeypatch.setenv(STACKS_AT_VAR, f"{time.time() + 30:.1f}")
    assert 28 < repro_one_head._form_bound_s() <= 30.1 < repro_one_head.FORM_S   # the time is written to 0.1 s
    monkeypatch.setenv(STACKS_AT_VAR, f"{time.time() - 5:.1f}")   # past: a second, not none
    assert repro_one_head._form_bound_s() == 1.0
