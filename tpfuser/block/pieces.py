"""One pass of the block (a forward or the backward) as one fusion or a few.

A pass is written once, on global shapes, as a function over a `Pieces`
builder. It reads its inputs by name (`b[name]`), names its outputs
(`b.output`) and marks the points where it may be cut (`b.cut(point, live)`).
At each point the caller asked for, the fusion so far ends and the next one
begins: what is live there leaves the first as its outputs and enters the
second as its inputs, by name. Each crossing tensor is one of tensors.py's, so
its placement on the mesh follows from its dimensions like any other's.
Without cuts the pass is one fusion.

Why cut: nvFuser's segmenter searches a fusion's expressions for kernels, at
a cost that grows steeply with their number; several small fusions compile in
far less time than one large one (NOTES.md). And a linear cut off on its own
is a fusion that a schedule can chunk into streams (parallel/overlapped.py).

The builder runs the definition twice: the first run records which inputs
each fusion reads; the second defines them up front, in the pass's declared
order (`order`), then what else each reads in table order. So a pass without
cuts is the very fusion a plain `with FusionDefinition()` would have written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from nvfuser_direct import FusionDefinition, ops

from tpfuser.block.tensors import TENSORS


@dataclass
class Piece:
    """One fusion of a pass: its inputs and outputs by name, in the fusion's
    order, and the tensors inside it that the schedule places (`placed`)."""

    point: str                     # the cut point it begins at; "" for a pass's first fusion
    fd: FusionDefinition
    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    placed: dict = field(default_factory=dict)
    derived: dict = field(default_factory=dict, repr=False)   # Pieces.derived's values
    kept: dict = field(default_factory=dict, repr=False)      # Pieces.keep's values
    laid_out: bool = False         # the schedule declared a memory layout of its own on one of its tensors
    twin: "Piece | None" = field(default=None, repr=False)    # an earlier fusion defined the same (share_twins)

    def execute(self, inputs: list, **options) -> list:
        """Run the fusion on `inputs` (in its order): its twin's compiled kernels where it has one."""
        return (self.twin or self).fd.execute(inputs, **options)


_TABLE_ORDER = {t.name: i for i, t in enumerate(TENSORS)}


class Pieces:
    """The builder a pass is written over (see the module's docstring).

    define_input(fd, name): defines the named input in fd (a tensor or a
    scalar) and returns it. cuts: the points to cut at. order: the names a
    fusion takes first, and returns first, in this order, where it has them.
    close(piece): called with each fusion before its definition ends (the
    schedule, which puts its tensors on the mesh)."""

    ops = ops   # nvFuser's operations act on the fusion being defined: `b.ops` is `fd.ops`

    def __init__(self, define_input: Callable, cuts: Iterable[str] = (), order: Iterable[str] = (),
                 close: Callable[[Piece], None] | None = None, _reads: list[list[str]] | None = None,
                 _values: list[set[str]] | None = None, hints: Iterable[str] = ()):
        self._define_input = define_input
        self.cuts, self.hints = frozenset(cuts), frozenset(hints)
        self._order = {name: i for i, name in enumerate(order)}
        self._close_hook = close
        self._reads = _reads
        self._values = _values
        self.reads: list[list[str]] = []     # per fusion, the inputs its definition read, in order
        self.values: list[set[str]] = []     # per fusion, the kept values (keep) it read by name
        self.points: list[str] = []          # every cut point the pass went through, cut or not
        self.pieces: list[Piece] = []
        self._open("")

    # -- what a definition calls ----------------------------------------
    def __getitem__(self, name: str):
        """The named input of the fusion being defined (defined at first use in it)."""
        piece = self.pieces[-1]
        if name not in piece.inputs:
            if self._reads is not None:
                raise AssertionError(f"{name}: read by fusion {len(self.pieces) - 1} of the pass now, "
                                     f"not when the pass was first run (the definition must be deterministic)")
            piece.inputs[name] = self._define_input(piece.fd, name)
        if name not in self.reads[-1]:
            self.reads[-1].append(name)
        return piece.inputs[name]

    def keep(self, name: str, tv):
        """Keep tv (tensors.py's `name`) for a later `value(name)`, perhaps in a
        later fusion: a fusion cut off after it returns it where one reads it."""
        self.pieces[-1].kept[name] = tv
        return tv

    def value(self, name: str):
        """A kept value: the tensor itself in the fusion that made it, an input
        (that fusion's output) in a later one."""
        self.values[-1].add(name)
        return self.pieces[-1].kept.get(name) if name in self.pieces[-1].kept else self[name]

    def derived(self, key: str, make: Callable[[], object]):
        """make(), once per fusion: a value derived from inputs alone (e.g. an
        input cast to fp32), made again in a later fusion rather than carried."""
        memo = self.pieces[-1].derived
        if key not in memo:
            memo[key] = make()
        return memo[key]

    def define_scalar(self, *args, **kwargs):
        """A constant (a symbolic scalar is an input: read it by name)."""
        scalar = self.pieces[-1].fd.define_scalar(*args, **kwargs)
        if scalar.is_symbolic():
            raise ValueError("a symbolic scalar is an input of the pass: define it through define_input")
        return scalar

    def output(self, name: str, tv) -> None:
        """Name tv an output of the pass. Where tv is an input of the fusion
        being defined (made by an earlier one), that one returns it already."""
        piece = self.pieces[-1]
        if piece.inputs.get(name) is tv:
            return
        if piece.outputs.setdefault(name, tv) is not tv:
            raise ValueError(f"{name}: named twice as an output, for two different tensors")

    def place(self, name: str, tv) -> None:
        """Have the schedule place tv, a tensor inside the fusion being defined (tensors.py's `name`)."""
        self.pieces[-1].placed[name] = tv

    def cut(self, point: str, live: dict[str, object]) -> list:
        """A point where the pass may be cut, with what is live there by name.
        Cut (point in `cuts`): the fusion so far returns what it made of
        `live`, and the next one reads all of it; hinted (in `hints`): each of
        `live` through a segment_set, nvFuser's mark that a kernel ends there;
        else `live` as it is."""
        self.points.append(point)
        if point in self.hints:
            return [ops.segment_set(tv) for tv in live.values()]
        if point not in self.cuts:
            return list(live.values())
        for name, tv in live.items():
            self.output(name, tv)
        self._close()
        self._open(point)
        return [self[name] for name in live]

    # -- the pass, once defined ------------------------------------------
    def finish(self) -> list[Piece]:
        """End the last fusion; the pass's fusions in order. A cut asked for
        that the pass does not have is refused, naming the ones it has."""
        self._close()
        unknown = sorted(self.cuts - set(self.points))
        if unknown:
            raise ValueError(f"cuts {unknown}: not cut points of this pass (its points: {', '.join(self.points)})")
        return self.pieces

    def _open(self, point: str) -> None:
        fd = FusionDefinition()
        fd.__enter__()
        piece = Piece(point, fd)
        self.pieces.append(piece)
        self.reads.append([])
        self.values.append(set())
        if self._reads is not None:   # the second run: this fusion's inputs up front, in order
            for name in sorted(self._reads[len(self.pieces) - 1], key=self._rank):
                piece.inputs[name] = self._define_input(fd, name)

    def _rank(self, name: str) -> tuple[int, int, str]:
        if name in self._order:
            return (0, self._order[name], name)
        return (1, _TABLE_ORDER.get(name, len(_TABLE_ORDER)), name)

    def _close(self) -> None:
        """The fusion's outputs in order (as the inputs), placed, and its definition ended.
        Its kept values leave it where a later fusion reads them (the first run
        cannot know yet: all of them)."""
        piece = self.pieces[-1]
        index = len(self.pieces) - 1
        for name, tv in piece.kept.items():
            if self._values is None or any(name in read for read in self._values[index + 1:]):
                self.output(name, tv)
        made = list(piece.outputs)   # the order they were named in
        piece.outputs = {name: piece.outputs[name]
                         for name in sorted(made, key=lambda n: (n not in self._order, self._order.get(n, made.index(n))))}
        for tv in piece.outputs.values():
            piece.fd.add_output(tv)
        if self._close_hook is not None:
            self._close_hook(piece)
        piece.fd.__exit__(None, None, None)


def build_pieces(define: Callable[[Pieces], object], define_input: Callable, cuts: Iterable[str] = (),
                 order: Iterable[str] = (), close: Callable[[Piece], None] | None = None, hints: Iterable[str] = ()):
    """(the pass's fusions, what `define` returned): `define(b)` run twice
    (the module's docstring says why), the second time with `close` applied."""
    first = Pieces(define_input, cuts, order, hints=hints)
    define(first)
    first.finish()
    second = Pieces(define_input, cuts, order, close, _reads=first.reads, _values=first.values, hints=hints)
    result = define(second)
    return second.finish(), result
