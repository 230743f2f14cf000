"""The deploy worker: a subprocess (runtime-only TVM) that talks to the tracker and the boards.

TVM's RPC client is C++ and blocks without a deadline, so the steps that wait on the
network run here; each step is reported as a JSON line on stdout (``step``, ``board``,
``run``, ``error``, ``done``) and :mod:`.watchdog` kills this process when one passes its
deadline. Started as ``python -c "from tvm_layerfuse.deploy.worker import main; main()"``
with the job as JSON on stdin.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np

from ..errors import ArtifactError, BoardMismatchError, first_line
from ..runtime import artifact
from ..runtime.loader import contiguous, read_weights
from .inputs import elf_machine, fit_board
from .remote_tactics import RemoteTacticsError, load_on_board, share_pool_on_board
from .tracker import StepFailure, TrackerClient

log = logging.getLogger(__name__)


def main() -> None:
    # Events go to a private copy of stdout; fd 1 itself goes to stderr so that nothing
    # printed by TVM (C++ or Python) can corrupt the event stream.
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(event: str, **data: Any) -> None:
        events.write(json.dumps({"event": event, **data}) + "\n")
        events.flush()

    job = json.loads(sys.stdin.read())
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    failure = None
    try:
        try:
            _run(job, emit)
            emit("done")
        except StepFailure as f:
            failure = (f.kind, f.message)
        except BaseException as e:  # noqa: BLE001 - everything reaches the parent as one line
            emit("error", kind="internal", message=f"the RPC client failed: {type(e).__name__}: {first_line(e, last=True)}")
        if failure is not None:
            # A refusal on the board: the exception is gone here, and with it the frames that held
            # the session; collecting them closes the session in order (TVM's server then goes on
            # serving; a session cut by the kill that follows the error event would stop its loop).
            import gc

            gc.collect()
            emit("error", kind=failure[0], message=failure[1])
    finally:
        events.close()


def _run(job: dict[str, Any], emit: Callable[..., None]) -> None:
    import gc
    import hashlib

    timeout = job["timeout"]
    socket.setdefaulttimeout(timeout)  # every Python socket of this worker (the tracker's)
    import tvm
    from tvm.runtime import vm as vm_runtime

    art = Path(job["artifact"])
    if job.get("vta_files"):
        _run_vta(job, emit, art)
        return
    lib_bytes = (art / job["library"]).read_bytes()
    if hashlib.sha256(lib_bytes).hexdigest() != job["library_sha256"]:
        raise StepFailure(
            "artifact",
            f"{job['library']!r} in artifact {str(art)!r} changed after it was verified; copy the artifact again",
        )
    weights: list[np.ndarray] = []
    if job["params_file"]:
        pfile = art / job["params_file"]
        if artifact.sha256_file(pfile) != job["params_sha256"]:
            raise StepFailure(
                "artifact",
                f"{job['params_file']!r} in artifact {str(art)!r} changed after it was verified; copy the artifact again",
            )
        try:
            weights = read_weights(art, job["params_file"], job["params_order"])
        except ArtifactError as e:
            raise StepFailure("artifact", str(e)) from None
    with np.load(job["inputs"], allow_pickle=False) as data:
        inputs = [contiguous(data[f"i{k}"]) for k in range(len(data.files))]
    weight_mb = sum(w.nbytes for w in weights) / 1e6
    kind, _, index = job["device"].partition(":")
    index = int(index or 0)
    known: dict[str, dict[str, Any]] = {}
    hint = "the board is down or unreachable, or its RPC server does not answer - check the board and restart its server"
    for number, board, sess, step in _sessions(job, emit, connect_hint=hint):
        # -------- what is it
        if board not in known:
            step("asking the board what it is")
            info = {
                "address": board,
                "machine": _remote_machine(sess),
                "hostname": _remote_hostname(sess),
                "key": job["key"],
            }
            known[board] = info
            emit("board", **info)
        info = known[board]
        machine = info["machine"]
        if machine is None:
            log.warning("board %s did not say what machine it is; loading the library anyway", board)
        elif job["machine"] and machine != job["machine"]:
            try:
                fit_board(
                    {"target": {"machine": job["machine"], "preset": job["preset"]}}, board=board, machine=machine
                )
            except BoardMismatchError as e:
                raise StepFailure("mismatch", str(e)) from None
        try:
            dev = sess.cuda(index) if kind == "cuda" else sess.cpu(0)
            present = dev.exist
        except Exception as e:  # noqa: BLE001
            raise StepFailure("board", _session_failure(board, "asking the board what it is", e, job)) from None
        if not present:
            raise StepFailure(
                "mismatch",
                f"board {board} has no {job['device']} device; nothing was uploaded - if it has an NVIDIA GPU, start its "
                "server with --load-library <site-packages>/tvm/lib/libtvm_runtime_cuda.so (a runtime-only TVM does not "
                "load CUDA support by itself), or deploy with --device cpu",
            )

        # -------- upload, load, run, time
        if job.get("tactics"):  # the tactic library (and what it needs) before the model
            what = "loading the tactic library"
            try:
                load_on_board(
                    sess, job["tactics"], artifact=art, board=board, upload_vendor=job.get("upload_vendor"), step=step
                )
            except RemoteTacticsError as e:
                raise StepFailure("mismatch", str(e)) from None
            except StepFailure:
                raise
            except Exception as e:  # noqa: BLE001
                raise StepFailure("board", _session_failure(board, what, e, job)) from None
        try:
            what = step(f"uploading {job['library']} ({len(lib_bytes) / 1e6:.1f} MB)")
            sess.upload(bytearray(lib_bytes), "model.so")
            what = step("loading the library")
            rlib = sess.load_module("model.so")
            if job.get("tactics") and job.get("thread_pool") == "openmp":  # one thread pool on the board too
                share_pool_on_board(sess, "model.so")
            vm = vm_runtime.VirtualMachine(rlib, dev)
            what = step(f"sending the weights ({weight_mb:.1f} MB) and inputs")
            args = [tvm.runtime.tensor(v, dev) for v in inputs] + [tvm.runtime.tensor(w, dev) for w in weights]
            what = step("running the model")
            t0 = time.perf_counter()
            vm.set_input("main", *args)
            vm.invoke_stateful("main")
            once = time.perf_counter() - t0  # one inference + RPC overhead: an upper estimate
            result = vm.get_outputs("main")
            flat = _flatten(result)
            if len(flat) != len(job["outputs"]):
                raise StepFailure(
                    "artifact",
                    f"the library returned {len(flat)} outputs on board {board}; "
                    f"the manifest lists {len(job['outputs'])} - re-run `compile`",
                )
            outs = [o.numpy() for o in flat]
            # Timed runs in chunks of about timeout/2 each (time_evaluator adds one warm-up
            # run per call), so that every step keeps the same deadline, however large repeat.
            latencies: list[float] = []
            timer = None
            total = job["repeat"]
            while len(latencies) < total:
                chunk = int(max(1, min(total - len(latencies), (timeout / 2) // max(once, 1e-6) - 1)))
                first_run, last_run = len(latencies) + 1, len(latencies) + chunk
                span = f"runs {first_run}-{last_run}" if last_run > first_run else f"run {first_run}"
                what = step(f"timing {span} of {total}")
                timer = vm.time_evaluator("invoke_stateful", dev, number=1, repeat=chunk)
                latencies += [float(t) * 1e3 for t in timer("main").results]
        except StepFailure:
            raise
        except Exception as e:  # noqa: BLE001
            raise StepFailure("board", _session_failure(board, what, e, job)) from None
        out_path = Path(job["job_dir"]) / f"run{number}.npz"
        np.savez(out_path, **{f"o{k}": v for k, v in enumerate(outs)})
        emit("run", board=board, latencies_ms=latencies, outputs=str(out_path))
        # -------- close the session (frees the board for the tracker's next request)
        del timer, result, flat, args, vm, rlib, dev, sess
        gc.collect()


VTA_SERVER = "python -m tvm_layerfuse.runtime.vta.rpc_server"


def _run_vta(job: dict[str, Any], emit: Callable[..., None], art: Path) -> None:
    """A VTA artifact: its files go to the board's VTA runtime (:mod:`tvm_layerfuse.runtime.vta.rpc_server`),
    which runs the programs on its device (simulator or VTA) and the host steps in the
    artifact's TVM-compiled ``host.so`` (built for the board's machine: checked first)."""
    import gc
    import hashlib
    import io

    timeout = job["timeout"]
    files: dict[str, bytes] = {}
    for name, digest in job["vta_files"].items():
        data = (art / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise StepFailure("artifact", f"{name!r} in artifact {str(art)!r} changed after it was verified; copy the artifact again")
        files[name] = data
    with np.load(job["inputs"], allow_pickle=False) as data:
        buf = io.BytesIO()
        np.savez(buf, **{k: data[k] for k in data.files})
    inputs = bytearray(buf.getvalue())
    total_mb = sum(len(b) for b in files.values()) / 1e6
    known: dict[str, Optional[str]] = {}  # board -> its machine
    hint = "the board is down or unreachable, or its RPC server does not answer - check the board"
    for number, board, sess, step in _sessions(job, emit, connect_hint=hint):
        if board not in known:
            step("asking the board what it is")
            known[board] = _remote_machine(sess)
            emit("board", address=board, machine=known[board], hostname=_remote_hostname(sess), key=job["key"])
        try:  # host.so is built for one machine: refuse another before uploading
            fit_board({"target": {"machine": job["machine"], "preset": job["preset"], "device": "vta"}}, board=board,
                      machine=known[board])  # fmt: skip
        except BoardMismatchError as e:
            raise StepFailure("mismatch", str(e)) from None
        try:
            load = sess.get_function("tvm_layerfuse.vta.load")
        except Exception:  # noqa: BLE001 - a plain TVM server: no VTA runtime registered
            raise StepFailure(
                "mismatch",
                f"board {board} has no VTA runtime (its RPC server lacks tvm_layerfuse.vta.load); nothing was run - "
                f"start the board's server with {VTA_SERVER} (a bundle's rpc_server.sh does for a vta artifact)",
            ) from None
        try:
            what = step(f"uploading the VTA programs, DRAM image and host steps ({total_mb:.1f} MB)")
            for name, data in files.items():
                sess.upload(bytearray(data), name)
            what = step("loading the VTA artifact")
            load(next(iter(job["vta_files"])))
            what = step("running the model")
            t0 = time.perf_counter()
            out = bytes(sess.get_function("tvm_layerfuse.vta.run")(inputs))
            once = time.perf_counter() - t0
            counters = json.loads(sess.get_function("tvm_layerfuse.vta.counters")())
            with np.load(io.BytesIO(out), allow_pickle=False) as z:
                outs = [z[f"o{k}"] for k in range(len(z.files))]
            if len(outs) != len(job["outputs"]):
                raise StepFailure("artifact", f"board {board} returned {len(outs)} outputs; the manifest lists {len(job['outputs'])}")
            latencies: list[float] = []
            timer = sess.get_function("tvm_layerfuse.vta.time")
            while len(latencies) < job["repeat"]:
                chunk = int(max(1, min(job["repeat"] - len(latencies), (timeout / 2) // max(once, 1e-6))))
                what = step(f"timing runs {len(latencies) + 1}-{len(latencies) + chunk} of {job['repeat']}")
                latencies += [float(t) for t in json.loads(timer(chunk))]
        except StepFailure:
            raise
        except Exception as e:  # noqa: BLE001
            detail = first_line(e, last=True)
            if "VTAError: " in detail:  # the board's VTA runtime refused (no device, damaged files ...)
                raise StepFailure("board", f"board {board} failed while {what}: {detail.split('VTAError: ', 1)[1]}") from None
            raise StepFailure("board", _session_failure(board, what, e, job)) from None
        out_path = Path(job["job_dir"]) / f"run{number}.npz"
        np.savez(out_path, **{f"o{k}": v for k, v in enumerate(outs)})
        emit("run", board=board, latencies_ms=latencies, outputs=str(out_path), counters=counters)
        del load, timer, sess
        gc.collect()


def _sessions(job: Mapping[str, Any], emit: Callable[..., None], *, connect_hint: str) -> Iterator[tuple]:
    """``(number, board, sess, step)`` for each of the job's sessions: the board (handed out
    by the tracker, or ``job["rpc"]``) as ``"host:port"``, an RPC session to it, and
    ``step(what, hint=None)``, which reports the step (``emit``) and returns ``what``.
    Closes the tracker client after the last one."""
    timeout = job["timeout"]
    tracker = TrackerClient(tuple(job["tracker"]), key=job["key"], timeout=timeout, emit=emit) if job["tracker"] else None
    for number in range(job["sessions"]):
        if tracker is not None:
            host, port, matchkey = tracker.request()
        else:
            # a server started with --key (and no tracker) wants it
            (host, port), matchkey = job["rpc"], job["key"] or ""
        board = f"{host}:{port}"

        def step(what: str, hint: Optional[str] = None, board: str = board) -> str:
            emit("step", what=what, where=f"board {board}", limit=timeout, **({"hint": hint} if hint else {}))
            return what

        step("connecting", hint=connect_hint)
        # no reference to the session stays here: the caller's `del sess` frees the board
        # before the next request
        yield number, board, _connect(host, port, matchkey, job, tracker=tracker), step
    if tracker is not None:
        tracker.close()


def _connect(host: str, port: int, matchkey: str, job: Mapping[str, Any], *, tracker: Optional["TrackerClient"]):
    from tvm import rpc as tvm_rpc

    try:
        return tvm_rpc.connect(host, port, key=matchkey, session_timeout=job["session_timeout"])
    except Exception as e:  # noqa: BLE001
        raise StepFailure("unreachable", _connect_failure(host, port, e, tracker=tracker)) from None


def _flatten(value: Any) -> list[Any]:
    if hasattr(value, "numpy"):
        return [value]
    out: list[Any] = []
    for v in value:
        out.extend(_flatten(v))
    return out


def _remote_machine(sess) -> Optional[str]:
    """The board's machine: the ELF header of the server's own executable.

    TVM 0.27's RPC has no call that reports the server's architecture, but the server
    can send a file (``tvm.rpc.server.download``; an absolute path is read as it is) and
    ``/proc/self/exe`` is the interpreter that will dlopen the library (qemu-user maps it
    to the emulated one). Where that fails (a non-Linux board, a server that confines
    paths) the machine is unknown and the library's own load error has the last word.
    """
    try:
        data = sess.download("/proc/self/exe")
    except Exception as e:  # noqa: BLE001 - non-Linux boards, or a server that refuses
        log.warning("could not read the board's executable (%s)", first_line(e, last=True))
        return None
    return elf_machine(bytes(data[:20]))


def _remote_hostname(sess) -> Optional[str]:
    try:
        name = bytes(sess.download("/etc/hostname")).decode(errors="replace").strip()
    except Exception:  # noqa: BLE001 - informative only
        return None
    return name or None


def _connect_failure(host: str, port: int, e: BaseException, *, tracker: Optional["TrackerClient"]) -> str:
    """Why connecting failed, in words: ask the OS (a plain socket) what the C++ client hid."""
    detail = first_line(e, last=True)
    where = f"cannot connect to board {host}:{port}"
    if "cannot obtain address" in detail:
        return f"{where}: host {host!r} is unknown (DNS lookup failed); check the name in --rpc HOST:PORT"
    try:
        with socket.create_connection((host, port), timeout=5.0):
            pass
    except ConnectionRefusedError:
        if tracker is not None:
            return f"{where}: connection refused - the tracker handed out a board whose server has gone; restart it"
        return (
            f"{where}: connection refused, nothing listens there; start the server on the board: "
            f"python -m tvm.exec.rpc_server --host 0.0.0.0 --port {port}"
        )
    except socket.timeout:
        return f"{where}: no answer within 5 s - the board is down or unreachable; check it is on and on the network"
    except OSError as oe:
        return f"{where}: {oe.strerror or oe}; check the address and the network"
    return (
        f"{where}: the RPC handshake failed ({detail}) - the server expects another key (pass the --key it was "
        "started with) or it is not a TVM RPC server"
    )


def _session_failure(board: str, what: str, e: BaseException, job: Mapping[str, Any]) -> str:
    detail = first_line(e, last=True)
    low = detail.lower()
    if "sessiontimeout" in low or "session has expired" in low:
        return (
            f"board {board} ended the session after its {job['session_timeout']:g} s session timeout while {what}; "
            "raise --session-timeout (or --timeout)"
        )
    if any(s in low for s in ("connection", "socket", "closed", "shutdown", "broken pipe", "eof", "reset")):
        why = "" if "kshutdown" in low else f" ({detail})"
        return (
            f"board {board} dropped the connection while {what}{why}; its RPC server stopped or crashed - "
            "check the server's log on the board and restart it"
        )
    return f"board {board} failed while {what}: {detail}"
