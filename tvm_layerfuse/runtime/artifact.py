"""The compiled artifact: a directory with the library, the weights and a manifest.

::

    OUT/
      manifest.json   format, versions, target, inputs/outputs, fusion report, sha256 of every file
      model.so        the device-executable library (host code + embedded device binary)
      params.npz      the weights, by parameter name (plain arrays: loaded with allow_pickle=False)

This module is pure Python + numpy: the runtime side imports it without TVM's compiler
or onnx. Artifacts are untrusted input: :func:`verify` checks every checksum before any
library is loaded, and nothing in an artifact is ever unpickled.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..errors import ArtifactError, UsageError

FORMAT = "tvm_layerfuse.artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LIBRARY = "model.so"
PARAMS = "params.npz"
MAX_ELEMENTS = 1 << 34  # per input/output tensor, as topology.onnx_reader.MAX_TENSOR_ELEMENTS


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and sanity-check ``path/manifest.json`` (no checksums yet)."""
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"artifact {str(path)!r} does not exist; expected a directory written by `compile`")
    if not path.is_dir():
        raise ArtifactError(
            f"artifact {str(path)!r} is a file; expected the directory written by `compile -o DIR`"
        )
    mpath = path / MANIFEST
    if not mpath.exists():
        raise ArtifactError(f"artifact {str(path)!r} has no {MANIFEST}; expected a directory written by `compile`")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{str(mpath)!r} is not readable JSON ({e}); re-run `compile`") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{str(mpath)!r} is not a tvm_layerfuse manifest; expected format {FORMAT!r}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"artifact {str(path)!r} has format version {version}; this tvm_layerfuse reads version "
            f"{FORMAT_VERSION} - re-run `compile` with this version"
        )
    for key in ("files", "library", "inputs", "outputs", "target"):
        if key not in manifest:
            raise ArtifactError(f"{str(mpath)!r} lacks {key!r}; re-run `compile`")
    problem = _schema_problem(manifest)
    if problem:
        raise ArtifactError(f"{str(mpath)!r} is malformed: {problem}; re-run `compile`")
    return manifest


def _is_dtype(name: str) -> bool:
    import numpy as np

    try:
        return np.dtype(name).kind in "biufc"
    except TypeError:
        return False


def _schema_problem(m: dict[str, Any]) -> Optional[str]:
    """What is wrong with the types of a manifest's fields (an artifact is untrusted input), or None."""
    if not isinstance(m["files"], dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in m["files"].items()
    ):
        return "'files' must map file names to sha256 strings"
    if not isinstance(m["library"], str):
        return "'library' must be a file name"
    if not isinstance(m["target"], dict):
        return "'target' must be an object"
    for key in ("inputs", "outputs"):
        entries = m[key]
        if not isinstance(entries, list):
            return f"{key!r} must be a list"
        for k, e in enumerate(entries):
            ok = (
                isinstance(e, dict)
                and isinstance(e.get("name"), str)
                and isinstance(e.get("shape"), list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in e["shape"])
                and isinstance(e.get("dtype"), str)
            )
            if not ok:
                return f"{key}[{k}] must be {{name, shape: [ints], dtype}}, found {str(e)[:80]}"
            if not _is_dtype(e["dtype"]):
                return f"{key}[{k}] has dtype {e['dtype'][:40]!r}, which is no numeric dtype"
            elements = 1
            for d in e["shape"]:
                elements *= d
            if elements > MAX_ELEMENTS:
                return f"{key}[{k}] declares shape {e['shape']} ({elements:.3g} elements, more than {MAX_ELEMENTS:.3g})"
    params = m.get("params")
    if params is not None:
        if not isinstance(params, dict):
            return "'params' must be an object {file, order}"
        order = params.get("order", [])
        if not isinstance(order, list) or not all(isinstance(n, str) for n in order):
            return "'params.order' must be a list of weight names"
        if order and not isinstance(params.get("file"), str):
            return "'params.file' must be a file name"
    return None


def verify(path: Path, manifest: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Check that every file the manifest lists is there, unchanged, and nothing escapes ``path``."""
    path = Path(path)
    manifest = manifest or read_manifest(path)
    files = manifest["files"]
    if not isinstance(files, dict) or not files:
        raise ArtifactError(f"manifest of {str(path)!r} lists no files; re-run `compile`")
    root = path.resolve()
    for name, digest in files.items():
        f = (path / name).resolve()
        if root not in f.parents:
            where = "" if Path(name).is_absolute() or ".." in Path(name).parts else f" (it resolves to {str(f)!r})"
            raise ArtifactError(
                f"manifest of {str(path)!r} names {name!r}{where}, outside the artifact; refusing to load it"
            )
        if not f.is_file():
            raise ArtifactError(f"artifact {str(path)!r} lacks {name!r}; expected it beside manifest.json - re-run `compile`")
        actual = sha256_file(f)
        if actual != digest:
            raise ArtifactError(
                f"{name!r} in artifact {str(path)!r} has sha256 {actual[:12]}…, the manifest says {str(digest)[:12]}…; "
                "the file was changed or damaged - re-run `compile` or copy the artifact again"
            )
    named = [("library", manifest["library"])]
    params = manifest.get("params") or {}
    if params.get("order"):
        named.append(("params file", params["file"]))
    for key, name in named:
        if name not in files:
            raise ArtifactError(
                f"manifest of {str(path)!r} names {key} {name!r} without a checksum; refusing to load it - "
                "re-run `compile`"
            )
    return manifest


def output_parent(out: Path, *, overwrite: bool) -> Path:
    """The directory that will hold the output directory ``out`` (``-o``), checked: it exists,
    and ``out`` does not unless ``overwrite`` (``--force``)."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.exists():  # a regular file there: writing into it says so (ENOTDIR)
        raise UsageError(f"output directory {str(parent)!r} does not exist; create it or choose another -o")
    if out.exists() and not overwrite:
        raise UsageError(f"output {str(out)!r} already exists; remove it or pass --force")
    return parent


@contextlib.contextmanager
def atomic_directory(
    out: Path,
    *,
    overwrite: bool = False,
    mode: Optional[int] = None,
    on_commit: Optional[Callable[[], None]] = None,
) -> Iterator[Path]:
    """A temporary directory beside ``out`` that becomes ``out`` when the block ends.

    ``with atomic_directory(out) as tmp:`` - fill ``tmp``; when the block ends normally it is
    renamed to ``out`` (replacing an old ``out`` only with ``overwrite``: ``--force``), then
    ``on_commit()`` runs (see :func:`_commit` for Ctrl-C then). On any exception (or Ctrl-C)
    before the rename ``tmp`` is removed and nothing is left at ``out``. ``mode``: the
    directory's permissions (default ``0o777`` less the umask: an ordinary directory, not
    mkdtemp's private one). The checks of ``out`` are :func:`output_parent`'s."""
    out = Path(out)
    parent = output_parent(out, overwrite=overwrite)
    with _sigint_held():  # the directory exists only once it is registered for removal
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
            _UNFINISHED.add(tmp)
            tmp.chmod(0o777 & ~_umask() if mode is None else mode)
        except OSError as e:
            raise UsageError(f"cannot write into {str(parent)!r} ({e.strerror}); choose a writable -o") from None
    try:
        yield tmp
        _commit(tmp, out, on_commit)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _UNFINISHED.discard(tmp)


# Temporary directories of this process that are neither renamed into place nor removed yet. A
# Ctrl-C can land between any two bytecodes, also inside the ``with`` machinery around
# atomic_directory's clean-up; the command line removes whatever is left here before it says
# "nothing was written" (remove_unfinished). After the rename the path no longer exists.
_UNFINISHED: set[Path] = set()


def remove_unfinished() -> None:
    """Remove the temporary directories an interrupted write of this process left behind."""
    for tmp in list(_UNFINISHED):
        shutil.rmtree(tmp, ignore_errors=True)
        _UNFINISHED.discard(tmp)


@contextlib.contextmanager
def _sigint_held():
    """SIGINT recorded instead of raised inside the block (main thread, Python handler only),
    and delivered to the handler in place when the block ends."""
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if held:
        handler(signal.SIGINT, None)


def write_artifact(
    out: Path,
    fill: Callable[[Path], dict[str, Any]],
    *,
    overwrite: bool = False,
    on_commit: Optional[Callable[[], None]] = None,
) -> Path:
    """Create the artifact directory ``out`` atomically (:func:`atomic_directory`).

    ``fill(tmpdir)`` writes the files into a temporary directory beside ``out`` and returns
    the manifest (without ``files``); checksums are added here, then the directory is
    renamed into place. On any failure (or Ctrl-C) before that rename nothing is left at
    ``out``; ``on_commit()`` runs right after it (see :func:`_commit` for Ctrl-C then).
    """
    out = Path(out)
    if overwrite and out.exists() and not (out / MANIFEST).exists():
        raise UsageError(f"output {str(out)!r} exists and is not an artifact; refusing to replace it - choose another -o")
    try:
        with atomic_directory(out, overwrite=overwrite, on_commit=on_commit) as tmp:
            manifest = fill(tmp)
            manifest["files"] = {
                p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST
            }
            _write_json(tmp / MANIFEST, manifest)
    except OSError as e:
        advice = {
            errno.EFBIG: "raise the file-size limit (ulimit -f) or choose another -o",
            errno.EACCES: "choose a writable -o",
            errno.EROFS: "choose a writable -o",
        }.get(e.errno, "free space on that file system or choose another -o")
        raise UsageError(
            f"cannot write artifact {str(out)!r} ({e.strerror or e}); nothing was written - {advice}"
        ) from None
    return out


def _commit(tmp: Path, out: Path, on_commit: Optional[Callable[[], None]]) -> None:
    """Rename ``tmp`` to ``out`` (replacing an old artifact): the instant the artifact exists.

    SIGINT is held around it (in the main thread, when its handler is a Python function):
    one that came before the rename is delivered before it, so nothing is written; one that
    comes during it is delivered after ``on_commit()``, to the handler in place then (which
    ``on_commit`` may have set to ignore it: the artifact is complete).
    """
    held: list[int] = []
    handler = signal.getsignal(signal.SIGINT)
    hold = callable(handler) and threading.current_thread() is threading.main_thread()

    def record(signum, frame) -> None:
        held.append(signum)

    if hold:
        signal.signal(signal.SIGINT, record)
    try:
        if held:
            handler(signal.SIGINT, None)  # raises KeyboardInterrupt: before the rename
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        if on_commit is not None:
            on_commit()
    finally:
        if hold and signal.getsignal(signal.SIGINT) is record:
            signal.signal(signal.SIGINT, handler)
    now = signal.getsignal(signal.SIGINT)
    if held and callable(now):
        now(signal.SIGINT, None)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
