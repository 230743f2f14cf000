"""The oneDNN tactic library: find oneDNN, build the extension (``onednn_conv.cc``), load it.

::

    availability()            None when oneDNN can be used here, else the reason (one line)
    build_extension()         the extension .so, built once per source/oneDNN version
                              (tvm_ffi.cpp.build: tvm-ffi headers + oneDNN, -ldnnl)
    load()                    build + dlopen: registers layerfuse.onednn.* as global functions
    implementation(...)       the oneDNN kernel a conv layer gets on this machine
    time_conv(...)            a conv layer's time here under two attrs (the algorithm choice)
    pool_implementation(...)  the same for a pooling layer
    float_bits(v)             a float32's bits as an integer (how attrs carry alpha and beta)

oneDNN comes from Debian's ``libdnnl-dev`` (oneDNN 2.x C++ API, ``/usr/include/oneapi/dnnl``)
or any prefix named by ``TVM_LAYERFUSE_ONEDNN_ROOT`` (``include/`` and ``lib/`` beneath it).
The runtime needs only the shared library ``libdnnl.so.2`` (Debian ``libdnnl2``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

from ...errors import BuildError
from . import abi

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("onednn_conv.cc")
SONAME = "libdnnl.so.2"
INSTALL = "apt-get install -y libdnnl2"
INSTALL_DEV = "apt-get install -y libdnnl-dev"
LIBRARY_FILE = "tactics_onednn.so"  # its name inside an artifact
# the library's functions, by the registry of :mod:`.abi` (these names stay for callers)
FUNCTIONS = {c.key: c.name for c in abi.CONVS}
CONV2D_ADD_INPLACE = abi.CONV2D_ADD_INPLACE.name  # called from TIR (onednn_inplace.residuals_in_place)
TO_BLOCKED = abi.TO_BLOCKED.name
CONCAT = abi.CONCAT.name
CONCAT_CONVS = abi.CONCAT_CONVS.name
POOL = abi.POOL2D.name
DENSE = abi.DENSE.name
POOL_ALGORITHMS = abi.POOL_ALGORITHMS
float_bits = abi.float_bits


def root() -> Path:
    return Path(os.environ.get("TVM_LAYERFUSE_ONEDNN_ROOT", "/usr"))


def _lib_dirs(prefix: Path) -> list[Path]:
    candidates = (prefix / "lib" / "x86_64-linux-gnu", prefix / "lib" / "aarch64-linux-gnu", prefix / "lib", prefix / "lib64")
    return [d for d in candidates if d.is_dir()]


def availability() -> Optional[str]:
    """Why oneDNN cannot be used on this machine (one line), or None when it can."""
    prefix = root()
    header = prefix / "include" / "oneapi" / "dnnl" / "dnnl.hpp"
    if not header.is_file():
        return f"oneDNN headers not found ({header}); install them with `{INSTALL_DEV}`"
    if not any((d / "libdnnl.so").exists() for d in _lib_dirs(prefix)):
        return f"oneDNN library libdnnl.so not found under {prefix}/lib; install it with `{INSTALL_DEV}`"
    version = _header_version(header.parent / "dnnl_version.h")
    if version is not None and version[0] != 2:
        return f"oneDNN {'.'.join(map(str, version))} found; the tactic library is written for the 2.x API (Debian libdnnl-dev)"
    return None


def _header_version(path: Path) -> Optional[tuple[int, int, int]]:
    try:
        text = path.read_text()
    except OSError:
        return None
    found = {}
    for key in ("MAJOR", "MINOR", "PATCH"):
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "#define" and parts[1] == f"DNNL_VERSION_{key}":
                found[key] = int(parts[2])
    return (found["MAJOR"], found["MINOR"], found["PATCH"]) if len(found) == 3 else None


def build_extension() -> Path:
    """Build (or reuse) the extension library; raises BuildError with the reason."""
    reason = availability()
    if reason is not None:
        raise BuildError(reason)
    import tvm_ffi
    import tvm_ffi.cpp

    prefix = root()
    cflags = ["-O2", "-DNDEBUG", "-fopenmp", "-fvisibility=hidden"]  # hidden: two copies in a process never bind to each other
    onednn_version = _header_version(prefix / "include" / "oneapi" / "dnnl" / "dnnl_version.h")
    key = [SOURCE.read_bytes(), str(prefix), tvm_ffi.__version__, str(onednn_version), " ".join(cflags), str(abi.ABI_VERSION)]
    digest = hashlib.sha256("\0".join(k if isinstance(k, str) else k.hex() for k in key).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TVM_LAYERFUSE_CACHE", Path.home() / ".cache" / "tvm_layerfuse")) / f"onednn-{digest}"
    out = cache / "layerfuse_onednn.so"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    libdirs = _lib_dirs(prefix)
    # several compiles may build at once (parallel jobs, a fresh machine): each builds in its
    # own folder and renames the finished library into place, so no one loads a partial file
    with tempfile.TemporaryDirectory(dir=cache, prefix="build-") as build_dir:
        try:
            path = tvm_ffi.cpp.build(
                "layerfuse_onednn",
                sources=[str(SOURCE)],
                extra_cflags=cflags,  # OpenMP: time_conv's thread count, the prologue's loop
                extra_ldflags=[*(f"-L{d}" for d in libdirs), "-ldnnl", "-fopenmp"],
                extra_include_paths=[str(prefix / "include")],
                build_directory=build_dir,
            )
        except Exception as e:  # the compiler's complaint, first line
            detail = next((line.strip() for line in str(e).splitlines() if "error" in line.lower()), str(e).strip()[:200])
            raise BuildError(f"the oneDNN tactic library did not build: {detail[:300]}") from None
        os.replace(path, out)
    return out


@lru_cache(maxsize=1)
def load() -> Path:
    """Build the extension and load it into this process (registers its global functions)."""
    from ...runtime.tactics import load_library, loaded_abi_version

    path = build_extension()
    have = loaded_abi_version()
    if have is not None and have != abi.ABI_VERSION:
        raise BuildError(
            f"this process already runs a oneDNN tactic library of ABI version {have} (an artifact's); the compiler's is "
            f"version {abi.ABI_VERSION} - compile in a process of its own"
        )
    try:
        load_library(path, needs=[SONAME], install=INSTALL)
    except Exception as e:
        raise BuildError(str(e)) from None
    return path


def version() -> str:
    import tvm_ffi

    load()
    return str(tvm_ffi.get_global_func("layerfuse.onednn.version")())


def _values(attrs) -> list[int]:
    """An attrs record (or already its values) as the integers the library reads."""
    return attrs.values() if hasattr(attrs, "values") and callable(attrs.values) else [int(v) for v in attrs]


def implementation(x_shape: Sequence[int], w_shape: Sequence[int], attrs: Sequence[int], *, residual: bool) -> str:
    """The oneDNN kernel (``impl_info_str``) this conv layer gets on this machine."""
    import tvm_ffi

    load()
    f = tvm_ffi.get_global_func("layerfuse.onednn.implementation")
    shapes = [tvm_ffi.Shape([int(d) for d in v]) for v in (x_shape, w_shape, _values(attrs))]
    return str(f(*shapes, bool(residual)))


def time_conv(
    x_shape: Sequence[int], w_shape: Sequence[int], attrs_a: Sequence[int], attrs_b: Sequence[int], *, residual: bool, reps: int = 7
) -> tuple[float, float]:
    """This conv layer's time in ms here under ``attrs_a`` and ``attrs_b``: the fastest of
    ``reps`` runs each, the two run in turn (other processes only ever add time)."""
    import tvm_ffi

    load()
    f = tvm_ffi.get_global_func("layerfuse.onednn.time_conv")
    shapes = [tvm_ffi.Shape([int(d) for d in v]) for v in (x_shape, w_shape, _values(attrs_a), _values(attrs_b))]
    a, b = f(*shapes, bool(residual), int(reps))
    return float(a), float(b)


def dense_implementation(n: int, k: int, m: int) -> str:
    """The oneDNN kernel of ``dense`` (x [n, k] @ w [k, m] + b)."""
    import tvm_ffi

    load()
    return str(tvm_ffi.get_global_func("layerfuse.onednn.dense_implementation")(tvm_ffi.Shape([int(n), int(k), int(m)])))


def pool_implementation(x_shape: Sequence[int], out_shape: Sequence[int], attrs: Sequence[int]) -> str:
    """The oneDNN kernel this pooling layer (``attrs`` as ``layerfuse.onednn.pool2d`` takes them) gets."""
    import tvm_ffi

    load()
    f = tvm_ffi.get_global_func("layerfuse.onednn.pool_implementation")
    return str(f(*[tvm_ffi.Shape([int(d) for d in v]) for v in (x_shape, out_shape, _values(attrs))]))
