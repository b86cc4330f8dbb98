"""GPU checks of the backward on the 1x1 mesh (marked gpu)."""
import os

import pytest
import torch

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

pytestmark = [
    pytest.mark.gpu,
    # Seen on the H200 on 2026-12-02 (NOTES.md): nvFuser 0.2.36 fails to compile the
    # meshed training fusions (allocation / rfactor / resize-scheduler asserts).
    # Not strict: an XPASS here means nvFuser or a workaround fixed it.
    pytest.mark.xfail(reason="nvFuser 0.2.36 fails to compile the meshed backward (NOTES.md)", strict=False),
]

from tpfuser.check import flash_replay, rel_l2  # noqa: E402
from tpfuser.config import preset  # noqa: E402
from tpfuser.reference import PARAM_NAMES, Masks, make_block, make_input  # noqa: E402
from tpfuser.shard import qkv_blocked  # noqa: E402

# Relative L2 error of every gradient. bf16: gradients pass through several
# bf16 roundings (activations, matmul outputs) and sums over b*s rows.
GRAD_TOLERANCES = {"bf16": 2e-2, "fp32": 1e-5}


@pytest.fixture(autouse=True)
def _no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _reference(cfg):
    ref = make_block(cfg)
    x = make_input(cfg)
    grad_out = make_input(cfg, seed=2)
    if cfg.dtype == "bf16":
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.bfloat16().float())
        x, grad_out = x.bfloat16().float(), grad_out.bfloat16().float()
    return ref, x, grad_out


@pytest.mark.parametrize("name", ["tiny", "nanogpt"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gradients_match_reference_autograd(name, dtype):
    from tpfuser.runtime import ShardedBlock
    cfg = preset(name, dtype=dtype)   # dropout 0.1: the reference applies the fusion's masks
    ref, x, grad_out = _reference(cfg)
    block = ShardedBlock(cfg, check=True).load(ref.state_dict())
    xl, gl = block.shard_input(x), block.shard_input(grad_out)
    rng_state = torch.cuda.get_rng_state()
    named, saved = block.forward_train(xl, 1234, 5)
    grad_x, grads = block.backward(gl, xl, saved, 1234, 5)

    ref = ref.cuda()
    masks = Masks(resid_attn=named["resid_attn_keep"], resid_mlp=named["resid_mlp_keep"], attn=named.get("attn_keep"))
    attention = flash_replay(cfg.dropout, rng_state) if dtype == "bf16" else None
    xr = x.cuda().requires_grad_(True)
    out = ref(xr, masks, attention)
    out.backward(grad_out.cuda())
    tol = GRAD_TOLERANCES[dtype]
    errors = {"out": rel_l2(named["out"], out.detach()), "x": rel_l2(grad_x, xr.grad)}
    for pname, g in zip(PARAM_NAMES, grads):
        if pname.startswith("attn.c_attn"):
            g = qkv_blocked(g, cfg.n_head)
        errors[pname] = rel_l2(g, dict(ref.named_parameters())[pname].grad)
    bad = {k: v for k, v in errors.items() if v > tol}
    assert not bad, (bad, errors)


def test_sgd_trajectory_matches_reference():
    """20 SGD steps on tiny, fp32, dropout 0: the same losses within 1e-4 (relative)."""
    from tpfuser.runtime import TPBlock
    cfg = preset("tiny", dtype="fp32", dropout=0.0)
    ref = make_block(cfg).cuda()
    model = TPBlock(cfg).load_full_state_dict(ref.state_dict())
    x = make_input(cfg).cuda()
    target = make_input(cfg, seed=3).cuda()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(20):
        pair = []
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            loss = ((m(x) - target) ** 2).mean()
            loss.backward()
            o.step()
            pair.append(loss.item())
        losses.append(pair)
    assert losses[-1][0] < 0.9 * losses[0][0], "the loss should move"
    worst = max(abs(f - r) / abs(r) for r, f in losses)
    assert worst <= 1e-4, losses


def test_module_gives_gradient_shards_and_full_grads():
    from tpfuser.runtime import TPBlock
    cfg = preset("tiny", dtype="fp32")
    ref = make_block(cfg).cuda()
    model = TPBlock(cfg).load_full_state_dict(ref.state_dict())
    model(make_input(cfg).cuda()).sum().backward()
    grads = model.full_grads()
    assert list(grads) == list(PARAM_NAMES)
    assert all(g is not None and g.shape == p.shape for g, (_, p) in zip(grads.values(), ref.named_parameters()))
    assert model.step == 1   # a training call advances the dropout offset
