"""``python -m tvm_layerfuse.board``: start a board for ``deploy`` (see :mod:`tvm_layerfuse.deploy.board`).

The module lives in :mod:`tvm_layerfuse.deploy.board`; this path keeps the command and the
import ``from tvm_layerfuse import board`` working.
"""

from .cli.board import main
from .deploy.board import (
    ARM64_ENV,
    LOOPBACK,
    BoardError,
    BoardProcess,
    arm64_board,
    arm64_board_dir,
    free_port,
    start_arm64_board,
    start_server,
    start_tracker,
    tracker_summary,
)

__all__ = [
    "ARM64_ENV",
    "LOOPBACK",
    "BoardError",
    "BoardProcess",
    "arm64_board",
    "arm64_board_dir",
    "free_port",
    "main",
    "start_arm64_board",
    "start_server",
    "start_tracker",
    "tracker_summary",
]

if __name__ == "__main__":
    raise SystemExit(main())
