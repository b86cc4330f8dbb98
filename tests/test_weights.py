"""Weights from Hugging Face GPT-2 and the checks every load makes (CPU; the
fusion's own agreement with HF's block is a GPU test at the end)."""
import os

import pytest
import torch

from tpfuser.config import Layout, preset
from tpfuser.block.tensors import PARAM_NAMES
from tpfuser.verify.reference import Block, make_block, make_input
from tpfuser.runtime.block import ShardedBlock
from tpfuser.runtime.weights import from_hf_gpt2, model_layer, rank_shards

if torch.cuda.is_available():   # a GPU machine runs the HF GPU test below: a missing transformers fails, not skips
    import transformers  # noqa: F401
else:
    transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402


def hf_config(cfg, n_layer=1):
    """HF's GPT-2 with the block's math: GELU tanh ("gelu_new"), LayerNorm eps 1e-5, no dropout."""
    config = GPT2Config(n_embd=cfg.n_embd, n_head=cfg.n_head, n_inner=4 * cfg.n_embd, n_layer=n_layer,
                        n_positions=cfg.seq, vocab_size=50, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                        resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    config._attn_implementation = "eager"
    return config


def hf_block(cfg, seed=0):
    """A GPT2Block with random weights (no download); LayerNorms perturbed off 1 and 0."""
    torch.manual_seed(seed)
    block = GPT2Block(hf_config(cfg)).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_((1.0 if name.startswith("ln_") and name.endswith("weight") else 0.0) + 0.05 * torch.randn_like(p))
    return block


def hf_forward(block, x):
    """GPT2Block alone applies no causal mask: GPT2Model builds it; here it is passed as GPT2Model would."""
    s = x.shape[1]
    causal = torch.full((s, s), float("-inf")).triu(1)[None, None]   # (1, 1, s, s), added to the scores
    out = block(x, attention_mask=causal)
    return out[0] if isinstance(out, tuple) else out


def rel_l2(a, b):
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


CFG = preset("tiny", dtype="fp32", dropout=0.0)


def test_hf_block_and_reference_agree():
    """The converted weights make the reference compute HF's block: only the
    order of summation differs in fp32. The branch (out - x) is compared, since
    x dominates out."""
    hf = hf_block(CFG)
    ref = Block(CFG)
    ref.load_state_dict(from_hf_gpt2(hf.state_dict(), CFG))
    x = make_input(CFG)
    with torch.no_grad():
        expected, got = hf_forward(hf, x), ref(x)
    assert rel_l2(got - x, expected - x) < 1e-6


def test_square_c_proj_left_transposed_shows():
    """The teeth of the test above: skipping the transpose of the square weight
    (which no shape check can see) is far outside its tolerance."""
    hf = hf_block(CFG)
    state = from_hf_gpt2(hf.state_dict(), CFG)
    state["attn.c_proj.weight"] = state["attn.c_proj.weight"].t()
    ref = Block(CFG)
    ref.load_state_dict(state)
    x = make_input(CFG)
    with torch.no_grad():
        assert rel_l2(ref(x) - x, hf_forward(hf, x) - x) > 0.1


def test_one_layer_of_a_whole_model():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(hf_config(CFG, n_layer=2))
    state = model.state_dict()
    got = from_hf_gpt2(state, CFG, layer=1)
    expected = from_hf_gpt2(model.transformer.h[1].state_dict(), CFG)
    assert got.keys() == expected.keys()
    for name in got:
        assert torch.equal(got[name], expected[name]), name
    assert not torch.equal(got["attn.c_attn.weight"], from_hf_gpt2(state, CFG, layer=0)["attn.c_attn.weight"])
    # GPT2Model's keys have no "transformer." prefix
    assert torch.equal(from_hf_gpt2(model.transformer.state_dict(), CFG, layer=1)["mlp.c_fc.weight"],
                       got["mlp.c_fc.weight"])


@pytest.fixture
def block():
    return ShardedBlock(CFG, Layout(1, 1), device=torch.device("cpu"))


def nanogpt_state():
    return dict(make_block(CFG).state_dict())


def hf_state():
    return dict(hf_block(CFG).state_dict())


def with_(state, name, value):
    state[name] = value
    return state


def without(state, *names):
    return {k: v for k, v in state.items() if k not in names}


def hf_model_state(n_layer=2):
    torch.manual_seed(0)
    return dict(GPT2LMHeadModel(hf_config(CFG, n_layer=n_layer)).state_dict())


def nanogpt_model_state(n_layer=2):
    """A nanoGPT GPT's state_dict: its blocks under transformer.h.{i}., besides the embeddings."""
    state = {"transformer.wte.weight": torch.zeros(50, CFG.n_embd), "lm_head.weight": torch.zeros(50, CFG.n_embd)}
    for i in range(n_layer):
        state.update({f"transformer.h.{i}.{k}": v for k, v in make_block(CFG, seed=i).state_dict().items()})
    return state


def fp8(state, dtype=torch.float8_e4m3fn):
    return {k: v.to(dtype) for k, v in state.items()}


def _nan_inf(t):
    t = t.clone()
    t.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    return t


# Every refusal of a load, with the words its message must carry.
LOAD_REFUSALS = [
    ("hf_dict_to_nanogpt_load", lambda b: b.load(hf_state()),
     ["looks like Hugging Face GPT-2's Conv1D layout", "attn.c_attn.weight (64, 192)", "load_hf_gpt2"]),
    ("hf_model_dict_to_nanogpt_load",
     lambda b: b.load(GPT2LMHeadModel(hf_config(CFG, n_layer=2)).state_dict()),
     ["looks like a whole model's (layers h.0..h.1)", "block.load_hf_gpt2(state, layer=i)"]),
    ("nanogpt_model_dict_to_load", lambda b: b.load(nanogpt_model_state()),   # each loader names the one that takes it
     ["looks like a whole model's (layers h.0..h.1)", "block.load(tpfuser.model_layer(state, i))"]),
    ("nanogpt_model_dict_to_hf_load", lambda b: b.load_hf_gpt2(nanogpt_model_state(), layer=1),
     ["looks like nanoGPT's nn.Linear layout", "block.load(tpfuser.model_layer(state, 1))"]),
    ("model_layer_out_of_range", lambda b: model_layer(nanogpt_model_state(), 2),
     ["layer=2: the state_dict has no keys 'transformer.h.2.'", "(it has h.0..h.1)"]),
    ("model_layer_of_a_block", lambda b: model_layer(nanogpt_state(), 0),
     ["layer=0", "holds no model layers; one block's state_dict loads as it is: block.load(state)"]),
    ("model_layer_a_string", lambda b: model_layer(nanogpt_model_state(), "1"),
     ["layer='1': expected an int >= 0 (the model layer's index), got str"]),
    ("nanogpt_dict_to_hf_load", lambda b: b.load_hf_gpt2(nanogpt_state()),
     ["looks like nanoGPT's nn.Linear layout", "attn.c_attn.weight (192, 64)", "block.load(state)"]),
    ("hf_model_dict_without_layer", lambda b: b.load_hf_gpt2(GPT2LMHeadModel(hf_config(CFG, n_layer=2)).state_dict()),
     ["holds layers h.0..h.1 of a model", "pass layer=i (0 <= i <= 1)"]),
    ("hf_layer_out_of_range", lambda b: b.load_hf_gpt2(GPT2LMHeadModel(hf_config(CFG, n_layer=2)).state_dict(), layer=2),
     ["layer=2: the state_dict has no keys 'transformer.h.2.'", "(it has h.0..h.1)"]),
    ("hf_block_with_layer", lambda b: b.load_hf_gpt2(hf_state(), layer=0),
     ["layer=0", "holds no model layers"]),
    ("hf_wrong_size", lambda b: b.load_hf_gpt2(with_(hf_state(), "mlp.c_fc.bias", torch.zeros(100))),
     ["mlp.c_fc.bias: expected shape (256,) in Hugging Face's layout for n_embd=64, got (100,)"]),
    ("int64_weight", lambda b: b.load(with_(nanogpt_state(), "mlp.c_fc.weight", torch.ones(256, 64, dtype=torch.int64))),
     ["mlp.c_fc.weight: expected a floating-point tensor, got torch.int64"]),
    ("bool_weight_hf", lambda b: b.load_hf_gpt2(with_(hf_state(), "ln_1.bias", torch.ones(64, dtype=torch.bool))),
     ["ln_1.bias: expected a floating-point tensor, got torch.bool"]),
    ("nan_weight", lambda b: b.load(with_(nanogpt_state(), "attn.c_proj.weight",
                                          _nan_inf(nanogpt_state()["attn.c_proj.weight"]))),
     ["attn.c_proj.weight: 3 of 4096 elements are not finite (1 NaN, 2 inf)"]),
    ("nan_weight_hf", lambda b: b.load_hf_gpt2(with_(hf_state(), "ln_2.weight", _nan_inf(torch.ones(64)))),
     ["ln_2.weight: 3 of 64 elements are not finite (1 NaN, 2 inf)"]),
    ("overflow_in_cast", lambda b: b.load(with_(nanogpt_state(), "ln_1.bias", torch.full((64,), 1e300, dtype=torch.float64))),
     ["ln_1.bias cast to fp32: 64 of 64 elements are not finite (0 NaN, 64 inf)"]),
    ("not_a_tensor", lambda b: b.load(with_(nanogpt_state(), "ln_1.bias", [0.0] * 64)),
     ["ln_1.bias: expected a torch.Tensor, got list"]),
    ("int_shard", lambda b: b.load_shards([torch.zeros(b.local_param_shape(n), dtype=torch.int32)
                                           for n in PARAM_NAMES]),
     ["ln_1.weight: expected a floating-point tensor, got torch.int32"]),
    ("nan_shard", lambda b: b.load_shards([_nan_inf(torch.zeros(b.local_param_shape(n))) if n == "mlp.c_fc.bias"
                                           else torch.zeros(b.local_param_shape(n)) for n in PARAM_NAMES]),
     ["mlp.c_fc.bias: 3 of 256 elements are not finite (1 NaN, 2 inf)"]),
    # keys the block has no tensor for, and keys it lacks, listed
    ("extra_keys", lambda b: b.load(with_(with_(nanogpt_state(), "lora.A", torch.zeros(2)), "lora.B", torch.zeros(2))),
     ["state_dict has 2 key(s) the block has no tensor for: 'lora.A', 'lora.B'", "strict=False ignores the others"]),
    ("many_extra_keys", lambda b: b.load({**nanogpt_state(), **{f"x{i}": torch.zeros(1) for i in range(10)}}),
     ["10 key(s)", "'x0', 'x1'", "and 2 more"]),
    ("missing_keys", lambda b: b.load(without(nanogpt_state(), "ln_2.weight", "mlp.c_proj.bias")),
     ["state_dict lacks ['ln_2.weight', 'mlp.c_proj.bias']: 2 of the block's 12 tensors"]),
    ("prefixed_keys", lambda b: b.load({f"block.{k}": v for k, v in nanogpt_state().items()}),
     ["state_dict lacks ['ln_1.weight'", "it has 12 other key(s): 'block.ln_1.weight', 'block.ln_1.bias'"]),
    ("missing_keys_hf", lambda b: b.load_hf_gpt2(without(hf_state(), "attn.c_attn.bias")),
     ["state_dict lacks ['attn.c_attn.bias']"]),
    ("extra_key_hf_block", lambda b: b.load_hf_gpt2(with_(hf_state(), "attn.lora_A", torch.zeros(2))),
     ["1 key(s) the block has no tensor for: 'attn.lora_A'"]),
    ("extra_key_of_the_layer", lambda b: b.load_hf_gpt2(with_(hf_model_state(), "transformer.h.1.mlp.lora", torch.zeros(2)),
                                                       layer=1),
     ["1 key(s) the block has no tensor for: 'transformer.h.1.mlp.lora'"]),
    # tensors torch would refuse in its own words, without their name
    ("meta_weight", lambda b: b.load(with_(nanogpt_state(), "attn.c_proj.bias", torch.zeros(64, device="meta"))),
     ["attn.c_proj.bias: a tensor on the meta device, which holds no values"]),
    ("meta_weight_of_a_layer", lambda b: b.load_hf_gpt2(
        with_(hf_model_state(), "transformer.h.0.ln_1.weight", torch.zeros(64, device="meta")), layer=0),
     ["transformer.h.0.ln_1.weight: a tensor on the meta device"]),
    ("fp8_nan", lambda b: b.load(with_(fp8(nanogpt_state()), "mlp.c_fc.bias",
                                       torch.full((256,), float("nan")).to(torch.float8_e4m3fn))),
     ["mlp.c_fc.bias: 256 of 256 elements are not finite (256 NaN, 0 inf)"]),
    ("fp8_e5m2_inf", lambda b: b.load(with_(nanogpt_state(), "ln_1.weight", _nan_inf(torch.ones(64)).to(torch.float8_e5m2))),
     ["ln_1.weight: 3 of 64 elements are not finite (1 NaN, 2 inf)"]),
    ("float4_packed", lambda b: b.load(with_(nanogpt_state(), "ln_1.bias",
                                             torch.zeros(64, dtype=torch.uint8).view(torch.float4_e2m1fn_x2))),
     ["ln_1.bias: a torch.float4_e2m1fn_x2 tensor, which torch cannot convert to float32"]),
    ("int32_weight_hf", lambda b: b.load_hf_gpt2(with_(hf_state(), "attn.c_attn.weight",
                                                      torch.zeros(64, 192, dtype=torch.int32))),
     ["attn.c_attn.weight: expected a floating-point tensor, got torch.int32"]),
    ("sparse_weight", lambda b: b.load(with_(nanogpt_state(), "ln_2.bias", torch.zeros(64).to_sparse())),
     ["ln_2.bias: a sparse_coo tensor; expected a dense one"]),
    # not a state_dict at all
    ("state_a_list", lambda b: b.load([torch.zeros(1)]),
     ["state_dict: expected a dict of tensors by name (a state_dict()), got list"]),
    ("state_none_hf", lambda b: b.load_hf_gpt2(None), ["state_dict: expected a dict of tensors by name", "got NoneType"]),
    ("state_int_key", lambda b: b.load(with_(nanogpt_state(), 3, torch.zeros(1))),
     ["state_dict: key 3 is an int; expected str keys"]),
    # a stray string (or bool) where an int or a bool is expected
    ("layer_a_string", lambda b: b.load_hf_gpt2(hf_model_state(), layer="1"),
     ["layer='1': expected None or an int >= 0 (the model layer's index), got str"]),
    ("layer_a_bool", lambda b: b.load_hf_gpt2(hf_model_state(), layer=True), ["layer=True: expected None or an int", "bool"]),
    ("layer_negative", lambda b: b.load_hf_gpt2(hf_model_state(), layer=-1), ["layer=-1: expected None or an int >= 0"]),
    ("strict_a_string", lambda b: b.load(nanogpt_state(), strict="no"), ["strict='no': expected True or False, got str"]),
    ("rank_a_string", lambda b: rank_shards(with_(nanogpt_state(), "ln_1.bias", _nan_inf(torch.ones(64))), CFG,
                                            Layout(1, 2), "1"),   # refused first, before the tensors are read
     ["rank='1': must be an int in [0, 2) for mesh 1x2, got a str"]),
    ("cfg_a_name", lambda b: rank_shards(nanogpt_state(), "tiny", Layout(1, 1), 0),
     ["cfg='tiny': expected a BlockConfig"]),
    ("cfg_a_name_hf", lambda b: from_hf_gpt2(hf_state(), "tiny"), ["cfg='tiny': expected a BlockConfig"]),
]


@pytest.mark.parametrize("load, words", [c[1:] for c in LOAD_REFUSALS], ids=[c[0] for c in LOAD_REFUSALS])
def test_load_refusals_name_the_thing(block, load, words):
    with pytest.raises(ValueError) as err:
        load(block)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_finite_inputs_checked_only_when_asked():
    x = torch.zeros(4, 16, 64)
    x[0, 0, :5] = float("nan")
    checked = ShardedBlock(CFG, Layout(1, 1), device=torch.device("cpu"), check_finite=True)
    checked._params = []   # pretend loaded: the input is checked first
    with pytest.raises(ValueError, match=r"x: 5 of 4096 elements are not finite \(5 NaN, 0 inf\)"):
        checked(x)
    unchecked = ShardedBlock(CFG, Layout(1, 1), device=torch.device("cpu"))
    unchecked._params = []
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):   # past the values, to the device
        unchecked(x)


TAKEN = [
    ("extra_keys_not_strict", lambda b: b.load(with_(nanogpt_state(), "lora.A", torch.zeros(2)), strict=False)),
    ("extra_keys_not_strict_hf", lambda b: b.load_hf_gpt2(with_(hf_state(), "lora.A", torch.zeros(2)), strict=False)),
    ("fp8_weights", lambda b: b.load(fp8(nanogpt_state()))),
    ("fp8_e5m2_weights_hf", lambda b: b.load_hf_gpt2(fp8(hf_state(), torch.float8_e5m2))),
    ("hf_mask_buffers", lambda b: b.load_hf_gpt2(with_(with_(hf_state(), "attn.bias", torch.ones(1, 1, 16, 16).tril()),
                                                       "attn.masked_bias", torch.tensor(-1e4)))),
    ("hf_mask_buffers_of_a_layer", lambda b: b.load_hf_gpt2(
        with_(with_(hf_model_state(), "transformer.h.1.attn.bias", torch.ones(1, 1, 16, 16).tril()),
              "transformer.h.1.attn.masked_bias", torch.tensor(-1e4)), layer=1)),
    ("nanogpt_mask_buffer", lambda b: b.load(with_(nanogpt_state(), "attn.bias", torch.ones(1, 1, 16, 16).tril()))),
    ("extra_key_of_another_layer", lambda b: b.load_hf_gpt2(
        with_(hf_model_state(), "transformer.h.0.mlp.lora", torch.zeros(2)), layer=1)),
    ("fp64_weights", lambda b: b.load({k: v.double() for k, v in nanogpt_state().items()})),
]


@pytest.mark.parametrize("load", [c[1] for c in TAKEN], ids=[c[0] for c in TAKEN])
def test_loads_taken(block, load):
    """Every check passed: the load reaches the device check of the shards (this CPU block's are not on a GPU)."""
    with pytest.raises(ValueError, match="ln_1.weight: expected a CUDA tensor"):
        load(block)


def test_one_layer_of_a_whole_nanogpt_model():
    state = nanogpt_model_state()
    layer = model_layer(state, 1)
    assert sorted(layer) == sorted(make_block(CFG).state_dict())
    expected = rank_shards(dict(make_block(CFG, seed=1).state_dict()), CFG, Layout(1, 2), 1)
    for got, want in zip(rank_shards(layer, CFG, Layout(1, 2), 1), expected, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(model_layer(state, 0)["attn.c_attn.weight"], layer["attn.c_attn.weight"])


def test_fp8_weights_cast_to_the_blocks_dtype():
    state = fp8(nanogpt_state())
    shards = rank_shards(state, CFG, Layout(1, 1), 0)
    assert all(s.dtype == torch.float32 for s in shards)
    assert torch.equal(shards[PARAM_NAMES.index("ln_1.bias")], state["ln_1.bias"].float())


def test_every_load_refusal_names_a_tensor_or_the_field(block):
    """The rule behind LOAD_REFUSALS: each message begins with what it is about."""
    names = (*PARAM_NAMES, "state_dict", "layer=", "strict=", "rank=", "cfg=", "transformer.h.", "expected ")
    for case_id, load, _ in LOAD_REFUSALS:
        with pytest.raises(ValueError) as err:
            load(block)
        assert str(err.value).startswith(names) and "\n" not in str(err.value), (case_id, str(err.value))


def test_a_good_dict_passes_every_check(block):
    """The checks refuse only what they should: both layouts reach the device
    check of the shards (this CPU block's shards are not on a GPU)."""
    for load in (lambda: block.load(nanogpt_state()), lambda: block.load_hf_gpt2(hf_state())):
        with pytest.raises(ValueError, match="ln_1.weight: expected a CUDA tensor"):
            load()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fusion_matches_hf_gpt2_block(dtype, no_tf32):
    """The fusion on HF's weights against HF's block, on the branch (out - x),
    to check.bound(dtype, "out"); in bf16 HF runs in fp32 on the bf16-rounded weights
    and input, as check.py runs the reference."""
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    from tpfuser.verify.check import bound
    cfg = CFG.replace(dtype=dtype)
    hf = hf_block(cfg)
    if dtype == "bf16":
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(p.bfloat16().float())
    block = ShardedBlock(cfg, Layout(1, 1)).load_hf_gpt2(hf.state_dict())
    x = make_input(cfg).to(cfg.torch_dtype).float()
    with torch.no_grad():
        expected = hf_forward(hf, x)
    out = block(block.shard_input(x))["out"].float().cpu()
    assert rel_l2(out, expected) <= bound(dtype, "out")
    assert rel_l2(out - x, expected - x) <= 2 * bound(dtype, "out")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a refusal of a machine without CUDA")
def test_a_cuda_block_without_cuda_says_so_after_the_checks():
    """Weights are checked where they are; only the move to the block's GPU needs one, and says so in one line."""
    block = ShardedBlock(CFG, Layout(1, 1), device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match="ln_1.bias: expected shape"):
        block.load(with_(nanogpt_state(), "ln_1.bias", torch.zeros(3)))
    for call in (lambda: block.load(nanogpt_state()), lambda: block.shard_input(make_input(CFG))):
        with pytest.raises(RuntimeError, match=r"^(load|shard_input): the block's device is cuda:0, and torch sees no "
                                               r"CUDA GPU here \(tpfuser.rank_shards cuts"):
            call()
