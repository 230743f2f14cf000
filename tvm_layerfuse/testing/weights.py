"""Seeded random weights for models whose shipped weights say nothing numerically.

The ONNX model-zoo "light" networks carry constant-filled weights (``ConstantOfShape``
0.02): every output is the same, so a channel mix-up would not show. ``random_weights``
gives a model the same graph with seeded random weights: convs and fully connected layers
He-normal, BatchNorm scale and variance in [0.5, 1.5], everything else small.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..topology.materialize import materialize_constants
from ..topology.onnx_reader import read_onnx


def random_weights(model: onnx.ModelProto, *, seed: int) -> onnx.ModelProto:
    """A copy of ``model`` (weights as initializers) with seeded random float32 weights."""
    out = materialize_constants(model, read_onnx(model))
    rng = np.random.default_rng(seed)
    role: dict[str, str] = {}
    for node in out.graph.node:
        if node.op_type == "BatchNormalization":
            for tag, name in zip(("scale", "bias", "mean", "var"), node.input[1:5]):
                role[name] = tag
        elif node.op_type in ("Conv", "Gemm", "MatMul") and len(node.input) > 1:
            role[node.input[1]] = "weight"
    inits = []
    for t in out.graph.initializer:
        v = onnx.numpy_helper.to_array(t)
        if v.dtype != np.float32:
            inits.append(t)
            continue
        tag = role.get(t.name, "other")
        if tag == "weight":
            fan_in = int(np.prod(v.shape[1:])) if v.ndim > 1 else v.shape[0]
            new = rng.standard_normal(v.shape) * np.sqrt(2.0 / max(fan_in, 1))  # He-normal
        elif tag in ("scale", "var"):
            new = rng.uniform(0.5, 1.5, v.shape)
        else:
            new = rng.standard_normal(v.shape) * 0.1
        inits.append(onnx.numpy_helper.from_array(new.astype(np.float32), t.name))
    del out.graph.initializer[:]
    out.graph.initializer.extend(inits)
    return out
