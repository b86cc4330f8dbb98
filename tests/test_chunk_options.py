"""A chunked linear's fusions run with the schedule's nvFuser options for the
piece they stand for, as an unchunked piece does (runtime/chunked.py). CPU:
the chunk fusion and CUDA's streams faked."""
import contextlib

import torch

from tpfuser.block.tensors import PARAM_NAMES
from tpfuser.config import Layout, preset
from tpfuser.parallel.schedules import SCHEDULES
from tpfuser.runtime import chunked
from tpfuser.runtime.block import ShardedBlock


class _Stream:
    def wait_stream(self, other):
        pass


def test_each_chunk_runs_with_the_schedules_options(monkeypatch):
    schedule = SCHEDULES["megatron-overlap"].replace(disable_options=("infer_contiguity",))
    block = ShardedBlock(preset("tiny", dtype="fp32"), Layout(1, 2), device=torch.device("cpu"), schedule=schedule)
    run = block.pass_of("forward")
    found = [(piece, block.chunked.runner(run, piece)) for piece in run.pieces]
    found = [(piece, r) for piece, r in found if isinstance(r, chunked.SideStreamChunks)]
    assert found, "megatron-overlap chunks no linear of the forward"
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(block.chunked, "streams", lambda: [_Stream()])
    for piece, runner in found:
        calls = []

        class Fake:   # the chunk's fusion: a zero output of the chunk's rows
            def execute(self, inputs, **options):
                calls.append(options)
                return [torch.zeros(*inputs[0].shape[:-1], inputs[1].shape[0])]
        runner._fd = Fake()
        act = (block.cfg.batch, block.cfg.seq, 4 * block.cfg.n_embd // 2)   # any rank-local activation will do
        runner([torch.zeros(*block.local_param_shape(n)) if n in PARAM_NAMES else torch.zeros(*act)
                for n in piece.inputs])
        assert len(calls) == runner.chunks > 1
        assert all(c == block._piece_options(run, piece) for c in calls)
        assert all("infer_contiguity" in c["_disable_options"] for c in calls)
