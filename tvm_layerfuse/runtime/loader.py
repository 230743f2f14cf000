"""Load a compiled artifact with the TVM runtime only, and run inference.

::

    from tvm_layerfuse import runtime
    rt = runtime.load("out/squeezenet", device="cpu")
    outputs = rt.run({"data_0": x})          # {"softmaxout_1": array}

Works where only ``libtvm_runtime`` is installed (``TVM_USE_RUNTIME_LIB=1``, no compiler
library, no ``tvm.relax``, no onnx). Before loading anything it checks the manifest: every
file's sha256, the artifact's target against the requested device and this machine's
architecture; :meth:`Runtime.run` checks input names, shapes and dtypes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import statistics
import threading
import zipfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from ..errors import ArtifactError, DeviceError, InputError, first_line
from . import artifact
from . import tactics as runtime_tactics

log = logging.getLogger(__name__)

Inputs = Union[np.ndarray, Sequence[np.ndarray], Mapping[str, np.ndarray]]

_MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def this_machine() -> str:
    m = platform.machine().lower()
    return _MACHINES.get(m, m)


def parse_device(device: str) -> tuple[str, int]:
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda"):
        raise DeviceError(f"device {device!r} is unknown; expected cpu, cuda or cuda:N")
    try:
        return kind, int(index or 0)
    except ValueError:
        raise DeviceError(f"device {device!r} has a bad index; expected cuda:N with N an integer") from None


def compiled_for(target: Mapping[str, Any]) -> str:
    """A manifest target in messages: ``device (preset[ arch])``."""
    return f"{target.get('device')} ({target.get('preset')}{' ' + target['arch'] if target.get('arch') else ''})"


def check_target(manifest: dict[str, Any], *, device: str, machine: str, where: str = "this machine") -> None:
    """Refuse an artifact whose target does not fit ``device`` on a ``machine`` host."""
    target = manifest["target"]
    kind, _ = parse_device(device)
    if target.get("device") != kind:
        raise ArtifactError(
            f"artifact was compiled for {compiled_for(target)}, but device {device!r} was requested; "
            f"compile with --target {'cuda' if kind == 'cuda' else 'cpu'} or run on {target.get('device')}"
        )
    if target.get("machine") and target["machine"] != machine:
        raise ArtifactError(
            f"artifact was compiled for {target['machine']} hosts, but {where} is {machine}; "
            f"compile with --target {'aarch64' if machine == 'aarch64' else 'cpu'} for it"
            + (" or `deploy` the artifact to the board" if target["machine"] != this_machine() else "")
        )


def _load_cuda_runtime(tvm) -> None:
    """With only libtvm_runtime loaded, CUDA support lives in a library of its own."""
    if tvm.get_global_func("device_api.cuda", allow_missing=True) is not None:
        return
    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    if not lib.exists():
        raise DeviceError(f"this TVM has no CUDA runtime ({lib} is missing); install a CUDA-enabled TVM runtime")
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise DeviceError(
            f"the TVM CUDA runtime cannot load ({e}); expected an NVIDIA driver (libcuda.so.1) on this machine"
        ) from None


# how the oneDNN tactic library refuses a call whose weights were packed for a layout that this
# machine's oneDNN does not pick (onednn_conv.cc, CheckPacked: another CPU ISA)
PACKED_ELSEWHERE = "its weights were packed at compile time for a oneDNN weights layout"


class Runtime:
    """A loaded artifact: inputs/outputs metadata and :meth:`run`."""

    def __init__(self, path: Union[str, os.PathLike], *, device: str = "cpu") -> None:
        self.path = Path(path)
        manifest = artifact.read_manifest(self.path)
        check_target(manifest, device=device, machine=this_machine())
        artifact.verify(self.path, manifest)
        runtime_tactics.check_cpu(manifest, path=self.path)
        self.manifest = manifest
        self.inputs: list[dict[str, Any]] = manifest["inputs"]
        self.outputs: list[dict[str, Any]] = manifest["outputs"]

        import tvm  # the runtime part only; tvm.relax is never imported here
        from tvm.runtime import vm as vm_runtime

        kind, index = parse_device(device)
        if kind == "cuda":
            _load_cuda_runtime(tvm)
        self.device = tvm.cuda(index) if kind == "cuda" else tvm.cpu(0)
        if not self.device.exist:
            raise DeviceError(f"device {device!r} is not available on this machine; expected a visible GPU")
        tactics = runtime_tactics.load_tactics(self.path, manifest)  # before the model: it calls their functions
        try:
            lib = tvm.runtime.load_module(str(self.path / manifest["library"]))
        except Exception as e:
            raise ArtifactError(
                f"library {manifest['library']!r} of artifact {str(self.path)!r} cannot be loaded: "
                f"{first_line(e)}"
            ) from None
        # one thread pool: the model's TVM kernels on the tactic library's OpenMP threads
        self.shared_pool = bool(tactics) and runtime_tactics.share_thread_pool(self.path / manifest["library"])
        self._lib = lib
        self._make_vm = vm_runtime.VirtualMachine
        self._threads = threading.local()  # each thread's VirtualMachine (a VM is not thread-safe)
        self._vm()  # this thread's, now: a library that cannot start fails at load
        self._params = self._load_params(tvm)  # one copy, shared by every thread's VM (read only)
        self._tvm = tvm

    def _vm(self):
        """This thread's VirtualMachine of the artifact's library (made on its first run)."""
        vm = getattr(self._threads, "vm", None)
        if vm is None:
            vm = self._threads.vm = self._make_vm(self._lib, self.device)
        return vm

    def _main(self):
        """This thread's VirtualMachine's ``main`` (looked up once: each lookup makes a new function)."""
        main = getattr(self._threads, "main", None)
        if main is None:
            main = self._threads.main = self._vm()["main"]
        return main

    def _load_params(self, tvm) -> list[Any]:
        spec = self.manifest.get("params") or {}
        order = spec.get("order", [])
        if not order:
            return []
        arrays = read_weights(self.path, spec["file"], order)
        arrays.reverse()
        tensors = []
        while arrays:  # each array freed once its tensor is made: the weights are held about once, even while loading
            tensors.append(tvm.runtime.tensor(arrays.pop(), self.device))
        return tensors

    # ------------------------------------------------------------------ inference
    def _input_tensors(self) -> list[tuple[Any, Optional[np.ndarray]]]:
        """This thread's input tensors, each with a writable NumPy view of its bytes (None off
        the host): made on its first run, then refilled by every run, so an inference allocates
        no input memory (a fresh tensor per run cost a MobileNetV3-small inference about 0.1 ms
        of allocation, page faults and unmapping)."""
        slots = getattr(self._threads, "inputs", None)
        if slots is None:
            tvm = self._tvm
            tensors = [tvm.runtime.empty(i["shape"], i["dtype"], self.device) for i in self.inputs]
            slots = self._threads.inputs = [(t, _host_view(t)) for t in tensors]
        return slots

    def _arguments(self, inputs: Inputs) -> list[Any]:
        """The arguments of ``main`` for ``inputs`` (checked against the manifest): an array
        that the host's kernels can read where it lies (:func:`wrap_in_place`) is passed as it
        is; any other is copied into this thread's input tensor. Valid until this thread's next
        call. No kernel writes into an input: the in-place calls write only into buffers that
        a call of the same function made (``residuals_in_place``, ``InPlaceConcat``)."""
        values = check_inputs(self.inputs, inputs)
        slots = self._input_tensors()
        args = []
        for (tensor, view), value in zip(slots, values):
            if view is not None:
                wrapped = wrap_in_place(self._tvm, value)
                if wrapped is not None:
                    args.append(wrapped)
                    continue
                np.copyto(view, value, casting="no")
            else:
                tensor.copyfrom(contiguous(value))
            args.append(tensor)
        return args + self._params

    def run(self, inputs: Inputs) -> dict[str, np.ndarray]:
        """Run one inference; returns ``{output name: array}``. Safe to call from several
        threads at once, as onnxruntime's ``InferenceSession.run``: each thread runs its own
        VirtualMachine over the one copy of the weights. An input array that is C-contiguous,
        writable and 64-byte aligned (:func:`aligned` makes one) is read where it lies, as
        onnxruntime reads its inputs; any other is copied first. Nothing writes into it."""
        args = self._arguments(inputs)  # inputs checked against the manifest here
        try:
            result = self._main()(*args)
        except (ValueError, TypeError) as e:
            if PACKED_ELSEWHERE in str(e):  # a tactic library's call: weights packed for another CPU's layout
                raise ArtifactError(f"artifact {str(self.path)!r} cannot run on this CPU: {first_line(e, limit=500)}") from None
            # The inputs fit the manifest, so the library refused the weights (or the manifest):
            # the artifact's files do not belong together.
            raise ArtifactError(
                f"the library of artifact {str(self.path)!r} rejects its arguments ({first_line(e)}); "
                "its weights file or manifest does not match the library - re-run `compile`"
            ) from None
        values = list(result) if not hasattr(result, "numpy") else [result]
        names = [o["name"] for o in self.outputs]
        if len(values) != len(names):
            raise ArtifactError(f"the library returned {len(values)} outputs; the manifest lists {len(names)}")
        return {n: _to_numpy(v) for n, v in zip(names, values)}

    def benchmark(self, inputs: Inputs, *, number: int = 1, repeat: int = 10, min_repeat_ms: int = 0) -> dict[str, float]:
        """Latency of ``main`` with TVM's time_evaluator: median, min, max in milliseconds."""
        timer = self._vm().time_evaluator("main", self.device, number=number, repeat=repeat, min_repeat_ms=min_repeat_ms)
        res = timer(*self._arguments(inputs))
        times = [t * 1e3 for t in res.results]
        return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "repeat": len(times)}


def read_weights(path: Path, file: str, order: Sequence[str]) -> list[np.ndarray]:
    """The artifact's weights in ``order``: plain numeric arrays only, never unpickled."""
    where = f"weights file {file!r} of artifact {str(path)!r}"
    try:
        with np.load(Path(path) / file, allow_pickle=False) as data:
            if not hasattr(data, "files"):
                raise ArtifactError(f"{where} is a single array, not an .npz archive; re-run `compile`")
            missing = [n for n in order if n not in data.files]
            if missing:
                raise ArtifactError(f"{where} lacks {missing[:3]}; re-run `compile`")
            arrays = [data[n] for n in order]
    except ValueError as e:
        if "allow_pickle" in str(e):  # object arrays: loading them would unpickle
            raise ArtifactError(
                f"{where} holds pickled Python objects ({first_line(e)}); weights are plain arrays and pickles "
                "are never loaded - refusing it, re-run `compile`"
            ) from None
        raise ArtifactError(f"{where} is not a readable .npz archive ({first_line(e)}); re-run `compile`") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise ArtifactError(f"{where} is not a readable .npz archive ({first_line(e)}); re-run `compile`") from None
    for n, a in zip(order, arrays):
        if a.dtype.kind not in "biufc":
            raise ArtifactError(f"{where} holds {n!r} of dtype {a.dtype}; expected numeric weights - re-run `compile`")
    return [contiguous(a) for a in arrays]


def check_inputs(specs: Sequence[dict[str, Any]], inputs: Inputs) -> list[np.ndarray]:
    """``inputs`` (one array, a list in order, or a mapping by name) as arrays in ``specs``
    order, refused with a one-line message when a name, shape or dtype does not match."""
    names = [i["name"] for i in specs]
    if isinstance(inputs, np.ndarray):
        inputs = [inputs]
    if isinstance(inputs, Mapping):
        unknown = sorted(set(inputs) - set(names))
        if unknown:
            raise InputError(f"input {unknown[0]!r} is not an input of this model; expected {names}")
        missing = [n for n in names if n not in inputs]
        if missing:
            raise InputError(f"input {missing[0]!r} is missing; expected values for {names}")
        values = [inputs[n] for n in names]
    else:
        values = list(inputs)
        if len(values) != len(names):
            raise InputError(f"{len(values)} inputs given; expected {len(names)}: {names}")
    out = []
    for spec, value in zip(specs, values):
        value = np.asarray(value)
        if list(value.shape) != list(spec["shape"]):
            raise InputError(
                f"input {spec['name']!r} has shape {list(value.shape)}; expected {spec['shape']} - "
                "reshape it or compile with --input-shape"
            )
        if value.dtype != np.dtype(spec["dtype"]):
            raise InputError(
                f"input {spec['name']!r} has dtype {value.dtype}; expected {spec['dtype']} - "
                f"convert it with .astype('{spec['dtype']}')"
            )
        out.append(value)
    return out


ALIGNMENT = 64  # bytes: the TVM runtime's tensor alignment, which its kernels may assume


def aligned(a: np.ndarray) -> np.ndarray:
    """``a`` as a C-contiguous array whose data starts at an :data:`ALIGNMENT`-byte boundary:
    ``a`` itself where it is one, else a copy (the form :meth:`Runtime.run` reads in place)."""
    a = np.asarray(a)
    if a.flags.c_contiguous and a.ctypes.data % ALIGNMENT == 0:
        return a
    raw = np.empty(a.nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    out = raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def wrap_in_place(tvm, value: np.ndarray) -> Optional[Any]:
    """A host tensor over ``value``'s own bytes (no copy) where the TVM runtime takes them:
    C-contiguous, writable (DLPack exports no read-only array), not empty and
    :data:`ALIGNMENT`-byte aligned (see :func:`aligned`); else None, and the caller copies.
    Reading the input where it lies spares each inference a copy of it (at 224x224x3, about
    0.1 ms of a 1.5 ms MobileNetV3-small inference at 2 threads: the copy's source is cold)."""
    if not (
        type(value) is np.ndarray
        and value.size
        and value.flags.c_contiguous
        and value.flags.writeable
        and value.ctypes.data % ALIGNMENT == 0
    ):
        return None
    try:
        return tvm.runtime.from_dlpack(value)
    except (TypeError, BufferError, RuntimeError, ValueError):
        return None


def _host_view(tensor) -> Optional[np.ndarray]:
    """A writable NumPy array over ``tensor``'s bytes where they are host memory NumPy can
    view (DLPack), else None."""
    try:
        view = np.from_dlpack(tensor)
    except (TypeError, BufferError, RuntimeError, ValueError):
        return None
    return view if view.flags.writeable else None


def _to_numpy(tensor) -> np.ndarray:
    """A NumPy copy of an output tensor: through a DLPack view on the host (one C-level copy),
    else ``Tensor.numpy``. Always a copy: an output may be a weight or an input tensor that the
    next run refills."""
    try:
        return np.from_dlpack(tensor).copy()
    except (TypeError, BufferError, RuntimeError, ValueError):
        return tensor.numpy()


def contiguous(a: np.ndarray) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (np.ascontiguousarray makes them 1-d)."""
    return a if a.flags.c_contiguous else np.array(a, order="C")


def load(path: Union[str, os.PathLike], *, device: str = "cpu") -> Runtime:
    """Load the artifact directory ``path`` for ``device`` (``cpu``, ``cuda``, ``cuda:N``)."""
    return Runtime(path, device=device)
