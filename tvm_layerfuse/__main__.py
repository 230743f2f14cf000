"""``python -m tvm_layerfuse``: the command line (see :func:`tvm_layerfuse.cli.console_main`)."""

import sys

try:
    from .cli import console_main

    code = console_main()
except KeyboardInterrupt:  # Ctrl-C while the command line itself is still loading
    print("error: interrupted; nothing was written", file=sys.stderr)
    code = 130
raise SystemExit(code)
