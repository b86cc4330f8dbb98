"""tpfuser: a Megatron-LM-style tensor-parallel GPT-2 block in nvFuser's Python API.

    from tpfuser import BlockConfig, Layout, preset, ShardedBlock, TPBlock, SCHEDULES, load_schedule

Importing the package imports nothing else and changes no environment: each
name below is imported at its first use (torch and nvFuser are heavy, and
`tpfuser plan` runs without nvFuser).
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "BlockConfig": "tpfuser.config", "Layout": "tpfuser.config", "preset": "tpfuser.config",
    "PRESETS": "tpfuser.config",
    "Schedule": "tpfuser.parallel.schedules", "LinearSchedule": "tpfuser.parallel.schedules",
    "SCHEDULES": "tpfuser.parallel.schedules", "load_schedule": "tpfuser.parallel.schedules",
    "ShardedBlock": "tpfuser.runtime.block", "TPBlock": "tpfuser.runtime.module",
    "GraphedForward": "tpfuser.runtime.graphs", "GraphedTrainStep": "tpfuser.runtime.graphs",
    "from_hf_gpt2": "tpfuser.runtime.weights", "rank_shards": "tpfuser.runtime.weights",
    "model_layer": "tpfuser.runtime.weights",
    "Block": "tpfuser.verify.reference", "make_block": "tpfuser.verify.reference",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'tpfuser' has no attribute {name!r} (its public names: {', '.join(__all__)})")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
