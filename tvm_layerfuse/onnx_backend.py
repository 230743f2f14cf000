"""The ONNX backend API: ``prepare`` = plan + fuse + compile, ``run`` = the runtime.

::

    from tvm_layerfuse.onnx_backend import LayerfuseBackend
    rep = LayerfuseBackend.prepare(model)          # an onnx.ModelProto
    outputs = rep.run([x])                         # tuple of arrays, in graph output order

so ``onnx.backend.test.BackendTest(LayerfuseBackend, __name__)`` runs ONNX's own
conformance cases through the whole pipeline (compile to an artifact in a temporary
directory, load it with the runtime, run). ``prepare(model, fuse=False)`` builds with TVM's
default pipeline instead.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep


class LayerfuseRep(BackendRep):
    """A compiled model ready to run (its artifact lives in a temporary directory)."""

    def __init__(self, runtime, workdir: Path) -> None:
        self.runtime = runtime
        self._workdir = workdir

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, Mapping):
            feeds = dict(inputs)
        else:
            values = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            feeds = {spec["name"]: np.asarray(v) for spec, v in zip(self.runtime.inputs, values)}
        outputs = self.runtime.run(feeds)
        return tuple(outputs[o["name"]] for o in self.runtime.outputs)

    def __del__(self) -> None:
        shutil.rmtree(self._workdir, ignore_errors=True)


class LayerfuseBackend(Backend):
    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> LayerfuseRep:
        super().prepare(model, device, **kwargs)
        from .compile.build import compile_model
        from .runtime import load

        target = "cuda" if device.upper().startswith("CUDA") else "cpu"
        workdir = Path(tempfile.mkdtemp(prefix="layerfuse-backend-"))
        try:
            out = compile_model(
                model,
                workdir / "artifact",
                target=target,
                arch=kwargs.get("arch"),
                fuse=kwargs.get("fuse", True),
                input_shapes=kwargs.get("input_shapes"),
                progress=False,
            )
            return LayerfuseRep(load(out, device=target), workdir)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        if device.upper() == "CPU":
            return True
        if device.upper().startswith("CUDA"):
            try:
                import tvm

                return bool(tvm.cuda(0).exist)
            except Exception:
                return False
        return False


prepare = LayerfuseBackend.prepare
run_model = LayerfuseBackend.run_model
supports_device = LayerfuseBackend.supports_device
