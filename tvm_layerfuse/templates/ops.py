"""Facts about single ops that several templates share.

* :func:`conv_params` - a Conv's attributes with ONNX defaults filled in, so that
  ``pads`` missing and ``pads=[0, 0, 0, 0]`` compare equal.
* :func:`affine_reason` - whether a layer is a per-channel affine op on a conv output
  (bias Add, BatchNormalization, Mul/Add/Sub/Div by a per-channel constant); these fold
  into the conv's weights and bias.
* :func:`activation_of` - whether a layer is an activation a conv epilogue can apply
  (Relu, Clip, LeakyRelu, and Sigmoid·Mul, i.e. SiLU).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from ..topology.facts import EpilogueOp
from ..topology.graph import Layer, TopologyGraph

CONV_OPS = ("Conv",)
AFFINE_BINARY = ("Add", "Sub", "Mul", "Div")
SIMPLE_ACTIVATIONS = ("Relu", "Clip", "LeakyRelu")


def is_conv(layer: Layer) -> bool:
    return layer.op_type in CONV_OPS and not layer.domain


def conv_params(graph: TopologyGraph, layer: Layer) -> dict[str, Any]:
    """Kernel size, stride, padding, dilation, groups, with defaults made explicit."""
    w = graph.tensor(layer.inputs[1]).shape if len(layer.inputs) > 1 and layer.inputs[1] else None
    kernel = layer.attrs.get("kernel_shape")
    if kernel is None and w is not None:
        kernel = list(w[2:])
    rank = len(kernel) if kernel is not None else 2
    auto_pad = layer.attrs.get("auto_pad", "NOTSET")
    pads = layer.attrs.get("pads", [0] * (2 * rank))
    return {
        "kernel_shape": [int(k) for k in kernel] if kernel is not None else None,
        "strides": [int(s) for s in layer.attrs.get("strides", [1] * rank)],
        "pads": [int(p) for p in pads] if auto_pad in ("NOTSET", "") else auto_pad,
        "dilations": [int(d) for d in layer.attrs.get("dilations", [1] * rank)],
        "group": int(layer.attrs.get("group", 1)),
    }


def channel_axis_len(graph: TopologyGraph, tensor: str) -> Optional[int]:
    shape = graph.tensor(tensor).shape
    if shape is None or len(shape) < 2:
        return None
    return shape[1]


def per_channel_reason(graph: TopologyGraph, const: str, data: str) -> Optional[str]:
    """Why the constant ``const`` is not a per-channel operand for NCHW tensor ``data``."""
    cshape = graph.tensor(const).shape
    dshape = graph.tensor(data).shape
    if cshape is None or dshape is None:
        return f"the shape of {const!r} or {data!r} is unknown"
    if len(cshape) > len(dshape):
        return f"constant {const!r} of shape {list(cshape)} has a higher rank than {list(dshape)}"
    # Right-align, as ONNX broadcasting does; only the channel axis (1) may be > 1.
    padded = (1,) * (len(dshape) - len(cshape)) + tuple(cshape)
    for axis, (c, d) in enumerate(zip(padded, dshape)):
        if c not in (1, None) and axis != 1:
            return f"constant {const!r} of shape {list(cshape)} varies along axis {axis}, not only per channel"
        if axis == 1 and c not in (1, d):
            return f"constant {const!r} of shape {list(cshape)} does not match {d} channels"
    return None


def affine_reason(graph: TopologyGraph, layer: Layer, data: str) -> Optional[str]:
    """Why ``layer`` (reading ``data``) is not a per-channel affine op that folds into a conv."""
    if layer.domain:
        return f"{layer.op_type} is not an ONNX op"
    if layer.op_type == "BatchNormalization":
        if len(layer.outputs) > 1 or layer.attrs.get("training_mode", 0):
            return f"BatchNormalization {layer.name!r} is in training mode"
        if layer.inputs[0] != data:
            return f"BatchNormalization {layer.name!r} does not normalise {data!r}"
        runtime = [i for i in layer.inputs[1:5] if i and not graph.is_constant(i)]
        if runtime:
            return (
                f"BatchNormalization {layer.name!r} reads {runtime[0]!r} as a run-time input; "
                "folding needs constant scale, bias, mean and variance"
            )
        return None
    if layer.op_type in AFFINE_BINARY:
        if len(layer.inputs) != 2:
            return f"{layer.op_type} {layer.name!r} does not have two inputs"
        a, b = layer.inputs
        if layer.op_type in ("Sub", "Div") and a != data:
            return f"{layer.op_type} {layer.name!r} has the conv output as its right operand"
        other = b if a == data else a
        if other == data:
            return f"{layer.op_type} {layer.name!r} reads {data!r} twice"
        if not graph.is_constant(other):
            return f"{layer.op_type} {layer.name!r} has a run-time operand {other!r}"
        return per_channel_reason(graph, other, data)
    return f"{layer.op_type} is not a per-channel affine op"


def activation_of(graph: TopologyGraph, layer: Layer, data: str) -> Optional[dict[str, Any]]:
    """Describe ``layer`` as an activation applied to ``data``, or None if it is not one.

    SiLU is the pair Sigmoid(x) -> Mul(x, sigmoid): ``layer`` is the Sigmoid and the
    returned ``layers`` holds both.
    """
    if layer.domain or data not in layer.inputs[:1]:
        return None
    if layer.op_type == "Relu":
        return {"op": "Relu", "layers": [layer.name]}
    if layer.op_type == "LeakyRelu":
        return {"op": "LeakyRelu", "alpha": float(layer.attrs.get("alpha", 0.01)), "layers": [layer.name]}
    if layer.op_type == "Clip":
        lo = layer.attrs.get("min")
        hi = layer.attrs.get("max")
        for k, name in enumerate(layer.inputs[1:3]):
            if not name:
                continue
            if not graph.is_constant(name):
                return None  # run-time bounds: not an epilogue
            v = graph.tensor(name).value()
            if k == 0:
                lo = float(v.reshape(-1)[0])
            else:
                hi = float(v.reshape(-1)[0])
        return {"op": "Clip", "min": lo, "max": hi, "layers": [layer.name]}
    if layer.op_type == "Sigmoid":
        sig_out = layer.outputs[0]
        mul = graph.sole_consumer(sig_out)
        if mul is None or mul.op_type != "Mul" or sorted(mul.inputs) != sorted([data, sig_out]):
            return None
        readers = {c.name for c in graph.consumers(data)}
        if readers != {layer.name, mul.name} or graph.tensor(data).is_output:
            return None
        return {"op": "SiLU", "layers": [layer.name, mul.name]}
    return None


def epilogue_entry(
    layer: Layer,
    role: str,
    *,
    op: Optional[str] = None,
    params: Optional[dict[str, Any]] = None,
    layers: Iterable[str] = (),
    folded: bool = False,
    extra_input: Optional[str] = None,
) -> EpilogueOp:
    """``layer`` as one op of an epilogue or prologue (``op`` overrides its op type)."""
    return EpilogueOp(
        op=op or layer.op_type,
        role=role,
        layer=layer.name,
        params=dict(params or {}),
        layers=tuple(layers),
        folded=folded,
        extra_input=extra_input,
    )
