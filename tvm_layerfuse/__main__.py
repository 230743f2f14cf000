"""``python -m tvm_layerfuse``: the command line."""

import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line itself is still loading
    print("error: interrupted; nothing was written", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())
