"""The block's tensors, one ordered table: what each is, its dimensions, its
dtype and when it exists. Their placements on the mesh follow from the
dimensions (placements.py); the fusions, the runtime, the plan, the report and the
tests read this table.

Dimensions are named by what they are, so that the sharding reads off them:
  b batch, s sequence, e hidden (n_embd), h heads, d head dim, two a pair,
  hd  heads x head dim (= e): attention's output, the row-parallel c_proj's input,
  q3  heads x (q, k, v) x head dim (= 3e): c_attn's output rows, head by head,
  f   the MLP hidden (= 4e).
Megatron-LM's tensor parallelism splits h, hd, q3 and f over tp (column-parallel
outputs, row-parallel inputs) and b over dp; sequence parallelism splits s
over tp too, in the tensors tensor parallelism would replicate (`seq_split`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tpfuser.config import BlockConfig

TP_DIMS = ("h", "hd", "q3", "f")
LN_EPS = 1e-5   # both LayerNorms' (nn.LayerNorm's default, as nanoGPT)
# Flash attention's own memory layout of q, k, v and its output (bf16): the
# heads inside the sequence, as ATen's flash kernels read and write them.
FLASH_MEMORY = ("b", "s", "h", "d")


def dim_sizes(cfg: BlockConfig) -> dict[str, int]:
    e = cfg.n_embd
    return {"b": cfg.batch, "s": cfg.seq, "e": e, "h": cfg.n_head, "d": cfg.head_dim, "hd": e, "q3": 3 * e,
            "f": 4 * e, "two": 2}


def _always(cfg: BlockConfig) -> bool:
    return True


def _dropout(cfg: BlockConfig) -> bool:
    return cfg.dropout > 0


def _bf16(cfg: BlockConfig) -> bool:   # flash attention's own state
    return cfg.dtype == "bf16"


def _fp32_dropout(cfg: BlockConfig) -> bool:   # attention written out, its dropout drawn by the fusion
    return cfg.dtype == "fp32" and cfg.dropout > 0


@dataclass(frozen=True)
class Tensor:
    """One tensor of the block.

    role: "param", "input", "output" (of the forward), "mask" (a dropout
    keep-mask the forward draws: a checking output, saved for backward),
    "saved" (for backward), "grad" (of the backward), "intermediate" (inside a
    pass: where it can be cut into fusions, or where the schedule places it
    for the collectives).
    dtype: "block" (the block's bf16 or fp32), "f32", "bool" or "u64".
    seq_split: under sequence parallelism s is split over tp (the region tensor
    parallelism replicates: the block's input and output, LayerNorms, residuals,
    residual dropouts). stream: a mask's dropout stream (dropout.STREAMS).
    flash_layout: in bf16, held in memory as FLASH_MEMORY, not in the order of
    `dims` (memory_order). unwritten: its values are whatever memory held
    (nothing compares them)."""

    name: str
    role: str
    dims: tuple[str, ...]
    dtype: str = "block"
    seq_split: bool = False
    when: Callable[[BlockConfig], bool] = _always
    stream: str | None = None
    flash_layout: bool = False
    unwritten: bool = False

    def shape(self, cfg: BlockConfig) -> tuple[int, ...]:
        sizes = dim_sizes(cfg)
        return tuple(sizes[dim] for dim in self.dims)

    @property
    def saved(self) -> bool:
        """What the training forward returns for the backward (masks included)."""
        return self.role in ("saved", "mask")


def _params() -> list[Tensor]:
    vector = {"ln_1": ("e",), "ln_2": ("e",)}
    linears = {  # weight [out, in] and bias [out], as nn.Linear
        "attn.c_attn": ("q3", "e"),   # column-parallel
        "attn.c_proj": ("e", "hd"),   # row-parallel: its bias is not split
        "mlp.c_fc": ("f", "e"),       # column-parallel
        "mlp.c_proj": ("e", "f"),     # row-parallel
    }
    out = []
    for module in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
        if module in vector:
            out += [Tensor(f"{module}.weight", "param", vector[module]), Tensor(f"{module}.bias", "param", vector[module])]
        else:
            out += [Tensor(f"{module}.weight", "param", linears[module]),
                    Tensor(f"{module}.bias", "param", linears[module][:1])]
    return out


PARAMS = _params()
PARAM_NAMES: tuple[str, ...] = tuple(p.name for p in PARAMS)   # nanoGPT's names, in its state_dict's order


def param_shapes(cfg: BlockConfig) -> dict[str, tuple[int, ...]]:
    return {p.name: p.shape(cfg) for p in PARAMS}


TENSORS: tuple[Tensor, ...] = (
    Tensor("x", "input", ("b", "s", "e"), seq_split=True),
    *PARAMS,
    Tensor("out", "output", ("b", "s", "e"), seq_split=True),
    # What the training forward saves for backward, in the order the backward takes them.
    Tensor("ln_1.mean", "saved", ("b", "s"), "f32", seq_split=True),
    Tensor("ln_1.rstd", "saved", ("b", "s"), "f32", seq_split=True),
    Tensor("q", "saved", ("b", "h", "s", "d"), flash_layout=True),
    Tensor("k", "saved", ("b", "h", "s", "d"), flash_layout=True),
    Tensor("v", "saved", ("b", "h", "s", "d"), flash_layout=True),
    Tensor("sdpa_out", "saved", ("b", "h", "s", "d"), when=_bf16, flash_layout=True),
    Tensor("sdpa_lse", "saved", ("b", "h", "s"), "f32", when=_bf16),
    Tensor("sdpa_seed", "saved", ("two",), "u64", when=_bf16),     # flash attention's philox state, per rank
    # ATen's flash attention returns an unused placeholder here, never written
    # (its philox state is all in sdpa_seed): its bits differ from call to call.
    Tensor("sdpa_offset", "saved", (), "u64", when=_bf16, unwritten=True),
    Tensor("x1", "saved", ("b", "s", "e"), "f32", seq_split=True),   # the residual after attention
    Tensor("ln_2.mean", "saved", ("b", "s"), "f32", seq_split=True),
    Tensor("ln_2.rstd", "saved", ("b", "s"), "f32", seq_split=True),
    Tensor("mlp_h", "saved", ("b", "s", "f")),                      # before GELU
    # The dropout masks the fusion draws (one byte an element, as eager PyTorch saves them).
    Tensor("resid_attn_keep", "mask", ("b", "s", "e"), "bool", seq_split=True, when=_dropout, stream="resid_attn"),
    Tensor("resid_mlp_keep", "mask", ("b", "s", "e"), "bool", seq_split=True, when=_dropout, stream="resid_mlp"),
    Tensor("attn_keep", "mask", ("b", "h", "s", "s"), "bool", when=_fp32_dropout, stream="attn"),
    # The backward: the upstream and input gradients are laid out like the output and the input.
    Tensor("grad_out", "input", ("b", "s", "e"), seq_split=True),
    Tensor("grad_x", "grad", ("b", "s", "e"), seq_split=True),
    *(Tensor(f"grad.{p.name}", "grad", p.dims) for p in PARAMS),
    # Backward intermediates the schedule places, where the collectives go: the
    # gradients at the row-parallel linears' outputs and the recomputed LayerNorm
    # outputs, read whole by the linears' gradients (under SP: all-gathered), and
    # the gradients at the LayerNorms' outputs, the column-parallel linears'
    # input gradients summed over tp (all-reduced; under SP reduce-scattered).
    Tensor("g.mlp.c_proj.out", "intermediate", ("b", "s", "e")),
    Tensor("g.attn.c_proj.out", "intermediate", ("b", "s", "e")),
    Tensor("ln_2.out.whole", "intermediate", ("b", "s", "e")),
    Tensor("ln_1.out.whole", "intermediate", ("b", "s", "e")),
    Tensor("g.ln_2.out", "intermediate", ("b", "s", "e"), "f32", seq_split=True),
    Tensor("g.ln_1.out", "intermediate", ("b", "s", "e"), "f32", seq_split=True),
    # Where a pass can be cut into fusions (block/pieces.py): what crosses each
    # cut point, a linear's input before it and its output after it (forward),
    # the residual stream's gradient between the sublayers (backward). The
    # row-parallel outputs are their partial sums reduced, before the bias;
    # the column-parallel linears' upstream gradients (g.mlp_h, g.qkv) and
    # their input gradients, partial sums over tp reduced (*.grad_in).
    Tensor("ln_1.out", "intermediate", ("b", "s", "e"), seq_split=True),
    Tensor("qkv", "intermediate", ("b", "s", "q3")),
    Tensor("attn_out", "intermediate", ("b", "s", "hd")),
    Tensor("attn.c_proj.out", "intermediate", ("b", "s", "e"), seq_split=True),
    Tensor("ln_2.out", "intermediate", ("b", "s", "e"), seq_split=True),
    Tensor("mlp_act", "intermediate", ("b", "s", "f")),
    Tensor("mlp.c_proj.out", "intermediate", ("b", "s", "e"), seq_split=True),
    Tensor("g.mlp_h", "intermediate", ("b", "s", "f")),
    Tensor("g.x1", "intermediate", ("b", "s", "e"), "f32", seq_split=True),
    Tensor("g.qkv", "intermediate", ("b", "s", "q3")),
    Tensor("mlp.c_fc.grad_in", "intermediate", ("b", "s", "e"), seq_split=True),
    Tensor("attn.c_attn.grad_in", "intermediate", ("b", "s", "e"), seq_split=True),
)

BY_NAME: dict[str, Tensor] = {t.name: t for t in TENSORS}
MASKS: dict[str, Tensor] = {t.stream: t for t in TENSORS if t.role == "mask"}   # stream -> mask


def tensors(cfg: BlockConfig, role: str | None = None) -> list[Tensor]:
    """The tensors that exist for cfg (of one role), in table order."""
    return [t for t in TENSORS if t.when(cfg) and (role is None or t.role == role)]


def saved(cfg: BlockConfig) -> list[Tensor]:
    """What the training forward saves for the backward, in the backward's order."""
    return [t for t in TENSORS if t.saved and t.when(cfg)]


def memory_order(t: Tensor, cfg: BlockConfig) -> tuple[int, ...] | None:
    """t's dimensions, outermost first, in the order its elements lie in memory
    under cfg; None: in the order of t.dims (contiguous). Flash attention (bf16)
    reads q, k, v and writes its output with the heads inside the sequence, so
    the forward writes them that way and the backward reads them that way:
    ATen copies none of them on either side (the five strided copies a nanogpt
    bf16 training step made before, profiled on an H200: docs/history.md)."""
    if t.flash_layout and cfg.dtype == "bf16":
        return tuple(t.dims.index(dim) for dim in FLASH_MEMORY)
    return None
