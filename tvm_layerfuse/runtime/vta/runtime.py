"""The VTA runtime: load a compiled VTA artifact and run it on a device (numpy only).

An artifact directory holds::

    vta.json       manifest: format, VTA configuration, inputs/outputs, tensor scales and
                   storage, the op sequence (VTA program or host steps), sha256 of each file
    dram.bin       the DRAM image: packed weights, biases, shift vectors, micro-op kernels,
                   zeroed activation buffers (absolute addresses are baked into the programs)
    programs.npz   one VTA instruction stream per fused layer (16 bytes per instruction)
    host.so        the host steps (stem conv, pools, classifier, ...) compiled by TVM for the
                   host CPU: one Relax VM function per host op (``host_library``)
    host.npz       their weights (the functions' parameters; also what the numpy steps read)

Devices implement :class:`VTADevice` (the shape of VTA's ``driver.h``: device memory,
copies, run an instruction stream and wait for FINISH). ``"sim"`` is
:class:`tvm_layerfuse.runtime.vta.sim.Simulator`. ``"board"`` needs a driver for a real VTA (PYNQ-Z1,
Ultra96, DE10-Nano with the VTA bitstream): none ships with this package, so it fails
with "no VTA device found" unless one is passed in. The host ops of a loaded artifact run in
``host.so`` through TVM's runtime (``tvm.runtime`` and its VM, imported when an artifact is
loaded); the numpy interpretation of the same steps (:mod:`.host`) is the reference the
compiler's in-memory modules run. Importing this module never imports onnx, TVM or the compiler.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Union

import numpy as np

from ...errors import ArtifactError, DeviceError, InputError, first_line
from . import host
from .config import VTAConfig, config_from_dict
from .layout import Layout, Segment, pack_activation, unpack_activation
from .numerics import dequantize, quantize
from .sim import DRAM, Counters, Simulator

log = logging.getLogger(__name__)

FORMAT = "tvm_layerfuse.vta/3"  # 3: hardware-legal programs (no acc8 loads)
MANIFEST = "vta.json"
FILES = ("dram.bin", "programs.npz", "host.npz")
HOST_LIBRARY = "host.so"


def artifact_files(manifest: Mapping[str, Any]) -> tuple[str, ...]:
    """The files beside ``vta.json``: :data:`FILES` and the host library when the manifest has one."""
    lib = manifest.get("host_library")
    return FILES + ((lib["file"],) if lib else ())
BOARD_DEVICE_NODES = ("/dev/xlnk", "/dev/udmabuf0", "/dev/vta0")


class VTADevice(Protocol):
    """What the runtime needs from a VTA: one DRAM and one instruction queue."""

    def reset(self, image: np.ndarray) -> None:
        """Device memory := ``image`` (weights, micro-ops, zeroed activations)."""

    def write(self, addr: int, data: np.ndarray) -> None:
        """Copy host bytes to device memory at byte address ``addr``."""

    def read(self, addr: int, nbytes: int) -> np.ndarray:
        """Copy ``nbytes`` of device memory to the host."""

    def run(self, stream: np.ndarray) -> Counters:
        """Fetch and execute an instruction stream; return when its FINISH completes."""


class SimDevice:
    """The simulator as a :class:`VTADevice`: ``mode="hardware"`` (what the VTA hardware designs
    execute; the default) or ``"functional"`` (upstream's functional simulator)."""

    def __init__(self, cfg: VTAConfig, *, mode: str = "hardware") -> None:
        self.cfg = cfg
        self.dram = DRAM()
        self.sim = Simulator(cfg, self.dram, mode=mode)

    def reset(self, image: np.ndarray) -> None:
        self.dram.data = image.copy()
        self.dram.top = image.size

    def write(self, addr: int, data: np.ndarray) -> None:
        self.dram.write(addr, data)

    def read(self, addr: int, nbytes: int) -> np.ndarray:
        return self.dram.read(addr, nbytes)

    def run(self, stream: np.ndarray, *, name: str = "?") -> Counters:
        return self.sim.run(stream, name=name)


def open_device(device: Union[str, VTADevice], cfg: VTAConfig) -> VTADevice:
    """``"sim"`` (the simulator in hardware mode), ``"sim-functional"`` (upstream's functional
    simulator, for comparison), ``"board"`` or a :class:`VTADevice` object."""
    if not isinstance(device, str):
        return device
    if device == "sim":
        return SimDevice(cfg)
    if device == "sim-functional":
        return SimDevice(cfg, mode="functional")
    if device == "board":
        found = [p for p in BOARD_DEVICE_NODES if os.path.exists(p)]
        detail = f"found {', '.join(found)} but no VTA driver is bundled" if found else f"none of {', '.join(BOARD_DEVICE_NODES)} exists"
        raise DeviceError(
            f"no VTA device found ({detail}); expected a PYNQ/Ultra96/DE10-Nano board with the VTA bitstream loaded and a "
            "driver object implementing tvm_layerfuse.runtime.vta.runtime.VTADevice - pass device='sim' to use the simulator"
        )
    raise DeviceError(f"VTA device {device!r} is unknown; expected 'sim', 'sim-functional', 'board' or a VTADevice object - "
                      "pass device='sim'")


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    counters: Counters
    per_program: dict[str, Counters]
    ints: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class _Storage:
    layout: Layout
    elem: int  # DRAM element (block-row) index of the tensor's first element
    height: int
    width: int


class HostSteps:
    """``host.so``: the host ops compiled by TVM, run by TVM's runtime (Relax VM) on the CPU.

    Each host op of the manifest names its ``function``, called with the op's ``reads``
    (float64, NCHW) and then its ``params`` (arrays of host.npz); it returns the ``writes``."""

    def __init__(self, path: Path, consts: Mapping[str, np.ndarray], ops: list[dict[str, Any]], *, machine: Optional[str]) -> None:
        import tvm  # the runtime part only: tvm.relax is never imported here
        from tvm.runtime import vm as vm_runtime

        try:
            lib = tvm.runtime.load_module(str(path))
        except Exception as e:  # noqa: BLE001 - a foreign or damaged library: one line
            raise ArtifactError(
                f"host library {str(path)!r} cannot be loaded ({first_line(e)}); expected a library built for "
                f"{machine or 'this machine'} - compile the artifact with a preset for this machine"
            ) from None
        self._tvm = tvm
        self._dev = tvm.cpu(0)
        self._vm = vm_runtime.VirtualMachine(lib, self._dev)
        # the functions' weights: float arrays of host.npz, float64 as the functions take them
        self._params = {k: tvm.runtime.tensor(np.ascontiguousarray(consts[k], dtype=np.float64), self._dev)
                        for op in ops for k in op.get("params", ())}  # fmt: skip

    def __call__(self, op: Mapping[str, Any], values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensor = self._tvm.runtime.tensor
        args = [tensor(np.ascontiguousarray(values[n], dtype=np.float64), self._dev) for n in op["reads"]]
        out = self._vm[op["function"]](*args, *(self._params[k] for k in op["params"]))
        outs = [out] if hasattr(out, "numpy") else list(out)
        return {name: o.numpy() for name, o in zip(op["writes"], outs)}


class VTAModule:
    """A compiled network: VTA programs on a device, host steps in ``host.so`` (a loaded
    artifact) or interpreted in numpy (the compiler's in-memory module, the reference)."""

    def __init__(self, manifest: Mapping[str, Any], image: np.ndarray, streams: Mapping[str, np.ndarray],
                 consts: Mapping[str, np.ndarray], *, device: Union[str, VTADevice] = "sim",
                 host_steps: Optional[HostSteps] = None) -> None:
        self.manifest = dict(manifest)
        self.cfg = config_from_dict(manifest["config"], source="artifact VTA configuration")
        self.image = image
        self.streams = dict(streams)
        self.consts = dict(consts)
        self.frac: dict[str, int] = {k: int(v) for k, v in manifest["frac"].items()}
        self.storage = {
            name: _Storage(
                Layout(s["channels"], s["blocks"], tuple(Segment(*seg) for seg in s["segments"])), s["elem"], s["height"], s["width"]
            )
            for name, s in manifest["storage"].items()
        }
        self.inputs: dict[str, list[int]] = {k: list(v) for k, v in manifest["inputs"].items()}
        self.outputs: list[str] = list(manifest["outputs"])
        self.host_steps = host_steps
        self.device = open_device(device, self.cfg)

    # ------------------------------------------------------------------ run
    def run(self, feeds: Mapping[str, np.ndarray], *, trace: bool = False) -> RunResult:
        cfg, dev = self.cfg, self.device
        self._check(feeds)
        dev.reset(self.image)
        floats: dict[str, np.ndarray] = {k: np.asarray(v, dtype=np.float64) for k, v in feeds.items()}
        resident: set[str] = set()
        ints: dict[str, np.ndarray] = {}
        eb = cfg.inp_elem_bytes

        def to_dram(name: str) -> None:
            st = self.storage[name]
            dev.write(st.elem * eb, pack_activation(quantize(floats[name], self.frac[name]), st.layout, cfg.block))
            resident.add(name)

        def from_dram(name: str) -> np.ndarray:
            st = self.storage[name]
            raw = dev.read(st.elem * eb, st.layout.blocks * st.height * st.width * eb)
            return unpack_activation(raw.view(np.int8).reshape(st.layout.blocks, st.height, st.width, cfg.block), st.layout)

        def as_float(name: str) -> np.ndarray:
            if name not in floats:
                x_q = from_dram(name)
                if trace:
                    ints[name] = x_q
                floats[name] = dequantize(x_q, self.frac[name])
            return floats[name]

        for name in self.inputs:
            if name in self.storage:
                to_dram(name)
        per: dict[str, Counters] = {}
        for op in self.manifest["ops"]:
            if op["kind"] == "host":
                local = {n: as_float(n) for n in op["reads"]}
                if self.host_steps is not None:
                    local.update(self.host_steps(op, local))
                else:
                    host.run_steps(op["steps"], local, self.consts)
                for name in op["writes"]:
                    floats[name] = local[name]
                    if name in self.storage:
                        to_dram(name)
                continue
            for name in op["reads"]:
                if name not in resident:
                    to_dram(name)
            if op["program"] is not None:
                stream = self.streams[op["program"]]
                per[op["name"]] = dev.run(stream, name=op["name"]) if isinstance(dev, SimDevice) else dev.run(stream)
            for name in op["writes"]:
                resident.add(name)
                floats.pop(name, None)
        if trace:
            for name in self.storage:
                if name in resident:
                    ints.setdefault(name, from_dram(name))
        outputs = {o: as_float(o) for o in self.outputs}
        total = Counters()
        for c in per.values():
            total.add(c)
        return RunResult(outputs, total, per, ints)

    def _check(self, feeds: Mapping[str, np.ndarray]) -> None:
        for name, shape in self.inputs.items():
            if name not in feeds:
                raise InputError(f"input {name!r} is missing; expected {sorted(self.inputs)} - pass every model input")
            got = list(np.shape(feeds[name]))
            if got != shape:
                raise InputError(
                    f"input {name!r} has shape {got}; expected {shape} (what the VTA artifact was compiled for) - "
                    "resize the input or recompile"
                )

    # ------------------------------------------------------------------ files
    def write_files(self, out_dir: Union[str, Path]) -> None:
        """Write the artifact's VTA files into the existing directory ``out_dir`` (which holds
        the host library already when the manifest names one)."""
        out = Path(out_dir)
        (out / "dram.bin").write_bytes(self.image.tobytes())
        np.savez(out / "programs.npz", **self.streams)
        np.savez(out / "host.npz", **self.consts)
        manifest = dict(self.manifest)
        manifest["sha256"] = {f: _sha256(out / f) for f in artifact_files(manifest)}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_vta(artifact_dir: Union[str, Path], *, device: Union[str, VTADevice] = "sim") -> VTAModule:
    """Load a VTA artifact written by :func:`tvm_layerfuse.compile.vta.pipeline.compile_vta`."""
    d = Path(artifact_dir)
    mpath = d / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{str(d)!r} has no vta.json; expected a VTA artifact directory - compile with the vta target")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{str(mpath)!r} cannot be read as JSON ({exc}); expected a VTA manifest - recompile") from None
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{str(mpath)!r} has format {manifest.get('format')!r}; expected {FORMAT!r} - recompile with this version")
    if any(op["kind"] == "host" for op in manifest["ops"]) and not manifest.get("host_library"):
        raise ArtifactError(f"{str(mpath)!r} has host ops but no host library; expected {HOST_LIBRARY} (the TVM-compiled "
                            "host steps) - recompile with this version")
    for f in artifact_files(manifest):
        p = d / f
        if not p.is_file() or _sha256(p) != manifest.get("sha256", {}).get(f):
            raise ArtifactError(f"artifact file {str(p)!r} is missing or does not match its checksum in vta.json; expected the files "
                                "as compiled - recompile or copy the whole directory again")
    image = np.frombuffer((d / "dram.bin").read_bytes(), dtype=np.uint8).copy()
    with np.load(d / "programs.npz", allow_pickle=False) as z:
        streams = {k: z[k] for k in z.files}
    with np.load(d / "host.npz", allow_pickle=False) as z:
        consts = {k: z[k] for k in z.files}
    lib = manifest.get("host_library")
    steps = HostSteps(d / lib["file"], consts, manifest["ops"], machine=lib.get("machine")) if lib else None
    return VTAModule(manifest, image, streams, consts, device=device, host_steps=steps)
