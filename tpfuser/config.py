"""Block and layout configuration: frozen, validated where built, with presets.

Dimension letters used throughout the code (see README's glossary):
  b batch, s sequence, e n_embd (hidden), h n_head, d head dim (= e / h),
  f MLP hidden (= 4 e), dp / tp the mesh sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _require(ok: bool, what: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"{what}={value!r}: {rule}")


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
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                     name, value, "must be a positive int")
        _require(self.n_embd % self.n_head == 0, "n_embd", self.n_embd,
                 f"must be divisible by n_head={self.n_head}")
        _require(isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0,
                 "dropout", self.dropout, "must be in [0, 1)")
        _require(self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {sorted(DTYPES)}")
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
    if name not in PRESETS:
        raise ValueError(f"preset={name!r}: must be one of {sorted(PRESETS)}")
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
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                     name, value, "must be a positive int")
        _require(isinstance(self.sp, bool), "sp", self.sp, "must be a bool")


    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def rank_coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of a global rank; the mesh is arange(dp*tp).reshape(dp, tp)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank}: must be in [0, {self.world_size}) for mesh {self.dp}x{self.tp}")
        return divmod(rank, self.tp)

    def check(self, cfg: BlockConfig) -> None:
        """Raise a ValueError naming the field when cfg cannot be sharded on this mesh."""
        _require(cfg.n_head % self.tp == 0, "n_head", cfg.n_head,
                 f"must be divisible by tp={self.tp} (each tp rank takes whole heads)")
        _require((4 * cfg.n_embd) % self.tp == 0, "4*n_embd", 4 * cfg.n_embd,
                 f"must be divisible by tp={self.tp} (the MLP hidden is split over tp)")
        _require(cfg.batch % self.dp == 0, "batch", cfg.batch,
                 f"must be divisible by dp={self.dp} (the batch is split over dp)")
        if self.sp:
            _require(cfg.seq % self.tp == 0, "seq", cfg.seq,
                     f"must be divisible by tp={self.tp} under sequence parallelism (the sequence is split over tp)")
