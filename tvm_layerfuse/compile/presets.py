"""Target presets: ``--target cpu|aarch64|cuda [--arch sm_XX]`` or a JSON file of one's own.

A preset (``targets/*.json``) is data: the TVM target dict, the host target, the cross
compiler that links the library, the device kind (``cpu``/``cuda``) and the machine
architecture of the hosts that will load the artifact. ``archs`` entries (CUDA) override
any of these per architecture, e.g. ``sm_87`` (Jetson Orin) has an aarch64 host.

CPU code generation: ``"mcpu": "host"`` in a preset's target (the ``cpu`` preset) is
replaced at compile time by this machine's CPU name as LLVM knows it (``znver4``,
``sapphirerapids`` ...), so LLVM emits AVX2/AVX-512 code; the artifact then needs a CPU with
the same extensions. ``cpu-portable`` names the baseline ``x86-64`` for artifacts that move
between machines. The manifest records the resolved target (``target.tvm_target.mcpu``) and
``target.portable``.
"""

from __future__ import annotations

import importlib.resources
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import BuildError, UsageError


@dataclass(frozen=True)
class TargetSpec:
    """A resolved build target."""

    preset: str
    description: str
    device: str  # "cpu" | "cuda"
    machine: str  # host architecture of the artifact: "x86_64" | "aarch64"
    target: dict[str, Any]  # TVM target dict, arch included
    host: Optional[dict[str, Any]] = None
    cross_compiler: Optional[str] = None
    arch: Optional[str] = None
    install_hint: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)
    host_cpu: bool = False  # the target's -mcpu is this build machine's CPU (not portable)

    def tvm_target(self):
        import tvm

        return tvm.target.Target(self.target, host=self.host) if self.host else tvm.target.Target(self.target)

    def to_dict(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "description": self.description,
            "device": self.device,
            "machine": self.machine,
            "arch": self.arch,
            "tvm_target": self.target,
            "host": self.host,
            "cross_compiler": self.cross_compiler,
            "portable": not self.host_cpu,
            "cpu_flags": _build_cpu_flags() if self.host_cpu else [],
        }


HOST_CPU = "host"  # the "mcpu" placeholder for this build machine's CPU


def _presets():
    """The folder of preset files: ``targets/`` of this checkout when there is one (so a
    source tree on PYTHONPATH uses its own presets), else the installed package data."""
    here = Path(__file__).resolve().parents[2] / "targets"
    if (here / "cpu.json").is_file():
        return here
    return importlib.resources.files("tvm_layerfuse.targets")


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in _presets().iterdir() if p.name.endswith(".json"))


def _build_cpu_flags() -> list[str]:
    from ..runtime.tactics import tracked_flags

    return tracked_flags()


def host_cpu_name() -> str:
    """This machine's CPU as LLVM names it (``-mcpu``), e.g. ``znver4``."""
    from tvm.target import codegen

    return str(codegen.llvm_get_system_cpu())


def _load_preset(name: str) -> dict[str, Any]:
    path = Path(name)
    if name.endswith(".json") or path.exists():
        if not path.is_file():
            raise UsageError(f"target file {name!r} does not exist; expected a preset name ({', '.join(preset_names())}) or a JSON file")
        source = path.read_text()
    else:
        res = _presets() / f"{name}.json"
        if not res.is_file():
            raise UsageError(f"target {name!r} is unknown; expected one of {', '.join(preset_names())} or a JSON preset file")
        source = res.read_text()
    try:
        data = json.loads(source)
    except json.JSONDecodeError as e:
        raise UsageError(f"target preset {name!r} is not valid JSON ({e}); fix the file") from None
    for key in ("device", "machine", "target"):
        if key not in data:
            raise UsageError(f"target preset {name!r} lacks {key!r}; see targets/cpu.json for the format")
    return data


def resolve(name: str = "cpu", *, arch: Optional[str] = None) -> TargetSpec:
    """The build target for preset ``name`` (or a JSON file) and an optional ``arch``."""
    data = _load_preset(name)
    archs = data.get("archs") or {}
    if archs:
        arch = arch or data.get("default_arch")
        if arch not in archs:
            raise UsageError(f"--arch {arch} is not offered by target {name!r}; expected one of {', '.join(archs)}")
        data = {**data, **archs[arch]}
        target = {**data["target"], "arch": arch}
    else:
        if arch is not None:
            raise UsageError(f"--arch applies to GPU targets; target {name!r} takes none - leave --arch out")
        target = dict(data["target"])
    host_cpu = target.get("mcpu") == HOST_CPU
    if host_cpu:
        target["mcpu"] = host_cpu_name()
    return TargetSpec(
        preset=data.get("name", Path(name).stem),
        description=data.get("description", ""),
        device=data["device"],
        machine=data["machine"],
        target=target,
        host=data.get("host"),
        cross_compiler=data.get("cross_compiler"),
        arch=arch if archs else None,
        install_hint=data.get("install_hint"),
        host_cpu=host_cpu,
    )


def check_toolchain(spec: TargetSpec) -> None:
    """Refuse early, with the install command, when a tool the build needs is missing."""
    if spec.cross_compiler and shutil.which(spec.cross_compiler) is None:
        hint = f" ({spec.install_hint})" if spec.install_hint else ""
        raise BuildError(
            f"target {spec.preset}{' ' + spec.arch if spec.arch else ''} links with {spec.cross_compiler}, which is not "
            f"on PATH; install it{hint}"
        )
    if spec.device == "cuda":
        from .cuda import find_cuda

        find_cuda()
