"""What the commands share: their missing-dependency line, argparse errors on one line, the
check of a picture path, and output that survives a reader closing the pipe.

Dependencies. The package itself needs only torch; each command checks its optional imports before doing any
work and, when one is missing, says in one line which ``pip install 'nemo_fp8_align[EXTRA]'``
brings it (the extras are defined in pyproject.toml).

Pipes. A reader that stops early is not an error: ``nemo-fp8-align report ... | head -1`` or
``check --format json | head -c 10`` close the pipe while the command still writes. The command
then runs to its end and exits with its own status (0, 1 or 2), without a BrokenPipe traceback:
once a write finds the pipe closed, the rest of that stream's output is discarded (its file
descriptor is pointed at the null device, so the interpreter's final flush cannot fail either).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator, NoReturn, Optional, Sequence, TextIO, Tuple

__all__ = ["CHECK_NEEDS", "PLOT_SUFFIXES", "closed_pipes_discarded", "missing_dependency",
           "one_line_usage_errors", "plot_path_problem"]

PLOT_SUFFIXES = (".png", ".svg", ".pdf")

#: (import name, distribution name, extra) that ``nemo-fp8-align check`` needs.
CHECK_NEEDS: Tuple[Tuple[str, str, str], ...] = (
    ("omegaconf", "omegaconf", "hydra"),
    ("hydra", "hydra-core", "hydra"),
)


def missing_dependency(command: str, needs: Sequence[Tuple[str, str, str]]) -> Optional[str]:
    """None when every module in ``needs`` imports; else one line naming the first missing
    distribution and the extra that installs it."""
    for module, distribution, extra in needs:
        if not _importable(module):
            return (f"'{command}' needs {distribution}, which is not installed: "
                    f"pip install 'nemo_fp8_align[{extra}]'")
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, a broken __spec__
        return False


def one_line_usage_errors(p: argparse.ArgumentParser) -> None:
    """argparse's errors as one line (the flag, the value, the fix), exit status 2: the usage
    block it prints first ran to 40 lines for ``plan``, above the one that says what is wrong."""
    def error(message: str) -> "NoReturn":
        p.exit(2, f"{p.prog}: error: {message} (see {p.prog} --help)\n")

    p.error = error  # type: ignore[method-assign]


def plot_path_problem(path: Optional[str], flag: str = "--plot") -> Optional[str]:
    """Why a picture cannot be written to ``path`` (None when it can), before any work."""
    if path is None:
        return None
    if os.path.isdir(path) or path.endswith(os.sep) or not os.path.basename(path):
        return f"{flag} {path}: is a directory; pass a file name, e.g. {os.path.join(path, 'plot.png')}"
    if not path.lower().endswith(PLOT_SUFFIXES):
        return (f"{flag} {path}: not a picture file name; end it with "
                f"{' / '.join(PLOT_SUFFIXES)}, e.g. {os.path.splitext(path)[0]}.png")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{flag} {path}: the directory {parent} does not exist; create it (mkdir -p) first"
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag} {path}: not writable; pass a path you can write"
    return None


class _Discarding:
    """``stream`` until a write or flush hits a closed pipe; from then on, nothing."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._discard()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._discard()

    def _discard(self) -> None:
        self.broken = True
        try:  # the buffered rest goes to the null device at the interpreter's final flush
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError, AttributeError):
            pass  # not a file descriptor (a test's capture): nothing is flushed to it later

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def closed_pipes_discarded() -> Iterator[None]:
    """For the ``with`` block, ``sys.stdout`` and ``sys.stderr`` discard output once their
    reader has gone; both are flushed before the block ends."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Discarding(saved[0]), _Discarding(saved[1])
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved
