"""A reader that stops early is not an error: ``nemo-fp8-align report ... | head -1`` or
``check --format json | head -c 10`` close the pipe while the command still writes. The command
then runs to its end and exits with its own status (0, 1 or 2), without a BrokenPipe traceback:
once a write finds the pipe closed, the rest of that stream's output is discarded (its file
descriptor is pointed at the null device, so the interpreter's final flush cannot fail either).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator, TextIO

__all__ = ["closed_pipes_discarded"]


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
