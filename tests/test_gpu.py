"""GPU checks of the 1x1 mesh (marked gpu: skipped where no CUDA device exists;
run them with tools/gpu_suite.sh on a GPU machine)."""
import os

import pytest
import torch

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")   # fp32 tolerances assume TF32 off

pytestmark = pytest.mark.gpu

from tpfuser.check import TOLERANCES, check_forward  # noqa: E402
from tpfuser.config import Layout, preset  # noqa: E402


@pytest.fixture(autouse=True)
def _full_precision(no_tf32):
    pass


@pytest.mark.parametrize("name", ["tiny", "nanogpt"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["p0", "p0.1"])
def test_forward_matches_reference(name, dtype, dropout, record):
    result = check_forward(preset(name, dtype=dtype, dropout=dropout), Layout(1, 1), preset_name=name)
    record(**result.as_dict())
    assert result.rel_err <= TOLERANCES[dtype], result.as_dict()
    # the fusion's masks, bit for bit, are dropout.keep_mask's (computed by torch)
    assert len(result.mask_mismatches) == (0 if dropout == 0 else 3 if dtype == "fp32" else 2)
    assert not any(result.mask_mismatches.values()), result.mask_mismatches


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_keep_rate_nanogpt(dtype):
    result = check_forward(preset("nanogpt", dtype=dtype), Layout(1, 1), preset_name="nanogpt")
    assert result.keep_rates, "no masks came back"
    for name, rate in result.keep_rates.items():
        assert abs(rate - 0.9) <= 0.005, (name, rate)


def _run(block, x, seed, offset):
    return {k: v.clone() for k, v in block(x, seed, offset).items()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_masks_reproducible_and_offset_sensitive(dtype):
    from tpfuser.reference import make_block, make_input
    from tpfuser.runtime import ShardedBlock
    cfg = preset("tiny", dtype=dtype)
    block = ShardedBlock(cfg, check=True).load(make_block(cfg).state_dict())
    x = block.shard_input(make_input(cfg))
    torch.cuda.manual_seed(0)
    a = _run(block, x, 7, 100)
    torch.cuda.manual_seed(0)
    b = _run(block, x, 7, 100)
    c = _run(block, x, 7, 101)
    for name in a:
        assert torch.equal(a[name], b[name]), name            # same seed and offset: bitwise equal
    for name in ("resid_attn_keep", "resid_mlp_keep"):
        assert not torch.equal(a[name], c[name]), name        # another offset: another mask
    assert not torch.equal(a["resid_attn_keep"], a["resid_mlp_keep"])  # the streams differ


def test_flash_dropout_replay_has_teeth():
    """Replaying flash attention's dropout from a *different* generator state
    must show: the bf16 attention-dropout check is not vacuous. The branch
    error is the signal (the residual x dominates the output's norm)."""
    import tpfuser.check as chk
    cfg = preset("nanogpt", dtype="bf16", dropout=0.1)
    right = check_forward(cfg, Layout(1, 1), preset_name="nanogpt")
    real = chk.flash_replay
    try:
        chk.flash_replay = lambda p, state: real(p, torch.cuda.get_rng_state())  # state after the fusion ran
        wrong = check_forward(cfg, Layout(1, 1), preset_name="nanogpt")
    finally:
        chk.flash_replay = real
    assert wrong.branch_rel_err > 5 * right.branch_rel_err, (right.as_dict(), wrong.as_dict())
