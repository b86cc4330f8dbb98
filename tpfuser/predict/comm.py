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

A ring's P2P steps (kinds "sendrecv": NCCL's send/recv, "copyengine": the
copy engine's) are one send of `nbytes` between two GPUs: by default a
P2PLink, latency + nbytes / bandwidth, each figure published (published.py);
or a measured table (nccl-tests' sendrecv_perf, whose busbw is its algbw),
time = nbytes / busbw(nbytes) with the same interpolation.

The default interconnects run NCCL with NVLink multicast off
(NCCL_NVLS_ENABLE=0, as on the machines this project gets): ring curves for
every collective. h100-nvlink-nvls keeps NCCL's NVLS all-reduce (multicast on).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from tpfuser.predict import published
from tpfuser.strict_json import MAX_BYTES, parse_json

KINDS = ("allreduce", "allgather", "reducescatter")
# A ring's P2P steps (nvFuser's send/recv), by the communicator backend that moves them.
P2P_KINDS = ("sendrecv", "copyengine")
P2P_BY_BACKEND = {"nccl": "sendrecv", "cuda": "copyengine"}
ALL_KINDS = KINDS + P2P_KINDS


def algorithm_factor(kind: str, ranks: int) -> float:
    """Bytes each rank sends per byte of the tensor (ring algorithms); a P2P send: all of it."""
    if kind not in ALL_KINDS:
        raise ValueError(f"collective kind {kind!r}: expected one of {', '.join(ALL_KINDS)}")
    if kind in P2P_KINDS:
        return 1.0
    return (2.0 if kind == "allreduce" else 1.0) * (ranks - 1) / ranks


def algorithm_bytes(kind: str, nbytes: float, ranks: int) -> float:
    """What each rank sends for a tensor of nbytes: 2(n-1)/n of it for an all-reduce, (n-1)/n otherwise."""
    return algorithm_factor(kind, ranks) * nbytes


@dataclass(frozen=True)
class BusTable:
    """One collective's bus bandwidth (GB/s) at message sizes (bytes), ascending; `source` says where from.
    A P2P kind's (nccl-tests' sendrecv_perf, a copy engine's): what one send moves a second, busbw = algbw."""

    kind: str
    sizes: tuple[int, ...]
    busbw_gbps: tuple[float, ...]
    ranks: int = 8
    source: str = ""

    def __post_init__(self):
        where = f"bus table {self.kind!r}"
        if self.kind not in ALL_KINDS:
            raise ValueError(f"{where}: kind expected one of {', '.join(ALL_KINDS)}")
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

    def time_ms(self, nbytes: float, ranks: int = 2) -> float:
        """One collective of a tensor of nbytes over `ranks` ranks, ms; 0 for a team of one."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        size = max(nbytes, self.sizes[0])   # the latency floor below the table
        return algorithm_bytes(self.kind, size, ranks) / (self.busbw(size) * 1e9) * 1e3

    def as_dict(self) -> dict:
        return {"sizes": list(self.sizes), "busbw_gbps": list(self.busbw_gbps), "ranks": self.ranks,
                "source": self.source}


@dataclass(frozen=True)
class P2PLink:
    """One P2P send of nbytes between two GPUs over one NVLink path: latency + nbytes / bandwidth."""

    kind: str                # P2P_KINDS
    latency_us: float
    bandwidth_gbps: float
    source: str = ""

    def time_ms(self, nbytes: float, ranks: int = 2) -> float:
        return 0.0 if nbytes <= 0 else self.latency_us * 1e-3 + nbytes / (self.bandwidth_gbps * 1e9) * 1e3

    def as_dict(self) -> dict:
        return {"latency_us": self.latency_us, "bandwidth_gbps": self.bandwidth_gbps, "source": self.source}


@dataclass(frozen=True)
class Interconnect:
    name: str
    tables: dict   # kind -> BusTable (a collective's, or a P2P kind's) or P2PLink
    source: str
    curves: str = ""   # which algorithms the collectives' tables were measured with, in words

    def time_ms(self, kind: str, nbytes: float, ranks: int) -> float:
        if kind not in self.tables:
            raise ValueError(f"interconnect {self.name!r}: no {kind} table (it has {', '.join(self.tables)})")
        return self.tables[kind].time_ms(nbytes, ranks)

    def p2p_ms(self, backend: str, nbytes: float) -> float:
        """One P2P step of a ring over nvFuser's communicator backend `backend`, ms."""
        if backend not in P2P_BY_BACKEND:
            raise ValueError(f"--predict: a ring over backend {backend!r} is not modelled: expected one of "
                             f"{', '.join(P2P_BY_BACKEND)} (NCCL send/recv, the copy engine)")
        return self.time_ms(P2P_BY_BACKEND[backend], nbytes, 2)

    def replace(self, tables: dict, name: str | None = None) -> "Interconnect":
        merged = {**self.tables, **tables}
        return Interconnect(name or f"{self.name}+given", merged, _sources(merged),
                            f"{self.curves}; given for {', '.join(tables)} (--comm-table)")


def _sources(tables: dict) -> str:
    return "; ".join(f"{k}: {t.source}" for k, t in tables.items())


def _table(kind: str, points, source: str) -> BusTable:
    return BusTable(kind, tuple(s for s, _ in points), tuple(b for _, b in points), 8, source)


MULTICAST_OFF = f"NCCL ring curves, NVLink multicast off: {published.RING_SETTINGS}"
MULTICAST_ON = ("all-reduce: NCCL NVLS, NVLink multicast on (NCCL_NVLS_ENABLE=1); all-gather and reduce-scatter: "
                f"ring, {published.RING_SETTINGS}")


def _nvlink(name: str) -> Interconnect:
    """An 8-GPU NVLink 4 node, every table from the H100 node's published output:
    h100-nvlink and h200-nvlink (the same figures, said to be H100's) with NVLink
    multicast off (ring curves), h100-nvlink-nvls its NVLS all-reduce."""
    nvls = name.endswith("-nvls")
    points = {"allreduce": published.ALLREDUCE_RING[:3] + published.ALLREDUCE_NVLS if nvls
              else published.ALLREDUCE_RING,
              "allgather": published.ALLGATHER_RING, "reducescatter": published.REDUCESCATTER_RING}
    sources = {**published.SOURCES, "allreduce": published.SOURCES["allreduce-nvls" if nvls else "allreduce"]}
    sources |= {kind: source for kind, (_, _, source) in (("sendrecv", published.SENDRECV),
                                                          ("copyengine", published.COPYENGINE))}
    h200 = name.startswith("h200")
    if h200:
        sources = {kind: f"{source}; taken for H200" for kind, source in sources.items()}
    tables = {kind: _table(kind, points[kind], sources[kind]) for kind in KINDS}
    for kind, (latency, bandwidth, _) in (("sendrecv", published.SENDRECV), ("copyengine", published.COPYENGINE)):
        tables[kind] = P2PLink(kind, latency, bandwidth, sources[kind])
    return Interconnect(name, tables, f"{published.ON_H200}: " * h200 + _sources(tables),
                        MULTICAST_ON if nvls else MULTICAST_OFF)


INTERCONNECTS = {name: _nvlink(name) for name in ("h200-nvlink", "h100-nvlink", "h100-nvlink-nvls")}


def flat(busbw_gbps: float) -> Interconnect:
    """One bus bandwidth at every size and for every kind, P2P too (plan's --bandwidth): no latency term."""
    tables = {k: BusTable(k, (1,), (busbw_gbps,), 8, f"flat {busbw_gbps:g} GB/s (--bandwidth)") for k in ALL_KINDS}
    return Interconnect(f"flat-{busbw_gbps:g}", tables, f"flat {busbw_gbps:g} GB/s, as given (--bandwidth)",
                        "one flat rate, no latency (--bandwidth)")


def interconnect(name: str) -> Interconnect:
    if name not in INTERCONNECTS:
        raise ValueError(f"--interconnect={name!r}: expected one of {', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[name]


_TOOLS = {"all_reduce_perf": "allreduce", "all_gather_perf": "allgather", "reduce_scatter_perf": "reducescatter",
          "sendrecv_perf": "sendrecv"}


def parse_nccl_tests(text: str, kind: str | None = None, source: str = "nccl-tests output") -> BusTable:
    """A BusTable from nccl-tests' text output: the out-of-place busbw column of
    each data row, by the header line's columns; the kind from `kind` or the
    tool's name in the text (all_reduce_perf, ...), which a kind given must
    agree with where the text names one; the ranks from its '#  Rank N ...' lines."""
    names = {_TOOLS[t] for t in _TOOLS if t in text}
    if kind is None:
        if len(names) != 1:
            seen = f"several: {', '.join(sorted(names))}" if names else "no tool name such as all_reduce_perf in it"
            raise ValueError(f"{source}: cannot tell the collective ({seen}): name it, e.g. --comm-table allreduce=FILE")
        kind = names.pop()
    elif names and kind not in names:   # a kind named for output the file says is of another collective
        tools = " and ".join(sorted(t for t, k in _TOOLS.items() if k in names))
        raise ValueError(f"{source}: {tools}'s output, given as {kind}'s: name it {'='.join(sorted(names))}=FILE, "
                         f"or give {next(t for t, k in _TOOLS.items() if k == kind)}'s output")
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
    rows = sorted({s: b for s, b in rows if 0 < s < 1 << 63 and b > 0}.items())
    if not rows:
        raise ValueError(f"{source}: no data rows with a positive size (below 2**63) and busbw under the header")
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
    """kind -> BusTable from `[KIND=]FILE`: nccl-tests' text output (sendrecv_perf's: kind "sendrecv", what
    NCCL's send/recv moves a second), or JSON {"source": ..., "tables": {kind: {"sizes": [bytes...],
    "busbw_gbps": [...], "ranks": n}}}, where kind "copyengine" is one copy-engine P2P send at each size."""
    kind, path = comm_table_spec(spec)
    if kind and kind not in ALL_KINDS:
        raise ValueError(f"--comm-table={spec!r}: kind expected one of {', '.join(ALL_KINDS)}, got {kind!r}")
    if not os.path.isfile(path):   # (never opened: a named pipe would block)
        raise ValueError(f"--comm-table={spec!r}: {path!r} is not a regular file")
    if os.path.getsize(path) > MAX_BYTES:   # (refused unread: nccl-tests' output is a few KB)
        raise ValueError(f"--comm-table={spec!r}: {os.path.getsize(path)} bytes; expected at most {MAX_BYTES} "
                         f"(nccl-tests output or a JSON table)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--comm-table={spec!r}: not readable ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--comm-table={spec!r}: not text (expected nccl-tests output or JSON)") from None
    if not text.lstrip().startswith("{"):
        return {(t := parse_nccl_tests(text, kind or None, f"nccl-tests output {path}")).kind: t}
    data = parse_json(text, f"--comm-table={spec!r}")
    try:
        source = data.get("source", path)
        out = {}
        for k, t in data["tables"].items():
            sizes, bw, ranks = t["sizes"], t["busbw_gbps"], t.get("ranks", 2 if k in P2P_KINDS else 8)
            for name, values, integer in (("sizes", sizes, True), ("busbw_gbps", bw, False)):
                if not isinstance(values, list) or not all(_finite(v) and (not integer or v == int(v) and v < 1 << 63)
                                                           for v in values):
                    unit = "whole numbers of bytes" if integer else "GB/s"
                    raise _BadTable(f"table {k!r}: {name} expected a list of {unit}, got {values!r}"
                                    + (" (a size below 2**63 each)" if integer else ""))
            if not (_finite(ranks) and ranks == int(ranks) and ranks >= 2):
                raise _BadTable(f"table {k!r}: ranks expected a whole number >= 2 (the ranks it was measured on), "
                                 f"got {ranks!r}")
            out[k] = BusTable(k, tuple(int(v) for v in sizes), tuple(float(b) for b in bw), int(ranks),
                              f"{source} ({path})")
    except _BadTable as e:
        raise ValueError(f"--comm-table={spec!r}: {e}") from None
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"--comm-table={spec!r}: expected nccl-tests output or JSON "
                         f"{{'tables': {{kind: {{'sizes', 'busbw_gbps'}}}}}}, got {type(e).__name__}: {e}") from None
    if kind:
        out = {kind: out[kind]} if kind in out else {}
    if not out:
        raise ValueError(f"--comm-table={spec!r}: no table{' for ' + kind if kind else ''} in it")
    return out
