"""The board side of ``deploy`` for VTA artifacts: TVM's RPC server with the VTA runtime.

::

    python -m tvm_layerfuse.runtime.vta.rpc_server [--host 127.0.0.1] [--port 9091] [--device sim|board]
                                           [--tracker H:P --key K]

As ``vta.exec.rpc_server`` did in TVM's VTA stack, this is ``tvm.rpc.Server`` with a
``server_init_callback`` that registers the VTA runtime as global functions of every
session (TVM's plain ``python -m tvm.exec.rpc_server`` runs compiled libraries only, no
Python, so a VTA artifact needs this one). The client uploads the artifact's VTA files
(``vta.json``, ``dram.bin``, ``programs.npz``, ``host.npz``, ``host.so``: the host steps
compiled by TVM for this board's CPU) into the session's work directory and calls:

* ``tvm_layerfuse.vta.load(name)`` - load the uploaded ``name`` (``vta.json``) with
  :func:`tvm_layerfuse.runtime.vta.runtime.load_vta` on this server's device; returns JSON
  ``{"device", "config"}``;
* ``tvm_layerfuse.vta.run(inputs)`` - one inference; ``inputs`` and the result are ``.npz``
  bytes (``i0, i1, ...`` in the manifest's input order; ``o0, o1, ...`` in output order);
* ``tvm_layerfuse.vta.time(n)`` - ``n`` timed runs of the last inputs; JSON latencies (ms);
* ``tvm_layerfuse.vta.counters()`` - JSON: VTA's profiling counters of the last run.

``--device sim`` (default) runs the programs on the bit-exact simulator on this machine's
CPU; ``--device board`` drives a real VTA and, since no driver ships with this package,
fails on load with "no VTA device found". The host steps run in ``host.so`` through TVM's
runtime in this process. Numpy and TVM's runtime only.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

FUNCTIONS = ("tvm_layerfuse.vta.load", "tvm_layerfuse.vta.run", "tvm_layerfuse.vta.time", "tvm_layerfuse.vta.counters")


class _Session:
    """What one RPC session holds: the loaded module, the last inputs and counters."""

    module: Any = None
    feeds: Optional[dict[str, np.ndarray]] = None
    counters: dict[str, int] = {}


def _npz(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def register(device: str = "sim") -> None:
    """Register the VTA runtime's global functions (``server_init_callback``; see the module doc)."""
    import tvm_ffi

    from ...errors import LayerfuseError
    from .runtime import load_vta

    state = _Session()

    def workpath(name: str) -> Path:
        return Path(tvm_ffi.get_global_func("tvm.rpc.server.workpath")(name))

    def load(name: str) -> str:
        try:
            state.module = load_vta(workpath(name).parent, device=device)
        except LayerfuseError as e:
            raise RuntimeError(f"VTAError: {e}") from None
        return json.dumps({"device": device, "config": state.module.cfg.summary()})

    def run(data: bytes) -> bytes:
        if state.module is None:
            raise RuntimeError("VTAError: no VTA artifact loaded in this session; call tvm_layerfuse.vta.load first")
        with np.load(io.BytesIO(bytes(data)), allow_pickle=False) as z:
            values = [z[f"i{k}"] for k in range(len(z.files))]
        state.feeds = dict(zip(state.module.inputs, values))
        try:
            result = state.module.run(state.feeds)
        except LayerfuseError as e:
            raise RuntimeError(f"VTAError: {e}") from None
        state.counters = result.counters.to_dict()
        return _npz({f"o{k}": result.outputs[n].astype(np.float32) for k, n in enumerate(state.module.outputs)})

    def timed(n: int) -> str:
        if state.feeds is None:
            raise RuntimeError("VTAError: no run yet in this session; call tvm_layerfuse.vta.run first")
        times = []
        for _ in range(int(n)):
            t = time.perf_counter()
            state.module.run(state.feeds)
            times.append((time.perf_counter() - t) * 1e3)
        return json.dumps(times)

    for name, fn in zip(FUNCTIONS, (load, run, timed, lambda: json.dumps(state.counters))):
        tvm_ffi.register_global_func(name, fn, override=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tvm_layerfuse.runtime.vta.rpc_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; TVM RPC has no authentication)")
    p.add_argument("--port", type=int, default=9091)
    p.add_argument("--port-end", type=int, default=9199)
    p.add_argument("--tracker", help="HOST:PORT of an RPC tracker (needs --key)")
    p.add_argument("--key", default="", help="the key this board registers under with the tracker")
    p.add_argument("--custom-addr", help="the address the tracker hands out to clients")
    p.add_argument("--device", choices=("sim", "board"), default="sim", help="run VTA programs on the simulator (default) or a board")
    p.add_argument("--load-library", help="extra libraries to load (':'-separated), as tvm.exec.rpc_server")
    p.add_argument("--silent", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    from tvm import rpc

    tracker = None
    if args.tracker:
        host, _, port = args.tracker.rpartition(":")
        tracker = (host, int(port))
        if not args.key:
            p.error("--tracker needs --key")
    server = rpc.Server(
        args.host, args.port, args.port_end, key=args.key, tracker_addr=tracker, custom_addr=args.custom_addr,
        load_library=args.load_library, silent=args.silent, server_init_callback=functools.partial(register, args.device),
    )  # fmt: skip
    server.proc.join()


if __name__ == "__main__":
    main()
