"""``python -m tvm_layerfuse.board``: the board side of ``deploy`` (see :mod:`tvm_layerfuse.deploy.board`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from typing import Optional, Sequence

from ..deploy.board import ARM64_ENV, start_arm64_board, start_server, start_tracker
from ..errors import LayerfuseError


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tvm_layerfuse.board",
        description="Start the board side of `deploy`: TVM's RPC server or tracker, runtime only; runs until Ctrl-C.",
        epilog="TVM RPC has no authentication: keep the default loopback --host unless the network is trusted.",
    )
    sub = parser.add_subparsers(dest="role", required=True)
    for role in ("server", "arm64"):
        p = sub.add_parser(
            role,
            help="an RPC server on this machine"
            if role == "server"
            else "the emulated AArch64 board's RPC server (qemu)",
        )
        p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it)")
        p.add_argument("--port", type=int, default=9091)
        p.add_argument("--tracker", metavar="HOST:PORT", help="register with this tracker")
        p.add_argument("--key", default="", help="the key to register under (with --tracker)")
        p.add_argument(
            "--vta", action="store_true", help="serve vta artifacts: the VTA runtime (simulator) registered in the server"
        )
        if role == "server":
            p.add_argument(
                "--load-library",
                help="extra libraries to load (':'-separated), e.g. .../tvm/lib/libtvm_runtime_cuda.so; "
                "PyPI's oneDNN (libdnnl.so.2) of this Python environment is loaded without asking",
            )
        else:
            p.add_argument(
                "--cache", help=f"the board's directory (default ${ARM64_ENV} or ~/.cache/tvm_layerfuse/arm64-board)"
            )
    p = sub.add_parser("tracker", help="an RPC tracker")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9190)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, a service manager: stop the server's group as Ctrl-C does
    try:
        if args.role == "tracker":
            bp = start_tracker(host=args.host, port=args.port)
        elif args.role == "arm64":
            bp = start_arm64_board(
                host=args.host, port=args.port, tracker=args.tracker, key=args.key, cache=args.cache, vta=args.vta
            )
        else:
            bp = start_server(
                host=args.host, port=args.port, tracker=args.tracker, key=args.key,
                load_library=":".join(filter(None, [args.load_library, *environment_vendor_libraries()])) or None,
                module="tvm_layerfuse.runtime.vta.rpc_server" if args.vta else "tvm.exec.rpc_server",
            )
    except LayerfuseError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # the half-started server was stopped by start_*
        print("error: interrupted while the board started; nothing is running", file=sys.stderr)
        return 130
    what = "tracker" if bp.role == "tracker" else f"RPC server ({bp.machine})"
    try:  # a signal right after the line below (someone waiting for it) stops the server too
        print(f"{what} ready on {bp.host}:{bp.port}; log {bp.log_path}; Ctrl-C stops it", flush=True)
        while bp.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        bp.__exit__(None, None, None)  # stop it and remove its log: a clean end
        return 0
    bp.stop()
    print(f"error: the {bp.role} exited (status {bp.proc.returncode}); see {bp.log_path}", file=sys.stderr)
    return 1


def environment_vendor_libraries() -> list[str]:
    """The tactic libraries' vendor libraries that pip installed into this Python environment
    (``onednn-cpu-gomp``: ``PREFIX/lib/libdnnl.so.2``), for the server to load before any
    artifact's tactic library (the system loader does not look in a Python prefix)."""
    from ..runtime.tactics import VENDOR_LIBRARIES, environment_lib_dirs

    found = []
    for soname in VENDOR_LIBRARIES:
        where = next((d / soname for d in environment_lib_dirs() if (d / soname).is_file()), None)
        if where is not None:
            found.append(str(where.resolve()))
    return found


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
