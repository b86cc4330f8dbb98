"""The command line's refusals and its output files.

Every refusal is one line naming the thing, what was expected and what came
(ArgParser for the options' syntax). An output path is checked before any
work (check_writable: never opens it, so it cannot block on a named pipe or
touch what is there) and written whole or not at all (write_output: a
temporary file in the same folder, then renamed over the path, with the
mode the file had; through a symbolic link, the file it names; SIGINT,
SIGTERM or SIGHUP during the write leave nothing beside it). "-" is
standard output, where it makes sense: not for an image (check_writable's
stdout). An output's format follows its name: a figure is written in the
format its suffix names (figure_format), and a name whose suffix asks for
another format than the option writes is refused (check_writable's kind).

Deferred: matplotlib (optional: only a figure needs it), imported where a figure's format is checked or saved.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import stat
import sys
import tempfile
import threading

from tpfuser.strict_json import read_json  # noqa: F401 (re-exported: the readers of schedule files, calibrations)


class ArgParser(argparse.ArgumentParser):
    """argparse with its refusals in one line, as every other refusal (no usage
    block); an empty value for an option (an unset shell variable, say) is
    refused, not taken as the option's default (output paths: check_writable)."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (--help lists the options)\n")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(namespace, action.dest, None) if action.option_strings else None
            values = value if isinstance(value, list) else [value]
            if action.dest not in _PATHS_CHECKED and any(isinstance(v, str) and not v.strip() for v in values):
                given = next(v for v in values if isinstance(v, str) and not v.strip())
                self.error(f"{action.option_strings[-1]}={given!r}: an empty value; give one, or leave the option "
                           f"out for its default")
        return namespace, extras


_PATHS_CHECKED = {"json", "png", "out"}   # output paths: check_writable says what is wrong with them
# Suffixes that ask for a format other than JSON: an image's (matplotlib's formats) or another text format's.
NOT_JSON = ("avif", "eps", "gif", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif", "tiff",
            "webp", "csv", "tsv", "html", "xml", "yaml", "yml", "toml")


def _target(path: str) -> str:
    """Where writing `path` lands: through a symbolic link, the file it names."""
    return os.path.realpath(path) if os.path.islink(path) else path


def _name_max(folder: str) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _suffix(path) -> str:
    return os.path.splitext(os.fspath(path))[1].lower().lstrip(".")


def figure_format(path, option: str = "--png") -> str:
    """The format a figure at `path` is written in: its suffix's (none: png),
    refused in one line where matplotlib writes no such format or is not installed."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError(f"{option}={path!r}: a figure needs matplotlib, which is not installed here "
                         f"(pip install matplotlib)") from None
    known = FigureCanvasBase.get_supported_filetypes()
    if _suffix(path) and _suffix(path) not in known:
        raise ValueError(f"{option}={path!r}: matplotlib writes no {_suffix(path)!r} figure; expected a name ending in "
                         f"{', '.join('.' + k for k in sorted(known))}")
    return _suffix(path) or "png"


def save_figure(fig, path, option: str = "--png", dpi: int = 110) -> None:
    """Write a matplotlib figure in the format its name asks for (figure_format),
    whole or not at all (replacing, with the same suffix), then close it."""
    import matplotlib.pyplot as plt
    try:
        fmt = figure_format(path, option)
        with replacing(path, option, suffix="." + fmt) as tmp:
            fig.savefig(tmp, dpi=dpi, format=fmt)
    finally:
        plt.close(fig)


def check_writable(path, option: str, stdout: bool | None = None, kind: str | None = None) -> None:
    """Refuse now, not after the work, an output path that cannot take a file:
    empty, a directory (or a name ending in /), a dangling link, something
    other than a regular file (a named pipe, a device), a name too long, or in
    a folder that is not there or where no file can be made. It never opens
    the path (a named pipe would block) and changes nothing there: only the
    folder is written to (a temporary file, removed at once). stdout: whether
    "-" (standard output) is taken; by default it is, except for an option
    writing an image (--png: bytes for a terminal or beside the command's text).
    kind: what is written, "figure" (its name's suffix a format matplotlib
    writes) or "json" (not a suffix of NOT_JSON); by default the option's
    (--png a figure, --json JSON)."""
    if path is None:
        return
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{option}={path!r}: expected a path (str), got {type(path).__name__}")
    path = os.fspath(path)
    if stdout is None:
        stdout = not option.endswith("png")
    kind = kind or ("figure" if option.endswith("png") else "json" if option.endswith("json") else None)
    if path == "-":
        if not stdout:
            raise ValueError(f"{option}='-': an image is not written to standard output; give a file name")
        return
    if not path.strip():
        raise ValueError(f"{option}={path!r}: an empty path; give a file name (or - for standard output)"
                         if stdout else f"{option}={path!r}: an empty path; give a file name")
    if re.match(r"/dev/|/proc/[^/]+/fd/", os.path.abspath(path)):   # /dev/stdout: what it redirects to is renamed over
        raise ValueError(f"{option}={path!r}: a device or stream, not a file to write whole; "
                         + ("use - for standard output" if stdout else "give a file name"))
    try:
        if os.path.islink(path) and not os.path.exists(path):
            raise ValueError(f"{option}={path!r}: a symbolic link to {os.readlink(path)!r}, which does not exist "
                             f"(or is a loop of links); give a file name")
        target = _target(path)
        if os.path.isdir(target):
            raise ValueError(f"{option}={path!r}: is a directory; give a file name")
        if path.endswith(os.sep):
            raise ValueError(f"{option}={path!r}: ends in {os.sep!r}, a folder's name; give a file name")
        if os.path.exists(target) and not stat.S_ISREG(os.stat(target).st_mode):
            raise ValueError(f"{option}={path!r}: not a regular file (a pipe, socket or device); give a file name")
        folder = os.path.dirname(os.path.abspath(target))
        if not os.path.isdir(folder):
            up = folder
            while up and not os.path.lexists(up):
                up = os.path.dirname(up) if os.path.dirname(up) != up else ""
            raise ValueError(f"{option}={path!r}: its folder {folder!r} does not exist"
                             + (f" ({up!r} is a file, not a folder)" if up and not os.path.isdir(up) else ""))
        name_max = _name_max(folder)
        if len(os.fsencode(os.path.basename(target))) > name_max:
            raise ValueError(f"{option}={path!r}: its name is {len(os.fsencode(os.path.basename(target)))} bytes "
                             f"long; expected at most {name_max}")
    except OSError as e:   # a folder on the way that cannot be searched, say
        raise ValueError(f"{option}={path!r}: cannot be looked at ({e.strerror or e})") from None
    try:
        with signals_raise(), held():   # (ended while the probe is there, it would stay)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".tpfuser-check-"):
                pass
    except OSError as e:
        raise ValueError(f"{option}={path!r}: no file can be written in {folder!r} ({e.strerror})") from None
    if os.path.exists(target) and not os.access(target, os.W_OK):
        raise ValueError(f"{option}={path!r}: exists and is not writable")
    if kind == "figure":
        figure_format(path, option)
    elif kind == "json" and _suffix(path) in NOT_JSON:
        raise ValueError(f"{option}={path!r}: its name asks for a {_suffix(path)!r} file, and this writes JSON; "
                         f"give a name ending in .json")


def check_distinct(outputs: dict, inputs: dict) -> None:
    """Refuse an output path that names an input file, or another output (each
    by its option): writing it would destroy what the command reads, or what it
    wrote a moment before."""
    def same(a, b):
        try:
            return os.path.samefile(a, b) if os.path.exists(a) and os.path.exists(b) else \
                os.path.realpath(a) == os.path.realpath(b)
        except OSError:
            return False
    named = [(o, p) for o, p in outputs.items() if p not in (None, "-", "")]   # ("": check_writable's to refuse)
    for i, (option, path) in enumerate(named):
        for other, given in [*((k, v) for k, vs in inputs.items() for v in (vs if isinstance(vs, list) else [vs])),
                             *named[:i]]:
            if given not in (None, "-", "") and same(path, given):
                raise ValueError(f"{option}={path!r}: the same file as {other}={given!r}; give another file name")


class Signalled(BaseException):
    """SIGTERM or SIGHUP came while an output was being written (signals_raise):
    raised there, as KeyboardInterrupt is for SIGINT, so that what the write
    made beside the output is removed before the process ends."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def line(self) -> str:
        return f"ended by {signal.Signals(self.signum).name}: no output was left half-written"


def _raise_signalled(signum, frame):
    raise Signalled(signum)


ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_raise():
    """SIGTERM and SIGHUP raise Signalled while the body runs, where they would
    end the process at once (their default disposition: no finally clause runs);
    a handler of the program's own, or an ignored signal, is left as it is."""
    if threading.current_thread() is not threading.main_thread():   # (handlers are the main thread's)
        yield
        return
    previous = {sig: signal.signal(sig, _raise_signalled) for sig in ENDING[1:]
                if signal.getsignal(sig) == signal.SIG_DFL}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def held():
    """The ending signals held while the body runs (delivered at its end): for
    the steps between making a file and knowing to remove it."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ENDING)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)   # (not thread-safe: only where /proc says nothing)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def replacing(path, option: str = "output", suffix: str = ".tmp"):
    """Yield a temporary path beside `path` (through a symbolic link: beside
    the file it names), ending in `suffix`, for the caller to write whole;
    then flush it to disk and rename it over the path, with the mode the file
    had (a new one: as open() makes it). On any failure, or an interrupt, the
    temporary file is removed and the path left as it was; an OSError becomes
    a one-line ValueError naming the path."""
    path = os.fspath(path)
    target = _target(path)
    folder = os.path.dirname(os.path.abspath(target))
    # the temporary file's name: the target's, cut to fit the folder's limit with the random part and suffix
    stem = os.fsencode("." + os.path.basename(target) + ".")[: max(1, _name_max(folder) - 16 - len(os.fsencode(suffix)))]
    tmp = None
    with signals_raise():
        try:
            with held():   # (a signal here would come between making the file and knowing its name)
                fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.fsdecode(stem), suffix=suffix)
                try:
                    mode = stat.S_IMODE(os.stat(target).st_mode) if os.path.exists(target) else 0o666 & ~_umask()
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
            yield tmp
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
            tmp = None
        except OSError as e:
            raise ValueError(f"{option}={path!r}: could not be written ({e.strerror or e}); nothing was written") \
                from None
        finally:
            with held():
                if tmp is not None and os.path.lexists(tmp):
                    os.remove(tmp)


def write_output(path, text: str, option: str = "output") -> None:
    """Write text to path whole (replacing: a temporary file beside it,
    renamed over it), or to standard output for "-". On failure (a full disk,
    say) nothing is left behind, the file there is as it was, and the error
    is one line naming the path."""
    path = os.fspath(path)
    if path == "-":
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:   # the reader has gone (| head): nothing more to say to it
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
            raise ValueError(f"{option}='-': standard output was closed by its reader before the output ended") from None
        except OSError as e:
            raise ValueError(f"{option}='-': standard output could not be written ({e.strerror or e})") from None
        return
    with replacing(path, option) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def write_json(path, data, option: str = "--json") -> None:
    write_output(path, json.dumps(data, indent=1) + "\n", option)
