"""Tactic libraries on a board: upload an artifact's ``tactics_onednn.so`` and load it in the
board's RPC session before the model, so that the model's ``layerfuse.onednn.*`` calls resolve.

The tactic library needs the vendor library ``libdnnl.so.2``; its run path is ``$ORIGIN`` only.
In the board's session:

1. with ``upload_vendor`` (``deploy --upload-onednn``), this machine's ``libdnnl.so.2`` is
   uploaded first, beside the tactic library, where ``$ORIGIN`` finds it;
2. the tactic library is loaded: the board's loader finds ``libdnnl.so.2`` beside it, on the
   system's path (Debian ``libdnnl2``), or already loaded by the server (``rpc_server
   --load-library PREFIX/lib/libdnnl.so.2``; ``python -m tvm_layerfuse.board server`` passes
   that by itself when its Python environment has PyPI's ``onednn-cpu-gomp``);
3. else the board is refused in one line, before the model is uploaded or run.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

log = logging.getLogger(__name__)


class RemoteTacticsError(Exception):
    """A tactic library could not be loaded on the board (the message is one line)."""


def load_on_board(
    sess,
    entries: Sequence[Mapping[str, Any]],
    *,
    artifact: Path,
    board: str,
    upload_vendor: Optional[Mapping[str, str]] = None,
    step: Callable[[str], str] = lambda s: s,
) -> list[str]:
    """Upload and load each tactic library of ``entries`` (the job's ``tactics``) in session
    ``sess``; returns how each library's vendor libraries were found. Raises
    :class:`RemoteTacticsError` (one line) when the board cannot load one."""
    how = []
    for entry in entries:
        name = entry["file"]
        data = (Path(artifact) / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise RemoteTacticsError(f"{name!r} in artifact {str(artifact)!r} changed after it was verified; copy the artifact again")
        step(f"uploading the tactic library {name} ({len(data) / 1e6:.1f} MB)")
        sess.upload(bytearray(data), name)
        for soname in entry.get("needs") or []:
            local = (upload_vendor or {}).get(soname)
            if local:
                blob = Path(local).read_bytes()
                step(f"uploading {soname} ({len(blob) / 1e6:.1f} MB)")
                sess.upload(bytearray(blob), soname)  # beside the tactic library: its $ORIGIN
        step(f"loading the tactic library {name}")
        how.append(_load(sess, entry, board=board))
    return how


def share_pool_on_board(sess, library: str) -> bool:
    """On the board, run the parallel loops of the loaded model library ``library`` (a name in
    the server's work folder) on the tactic library's OpenMP threads, as a local load does
    (:func:`tvm_layerfuse.runtime.tactics.share_thread_pool`). False where the board's server
    or tactic library offers no way to (its loops keep TVM's pool: slower, not wrong)."""
    try:
        where = sess.get_function("tvm.rpc.server.workpath")(library)
        return bool(sess.get_function("layerfuse.onednn.share_pool")(where))
    except Exception:  # noqa: BLE001 - an older server or library: TVM's pool stays
        return False


def _load(sess, entry: Mapping[str, Any], *, board: str) -> str:
    name = entry["file"]
    try:
        sess.load_module(name)
        return "loaded"
    except Exception as e:  # noqa: BLE001 - the board's dlopen error, as text
        first = _first_line(e)
    missing = next((s for s in entry.get("needs") or [] if f"{s}: cannot open shared object" in first), None)
    if missing is None:
        raise RemoteTacticsError(f"board {board} cannot load the tactic library {name} ({first[:200]}); nothing was run")
    install = entry.get("install") or "install it"
    raise RemoteTacticsError(
        f"board {board} cannot load the tactic library {name}: {missing} is not installed there or not loaded by its server; "
        f"nothing was run - on the board, `{install}` and start the server with `python -m tvm_layerfuse.board server` "
        f"(or rpc_server --load-library PREFIX/lib/{missing}), install Debian's libdnnl2, or deploy with --upload-onednn"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for marker in ("cannot open shared object", "Failed to load", "undefined symbol"):  # the loader's own words
        hit = next((line for line in lines if marker in line), None)
        if hit:
            return hit
    return lines[-1] if lines else type(e).__name__
