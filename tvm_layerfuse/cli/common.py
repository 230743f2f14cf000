"""What the commands share: -v/-q after the command, and status lines."""

from __future__ import annotations

import argparse
import sys


def say(args: argparse.Namespace, message: str) -> None:
    """A status line on stderr (stdout carries the command's result), unless --quiet."""
    if not args.quiet:
        print(message, file=sys.stderr)


def verbosity_parent() -> argparse.ArgumentParser:
    """-v/-q accepted after the command too (SUPPRESS keeps the top-level value otherwise)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="more log output")
    group.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="only errors")
    return parent
