"""``python -m tvm_layerfuse``: the command line."""

from .cli import main

raise SystemExit(main())
