"""The former home of the VTA target, kept importable: ``tvm_layerfuse.vta.X`` is the module
``X`` of :mod:`tvm_layerfuse.runtime.vta` (ISA, encoding, configuration, layout, simulator,
device interface, runtime, host reference, board server) or of :mod:`tvm_layerfuse.compile.vta`
(graph, quantize, codegen, executor, host library, pipeline) - the same module object, not a
copy. New code imports the new homes."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

HOMES = {
    **{m: f"tvm_layerfuse.runtime.vta.{m}" for m in
       ("runtime", "rpc_server", "sim", "isa", "encoding", "config", "layout", "host", "numerics", "loader")},
    **{m: f"tvm_layerfuse.compile.vta.{m}" for m in ("graph", "quantize", "codegen", "executor", "host_library", "pipeline")},
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``tvm_layerfuse.vta.X`` and loads it as its new home's module object."""

    def find_spec(self, fullname, path=None, target=None):
        pkg, _, name = fullname.rpartition(".")
        if pkg == __name__ and name in HOMES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(HOMES[spec.name.rpartition(".")[2]])

    def exec_module(self, module) -> None:
        pass


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())


def __getattr__(name: str):
    if name in HOMES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
