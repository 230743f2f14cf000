"""The command line: ``python -m tvm_layerfuse COMMAND ...``.

* :mod:`.commands` - the parser, ``inspect``, ``compile``, ``bundle`` and :func:`main`;
* :mod:`.run` - ``run`` (also a bundle's ``run.py``: it imports the runtime package only);
* :mod:`.deploy` - ``deploy``;  :mod:`.board` - ``python -m tvm_layerfuse.board``;
* :mod:`.common` - what the commands share (-v/-q, status lines).

Importing this package imports none of them: a bundle holds only ``run``.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m tvm_layerfuse``; returns the exit status."""
    from .commands import main as _main

    return _main(argv)


def console_main() -> int:
    """``python -m tvm_layerfuse`` and the ``tvm-layerfuse`` script: :func:`main` in a process
    that is the command (one Ctrl-C at any instant: the complete result and status 0, or
    nothing written, one line and status 130)."""
    try:
        from .commands import main as _main

        return _main(standalone=True)
    except KeyboardInterrupt:  # Ctrl-C while the command line itself is still loading
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130


def build_parser():
    """The argparse parser of ``python -m tvm_layerfuse``."""
    from .commands import build_parser as _build_parser

    return _build_parser()


__all__ = ["build_parser", "console_main", "main"]
