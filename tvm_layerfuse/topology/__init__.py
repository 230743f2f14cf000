"""Topology graphs: the layers of a CNN and the tensors that connect them."""

from .graph import Dim, Layer, Tensor, TopologyGraph
from .onnx_reader import load_model, read_onnx

__all__ = ["Dim", "Layer", "Tensor", "TopologyGraph", "load_model", "read_onnx"]
