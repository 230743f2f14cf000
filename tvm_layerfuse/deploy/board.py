"""The board side of ``deploy``: TVM's own RPC server and tracker, runtime only.

::

    python -m tvm_layerfuse.board server  [--host 127.0.0.1] [--port 9091] [--tracker H:P --key K]
    python -m tvm_layerfuse.board tracker [--host 127.0.0.1] [--port 9190]
    python -m tvm_layerfuse.board arm64   [--port 9091] [--tracker H:P --key K] [--vta]   # emulated AArch64 board

Each starts ``python -m tvm.exec.rpc_server`` (or ``rpc_tracker``) with
``TVM_USE_RUNTIME_LIB=1`` in a process group of its own, waits until it is ready
(listening, or registered with the tracker), and runs until Ctrl-C. From Python::

    from tvm_layerfuse import board
    with board.start_server(port=board.free_port()) as server:
        rpc.deploy(art, rpc=server.address)

``arm64`` runs the board's AArch64 Python under ``qemu-aarch64-static`` from the tree that
``scripts/setup_arm64_board.sh`` prepares (see :func:`arm64_board`). TVM's server starts its
worker with ``sys.executable``; without binfmt_misc the kernel cannot exec an AArch64
binary, so ``sys.executable`` is pointed at the tree's x86 wrapper script, which execs qemu.
``arm64 --vta`` serves vta artifacts there: ``tvm_layerfuse.runtime.vta.rpc_server`` (the simulator
standing in for the FPGA) with tvm_layerfuse's runtime files, as a bundle holds them
(:func:`tvm_layerfuse.deploy.bundle.copy_runtime`), on the board's ``PYTHONPATH``.

The default address is loopback. TVM RPC has no authentication: anyone who can reach the
port can upload and run code. Binding beyond loopback (``--host 0.0.0.0``) is the user's
explicit choice, for trusted networks only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from ..errors import LayerfuseError, UsageError

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "::1", "localhost")
ARM64_ENV = "TVM_LAYERFUSE_ARM64_BOARD"
ARM64_SETUP = "scripts/setup_arm64_board.sh"

# Run a module with sys.executable replaced: the emulated board's interpreter cannot be
# re-executed by the kernel, its x86 wrapper script can.
_LAUNCH = (
    "import runpy, sys; sys.executable = sys.argv[1]; module = sys.argv[2]; "
    "sys.argv = [module] + sys.argv[3:]; runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


class BoardError(LayerfuseError):
    """A board process could not be started or did not become ready."""

    exit_code = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class BoardProcess:
    """A started RPC server or tracker: its address, process group and log file."""

    role: str  # "server" | "tracker"
    host: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    machine: str
    key: Optional[str] = None
    tracker: Optional[tuple[str, int]] = None
    _owns_log_dir: Optional[Path] = field(default=None, repr=False)
    _owns_site: Optional[Path] = field(default=None, repr=False)  # files put on the server's PYTHONPATH

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the whole process group (the server forks a worker per session)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, *, grace: float = 3.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; idempotent."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)  # a paused group cannot act on SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # The group may outlive its leader (TVM's popen worker runs the server thread).
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
            log.warning("%s %s:%d (pid %d) did not exit after SIGKILL", self.role, self.host, self.port, self.proc.pid)
        if self._owns_site is not None:
            shutil.rmtree(self._owns_site, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> "BoardProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        if self._owns_log_dir is not None and exc[0] is None:  # keep the log when something failed
            shutil.rmtree(self._owns_log_dir, ignore_errors=True)


def _check_bind(host: str) -> None:
    if host not in LOOPBACK:
        log.warning(
            "binding to %s: TVM RPC has no authentication - anyone who can reach this port can upload and run code "
            "on this machine; use it on trusted networks only",
            host,
        )


def _need_modules(python: str, modules: Sequence[str], what: str) -> None:
    """Refuse early, naming the package, when this interpreter lacks what TVM's server needs."""
    if python != sys.executable:
        return  # another interpreter (an emulated board): its setup script checked it
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise BoardError(
            f"TVM's {what} needs {', '.join(missing)}, which this Python lacks; pip install {' '.join(missing)}"
        )


def _spawn(
    role: str, cmd: list[str], *, env: dict[str, str], log_path: Optional[Path]
) -> tuple[subprocess.Popen, Path, Optional[Path]]:
    owned = None
    if log_path is None:
        owned = Path(tempfile.mkdtemp(prefix=f"tvm_layerfuse_{role}_"))
        log_path = owned / f"{role}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # one process group: stop() ends the server and its workers
        )
    return proc, Path(log_path), owned


def _wait_ready(bp: BoardProcess, *, ready_timeout: float, probe) -> None:
    deadline = time.monotonic() + ready_timeout
    delay = 0.05
    while True:
        if bp.proc.poll() is not None:
            tail = bp.log_tail(5).strip().splitlines()
            bp.stop()
            raise BoardError(
                f"the {bp.role} on {bp.host}:{bp.port} exited at start (status {bp.proc.returncode})"
                + (f": {tail[-1].strip()[:300]}" if tail else "")
                + f"; see {bp.log_path}"
            )
        if probe():
            return
        if time.monotonic() > deadline:
            bp.stop()
            raise BoardError(
                f"the {bp.role} on {bp.host}:{bp.port} was not ready within {ready_timeout:g} s; see {bp.log_path}"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def tracker_summary(tracker: tuple[str, int], *, timeout: float = 5.0) -> dict[str, Any]:
    """The tracker's summary (TVM's tracker protocol, with a socket deadline)."""
    from tvm.rpc import base

    with socket.create_connection(tracker, timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
        if struct.unpack("<i", base.recvall(sock, 4))[0] != base.RPC_TRACKER_MAGIC:
            raise BoardError(f"{tracker[0]}:{tracker[1]} is not a TVM RPC tracker")
        base.sendjson(sock, [base.TrackerCode.SUMMARY])
        value = base.recvjson(sock)
    if value[0] != base.TrackerCode.SUCCESS:
        raise BoardError(f"the tracker {tracker[0]}:{tracker[1]} refused its summary: {value!r}")
    return value[1]


def _registered(tracker: tuple[str, int], key: str, port: int) -> bool:
    try:
        summary = tracker_summary(tracker, timeout=2.0)
    except (OSError, BoardError):
        return False
    # The server reports itself (UPDATE_INFO) and offers itself (PUT) in one go.
    return any(
        s.get("key") == "server:" + key and int(s.get("addr", [None, -1])[1]) == port
        for s in summary.get("server_info", [])
    )


def _parse_tracker(tracker: Union[None, str, Sequence[Any]]) -> Optional[tuple[str, int]]:
    if tracker is None:
        return None
    from .inputs import parse_address

    return parse_address(tracker, what="--tracker")


def _bound(bp: BoardProcess) -> bool:
    """Our process says it bound the port (another program listening there would not)."""
    return f"bind to {bp.host}:{bp.port}" in bp.log_tail(200)


def _start(
    role: str,
    make_cmd,
    *,
    host: str,
    port: int,
    env: Optional[dict[str, str]],
    log_path: Optional[Path],
    ready,
    machine: str,
    key: Optional[str] = None,
    tracker: Optional[tuple[str, int]] = None,
) -> BoardProcess:
    """Spawn ``make_cmd(port)`` with ``env`` (default: ours) plus ``TVM_USE_RUNTIME_LIB=1``
    unless it says otherwise, wait until ready; with ``port=0`` pick a free port and retry if
    it was taken meanwhile."""
    env = dict(os.environ if env is None else env)
    env.setdefault("TVM_USE_RUNTIME_LIB", "1")
    attempts = 3 if port == 0 else 1
    for attempt in range(attempts):
        chosen = free_port(host) if port == 0 else port
        proc, logp, owned = _spawn(role, make_cmd(chosen), env=env, log_path=log_path)
        bp = BoardProcess(role, host, chosen, proc, logp, machine, key, tracker, _owns_log_dir=owned)
        try:
            _wait_ready(bp, ready_timeout=ready[0], probe=lambda: _bound(bp) and ready[1](bp))
            return bp
        except BoardError:
            if attempt + 1 < attempts and "cannot bind" in bp.log_tail(50):
                log.info("port %d was taken meanwhile; trying another", chosen)
                continue
            raise
        except BaseException:  # Ctrl-C while waiting: the group must not outlive us
            bp.stop()
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def start_server(
    *,
    host: str = "127.0.0.1",
    port: int = 9091,
    tracker: Union[None, str, Sequence[Any]] = None,
    key: str = "",
    python: Optional[str] = None,
    executable: Optional[str] = None,
    env: Optional[dict[str, str]] = None,
    load_library: Optional[str] = None,
    machine: Optional[str] = None,
    ready_timeout: float = 60.0,
    log_path: Optional[Path] = None,
    module: str = "tvm.exec.rpc_server",
) -> BoardProcess:
    """Start ``python -m tvm.exec.rpc_server --host HOST --port PORT`` (runtime-only TVM).

    ``module``: the server module; ``tvm_layerfuse.runtime.vta.rpc_server`` is TVM's server with the
    VTA runtime registered (the board side of a ``vta`` artifact).

    ``port=0`` picks a free port (see ``.port``). ``tracker``/``key`` register it with a
    tracker (ready = registered). ``python`` is the interpreter (default this one);
    ``executable`` replaces ``sys.executable`` inside the server (for emulated boards);
    ``load_library`` is passed as ``--load-library`` (e.g. ``libtvm_runtime_cuda.so`` for GPU
    boards). Returns once the server accepts sessions; raises :class:`BoardError` otherwise.
    """
    tracker_addr = _parse_tracker(tracker)
    if tracker_addr and not key:
        raise UsageError("a server registered with --tracker needs --key KEY (the name deploy asks the tracker for)")
    _check_bind(host)
    python = python or sys.executable
    _need_modules(python, ["cloudpickle", "psutil"], "RPC server")

    def make_cmd(p: int) -> list[str]:
        args = ["--host", host, "--port", str(p), "--port-end", str(p + 1)]
        if tracker_addr:
            args += ["--tracker", f"{tracker_addr[0]}:{tracker_addr[1]}", "--key", key]
            if host not in ("0.0.0.0", "::", ""):
                args += ["--custom-addr", host]  # the address the tracker hands out to clients
        if load_library:
            args += ["--load-library", load_library]
        if executable:
            return [python, "-c", _LAUNCH, executable, module, *args]
        return [python, "-m", module, *args]

    def ready(bp: BoardProcess) -> bool:
        if tracker_addr:
            return _registered(tracker_addr, key, bp.port)
        # A plain connection is harmless to a server without a tracker (it reads no magic and
        # goes back to accepting); with a tracker it would make it re-register, so not there.
        return _listening(host, bp.port)

    bp = _start(
        "server",
        make_cmd,
        host=host,
        port=port,
        env=env,
        log_path=log_path,
        ready=(ready_timeout, ready),
        machine=machine or _this_machine(),
        key=key or None,
        tracker=tracker_addr,
    )
    log.info(
        "RPC server (%s) ready on %s:%d%s", bp.machine, host, bp.port, f" under key {key!r}" if tracker_addr else ""
    )
    return bp


def start_tracker(
    *,
    host: str = "127.0.0.1",
    port: int = 9190,
    python: Optional[str] = None,
    ready_timeout: float = 60.0,
    log_path: Optional[Path] = None,
) -> BoardProcess:
    """Start ``python -m tvm.exec.rpc_tracker`` (needs ``tornado``); ``port=0`` picks a free port."""
    _check_bind(host)
    python = python or sys.executable
    _need_modules(python, ["tornado", "cloudpickle", "psutil"], "RPC tracker")

    def make_cmd(p: int) -> list[str]:
        return [python, "-m", "tvm.exec.rpc_tracker", "--host", host, "--port", str(p), "--port-end", str(p + 1)]

    def answers(bp: BoardProcess) -> bool:
        try:
            tracker_summary((host, bp.port), timeout=2.0)
            return True
        except (OSError, BoardError):
            return False

    return _start(
        "tracker", make_cmd, host=host, port=port, env=None, log_path=log_path, ready=(ready_timeout, answers), machine=_this_machine()
    )


def _this_machine() -> str:
    from ..runtime.loader import this_machine

    return this_machine()


# ---------------------------------------------------------------------- the emulated AArch64 board
def arm64_board_dir(cache: Union[None, str, os.PathLike] = None) -> Path:
    """Where ``scripts/setup_arm64_board.sh`` puts the board (``$TVM_LAYERFUSE_ARM64_BOARD``)."""
    if cache is not None:
        return Path(cache)
    env = os.environ.get(ARM64_ENV)
    return Path(env) if env else Path.home() / ".cache" / "tvm_layerfuse" / "arm64-board"


def arm64_board(cache: Union[None, str, os.PathLike] = None) -> dict[str, Any]:
    """The emulated board's description (board.json); raises :class:`BoardError` saying how to set it up."""
    root = arm64_board_dir(cache)
    desc = root / "board.json"
    if not desc.is_file():
        raise BoardError(
            f"no emulated AArch64 board in {str(root)!r}; run {ARM64_SETUP} (it prints where it put the board)"
        )
    try:
        board = json.loads(desc.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BoardError(f"{str(desc)!r} is unreadable ({e}); run {ARM64_SETUP} again") from None
    python = Path(board.get("python", ""))
    if not os.access(python, os.X_OK):
        raise BoardError(f"the emulated board's python {str(python)!r} is missing; run {ARM64_SETUP} again")
    return board


def start_arm64_board(
    *,
    host: str = "127.0.0.1",
    port: int = 9091,
    tracker: Union[None, str, Sequence[Any]] = None,
    key: str = "",
    cache: Union[None, str, os.PathLike] = None,
    vta: bool = False,
    ready_timeout: float = 180.0,
    log_path: Optional[Path] = None,
) -> BoardProcess:
    """Start the RPC server of the emulated AArch64 board (qemu-user; see the module docstring).

    ``vta=True``: the VTA board server (``tvm_layerfuse.runtime.vta.rpc_server``, simulator device)
    with tvm_layerfuse's runtime files copied, as into a bundle, to a temporary directory on
    the board's ``PYTHONPATH`` (removed when the server stops).
    """
    board = arm64_board(cache)
    wrapper = board["python"]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # this machine's paths mean nothing to the board's Python
    env.pop("PYTHONHOME", None)
    env.pop("VIRTUAL_ENV", None)
    site = None
    if vta:
        version = board.get("version", 1)
        if not isinstance(version, int) or version < 2:  # its python3 replaced PYTHONPATH instead of extending it
            raise BoardError(
                f"the emulated board in {str(arm64_board_dir(cache))!r} is version {version!r}, --vta needs version 2 "
                f"(its python3 must keep PYTHONPATH); run {ARM64_SETUP} again (seconds, the downloads are cached)"
            )
        from .bundle import copy_runtime

        site = Path(tempfile.mkdtemp(prefix="tvm_layerfuse_board_site_"))
        copy_runtime(site)
        env["PYTHONPATH"] = str(site)  # the wrapper appends the board's own site (TVM's runtime, numpy)
    try:
        bp = start_server(
            host=host,
            port=port,
            tracker=tracker,
            key=key,
            python=wrapper,
            executable=wrapper,
            env=env,
            machine=board.get("machine", "aarch64"),
            ready_timeout=ready_timeout,
            log_path=log_path,
            module="tvm_layerfuse.runtime.vta.rpc_server" if vta else "tvm.exec.rpc_server",
        )
    except BaseException:
        if site is not None:
            shutil.rmtree(site, ignore_errors=True)
        raise
    bp._owns_site = site
    return bp
