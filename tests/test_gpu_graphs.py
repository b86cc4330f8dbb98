"""CUDA graphs on the 1x1 mesh (marked gpu: skipped where no CUDA device exists).
A replay must equal a called block with the same (seed, offset) bit for bit,
and two offsets must draw different masks."""
import pytest
import torch

pytestmark = pytest.mark.gpu

from tpfuser.config import preset  # noqa: E402
from tpfuser.config import Layout  # noqa: E402
from tpfuser.parallel.schedules import default_schedule  # noqa: E402
from tpfuser.verify.reference import make_block, make_input  # noqa: E402

DEVICE_KEYS = default_schedule(Layout()).replace(keys_on_device=True)   # was ShardedBlock(keys_on_device=True)


@pytest.fixture(autouse=True)
def _full_precision(no_tf32):
    pass


def blocks(cfg):
    """A called block with host keys, one with device keys, and the latter's graphed forward."""
    from tpfuser.runtime.graphs import GraphedForward
    from tpfuser.runtime.block import ShardedBlock
    state = make_block(cfg).state_dict()
    host = ShardedBlock(cfg, check=True).load(state)
    device = ShardedBlock(cfg, check=True, schedule=DEVICE_KEYS).load(state)
    return host, device, GraphedForward(device)


def cloned(outputs):
    return {k: v.clone() for k, v in outputs.items()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["p0", "p0.1"])
def test_forward_replay_equals_the_called_block(dtype, dropout, record):
    cfg = preset("tiny", dtype=dtype, dropout=dropout)
    host, device, graphed = blocks(cfg)
    x = host.shard_input(make_input(cfg))
    runs = {}
    for offset in (5, 6, 5):   # 5 again: the replay after another step replays 5's masks
        called = cloned(device(x, 11, offset))   # the graph's fusions, called
        masks = [k for k in called if k != "out"]
        assert all(torch.equal(called[k], host(x, 11, offset)[k]) for k in masks)   # device keys draw host keys' masks
        replayed = cloned(graphed(x, 11, offset))
        assert called.keys() == replayed.keys()
        for name in called:
            assert torch.equal(called[name], replayed[name]), (offset, name)
        runs.setdefault(offset, replayed)
    if dropout > 0:   # the next step draws new masks, and so a new output
        for name in runs[5]:
            assert not torch.equal(runs[5][name], runs[6][name]), name
    record(dtype=dtype, dropout=dropout, pool_bytes=graphed.pool_bytes)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_train_step_replay_equals_the_called_block(dtype, record):
    from tpfuser.runtime.graphs import GraphedTrainStep
    from tpfuser.runtime.block import ShardedBlock
    cfg = preset("tiny", dtype=dtype)   # dropout 0.1
    state = make_block(cfg).state_dict()
    called = ShardedBlock(cfg, schedule=DEVICE_KEYS).load(state)   # called and graphed: the same fusions
    step = GraphedTrainStep(called)
    x = called.shard_input(make_input(cfg))
    grad_out = torch.randn_like(x)
    results = {}
    for offset in (3, 4):
        named, saved = called.forward_train(x, 2, offset)
        grad_x, grads = called.backward(grad_out, x, saved)
        out_r, grad_x_r, grads_r = step(x, grad_out, 2, offset)
        assert torch.equal(named["out"], out_r) and torch.equal(grad_x, grad_x_r), offset
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_r)), offset
        results[offset] = out_r.clone()
    assert not torch.equal(results[3], results[4])
    record(dtype=dtype, pool_bytes=step.pool_bytes)


def test_graph_sees_parameters_updated_in_place_and_refuses_replaced_ones():
    from tpfuser.runtime.graphs import GraphedForward
    from tpfuser.runtime.block import ShardedBlock
    cfg = preset("tiny", dtype="fp32", dropout=0.0)
    state = make_block(cfg).state_dict()
    block = ShardedBlock(cfg, schedule=DEVICE_KEYS).load(state)
    graphed = GraphedForward(block)
    x = block.shard_input(make_input(cfg))
    before = graphed(x)["out"].clone()
    with torch.no_grad():
        for p in block._params:
            p.mul_(0.5)
    after = graphed(x)["out"].clone()
    assert not torch.equal(before, after)
    assert torch.equal(after, block(x)["out"])
    block.load(state)
    with pytest.raises(ValueError, match="parameters were replaced since the graph was captured"):
        graphed(x)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tp_block_graphs_train_as_the_called_module(dtype):
    """Three SGD steps of TPBlock(graphs=True) against TPBlock on the same fusions
    (device keys): outputs, input and parameter gradients equal bit for bit;
    a backward whose activations a later forward overwrote is refused."""
    from tpfuser.runtime.block import ShardedBlock
    from tpfuser.runtime.module import TPBlock
    cfg = preset("tiny", dtype=dtype)
    state = make_block(cfg).state_dict()
    models = [TPBlock(cfg, graphs=g) for g in (False, True)]
    models[0].runner = ShardedBlock(cfg, schedule=DEVICE_KEYS)   # called, on the graph's fusions
    for model in models:
        model.load_full_state_dict(state)
    x = models[0].runner.shard_input(make_input(cfg))
    for step in range(3):
        results = []
        for model in models:
            xi = x.clone().requires_grad_(True)
            out = model(xi)
            out.float().pow(2).mean().backward()
            results.append((out.detach().clone(), xi.grad, [p.grad.clone() for p in model.shards]))
            with torch.no_grad():
                for p in model.shards:
                    p -= 0.1 * p.grad
                    p.grad = None
        (o0, gx0, g0), (o1, gx1, g1) = results
        assert torch.equal(o0, o1) and torch.equal(gx0, gx1), step
        assert all(torch.equal(a, b) for a, b in zip(g0, g1)), step
    xi = x.clone().requires_grad_(True)
    stale = models[1](xi)
    models[1](xi)
    with pytest.raises(RuntimeError, match="was overwritten by a later forward"):
        stale.float().sum().backward()
