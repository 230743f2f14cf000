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

TVM's RPC client is C++ and blocks without a deadline (connect, every call), so steps
3-4 run in a worker subprocess (``python -c ... _worker_main``, runtime-only TVM) that
reports each step on a pipe; this process enforces the deadline of each step and kills
the worker when one passes. A board that is down, a server killed mid-run, a board that
hangs or a link that is too slow all end with one line: :class:`DeployError`.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from ..runtime import artifact
from ..errors import ArtifactError, LayerfuseError, UsageError
from ..runtime.loader import _contiguous, check_inputs, parse_device, read_weights

log = logging.getLogger(__name__)

Address = Union[str, Sequence[Any]]
Inputs = Union[np.ndarray, Sequence[np.ndarray], Mapping[str, np.ndarray]]

DEFAULT_RPC = ("127.0.0.1", 9091)
DEFAULT_TIMEOUT = 60.0
# TVM's server waits on a session with poll() in milliseconds: a session timeout above
# ~2.1e6 s overflows it, and the server's accept thread dies (the server never answers again).
MAX_SESSION_TIMEOUT = 86400.0

# ELF e_machine -> the machine names the manifests use (runtime.this_machine spelling).
_ELF_MACHINES = {
    0x03: "i386",
    0x08: "mips",
    0x14: "ppc",
    0x15: "ppc64",
    0x28: "armv7l",
    0x3E: "x86_64",
    0xB7: "aarch64",
    0xF3: "riscv64",
}


class DeployError(LayerfuseError):
    """A deployment over RPC failed: the tracker, the link or the board."""

    exit_code = 1


class DeployTimeoutError(DeployError):
    """A step of a deployment did not finish within its deadline."""


class BoardMismatchError(DeployError):
    """The artifact was compiled for another machine or device than the board offers."""

    exit_code = 2


# ---------------------------------------------------------------------- results
@dataclass(frozen=True)
class BoardInfo:
    """A board (RPC server) that ran the model, as it described itself."""

    address: str  # "host:port" the client connected to
    machine: Optional[str]  # from the ELF header of the server's executable; None if unknown
    hostname: Optional[str] = None
    key: Optional[str] = None  # tracker key it was handed out under


@dataclass(frozen=True)
class RunRecord:
    """One timed run: which board, and the remote latency time_evaluator measured."""

    board: str
    latency_ms: float


@dataclass(frozen=True)
class Latency:
    median_ms: float
    min_ms: float
    max_ms: float
    runs: int


@dataclass
class DeployResult:
    """Outputs (by name, from the first session), remote latency, and who ran it."""

    artifact: Path
    device: str
    outputs: dict[str, np.ndarray]
    latency: Latency
    runs: list[RunRecord]
    boards: list[BoardInfo]
    max_run_difference: float = 0.0  # max |output - first session's output| over all sessions
    wall_s: float = 0.0
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def board(self) -> BoardInfo:
        return self.boards[0]

    def latency_by_board(self) -> dict[str, Latency]:
        by: dict[str, list[float]] = {}
        for r in self.runs:
            by.setdefault(r.board, []).append(r.latency_ms)
        return {b: _stats(v) for b, v in by.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "artifact": str(self.artifact),
            "device": self.device,
            "latency": asdict(self.latency),
            "runs": [asdict(r) for r in self.runs],
            "boards": [asdict(b) for b in self.boards],
            "max_run_difference": self.max_run_difference,
            "wall_s": round(self.wall_s, 3),
            "outputs": {n: {"shape": list(v.shape), "dtype": str(v.dtype)} for n, v in self.outputs.items()},
        }

    def summary(self, *, top: int = 5) -> str:
        """A few lines for people: where it ran, how fast, what came out (top-k for classifiers)."""
        target = self.manifest.get("target", {})
        name = (self.manifest.get("model") or {}).get("name") or self.artifact.name
        lines = [
            f"deployed {name} (target {target.get('preset', '?')}) to {len(self.boards)} board(s), device {self.device}: "
            f"{len(self.runs)} timed run(s) in {self.wall_s:.1f} s"
        ]
        by = self.latency_by_board()
        for b in self.boards:
            s = by.get(b.address)
            where = ", ".join(x for x in (b.machine, f"host {b.hostname}" if b.hostname else None) if x)
            if s:
                lines.append(
                    f"  board {b.address} ({where}): {s.runs} run(s), median {s.median_ms:.3f} ms "
                    f"(min {s.min_ms:.3f}, max {s.max_ms:.3f})"
                )
        lat = self.latency
        lines.append(
            f"latency: median {lat.median_ms:.3f} ms, min {lat.min_ms:.3f} ms, max {lat.max_ms:.3f} ms over {lat.runs} run(s)"
        )
        if len(self.runs) > 1 and len({r.board for r in self.runs}) > 1:
            lines.append(f"outputs agree across boards within {self.max_run_difference:.3g} (max abs difference)")
        for n, v in self.outputs.items():
            lines.append(f"output {n!r} {list(v.shape)} {v.dtype}: {_describe_output(v, top=top)}")
        return "\n".join(lines)


def _stats(values_ms: Sequence[float]) -> Latency:
    return Latency(
        median_ms=float(statistics.median(values_ms)),
        min_ms=float(min(values_ms)),
        max_ms=float(max(values_ms)),
        runs=len(values_ms),
    )


def _describe_output(v: np.ndarray, *, top: int) -> str:
    """Top-k classes for classifier-shaped outputs ([N, C]), else range and mean."""
    if v.ndim == 2 and v.shape[1] >= 2 and np.issubdtype(v.dtype, np.number) and v.size:
        parts = []
        for i, row in enumerate(v[:4]):
            k = min(top, row.shape[0])
            idx = np.argsort(-row, kind="stable")[:k]
            ranked = ", ".join(f"{int(j)} ({float(row[j]):.4g})" for j in idx)
            parts.append((f"[{i}] " if v.shape[0] > 1 else "") + f"top-{k} {ranked}")
        return "; ".join(parts) + (" ..." if v.shape[0] > 4 else "")
    if v.size and np.issubdtype(v.dtype, np.number):
        return f"min {float(v.min()):.4g}, max {float(v.max()):.4g}, mean {float(v.mean()):.4g}"
    return "(empty)" if not v.size else f"{v.dtype} values"


# ---------------------------------------------------------------------- inputs
def parse_address(value: Address, *, what: str = "--rpc") -> tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"`` or ``(host, port)`` -> ``(host, port)``."""
    if isinstance(value, str):
        host, sep, port = value.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host:
            raise UsageError(f"{what} {value!r} is malformed; expected HOST:PORT, e.g. 127.0.0.1:9091")
    else:
        try:
            host, port = value
        except (TypeError, ValueError):
            raise UsageError(f"{what} {value!r} is malformed; expected (host, port)") from None
    try:
        port_no = int(port)
    except (TypeError, ValueError):
        raise UsageError(f"{what} {value!r} has a non-integer port; expected HOST:PORT, e.g. 127.0.0.1:9091") from None
    if not 0 < port_no < 65536:
        raise UsageError(f"{what} {value!r} has port {port_no}; expected 1..65535")
    return str(host), port_no


def normalize_inputs(manifest: Mapping[str, Any], inputs: Inputs) -> list[np.ndarray]:
    """Inputs in manifest order, checked by name, shape and dtype (the runtime's own rules)."""
    return [_contiguous(v) for v in check_inputs(manifest["inputs"], inputs)]


def random_inputs(manifest: Mapping[str, Any], *, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random inputs of the manifest's shapes and dtypes (standard normal for floats)."""
    rng = np.random.default_rng(seed)
    values = {}
    for spec in manifest["inputs"]:
        dtype = np.dtype(spec["dtype"])
        shape = [int(d) for d in spec["shape"]]
        if np.issubdtype(dtype, np.floating):
            values[spec["name"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            values[spec["name"]] = rng.integers(0, 2, shape).astype(dtype)
        else:
            values[spec["name"]] = rng.integers(0, 10, shape).astype(dtype)
    return values


def elf_machine(head: bytes) -> Optional[str]:
    """Machine of an ELF file from its first 20 bytes (None when it is not ELF)."""
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    order = "<" if head[5] == 1 else ">"
    (code,) = struct.unpack(order + "H", head[18:20])
    name = _ELF_MACHINES.get(code, f"elf-machine-{code:#x}")
    if code == 0xF3 and head[4] == 1:
        name = "riscv32"
    return name


def _check_library(path: Path, manifest: Mapping[str, Any]) -> None:
    """The library must be for the machine the manifest names (else the manifest lies)."""
    expected = manifest["target"].get("machine")
    with open(path / manifest["library"], "rb") as f:
        found = elf_machine(f.read(20))
    if expected and found and found != expected:
        raise ArtifactError(
            f"library {manifest['library']!r} of artifact {str(path)!r} is {found} code, but the manifest says "
            f"{expected}; the artifact was edited or mixed up - re-run `compile`"
        )


def _fit_board(manifest: Mapping[str, Any], *, board: str, machine: Optional[str]) -> None:
    """Refuse an artifact whose machine is not the board's (before anything is uploaded)."""
    target = manifest["target"]
    wanted = target.get("machine")
    if machine is None or not wanted or machine == wanted:
        return
    preset = {"aarch64": "aarch64", "x86_64": "cpu"}.get(machine)
    raise BoardMismatchError(
        f"artifact was compiled for {wanted} (target {target.get('preset')}), but board {board} runs {machine}; "
        f"nothing was uploaded - "
        + (
            f"compile with --target {preset} for this board"
            if preset
            else f"compile with a target preset for {machine}"
        )
        + f", or deploy to {'an' if wanted[:1] in 'aeiox' else 'a'} {wanted} board"
    )


def _check_device(manifest: Mapping[str, Any], device: str) -> None:
    kind, _ = parse_device(device)
    target = manifest["target"]
    if target.get("device") != kind:
        raise BoardMismatchError(
            f"artifact was compiled for {target.get('device')} ({target.get('preset')}"
            f"{' ' + target['arch'] if target.get('arch') else ''}), but --device {device} was requested; "
            f"deploy it with --device {target.get('device')} or compile for {kind}"
        )


# ---------------------------------------------------------------------- deploy
def deploy(
    artifact_dir: Union[str, os.PathLike],
    *,
    rpc: Optional[Address] = None,
    tracker: Optional[Address] = None,
    key: Optional[str] = None,
    device: str = "cpu",
    inputs: Optional[Inputs] = None,
    repeat: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
    session_timeout: Optional[float] = None,
    seed: int = 0,
    progress: Optional[Callable[[str], None]] = None,
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
    ``progress`` receives a line per step. Raises :class:`DeployError` (one line) when the
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
    kind, index = parse_device(device)

    manifest = artifact.read_manifest(path)
    _check_device(manifest, device)
    device = kind if kind == "cpu" else f"cuda:{index}"
    artifact.verify(path, manifest)
    _check_library(path, manifest)
    if inputs is None:
        inputs = random_inputs(manifest, seed=seed)
        log.info("no inputs given: seeded random inputs (seed %d)", seed)
    values = normalize_inputs(manifest, inputs)

    sessions = repeat if tracker_addr else 1
    per_session = 1 if tracker_addr else repeat
    steps = 6 + per_session  # connect, probe, upload, load, weights, run + at most one timing step per run
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
        }
        records = _run_worker(job, timeout=float(timeout), progress=progress)
        return _assemble(path, manifest, device, records, started)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


def _assemble(path: Path, manifest, device: str, records: dict[str, Any], started: float) -> DeployResult:
    runs: list[RunRecord] = []
    first: Optional[dict[str, np.ndarray]] = None
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
        latency=_stats([r.latency_ms for r in runs]),
        runs=runs,
        boards=boards,
        max_run_difference=diff,
        wall_s=time.perf_counter() - started,
        manifest=manifest,
    )


# ---------------------------------------------------------------------- the watchdog (this process)
def _worker_command() -> list[str]:
    return [sys.executable, "-c", "from tvm_layerfuse.deploy.client import _worker_main; _worker_main()"]


def _run_worker(job: dict[str, Any], *, timeout: float, progress: Optional[Callable[[str], None]]) -> dict[str, Any]:
    """Run the job in a worker process; enforce each step's deadline; return its records."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["TVM_USE_RUNTIME_LIB"] = "1"  # the client needs only the runtime (RPC lives there)
    stderr_path = Path(job["job_dir"]) / "worker.stderr"
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            _worker_command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            start_new_session=True,  # Ctrl-C reaches this process only; the worker is killed below
        )
    records: dict[str, Any] = {"runs": [], "boards": []}
    step = {"what": "starting the RPC client", "where": "this machine", "limit": max(timeout, 30.0)}
    deadline = time.monotonic() + step["limit"]
    buffer = b""
    try:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:  # it died at start; its stderr says why (below)
            pass
        fd = proc.stdout.fileno()
        while True:
            wait = deadline - time.monotonic()
            if wait <= 0:
                _kill(proc)
                raise DeployTimeoutError(_timeout_message(step, job))
            ready, _, _ = select.select([fd], [], [], min(wait, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                event = json.loads(line)
                kind = event.pop("event")
                if kind == "step":
                    step = event
                    deadline = time.monotonic() + float(event["limit"])
                    text = f"{event['where']}: {event['what']}"
                    log.info("deploy: %s", text)
                    if progress:
                        progress(text)
                elif kind == "board":
                    records["boards"].append(event)
                elif kind == "run":
                    records["runs"].append(event)
                elif kind == "error":
                    _kill(proc)
                    cls = {"mismatch": BoardMismatchError, "timeout": DeployTimeoutError}.get(
                        event["kind"], DeployError
                    )
                    raise cls(event["message"])
                elif kind == "done":
                    try:
                        proc.wait(timeout=5.0)
                    except subprocess.TimeoutExpired:  # the results are in; do not wait for its exit
                        pass
                    return records
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        tail = _tail(stderr_path)
        log.debug("RPC client stderr:\n%s", stderr_path.read_text(errors="replace") if stderr_path.exists() else "")
        raise DeployError(
            f"the RPC client process ended (status {proc.returncode}) while {step['what']} ({step['where']})"
            + (f": {tail}" if tail else "")
            + "; check the board's server log (--verbose shows this client's log)"
        )
    finally:
        _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the worker and nothing else
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()


def _tail(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _timeout_message(step: Mapping[str, Any], job: Mapping[str, Any]) -> str:
    return (
        f"{step['where']}: timed out after {float(step['limit']):g} s while {step['what']} (--timeout {job['timeout']:g}); "
        + step.get(
            "hint", "the board or the link is down, hung or too slow - check the board's RPC server, or raise --timeout"
        )
    )


# ---------------------------------------------------------------------- the worker (a subprocess)
class _Fail(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _first_line(e: BaseException) -> str:
    """The informative line of a TVM error (they carry tracebacks and check expressions)."""
    import re

    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(("File ", "at ", "[bt]", "Traceback", "^"))]
    best = lines[-1] if lines else type(e).__name__
    best = re.sub(r"^(tvm\.error\.)?\w*Error: ", "", best)
    best = re.sub(r"^(Check failed: )?\(.*?\) is false: ", "", best)
    return best[:300]


def _worker_main() -> None:
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
    try:
        _worker_run(job, emit)
        emit("done")
    except _Fail as f:
        emit("error", kind=f.kind, message=f.message)
    except BaseException as e:  # noqa: BLE001 - everything reaches the parent as one line
        emit("error", kind="internal", message=f"the RPC client failed: {type(e).__name__}: {_first_line(e)}")
    finally:
        events.close()


def _worker_run(job: dict[str, Any], emit: Callable[..., None]) -> None:
    import gc
    import hashlib

    timeout = job["timeout"]
    socket.setdefaulttimeout(timeout)  # every Python socket of this worker (the tracker's)
    import tvm
    from tvm import rpc as tvm_rpc
    from tvm.runtime import vm as vm_runtime

    art = Path(job["artifact"])
    lib_bytes = (art / job["library"]).read_bytes()
    if hashlib.sha256(lib_bytes).hexdigest() != job["library_sha256"]:
        raise _Fail(
            "artifact",
            f"{job['library']!r} in artifact {str(art)!r} changed after it was verified; copy the artifact again",
        )
    weights: list[np.ndarray] = []
    if job["params_file"]:
        pfile = art / job["params_file"]
        if artifact.sha256_file(pfile) != job["params_sha256"]:
            raise _Fail(
                "artifact",
                f"{job['params_file']!r} in artifact {str(art)!r} changed after it was verified; copy the artifact again",
            )
        try:
            weights = read_weights(art, job["params_file"], job["params_order"])
        except ArtifactError as e:
            raise _Fail("artifact", str(e)) from None
    with np.load(job["inputs"], allow_pickle=False) as data:
        inputs = [_contiguous(data[f"i{k}"]) for k in range(len(data.files))]
    weight_mb = sum(w.nbytes for w in weights) / 1e6
    kind, _, index = job["device"].partition(":")
    index = int(index or 0)
    known: dict[str, dict[str, Any]] = {}
    tracker = None
    if job["tracker"]:
        tracker = _TrackerClient(tuple(job["tracker"]), key=job["key"], timeout=timeout, emit=emit)

    for number in range(job["sessions"]):
        # -------- which board
        if tracker is not None:
            host, port, matchkey = tracker.request()
        else:
            host, port = job["rpc"]
            matchkey = job["key"] or ""  # a server started with --key (and no tracker) wants it
        board = f"{host}:{port}"

        def step(what: str, limit: float = timeout, hint: Optional[str] = None, board: str = board) -> str:
            emit("step", what=what, where=f"board {board}", limit=limit, **({"hint": hint} if hint else {}))
            return what

        # -------- connect
        step(
            "connecting",
            hint="the board is down or unreachable, or its RPC server does not answer - check the board and restart its server",
        )
        try:
            sess = tvm_rpc.connect(host, port, key=matchkey, session_timeout=job["session_timeout"])
        except Exception as e:  # noqa: BLE001
            raise _Fail("unreachable", _connect_failure(host, port, e, tracker=tracker)) from None

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
                _fit_board(
                    {"target": {"machine": job["machine"], "preset": job["preset"]}}, board=board, machine=machine
                )
            except BoardMismatchError as e:
                raise _Fail("mismatch", str(e)) from None
        try:
            dev = sess.cuda(index) if kind == "cuda" else sess.cpu(0)
            present = dev.exist
        except Exception as e:  # noqa: BLE001
            raise _Fail("board", _session_failure(board, "asking the board what it is", e, job)) from None
        if not present:
            raise _Fail(
                "mismatch",
                f"board {board} has no {job['device']} device; nothing was uploaded - if it has an NVIDIA GPU, start its "
                "server with --load-library <site-packages>/tvm/lib/libtvm_runtime_cuda.so (a runtime-only TVM does not "
                "load CUDA support by itself), or deploy with --device cpu",
            )

        # -------- upload, load, run, time
        try:
            what = step(f"uploading {job['library']} ({len(lib_bytes) / 1e6:.1f} MB)")
            sess.upload(bytearray(lib_bytes), "model.so")
            what = step("loading the library")
            rlib = sess.load_module("model.so")
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
                raise _Fail(
                    "artifact",
                    f"the library returned {len(flat)} outputs on board {board}; the manifest lists {len(job['outputs'])} - re-run `compile`",
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
        except _Fail:
            raise
        except Exception as e:  # noqa: BLE001
            raise _Fail("board", _session_failure(board, what, e, job)) from None
        out_path = Path(job["job_dir"]) / f"run{number}.npz"
        np.savez(out_path, **{f"o{k}": v for k, v in enumerate(outs)})
        emit("run", board=board, latencies_ms=latencies, outputs=str(out_path))
        # -------- close the session (frees the board for the tracker's next request)
        del timer, result, flat, args, vm, rlib, dev, sess
        gc.collect()
    if tracker is not None:
        tracker.close()


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
        log.warning("could not read the board's executable (%s)", _first_line(e))
        return None
    return elf_machine(bytes(data[:20]))


def _remote_hostname(sess) -> Optional[str]:
    try:
        name = bytes(sess.download("/etc/hostname")).decode(errors="replace").strip()
    except Exception:  # noqa: BLE001 - informative only
        return None
    return name or None


def _connect_failure(host: str, port: int, e: BaseException, *, tracker: Optional["_TrackerClient"]) -> str:
    """Why connecting failed, in words: ask the OS (a plain socket) what the C++ client hid."""
    detail = _first_line(e)
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
    detail = _first_line(e)
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


class _TrackerClient:
    """TVM's tracker protocol (``tvm.rpc.client.TrackerSession``) with deadlines.

    ``TrackerSession`` retries a refused connection for 60 s, waits for a free board
    without any deadline (its ``request`` retries a timed-out wait five times) and hides
    the address of the board it hands out. So this sends the same messages through a
    ``TrackerSession`` whose socket was opened here with a timeout.
    """

    def __init__(self, addr: tuple[str, int], *, key: str, timeout: float, emit: Callable[..., None]) -> None:
        from tvm.rpc import base
        from tvm.rpc.client import TrackerSession

        self.addr, self.key, self.timeout, self.emit = addr, key, timeout, emit
        self._base = base
        where = f"{addr[0]}:{addr[1]}"
        emit("step", what="connecting", where=f"tracker {where}", limit=timeout)
        try:
            sock = socket.create_connection(addr, timeout=timeout)
            sock.settimeout(timeout)
            sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
            magic = struct.unpack("<i", base.recvall(sock, 4))[0]
        except ConnectionRefusedError:
            raise _Fail(
                "unreachable",
                f"cannot connect to the tracker {where}: connection refused; start it: python -m tvm.exec.rpc_tracker --host 0.0.0.0 --port {addr[1]}",
            ) from None
        except socket.timeout:
            raise _Fail(
                "timeout", f"the tracker {where} did not answer within {timeout:g} s; check the address in --tracker"
            ) from None
        except OSError as e:
            raise _Fail(
                "unreachable", f"cannot connect to the tracker {where}: {e.strerror or e}; check --tracker HOST:PORT"
            ) from None
        if magic != base.RPC_TRACKER_MAGIC:
            sock.close()
            raise _Fail("unreachable", f"{where} is not a TVM RPC tracker; check --tracker HOST:PORT")
        self.session = TrackerSession.__new__(TrackerSession)
        self.session._addr = addr
        self.session._sock = sock
        self.where = where

    def summary(self) -> dict[str, Any]:
        return self.session.summary()

    def request(self) -> tuple[str, int, str]:
        base = self._base
        summary = self.summary()
        servers = [s for s in summary.get("server_info", []) if s.get("key") == "server:" + self.key]
        if not servers:
            keys = sorted({s.get("key", "")[len("server:") :] for s in summary.get("server_info", [])} - {""})
            raise _Fail(
                "unreachable",
                f"the tracker {self.where} has no board registered under key {self.key!r} "
                f"(keys there: {', '.join(keys) or 'none'}); start one with "
                f"python -m tvm.exec.rpc_server --tracker {self.where} --key {self.key}, or use another --key",
            )
        free = (summary.get("queue_info", {}).get(self.key) or {}).get("free", 0)
        self.emit(
            "step",
            what=f"waiting for a free board under key {self.key!r} ({len(servers)} registered, {free} free)",
            where=f"tracker {self.where}",
            limit=self.timeout,
            hint="every board under this key stayed busy; raise --timeout or add boards",
        )
        try:
            base.sendjson(self.session._sock, [base.TrackerCode.REQUEST, self.key, "", 1])
            value = base.recvjson(self.session._sock)
        except socket.timeout:
            raise _Fail(
                "timeout",
                f"no board under key {self.key!r} became free within {self.timeout:g} s at the tracker {self.where} "
                f"({len(servers)} registered, all busy); raise --timeout or add boards",
            ) from None
        except OSError as e:
            raise _Fail(
                "unreachable", f"the tracker {self.where} dropped the connection ({e}); is it still running?"
            ) from None
        if not isinstance(value, list) or value[0] != base.TrackerCode.SUCCESS:
            raise _Fail("unreachable", f"the tracker {self.where} refused the request for key {self.key!r}: {value!r}")
        url, port, matchkey = value[1]
        return str(url), int(port), str(matchkey)

    def close(self) -> None:
        self.session.close()


# ---------------------------------------------------------------------- command line
def _load_input_file(path: str, manifest: Mapping[str, Any]) -> dict[str, np.ndarray]:
    names = [i["name"] for i in manifest["inputs"]]
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--input {path!r} does not exist; expected a .npy (one input) or .npz (by input name) file")
    try:
        data = np.load(p, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"--input {path!r} is not a readable .npy/.npz file ({e})") from None
    if isinstance(data, np.ndarray):
        if len(names) != 1:
            raise UsageError(
                f"--input {path!r} holds one array, but the model has inputs {names}; give an .npz with one array per name"
            )
        return {names[0]: data}
    with data:
        files = list(data.files)
        if len(files) == 1 and len(names) == 1 and files[0] not in names:
            return {names[0]: data[files[0]]}
        unknown = [f for f in files if f not in names]
        if unknown:
            raise UsageError(
                f"--input {path!r} has array {unknown[0]!r}, which is not an input of the model; expected names {names}"
            )
        return {n: data[n] for n in files}


def write_outputs(path: Union[str, os.PathLike], outputs: Mapping[str, np.ndarray]) -> Path:
    """Write ``outputs`` as an .npz atomically: a temporary file beside it, then rename."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(
            f"--output {str(path)!r}: directory {str(parent)!r} does not exist; create it or choose another path"
        )
    import zipfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            # np.savez's own layout, written entry by entry: any output name is a valid key
            # (np.savez(**outputs) would take an output called "file" for its argument).
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                for name, value in outputs.items():
                    with zf.open(f"{name}.npy", "w", force_zip64=True) as entry:
                        np.lib.format.write_array(entry, np.asanyarray(value), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def cmd_deploy(args) -> int:
    if args.rpc and args.tracker:
        raise UsageError("both --rpc and --tracker given; expected one")
    if args.output and not str(args.output).endswith(".npz"):
        raise UsageError(f"--output {args.output!r} should end in .npz (outputs are written by name)")
    if args.output and not (Path(args.output).parent if str(Path(args.output).parent) else Path(".")).is_dir():
        raise UsageError(f"--output {args.output!r}: its directory does not exist; create it or choose another path")
    path = Path(args.artifact)
    inputs = None
    if args.input:
        inputs = _load_input_file(args.input, artifact.read_manifest(path))
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
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; expected N >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive; expected N >= 1")
    return value


def _seconds(text: str) -> float:
    import argparse

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
        from ..cli.commands import _verbosity_parent

        parents = [_verbosity_parent()]
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
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N on the board")
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
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_deploy)
    return p
