"""tvm_layerfuse: layer fusion for convolutional networks on Apache TVM.

Read an ONNX model into a topology graph, find layers to merge with fusion templates
(vertical chains, horizontal parallel convs, in-place concats, element-wise epilogues),
plan the merges, and compile the result with TVM.
"""

import logging

from .errors import LayerfuseError
from .topology import Layer, Tensor, TopologyGraph, read_onnx

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["LayerfuseError", "Layer", "Tensor", "TopologyGraph", "read_onnx", "__version__"]
