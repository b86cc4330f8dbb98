"""JSON as the program reads it: only what a file of ours can sensibly hold.

Python's json takes a key given twice (keeping the last: the first entry
vanishes without a word), NaN and Infinity where a number is due (and 1e999,
read as inf), an integer of thousands of digits (refused by int() with a
message naming neither file nor field), nesting as deep as the recursion
limit allows (then a RecursionError), and a file of any size (read whole
first). parse_json refuses each of them in one line naming the file and the
field; read_json refuses a file over its bound before reading a byte of it.
"""

from __future__ import annotations

import json
import math
import os
import re

MAX_DEPTH = 32        # a schedule is 3 levels deep, a calibration 8, a bench report 4
MAX_DIGITS = 20       # an integer's digits: 2**64 has 20
MAX_BYTES = 16 << 20  # a calibration is some 40 KB, a bench report some 100 KB
# A string (its escapes included) or a bracket, in JSON text: what nesting is counted from.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"\s*:?|[\[\]{}]', re.S)


class _Twice(dict):
    """An object in which a key came more than once (the first such key kept, for the refusal)."""

    def __init__(self, pairs, key):
        super().__init__(pairs)
        self.twice = key


class _Number(str):
    """A number's text that no finite float or bounded int holds."""


def _object(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            return _Twice(pairs, key)
        seen[key] = value
    return seen


def _float(text: str):
    value = float(text)
    return value if math.isfinite(value) else _Number(text)


def _int(text: str):
    return _Number(text) if len(text.lstrip("-")) > MAX_DIGITS else int(text)


def _field(path: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else str(p) for i, p in enumerate(path)) or \
        "(the top level)"


def _depth_refusal(text: str) -> str | None:
    """Where the text nests deeper than MAX_DEPTH: the field (its first keys) and the line."""
    keys: list = []   # the key each open object or list was opened under (None: a list's item, the top)
    pending = None
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token[0] == '"':
            pending = token[1:token.rindex('"')] if token.rstrip().endswith(":") else None
            continue
        if token in "[{":
            keys.append(pending)
            if len(keys) > MAX_DEPTH:
                line = text.count("\n", 0, match.start()) + 1
                shown = "".join(f".{k}" if k is not None else "[]" for k in keys[1:5]).lstrip(".")
                return (f"field {shown + ' ...'!r}: nested deeper than {MAX_DEPTH} levels (line {line}); "
                        f"expected at most {MAX_DEPTH}")
        elif keys:
            keys.pop()
        pending = None
    return None


def _walk(value, path: list) -> str | None:
    """The first field the parse marked (a key twice, a number out of bounds), as a refusal; or None."""
    if isinstance(value, _Number):
        what = f"a number of at most {MAX_DIGITS} digits" if re.fullmatch(r"-?[0-9]+", value) else "a finite number"
        shown = value if len(value) <= 24 else f"a {len(value.lstrip('-'))}-digit integer"
        return f"field {_field(path)!r}: expected {what}, got {shown}"
    if isinstance(value, _Twice):
        return (f"field {_field(path + [value.twice])!r} given twice (JSON would keep the last, the first "
                f"dropped without a word); expected each key once")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (refusal := _walk(item, path + [key])) is not None:
            return refusal
    return None


class Refused(ValueError):
    """What strict_loads refuses in JSON that parses: the field and what is wrong with it (no file named)."""


def strict_loads(text: str):
    """json.loads, but a key given twice, a number not finite or too long, or
    nesting too deep is a Refused naming the field (not JSON at all: json's
    JSONDecodeError, as json.loads raises it)."""
    if (deep := _depth_refusal(text)) is not None:
        raise Refused(deep)
    value = json.loads(text, object_pairs_hook=_object, parse_float=_float, parse_int=_int, parse_constant=_Number)
    if (refusal := _walk(value, [])) is not None:
        raise Refused(refusal)
    return value


def parse_json(text: str, where: str, error: type[ValueError] = ValueError):
    """The value JSON text holds, or one line "WHERE: ..." naming the field that
    is wrong (strict_loads) or saying the text is not JSON."""
    try:
        return strict_loads(text)
    except Refused as e:
        raise error(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        raise error(f"{where}: not readable as JSON ({e})") from None


def read_json(path: str, what: str, error: type[ValueError] = ValueError, max_bytes: int = MAX_BYTES):
    """The JSON a file holds, or one line naming it (`what` the file is:
    "schedule file", "calibration") where it is not a readable JSON file, is
    larger than max_bytes (refused before it is read), or holds what
    parse_json refuses."""
    where = f"{what} {path!r}"
    if not os.path.isfile(path):   # (never opened: a named pipe would block)
        raise error(f"{where}: not a file")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise error(f"{where}: {size} bytes; expected at most {max_bytes} (a {what} is far smaller)")
            text = f.read(max_bytes + 1).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{where}: not readable as JSON ({e})") from None
    return parse_json(text, where, error)
