"""Running the sharded block: one `ShardedBlock` per rank.

    block = ShardedBlock(cfg, Layout(dp, tp), rank)
    block.load(reference_block.state_dict())      # full params; each rank keeps its shards
    out = block(block.shard_input(x))["out"]      # this rank's [b/dp, s, e]

A 1x1 mesh is the same code path. Inputs are validated before nvFuser sees
them, so a wrong shape, dtype or device is a ValueError that names the tensor.
"""

from __future__ import annotations

from typing import Optional

import torch

from tpfuser.config import BlockConfig, Layout
from tpfuser.fusion import RNG_STREAMS, build_forward, communicator
from tpfuser.plan import ACTIVATION_PLACEMENTS, PARAM_PLACEMENTS, local_shape
from tpfuser.reference import PARAM_NAMES, param_shapes
from tpfuser.shard import fusion_params, local_slice, rank_params

# nvFuser's generated kernels hold the philox offset in the index type (32-bit
# for these sizes): an offset of 2**40 wrapped to 0 on the H200 and gave every
# dp rank the same masks. Offsets therefore stay below 2**31.
RNG_OFFSET_LIMIT = 1 << 31


def rank_rng_offset(rng_offset: int, dp: int, dp_rank: int) -> int:
    """The fusion's base philox offset for this rank.

    Each (user offset, dp rank) pair gets its own block of len(RNG_STREAMS)
    offsets, so that data-parallel replicas do not drop the same positions of
    their batch slices and no two streams ever share a philox counter. Tp ranks
    share the block: Megatron replicates those masks over tp."""
    if not isinstance(rng_offset, int) or rng_offset < 0:
        raise ValueError(f"rng_offset={rng_offset!r}: must be a non-negative int")
    base = (rng_offset * dp + dp_rank) * len(RNG_STREAMS)
    if base + len(RNG_STREAMS) > RNG_OFFSET_LIMIT:
        raise ValueError(f"rng_offset={rng_offset}: must be below {RNG_OFFSET_LIMIT // (dp * len(RNG_STREAMS))} "
                         f"for dp={dp} (the fusion's philox offsets are 32-bit)")
    return base


def check_world(layout: Layout, world_size: int, local_gpus: Optional[int] = None, local_ranks: Optional[int] = None) -> None:
    """Fail before any GPU work when the launch cannot host the mesh."""
    if world_size != layout.world_size:
        raise ValueError(f"world size {world_size} != dp*tp = {layout.dp}*{layout.tp} = {layout.world_size}; "
                         f"launch exactly {layout.world_size} ranks")
    if local_gpus is not None and local_ranks is not None and local_ranks > local_gpus:
        raise ValueError(f"{local_ranks} ranks on this node but only {local_gpus} CUDA device(s) visible")


class ShardedBlock:
    """One rank's share of the block forward on a dp x tp mesh."""

    def __init__(self, cfg: BlockConfig, layout: Layout = Layout(), rank: int = 0, check: bool = False,
                 device: Optional[torch.device] = None, mesh: bool = True):
        """mesh=False (1x1 only) builds the fusion without a device mesh: the
        same math, run by nvFuser's single-device executor (see NOTES.md)."""
        layout.check(cfg)
        if not mesh and layout.world_size != 1:
            raise ValueError(f"mesh=False needs a 1x1 layout, got {layout.dp}x{layout.tp}")
        self.cfg, self.layout, self.rank, self.check = cfg, layout, rank, check
        self.dp_rank, self.tp_rank = layout.rank_coords(rank)
        self.device = device or torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        self.fusion = build_forward(cfg, layout if mesh else None, check=check)
        self.output_names = list(self.fusion.outputs)
        self._params: Optional[list[torch.Tensor]] = None

    # -- parameters -------------------------------------------------------
    def load(self, state: dict[str, torch.Tensor]) -> "ShardedBlock":
        """Take a nanoGPT-style state_dict (global, blocked c_attn); keep this rank's shards."""
        missing = [n for n in PARAM_NAMES if n not in state]
        if missing:
            raise ValueError(f"state_dict lacks {missing}")
        shapes = param_shapes(self.cfg)
        for name in PARAM_NAMES:
            if tuple(state[name].shape) != shapes[name]:
                raise ValueError(f"{name}: expected shape {shapes[name]}, got {tuple(state[name].shape)}")
        fparams = fusion_params({n: state[n].detach().cpu() for n in PARAM_NAMES}, self.cfg)
        shards = rank_params(fparams, self.layout, self.rank)
        return self.load_shards([s.to(self.device, self.cfg.torch_dtype) for s in shards])

    def load_shards(self, shards: list[torch.Tensor]) -> "ShardedBlock":
        """Take this rank's shards directly (PARAM_NAMES order, fusion's qkv order)."""
        if len(shards) != len(PARAM_NAMES):
            raise ValueError(f"expected {len(PARAM_NAMES)} parameter shards ({', '.join(PARAM_NAMES)}), got {len(shards)}")
        for name, t in zip(PARAM_NAMES, shards):
            self._validate(name, t, self.local_param_shape(name))
        self._params = list(shards)
        return self

    def local_param_shape(self, name: str) -> tuple[int, ...]:
        return local_shape(param_shapes(self.cfg)[name], PARAM_PLACEMENTS[name], self.layout)

    # -- activations ------------------------------------------------------
    def input_shape(self) -> tuple[int, ...]:
        cfg = self.cfg
        return local_shape((cfg.batch, cfg.seq, cfg.n_embd), ACTIVATION_PLACEMENTS["x"], self.layout)

    def shard_input(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a global input, on this rank's device."""
        return local_slice(x, ACTIVATION_PLACEMENTS["x"], self.layout, self.rank).to(self.device, self.cfg.torch_dtype)

    def shard_output(self, t: torch.Tensor, name: str = "out") -> torch.Tensor:
        """This rank's slice of a global output (for checking against a reference)."""
        return local_slice(t, ACTIVATION_PLACEMENTS[name], self.layout, self.rank)

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

    def __call__(self, x: torch.Tensor, rng_seed: int = 0, rng_offset: int = 0) -> dict[str, torch.Tensor]:
        """Run the fusion on this rank's input slice; returns this rank's outputs by name
        ('out', and with check=True the keep-masks of the dropouts)."""
        if self._params is None:
            raise RuntimeError("no parameters: call load() or load_shards() first")
        self._validate("x", x, self.input_shape())
        inputs = [x.contiguous(), *self._params]
        if self.fusion.has_rng:
            if not isinstance(rng_seed, int) or not 0 <= rng_seed < RNG_OFFSET_LIMIT:
                raise ValueError(f"rng_seed={rng_seed!r}: must be an int in [0, 2**31)")
            inputs += [rng_seed, rank_rng_offset(rng_offset, self.layout.dp, self.dp_rank)]
        outs = self.fusion.fd.execute(inputs)
        return dict(zip(self.output_names, outs))


def world() -> tuple[int, int]:
    """(rank, size) as nvFuser's Communicator sees them (torchrun or mpirun)."""
    comm = communicator()
    return comm.rank(), comm.size()


def gather_output(local: torch.Tensor, layout: Layout, name: str = "out", group=None) -> torch.Tensor:
    """Every rank's shard of an output, reassembled into the global tensor on
    every rank (for checking; it moves the whole tensor). Uses torch.distributed
    (any backend; the shards travel through the CPU), which the caller
    initializes; with a world of one it returns the local tensor."""
    import torch.distributed as dist
    from tpfuser.shard import gather
    if layout.world_size == 1:
        return local
    if not dist.is_initialized():
        raise RuntimeError("gather_output needs torch.distributed initialized (e.g. init_process_group('gloo'))")
    if dist.get_world_size(group) != layout.world_size:
        raise ValueError(f"world size {dist.get_world_size(group)} != dp*tp = {layout.world_size}")
    shards: list = [None] * layout.world_size
    dist.all_gather_object(shards, local.detach().cpu(), group=group)
    return gather(shards, ACTIVATION_PLACEMENTS[name], layout)
