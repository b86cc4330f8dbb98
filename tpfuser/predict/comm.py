"""Collective times from bus-bandwidth tables, interpolated in message size.

A table gives NCCL's bus bandwidth (nccl-tests' `busbw`, GB/s = 1e9 B/s) at
message sizes (nccl-tests' `size`: the whole tensor, bytes: an all-reduce's
buffer, an all-gather's output, a reduce-scatter's input). nccl-tests
(doc/PERFORMANCE.md) defines busbw so that, for the ring algorithms, it is what
each rank's link carries:

    time = algorithm_bytes(kind, size, n) / busbw(size)
    algorithm_bytes = 2 (n-1)/n size    all-reduce (reduce-scatter, then all-gather)
                      (n-1)/n size      all-gather, reduce-scatter

Between a table's sizes, log(busbw) is interpolated linearly in log(size);
below its smallest size the time is held at that size's time (a latency floor:
it overstates tiny messages); above its largest the bandwidth is held at the
largest's. A table measured on n ranks is used for any team size: busbw is
meant not to depend on n (PERFORMANCE.md), a first-order assumption on one
NVSwitch. Times are in milliseconds.
"""

from __future__ import annotations

import json
import os
import math
import re
from dataclasses import dataclass

KINDS = ("allreduce", "allgather", "reducescatter")
KiB, MiB = 1 << 10, 1 << 20

# Published nccl-tests all-reduce bus bandwidth on 8 H200 (NVLink 4, NVSwitch),
# 1 to 64 MiB, as quoted in tpfuser issue 32 (close to 52 us + size / 227 GB/s).
_H200_ALLREDUCE = ((1 * MiB, 39.9), (2 * MiB, 64.5), (4 * MiB, 107.0), (8 * MiB, 156.0),
                   (16 * MiB, 220.0), (32 * MiB, 276.0), (64 * MiB, 347.0))
_H200_SOURCE = ("nccl-tests all_reduce_perf on 8xH200, 1-64 MiB (a public run of it: "
                "github.com/NVIDIA/nccl-tests/issues/272; these figures not checked against it)")


def _doubling(first: int, busbw: tuple[float, ...]) -> tuple[tuple[int, float], ...]:
    return tuple((first << i, b) for i, b in enumerate(busbw))


# Published nccl-tests output of one node of 8 H100 SXM (NVLink 4, NVSwitch, as
# on an H200 SXM node), NCCL 2.26.2, nccl-tests 2.17.9, one process driving the
# 8 GPUs, float, out-of-place busbw, sizes doubling from the first.
_TOGETHER = "github.com/togethercomputer/together-nccl-tests, benchmarks/H100/results"
_H100_ALLGATHER = _doubling(128 * KiB, (3.12, 6.24, 11.43, 22.02, 44.24, 88.77, 156.12, 207.36, 234.03, 278.45,
                                        298.43, 320.49, 335.70, 344.53, 350.36, 355.23, 357.90))
_H100_REDUCESCATTER = _doubling(128 * KiB, (3.12, 6.27, 11.76, 22.60, 44.05, 88.02, 145.53, 203.96, 247.18,
                                            284.43, 307.89, 327.04, 337.19, 346.49, 351.01, 359.62, 363.18))
_H100_ALLREDUCE = _doubling(1 * MiB, (43.38, 83.73, 131.03, 172.95, 233.92, 293.22, 358.97, 398.98, 421.78,
                                      437.03, 467.77, 472.84, 477.00, 479.61))
# Below 1 MiB both all-reduce tables take that node's ring figures at 64-256 KiB
# (its latency floor, ~36 us; 512 KiB left out: out of place 69.2 us against
# 44.2 in place, an outlier), so a small fp32 gradient is not billed at 1 MiB.
_H100_ALLREDUCE_FLOOR = _doubling(64 * KiB, (3.21, 6.15, 12.09))
_FLOOR_SOURCE = (f"below 1 MiB: all_reduce_perf on 8xH100 SXM, ring, 64-256 KiB ({_TOGETHER}/20260305_220043/"
                 f"all_reduce_ring.out)")
_H100_SOURCES = {
    "allgather": f"nccl-tests all_gather_perf on 8xH100 SXM, ring, 128 KiB-8 GiB ({_TOGETHER}/20260305_220043/"
                 f"all_gather_ring.out)",
    "reducescatter": f"nccl-tests reduce_scatter_perf on 8xH100 SXM, ring, 128 KiB-8 GiB ({_TOGETHER}/"
                     f"20260305_220043/reduce_scatter_ring.out)",
    "allreduce": f"nccl-tests all_reduce_perf on 8xH100 SXM, NVLS, 1 MiB-8 GiB ({_TOGETHER}/20260305_221443/"
                 f"all_reduce_nvls.out)",
}
_ON_H200 = ("measured on H100 SXM, taken for H200 SXM: the same NVLink 4 (18 links, 900 GB/s a GPU) and "
            "NVSwitch; no published 8xH200 figures for it were at hand; replace with all_gather_perf / "
            "reduce_scatter_perf output from the machine (--comm-table)")


def algorithm_factor(kind: str, ranks: int) -> float:
    """Bytes each rank sends per byte of the tensor (ring algorithms)."""
    if kind not in KINDS:
        raise ValueError(f"collective kind {kind!r}: expected one of {', '.join(KINDS)}")
    return (2.0 if kind == "allreduce" else 1.0) * (ranks - 1) / ranks


def algorithm_bytes(kind: str, nbytes: float, ranks: int) -> float:
    """What each rank sends for a tensor of nbytes: 2(n-1)/n of it for an all-reduce, (n-1)/n otherwise."""
    return algorithm_factor(kind, ranks) * nbytes


@dataclass(frozen=True)
class BusTable:
    """One collective's bus bandwidth (GB/s) at message sizes (bytes), ascending; `source` says where from."""

    kind: str
    sizes: tuple[int, ...]
    busbw_gbps: tuple[float, ...]
    ranks: int = 8
    source: str = ""

    def __post_init__(self):
        where = f"bus table {self.kind!r}"
        if self.kind not in KINDS:
            raise ValueError(f"{where}: kind expected one of {', '.join(KINDS)}")
        if not self.sizes or len(self.sizes) != len(self.busbw_gbps):
            raise ValueError(f"{where}: expected as many sizes as bandwidths (at least one), got "
                             f"{len(self.sizes)} and {len(self.busbw_gbps)}")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])) or self.sizes[0] <= 0:
            raise ValueError(f"{where}: sizes expected positive and ascending, got {list(self.sizes)}")
        if not all(isinstance(v, (int, float)) and 0 < v < math.inf for v in self.busbw_gbps):
            raise ValueError(f"{where}: bandwidths expected positive and finite GB/s, got {list(self.busbw_gbps)}")

    def busbw(self, nbytes: float) -> float:
        """Bus bandwidth, GB/s, at a message of nbytes: log(busbw) linear in log(size) between the
        table's points (where busbw doubles with size, as at the latency floor, time stays flat), held at the ends."""
        sizes, bw = self.sizes, self.busbw_gbps
        if nbytes <= sizes[0]:
            return bw[0]
        if nbytes >= sizes[-1]:
            return bw[-1]
        i = next(i for i in range(1, len(sizes)) if nbytes <= sizes[i])
        t = (math.log(nbytes) - math.log(sizes[i - 1])) / (math.log(sizes[i]) - math.log(sizes[i - 1]))
        return bw[i - 1] * (bw[i] / bw[i - 1]) ** t

    def time_ms(self, nbytes: float, ranks: int) -> float:
        """One collective of a tensor of nbytes over `ranks` ranks, ms; 0 for a team of one."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        size = max(nbytes, self.sizes[0])   # the latency floor below the table
        return algorithm_bytes(self.kind, size, ranks) / (self.busbw(size) * 1e9) * 1e3


@dataclass(frozen=True)
class Interconnect:
    name: str
    tables: dict   # kind -> BusTable
    source: str

    def time_ms(self, kind: str, nbytes: float, ranks: int) -> float:
        if kind not in self.tables:
            raise ValueError(f"interconnect {self.name!r}: no {kind} table (it has {', '.join(self.tables)})")
        return self.tables[kind].time_ms(nbytes, ranks)

    def replace(self, tables: dict, name: str | None = None) -> "Interconnect":
        merged = {**self.tables, **tables}
        return Interconnect(name or f"{self.name}+given", merged, "; ".join(
            f"{k}: {t.source}" for k, t in merged.items()))


def _table(kind: str, points, source: str) -> BusTable:
    return BusTable(kind, tuple(s for s, _ in points), tuple(b for _, b in points), 8, source)


def _nvlink(name: str) -> Interconnect:
    """An 8-GPU NVLink node: h100-nvlink every table from the H100 node's output,
    h200-nvlink the H200 all-reduce and the H100 node's all-gather and reduce-scatter."""
    points = {"allreduce": _H100_ALLREDUCE, "allgather": _H100_ALLGATHER, "reducescatter": _H100_REDUCESCATTER}
    sources = dict(_H100_SOURCES)
    if name == "h200-nvlink":
        points["allreduce"], sources["allreduce"] = _H200_ALLREDUCE, _H200_SOURCE
        for kind in ("allgather", "reducescatter"):
            sources[kind] = f"{sources[kind]}; {_ON_H200}"
    points["allreduce"] = _H100_ALLREDUCE_FLOOR + points["allreduce"]
    sources["allreduce"] = f"{sources['allreduce']}; {_FLOOR_SOURCE}"
    tables = {kind: _table(kind, points[kind], sources[kind]) for kind in KINDS}
    return Interconnect(name, tables, "; ".join(f"{kind}: {t.source}" for kind, t in tables.items()))


INTERCONNECTS = {name: _nvlink(name) for name in ("h200-nvlink", "h100-nvlink")}


def flat(busbw_gbps: float) -> Interconnect:
    """One bus bandwidth at every size and for every kind (plan's --bandwidth): no latency term."""
    tables = {k: BusTable(k, (1,), (busbw_gbps,), 8, f"flat {busbw_gbps:g} GB/s (--bandwidth)") for k in KINDS}
    return Interconnect(f"flat-{busbw_gbps:g}", tables, f"flat {busbw_gbps:g} GB/s, as given (--bandwidth)")


def interconnect(name: str) -> Interconnect:
    if name not in INTERCONNECTS:
        raise ValueError(f"--interconnect={name!r}: expected one of {', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[name]


_TOOLS = {"all_reduce_perf": "allreduce", "all_gather_perf": "allgather", "reduce_scatter_perf": "reducescatter"}


def parse_nccl_tests(text: str, kind: str | None = None, source: str = "nccl-tests output") -> BusTable:
    """A BusTable from nccl-tests' text output: the out-of-place busbw column of
    each data row, by the header line's columns; the kind from `kind` or the
    tool's name in the text (all_reduce_perf, ...); the ranks from its
    '#  Rank N ...' lines."""
    names = {_TOOLS[t] for t in _TOOLS if t in text}
    if kind is None:
        if len(names) != 1:
            seen = f"several: {', '.join(sorted(names))}" if names else "no tool name such as all_reduce_perf in it"
            raise ValueError(f"{source}: cannot tell the collective ({seen}): name it, e.g. --comm-table allreduce=FILE")
        kind = names.pop()
    header = None
    rows = []
    for line in text.splitlines():
        tokens = line.replace("#", " ").split()
        if line.lstrip().startswith("#") and tokens[:2] == ["size", "count"] and "busbw" in tokens:
            header = tokens
        elif header and not line.lstrip().startswith("#") and tokens and tokens[0].isdigit():
            if len(tokens) <= header.index("busbw"):
                continue
            try:
                rows.append((int(tokens[0]), float(tokens[header.index("busbw")])))
            except ValueError:
                continue
    if header is None:
        raise ValueError(f"{source}: no nccl-tests header line ('#  size  count  type ... busbw') found")
    rows = sorted({s: b for s, b in rows if s > 0 and b > 0}.items())
    if not rows:
        raise ValueError(f"{source}: no data rows with a positive size and busbw under the header")
    ranks = len(set(re.findall(r"^#\s+Rank\s+(\d+)", text, flags=re.M)))
    return BusTable(kind, tuple(s for s, _ in rows), tuple(b for _, b in rows), ranks or 8,
                    f"{source} ({len(rows)} sizes, {ranks or 'unknown, taken as 8'} ranks)")


class _BadTable(ValueError):
    pass


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def comm_table_spec(spec: str) -> tuple[str, str]:
    """(kind, path) of `[KIND=]FILE` ("" where no kind is named)."""
    head, sep, tail = spec.partition("=")
    return (head, tail) if sep and "/" not in head else ("", spec)


def read_comm_table(spec: str) -> dict:
    """kind -> BusTable from `[KIND=]FILE`: nccl-tests' text output, or JSON
    {"source": ..., "tables": {kind: {"sizes": [bytes...], "busbw_gbps": [...], "ranks": n}}}."""
    kind, path = comm_table_spec(spec)
    if kind and kind not in KINDS:
        raise ValueError(f"--comm-table={spec!r}: kind expected one of {', '.join(KINDS)}, got {kind!r}")
    if not os.path.isfile(path):   # (never opened: a named pipe would block)
        raise ValueError(f"--comm-table={spec!r}: {path!r} is not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--comm-table={spec!r}: not readable ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--comm-table={spec!r}: not text (expected nccl-tests output or JSON)") from None
    if not text.lstrip().startswith("{"):
        return {(t := parse_nccl_tests(text, kind or None, f"nccl-tests output {path}")).kind: t}
    try:
        data = json.loads(text)
        source = data.get("source", path)
        out = {}
        for k, t in data["tables"].items():
            sizes, bw, ranks = t["sizes"], t["busbw_gbps"], t.get("ranks", 8)
            for name, values, integer in (("sizes", sizes, True), ("busbw_gbps", bw, False)):
                if not isinstance(values, list) or not all(_finite(v) and (not integer or v == int(v)) for v in values):
                    unit = "whole numbers of bytes" if integer else "GB/s"
                    raise _BadTable(f"table {k!r}: {name} expected a list of {unit}, got {values!r}")
            if not (_finite(ranks) and ranks == int(ranks) and ranks >= 2):
                raise _BadTable(f"table {k!r}: ranks expected a whole number >= 2 (the ranks it was measured on), "
                                 f"got {ranks!r}")
            out[k] = BusTable(k, tuple(int(v) for v in sizes), tuple(float(b) for b in bw), int(ranks),
                              f"{source} ({path})")
    except _BadTable as e:
        raise ValueError(f"--comm-table={spec!r}: {e}") from None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"--comm-table={spec!r}: expected nccl-tests output or JSON "
                         f"{{'tables': {{kind: {{'sizes', 'busbw_gbps'}}}}}}, got {type(e).__name__}: {e}") from None
    if kind:
        out = {kind: out[kind]} if kind in out else {}
    if not out:
        raise ValueError(f"--comm-table={spec!r}: no table{' for ' + kind if kind else ''} in it")
    return out
