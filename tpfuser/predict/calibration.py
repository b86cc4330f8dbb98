"""The calibration: one rank's pieces of the block, timed on one GPU at that
rank's local shapes (tools/calibrate.py writes it), read and checked here.

    {"format": "tpfuser-calibration/1", "stand_in": false, "complete": true,
     "gpu", "sm_clock_mhz", "torch", "cuda", "date", "command", "commit", "timing",
     "presets": {"gpt3": {"config": {BlockConfig's fields},
        "tp": {"8": {"tp": {"forward": {piece: ms}, "backward": {piece: ms}},
                     "sp": {... the same pieces, the sequence-split ones on s/tp rows ...},
                     "whole": {"forward_ms", "backward_ms", "train_ms"},
                     "beside_copy": {"forward"|"backward": {gemm piece: {chunks: ratio}}}}}}}}

A GEMM piece holds {chunks: ms of all its chunks together} for chunks 1, 2, 4,
8 along the tokens (a linear's forward GEMM by its name; its backward's as
NAME.wgrad and NAME.dgrad); every other piece one ms. The pieces are eager
PyTorch at the rank's local shapes (no collective: a row-parallel linear's
partial sums are not reduced), each replayed from a CUDA graph. "whole" is the
rank's whole pass in plain PyTorch at tensor-parallel local shapes, timed the
same way: what the pieces' sum is checked against (check_sums). "beside_copy"
(optional): a GEMM's time beside a memory-bound copy on 32 CTAs on another
stream over its time alone, a rough stand-in for NCCL's SMs.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from tpfuser.block.form import LINEARS
from tpfuser.outputs import read_json

FORMAT = "tpfuser-calibration/1"
CHUNKS = (1, 2, 4, 8)
# In the order the passes run them (tools/calibrate.py's rank pass, block/forward.py, block/backward.py).
FORWARD_PIECES = ("ln_1", "attn.c_attn", "qkv_split", "attention", "heads_join", "attn.c_proj", "resid_attn",
                  "ln_2", "mlp.c_fc", "gelu", "mlp.c_proj", "resid_mlp")
BACKWARD_PIECES = ("resid_mlp", "mlp.c_proj.wgrad", "mlp.c_proj.dgrad", "gelu", "mlp.c_fc.wgrad",
                   "mlp.c_fc.dgrad", "ln_2", "resid_attn", "attn.c_proj.wgrad", "attn.c_proj.dgrad",
                   "heads_join", "attention", "qkv_split", "attn.c_attn.wgrad", "attn.c_attn.dgrad", "ln_1")
PIECES = {"forward": FORWARD_PIECES, "backward": BACKWARD_PIECES}
# Pieces on the rank's part of the sequence (s/tp rows) under sequence parallelism; the rest see every token.
SEQUENCE_SPLIT = ("ln_1", "resid_attn", "ln_2", "resid_mlp")
WHOLE_FIELDS = ("forward_ms", "backward_ms", "train_ms")
CHECK_TOLERANCE = 0.10   # the issue's: the pieces' sum within 10 % of the whole pass


def is_gemm(piece: str) -> bool:
    return piece.removesuffix(".wgrad").removesuffix(".dgrad") in LINEARS


# The committed calibrations, in the checkout, in the order a preset is looked up (default_path).
COMMITTED = ("h200.json", "h100.json")


def default_path(preset: str | None = None, folder: str | None = None) -> str:
    """The first committed calibration (in `folder`, default the checkout's
    results/calibration) that holds `preset`: H200's, then H100's (nanogpt was
    timed on the H100 only); H200's where none does, or without a preset."""
    folder = folder or os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "results", "calibration")
    for name in COMMITTED if preset is not None else ():
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                if preset in (json.load(f).get("presets") or {}):
                    return path
        except (OSError, ValueError, AttributeError):   # missing or malformed: refused when it is read, if chosen
            continue
    return os.path.join(folder, COMMITTED[0])


class CalibrationError(ValueError):
    pass


def _refuse(path: str, field: str, expected: str, got) -> None:
    shown = got if not isinstance(got, (dict, list)) else type(got).__name__
    raise CalibrationError(f"calibration {path}: field {field!r}: expected {expected}, got {shown!r}")


def _ms(path: str, field: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        _refuse(path, field, "a positive, finite time in ms", value)
    return float(value)


def _count(key: str) -> bool:
    """A positive integer key in ASCII digits ("²" passes str.isdigit, not int())."""
    return re.fullmatch(r"[1-9][0-9]*", key) is not None


def _dict(path: str, field: str, value) -> dict:
    if not isinstance(value, dict):
        _refuse(path, field, "an object", value)
    return value


def _check_pass(path: str, where: str, data, kind: str) -> None:
    data = _dict(path, where, data)
    unknown = sorted(set(data) - set(PIECES[kind]))
    if unknown:
        _refuse(path, f"{where}.{unknown[0]}", f"a piece of the {kind} ({', '.join(PIECES[kind])})", unknown[0])
    for piece in PIECES[kind]:
        if piece not in data:
            _refuse(path, f"{where}.{piece}", "a piece's time (every piece of the pass)", None)
        if is_gemm(piece):
            times = _dict(path, f"{where}.{piece}", data[piece])
            if "1" not in times:
                _refuse(path, f"{where}.{piece}.1", "the whole GEMM's ms (chunks 1)", None)
            for chunks, ms in times.items():
                if not _count(chunks):
                    _refuse(path, f"{where}.{piece}.{chunks}", "a chunk count (a positive integer key)", chunks)
                _ms(path, f"{where}.{piece}.{chunks}", ms)
        else:
            _ms(path, f"{where}.{piece}", data[piece])


def validate(data, path: str) -> None:
    """Refuse, in one line naming the field, what is not a calibration."""
    _dict(path, "(the file)", data)
    if data.get("format") != FORMAT:
        _refuse(path, "format", repr(FORMAT), data.get("format"))
    for name in ("gpu", "date", "commit"):
        if not isinstance(data.get(name), str) or not data[name]:
            _refuse(path, name, "a non-empty string", data.get(name))
    for name in ("stand_in", "complete"):
        if not isinstance(data.get(name, False), bool):
            _refuse(path, name, "true or false", data.get(name))
    for name in ("sm_clock_mhz", "sm_clock_mhz_after", "max_sm_clock_mhz"):   # read by the header, optional
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e5):
            _refuse(path, name, "a clock in MHz (a positive number) or null", value)
    presets = _dict(path, "presets", data.get("presets"))
    for preset, entry in presets.items():
        entry = _dict(path, f"presets.{preset}", entry)
        _dict(path, f"presets.{preset}.config", entry.get("config"))
        for tp, at in _dict(path, f"presets.{preset}.tp", entry.get("tp")).items():
            where = f"presets.{preset}.tp.{tp}"
            if not _count(tp):
                _refuse(path, where, "a tp size (a positive integer key)", tp)
            at = _dict(path, where, at)
            for par in ("tp", "sp"):   # sp: absent where the sequence does not split over tp
                if par == "sp" and "sp" not in at:
                    continue
                _dict(path, f"{where}.{par}", at.get(par))
                for kind in PIECES:
                    _check_pass(path, f"{where}.{par}.{kind}", at[par].get(kind), kind)
            whole = _dict(path, f"{where}.whole", at.get("whole"))
            for name in WHOLE_FIELDS:
                _ms(path, f"{where}.whole.{name}", whole.get(name))
            for kind, ratios in _dict(path, f"{where}.beside_copy", at.get("beside_copy", {})).items():
                if kind not in PIECES:
                    _refuse(path, f"{where}.beside_copy.{kind}", "forward or backward", kind)
                for piece, by_chunks in _dict(path, f"{where}.beside_copy.{kind}", ratios).items():
                    if piece not in PIECES[kind]:
                        _refuse(path, f"{where}.beside_copy.{kind}.{piece}", f"a piece of the {kind}", piece)
                    for chunks, ratio in _dict(path, f"{where}.beside_copy.{kind}.{piece}", by_chunks).items():
                        if not _count(chunks):
                            _refuse(path, f"{where}.beside_copy.{kind}.{piece}.{chunks}", "a chunk count", chunks)
                        if _ms(path, f"{where}.beside_copy.{kind}.{piece}.{chunks}", ratio) < 0.5:
                            _refuse(path, f"{where}.beside_copy.{kind}.{piece}.{chunks}",
                                    "a slowdown ratio near or above 1", ratio)


@dataclass(frozen=True)
class Pieces:
    """One rank's pieces at one tp and parallelism: ms(pass, piece, chunks)."""

    passes: dict        # kind -> {piece: ms or {chunks: ms}}
    beside: dict        # kind -> {piece: {chunks: ratio}}
    where: str          # for refusals

    def ms(self, kind: str, piece: str, chunks: int = 1) -> float:
        """The piece's time, ms; a GEMM's all chunks together."""
        value = self.passes[kind][piece]
        if not isinstance(value, dict):
            return value
        if str(chunks) not in value:
            raise CalibrationError(f"{self.where}: {kind} {piece} was timed at chunks "
                                   f"{', '.join(sorted(value, key=int))}, the schedule asks {chunks}")
        return value[str(chunks)]

    def slowdown(self, kind: str, piece: str, chunks: int) -> float | None:
        """Measured time beside the copy over alone, or None where not measured."""
        return self.beside.get(kind, {}).get(piece, {}).get(str(chunks))

    def scaled(self, factor: dict) -> "Pieces":
        """Every piece of a pass times factor[pass] (e.g. to make the pieces add up to the measured whole)."""
        times = lambda v, f: {c: ms * f for c, ms in v.items()} if isinstance(v, dict) else v * f   # noqa: E731
        return Pieces({k: {p: times(v, factor.get(k, 1.0)) for p, v in by.items()} for k, by in self.passes.items()},
                      self.beside, self.where + " scaled to the measured whole pass")

    def mean_slowdown(self) -> float | None:
        ratios = [r for by in self.beside.values() for c in by.values() for r in c.values()]
        return sum(ratios) / len(ratios) if ratios else None


class Calibration:
    def __init__(self, data: dict, path: str):
        validate(data, path)
        self.data, self.path = data, path

    @property
    def stand_in(self) -> bool:
        return bool(self.data.get("stand_in", False))

    def _at(self, preset: str, tp: int) -> dict:
        presets = self.data["presets"]
        if preset not in presets:
            raise CalibrationError(f"calibration {self.path} has no preset {preset!r} (it has "
                                   f"{', '.join(presets) or 'none'}): run tools/calibrate.py --preset {preset}")
        tps = presets[preset]["tp"]
        if str(tp) not in tps:
            early = "" if self.data.get("complete", True) else "; the run that made it stopped early"
            raise CalibrationError(f"calibration {self.path} has {preset} at tp {', '.join(sorted(tps, key=int)) or 'none'}"
                                   f", not at tp {tp}{early}: run tools/calibrate.py --preset {preset} --tp {tp}")
        return tps[str(tp)]

    def check_config(self, preset: str, config: dict) -> None:
        """Refuse a block other than the one calibrated (say, another dropout)."""
        have = self.data["presets"].get(preset, {}).get("config", {})
        for name, value in config.items():
            if name in have and have[name] != value:
                raise CalibrationError(f"calibration {self.path}: {preset} was timed with {name}={have[name]!r}, "
                                       f"the block here has {name}={value!r}")

    def pieces(self, preset: str, tp: int, sp: bool) -> Pieces:
        at = self._at(preset, tp)
        par = "sp" if sp else "tp"
        if par not in at:
            raise CalibrationError(f"calibration {self.path}: {preset} at tp {tp} has no sequence-parallel pieces "
                                   f"(its sequence does not split over tp {tp})")
        return Pieces(at[par], at.get("beside_copy", {}), f"calibration {self.path} ({preset}, tp {tp}, {par})")

    def whole(self, preset: str, tp: int) -> dict:
        return self._at(preset, tp)["whole"]

    def summary(self) -> dict:
        keys = ("gpu", "sm_clock_mhz", "sm_clock_mhz_after", "max_sm_clock_mhz", "torch", "cuda", "date", "commit",
                "command", "stand_in", "complete")
        return {"path": self.path, **{k: self.data.get(k) for k in keys}}


def read_calibration(path: str) -> Calibration:
    return Calibration(read_json(path, "calibration", CalibrationError), path)


def pass_sum(pieces: Pieces, kind: str) -> float:
    """The pass's pieces added up, each GEMM whole."""
    return sum(pieces.ms(kind, piece) for piece in PIECES[kind])


def check_sums(cal: Calibration, preset: str) -> list[dict]:
    """Per tp calibrated: the tensor-parallel pieces' sum against the measured
    whole pass, forward and backward; `within` is the 10 % check, and where it
    is off, `largest` names the pass's largest pieces (where to look)."""
    rows = []
    for tp in sorted(cal.data["presets"].get(preset, {}).get("tp", {}), key=int):
        pieces, whole = cal.pieces(preset, int(tp), False), cal.whole(preset, int(tp))
        for kind in PIECES:
            total, measured = pass_sum(pieces, kind), whole[f"{kind}_ms"]
            error = total / measured - 1
            row = {"tp": int(tp), "pass": kind, "pieces_ms": total, "whole_ms": measured, "error": error,
                   "within": abs(error) <= CHECK_TOLERANCE}
            if not row["within"]:
                ranked = sorted(PIECES[kind], key=lambda p: -pieces.ms(kind, p))[:3]
                row["largest"] = [[p, pieces.ms(kind, p)] for p in ranked]
            rows.append(row)
    return rows
