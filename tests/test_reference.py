"""The oracle against an independent float64 computation written with einsum."""
import math

import pytest
import torch

from tpfuser.config import preset
from tpfuser.block.tensors import PARAM_NAMES
from tpfuser.verify.reference import Block, Masks, make_block, make_input


def explicit_block(x, w, n_head, p=0.0, masks=None):
    """nanoGPT's block with every op spelled out (float64), blocked [Q; K; V]."""
    def ln(t, g, b):
        mu = t.mean(-1, keepdim=True)
        var = ((t - mu) ** 2).mean(-1, keepdim=True)
        return (t - mu) / torch.sqrt(var + 1e-5) * g + b

    def drop(t, keep):
        return t if keep is None else t * keep / (1 - p)

    b, s, e = x.shape
    d = e // n_head
    qkv = torch.einsum("bse,fe->bsf", ln(x, w["ln_1.weight"], w["ln_1.bias"]), w["attn.c_attn.weight"]) + w["attn.c_attn.bias"]
    q, k, v = (qkv[..., i * e:(i + 1) * e].reshape(b, s, n_head, d) for i in range(3))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    scores = scores + torch.triu(torch.full((s, s), float("-inf"), dtype=x.dtype), 1)
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = drop(probs / probs.sum(-1, keepdim=True), masks and masks.attn)
    y = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, e)
    x = x + drop(torch.einsum("bse,fe->bsf", y, w["attn.c_proj.weight"]) + w["attn.c_proj.bias"], masks and masks.resid_attn)
    h = torch.einsum("bse,fe->bsf", ln(x, w["ln_2.weight"], w["ln_2.bias"]), w["mlp.c_fc.weight"]) + w["mlp.c_fc.bias"]
    h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    return x + drop(torch.einsum("bsf,ef->bse", h, w["mlp.c_proj.weight"]) + w["mlp.c_proj.bias"], masks and masks.resid_mlp)


def test_state_dict_keys_are_nanogpt_param_names_in_order():
    assert list(Block(preset("tiny")).state_dict()) == list(PARAM_NAMES)


def test_the_oracles_own_parameter_table_is_the_fusions():
    """The oracle writes nanoGPT's names and shapes out itself (it imports nothing
    of the package): they must be tensors.py's, the fusion's inputs' order."""
    from tpfuser.block import tensors
    from tpfuser.config import PRESETS
    from tpfuser.verify import reference
    assert reference.PARAM_NAMES == tensors.PARAM_NAMES
    for name in PRESETS:
        cfg = preset(name)
        assert reference.param_shapes(cfg) == tensors.param_shapes(cfg)
        assert tuple(reference.param_shapes(cfg)) == reference.PARAM_NAMES
    tiny = preset("tiny")
    assert {k: tuple(v.shape) for k, v in Block(tiny).state_dict().items()} == reference.param_shapes(tiny)


def test_loads_a_nanogpt_state_dict_as_is():
    cfg = preset("tiny")
    src = make_block(cfg, seed=3)
    dst = Block(cfg)
    dst.load_state_dict(dict(src.state_dict()), strict=True)
    x = make_input(cfg)
    assert torch.equal(dst(x), src(x))


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no_dropout", "dropout"])
def test_reference_matches_explicit_float64(dropout):
    cfg = preset("tiny", dropout=dropout)
    block = make_block(cfg, dtype=torch.float64)
    x = make_input(cfg, dtype=torch.float64)
    masks = None
    if dropout:
        g = torch.Generator().manual_seed(5)
        b, s, e, h = cfg.batch, cfg.seq, cfg.n_embd, cfg.n_head
        masks = Masks(resid_attn=torch.rand(b, s, e, generator=g) > dropout,
                      resid_mlp=torch.rand(b, s, e, generator=g) > dropout,
                      attn=torch.rand(b, h, s, s, generator=g) > dropout)
    expected = explicit_block(x, block.state_dict(), cfg.n_head, dropout, masks)
    actual = block(x, masks)
    # float64 both ways: only summation order differs.
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    if dropout:  # the masks matter: without them the result differs
        assert not torch.allclose(block(x), expected, rtol=1e-3, atol=1e-3)


def test_sdpa_forward_is_the_reference_block():
    """The user's training forward (SDPA, F.dropout) the eager, compile and DTensor
    peers run equals the oracle's forward at dropout 0, in both c_attn row orders."""
    from tpfuser.verify.reference import sdpa_forward
    from tpfuser.parallel.shard import qkv_heads_interleaved
    cfg = preset("tiny", dropout=0.0)
    block = make_block(cfg, dtype=torch.float64)
    x = make_input(cfg, dtype=torch.float64)
    expected = block(x)
    assert torch.allclose(sdpa_forward(block, x, 0.0), expected, rtol=0, atol=1e-12)
    with torch.no_grad():
        for p in (block.attn.c_attn.weight, block.attn.c_attn.bias):
            p.copy_(qkv_heads_interleaved(p, cfg.n_head))
    assert torch.allclose(sdpa_forward(block, x, 0.0, heads_interleaved=True), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(sdpa_forward(block, x, 0.0), expected, atol=1e-3)   # the order matters
