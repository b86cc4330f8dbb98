"""The command line's refusals and its output files.

Every refusal is one line naming the thing, what was expected and what came
(ArgParser for the options' syntax). An output path is checked before any
work (check_writable: never opens it, so it cannot block on a named pipe or
touch what is there) and written whole or not at all (write_output: a
temporary file in the same folder, then renamed over the path). "-" is
standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile


class ArgParser(argparse.ArgumentParser):
    """argparse with its refusals in one line, as every other refusal (no usage block)."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (--help lists the options)\n")


def _target(path: str) -> str:
    """Where writing `path` lands: through a symbolic link, the file it names."""
    return os.path.realpath(path) if os.path.islink(path) else path


def check_writable(path: str | None, option: str) -> None:
    """Refuse now, not after the work, an output path that cannot take a file:
    empty, a directory, a dangling link, something other than a regular file
    (a named pipe, a device), or in a folder where no file can be made. Only
    the folder is written to (a temporary file, removed at once)."""
    if path is None or path == "-":
        return
    if not path.strip():
        raise ValueError(f"{option}={path!r}: an empty path; give a file name (or - for standard output)")
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(f"{option}={path!r}: a symbolic link to {os.readlink(path)!r}, which does not exist; "
                         f"give a file name")
    target = _target(path)
    if os.path.isdir(target):
        raise ValueError(f"{option}={path!r}: is a directory; give a file name")
    if os.path.exists(target) and not stat.S_ISREG(os.stat(target).st_mode):
        raise ValueError(f"{option}={path!r}: not a regular file (a pipe, socket or device); give a file name")
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        raise ValueError(f"{option}={path!r}: its folder {folder!r} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tpfuser-check-"):
            pass
    except OSError as e:
        raise ValueError(f"{option}={path!r}: no file can be written in {folder!r} ({e.strerror})") from None
    if os.path.exists(target) and not os.access(target, os.W_OK):
        raise ValueError(f"{option}={path!r}: exists and is not writable")


def write_output(path: str, text: str, option: str = "output") -> None:
    """Write text to path whole (a temporary file beside it, renamed over it),
    or to standard output for "-". On failure (a full disk, say) nothing is
    left behind and the error is one line naming the path."""
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    target = _target(path)
    folder = os.path.dirname(os.path.abspath(target))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise ValueError(f"{option}={path!r}: could not be written ({e.strerror or e}); nothing was written") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str, data, option: str = "--json") -> None:
    write_output(path, json.dumps(data, indent=1) + "\n", option)
