"""The keep-masks' fusions as nvFuser is given them (their printed definition,
`str(fd)`), executed on the CPU by a stand-in for nvFuser's ops in numpy, with
nvFuser's integer types and no promotion between them: each mask must equal
the oracle's (block/dropout.keep_mask, torch int64) bit for bit, in either
integer form of the hash (Form.hash_ints), keys on the host or on the
device, a rank's slice starting anywhere. What this cannot see is nvFuser's
code generation: the GPU's check compares the masks it draws."""
import numpy as np
import pytest

from tpfuser.block.dropout import keep_mask, stream_key
from tpfuser.block.inputs import MASK_STARTS
from tpfuser.block.tensors import MASKS
from tpfuser.config import Layout, preset
from tpfuser.parallel.passes import build_forward
from tpfuser.parallel.schedules import SCHEDULES

NP = {"DataType.Int": np.int64, "DataType.UInt64": np.uint64, "DataType.Bool": np.bool_}


class _DataType:   # DataType.X in the printed definition, as the numpy type
    def __getattr__(self, name):
        return NP[f"DataType.{name}"]


class _Ops:
    """nvFuser's ops that the masks' fusions use, on numpy values of one integer type each."""

    @staticmethod
    def _same(a, b):
        """Operands of one type: a Python literal takes the other's; two types are refused."""
        if isinstance(b, int):
            b = a.dtype.type(b)
        if isinstance(a, int):
            a = b.dtype.type(a)
        if np.asarray(a).dtype != np.asarray(b).dtype:
            raise TypeError(f"{np.asarray(a).dtype} with {np.asarray(b).dtype}: nvFuser promotes neither")
        return a, b

    def _binary(fn):
        return staticmethod(lambda a, b: fn(*_Ops._same(a, b)))

    add, mul = _binary(np.add), _binary(np.multiply)
    bitwise_and, bitwise_xor = _binary(np.bitwise_and), _binary(np.bitwise_xor)
    bitwise_right_shift, bitwise_left_shift = _binary(np.right_shift), _binary(np.left_shift)
    lt = _binary(np.less)

    @staticmethod
    def iota(length, start, step):
        return np.int64(start) + np.arange(length, dtype=np.int64) * np.int64(step)

    @staticmethod
    def broadcast(t, is_broadcast_dim):
        return t.reshape([1 if b else -1 for b in is_broadcast_dim])

    @staticmethod
    def expand(t, shape):
        return np.broadcast_to(t, shape)

    @staticmethod
    def cast(t, dtype):
        if np.any(np.asarray(t) < 0):
            raise ValueError("a negative value cast")
        return np.asarray(t).astype(dtype)[()] if np.ndim(t) == 0 else t.astype(dtype)


class _Fd:
    """fd as the printed definition calls it: inputs in order from `values`."""

    def __init__(self, values):
        self.ops, self.values, self.outputs = _Ops(), list(values), []

    def define_scalar(self, value, dtype):
        return dtype(self.values.pop(0) if value is None else value)

    def define_tensor(self, shape, contiguity, dtype, is_cpu=False, **_):
        assert shape == [] and dtype is np.int64   # a key on the device: a 0-d int64 tensor
        return np.int64(self.values.pop(0))

    def add_output(self, t):
        self.outputs.append(t)


def run_printed(fd, values):
    """Execute a fusion's printed definition on `values` (its inputs, in order); its outputs."""
    scope = {"DataType": _DataType(), "FusionDefinition": object}
    exec(str(fd), scope)
    stand_in = _Fd(values)
    scope["nvfuser_fusion"](stand_in)
    assert not stand_in.values, f"inputs left unread: {stand_in.values}"
    return stand_in.outputs


@pytest.mark.parametrize("hash_ints", ["int64", "uint64"])
@pytest.mark.parametrize("keys_on_device", [False, True])
def test_the_masks_fusions_draw_the_oracles_masks(hash_ints, keys_on_device):
    cfg = preset("tiny", dtype="fp32")   # fp32: the attention's mask drawn too (4-d, starts on heads)
    schedule = SCHEDULES["megatron-sp-cut-linears"].replace(hash_ints=hash_ints, keys_on_device=keys_on_device)
    masks = [piece for piece in build_forward(cfg, Layout(2, 2, sp=True), schedule=schedule).pieces
             if all(name.endswith("_keep") for name in piece.outputs)]
    streams = {mask.name: stream for stream, mask in MASKS.items()}
    assert sorted(name for piece in masks for name in piece.outputs) == sorted(streams)
    starts = {"start.batch": 2, "start.seq": 8, "start.head": 4}   # where this rank's slice begins
    for seed, offset in ((0, 0), (3, 9), (2**64 - 1, 2**40)):
        for piece in masks:
            (stream,) = (streams[name] for name in piece.outputs)
            key = stream_key(seed, offset, stream)
            (got,) = run_printed(piece.fd, [key if name.startswith("key.") else starts[name] for name in piece.inputs])
            shape = MASKS[stream].shape(cfg)
            at = [starts[name] if name else 0 for name in MASK_STARTS[stream]]
            assert np.array_equal(np.asarray(got), keep_mask(key, cfg.dropout, shape, at, shape).numpy()), \
                (stream, seed, offset)
