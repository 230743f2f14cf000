"""Deploy a compiled artifact to an edge board over TVM's own RPC, run it there, time it.

::

    from tvm_layerfuse import rpc
    result = rpc.deploy("out/squeezenet", rpc=("192.168.1.20", 9091), inputs={"data": x}, repeat=10)
    result.outputs["prob"], result.latency.median_ms, result.boards[0].machine

    # several boards behind a tracker: runs go to whichever board the tracker hands out
    result = rpc.deploy("out/squeezenet", tracker=("127.0.0.1", 9190), key="rasp4", repeat=4)

What happens, in order (every step that waits on the network has a deadline):

1. *here*: read the manifest, check every file's sha256, check that model.so's ELF header
   matches the manifest's machine and that the requested device fits the artifact;
2. *tracker* (optional): ``summary`` (is any board registered under the key?) and
   ``REQUEST`` for a free board, as :meth:`tvm.rpc.client.TrackerSession.request` does;
3. *board*: ``tvm.rpc.connect``; ask the board what it is: TVM's RPC exposes no
   "what machine are you" call, so the client downloads the server's own executable
   (``/proc/self/exe``, also right under qemu-user) and reads its ELF machine field, plus
   ``/etc/hostname``; refuse, before uploading anything, when the artifact does not fit;
4. upload model.so, ``remote.load_module``, ``tvm.runtime.vm.VirtualMachine`` on the
   remote device (the runtime-only API), weights and inputs as remote tensors;
   ``set_input``/``invoke_stateful``/``get_outputs`` (safe over RPC for tuple outputs),
   then ``time_evaluator("invoke_stateful")`` for the latency.

A ``vta`` artifact (target device ``vta``): step 3 checks the board's machine against its host
library's (``host.so``, the TVM-compiled host steps); step 4 uploads its VTA files and
calls the VTA runtime that the board's server registers (``python -m
tvm_layerfuse.runtime.vta.rpc_server``; see :mod:`tvm_layerfuse.runtime.vta.rpc_server`); the result also holds
VTA's counters. A server without that runtime is refused before anything runs.

TVM's RPC client is C++ and blocks without a deadline (connect, every call), so steps
3-4 run in a worker subprocess (``python -c ... _worker_main``, runtime-only TVM) that
reports each step on a pipe; this process enforces the deadline of each step and kills
the worker when one passes. A board that is down, a server killed mid-run, a board that
hangs or a link that is too slow all end with one line: :class:`DeployError`.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np

from ..errors import DeployError, UsageError
from ..runtime import artifact
from ..runtime.io import random_inputs
from ..runtime.loader import Inputs, parse_device
from ..runtime.tactics import thread_pool
from .inputs import Address, check_device, check_library, normalize_inputs, parse_address, tactic_entries, vendor_uploads
from .results import BoardInfo, DeployResult, RunRecord, stats
from .watchdog import run_worker

log = logging.getLogger(__name__)

DEFAULT_RPC = ("127.0.0.1", 9091)
DEFAULT_TIMEOUT = 60.0
# TVM's server waits on a session with poll() in milliseconds: a session timeout above
# ~2.1e6 s overflows it, and the server's accept thread dies (the server never answers again).
MAX_SESSION_TIMEOUT = 86400.0


def deploy(
    artifact_dir: Union[str, os.PathLike],
    *,
    rpc: Optional[Address] = None,
    tracker: Optional[Address] = None,
    key: Optional[str] = None,
    device: Optional[str] = None,
    inputs: Optional[Inputs] = None,
    repeat: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
    session_timeout: Optional[float] = None,
    seed: int = 0,
    progress: Optional[Callable[[str], None]] = None,
    upload_onednn: bool = False,
) -> DeployResult:
    """Run the artifact ``artifact_dir`` on a board over TVM RPC; see the module docstring.

    ``rpc=(host, port)`` (default 127.0.0.1:9091) connects to one RPC server (``key``: the one
    it was started with, if any); ``tracker=(host, port), key=K`` asks a tracker for a board
    registered under ``K``. ``repeat`` timed runs:
    with ``rpc`` one session times ``repeat`` runs; with a tracker each run is a session of
    its own, on whichever board the tracker hands out (so several boards share the runs).
    ``timeout`` (seconds) bounds every single step that waits on the network or the board
    (connecting, waiting for a free board, uploading, loading, one inference, and each
    chunk of timed runs: they go in chunks of about ``timeout / 2``, estimated from the
    first run). ``session_timeout`` is passed to the server, which ends the session (and
    frees the board) after that long even if this client vanished; default: the sum of the
    step deadlines, at most a day. ``inputs=None`` draws seeded random inputs (``seed``).
    ``progress`` receives a line per step. An artifact whose layers run on oneDNN has its
    tactic library uploaded and loaded first (:mod:`.remote_tactics`); ``upload_onednn`` also
    sends this machine's ``libdnnl.so.2``, for a board without oneDNN. Raises :class:`DeployError` (one line) when the
    tracker, the link or the board fails, :class:`DeployTimeoutError` when a step passes
    its deadline, :class:`BoardMismatchError` before uploading when the artifact does not
    fit the board.
    """
    started = time.perf_counter()
    path = Path(artifact_dir)
    try:
        repeat = operator.index(repeat)
    except TypeError:
        raise UsageError(f"--repeat {repeat!r} is not an integer; expected N >= 1") from None
    if repeat < 1:
        raise UsageError(f"--repeat {repeat!r} is not a positive integer; expected N >= 1")
    if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise UsageError(f"--timeout {timeout!r} is not a positive number of seconds")
    if tracker is not None and rpc is not None:
        raise UsageError("both --rpc and --tracker given; expected one: a board's HOST:PORT or a tracker's with --key")
    if tracker is not None:
        tracker_addr = parse_address(tracker, what="--tracker")
        if not key:
            raise UsageError("--tracker needs --key KEY: the key the boards registered under (rpc_server --key)")
        board_addr = None
    else:
        tracker_addr = None
        board_addr = parse_address(rpc if rpc is not None else DEFAULT_RPC, what="--rpc")
    manifest = artifact.read_manifest(path)
    vta = manifest["target"].get("device") == "vta"
    if vta:  # VTA programs + the host steps' library: the board's server runs them (vta.rpc_server)
        if device not in (None, "vta"):
            check_device(manifest, device)  # refused: names the artifact's device
        device = "vta"
        artifact.verify(path, manifest)
    else:
        kind, index = parse_device(device or "cpu")
        check_device(manifest, device or "cpu")
        device = kind if kind == "cpu" else f"cuda:{index}"
        artifact.verify(path, manifest)
        check_library(path, manifest)
    tactics = [] if vta else tactic_entries(path, manifest)
    upload_vendor = vendor_uploads(path, manifest) if upload_onednn else None
    if inputs is None:
        inputs = random_inputs(manifest["inputs"], seed=seed)
        log.info("no inputs given: seeded random inputs (seed %d)", seed)
    values = normalize_inputs(manifest, inputs)

    sessions = repeat if tracker_addr else 1
    per_session = 1 if tracker_addr else repeat
    # connect, probe, upload, load, weights, run + at most one timing step per run (+ the tactic libraries)
    steps = 6 + per_session + 3 * len(tactics)
    if session_timeout is None:
        session_timeout = min(float(timeout) * steps, MAX_SESSION_TIMEOUT)
    elif not isinstance(session_timeout, (int, float)) or not 0 < session_timeout <= MAX_SESSION_TIMEOUT:
        raise UsageError(
            f"--session-timeout {session_timeout!r} is not a number of seconds in (0, {MAX_SESSION_TIMEOUT:g}]; "
            "TVM's RPC server cannot wait longer"
        )

    params = manifest.get("params") or {}
    job_dir = Path(tempfile.mkdtemp(prefix="tvm_layerfuse_deploy_"))
    try:
        np.savez(job_dir / "inputs.npz", **{f"i{k}": v for k, v in enumerate(values)})
        job = {
            "artifact": str(path.resolve()),
            "library": manifest["library"],
            "library_sha256": manifest["files"][manifest["library"]],
            "params_file": params.get("file") if params.get("order") else None,
            "params_sha256": manifest["files"].get(params.get("file", ""), None),
            "params_order": list(params.get("order", [])),
            "inputs": str(job_dir / "inputs.npz"),
            "outputs": [o["name"] for o in manifest["outputs"]],
            "job_dir": str(job_dir),
            "device": device,
            "machine": manifest["target"].get("machine"),
            "preset": manifest["target"].get("preset"),
            "rpc": list(board_addr) if board_addr else None,
            "tracker": list(tracker_addr) if tracker_addr else None,
            "key": key,
            "sessions": sessions,
            "repeat": per_session,
            "timeout": float(timeout),
            "session_timeout": float(session_timeout),
            "vta_files": _vta_files(path, manifest) if vta else None,
            "tactics": tactics,
            "thread_pool": thread_pool() if tactics else None,  # as a local load runs the model's loops
            "upload_vendor": upload_vendor,
        }
        records = run_worker(job, timeout=float(timeout), progress=progress)
        return _assemble(path, manifest, device, records, started)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


def _vta_files(path: Path, manifest: dict[str, Any]) -> dict[str, str]:
    """The files a VTA board loads, with their checksums (the manifest's ``files``)."""
    from ..runtime.vta.runtime import FILES, HOST_LIBRARY, MANIFEST

    names = (MANIFEST, *FILES) + ((HOST_LIBRARY,) if HOST_LIBRARY in manifest["files"] else ())
    return {name: manifest["files"][name] for name in names}


def _assemble(path: Path, manifest, device: str, records: dict[str, Any], started: float) -> DeployResult:
    runs: list[RunRecord] = []
    first: Optional[dict[str, np.ndarray]] = None
    counters = next((run["counters"] for run in records["runs"] if run.get("counters")), None)
    diff = 0.0
    names = [o["name"] for o in manifest["outputs"]]
    for run in records["runs"]:
        with np.load(run["outputs"], allow_pickle=False) as data:
            outs = {n: data[f"o{k}"] for k, n in enumerate(names)}
        if first is None:
            first = outs
        else:
            for n in names:
                a, b = first[n], outs[n]
                if a.shape != b.shape:
                    raise DeployError(
                        f"board {run['board']} returned output {n!r} of shape {list(b.shape)}; the first board gave {list(a.shape)}"
                    )
                if a.size:
                    diff = max(diff, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
        runs.extend(RunRecord(board=run["board"], latency_ms=t) for t in run["latencies_ms"])
    if first is None:
        raise DeployError("the RPC client finished without a result; run with --verbose and report it")
    scale = max(
        [1.0] + [float(np.max(np.abs(v))) for v in first.values() if v.size and np.issubdtype(v.dtype, np.number)]
    )
    if diff > 1e-4 * scale:
        log.warning("boards disagree: outputs differ by up to %.3g between sessions", diff)
    boards = [BoardInfo(**b) for b in records["boards"]]
    return DeployResult(
        artifact=path,
        device=device,
        outputs=first,
        latency=stats([r.latency_ms for r in runs]),
        runs=runs,
        boards=boards,
        max_run_difference=diff,
        wall_s=time.perf_counter() - started,
        manifest=manifest,
        counters=counters,
    )
