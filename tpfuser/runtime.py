"""Running the sharded block: one `ShardedBlock` per rank.

    block = ShardedBlock(cfg, Layout(dp, tp), rank)
    block.load(reference_block.state_dict())      # full params; each rank keeps its shards
    out = block(block.shard_input(x))["out"]      # this rank's [b/dp, s, e]

A 1x1 mesh is the same code path. Inputs are validated before nvFuser sees
them, so a wrong shape, dtype or device is a ValueError that names the tensor.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Optional

import torch

from tpfuser.config import BlockConfig, Layout
from tpfuser.dropout import STREAMS, flash_seed, stream_key
from tpfuser.fusion import MASK_STARTS, build_backward, build_forward, enable_options, rng_input_names, saved_names
from tpfuser.plan import PARAM_PLACEMENTS, local_shape, placements
from tpfuser.reference import PARAM_NAMES, param_shapes
from tpfuser.shard import local_slice, slice_starts
from tpfuser.tensors import BY_NAME, MASKS, memory_order
from tpfuser.weights import check_finite, check_tensor, from_hf_gpt2, rank_shards
from tpfuser.world import describe_single_process, gather_output, sum_over_group

# The tensors each dropout stream masks (fusion.MASK_STARTS, plan.placements).
MASKED = {stream: mask.name for stream, mask in MASKS.items()}


def laid_out(t: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """t with its elements in memory in `order` (its dimensions outermost
    first; None: contiguous), as a backward fusion input declares it; a copy
    only where t is not so already."""
    if order is None:
        return t.contiguous()
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return t.permute(order).contiguous().permute(inverse)


def mask_shape(cfg: BlockConfig, stream: str) -> tuple[int, ...]:
    return MASKS[stream].shape(cfg)


def mask_starts(cfg: BlockConfig, layout: Layout, rank: int) -> dict[str, int]:
    """Where this rank's slice of each masked tensor begins in the global tensor,
    by the fusion's scalar names (fusion.MASK_STARTS): fixed for a rank."""
    values, where = {}, placements(layout)
    for stream in STREAMS:
        starts = slice_starts(mask_shape(cfg, stream), where[MASKED[stream]], layout, rank)
        for name, start in zip(MASK_STARTS[stream], starts):
            if name and values.setdefault(name, start) != start:
                raise AssertionError(f"{name}: {stream} starts at {start}, another mask at {values[name]}")
    return values


def dropout_scalars(cfg: BlockConfig, layout: Layout, rank: int, rng_seed: int, rng_offset: int,
                    starts: dict[str, int] | None = None) -> dict[str, int]:
    """The fusion's dropout inputs for this rank (fusion.rng_input_names): every
    stream's key, the same on all ranks (dropout.stream_key), and the mask
    starts (mask_starts, or `starts` as it gave them)."""
    keys = {f"key.{stream}": stream_key(rng_seed, rng_offset, stream) for stream in STREAMS}
    return keys | (mask_starts(cfg, layout, rank) if starts is None else starts)


@contextmanager
def seeded_cuda_generator(device: torch.device, seed: int):
    """Run the body with `device`'s default CUDA generator at (seed, offset 0);
    restore the generator's state after it."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    state = gen.get_state()
    gen.manual_seed(seed)
    try:
        yield
    finally:
        gen.set_state(state)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class ShardedBlock:
    """One rank's share of the block forward on a dp x tp mesh."""

    def __init__(self, cfg: BlockConfig, layout: Layout = Layout(), rank: int = 0, check: bool = False,
                 device: Optional[torch.device] = None, mesh: bool = True,
                 dp_group=None, check_finite: bool = False, keys_on_device: bool = False,
                 enable: tuple[str, ...] = (), split_unit_axes: bool = False):
        """mesh=False (1x1 only) builds the fusion without a device mesh: the
        same math, run by nvFuser's single-device executor (see NOTES-history.md, runs 15-18).
        dp_group: the torch.distributed group of this rank's dp replicas (world.dp_group),
        over which backward sums the parameter gradients; needed when dp > 1.
        check_finite: refuse an input (x, grad_out) holding NaN or inf; off by
        default, since reading the count back waits for the GPU on every call.
        keys_on_device: the fusions read the dropout keys from a small CUDA
        tensor this block writes before each call, not from host scalars, so
        that a captured CUDA graph draws new masks on each replay (graphs.py).
        enable: nvFuser options turned on for every call of this block's fusions
        (`_enable_options`), e.g. ("fuse_matmul",): nvFuser's own matmul kernels,
        with the pointwise work around them fused in, instead of ATen's.
        split_unit_axes=True: also split over a mesh axis of one device
        (fusion.schedule), where nvFuser then posts collectives over a team of
        one (`tpfuser check --unit-splits`); the default leaves those splits out.
        On its own (no launcher) the process describes a world of one to nvFuser
        first (world.describe_single_process): before its first fusion runs."""
        describe_single_process()
        layout.check(cfg)
        if not mesh and layout.world_size != 1:
            raise ValueError(f"mesh=False needs a 1x1 layout, got {layout.dp}x{layout.tp}")
        self.cfg, self.layout, self.rank, self.check = cfg, layout, rank, check
        self.dp_rank, self.tp_rank = layout.rank_coords(rank)
        self.device = device or torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        self._mesh_layout = layout if mesh else None
        self.keys_on_device = keys_on_device and cfg.dropout > 0
        if isinstance(enable, str):
            raise ValueError(f"enable={enable!r}: a tuple of nvFuser option names, e.g. ({enable!r},)")
        self.enable = tuple(enable)
        self._options = enable_options(self.enable)   # the forward's execute keywords, made once
        self.split_unit_axes = split_unit_axes
        self._keys = None   # the keys' CUDA tensor (keys_on_device), made at first use
        self._eval_cfg = cfg.replace(dropout=0.0) if cfg.dropout > 0 else cfg   # mode_cfg(False), made once
        # what the layout fixes, made once, not on every call
        self._placements = placements(layout)
        self._mask_starts = mask_starts(cfg, layout, rank)
        self._saved_names = {True: saved_names(cfg), False: saved_names(self._eval_cfg)}
        # how the backward takes each saved tensor in memory (tensors.memory_order), per mode
        self._saved_orders = {mode: [memory_order(BY_NAME[name], cfg) for name in names]
                              for mode, names in self._saved_names.items()}
        self._fusions = {}   # (kind, dropout): built at first use (_fusion)
        self.fusion = self._fusion("forward", True)
        self._params: Optional[list[torch.Tensor]] = None
        self.dp_group = dp_group
        self.check_finite = check_finite

    # -- parameters -------------------------------------------------------
    def load(self, state: dict[str, torch.Tensor]) -> "ShardedBlock":
        """Take a nanoGPT-style state_dict (global, blocked c_attn); keep this rank's
        shards, checked and cast by weights.rank_shards."""
        return self.load_shards([s.to(self.device) for s in rank_shards(state, self.cfg, self.layout, self.rank)])

    def load_hf_gpt2(self, state: dict[str, torch.Tensor], layer: Optional[int] = None) -> "ShardedBlock":
        """Take Hugging Face GPT-2 weights (Conv1D layout): a GPT2Block's state_dict, or
        with `layer` that layer of a GPT2LMHeadModel's (weights.from_hf_gpt2)."""
        return self.load(from_hf_gpt2(state, self.cfg, layer))

    def load_shards(self, shards: list[torch.Tensor]) -> "ShardedBlock":
        """Take this rank's shards directly (PARAM_NAMES order, fusion's qkv order),
        checked as load() checks full weights."""
        if len(shards) != len(PARAM_NAMES):
            raise ValueError(f"expected {len(PARAM_NAMES)} parameter shards ({', '.join(PARAM_NAMES)}), got {len(shards)}")
        for name, t in zip(PARAM_NAMES, shards):
            check_tensor(name, t)
        for name, t in zip(PARAM_NAMES, shards):
            self._validate(name, t, self.local_param_shape(name))
        self._params = list(shards)
        return self

    @property
    def params(self) -> Optional[list[torch.Tensor]]:
        """This rank's parameter shards as loaded (PARAM_NAMES order), or None."""
        return self._params

    def mode_cfg(self, dropout: bool = True) -> BlockConfig:
        """The block's config as a call runs it: dropout=False (nn.Module's eval
        mode) is the block with dropout 0, whose fusions draw no masks."""
        return self.cfg if dropout else self._eval_cfg

    def saved_names(self, dropout: bool = True) -> list[str]:
        """What the training forward saves for the backward (fusion.saved_names of mode_cfg(dropout))."""
        return list(self._saved_names[dropout])

    def _fusion(self, kind: str, dropout: bool):
        """The "forward", "train" (forward that saves for backward) or "backward"
        fusion, with or without dropout, built at its first use."""
        cfg = self.mode_cfg(dropout)
        key = (kind, cfg.dropout > 0)
        if key not in self._fusions:
            if kind == "backward":
                self._fusions[key] = build_backward(cfg, self._mesh_layout, dp_rank=self.dp_rank,
                                                    split_unit_axes=self.split_unit_axes)
            else:
                self._fusions[key] = build_forward(cfg, self._mesh_layout, check=self.check, train=kind == "train",
                                                   keys_on_device=self.keys_on_device and cfg.dropout > 0,
                                                   split_unit_axes=self.split_unit_axes)
        return self._fusions[key]

    def local_param_shape(self, name: str) -> tuple[int, ...]:
        return local_shape(param_shapes(self.cfg)[name], PARAM_PLACEMENTS[name], self.layout)

    # -- activations ------------------------------------------------------
    def input_shape(self) -> tuple[int, ...]:
        cfg = self.cfg
        return local_shape((cfg.batch, cfg.seq, cfg.n_embd), self._placements["x"], self.layout)

    def shard_input(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a global input, on this rank's device."""
        return local_slice(x, self._placements["x"], self.layout, self.rank).to(self.device, self.cfg.torch_dtype)

    def shard_output(self, t: torch.Tensor, name: str = "out") -> torch.Tensor:
        """This rank's slice of a global output (for checking against a reference)."""
        return local_slice(t, self._placements[name], self.layout, self.rank)

    def _validate(self, name: str, t, shape: tuple[int, ...]) -> None:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        problems = []
        if tuple(t.shape) != tuple(shape):
            problems.append(f"shape {tuple(shape)} (got {tuple(t.shape)})")
        if t.dtype != self.cfg.torch_dtype:
            problems.append(f"dtype {self.cfg.torch_dtype} (got {t.dtype})")
        if t.device.type != "cuda":
            problems.append(f"a CUDA tensor (got device {t.device})")
        if problems:
            raise ValueError(f"{name}: expected " + ", ".join(problems) +
                             f" for rank {self.rank} of mesh {self.layout.dp}x{self.layout.tp}")

    def _validate_input(self, name: str, t) -> None:
        if self.check_finite and isinstance(t, torch.Tensor) and not capturing():   # a sync: not in a graph
            check_finite(name, t)
        self._validate(name, t, self.input_shape())

    def _rng_inputs(self, rng_seed, rng_offset, write_keys: bool = True, dropout: bool = True) -> list:
        """The fusion's dropout inputs. With keys_on_device the keys are 0-d views
        of this block's key tensor, written now (write_keys=False: as they are,
        for a CUDA graph's capture, which must not copy from the host)."""
        if self.mode_cfg(dropout).dropout == 0:
            return []
        names = rng_input_names(self.cfg)
        values = dropout_scalars(self.cfg, self.layout, self.rank, rng_seed, rng_offset, self._mask_starts)
        if not self.keys_on_device:
            return [values[name] for name in names]
        keys = [name for name in names if name.startswith("key.")]
        if self._keys is None:
            if not write_keys:   # under capture: the tensor would be made (zeros) by every replay
                raise RuntimeError("the dropout keys were never written: call the block once before capturing it")
            self._keys = torch.zeros(len(keys), dtype=torch.int64, device=self.device)
        if write_keys:   # a fill per key, its value a kernel argument: no host memory for the GPU to read
            for i, name in enumerate(keys):   # (keys are below 2**62, dropout.stream_key: int64 holds them)
                self._keys[i].fill_(values[name])
        views = {name: self._keys[i] for i, name in enumerate(keys)}
        return [views.get(name, values[name]) for name in names]

    def _attention_stream(self, rng_seed: int, rng_offset: int, dropout: bool = True):
        """Around a forward fusion: flash attention's dropout (bf16) draws this
        rank's own stream (dropout.flash_seed), and the caller's CUDA generator
        is left as it was. A no-op where the fusion draws no flash dropout."""
        if self.cfg.dtype != "bf16" or self.mode_cfg(dropout).dropout == 0:
            return nullcontext()
        return seeded_cuda_generator(self.device, flash_seed(rng_seed, rng_offset, self.dp_rank, self.tp_rank))

    def _checked_params(self, params) -> list[torch.Tensor]:
        if params is None:
            if self._params is None:
                raise RuntimeError("no parameters: call load() or load_shards() first")
            return self._params
        return list(params)

    def __call__(self, x: torch.Tensor, rng_seed: int = 0, rng_offset: int = 0,
                 dropout: bool = True, params=None) -> dict[str, torch.Tensor]:
        """Run the fusion on this rank's input slice; returns this rank's outputs by name
        ('out', and with check=True the keep-masks of the dropouts). dropout=False:
        the block without dropout (eval mode). params: the shards to use (default: loaded)."""
        params = self._checked_params(params)
        self._validate_input("x", x)
        fusion = self._fusion("forward", dropout)
        outs = self._execute_forward(fusion, x, params, rng_seed, rng_offset, dropout)
        return dict(zip(fusion.outputs, outs))

    def _execute_forward(self, fusion, x, params, rng_seed, rng_offset, dropout: bool = True) -> list[torch.Tensor]:
        """Run a forward fusion. Under CUDA-graph capture the keys are not
        written and flash attention's generator is not seeded: the caller does
        both before each replay, which reads them then (graphs.py)."""
        in_graph = capturing()
        if in_graph and self.mode_cfg(dropout).dropout > 0 and not self.keys_on_device:
            raise ValueError("capturing a CUDA graph with dropout > 0 needs ShardedBlock(keys_on_device=True): "
                             "host-scalar keys would freeze the masks at capture (use tpfuser.graphs)")
        rng = self._rng_inputs(rng_seed, rng_offset, write_keys=not in_graph, dropout=dropout)
        with nullcontext() if in_graph else self._attention_stream(rng_seed, rng_offset, dropout):
            return fusion.fd.execute([x.contiguous(), *params, *rng], **self._options)

    # -- training ---------------------------------------------------------
    def forward_train(self, x: torch.Tensor, rng_seed: int = 0, rng_offset: int = 0, params=None,
                      dropout: bool = True):
        """The forward that also returns what backward needs: (outputs by name, saved
        list: self.saved_names(dropout))."""
        params = self._checked_params(params)
        self._validate_input("x", x)
        fusion = self._fusion("train", dropout)
        outs = self._execute_forward(fusion, x, params, rng_seed, rng_offset, dropout)
        named = dict(zip(fusion.outputs, outs))
        saved = [named.pop(name) for name in self._saved_names[dropout]]
        return named, saved

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, saved: list[torch.Tensor], params=None,
                 sum_over_dp: bool = True, dropout: bool = True):
        """(grad of x, [grad of each parameter shard in PARAM_NAMES order]) for this rank,
        from forward_train's saved list (its dropout masks included; dropout as
        forward_train was called). The parameter gradients are the whole batch's:
        summed over dp after the fusion (sum_over_dp=False: this rank's rows only,
        the caller sums)."""
        if sum_over_dp and self.layout.dp > 1 and self.dp_group is None:
            raise ValueError(f"dp={self.layout.dp}: the parameter gradients are summed over dp after the backward "
                             f"fusion; pass ShardedBlock(dp_group=world.dp_group(layout, rank))")
        inputs = self.backward_inputs(grad_out, x, saved, params, dropout)
        fusion = self._fusion("backward", dropout)
        named = dict(zip(fusion.outputs, fusion.execute(inputs, self.enable)))
        grads = [named[f"grad.{name}"] for name in PARAM_NAMES]
        return named["grad_x"], self._sum_over_dp(grads) if sum_over_dp else grads

    def _sum_over_dp(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return grads if self.layout.dp == 1 else sum_over_group(grads, self.dp_group)

    def backward_inputs(self, grad_out: torch.Tensor, x: torch.Tensor, saved: list[torch.Tensor],
                        params=None, dropout: bool = True) -> list:
        """The backward fusion's inputs, checked, in its order (fusion.define_backward)."""
        params = self._checked_params(params)
        self._validate_input("grad_out", grad_out)
        names = self._saved_names[dropout]
        if len(saved) != len(names):
            raise ValueError(f"saved: expected {len(names)} tensors ({', '.join(names)}), got {len(saved)}")
        return [grad_out.contiguous(), x.contiguous(), *params,
                *(laid_out(t, memory_order(BY_NAME[name], self.cfg)) for name, t in zip(names, saved))]


class _BlockFunction(torch.autograd.Function):
    """autograd glue: forward and backward fusions of one ShardedBlock."""

    @staticmethod
    def forward(ctx, block: ShardedBlock, rng_seed: int, rng_offset: int, dropout: bool, x, *params):
        named, saved = block.forward_train(x, rng_seed, rng_offset, params, dropout=dropout)
        ctx.block, ctx.dropout = block, dropout
        ctx.saved_names = block.saved_names(dropout)
        ctx.names = ["x", *PARAM_NAMES, *ctx.saved_names]   # what save_for_backward holds, in order
        ctx.save_for_backward(x, *params, *saved)
        return named["out"]

    @staticmethod
    def backward(ctx, grad_out):
        held = dict(zip(ctx.names, ctx.saved_tensors))
        params = [held[name] for name in PARAM_NAMES]
        saved = [held[name] for name in ctx.saved_names]
        grad_x, grads = ctx.block.backward(grad_out, held["x"], saved, params=params, dropout=ctx.dropout)
        return (None, None, None, None, grad_x, *grads)


class TPBlock(torch.nn.Module):
    """The sharded block as an nn.Module: its parameters are this rank's shards
    (PARAM_NAMES order, c_attn rows head by head), so `loss.backward()` leaves
    each rank its gradient shards. Parameter gradients are summed over dp after
    the backward fusion, over dp_group (as for a loss summed over the global batch).

    Each training-mode call draws fresh dropout masks: the rng offset is a
    step counter, the seed fixed at construction.

    graphs=True: a training-mode call replays a CUDA graph of the training
    forward, and its backward one of the backward (graphs.GraphedTraining),
    captured at the first call; one step at a time (forward, then backward).
    The output is a view of a buffer the next step overwrites. Eval-mode calls
    are not graphed. split_unit_axes: as ShardedBlock's."""

    def __init__(self, cfg: BlockConfig, layout: Layout = Layout(), rank: int = 0, rng_seed: int = 0,
                 device: Optional[torch.device] = None, mesh: bool = True,
                 dp_group=None, graphs: bool = False, split_unit_axes: bool = False):
        super().__init__()
        self.cfg, self.layout, self.rank = cfg, layout, rank
        self.runner = ShardedBlock(cfg, layout, rank, device=device, mesh=mesh, dp_group=dp_group,
                                   keys_on_device=graphs, split_unit_axes=split_unit_axes)
        self.graphs = graphs
        self._graphed = None   # graphs.GraphedTraining, made at the first training-mode call
        self.shards = torch.nn.ParameterList()
        self.rng_seed, self.step = rng_seed, 0

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> "TPBlock":
        """Take a nanoGPT Block state_dict (global); keep this rank's shards as parameters."""
        self.runner.load(state)
        self.shards = torch.nn.ParameterList([torch.nn.Parameter(t) for t in self.runner.params])
        self._graphed = None   # new parameters: a graph captured on the old ones is dropped
        return self

    def load_hf_gpt2(self, state: dict[str, torch.Tensor], layer: Optional[int] = None) -> "TPBlock":
        """Take Hugging Face GPT-2 weights (weights.from_hf_gpt2); keep this rank's shards as parameters."""
        return self.load_full_state_dict(from_hf_gpt2(state, self.cfg, layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Training mode: dropout with the next step's masks. Eval mode: the same
        runner's fusions without dropout (built at the first eval call), no step;
        without autograd (torch.no_grad) the inference forward, which saves nothing."""
        if not self.training and not torch.is_grad_enabled():
            return self.runner(x, self.rng_seed, self.step, dropout=False, params=list(self.shards))["out"]
        offset = self.step
        if self.training:
            self.step += 1
            if self.graphs:
                from tpfuser.graphs import GraphedTraining, _GraphedBlockFunction
                if self._graphed is None:
                    self._graphed = GraphedTraining(self.runner)
                return _GraphedBlockFunction.apply(self._graphed, self.rng_seed, offset, x, *self.shards)
        return _BlockFunction.apply(self.runner, self.rng_seed, offset, self.training, x, *self.shards)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Global parameter gradients in nanoGPT's layout (blocked c_attn), for checking.
        Gathers the other ranks' shards through torch.distributed when the world is larger than one."""
        from tpfuser.shard import qkv_blocked
        out = {}
        for name, p in zip(PARAM_NAMES, self.shards):
            g = p.grad
            if self.layout.world_size > 1:
                g = gather_output(g, self.layout, name)
            if name.startswith("attn.c_attn"):
                g = qkv_blocked(g, self.cfg.n_head)
            out[name] = g
        return out

