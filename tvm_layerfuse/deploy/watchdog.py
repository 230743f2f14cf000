"""The deploy watchdog (this process): runs the worker, enforces each step's deadline, kills
the worker when one passes and turns its events into results or one-line errors."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from ..errors import BoardMismatchError, DeployError, DeployTimeoutError

log = logging.getLogger(__name__)


def _worker_command() -> list[str]:
    return [sys.executable, "-c", "from tvm_layerfuse.deploy.worker import main; main()"]


def run_worker(job: dict[str, Any], *, timeout: float, progress: Optional[Callable[[str], None]]) -> dict[str, Any]:
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
