"""TVM's tracker protocol with deadlines, for the deploy worker."""

from __future__ import annotations

import socket
import struct
from typing import Any, Callable


class StepFailure(Exception):
    """A step of the worker failed; the watchdog raises it as the error class its ``kind`` names."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message



class TrackerClient:
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
            raise StepFailure(
                "unreachable",
                f"cannot connect to the tracker {where}: connection refused; start it: "
                f"python -m tvm.exec.rpc_tracker --host 0.0.0.0 --port {addr[1]}",
            ) from None
        except socket.timeout:
            raise StepFailure(
                "timeout", f"the tracker {where} did not answer within {timeout:g} s; check the address in --tracker"
            ) from None
        except OSError as e:
            raise StepFailure(
                "unreachable", f"cannot connect to the tracker {where}: {e.strerror or e}; check --tracker HOST:PORT"
            ) from None
        if magic != base.RPC_TRACKER_MAGIC:
            sock.close()
            raise StepFailure("unreachable", f"{where} is not a TVM RPC tracker; check --tracker HOST:PORT")
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
            raise StepFailure(
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
            raise StepFailure(
                "timeout",
                f"no board under key {self.key!r} became free within {self.timeout:g} s at the tracker {self.where} "
                f"({len(servers)} registered, all busy); raise --timeout or add boards",
            ) from None
        except OSError as e:
            raise StepFailure(
                "unreachable", f"the tracker {self.where} dropped the connection ({e}); is it still running?"
            ) from None
        if not isinstance(value, list) or value[0] != base.TrackerCode.SUCCESS:
            raise StepFailure("unreachable", f"the tracker {self.where} refused the request for key {self.key!r}: {value!r}")
        url, port, matchkey = value[1]
        return str(url), int(port), str(matchkey)

    def close(self) -> None:
        self.session.close()
