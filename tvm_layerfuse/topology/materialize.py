"""Rewrite an ONNX model so that every constant a layer reads is a plain initializer.

The ONNX model-zoo "light" models build their weights with ``ConstantOfShape`` and torch
exports with ``Constant``/``Identity`` nodes; compilers then see computed tensors, not
weights. This step evaluates each constant chain once (the topology graph already knows
which tensors are constant) and writes the model back with:

* one initializer per constant tensor that a layer reads, under the same name;
* none of the nodes that only computed constants;
* initializers no longer listed among the graph inputs (IR >= 4 semantics: weights are
  not overridable inputs).

The result computes exactly the same function as the original.
"""

from __future__ import annotations

import onnx
from onnx import numpy_helper

from .graph import TopologyGraph


def materialize_constants(model: onnx.ModelProto, graph: TopologyGraph) -> onnx.ModelProto:
    """A copy of ``model`` whose layer-read constants are initializers (see module doc)."""
    needed: dict[str, None] = {}
    for layer in graph:
        for name in graph.const_inputs(layer):
            needed.setdefault(name, None)
    for name in graph.outputs:
        if graph.tensor(name).constant:
            needed.setdefault(name, None)
    layer_outputs = {o for layer in graph for o in layer.outputs}

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    kept_nodes = [n for n in g.node if any(o in layer_outputs for o in n.output)]
    del g.node[:]
    g.node.extend(kept_nodes)
    del g.initializer[:]
    g.initializer.extend(numpy_helper.from_array(graph.tensor(n).value(), name=n) for n in needed)
    inputs = [vi for vi in g.input if vi.name in graph.inputs]
    del g.input[:]
    g.input.extend(inputs)
    # Drop stale shape annotations of removed tensors; shape inference re-derives the rest.
    keep_vi = [vi for vi in g.value_info if vi.name in layer_outputs]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    out.ir_version = max(out.ir_version, 4)
    return out
