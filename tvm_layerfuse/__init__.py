"""tvm_layerfuse: layer fusion for convolutional networks on Apache TVM.

Read an ONNX model into a topology graph, find layers to merge with fusion templates
(vertical chains, horizontal parallel convs, in-place concats, element-wise epilogues),
plan the merges, and compile the result with TVM.

Importing the package is cheap and needs neither onnx nor TVM's compiler: the runtime
side (``tvm_layerfuse.runtime``) runs where only the TVM runtime is installed. The other
names below load on first use.
"""

import logging

from .errors import LayerfuseError

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

_LAZY = {
    "read_onnx": ("tvm_layerfuse.topology", "read_onnx"),
    "TopologyGraph": ("tvm_layerfuse.topology", "TopologyGraph"),
    "Layer": ("tvm_layerfuse.topology", "Layer"),
    "Tensor": ("tvm_layerfuse.topology", "Tensor"),
    "plan": ("tvm_layerfuse.planner", "plan"),
    "FusionPlan": ("tvm_layerfuse.planner", "FusionPlan"),
    "fuse": ("tvm_layerfuse.relax.pipeline", "fuse"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'tvm_layerfuse' has no attribute {name!r}")


__all__ = ["LayerfuseError", "__version__", *_LAZY]
