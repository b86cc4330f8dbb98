"""Running the sharded block: one `ShardedBlock` per rank.

    block = ShardedBlock(cfg, Layout(dp, tp), rank)              # schedule: "megatron-cut-linears" (or its -sp)
    block.load(reference_block.state_dict())      # full params; each rank keeps its shards
    out = block(block.shard_input(x))["out"]      # this rank's [b/dp, s, e]

A 1x1 mesh is the same code path. Each pass (the forward, the training
forward, the backward) is a few fusions (parallel/passes.build_pass), run
in order: every input by name from what the caller gave and what the earlier
fusions returned. Inputs are validated before nvFuser sees them, so a wrong
shape, dtype or device is a ValueError that names the tensor.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Optional

import torch

from tpfuser.block.dropout import STREAMS, flash_seed, stream_key
from tpfuser.block.inputs import MASK_STARTS, declared_order, free_strides, rng_input_names
from tpfuser.block.tensors import MASKS, PARAM_NAMES, param_shapes
from tpfuser.config import BlockConfig, Layout, check_config, check_flags
from tpfuser.dist.world import check_group, describe_single_process, sum_over_group
from tpfuser.parallel.placements import PARAM_PLACEMENTS, local_shape, placements
from tpfuser.parallel.passes import Pass
from tpfuser.parallel.schedules import Schedule, default_schedule, known_failure, load_schedule
from tpfuser.parallel.shard import local_slice, slice_starts
from tpfuser.runtime import kernel_cache, shared
from tpfuser.runtime.chunked import ChunkedLinears
from tpfuser.runtime.weights import block_device, check_finite, check_tensor, from_hf_gpt2, rank_shards, to_device

MASKED = {stream: mask.name for stream, mask in MASKS.items()}   # the tensor each dropout stream masks


def laid_out(t: torch.Tensor, order: tuple[int, ...] | None, dense: bool = True) -> torch.Tensor:
    """t with its elements in memory in `order` (its dimensions outermost first;
    None: contiguous), as a backward fusion input declares it; a copy only where
    t is not so already. dense=False (inputs.free_strides): t as it is if its
    strides fall in `order` (q, k, v as views of qkv)."""
    order = tuple(range(t.dim())) if order is None else order
    spanned = [d for d in order if t.size(d) != 1]   # one element: no stride to keep
    if not dense and all(t.stride(a) >= t.stride(b) for a, b in zip(spanned, spanned[1:])):
        return t
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return t.permute(order).contiguous().permute(inverse)


def mask_shape(cfg: BlockConfig, stream: str) -> tuple[int, ...]:
    return MASKS[stream].shape(cfg)


def mask_starts(cfg: BlockConfig, layout: Layout, rank: int) -> dict[str, int]:
    """Where this rank's slice of each masked tensor begins in the global tensor,
    by the fusions' scalar names (block/inputs.MASK_STARTS): fixed for a rank."""
    values, where = {}, placements(layout)
    for stream in STREAMS:
        starts = slice_starts(mask_shape(cfg, stream), where[MASKED[stream]], layout, rank)
        for name, start in zip(MASK_STARTS[stream], starts):
            if name and values.setdefault(name, start) != start:
                raise AssertionError(f"{name}: {stream} starts at {start}, another mask at {values[name]}")
    return values


def dropout_scalars(cfg: BlockConfig, layout: Layout, rank: int, rng_seed: int, rng_offset: int,
                    starts: dict[str, int] | None = None) -> dict[str, int]:
    """The fusions' dropout inputs for this rank (rng_input_names): every stream's key, the same
    on all ranks (dropout.stream_key), and the mask starts (mask_starts, or `starts` as it gave them)."""
    keys = {f"key.{stream}": stream_key(rng_seed, rng_offset, stream) for stream in STREAMS}
    return keys | (mask_starts(cfg, layout, rank) if starts is None else starts)


@contextmanager
def seeded_cuda_generator(device: torch.device, seed: int):
    """Run the body with `device`'s default CUDA generator at (seed, offset 0), restored after."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    state = gen.get_state()
    gen.manual_seed(seed)
    try:
        yield
    finally:
        gen.set_state(state)


def capturing() -> bool:   # whether the current CUDA stream is capturing a graph
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class ShardedBlock:
    """One rank's share of the block on a dp x tp mesh, under a schedule."""

    def __init__(self, cfg: BlockConfig, layout: Layout = Layout(), rank: int = 0, check: bool = False,
                 device: torch.device | str | int | None = None, dp_group=None, check_finite: bool = False,
                 schedule: Schedule | str | dict | None = None):
        """device: as PyTorch takes one (weights.block_device; default the current CUDA
        device). schedule: parallel/schedules.py's (a name, a dict, a JSON file or a
        Schedule); default "megatron-cut-linears", or its -sp for a sequence-parallel
        layout. check: the forward also returns the dropout keep-masks.
        dp_group: the torch.distributed group of this rank's dp replicas
        (world.dp_group), over which backward sums the parameter gradients;
        needed when dp > 1. check_finite: refuse an input (x, grad_out)
        holding NaN or inf; off by default, since reading the count back waits
        for the GPU on every call. On its own (no launcher) the process describes
        a world of one to nvFuser first (world.describe_single_process)."""
        check_config(cfg, layout)
        check_flags(check=check, check_finite=check_finite)
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise ValueError(f"rank={rank!r}: expected an int in [0, {layout.world_size})")
        self.device, self.dp_group = block_device(device), dp_group
        check_group("dp_group", dp_group)
        self.schedule = default_schedule(layout) if schedule is None else load_schedule(schedule)
        self.schedule.check(cfg, layout)
        layout.check(cfg)
        if refused := known_failure(cfg, layout, self.schedule):
            raise ValueError(refused)
        describe_single_process()
        self.cfg, self.layout, self.rank, self.check = cfg, layout, rank, check
        self.dp_rank, self.tp_rank = layout.rank_coords(rank)
        self.form = self.schedule.form()
        self.keys_on_device = self.schedule.keys_on_device and cfg.dropout > 0
        self._keys = None   # the keys' CUDA tensor (keys_on_device), made at first use
        self._options: dict = {}   # (pass kind, cut point) -> fd.execute's option keywords (_piece_options)
        self._eval_cfg = cfg.replace(dropout=0.0) if cfg.dropout > 0 else cfg   # mode_cfg(False), made once
        # what the layout fixes, made once, not on every call
        self._placements = placements(layout)
        self._mask_starts = mask_starts(cfg, layout, rank)
        self._passes: dict[tuple[str, bool], Pass] = {}   # (kind, dropout): built at first use (pass_of)
        self._saved_orders: dict[bool, dict] = {}          # dropout: _saved's, made at first use
        self.chunked = ChunkedLinears(self)
        self.forward_pass = self.pass_of("forward", True)
        self._params: Optional[list[torch.Tensor]] = None
        self.check_finite = check_finite

    # -- parameters -------------------------------------------------------
    def load(self, state: dict[str, torch.Tensor], strict: bool = True) -> "ShardedBlock":
        """Keep this rank's shards of a nanoGPT-style state_dict (global, blocked c_attn), checked and cast by
        weights.rank_shards (strict=False: other keys ignored, not refused), as copies, never the state's tensors."""
        return self.load_shards([to_device(s, self.device, "load") for s in rank_shards(state, self.cfg, self.layout,
                                                                                         self.rank, strict)])

    def load_hf_gpt2(self, state: dict[str, torch.Tensor], layer: Optional[int] = None,
                     strict: bool = True) -> "ShardedBlock":
        """Take Hugging Face GPT-2 weights (Conv1D layout): a GPT2Block's state_dict, or
        with `layer` that layer of a GPT2LMHeadModel's (weights.from_hf_gpt2)."""
        return self.load(from_hf_gpt2(state, self.cfg, layer, strict), strict=True)

    def load_shards(self, shards: list[torch.Tensor]) -> "ShardedBlock":
        """This rank's shards as given (PARAM_NAMES order, fusion's qkv order), checked as load() checks weights."""
        if not isinstance(shards, (list, tuple)) or len(shards) != len(PARAM_NAMES):
            raise ValueError(f"shards: expected a list of {len(PARAM_NAMES)} tensors ({', '.join(PARAM_NAMES)}), got "
                             + (f"{len(shards)}" if isinstance(shards, (list, tuple)) else type(shards).__name__))
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

    def checked_params(self, params=None) -> list[torch.Tensor]:
        """`params` as a list, or the loaded shards; refused when neither is there."""
        if params is None:
            if self._params is None:
                raise RuntimeError("no parameters: call load() or load_shards() first")
            return self._params
        return list(params)

    def mode_cfg(self, dropout: bool = True) -> BlockConfig:
        """The block's config as a call runs it: dropout=False (nn.Module's eval
        mode) is the block with dropout 0, whose fusions draw no masks."""
        return self.cfg if dropout else self._eval_cfg

    def saved_names(self, dropout: bool = True) -> list[str]:
        """What the training forward saves for the backward, in the backward's order."""
        return list(self._saved(dropout))

    def _saved(self, dropout: bool) -> dict:
        """{saved name: (memory order, dense) as the backward declares it}, per mode,
        made once (not on every call): the training pass's outputs but `out`."""
        key = self.mode_cfg(dropout).dropout > 0
        if key not in self._saved_orders:
            self._saved_orders[key] = {name: (declared_order(name, self.cfg, self.form),
                                              not free_strides(name, self.form))
                                       for name in self.pass_of("train", dropout).outputs if name != "out"}
        return self._saved_orders[key]

    def pass_of(self, kind: str, dropout: bool = True) -> Pass:
        """The "forward", "train" (forward that saves for backward) or "backward"
        pass, with or without dropout, built at its first use."""
        cfg = self.mode_cfg(dropout)
        key = (kind, cfg.dropout > 0)
        if key not in self._passes:
            layout = self.layout if self.schedule.mesh else None
            self._passes[key] = shared.shared_pass(cfg, kind, layout, self.check and kind == "forward", self.dp_rank,
                                                   self.schedule, self.device)
        return self._passes[key]

    def local_param_shape(self, name: str) -> tuple[int, ...]:
        return local_shape(param_shapes(self.cfg)[name], PARAM_PLACEMENTS[name], self.layout)

    # -- activations ------------------------------------------------------
    def input_shape(self) -> tuple[int, ...]:
        cfg = self.cfg
        return local_shape((cfg.batch, cfg.seq, cfg.n_embd), self._placements["x"], self.layout)

    def shard_input(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a global input, on this rank's device."""
        return to_device(local_slice(x, self._placements["x"], self.layout, self.rank, "x"), self.device, "shard_input",
                         self.cfg.torch_dtype)

    def shard_output(self, t: torch.Tensor, name: str = "out") -> torch.Tensor:
        """This rank's slice of a global output (for checking against a reference)."""
        return local_slice(t, self._placements[name], self.layout, self.rank, name)

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

    def validate_input(self, name: str, t) -> None:
        """Refuse an activation (x, grad_out) this rank's fusions cannot take, naming it."""
        if self.check_finite and isinstance(t, torch.Tensor) and not capturing():   # a sync: not in a graph
            check_finite(name, t)
        self._validate(name, t, self.input_shape())

    # -- running ----------------------------------------------------------
    def rng_inputs(self, rng_seed, rng_offset, write_keys: bool = True, dropout: bool = True) -> dict:
        """The fusions' dropout inputs by name. With keys_on_device the keys are
        0-d views of this block's key tensor, written now (write_keys=False: as
        they are, for a CUDA graph's capture, which must not copy from the host)."""
        if self.mode_cfg(dropout).dropout == 0:
            return {}
        names = rng_input_names(self.cfg)
        values = dropout_scalars(self.cfg, self.layout, self.rank, rng_seed, rng_offset, self._mask_starts)
        if not self.keys_on_device:
            return {name: values[name] for name in names}
        keys = [name for name in names if name.startswith("key.")]
        if self._keys is None:
            if not write_keys:   # under capture: the tensor would be made (zeros) by every replay
                raise RuntimeError("the dropout keys were never written: call the block once before capturing it")
            self._keys = torch.zeros(len(keys), dtype=torch.int64, device=self.device)
        if write_keys:   # a fill per key, its value a kernel argument: no host memory for the GPU to read
            for i, name in enumerate(keys):   # (keys are below 2**62, dropout.stream_key: int64 holds them)
                self._keys[i].fill_(values[name])
        views = {name: self._keys[i] for i, name in enumerate(keys)}
        return {name: views.get(name, values[name]) for name in names}

    def attention_stream(self, rng_seed: int, rng_offset: int, dropout: bool = True):
        """Around a forward: flash attention's dropout (bf16) draws this rank's
        own stream (dropout.flash_seed), and the caller's CUDA generator is
        left as it was. A no-op where the fusions draw no flash dropout."""
        if self.cfg.dtype != "bf16" or self.mode_cfg(dropout).dropout == 0:
            return nullcontext()
        return seeded_cuda_generator(self.device, flash_seed(rng_seed, rng_offset, self.dp_rank, self.tp_rank))

    def run_pass(self, kind: str, env: dict, dropout: bool = True) -> dict[str, torch.Tensor]:
        """Run a pass's fusions in order on `env` (its inputs by name, extended
        with what each fusion returns); the pass's outputs by name."""
        run = self.pass_of(kind, dropout)
        for piece in run.pieces:
            chunked = self.chunked.runner(run, piece)
            inputs = [env[name] for name in piece.inputs]
            outs = chunked(inputs) if chunked else piece.execute(inputs, **self._piece_options(run, piece))
            env.update(zip(piece.outputs, outs))
        return {name: env[name] for name in run.outputs}

    def _piece_options(self, run: Pass, piece) -> dict:
        """fd.execute's option keywords for one fusion: the pass's own, the schedule's, the kernel cache's."""
        key = (run.kind, piece.point)
        if key not in self._options:
            mine, cache = self.schedule.options(piece.point), kernel_cache.options()
            self._options[key] = {k: [*run.options.get(k, []), *mine.get(k, []), *cache.get(k, [])]
                                  for k in {*run.options, *mine, *cache}}
        return self._options[key]

    def _forward(self, kind, x, params, rng_seed, rng_offset, dropout) -> dict[str, torch.Tensor]:
        """Run a forward pass. Under CUDA-graph capture the keys are not
        written and flash attention's generator is not seeded: the caller does
        both before each replay, which reads them then (graphs.py)."""
        in_graph = capturing()
        if in_graph and self.mode_cfg(dropout).dropout > 0 and not self.keys_on_device:
            raise ValueError("capturing a CUDA graph with dropout > 0 needs a schedule with keys_on_device=true: "
                             "host-scalar keys would freeze the masks at capture (use tpfuser.runtime.graphs)")
        env = {"x": x.contiguous(), **dict(zip(PARAM_NAMES, params)),
               **self.rng_inputs(rng_seed, rng_offset, write_keys=not in_graph, dropout=dropout)}
        with nullcontext() if in_graph else self.attention_stream(rng_seed, rng_offset, dropout):
            return self.run_pass(kind, env, dropout)

    def __call__(self, x: torch.Tensor, rng_seed: int = 0, rng_offset: int = 0,
                 dropout: bool = True, params=None) -> dict[str, torch.Tensor]:
        """Run the forward on this rank's input slice; returns this rank's outputs by name
        ('out', and with check=True the keep-masks of the dropouts). dropout=False:
        the block without dropout (eval mode). params: the shards to use (default: loaded)."""
        params = self.checked_params(params)
        self.validate_input("x", x)
        return self._forward("forward", x, params, rng_seed, rng_offset, dropout)

    # -- training ---------------------------------------------------------
    def forward_train(self, x: torch.Tensor, rng_seed: int = 0, rng_offset: int = 0, params=None,
                      dropout: bool = True):
        """The forward that also returns what backward needs: (outputs by name, saved
        list: self.saved_names(dropout))."""
        params = self.checked_params(params)
        self.validate_input("x", x)
        named = self._forward("train", x, params, rng_seed, rng_offset, dropout)
        saved = [named.pop(name) for name in self._saved(dropout)]
        return named, saved

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, saved: list[torch.Tensor], params=None,
                 sum_over_dp: bool = True, dropout: bool = True):
        """(grad of x, [grad of each parameter shard in PARAM_NAMES order]) for this rank,
        from forward_train's saved list (its dropout masks included; dropout as
        forward_train was called). The parameter gradients are the whole batch's:
        summed over dp after the fusions (sum_over_dp=False: this rank's rows only,
        the caller sums)."""
        if sum_over_dp and self.layout.dp > 1 and self.dp_group is None:
            raise ValueError(f"dp={self.layout.dp}: the parameter gradients are summed over dp after the backward "
                             f"fusions; pass ShardedBlock(dp_group=world.dp_group(layout, rank))")
        named = self.run_pass("backward", self.backward_inputs(grad_out, x, saved, params, dropout), dropout)
        grads = [named[f"grad.{name}"] for name in PARAM_NAMES]
        return named["grad_x"], self.sum_over_dp(grads) if sum_over_dp else grads

    def sum_over_dp(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameter gradients summed over this rank's dp replicas (as DDP)."""
        return grads if self.layout.dp == 1 else sum_over_group(grads, self.dp_group)

    def backward_inputs(self, grad_out: torch.Tensor, x: torch.Tensor, saved: list[torch.Tensor],
                        params=None, dropout: bool = True) -> dict:
        """The backward's inputs by name, checked, the saved ones laid out as it reads them."""
        params = self.checked_params(params)
        self.validate_input("grad_out", grad_out)
        orders = self._saved(dropout)
        if len(saved) != len(orders):
            raise ValueError(f"saved: expected {len(orders)} tensors ({', '.join(orders)}), got {len(saved)}")
        return {"grad_out": grad_out.contiguous(), "x": x.contiguous(), **dict(zip(PARAM_NAMES, params)),
                **{name: laid_out(t, *layout) for (name, layout), t in zip(orders.items(), saved)}}
