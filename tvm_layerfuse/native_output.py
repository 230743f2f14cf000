"""What native code prints (TVM's and onnxruntime's C++ log lines on fd 2, Python prints on
stdout) sent to a logger instead of the user's terminal, and given back at any instant.

:func:`to_log` redirects fd 2 into a temporary file for the code inside it. An interrupt
(SIGINT) can arrive at any bytecode, also where a context manager's own ``__enter__`` or
``__exit__`` code cannot run, so every active redirection is kept on a stack and
:func:`restore` puts the terminal back: the command line calls it before it prints its own
error line.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile

_SAVED: list[int] = []
"""Duplicates of fd 2 as it was before each active redirection (innermost last)."""


def restore(depth: int = 0) -> None:
    """Undo the active redirections of fd 2 above ``depth`` (innermost first; all by default)."""
    while len(_SAVED) > depth:
        saved = _SAVED.pop()
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def to_log(what: str, log: logging.Logger):
    """Send what the code inside prints - Python's stdout and the C++ side's stderr (fd 2) -
    to ``log`` at debug level instead of the terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    depth = len(_SAVED)
    with tempfile.TemporaryFile() as captured, contextlib.redirect_stdout(io.StringIO()) as printed:
        _SAVED.append(os.dup(2))
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            restore(depth)  # nothing left to do when the command line restored it already
            captured.seek(0)
            text = printed.getvalue() + captured.read().decode("utf-8", "replace")
    if text.strip():
        log.debug("%s said:\n%s", what, text.rstrip())
