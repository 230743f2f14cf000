"""Runtime side of the tactics: the CPU check and the tactic libraries an artifact carries.

What a board needs and nothing more (no ``tvm.relax``, no onnx, no compiler):

* :func:`check_cpu` - an artifact compiled for the build machine's CPU (``cpu`` preset,
  ``-mcpu`` of that machine) records the instruction-set extensions it was built with
  (``target.cpu_flags``); loading it on a CPU that lacks one fails with one line, not
  with an illegal-instruction crash in the middle of an inference;
* :func:`load_tactics` - an artifact whose layers run on a vendor library (``onednn``)
  carries the project's tactic library (``manifest["tactics"]["libraries"]``); loading
  it registers its global functions (``layerfuse.onednn.*``), which the compiled model
  calls through ``R.call_dps_packed``. Where the vendor library itself is missing, one
  line names it and the command that installs it.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any, Iterable, Optional

from ..errors import ArtifactError

log = logging.getLogger(__name__)

# x86 extensions that decide whether LLVM's code for a given -mcpu runs (names as in /proc/cpuinfo)
TRACKED_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2",
    "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512cd", "avx512_vnni", "avx512_bf16",
)  # fmt: skip

_LOADED: dict[str, Any] = {}  # tactic library path -> ctypes handle (a library loads once per process)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> Optional[set[str]]:
    """The CPU flags of this machine (Linux ``/proc/cpuinfo``), or None where unknown."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def tracked_flags(flags: Optional[Iterable[str]] = None) -> list[str]:
    """The :data:`TRACKED_FLAGS` this machine (or ``flags``) has, for the manifest."""
    have = set(flags) if flags is not None else (cpu_flags() or set())
    return [f for f in TRACKED_FLAGS if f in have]


def check_cpu(manifest: dict[str, Any], *, flags: Optional[set[str]] = None, path: Optional[Path] = None) -> None:
    """Refuse an artifact built for a CPU with extensions this one lacks."""
    target = manifest.get("target") or {}
    needed = target.get("cpu_flags")
    if not isinstance(needed, list) or not needed:
        return
    flags = flags if flags is not None else cpu_flags()
    if flags is None:
        return  # not Linux: nothing to compare with
    missing = [f for f in needed if isinstance(f, str) and f not in flags]
    if missing:
        mcpu = (target.get("tvm_target") or {}).get("mcpu", "?")
        name = f"artifact {str(path)!r}" if path is not None else "artifact"
        raise ArtifactError(
            f"{name} was compiled for CPU {mcpu} and needs {', '.join(missing)}, which this CPU lacks; "
            "compile with --target cpu-portable, or compile on this machine"
        )


def loaded_abi_version() -> Optional[int]:
    """The calling-contract version of the oneDNN tactic library this process runs (its
    functions are process-wide), or None when none is loaded. A library from before the
    version was exported counts as version 1."""
    import tvm_ffi

    f = tvm_ffi.get_global_func("layerfuse.onednn.abi_version", allow_missing=True)
    if f is not None:
        return int(f())
    return 1 if tvm_ffi.get_global_func("layerfuse.onednn.conv2d", allow_missing=True) is not None else None


def load_tactics(path: Path, manifest: dict[str, Any]) -> list[str]:
    """Load the tactic libraries the artifact at ``path`` carries; returns their names.

    The library's functions are global to the process, so an artifact whose library follows
    another calling contract (``abi_version`` in the manifest) than the one already loaded is
    refused in one line rather than run with the other library's code. After a load the
    library's cached layers are dropped (:func:`release_layers`): the new weights may sit
    where an unloaded model's were."""
    tactics = manifest.get("tactics") or {}
    libraries = tactics.get("libraries") or []
    loaded = []
    for entry in libraries:
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise ArtifactError(f"manifest of {str(path)!r} has a malformed tactics entry {str(entry)[:80]}; re-run `compile`")
        want = entry.get("abi_version", 1)
        have = loaded_abi_version()
        if have is not None and have != want:
            raise ArtifactError(
                f"artifact {str(path)!r} carries a tactic library of ABI version {want}, but this process already runs "
                f"version {have} (another artifact or compile); load it in a process of its own, or re-run `compile`"
            )
        load_library(Path(path) / entry["file"], needs=entry.get("needs") or [], install=entry.get("install"), artifact=path)
        got = loaded_abi_version()
        if got != want:
            raise ArtifactError(
                f"tactic library {entry['file']!r} of artifact {str(path)!r} is ABI version {got}, its manifest says "
                f"{want}; the files do not belong together - re-run `compile`"
            )
        release_layers()
        loaded.append(entry["file"])
    return loaded


def release_layers() -> None:
    """Drop the oneDNN tactic library's cached layers (they are made again, from the weights
    of the call, on first use)."""
    import tvm_ffi

    f = tvm_ffi.get_global_func("layerfuse.onednn.release", allow_missing=True)
    if f is not None:
        f()


def load_library(
    lib: Path, *, needs: Iterable[str] = (), install: Optional[str] = None, artifact: Optional[Path] = None
) -> None:
    """dlopen tactic library ``lib`` (its static initialisers register its global functions),
    after checking that the vendor libraries it ``needs`` (sonames) can be loaded."""
    key = str(Path(lib).resolve())
    if key in _LOADED:
        return
    for soname in needs:
        try:
            ctypes.CDLL(str(soname), mode=ctypes.RTLD_GLOBAL)
        except OSError:
            how = f"install it ({install})" if install else "install it"
            owner = f"artifact {str(artifact)!r}" if artifact is not None else f"tactic library {str(lib)!r}"
            raise ArtifactError(
                f"{owner} needs {soname} (for {Path(lib).name}), which is not installed on this machine; "
                f"{how}, or compile the model with --tactics tvm"
            ) from None
    import tvm_ffi  # noqa: F401  (libtvm_ffi must be loaded before the library that links it)

    try:
        _LOADED[key] = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise ArtifactError(f"tactic library {str(lib)!r} cannot be loaded ({str(e)[:200]}); re-run `compile`") from None
    log.info("loaded tactic library %s", lib)
