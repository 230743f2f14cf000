"""Build CUDA artifacts that embed the device binary, on a machine without a GPU.

Three things make TVM embed a real device binary (not CUDA source to be compiled at load
time by NVRTC, which needs the compiler side on the board):

1. ``libtvm_runtime_cuda.so`` must load, so that code generation can create a CUDA module.
   It links against ``libcuda.so.1`` (the driver). Without a driver we load a *link-time
   stub* first: a tiny library with that soname whose functions all fail. It only
   satisfies the dynamic linker while building; nothing in it is ever called, and the
   artifact does not reference it.
2. ``tvm_callback_cuda_compile`` compiles the generated CUDA with ``nvcc`` into a fatbin
   holding the cubin for the requested ``sm_XX`` and its PTX.
3. ``CUDA_PATH`` points at the real toolkit (the ``nvcc`` on PATH may be a wrapper script).

:func:`device_code` reads the fatbin back out of a library, to check what got embedded.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from ..errors import BuildError

log = logging.getLogger(__name__)

FATBIN_MAGIC = 0xBA55ED50
_KINDS = {1: "ptx", 2: "elf"}
# Driver entry points libtvm_runtime_cuda.so imports (read with `nm -D` when available).
_DRIVER_SYMBOLS = (
    "cuDeviceGetName",
    "cuFuncSetAttribute",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuLaunchKernelEx",
    "cuModuleGetFunction",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuTensorMapEncodeTiled",
)


def find_cuda() -> Path:
    """The CUDA toolkit root (with ``bin/nvcc``): $CUDA_PATH, $CUDA_HOME, or /usr/local/cuda*."""
    candidates = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    candidates += sorted((str(p) for p in Path("/usr/local").glob("cuda-*")), reverse=True)
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").is_file() and not _is_wrapper(Path(c) / "bin" / "nvcc"):
            return Path(c).resolve()
    raise BuildError(
        "CUDA targets need the CUDA toolkit's nvcc, which was not found (looked at $CUDA_PATH, $CUDA_HOME, "
        "/usr/local/cuda*); install the CUDA toolkit or set CUDA_PATH"
    )


def _is_wrapper(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"#!"


def _tvm_lib_dir() -> Path:
    import tvm

    return Path(tvm.__file__).parent / "lib"


def _driver_symbols(lib: Path) -> list[str]:
    nm = shutil.which("nm")
    if nm:
        out = subprocess.run([nm, "-D", "--undefined-only", str(lib)], capture_output=True, text=True)
        names = [line.split()[-1] for line in out.stdout.splitlines() if line.split()]
        names = [n for n in names if n.startswith("cu") and n[2:3].isupper() and "@" not in n]
        if names:
            return names
    return list(_DRIVER_SYMBOLS)


def driver_stub(cache: Optional[Path] = None) -> Path:
    """Build (once, cached) the link-time stub ``libcuda.so.1``."""
    runtime_cuda = _tvm_lib_dir() / "libtvm_runtime_cuda.so"
    symbols = _driver_symbols(runtime_cuda)
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvm_layerfuse" / "cuda-stub"
    key = hashlib.sha256(" ".join(symbols).encode()).hexdigest()[:16]
    out = cache / key / "libcuda.so.1"
    if out.exists():
        return out
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise BuildError("building for CUDA without a GPU needs a C compiler (cc) for the driver stub; install gcc")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "stub.c"
        # CUDA_ERROR_UNKNOWN (999) from every entry point: never meant to be called.
        src.write_text("".join(f"int {s}(void) {{ return 999; }}\n" for s in symbols))
        lib = Path(tmp) / "libcuda.so.1"
        proc = subprocess.run(
            [cc, "-shared", "-fPIC", "-o", str(lib), "-Wl,-soname,libcuda.so.1", str(src)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise BuildError(f"cannot build the CUDA driver stub: {proc.stderr.strip()[:200]}")
        os.replace(lib, out)
    return out


def load_cuda_codegen_runtime() -> None:
    """Make ``libtvm_runtime_cuda.so`` loaded in this process (with the stub when no driver)."""
    import tvm

    if tvm.get_global_func("device_api.cuda", allow_missing=True) is not None:
        return
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        ctypes.CDLL(str(driver_stub()), mode=ctypes.RTLD_GLOBAL)
        log.info("no NVIDIA driver here: loaded a link-time stub libcuda.so.1 to build CUDA code")
    lib = _tvm_lib_dir() / "libtvm_runtime_cuda.so"
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise BuildError(f"TVM's CUDA runtime ({lib}) cannot load: {e}; install the CUDA toolkit runtime (libcudart)") from None
    if tvm.get_global_func("device_api.cuda", allow_missing=True) is None:
        raise BuildError("TVM's CUDA runtime loaded but registered no CUDA device API; check the TVM installation")


@contextlib.contextmanager
def nvcc_fatbin(arch: str) -> Iterator[None]:
    """Within this block TVM compiles CUDA kernels with nvcc into a fatbin for ``arch`` (sm_XX)."""
    import tvm_ffi
    from tvm.support import nvcc

    root = find_cuda()
    load_cuda_codegen_runtime()
    number = arch.removeprefix("sm_")
    gencode = ["-gencode", f"arch=compute_{number},code=[sm_{number},compute_{number}]"]

    def compile_cuda(code):
        try:
            return nvcc.compile_cuda(code, target_format="fatbin", arch=gencode, compiler="nvcc")
        except Exception as e:
            lines = [line.strip() for line in str(e).splitlines() if "error" in line]
            detail = (lines or str(e).strip().splitlines() or ["nvcc failed"])[0][:300]
            raise BuildError(f"nvcc failed for {arch}: {detail}") from None

    previous_path = os.environ.get("CUDA_PATH")
    previous_cb = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    os.environ["CUDA_PATH"] = str(root)
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)
    try:
        yield
    finally:
        if previous_cb is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", previous_cb, override=True)
        if previous_path is None:
            os.environ.pop("CUDA_PATH", None)
        else:
            os.environ["CUDA_PATH"] = previous_path


def _fatbins(data: bytes) -> Iterator[tuple[int, int, int]]:
    """``(start, header_size, payload_size)`` of every fatbin (magic ``0xBA55ED50``) in ``data``."""
    magic = struct.pack("<I", FATBIN_MAGIC)
    start = data.find(magic)
    while start >= 0:
        _, header_size, fat_size = struct.unpack_from("<HHQ", data, start + 4)
        yield start, header_size, fat_size
        start = data.find(magic, start + header_size + fat_size)


def device_code(path: Path) -> list[dict[str, object]]:
    """The device images embedded in a library: ``[{"kind": "elf"|"ptx", "arch": "sm_90"}, ...]``.

    Reads every fatbin in the file and lists its entries.
    """
    data = Path(path).read_bytes()
    found = []
    for start, header_size, fat_size in _fatbins(data):
        off, end = start + header_size, start + header_size + fat_size
        while off + 32 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, off)
            arch = struct.unpack_from("<I", data, off + 28)[0]
            found.append({"kind": _KINDS.get(kind, str(kind)), "arch": f"sm_{arch}", "offset": off, "fatbin": start})
            if entry_header == 0:
                break
            off += entry_header + payload
    return found


def extract_fatbins(path: Path, out_dir: Path) -> list[Path]:
    """Write each embedded fatbin to ``out_dir`` (for ``cuobjdump --list-elf``)."""
    data = Path(path).read_bytes()
    files = []
    for start, header_size, fat_size in _fatbins(data):
        f = Path(out_dir) / f"image{len(files)}.fatbin"
        f.write_bytes(data[start : start + header_size + fat_size])
        files.append(f)
    return files
