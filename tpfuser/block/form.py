"""How the block's passes are written as fusions: the choices that change the
fusions' text but neither the math nor where anything runs (a schedule picks
them, parallel/schedules.py; the mesh is applied apart, parallel/passes.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

# How q, k and v leave qkv, and their gradients return to it. nvFuser 0.2.36
# fails every one of them with one head per rank (tools/repro_one_head.py).
#   slice   slices of the (b, s, h, 3d) view, each through a kernel (the
#           multiplication by one); the gradient by cat.
#   select  select on the 3-axis of the (b, s, h, 3, d) view; the gradient by cat.
#   onehot  sums over that 3-axis times a one-hot made from iota; the gradient
#           the sum of the three broadcast on it times their one-hots
#           (pointwise: neither a view nor a cat). Exact for finite values.
#   view    slices of the (b, s, h, 3d) view left as views of qkv: no kernel, flash attention
#           reads the strided q, k and v (the backward takes them with any strides); the gradient by cat.
QKV_SPLITS = ("slice", "select", "onehot", "view")
# Where the dropout keep-masks are drawn (dropout.py's hash of the global position):
#   inline  inside the fusion that applies them;
#   fusion  by fusions of their own, one a mask, first in the pass (pointwise only), read
#           by the others: the same bits, and a block fusion with ~100 fewer
#           integer expressions for nvFuser's segmenter to search.
MASK_FORMS = ("inline", "fusion")
# The integers the fusions hash the dropout positions in (dropout.py; the same bits either way):
#   int64   32-bit values in nvFuser's Int, multiplied by a constant's 16-bit halves (two products each);
#   uint64  in UInt64, which holds a product of two 32-bit values exactly: one product each.
HASH_INTS = ("int64", "uint64")
# The block's linears, in order, and where its passes can be cut into fusions
# (block/pieces.py): the forward before and after each linear, and after the
# masks' own fusion; the backward before each sublayer's linears' backward,
# before and after each column-parallel linear's input-gradient matmul, and
# between each LayerNorm's parameter gradients and its input's.
LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
FORWARD_CUTS = ("masks",) + tuple(point for linear in LINEARS for point in (linear, f"{linear}.out"))
# Where the masks' own fusions begin after the first (one a mask: forward.mask_cuts), where drawn.
MASK_POINTS = ("masks.resid_mlp", "masks.attn")
BACKWARD_CUTS = ("grad:mlp.c_fc", "grad:mlp.c_fc.in", "grad:mlp.c_fc.in.out", "grad:ln_2", "grad:attn.c_proj",
                 "grad:attn.c_attn", "grad:attn.c_attn.in", "grad:attn.c_attn.in.out", "grad:ln_1")
# What a pass can be cut right after that is a partial sum over tp reduced
# there, by the linear that makes it: the row-parallel linears' outputs and
# the column-parallel linears' input gradients.
PARTIAL_SUMS = {"attn.c_proj.out": "attn.c_proj", "mlp.c_proj.out": "mlp.c_proj",
                "mlp.c_fc.grad_in": "mlp.c_fc", "attn.c_attn.grad_in": "attn.c_attn"}


@dataclass(frozen=True)
class Form:
    """cuts: the points where the passes are cut into fusions (FORWARD_CUTS,
    BACKWARD_CUTS). hints: points where a pass stays one fusion but tells
    nvFuser's segmenter to end a kernel there (segment_set on what crosses
    it). flash_layout: in bf16, q, k, v
    and attention's output held as flash attention holds them (tensors.memory_order).
    keys_on_device: the dropout keys are 0-d int64 CUDA tensors, read by the
    kernels at run time (a CUDA graph then draws new masks on each replay),
    not host scalars. seq_major: the partial sums (PARTIAL_SUMS) that enter
    a fusion sequence-major, as nvFuser 0.2.36 returns a reduce-scatter over
    the sequence (its ReorderShardedAxisPass puts the scattered axis
    outermost): under sequence parallelism, those of linears not chunked."""

    cuts: frozenset[str] = field(default_factory=frozenset)
    masks: str = "inline"
    hints: frozenset[str] = field(default_factory=frozenset)   # points kept in one fusion, a kernel boundary hinted
    qkv_split: str = "slice"
    flash_layout: bool = True
    keys_on_device: bool = False
    seq_major: frozenset[str] = field(default_factory=frozenset)
    hash_ints: str = "int64"

    def __post_init__(self):
        for name in ("cuts", "hints", "seq_major"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        if self.masks not in MASK_FORMS:
            raise ValueError(f"masks={self.masks!r}: expected one of {', '.join(MASK_FORMS)}")
        if self.qkv_split not in QKV_SPLITS:
            raise ValueError(f"qkv_split={self.qkv_split!r}: expected one of {', '.join(QKV_SPLITS)}")
        if self.hash_ints not in HASH_INTS:
            raise ValueError(f"hash_ints={self.hash_ints!r}: expected one of {', '.join(HASH_INTS)}")
