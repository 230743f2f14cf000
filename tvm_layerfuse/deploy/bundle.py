"""``bundle``: a self-contained, runtime-only directory for a machine without TVM.

::

    DIR/
      run.py            python run.py [--input x.npy] [--output y.npz] [--device cpu|cuda]
      rpc_server.sh     ./rpc_server.sh [--host 127.0.0.1] [--port 9091] [--tracker H:P --key K]
      artifact/         the compiled artifact (checked before copying); for an artifact whose
                        layers run on oneDNN, also libdnnl.so.2 beside tactics_onednn.so (which
                        finds it through its $ORIGIN run path), so the target needs no oneDNN
      site/             tvm (runtime library only), tvm_ffi, ml_dtypes, typing_extensions,
                        cloudpickle, psutil, and tvm_layerfuse's runtime package (with the
                        VTA runtime: a vta artifact runs on the simulator, rpc_server.sh
                        then serves it with the VTA runtime registered)
      README.txt

The target needs Python (the version given with ``--python``) and numpy. The packages for
another Python version or machine (aarch64 boards) are PyPI wheels fetched with
``pip download``; for this machine's own Python they are copied from this installation.
What TVM's runtime does not need is left out: the compiler library, relax, s_tir, topi,
sources and headers (~18 MB remain).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Optional

from ..errors import BuildError, UsageError
from ..runtime import artifact

log = logging.getLogger(__name__)

# Directories and files of the tvm / tvm_ffi packages that the runtime never imports.
PRUNE = (
    "tvm/lib/libtvm_compiler.so",
    "tvm/3rdparty",
    "tvm/src",
    "tvm/include",
    "tvm/relax",
    "tvm/s_tir",
    "tvm/topi",
    "tvm/web",
    "tvm/cmake",
    "tvm/lib64",
    "tvm/backend/trn",
    "tvm_ffi/include",
    "tvm_ffi/src",
    "tvm_ffi/3rdparty",
    "tvm_ffi/cython",
)
PACKAGES = ("tvm", "tvm_ffi", "ml_dtypes", "typing_extensions", "cloudpickle", "psutil")
# What a bundle holds of tvm_layerfuse: the runtime package, as it is, and the modules
# around it that it and the run command import (tests/test_runtime_boundary.py checks
# that none of them imports the compiler).
RUNTIME_PACKAGE = "runtime"
LOADER = ("__init__.py", "errors.py", "cli/__init__.py", "cli/run.py")
# The runtime side of the VTA target (numpy + TVM's runtime: what runtime.load needs for a vta
# artifact, and the board's server, python -m tvm_layerfuse.runtime.vta.rpc_server) is
# runtime/vta/, part of the runtime package.
WHEELS = {
    "tvm": "apache-tvm=={tvm}",
    "tvm_ffi": "apache-tvm-ffi=={ffi}",
    "ml_dtypes": "ml_dtypes",
    "typing_extensions": "typing_extensions",
    "cloudpickle": "cloudpickle",
    "psutil": "psutil",
}

RUN_PY = '''#!/usr/bin/env python3
"""Run the bundled model with the TVM runtime only (see README.txt)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
sys.path.insert(0, os.path.join(HERE, "site"))

from tvm_layerfuse.cli.run import bundle_main  # noqa: E402

sys.exit(bundle_main(artifact_dir=os.path.join(HERE, "artifact")))
'''

RPC_SH = '''#!/bin/sh
# Start TVM's RPC server from this bundle (runtime only). TVM RPC has no authentication:
# it binds to 127.0.0.1 unless you pass --host; expose it only on a network you trust.
HERE=$(cd "$(dirname "$0")" && pwd)
export TVM_USE_RUNTIME_LIB=1
export PYTHONPATH="$HERE/site${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m {server} --host 127.0.0.1 "$@"
'''

README = """tvm_layerfuse runtime bundle
============================

Model: {model}    target: {target}    built for Python {python} on {machine}

Needs: Python {python} and numpy (pip install numpy). Nothing else: TVM's runtime is in site/.

Run once:            python3 run.py --input x.npy --output y.npz      (random input without --input)
                     python3 run.py --input image.jpg                  (needs Pillow for images)
Serve over TVM RPC:  ./rpc_server.sh --port 9091                       (loopback only by default)
                     then on the workstation: python -m tvm_layerfuse deploy ARTIFACT --rpc BOARD:9091
TVM RPC has no authentication: use --host 0.0.0.0 only on a network you trust.
"""


def make_bundle(
    artifact_dir: Path,
    out: Path,
    *,
    python: Optional[str] = None,
    force: bool = False,
    cache: Optional[Path] = None,
) -> Path:
    """Write the bundle directory ``out`` for ``artifact_dir`` (atomically)."""
    artifact_dir = Path(artifact_dir)
    manifest = artifact.verify(artifact_dir)
    machine = manifest["target"].get("machine") or _machine()
    python = python or f"{sys.version_info.major}.{sys.version_info.minor}"
    if not python.replace(".", "").isdigit() or python.count(".") != 1:
        raise UsageError(f"--python {python!r} is not a version; expected MAJOR.MINOR such as 3.12")
    out = Path(out)
    with artifact.atomic_directory(out, overwrite=force, mode=0o755) as tmp:
        site = tmp / "site"
        site.mkdir()
        _install_packages(site, python=python, machine=machine, cache=cache)
        _prune(site)
        copy_runtime(site)
        shutil.copytree(artifact_dir, tmp / "artifact", ignore=shutil.ignore_patterns(".*"))
        copy_vendor_libraries(manifest, tmp / "artifact", machine=machine, artifact_dir=artifact_dir)
        _write(tmp / "run.py", RUN_PY, executable=True)
        vta = manifest["target"].get("device") == "vta"  # its server runs the VTA runtime (simulator)
        server = "tvm_layerfuse.runtime.vta.rpc_server" if vta else "tvm.exec.rpc_server"
        _write(tmp / "rpc_server.sh", RPC_SH.replace("{server}", server), executable=True)
        _write(
            tmp / "README.txt",
            README.format(
                model=manifest.get("model", {}).get("name"),
                target=manifest["target"].get("preset"),
                python=python,
                machine=machine,
            ),
        )
    return out


def copy_runtime(site: Path) -> Path:
    """Copy tvm_layerfuse's runtime side (``RUNTIME_PACKAGE`` with the VTA runtime, ``LOADER``) into
    ``site/tvm_layerfuse``; with ``site`` on ``PYTHONPATH`` a runtime-only Python can load any
    artifact and serve vta ones (``python -m tvm_layerfuse.runtime.vta.rpc_server``). Returns the package."""
    pkg = Path(site) / "tvm_layerfuse"
    pkg.mkdir()
    here = Path(__file__).resolve().parents[1]
    shutil.copytree(here / RUNTIME_PACKAGE, pkg / RUNTIME_PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    for name in LOADER:
        (pkg / name).parent.mkdir(exist_ok=True)
        shutil.copy2(here / name, pkg / name)
    return pkg


def copy_vendor_libraries(manifest: dict, dest: Path, *, machine: str, artifact_dir: Path) -> list[str]:
    """Copy the vendor libraries that the artifact's tactic libraries need (``libdnnl.so.2``)
    into ``dest``, beside them, from where this machine loads them; returns their names."""
    from ..runtime.tactics import vendor_file

    copied = []
    for entry in (manifest.get("tactics") or {}).get("libraries") or []:
        for soname in entry.get("needs") or []:
            built = Path((entry.get("built_against") or {}).get("library") or "")
            found = vendor_file(soname, artifact_dir / entry["file"], [built.parent] if built.name == soname else [])
            if found is None or machine != _machine():
                why = "is not installed here" if found is None else f"here is for {_machine()}, the artifact for {machine}"
                raise BuildError(
                    f"artifact {str(artifact_dir)!r} needs {soname} for {entry['file']}, which {why}; "
                    f"install it ({entry.get('install') or 'see README'}) and bundle again, or compile with --tactics tvm"
                )
            shutil.copy2(found, dest / soname)  # a copy, not a link: the bundle moves to another machine
            copied.append(soname)
    return copied


def size_of(path: Path) -> dict[str, int]:
    """Bytes of the runtime part (everything but the weights and the vendor libraries), of the
    weights, and of the vendor libraries the bundle carries (``libdnnl.so.2``)."""
    from ..runtime.tactics import VENDOR_LIBRARIES

    total = weights = vendor = 0
    for f in Path(path).rglob("*"):
        if f.is_file():
            total += f.stat().st_size
            if f.name == artifact.PARAMS:
                weights += f.stat().st_size
            elif f.name in VENDOR_LIBRARIES:
                vendor += f.stat().st_size
    return {"runtime_bytes": total - weights - vendor, "weights_bytes": weights, "vendor_bytes": vendor}


def _machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _install_packages(site: Path, *, python: str, machine: str, cache: Optional[Path]) -> None:
    local = python == f"{sys.version_info.major}.{sys.version_info.minor}" and machine == _machine()
    missing = []
    for name in PACKAGES:
        src = _local_package(name) if local else None
        if src is None:
            missing.append(name)
        elif src.is_dir():
            shutil.copytree(src, site / src.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, site / src.name)
    if missing:
        _download(site, missing, python=python, machine=machine, cache=cache)


def _local_package(name: str) -> Optional[Path]:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin)
    return origin.parent if origin.name == "__init__.py" else origin


def _download(site: Path, names: list[str], *, python: str, machine: str, cache: Optional[Path]) -> None:
    import tvm_ffi

    try:
        from importlib.metadata import version

        tvm_version = version("apache-tvm")
    except Exception:
        tvm_version = "0.27.0.post1"
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvm_layerfuse" / "wheels"
    where = cache / f"py{python}-{machine}"
    where.mkdir(parents=True, exist_ok=True)
    reqs = [WHEELS[n].format(tvm=tvm_version, ffi=tvm_ffi.__version__) for n in names]
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", python, "--platform", f"manylinux_2_28_{machine}", "--platform", f"manylinux2014_{machine}",
        "--platform", f"manylinux_2_17_{machine}", "-d", str(where), *reqs,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise BuildError(
            f"cannot fetch runtime wheels for Python {python} on {machine} ({tail}); check the version and network"
        )
    for wheel in sorted(where.glob("*.whl")):
        dist = wheel.name.split("-")[0].lower().replace("_", "-")
        if any(dist == WHEELS[n].split("=")[0].lower() for n in names):
            with zipfile.ZipFile(wheel) as z:
                for member in z.namelist():
                    top = member.split("/")[0]
                    if ".dist-info" in top or top.endswith(".data"):
                        continue
                    z.extract(member, site)
    for f in site.rglob("*.so*"):
        f.chmod(f.stat().st_mode | stat.S_IXUSR)


def _prune(site: Path) -> None:
    for rel in PRUNE:
        p = site / rel
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    for cache_dir in list(site.rglob("__pycache__")):
        shutil.rmtree(cache_dir, ignore_errors=True)


def _write(path: Path, text: str, *, executable: bool = False) -> None:
    path.write_text(text)
    if executable:
        path.chmod(0o755)
