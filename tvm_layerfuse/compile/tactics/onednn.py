"""The oneDNN tactic library: find oneDNN, build the extension (``onednn_conv.cc``), load it.

::

    availability()            None when oneDNN can be used here, else the reason (one line)
    build_extension()         the extension .so, built once per source/oneDNN version
                              (tvm_ffi.cpp.build: tvm-ffi headers + oneDNN, -ldnnl)
    load()                    build + dlopen: registers layerfuse.onednn.* as global functions
    implementation(...)       the kernel a conv layer gets on this machine
    time_conv(...)            a conv layer's time here under two attrs (the algorithm choice)
    pool_implementation(...)  the same for a pooling layer
    float_bits(v)             a float32's bits as an integer (how attrs carry alpha and beta)
    block_width()             the channel block of oneDNN's optimised kernels here: 16
                              (nChw16c, AVX-512), 8 (nChw8c, AVX2 / AVX / SSE4.1), 0 (plain)
    dst_block(widths)         a conv's ``dst_block`` attr from its outputs' block widths

Where oneDNN comes from (the first that has it; see :func:`find`):

* ``TVM_LAYERFUSE_ONEDNN_ROOT``, when set: that prefix and no other (``include/`` and ``lib/``);
* this Python environment: PyPI's ``onednn-devel-cpu-gomp==2022.2.1`` (oneDNN 2.6, a dependency
  of the package on Linux x86_64) puts ``lib/libdnnl.so*`` and ``include/oneapi/dnnl/`` under
  the environment's prefix (``sys.prefix``, or the user base for ``pip install --user``);
* the system: Debian's ``libdnnl-dev`` (oneDNN 2.6.3, ``/usr/include/oneapi/dnnl``).

The tactic library is linked with ``$ORIGIN`` as its run path and never with an absolute one:
whoever loads it (:func:`tvm_layerfuse.runtime.tactics.load_library`) first loads
``libdnnl.so.2`` by absolute path from the artifact, the running environment or the system,
so an artifact needs only the runtime library ``libdnnl.so.2`` (PyPI ``onednn-cpu-gomp``, or
Debian ``libdnnl2``) wherever it runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import site
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ...errors import BuildError
from . import abi

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("onednn_conv.cc")
SOURCE_INCLUDES = (Path(__file__).with_name("onednn_winograd.inc"),)  # what SOURCE #includes from beside it
SONAME = "libdnnl.so.2"
PYPI_RUNTIME = "onednn-cpu-gomp==2022.2.1"  # oneDNN 2.6.0: libdnnl.so.2 (GNU OpenMP)
PYPI_DEVEL = "onednn-devel-cpu-gomp==2022.2.1"  # + the headers
INSTALL = f"pip install {PYPI_RUNTIME}"
INSTALL_DEV = f"pip install {PYPI_DEVEL}"
ROOT_VARIABLE = "TVM_LAYERFUSE_ONEDNN_ROOT"
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


@dataclass(frozen=True)
class Installation:
    """One oneDNN found on this machine: what the tactic library is built against."""

    prefix: Path
    source: str  # "TVM_LAYERFUSE_ONEDNN_ROOT" | "python environment" | "system"
    lib_dir: Path  # holds libdnnl.so (link time) and libdnnl.so.2 (run time)
    version: tuple[int, int, int]

    @property
    def library(self) -> Path:
        return self.lib_dir / SONAME

    def to_dict(self) -> dict:
        return {"version": ".".join(map(str, self.version)), "source": self.source, "library": str(self.library)}


def _lib_dirs(prefix: Path) -> list[Path]:
    candidates = (prefix / "lib" / "x86_64-linux-gnu", prefix / "lib" / "aarch64-linux-gnu", prefix / "lib", prefix / "lib64")
    return [d for d in candidates if d.is_dir()]


def search_prefixes() -> list[tuple[Path, str]]:
    """The prefixes :func:`find` looks in, in order, each with where it comes from."""
    explicit = os.environ.get(ROOT_VARIABLE)
    if explicit:
        return [(Path(explicit), ROOT_VARIABLE)]
    prefixes = [(Path(sys.prefix), "python environment")]
    user = site.getuserbase()
    if user:
        prefixes.append((Path(user), "python environment"))
    prefixes.append((Path("/usr"), "system"))
    return prefixes


def _inspect_prefix(prefix: Path, source: str) -> "Installation | str":
    header = prefix / "include" / "oneapi" / "dnnl" / "dnnl.hpp"
    if not header.is_file():
        return f"oneDNN headers not found ({header})"
    lib_dir = next((d for d in _lib_dirs(prefix) if (d / "libdnnl.so").exists()), None)
    if lib_dir is None:
        return f"oneDNN library libdnnl.so not found under {prefix}/lib"
    version = _header_version(header.parent / "dnnl_version.h")
    if version is None:
        return f"oneDNN version not readable from {header.parent / 'dnnl_version.h'}"
    if version[0] != 2:
        return f"oneDNN {'.'.join(map(str, version))} found in {prefix}; the tactic library is written for the 2.x API ({PYPI_DEVEL})"
    return Installation(prefix=prefix, source=source, lib_dir=lib_dir, version=version)


def find() -> "Installation | str":
    """The oneDNN to build against: the first prefix of :func:`search_prefixes` that has a
    usable one, else the reason none does (one line, with the install command)."""
    reasons = []
    for prefix, source in search_prefixes():
        found = _inspect_prefix(prefix, source)
        if isinstance(found, Installation):
            return found
        reasons.append(found)
    if os.environ.get(ROOT_VARIABLE):
        return (
            f"{reasons[0]} ({ROOT_VARIABLE} names it); install oneDNN 2.x there, or unset {ROOT_VARIABLE} "
            f"to use this Python environment's (`{INSTALL_DEV}`)"
        )
    return f"oneDNN 2.x not found in this Python environment or the system; install it with `{INSTALL_DEV}`"


def availability() -> Optional[str]:
    """Why oneDNN cannot be used on this machine (one line), or None when it can."""
    found = find()
    return found if isinstance(found, str) else None


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


# OpenMP: time_conv's thread count, the prologue's loop; hidden: two copies in a process never bind to each other
_FLAGS = ("-O2", "-DNDEBUG", "-fopenmp", "-fvisibility=hidden")


def installation() -> Installation:
    """The oneDNN the tactic library is built against (raises BuildError when there is none)."""
    found = find()
    if isinstance(found, str):
        raise BuildError(found)
    return found


def build_extension() -> Path:
    """Build (or reuse) the extension library; raises BuildError with the reason."""
    found = installation()
    import tvm_ffi
    import tvm_ffi.cpp

    # the cache key: the source (and what it includes), the oneDNN it links, tvm-ffi (its headers and ABI), the flags, the ABI version
    sources = SOURCE.read_bytes() + b"".join(p.read_bytes() for p in SOURCE_INCLUDES)
    key = sources + repr((str(found.lib_dir), found.version, tvm_ffi.__version__, _FLAGS, abi.ABI_VERSION)).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    cache = Path(os.environ.get("TVM_LAYERFUSE_CACHE", Path.home() / ".cache" / "tvm_layerfuse")) / f"onednn-{digest}"
    out = cache / "layerfuse_onednn.so"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    # several compiles may build at once (parallel jobs, a fresh machine): each builds in its
    # own folder and renames the finished library into place, so no one loads a partial file
    with tempfile.TemporaryDirectory(dir=cache, prefix="build-") as build_dir:
        try:
            path = tvm_ffi.cpp.build(
                "layerfuse_onednn",
                sources=[str(SOURCE)],
                extra_cflags=list(_FLAGS),
                # run path $ORIGIN only ('$$' is ninja's '$'): libdnnl.so.2 beside the library
                # (a bundle), else whatever the loader loaded first by absolute path
                extra_ldflags=[f"-L{found.lib_dir}", "-ldnnl", "-ldl", "-fopenmp", "'-Wl,-rpath,$$ORIGIN'"],
                extra_include_paths=[str(found.prefix / "include")],
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
        load_library(path, needs=[SONAME], install=INSTALL, search=[installation().lib_dir])
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


@lru_cache(maxsize=1)
def block_width() -> int:
    """The channel block width of the blocked layout oneDNN's optimised conv and pool kernels
    take on this CPU (asked of the library: ``dnnl::get_effective_cpu_isa``): 16 (``nChw16c``)
    where it runs its AVX-512 kernels (avx512_core), 8 (``nChw8c``) with AVX2, AVX or SSE4.1,
    0 below (plain layouts only). Every blocked call's attrs carry it, so the library never
    guesses it and an artifact's bytes mean the same wherever it runs."""
    import tvm_ffi

    load()
    return int(tvm_ffi.get_global_func("layerfuse.onednn.block_width")())


# the block widths in attrs: the contract's (abi.py)
DST_BLOCK_BITS = abi.DST_BLOCK_BITS
MAX_BLOCKED_OUTPUTS = abi.MAX_BLOCKED_OUTPUTS
dst_block = abi.dst_block
dst_block_of = abi.dst_block_of
layout_name = abi.layout_name


def implementation(x_shape: Sequence[int], w_shape: Sequence[int], attrs: Sequence[int], *, residual: bool) -> str:
    """The kernel this conv layer gets on this machine: oneDNN's ``impl_info_str``, or the name of
    the library's own Winograd kernel (``abi.is_own_winograd``) for algorithms 2 and 3; a SiLU
    conv's ends with ``abi.OWN_SILU_SUFFIX`` (the library's pass after oneDNN's kernel)."""
    import tvm_ffi

    load()
    f = tvm_ffi.get_global_func("layerfuse.onednn.implementation")
    shapes = [tvm_ffi.Shape([int(d) for d in v]) for v in (x_shape, w_shape, _values(attrs))]
    return str(f(*shapes, bool(residual)))


def time_conv(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    attrs_a: Sequence[int],
    attrs_b: Sequence[int],
    *,
    residual: bool,
    reps: int = 7,
    threads: int = 1,
) -> tuple[float, float]:
    """This conv layer's time in ms here under ``attrs_a`` and ``attrs_b`` on ``threads`` OpenMP
    threads (the kernels oneDNN makes for that count): the fastest of ``reps`` runs each, the
    two run in turn (other processes only ever add time)."""
    import tvm_ffi

    load()
    f = tvm_ffi.get_global_func("layerfuse.onednn.time_conv")
    shapes = [tvm_ffi.Shape([int(d) for d in v]) for v in (x_shape, w_shape, _values(attrs_a), _values(attrs_b))]
    a, b = f(*shapes, bool(residual), int(reps), int(threads))
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


class LayoutVaries(ValueError):
    """A call's weights layout depends on the thread count its kernels are made for, so its
    weights cannot be packed once for every thread count (the library's ``ThreadSteady``)."""

    def __init__(self, threads: int) -> None:
        counted = f"{threads} thread{'s' if threads != 1 else ''}"
        super().__init__(f"oneDNN picks its weights layout by the thread count (another one at {counted})")


def _layout(found, *, steady: bool) -> tuple[int, int]:
    """(identity, bytes) of the library's ``[identity, bytes, varies]``; ``steady``:
    :class:`LayoutVaries` where ``varies`` names a thread count with another layout."""
    identity, nbytes, varies = (int(v) for v in found)
    if steady and varies:
        raise LayoutVaries(varies)
    return identity, nbytes


def pack_weights(
    x_shape: Sequence[int], weight, attrs, *, prologue: bool, residual: bool, out_channels: Sequence[int], steady: bool = False
) -> tuple[int, np.ndarray]:
    """``weight`` (plain ``[O, C/groups, kh, kw]``) packed for the conv call with input dims
    ``x_shape`` (a prologue's pieces: their concatenation's), ``attrs`` (plain weights) and
    outputs of ``out_channels`` channels each, as this machine's oneDNN lays it out for that
    call: (the layout's identity for :attr:`.abi.ConvAttrs.packed`, the packed bytes as 1-d
    float32). The library builds each piece's primitive exactly as the call will.
    ``steady``: :class:`LayoutVaries` where that layout is not the same at every thread count
    from 1 to the library's probe (64) and this process's."""
    import tvm
    import tvm_ffi

    load()
    shapes = [tvm_ffi.Shape([int(d) for d in v]) for v in (x_shape, weight.shape, _values(attrs), out_channels)]
    layout = tvm_ffi.get_global_func("layerfuse.onednn.packed_layout")
    found = layout(shapes[0], bool(prologue), shapes[1], shapes[2], bool(residual), shapes[3])
    identity, nbytes = _layout(found, steady=steady)
    out = tvm.runtime.empty((int(nbytes) // 4,), "float32", tvm.cpu())
    w = tvm.runtime.tensor(np.ascontiguousarray(weight, dtype=np.float32))
    tvm_ffi.get_global_func("layerfuse.onednn.pack_weights")(
        shapes[0], bool(prologue), w, shapes[2], bool(residual), shapes[3], out
    )
    return int(identity), out.numpy()


def pack_dense_weights(n: int, weight, *, steady: bool = False) -> tuple[int, np.ndarray]:
    """``weight`` (plain ``[K, M]``) packed for ``dense`` with an input of ``n`` rows, as this
    machine's oneDNN matmul lays it out: (the layout's identity for
    :attr:`.abi.DenseAttrs.packed`, the packed bytes as 1-d float32); ``steady`` as for
    :func:`pack_weights`."""
    import tvm
    import tvm_ffi

    load()
    k, m = (int(d) for d in weight.shape)
    nkm = tvm_ffi.Shape([int(n), k, m])
    identity, nbytes = _layout(tvm_ffi.get_global_func("layerfuse.onednn.dense_packed_layout")(nkm), steady=steady)
    out = tvm.runtime.empty((int(nbytes) // 4,), "float32", tvm.cpu())
    w = tvm.runtime.tensor(np.ascontiguousarray(weight, dtype=np.float32))
    tvm_ffi.get_global_func("layerfuse.onednn.dense_pack_weights")(nkm, w, out)
    return int(identity), out.numpy()
