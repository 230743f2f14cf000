"""``deploy``: run a compiled artifact on a board over TVM RPC (see :mod:`tvm_layerfuse.deploy`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from ..deploy import DEFAULT_TIMEOUT, deploy
from ..errors import UsageError
from .common import verbosity_parent


def cmd_deploy(args) -> int:
    from ..runtime import artifact
    from ..runtime.io import check_output_path, read_inputs, write_outputs

    if args.rpc and args.tracker:
        raise UsageError("both --rpc and --tracker given; expected one")
    if args.output:
        check_output_path(args.output)
    path = Path(args.artifact)
    inputs = None
    if args.input:
        inputs = read_inputs(artifact.read_manifest(path)["inputs"], [args.input])
    result = deploy(
        path,
        rpc=args.rpc if not args.tracker else None,
        tracker=args.tracker,
        key=args.key,
        device=args.device,
        inputs=inputs,
        repeat=args.repeat,
        timeout=args.timeout,
        session_timeout=args.session_timeout,
        seed=args.seed,
        upload_onednn=args.upload_onednn,
    )
    if args.output:
        write_outputs(args.output, result.outputs)
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(result.summary())
        if args.output:
            print(f"wrote {args.output}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; expected N >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive; expected N >= 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def add_deploy_parser(subparsers, *, parents: Optional[Sequence[Any]] = None) -> Any:
    """Register ``deploy`` on an argparse ``subparsers``; the command returns an exit code.

    ``parents`` defaults to the CLI's -v/-q parent, so ``deploy ... -v`` works like the others.
    """
    if parents is None:
        parents = [verbosity_parent()]
    p = subparsers.add_parser(
        "deploy",
        parents=list(parents),
        help="run a compiled artifact on an edge board over TVM RPC (outputs, remote latency)",
        description=(
            "Upload a compiled artifact to a board running TVM's RPC server (python -m tvm.exec.rpc_server), "
            "run it there and time it. The artifact's checksums and target are checked first; a board of "
            "another architecture is refused before anything is uploaded. TVM RPC has no authentication: "
            "only deploy to servers on networks you trust."
        ),
        epilog="exit status: 0 ok; 1 the board, link or tracker failed (or timed out); 2 bad arguments, artifact or target mismatch",
    )
    p.add_argument("artifact", help="artifact directory written by `compile`")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--rpc", metavar="HOST:PORT", help="the board's RPC server (default 127.0.0.1:9091)")
    where.add_argument("--tracker", metavar="HOST:PORT", help="an RPC tracker; needs --key")
    p.add_argument(
        "--key", help="the boards' key (rpc_server --key): with --tracker, runs spread over the boards under it"
    )
    p.add_argument(
        "--device", help="cpu (default), cuda or cuda:N on the board; a vta artifact runs on the board's VTA runtime"
    )
    p.add_argument(
        "--input",
        metavar="FILE",
        help="inputs: .npy (single-input models) or .npz by input name; default seeded random",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random input (default 0)")
    p.add_argument("--output", metavar="FILE.npz", help="write the outputs by name (atomically, only on success)")
    p.add_argument(
        "--repeat", type=_positive_int, default=1, metavar="N", help="timed runs (with a tracker: one session each)"
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"deadline of each step in seconds (default {DEFAULT_TIMEOUT:g})",
    )
    p.add_argument(
        "--session-timeout",
        type=_seconds,
        default=None,
        metavar="S",
        help="the board ends a session after S seconds (default: sum of the step deadlines)",
    )
    p.add_argument(
        "--upload-onednn",
        action="store_true",
        help="send this machine's libdnnl.so.2 with a oneDNN artifact (~40 MB), for a board without oneDNN installed",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_deploy)
    return p
