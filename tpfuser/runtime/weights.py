"""Weights from where users have them, checked before they reach a rank.

The block takes nanoGPT's layout (tensors.PARAM_NAMES): every linear stores
its weight as nn.Linear does, W[out, in], and computes y = x W^T + b.

Hugging Face's GPT-2 uses the same names (ln_1, attn.c_attn, attn.c_proj,
ln_2, mlp.c_fc, mlp.c_proj) but its linears are `Conv1D`, which stores W as
[in, out] and computes y = x W + b. So W_nanogpt = W_hf^T for the four linear
weights; biases and LayerNorms are the same. c_attn's columns are [Q | K | V],
each head by head, which is nanoGPT's [3, h, d] row order once transposed.

The shapes tell the layouts apart only for the non-square weights (c_attn
[e, 3e] against [3e, e], c_fc, mlp.c_proj); attn.c_proj is [e, e] in both.
So a dict is taken in one layout or the other whole, never weight by weight:
`load()` refuses a dict with any Conv1D-shaped weight and names the HF loader,
which transposes all four (the square one too).

Not in the state_dict, so not checked here: HF's config must match the
block's (activation_function "gelu_new", GELU tanh; layer_norm_epsilon 1e-5;
n_inner None or 4 n_embd; scale_attn_weights True; no scale_attn_by_inverse_layer_idx,
no reorder_and_upcast_attn).
"""

from __future__ import annotations

import re

import torch

from tpfuser.config import BlockConfig, Layout, article, check_config
from tpfuser.block.tensors import PARAM_NAMES, param_shapes
from tpfuser.parallel.shard import fusion_params, rank_params

LINEAR_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers older Hugging Face GPT-2 blocks keep in their state_dict (the causal
# mask and its fill value; nanoGPT's CausalSelfAttention keeps the mask as
# attn.bias too, without flash attention): not weights, so not refused as
# unexpected keys, in either layout.
HF_BUFFERS = ("attn.bias", "attn.masked_bias")
_LAYER_KEY = re.compile(r"^(?:transformer\.)?h\.(\d+)\.")


def check_tensor(name: str, t) -> None:
    """A weight must be a dense floating-point tensor of finite values, with
    data: load() casts floats to the block's dtype (fp8 too), but an integer
    tensor cast is almost surely the wrong tensor, and a NaN or inf poisons
    every output of the block. Every refusal names the tensor (torch's own
    errors on such tensors do not)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: a {str(t.layout).removeprefix('torch.')} tensor; expected a dense one "
                         f"(.to_dense() makes it)")
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if t.device.type == "meta":
        raise ValueError(f"{name}: a tensor on the meta device, which holds no values; expected one with "
                         f"data (the checkpoint's weights loaded)")
    check_finite(name, t)


def check_finite(name: str, t: torch.Tensor) -> None:
    """Refuse NaN or inf, saying how many. It reads the tensor back (a sync on a GPU)."""
    if t.dtype.itemsize == 1:   # fp8: torch has no isfinite for it; its values are exact in fp32
        try:
            t = t.float()
        except (RuntimeError, NotImplementedError):   # a packed one (float4_e2m1fn_x2): no conversion
            raise ValueError(f"{name}: a {t.dtype} tensor, which torch cannot convert to float32 (a packed "
                             f"format); expected fp32, bf16, fp16, fp64 or fp8") from None
    bad = ~torch.isfinite(t)
    n_bad = int(bad.sum())
    if n_bad:
        n_nan = int(torch.isnan(t).sum())
        raise ValueError(f"{name}: {n_bad} of {t.numel()} elements are not finite "
                         f"({n_nan} NaN, {n_bad - n_nan} inf); expected finite values")


def _transposed(state: dict, cfg: BlockConfig) -> list[str]:
    """The linear weights whose shape is the transpose of nanoGPT's (and not nanoGPT's itself)."""
    shapes = param_shapes(cfg)
    return [n for n in LINEAR_WEIGHTS if n in state and isinstance(state[n], torch.Tensor)
            and tuple(state[n].shape) == shapes[n][::-1] != shapes[n]]


def _describe(state: dict, names: list[str]) -> str:
    return ", ".join(f"{n} {tuple(state[n].shape)}" for n in names)


def _layers(state: dict) -> list[int]:
    return sorted({int(m.group(1)) for k in state if isinstance(k, str) and (m := _LAYER_KEY.match(k))})


def _layer(state: dict, layer: int) -> tuple[dict, dict]:
    """Layer i's tensors by the block's names, and each name's key in the model's dict."""
    block, shown_as = {}, {}
    for key, t in state.items():
        m = _LAYER_KEY.match(key)
        if m and int(m.group(1)) == layer:
            block[key[m.end():]] = t
            shown_as[key[m.end():]] = key
    return block, shown_as


def _checked_layer(state: dict, layer, alone: str, none_ok: bool = False) -> tuple[dict, dict]:
    """_layer, with layer refused unless an index the dict has (alone: what to do with one block's dict)."""
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise ValueError(f"layer={layer!r}: expected {'None or ' if none_ok else ''}an int >= 0 (the model layer's "
                         f"index), got "
                         f"{type(layer).__name__ if not isinstance(layer, int) or isinstance(layer, bool) else layer}")
    layers = _layers(state)
    if layer not in layers:
        raise ValueError(f"layer={layer}: the state_dict has no keys 'transformer.h.{layer}.' or 'h.{layer}.'"
                         + (f" (it has h.{layers[0]}..h.{layers[-1]})" if layers else
                            f" (it holds no model layers; {alone})"))
    return _layer(state, layer)


def model_layer(state: dict, layer: int) -> dict:
    """Layer i of a whole model's state_dict (`transformer.h.{i}.` or `h.{i}.`,
    nanoGPT's GPT or Hugging Face's GPT2Model / GPT2LMHeadModel), by the block's
    names; the model's other keys are not the layer's. Layouts are not changed:
    `block.load(model_layer(nanogpt.state_dict(), i))`."""
    check_state(state)
    return _checked_layer(state, layer, "one block's state_dict loads as it is: block.load(state)")[0]


def check_nanogpt(state: dict, cfg: BlockConfig) -> None:
    """Refuse a dict in HF's layout (or a model's whole state_dict) with a message
    naming the layout it looks like and the loader that takes it."""
    layers = _layers(state)
    if layers and not any(n in state for n in PARAM_NAMES):
        first = _layer(state, layers[0])[0]
        loader = ("block.load_hf_gpt2(state, layer=i) (Hugging Face's Conv1D layout, as this one's weights are)"
                  if _transposed(first, cfg) else "block.load(tpfuser.model_layer(state, i))")
        raise ValueError(f"state_dict looks like a whole model's (layers h.{layers[0]}..h.{layers[-1]}), "
                         f"expected one block's: pick a layer with {loader}")
    flipped = _transposed(state, cfg)
    if flipped:
        raise ValueError(f"state_dict looks like Hugging Face GPT-2's Conv1D layout (weights stored [in, out]): "
                         f"{_describe(state, flipped)}; expected nanoGPT's [out, in]. Load it with "
                         f"block.load_hf_gpt2(state) (tpfuser.runtime.weights.from_hf_gpt2), which transposes all four "
                         f"linear weights, the square attn.c_proj too")


def _shown(keys: list[str]) -> str:
    return ", ".join(map(repr, keys[:8])) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def check_state(state, what: str = "state_dict") -> None:
    """A dict of tensors by str name, refused in one line otherwise (before a key is read)."""
    if not isinstance(state, dict):
        raise ValueError(f"{what}: expected a dict of tensors by name (a state_dict()), got {type(state).__name__}")
    odd = [k for k in state if not isinstance(k, str)]
    if odd:
        raise ValueError(f"{what}: key {odd[0]!r} is {article(odd[0])}; expected str keys (tensors' names)")


def check_strict(strict) -> None:
    if not isinstance(strict, bool):
        raise ValueError(f"strict={strict!r}: expected True or False, got {type(strict).__name__}")


def check_keys(keys, strict: bool, ignored=(), shown_as=None) -> None:
    """Refuse a state_dict with keys the block has none of (e.g. a LoRA
    adapter's: loading the rest would compute another model than the
    user's), naming them; strict=False ignores them. Missing keys are always
    refused, naming them (and the keys there are instead). shown_as: a key's
    name in the user's dict, where it differs (a model layer's prefix)."""
    keys = list(keys)
    shown_as = shown_as or {}
    unexpected = [k for k in keys if k not in PARAM_NAMES and k not in ignored]
    missing = [n for n in PARAM_NAMES if n not in keys]
    if missing:
        instead = (f"; it has {len(unexpected)} other key(s): {_shown([shown_as.get(k, k) for k in unexpected])}"
                   if unexpected else "")
        raise ValueError(f"state_dict lacks {missing}: {len(missing)} of the block's {len(PARAM_NAMES)} tensors"
                         f"{instead}; expected all of {', '.join(PARAM_NAMES)}")
    if unexpected and strict:
        raise ValueError(f"state_dict has {len(unexpected)} key(s) the block has no tensor for: "
                         f"{_shown([shown_as.get(k, k) for k in unexpected])}; "
                         f"expected exactly {', '.join(PARAM_NAMES)} (strict=False ignores the others)")


def from_hf_gpt2(state: dict, cfg: BlockConfig, layer: int | None = None,
                 strict: bool = True) -> dict[str, torch.Tensor]:
    """nanoGPT's layout from Hugging Face's: a `GPT2Block.state_dict()` or, with
    `layer`, layer i of a `GPT2LMHeadModel` / `GPT2Model` state_dict
    (`transformer.h.{i}.` or `h.{i}.`; the model's other keys are not the
    layer's). The four linear weights are transposed (Conv1D's [in, out] ->
    nn.Linear's [out, in]); everything else is copied by name. A key of the
    block (or layer) that is none of its tensors is refused (check_keys)."""
    check_config(cfg)
    check_state(state)
    check_strict(strict)
    if layer is None:
        layers = _layers(state)
        if layers:
            raise ValueError(f"state_dict holds layers h.{layers[0]}..h.{layers[-1]} of a model: "
                             f"pass layer=i (0 <= i <= {layers[-1]})")
        block, shown_as = dict(state), {}
    else:
        block, shown_as = _checked_layer(state, layer, "for one GPT2Block's state_dict leave layer=None", True)
    check_keys(block, strict, ignored=HF_BUFFERS, shown_as=shown_as)
    shapes = param_shapes(cfg)
    nanogpt_like = [n for n in LINEAR_WEIGHTS if isinstance(block[n], torch.Tensor)
                    and tuple(block[n].shape) == shapes[n] != shapes[n][::-1]]
    if nanogpt_like:
        raise ValueError(f"state_dict looks like nanoGPT's nn.Linear layout (weights stored [out, in]): "
                         f"{_describe(block, nanogpt_like)}; expected Hugging Face's Conv1D [in, out]. "
                         f"Load it with " + ("block.load(state)" if layer is None
                                             else f"block.load(tpfuser.model_layer(state, {layer}))"))
    out = {}
    for name in PARAM_NAMES:
        t = block[name]
        check_tensor(shown_as.get(name, name), t)
        expected = shapes[name][::-1] if name in LINEAR_WEIGHTS else shapes[name]
        if tuple(t.shape) != expected:
            raise ValueError(f"{shown_as.get(name, name)}: expected shape {expected} in Hugging Face's layout "
                             f"for n_embd={cfg.n_embd}, got {tuple(t.shape)}")
        out[name] = t.detach().t().contiguous() if name in LINEAR_WEIGHTS else t.detach()
    return out


def rank_shards(state: dict[str, torch.Tensor], cfg: BlockConfig, layout: Layout, rank: int,
                strict: bool = True) -> list[torch.Tensor]:
    """A rank's parameter shards (PARAM_NAMES order, the fusion's qkv order, on
    each tensor's own device: cast, checked and cut there, never through the host)
    from a nanoGPT-style state_dict (global, blocked c_attn). Floating
    weights are cast to the block's dtype; integers, NaN and inf are refused, and
    so is Hugging Face's layout (from_hf_gpt2 converts it), and keys that are
    none of the block's tensors (check_keys; strict=False ignores them; the
    causal-mask buffers HF_BUFFERS are no weights and always ignored)."""
    check_config(cfg, layout)
    layout.check(cfg)
    check_state(state)
    check_strict(strict)
    layout.rank_coords(rank)   # a rank of the mesh (an int: "1" is refused)
    check_nanogpt(state, cfg)
    check_keys(state, strict, ignored=HF_BUFFERS)
    shapes = param_shapes(cfg)
    full = {}
    for name in PARAM_NAMES:
        check_tensor(name, state[name])
        if tuple(state[name].shape) != shapes[name]:
            raise ValueError(f"{name}: expected shape {shapes[name]}, got {tuple(state[name].shape)}")
        full[name] = state[name].detach().to(cfg.torch_dtype)
        check_finite(f"{name} cast to {cfg.dtype}", full[name])   # e.g. fp64 beyond fp32's range
    return rank_params(fusion_params(full, cfg), layout, rank)


def block_device(device) -> torch.device:
    """The block's device from what PyTorch takes for one: a torch.device, a str
    ("cuda", "cuda:1", "cpu") or a CUDA device's index (None: the current CUDA
    device). Refused in one line: another type, a device the block cannot be
    on (its fusions run on a CUDA GPU; on the CPU only its slices and passes
    are made), a CUDA index past the GPUs this machine has."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise ValueError(f"device={device!r}: expected a torch.device, a str such as 'cuda:0' or a CUDA device's "
                         f"index, got {article(device)}")
    try:
        made = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device={device!r}: not a device PyTorch knows ({str(e).splitlines()[0]})") from None
    if made.type not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: expected a CUDA device ('cuda', 'cuda:N'): the block's fusions run on "
                         f"a GPU (on the CPU, 'cpu', only its slices and passes are made), got a {made.type} device")
    count = torch.cuda.device_count() if made.type == "cuda" and torch.cuda.is_available() else None
    if count is not None and made.index is not None and made.index >= count:
        raise ValueError(f"device={device!r}: this machine has {count} CUDA device{'s' * (count != 1)} "
                         f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
    return made


def to_device(t: torch.Tensor, device: torch.device, what: str, dtype=None) -> torch.Tensor:
    """A copy of t on the block's device (and dtype), or one line where that
    device is a GPU this machine has not (torch's own words name no call)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{what}: the block's device is {device}, and torch sees no CUDA GPU here "
                           f"(tpfuser.rank_shards cuts a rank's shards without one)")
    return t.to(device, dtype, copy=True)

