"""The oracle: nanoGPT's Block in plain PyTorch (GELU tanh, as in Thunder's nanoGPT).

Parameter names are nanoGPT's, so a nanoGPT `Block.state_dict()` loads as is.
Their order and shapes (`PARAM_NAMES`, `param_shapes`) are written out here,
not read from block/tensors.py, the table the fusion's `define_tensor`s and
`execute` inputs follow: the oracle imports nothing of the package it checks
(tests/test_imports.py), and tests/test_reference.py checks the two agree.

Dropout is applied through explicit masks when they are given (`Masks`), so
that the reference can replay exactly what a fusion drew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:   # the annotations' type only
    from tpfuser.config import BlockConfig

# nanoGPT's parameters, in its state_dict's order.
PARAM_NAMES: tuple[str, ...] = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                                "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                                "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")

LN_EPS = 1e-5


def param_shapes(cfg: BlockConfig) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape, in PARAM_NAMES' order (nn.Linear's weight [out, in])."""
    e = cfg.n_embd
    return {"ln_1.weight": (e,), "ln_1.bias": (e,),
            "attn.c_attn.weight": (3 * e, e), "attn.c_attn.bias": (3 * e,),
            "attn.c_proj.weight": (e, e), "attn.c_proj.bias": (e,),
            "ln_2.weight": (e,), "ln_2.bias": (e,),
            "mlp.c_fc.weight": (4 * e, e), "mlp.c_fc.bias": (4 * e,),
            "mlp.c_proj.weight": (e, 4 * e), "mlp.c_proj.bias": (e,)}


@dataclass
class Masks:
    """Keep-masks (bool, True = kept) of the block's dropouts, global shapes.

    attn: [b, h, s, s] on the attention probabilities, or None (no dropout
    there, or dropout done inside a flash-attention kernel);
    resid_attn, resid_mlp: [b, s, e] on the two residual branches.
    """

    resid_attn: torch.Tensor
    resid_mlp: torch.Tensor
    attn: Optional[torch.Tensor] = None

    def batch_slice(self, parts: int, index: int) -> "Masks":
        """The masks of one of `parts` equal chunks of the batch."""
        def cut(t):
            return None if t is None else t.chunk(parts, dim=0)[index]
        return Masks(cut(self.resid_attn), cut(self.resid_mlp), cut(self.attn))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def _dropout(x: torch.Tensor, keep: Optional[torch.Tensor], p: float) -> torch.Tensor:
    if keep is None or p == 0.0:
        return x
    return x * keep.to(x.dtype) / (1.0 - p)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x, p: float = 0.0, attn_keep=None, attention: Optional[Callable] = None):
        b, s, e = x.shape
        q, k, v = self.c_attn(x).split(e, dim=2)
        q, k, v = (t.view(b, s, self.n_head, e // self.n_head).transpose(1, 2) for t in (q, k, v))  # (b, h, s, d)
        if attention is not None:
            y = attention(q, k, v)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (b, h, s, s)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            y = _dropout(probs, attn_keep, p) @ v
        y = y.transpose(1, 2).reshape(b, s, e)  # (b, s, e)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(gelu_tanh(self.c_fc(x)))


class Block(nn.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(.)), each branch through dropout."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        if not all(hasattr(cfg, name) for name in ("n_embd", "n_head", "dropout")):   # (duck-typed: see the top)
            raise ValueError(f"cfg={cfg!r}: expected a BlockConfig (tpfuser.preset(name) or BlockConfig(...)), "
                             f"got {type(cfg).__name__}")
        self.cfg = cfg
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=LN_EPS)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=LN_EPS)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, masks: Optional[Masks] = None,
                attention: Optional[Callable] = None) -> torch.Tensor:
        """With masks=None no dropout is applied (eval semantics)."""
        p = self.cfg.dropout if masks is not None else 0.0
        keep = masks or Masks(None, None)
        x = x + _dropout(self.attn(self.ln_1(x), p, keep.attn, attention), keep.resid_attn, p)
        return x + _dropout(self.mlp(self.ln_2(x)), keep.resid_mlp, p)

    def params(self) -> list[torch.Tensor]:
        """Parameters in PARAM_NAMES order, detached."""
        state = self.state_dict()
        return [state[name].detach() for name in PARAM_NAMES]


def sdpa_forward(block: Block, x: torch.Tensor, p: float, heads_interleaved: bool = False) -> torch.Tensor:
    """nanoGPT's training forward as a PyTorch user runs it: PyTorch's fused
    attention (SDPA) and F.dropout, on the reference block's weights (the
    benchmark's eager and torch.compile peers; with heads_interleaved, c_attn's
    rows head by head, as DTensor's tensor-parallel peer holds them: each rank
    then sees whole heads)."""
    d = block.cfg.head_dim
    qkv = block.attn.c_attn(block.ln_1(x))
    b, s = qkv.shape[:2]   # the whole sequence (x holds a rank's part of it under DTensor's sequence parallelism)
    if heads_interleaved:   # rows [h, 3, d] (shard.qkv_heads_interleaved)
        q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, -1, 3, d).unbind(3))    # (b, h, s, d)
    else:                   # nanoGPT's rows [3, h, d]
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in qkv.chunk(3, dim=2))  # (b, h, s, d)
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True).transpose(1, 2).reshape(b, s, -1)
    x = x + F.dropout(block.attn.c_proj(y), p)
    return x + F.dropout(block.mlp.c_proj(gelu_tanh(block.mlp.c_fc(block.ln_2(x)))), p)


def make_block(cfg: BlockConfig, seed: int = 0, dtype=torch.float32, device="cpu", drawn_on="cpu") -> Block:
    """A reference block with GPT-2-like random weights (std 0.02; LayerNorm
    weights and all biases perturbed so that none of them is trivially 1 or 0).
    The weights are drawn by a generator on `drawn_on` (a CUDA device draws
    gpt3's 1.8 G weights in a blink; its numbers differ from the CPU's)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r}: expected an int, got {type(seed).__name__}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r}: expected a torch.dtype (torch.float32, torch.bfloat16), "
                         f"got {type(dtype).__name__}")
    gen = torch.Generator(drawn_on).manual_seed(seed)
    with torch.device(drawn_on):
        block = Block(cfg)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.startswith("ln_") and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=drawn_on))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, device=drawn_on))
    return block.to(device=device, dtype=dtype)


def make_input(cfg: BlockConfig, seed: int = 1, dtype=torch.float32, device="cpu", drawn_on="cpu") -> torch.Tensor:
    gen = torch.Generator(drawn_on).manual_seed(seed)
    return torch.randn(cfg.batch, cfg.seq, cfg.n_embd, generator=gen, device=drawn_on).to(device=device, dtype=dtype)
