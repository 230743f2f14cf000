"""The command line: ``python -m tvm_layerfuse COMMAND ...`` (see :mod:`.commands`)."""

from .commands import build_parser, main, parse_input_shapes

__all__ = ["build_parser", "main", "parse_input_shapes"]
