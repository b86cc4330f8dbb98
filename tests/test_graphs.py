"""CUDA-graph mode without a GPU: the device-key fusions, the keys the block
writes, and the refusals (tests/test_gpu_graphs.py replays on a GPU)."""
import pytest
import torch

from tpfuser.config import Layout, preset
from tpfuser.parallel.passes import build_forward
from tpfuser.block.inputs import rng_input_names
from tpfuser.parallel.schedules import SCHEDULES
from tpfuser.runtime.block import ShardedBlock, dropout_scalars

DEVICE_KEYS = SCHEDULES["megatron"].replace(keys_on_device=True)   # was ShardedBlock(keys_on_device=True)


def device_keys(built):
    """The dropout keys the pass's fusions take, by name (was ForwardFusion.device_keys)."""
    return {name: tv for piece in built.pieces for name, tv in piece.inputs.items() if name.startswith("key.")}


@pytest.mark.parametrize("dtype, keys", [("fp32", 3), ("bf16", 2)])
def test_device_keys_are_replicated_0d_int64_inputs(dtype, keys):
    """Under the default schedule (the masks' own fusion takes the keys) and
    its single-fusion form; the xors counted over all the pass's fusions."""
    cfg = preset("tiny", dtype=dtype)
    for schedule in (SCHEDULES["megatron"], SCHEDULES["megatron-whole"]):
        ff = build_forward(cfg, Layout(2, 2), train=True, schedule=schedule.replace(keys_on_device=True))
        keyed = device_keys(ff)
        assert list(keyed) == [n for n in rng_input_names(cfg) if n.startswith("key.")] and len(keyed) == keys
        for tv in keyed.values():
            assert "int64_t[]" in str(tv) and "DeviceMesh{{0 1}{2 3}}" in str(tv)   # 0-d, on the mesh, not split
        # the same hash as the host-key fusion (its xors print as ^): only the keys' kind of input differs
        host_pass = build_forward(cfg, Layout(2, 2), train=True, schedule=schedule)
        assert not any(tv.is_tensor() for tv in device_keys(host_pass).values())   # host scalars there
        assert ff.text().count(" ^ ") == host_pass.text().count(" ^ ") == 9 * keys


def test_block_writes_its_keys_and_passes_views():
    cfg = preset("tiny", dtype="fp32")
    block = ShardedBlock(cfg, Layout(1, 2), rank=1, device=torch.device("cpu"), schedule=DEVICE_KEYS)
    inputs = block.rng_inputs(7, 3)   # by name
    names = rng_input_names(cfg)
    assert list(inputs) == names
    inputs = list(inputs.values())
    values = dropout_scalars(cfg, Layout(1, 2), 1, 7, 3)
    for name, got in zip(names, inputs):
        if name.startswith("key."):
            assert isinstance(got, torch.Tensor) and got.dim() == 0 and got.item() == values[name]
        else:
            assert got == values[name]   # the rank's slice starts stay host scalars
    kept = [t for t in inputs if isinstance(t, torch.Tensor)]
    block.rng_inputs(7, 4, write_keys=False)   # as under capture: the tensor is left as it was
    assert [t.item() for t in kept] == [values[n] for n in names if n.startswith("key.")]
    block.rng_inputs(7, 4)
    assert [t.item() for t in kept] != [values[n] for n in names if n.startswith("key.")]   # the same views, new keys


def test_no_device_keys_without_dropout():
    block = ShardedBlock(preset("tiny", dropout=0.0), device=torch.device("cpu"), schedule=DEVICE_KEYS)
    assert not block.keys_on_device and block.rng_inputs(1, 2) == {}


def test_capture_with_host_keys_and_dropout_is_refused(monkeypatch):
    import tpfuser.runtime.block as runtime
    block = ShardedBlock(preset("tiny"), device=torch.device("cpu"))
    monkeypatch.setattr(runtime, "capturing", lambda: True)
    monkeypatch.setattr(block, "validate_input", lambda name, t: None)   # a CPU tensor, not a CUDA one
    with pytest.raises(ValueError, match=r"needs a schedule with keys_on_device=true"):
        block(torch.zeros(1), 0, 0, params=[])


def test_graphs_refuse_without_cuda_or_device_keys(monkeypatch):
    from tpfuser.runtime.graphs import GraphedForward
    block = ShardedBlock(preset("tiny"), device=torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
            GraphedForward(block)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"dropout=0.1: a graph needs the dropout keys on the device "
                                         r"\(a schedule with keys_on_device=true\)"):
        GraphedForward(block)


class _NoGraph:
    def replay(self):
        pass


def test_graphed_training_refuses_a_backward_whose_activations_were_overwritten(monkeypatch):
    """The graphs hold one step's activations: the backward of a forward that a
    later forward overwrote is refused; the last forward's backward runs."""
    from tpfuser.runtime.graphs import GraphedTraining
    cfg = preset("tiny", dtype="fp32", dropout=0.0)
    runner = ShardedBlock(cfg, device=torch.device("cpu"))   # before CUDA is faked: it describes no world
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    runner._params = []   # no parameters to check: the stand-in graphs read none
    monkeypatch.setattr(runner, "validate_input", lambda name, t: None)
    graphed = GraphedTraining(runner)
    graphed.graph, graphed.backward_graph, graphed._param_ptrs = _NoGraph(), _NoGraph(), []
    graphed.out, graphed.grad_x, graphed.grads = torch.zeros(1), torch.zeros(1), []
    x = torch.zeros(runner.input_shape())
    _, first = graphed.forward(x, 0, 0)
    _, second = graphed.forward(x, 0, 1)   # e.g. a forward under no_grad, or an abandoned step
    with pytest.raises(RuntimeError, match=r"this backward's forward \(step 1\) was overwritten by a later forward \(step 2\)"):
        graphed.backward(x, first)
    graphed.backward(x, second)
    graphed.backward(x, second)   # again (retain_graph): the same activations
    with pytest.raises(ValueError, match="parameters were replaced since the graph was captured"):
        graphed.forward(x, 0, 2, params=[torch.zeros(1)])   # the module's shards, replaced


def test_tp_block_graphs_need_cuda():
    from tpfuser.runtime.module import TPBlock
    model = TPBlock(preset("tiny"), device=torch.device("cpu"), graphs=True)
    assert model.runner.keys_on_device
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
            model(torch.zeros(4, 16, 64))


def test_graphed_training_steps_refuse_dp_without_a_group(monkeypatch):
    """With dp > 1 the gradients are summed over dp: no group is refused when the graph is made."""
    from tpfuser.runtime.graphs import GraphedTraining, GraphedTrainStep
    block = ShardedBlock(preset("tiny", dropout=0.0), Layout(2, 1), device=torch.device("cpu"))   # before CUDA is faked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for graphed in (GraphedTrainStep, GraphedTraining):
        with pytest.raises(ValueError, match=r"dp=2: the gradients are summed over dp; build the block"):
            graphed(block)


def test_cublas_workspaces_are_dropped_after_the_warm_up_and_after_each_capture(monkeypatch):
    """On an H200 (docs/history.md) nvFuser's graph held 360 MiB,
    its pool 326: the rest, we expect, is cuBLAS's workspace for the warm-up's
    side stream (32 MiB on Hopper), kept beside the one the capture makes in
    the pool. The order of the calls around a capture, with CUDA faked (CPU)."""
    import contextlib

    import tpfuser.runtime.graphs as graphs
    calls = []

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def pool(self):
            return None

        def replay(self):
            calls.append("replay")

    @contextlib.contextmanager
    def capture(graph, pool=None):
        calls.append("capture")
        yield
        calls.append("captured")
    for name, value in {"Stream": Stream, "current_stream": Stream, "stream": lambda s: contextlib.nullcontext(),
                        "synchronize": lambda *a: None, "empty_cache": lambda: calls.append("empty_cache"),
                        "CUDAGraph": Graph, "graph": capture, "memory_reserved": lambda *a: 0}.items():
        monkeypatch.setattr(torch.cuda, name, value, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("clear"), raising=False)

    graphs.warm_up(lambda: calls.append("body"), times=2)
    assert calls == ["body", "body", "clear", "empty_cache"]

    calls.clear()
    fake = graphs._Graphed.__new__(graphs._Graphed)
    fake._prepare_capture = lambda seed, offset, body: (body(), 0)[1]
    fake.block = type("B", (), {"device": None})()
    assert fake._capture(0, 0, lambda: calls.append("body") or "held") == "held"
    assert calls == ["body", "capture", "body", "captured", "clear"]

    # the training's two graphs share a pool: a clear after each capture
    calls.clear()
    training = graphs.GraphedTraining.__new__(graphs.GraphedTraining)
    training.x = training.grad_out = None
    training._prepare_capture = lambda seed, offset, body: (body(), 0)[1]
    training.block = type("B", (), {"device": None,
                                    "forward_train": lambda *a: calls.append("fwd") or ({"out": 1}, "saved"),
                                    "backward": lambda *a, **k: calls.append("bwd") or (2, [3])})()
    training._capture_both(0, 0)
    assert calls == ["fwd", "bwd", "capture", "fwd", "captured", "clear", "capture", "bwd", "captured", "clear"]
    assert (training.out, training.saved, training.grad_x, training.grads) == (1, "saved", 2, [3])

    # eager captured by hand (bench's eager-graph): warmed up, captured, cleared
    from tpfuser.bench.impls import graphed_callable
    calls.clear()
    graphed_callable(lambda: calls.append("body"))()
    assert calls == ["body"] * 3 + ["clear", "empty_cache", "capture", "body", "captured", "clear", "replay"]

    # bench's memory measure: cuBLAS's workspaces cleared and the cache emptied before the steps
    from tpfuser.bench.impls import _warm_then_memory
    for name in ("reset_peak_memory_stats", "memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: 0)
    calls.clear()
    assert _warm_then_memory(lambda: calls.append("step")) == {"peak_mib_above_baseline": 0.0, "reserved_mib": 0.0}
    assert calls == ["clear", "empty_cache"] + ["step"] * 4
