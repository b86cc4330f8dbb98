"""Block and layout configuration: frozen, validated where built, with presets.

Dimension letters used throughout the code (block/tensors.py adds hd and q3):
  b batch, s sequence, e n_embd (hidden), h n_head, d head dim (= e / h),
  f MLP hidden (= 4 e), dp / tp the mesh sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _kind(value) -> str:
    """What came, where its repr alone can mislead ('4' for 4, True for 1):
    the type of anything that is not a plain number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ""
    return f", got {article(value)}"


def article(value) -> str:
    """"a str", "an int": the type of what came, for a refusal."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _require(ok: bool, what: str, value, rule: str, kind: bool = False) -> None:
    """Refuse "what=value: rule"; kind: a number is expected, so say the type of anything else."""
    if not ok:
        raise ValueError(f"{what}={value!r}: {rule}{_kind(value) if kind else ''}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(what: str, value) -> None:
    _require(_is_int(value) and value > 0, what, value, "must be a positive int", kind=True)


def _fields_of(cls, changes: dict, where: str) -> None:
    """Refuse, naming it, a keyword that is none of the dataclass's fields (dataclasses says it in a TypeError)."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in changes if k not in names]
    if unknown:
        raise ValueError(f"{where}: {cls.__name__} has no field {', '.join(map(repr, unknown))}; "
                         f"expected some of {', '.join(names)}")


class FrozenDict(dict):
    """A dict that refuses to change in place: a frozen dataclass's mapping field
    (frozen=True stops assigning the field, not its items). Equal to a dict of
    the same items; copied and pickled as one; `what` names it in the refusal."""

    def __init__(self, items=(), what: str = "this mapping"):
        super().__init__(items)
        self.what = what

    def _refuse(self, *args, **kwargs):
        raise TypeError(f"{self.what} cannot be changed in place (a frozen value: others may share it); make a "
                        f"changed copy instead, e.g. with its holder's replace()")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return FrozenDict, (dict(self), self.what)


def frozen(value, what: str):
    """value with every dict in it a FrozenDict and every list a tuple (a copy: the caller's stays its own)."""
    if isinstance(value, dict):
        return FrozenDict({k: frozen(v, what) for k, v in value.items()}, what)
    return tuple(frozen(v, what) for v in value) if isinstance(value, (list, tuple)) else value


def thawed(value):
    """frozen's inverse: plain dicts and lists (for JSON and for a caller to change)."""
    if isinstance(value, dict):
        return {k: thawed(v) for k, v in value.items()}
    return [thawed(v) for v in value] if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class BlockConfig:
    """One GPT-2 block and the activation it is run on (global shapes)."""

    batch: int
    seq: int
    n_embd: int
    n_head: int
    dropout: float = 0.0
    dtype: str = "bf16"

    def __post_init__(self):
        for name in ("batch", "seq", "n_embd", "n_head"):
            _positive_int(name, getattr(self, name))
        _require(self.n_embd % self.n_head == 0, "n_embd", self.n_embd,
                 f"must be divisible by n_head={self.n_head}")
        number = isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool)
        _require(number and 0.0 <= self.dropout < 1.0, "dropout", self.dropout,
                 "must be in [0, 1)" if number else "must be a number in [0, 1)", kind=True)
        _require(isinstance(self.dtype, str) and self.dtype in DTYPES, "dtype", self.dtype,
                 f"must be one of {sorted(DTYPES)}" + (" (its name, not a torch.dtype)"
                                                        if isinstance(self.dtype, torch.dtype) else ""))
        if self.dtype == "bf16":
            # bf16 attention is flash attention's kernel (sdpfa_fwd), which takes these head sizes
            # only; it would fail on the GPU, after the fusion is built. fp32 writes attention out.
            rule = "in bf16 (flash attention's limit; fp32 has none)"
            _require(self.head_dim % 8 == 0, "head_dim", self.head_dim,
                     f"n_embd/n_head must be a multiple of 8 {rule}")
            _require(self.head_dim <= 256, "head_dim", self.head_dim, f"n_embd/n_head must be at most 256 {rule}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def replace(self, **changes) -> "BlockConfig":
        _fields_of(BlockConfig, changes, "replace()")
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, BlockConfig] = {
    # The benchmark of the original request (Thunder's nanoGPT block target).
    "nanogpt": BlockConfig(batch=16, seq=128, n_embd=1600, n_head=25, dropout=0.1),
    # The size nvFuser's own multi-GPU transformer tests use.
    "gpt3": BlockConfig(batch=1, seq=2048, n_embd=12288, n_head=96, dropout=0.1),
    # Small enough for CPU tests; heads and batch divisible by 8 for every test mesh.
    "tiny": BlockConfig(batch=4, seq=16, n_embd=64, n_head=8, dropout=0.1),
}


def preset(name: str, **overrides) -> BlockConfig:
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"preset={name!r}: must be one of {sorted(PRESETS)}"
                         + ("" if isinstance(name, str) else _kind(name)))
    _fields_of(BlockConfig, overrides, f"preset({name!r})")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


@dataclass(frozen=True)
class Layout:
    """The parallel layout: a dp x tp device mesh (data parallel on mesh_y,
    tensor parallel on mesh_x); sp adds sequence parallelism over the tp axis
    (Korthikanti et al., 2022) to the regions tensor parallelism replicates."""

    dp: int = 1
    tp: int = 1
    sp: bool = False

    def __post_init__(self):
        for name in ("dp", "tp"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.sp, bool):   # 1 or "yes" is not taken for True
            raise ValueError(f"sp={self.sp!r}: must be a bool (True or False), got {article(self.sp)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def rank_coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of a global rank; the mesh is arange(dp*tp).reshape(dp, tp)."""
        _require(_is_int(rank) and 0 <= rank < self.world_size, "rank", rank,
                 f"must be {'' if _is_int(rank) else 'an int '}in [0, {self.world_size}) for mesh {self.dp}x{self.tp}",
                 kind=True)
        return divmod(rank, self.tp)

    def check(self, cfg: BlockConfig) -> None:
        """Raise a ValueError naming the field when cfg cannot be sharded on this mesh."""
        check_config(cfg)
        _require(cfg.n_head % self.tp == 0, "n_head", cfg.n_head,
                 f"must be divisible by tp={self.tp} (each tp rank takes whole heads)")
        _require((4 * cfg.n_embd) % self.tp == 0, "4*n_embd", 4 * cfg.n_embd,
                 f"must be divisible by tp={self.tp} (the MLP hidden is split over tp)")
        _require(cfg.batch % self.dp == 0, "batch", cfg.batch,
                 f"must be divisible by dp={self.dp} (the batch is split over dp)")
        if self.sp:
            _require(cfg.seq % self.tp == 0, "seq", cfg.seq,
                     f"must be divisible by tp={self.tp} under sequence parallelism (the sequence is split over tp)")


def check_config(cfg, layout=None) -> None:
    """Refuse, in one line, a block config or layout of another type (a preset's
    name, a tuple) before its fields are read."""
    if not isinstance(cfg, BlockConfig):
        raise ValueError(f"cfg={cfg!r}: expected a BlockConfig (tpfuser.preset(name) or BlockConfig(...)), "
                         f"got {type(cfg).__name__}")
    if layout is not None and not isinstance(layout, Layout):
        raise ValueError(f"layout={layout!r}: expected a Layout (Layout(dp, tp, sp)), got {type(layout).__name__}")


def check_flags(**flags) -> None:
    """Refuse a flag that is not a bool ("no" or 1 is not taken for True or False), naming it."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: expected True or False, got {article(value)}")
