"""Dropout masks that do not depend on the sharding (tpfuser/block/dropout.py):
the hash, its statistics, and that every rank's slice assembles into the
unsharded mask, with the very scalars the runtime passes to the fusion."""
import math
import random

import pytest
import torch

from tpfuser.config import Layout, preset
from tpfuser.block.dropout import M32, STREAMS, keep_mask, keep_threshold, mix32, stream_key
from tpfuser.parallel.placements import local_shape, placements
from tpfuser.runtime.block import MASKED, dropout_scalars, mask_shape
from tpfuser.parallel.shard import gather


def lowbias32(x):
    """The published hash (its constants written here, not imported), plainly with Python's big ints."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def test_mix32_is_lowbias32_on_ints_and_int64_tensors():
    rng = random.Random(0)
    xs = [0, 1, 2, 0xFFFF, 0x10000, M32] + [rng.getrandbits(32) for _ in range(2000)]
    assert [mix32(x) for x in xs] == [lowbias32(x) for x in xs]
    assert mix32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]


def test_stream_keys_differ_and_bad_seeds_are_refused():
    keys = {stream_key(seed, offset, s) for seed in (0, 1, 2**40) for offset in range(20) for s in STREAMS}
    assert len(keys) == 3 * 20 * len(STREAMS) and max(keys) < 2**62
    with pytest.raises(ValueError, match=r"rng_offset=-1: must be an int in \[0, 2\*\*64\)"):
        stream_key(0, -1, "attn")
    with pytest.raises(ValueError, match="rng_seed=1.5"):
        stream_key(1.5, 0, "attn")
    with pytest.raises(ValueError, match="dropout p=1.0"):
        keep_threshold(1.0)


def test_keep_rate_and_no_correlation_between_neighbours():
    """2**20 draws: the keep rate and the lag-1 correlations (along the last and
    the first dimension, and between two streams at the same position) within
    5 standard deviations of independent Bernoulli(0.9) draws."""
    p, shape = 0.1, (64, 128, 128)
    n = math.prod(shape)
    a = keep_mask(stream_key(1234, 0, "resid_attn"), p, shape).double()
    b = keep_mask(stream_key(1234, 0, "resid_mlp"), p, shape).double()
    c = keep_mask(stream_key(1234, 1, "resid_attn"), p, shape).double()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(a.mean().item() - (1 - p)) < 5 * sigma

    def corr(u, v):
        u, v = u.flatten() - u.mean(), v.flatten() - v.mean()
        return (u @ v / (u.norm() * v.norm())).item()
    for u, v, what in ((a[..., 1:], a[..., :-1], "last dim"), (a[1:], a[:-1], "first dim"),
                       (a, b, "two streams"), (a, c, "two offsets")):
        assert abs(corr(u, v)) < 5 / math.sqrt(u.numel()), what


def rank_masks(cfg, layout, stream, seed=7, offset=3):
    """Every rank's mask, drawn on its local shape from the scalars the runtime gives its fusion."""
    from tpfuser.block.inputs import MASK_STARTS
    shape, placement = mask_shape(cfg, stream), placements(layout)[MASKED[stream]]
    masks = []
    for rank in range(layout.world_size):
        scalars = dropout_scalars(cfg, layout, rank, seed, offset)
        starts = [scalars[name] if name else 0 for name in MASK_STARTS[stream]]
        masks.append(keep_mask(scalars[f"key.{stream}"], cfg.dropout, local_shape(shape, placement, layout),
                               starts, shape))
    return masks, placement


@pytest.mark.parametrize("layout", [Layout(1, 4), Layout(1, 4, sp=True), Layout(2, 4), Layout(2, 4, sp=True)],
                         ids=["1x4", "1x4sp", "2x4", "2x4sp"])
@pytest.mark.parametrize("stream", list(STREAMS))
def test_rank_masks_assemble_into_the_unsharded_mask(layout, stream):
    cfg = preset("tiny", dtype="fp32")
    masks, placement = rank_masks(cfg, layout, stream)
    unsharded = rank_masks(cfg, Layout(1, 1), stream)[0][0]
    assert torch.equal(gather(masks, placement, layout), unsharded)


def test_local_positions_would_not_assemble():
    """The negative control: drawing on local positions (as philox does) gives
    every tp rank of SP the first rank's slice, not the unsharded mask."""
    cfg, layout = preset("tiny", dtype="fp32"), Layout(1, 4, sp=True)
    shape, placement = mask_shape(cfg, "resid_attn"), placements(layout)[MASKED["resid_attn"]]
    local = local_shape(shape, placement, layout)
    key = stream_key(7, 3, "resid_attn")
    masks = [keep_mask(key, cfg.dropout, local) for _ in range(layout.world_size)]
    assert not torch.equal(gather(masks, placement, layout), keep_mask(key, cfg.dropout, shape))


def test_dropout_scalars_of_a_rank():
    cfg = preset("tiny", dtype="fp32")   # b 4, s 16, h 8
    tp = dropout_scalars(cfg, Layout(2, 4), 6, 0, 0)   # dp rank 1, tp rank 2
    sp = dropout_scalars(cfg, Layout(2, 4, sp=True), 6, 0, 0)
    assert (tp["start.batch"], tp["start.seq"], tp["start.head"]) == (2, 0, 4)
    assert (sp["start.batch"], sp["start.seq"], sp["start.head"]) == (2, 8, 4)
    assert tp["key.attn"] == sp["key.attn"] == stream_key(0, 0, "attn")


def test_flash_seed_is_a_stream_per_rank_and_call():
    from tpfuser.block.dropout import flash_seed
    seeds = {flash_seed(s, o, d, t) for s in (0, 1) for o in (0, 1, 2) for d in range(2) for t in range(8)}
    assert len(seeds) == 2 * 3 * 2 * 8                       # every (seed, offset, dp rank, tp rank) its own
    assert all(0 <= x < 2 ** 63 for x in seeds)              # a valid torch generator seed
    assert flash_seed(5, 7, 1, 3) == 8481850171017610917     # no state: any process, any day, replays it


def test_the_hosts_int_hash_is_the_fusions_hash():
    """mix32 on a Python int takes plain arithmetic (tools/probes/host_overhead.py: the
    keys were most of a call's host time); the torch path, which the fusion's
    nvFuser ops mirror, must give the same 32-bit values."""
    from tpfuser.block.dropout import mix32
    g = torch.Generator().manual_seed(5)
    values = torch.cat([torch.randint(0, 2**32, (4000,), generator=g, dtype=torch.int64),
                        torch.tensor([0, 1, 2**16 - 1, 2**16, 2**31 - 1, 2**31, 2**32 - 1])])
    assert [mix32(int(v)) for v in values] == mix32(values).tolist()
    assert all(type(mix32(int(v))) is int and 0 <= mix32(int(v)) < 2**32 for v in values[-7:])


def test_a_block_hands_its_fusion_the_ranks_own_starts_and_this_calls_keys():
    """What a block made once at construction (the mask starts) and per call
    (the keys) reaches the fusion as the fusion names them: dp rank 1, tp rank 2
    of 2x4 starts at batch 2, head 4 (and sequence 8 under SP), by hand."""
    from tpfuser.block.inputs import rng_input_names
    from tpfuser.runtime.block import ShardedBlock
    cfg = preset("tiny", dtype="fp32")
    for layout, seq in ((Layout(2, 4), 0), (Layout(2, 4, sp=True), 8)):
        block = ShardedBlock(cfg, layout, 6, device=torch.device("cpu"))
        inputs = block.rng_inputs(3, 9)   # by name, in the fusions' order
        assert list(inputs) == rng_input_names(cfg)
        assert (inputs["start.batch"], inputs["start.seq"], inputs["start.head"]) == (2, seq, 4)
        later = block.rng_inputs(3, 10)
        assert list(later) == rng_input_names(cfg)
        assert inputs["key.resid_mlp"] == stream_key(3, 9, "resid_mlp") != later["key.resid_mlp"]
        assert later["start.head"] == 4                          # the starts do not move from call to call


def test_the_wide_hash_is_the_halves_hash():
    """hash_ints "uint64": operations that hold a 64-bit product (`wide`, here
    Python ints wrapped to 64 bits as UInt64 wraps) multiply each 32-bit value
    once; the hash must be the int64 tensors' one (16-bit halves), bit for bit,
    keys of 62 bits and positions past 2**32 included."""
    from types import SimpleNamespace
    from tpfuser.block.dropout import PLAIN_OPS, hash_positions
    u64 = 2**64 - 1
    wide = SimpleNamespace(**{**vars(PLAIN_OPS), "wide": True, "unsigned": lambda v: v & u64,
                              "mul": lambda a, b: (a * b) & u64})
    g = torch.Generator().manual_seed(7)
    index = torch.cat([torch.randint(0, 2**40, (3000,), generator=g, dtype=torch.int64),
                       torch.tensor([0, 1, 2**32 - 1, 2**32, 2**40 - 1])])
    for key in (0, 1, stream_key(3, 9, "resid_attn"), 2**62 - 1):
        halves = hash_positions(index, torch.tensor(key)).tolist()
        assert [hash_positions(int(i), key, wide) for i in index] == halves


def test_uint64_masks_multiply_once_where_int64_masks_multiply_by_halves():
    """The fusions' keep-masks under hash_ints (Form.hash_ints): int64 multiplies
    by each constant's 16-bit halves (4 products a round), uint64 by the
    constant whole (2 a round) with every hash value UInt64; the default
    schedule hashes in int64 (its fusions, and their digests, unchanged)."""
    from tpfuser.block.dropout import MUL1, MUL2
    from tpfuser.parallel.passes import build_forward
    from tpfuser.parallel.schedules import SCHEDULES, default_schedule
    cfg = preset("tiny", dtype="bf16")
    assert default_schedule(Layout(1, 2)).hash_ints == "int64"
    halves = {str(c & 0xFFFF) for c in (MUL1, MUL2)} | {str(c >> 16) for c in (MUL1, MUL2)}
    for hash_ints, constants, products in (("int64", halves, 8), ("uint64", {str(MUL1), str(MUL2)}, 4)):
        schedule = SCHEDULES["megatron-cut-linears"].replace(hash_ints=hash_ints)
        mask = build_forward(cfg, Layout(1, 2), schedule=schedule).pieces[0].fd.fusion.print_math()
        lines = mask.split("%kernel_math {")[1].splitlines()
        multiplied = [lines[i + 1].strip().lstrip("* ").rstrip(";") for i, line in enumerate(lines[:-1])
                      if line.strip().startswith("=") and lines[i + 1].strip().startswith("* ")]
        assert sorted(c for c in multiplied if c in constants) == sorted(2 * list(constants)) and \
            sum(c in constants for c in multiplied) == products
        assert ("uint64_t" in mask) == (hash_ints == "uint64") and mask.count("__to_uint64") == 2 * (hash_ints == "uint64")
