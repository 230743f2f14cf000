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

The vendor library (``libdnnl.so.2``) is loaded by absolute path before the tactic library,
from the first place that has it (:func:`vendor_search_dirs`): beside the tactic library (a
bundle carries it there), the running Python environment (``pip install onednn-cpu-gomp``
puts it in ``sys.prefix/lib``, or the user base's ``lib`` for ``--user``), then the system's
loader path (Debian ``libdnnl2``). No ``LD_LIBRARY_PATH`` is needed.
"""

from __future__ import annotations

import ctypes
import logging
import site
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from ..errors import ArtifactError

log = logging.getLogger(__name__)

# x86 extensions that decide whether LLVM's code for a given -mcpu runs (names as in /proc/cpuinfo)
TRACKED_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2",
    "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512cd", "avx512_vnni", "avx512_bf16",
)  # fmt: skip

# the vendor libraries that tactic libraries need (what a board's server may preload)
VENDOR_LIBRARIES = ("libdnnl.so.2",)
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


POOL_VARIABLE = "TVM_LAYERFUSE_THREAD_POOL"  # "openmp" (the default) or "tvm"


def thread_pool() -> str:
    """The pool a model's TVM loops run on beside a tactic library: ``openmp`` (the default)
    or ``tvm``, from ``TVM_LAYERFUSE_THREAD_POOL``; another value is refused in one line."""
    import os

    choice = os.environ.get(POOL_VARIABLE, "openmp").strip().lower()
    if choice not in ("openmp", "tvm"):
        raise ArtifactError(f"{POOL_VARIABLE}={choice!r} is not a thread pool; expected 'openmp' or 'tvm' - set one of them or unset it")
    return choice


def share_thread_pool(library: Path) -> bool:
    """Run the parallel loops of the loaded model library ``library`` on the oneDNN tactic
    library's OpenMP threads (``layerfuse.onednn.share_pool``), so that a model alternating
    between library layers and TVM kernels keeps one set of worker threads, not two that spin
    against each other. Their number is OpenMP's (``OMP_NUM_THREADS``, else one per core).
    ``TVM_LAYERFUSE_THREAD_POOL=tvm`` keeps TVM's own pool (``TVM_NUM_THREADS``). Returns
    whether the loops now run on OpenMP; False where no tactic library is loaded."""
    import tvm_ffi

    share = tvm_ffi.get_global_func("layerfuse.onednn.share_pool", allow_missing=True)
    if thread_pool() == "tvm" or share is None:
        return False
    shared = bool(share(str(Path(library).resolve())))
    log.debug("parallel loops of %s on %s", library, "OpenMP" if shared else "TVM's pool")
    return shared


def environment_lib_dirs() -> list[Path]:
    """Where pip puts a package's shared libraries in this Python environment: the prefix's
    ``lib`` (``sys.prefix``), and the user base's for ``pip install --user``."""
    dirs = [Path(sys.prefix) / "lib"]
    user = site.getuserbase()
    if user:
        dirs.append(Path(user) / "lib")
    return dirs


def vendor_search_dirs(lib: Path, extra: Sequence[Path] = ()) -> list[Path]:
    """Where a vendor library that tactic library ``lib`` needs is looked for, in order,
    before the system loader's own path: ``extra``, ``lib``'s folder, then
    :func:`environment_lib_dirs`."""
    seen: list[Path] = []
    for d in [*map(Path, extra), Path(lib).resolve().parent, *environment_lib_dirs()]:
        if d not in seen:
            seen.append(d)
    return seen


def vendor_file(soname: str, lib: Path, extra: Sequence[Path] = ()) -> Optional[Path]:
    """The file this machine would load for vendor library ``soname`` of tactic library
    ``lib``: the first of :func:`vendor_search_dirs` that has it, else the system loader's
    (``ldconfig``'s cache); None when there is none."""
    found = next((d / soname for d in vendor_search_dirs(lib, extra) if (d / soname).is_file()), None)
    return found.resolve() if found is not None else system_library(soname)


def system_library(soname: str) -> Optional[Path]:
    """Where the system loader finds ``soname`` (``ldconfig``'s cache), or None."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        name, _, where = line.strip().partition(" => ")
        if name.split(" ")[0] == soname and Path(where).is_file():
            return Path(where).resolve()
    return None


def load_vendor(soname: str, dirs: Iterable[Path]) -> Path | str:
    """Load vendor library ``soname`` (RTLD_GLOBAL) from the first of ``dirs`` that has it,
    else through the system loader's path; returns where it came from. Raises OSError with
    the loader's reason when it cannot be loaded."""
    errors = []
    for d in dirs:
        candidate = Path(d) / soname
        if candidate.is_file():
            try:
                ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
                return candidate
            except OSError as e:  # present but unusable (its own dependency missing, wrong machine)
                errors.append(str(e))
    try:
        ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
        return soname
    except OSError as e:
        raise OSError(errors[0] if errors else str(e)) from None


def load_library(
    lib: Path,
    *,
    needs: Iterable[str] = (),
    install: Optional[str] = None,
    artifact: Optional[Path] = None,
    search: Sequence[Path] = (),
) -> None:
    """dlopen tactic library ``lib`` (its static initialisers register its global functions),
    after loading the vendor libraries it ``needs`` (sonames) from :func:`vendor_search_dirs`
    (``search`` first)."""
    key = str(Path(lib).resolve())
    if key in _LOADED:
        return
    for soname in needs:
        try:
            where = load_vendor(str(soname), vendor_search_dirs(Path(lib), search))
        except OSError as e:
            how = f"install it ({install})" if install else "install it"
            owner = f"artifact {str(artifact)!r}" if artifact is not None else f"tactic library {str(lib)!r}"
            detail = str(e).splitlines()[0][:160] if str(e) else ""
            missing = "is not installed on this machine" if detail.startswith(f"{soname}:") else f"cannot be loaded here ({detail})"
            raise ArtifactError(
                f"{owner} needs {soname} (for {Path(lib).name}), which {missing}; "
                f"{how}, or compile the model with --tactics tvm"
            ) from None
        log.debug("loaded %s from %s", soname, where)
    import tvm_ffi  # noqa: F401  (libtvm_ffi must be loaded before the library that links it)

    try:
        _LOADED[key] = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise ArtifactError(f"tactic library {str(lib)!r} cannot be loaded ({str(e)[:200]}); re-run `compile`") from None
    log.info("loaded tactic library %s", lib)
