"""Dropout masks that do not depend on the sharding.

An element is kept when a hash of (stream key, global position) falls below
(1 - p) * 2**32. The position is the element's index in the global (unsharded)
tensor, so a rank that holds a slice of the tensor draws exactly that slice of
the mask an unsharded run draws, under any dp x tp mesh and with or without
sequence parallelism. No state is carried from call to call: the key is a hash
of (seed, offset, stream) made on the host, the same on every rank.

philox (nvFuser's `uniform`) cannot give this: its counter is the element's
index in the rank's local tensor, so every shard would draw the first shard's
numbers (and dp ranks the same masks).

The hash is `lowbias32` (Chris Wellons' hash-prospector: xorshift-multiply,
two rounds, bias 0.17), applied twice with the key mixed in before each round,
on 32-bit values held in int64 (nvFuser's integer type). Multiplying two
32-bit values would overflow int64, so `_mul32` multiplies by the constant's
two 16-bit halves (a Python int, which cannot overflow, takes plain arithmetic:
`_mix32_int`, tested equal). Operations whose `wide` is true hold a 64-bit
product of two 32-bit values exactly (nvFuser's UInt64, ops.int_ops): one
multiplication there. The one algorithm below runs on Python ints (the host's
keys), on torch int64 tensors (the oracle the tests compare the fusion with),
and, through ops.int_ops's adapter, on nvFuser TensorViews: all three use only
xor, and, shifts, add and multiplication by a constant.
"""

from __future__ import annotations

import math
import operator
from types import SimpleNamespace

import torch

M32 = 0xFFFFFFFF
MUL1, MUL2 = 0x7FEB352D, 0x846CA68B
STREAMS = {"resid_attn": 0, "resid_mlp": 1, "attn": 2}

# Python ints and torch int64 tensors share the operators (not wide: int64 cannot hold a product of two 32-bit values).
PLAIN_OPS = SimpleNamespace(xor=operator.xor, band=operator.and_, shr=operator.rshift, shl=operator.lshift,
                            add=operator.add, mul=operator.mul, wide=False)


def _mul32(x, c: int, ops):
    """(x * c) mod 2**32 for 0 <= x < 2**32 without leaving int64: every partial product is below 2**49
    (wide operations: the whole product, below 2**64, held exactly)."""
    if ops.wide:
        return ops.band(ops.mul(x, c), M32)
    low = ops.mul(x, c & 0xFFFF)
    high = ops.shl(ops.band(ops.mul(x, c >> 16), 0xFFFF), 16)
    return ops.band(ops.add(low, high), M32)


def mix32(x, ops=PLAIN_OPS):
    """lowbias32 of 0 <= x < 2**32: a bijection of 32-bit values with good avalanche."""
    if type(x) is int and ops is PLAIN_OPS:   # the host's keys: Python ints multiply exactly, no halves needed
        return _mix32_int(x)
    x = ops.xor(x, ops.shr(x, 16))
    x = _mul32(x, MUL1, ops)
    x = ops.xor(x, ops.shr(x, 15))
    x = _mul32(x, MUL2, ops)
    return ops.xor(x, ops.shr(x, 16))


def _mix32_int(x: int) -> int:
    """mix32 on one Python int, the same function in plain arithmetic (a key
    is 30 rounds a call: the generic path's 16-bit halves cost more than the call)."""
    x ^= x >> 16
    x = (x * MUL1) & M32
    x ^= x >> 15
    x = (x * MUL2) & M32
    return x ^ (x >> 16)


def hash_positions(index, key: int | object, ops=PLAIN_OPS):
    """32-bit hash of global positions (int64 >= 0) under a 62-bit key
    (low 32 bits mixed in before the first round, high 30 bits before the second)."""
    if ops.wide:
        index, key = ops.unsigned(index), ops.unsigned(key)
    k_low, k_high = ops.band(key, M32), ops.shr(key, 32)
    first = mix32(ops.xor(ops.band(index, M32), k_low), ops)
    return mix32(ops.xor(ops.xor(first, ops.shr(index, 32)), k_high), ops)


def check_rng(name: str, value) -> None:
    """Refuse a seed or offset that is not an int in [0, 2**64), naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise ValueError(f"{name}={value!r}: must be an int in [0, 2**64)")


def stream_key(seed: int, offset: int, stream: str) -> int:
    """The key of one dropout stream of one call: 62 bits from (seed, offset, stream)."""
    check_rng("rng_seed", seed)
    check_rng("rng_offset", offset)
    words = [seed & M32, seed >> 32, offset & M32, offset >> 32, STREAMS[stream]]
    low = high = 0x9E3779B9
    for w in words:
        low = mix32(low ^ w)
        high = mix32(high ^ low ^ 0x85EBCA6B)
    return (high & 0x3FFFFFFF) << 32 | low


def keep_threshold(p: float) -> int:
    """Keep an element when its hash is below this: probability (1 - p), to 2**-32."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p={p}: must be in [0, 1)")
    return round((1.0 - p) * (1 << 32))


def global_index(shape, starts, global_shape, device=None) -> torch.Tensor:
    """int64 index, in the global tensor, of every element of the slice of
    `shape` that begins at `starts` (the global tensor is `global_shape`, row-major)."""
    index = torch.zeros(shape, dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        ar = torch.arange(starts[dim], starts[dim] + shape[dim], dtype=torch.int64, device=device)
        index += (ar * stride).view([-1 if d == dim else 1 for d in range(len(shape))])
        stride *= global_shape[dim]
    return index


def keep_mask(key: int, p: float, shape, starts=None, global_shape=None, device=None) -> torch.Tensor:
    """The keep-mask (bool) of a slice (all of it by default), computed with torch: the oracle."""
    starts = starts or [0] * len(shape)
    global_shape = global_shape or shape
    if math.prod(global_shape) >= 1 << 62:
        raise ValueError(f"{global_shape}: too many elements for 62-bit positions")
    return hash_positions(global_index(shape, starts, global_shape, device), key) < keep_threshold(p)


def flash_seed(seed: int, offset: int, dp_rank: int, tp_rank: int) -> int:
    """The philox seed of flash attention's dropout (bf16) on one rank, for one call.

    Flash attention draws its mask from ATen's CUDA generator, indexed by the
    rank's local (batch, head, row, column): two tp ranks holding different
    heads, or two dp ranks holding different rows, would draw the same mask
    from the same seed. Megatron-LM gives each tensor-parallel rank its own
    stream for this (its model-parallel RNG tracker); here the seed is a hash
    of (seed, offset, dp rank, tp rank), so that any process can replay any
    rank's mask (check.py does) and no state is carried between calls.
    """
    key = stream_key(seed, offset, "attn")
    return mix32(mix32(key & M32 ^ dp_rank) ^ tp_rank) << 31 | (key >> 32) & 0x7FFFFFFF
