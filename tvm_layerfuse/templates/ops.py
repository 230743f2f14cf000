"""Facts about single ops that several templates share.

* :func:`conv_params` - a Conv's attributes with ONNX defaults filled in, so that
  ``pads`` missing and ``pads=[0, 0, 0, 0]`` compare equal.
* :func:`affine_reason` - whether a layer is a per-channel affine op on a conv output
  (bias Add, BatchNormalization, Mul/Add/Sub/Div by a per-channel constant); these fold
  into the conv's weights and bias.
* :func:`activation_of` - whether a layer is an activation a conv epilogue can apply
  (Relu, Clip, LeakyRelu, HardSwish, HardSigmoid, Sigmoid, PRelu with a constant slope,
  Gelu, and Sigmoid·Mul, i.e. SiLU);
* :func:`decomposed_activation` - an activation written out in several ops, read from the
  two readers of its input::

      SiLU       x * Sigmoid(x)
      HardSwish  x * HardSigmoid(x)            (alpha 1/6, beta 1/2: torch at opset < 14)
      HardSwish  x * Clip(x + 3, 0, 6) / 6     (tf2onnx, Paddle; also x * (Clip(x + 3, 0, 6) / 6))
      Gelu       x * 0.5 * (1 + Erf(x / sqrt(2)))   (torch's exact GELU before opset 20; any order
                                                  of the two outer multiplications)
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from ..topology.facts import EpilogueOp
from ..topology.graph import Layer, TopologyGraph

CONV_OPS = ("Conv",)
AFFINE_BINARY = ("Add", "Sub", "Mul", "Div")
SIMPLE_ACTIVATIONS = ("Relu", "Clip", "LeakyRelu")
# Activations that are one ONNX node reading only the conv output (PRelu also reads its slope).
SINGLE_ACTIVATIONS = SIMPLE_ACTIVATIONS + ("HardSwish", "HardSigmoid", "Sigmoid", "PRelu", "Gelu")
# Tolerance when a decomposed activation's constants are compared with the textbook ones.
_CONST_TOL = 1e-6


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
            if graph.readers(data) == 1:
                return {"op": "Sigmoid", "layers": [layer.name]}
            return None
        readers = {c.name for c in graph.consumers(data)}
        if readers != {layer.name, mul.name} or graph.tensor(data).is_output:
            return None
        return {"op": "SiLU", "layers": [layer.name, mul.name]}
    if layer.op_type == "HardSwish":
        return {"op": "HardSwish", "layers": [layer.name]}
    if layer.op_type == "HardSigmoid":
        return {
            "op": "HardSigmoid",
            "alpha": float(layer.attrs.get("alpha", 0.2)),
            "beta": float(layer.attrs.get("beta", 0.5)),
            "layers": [layer.name],
        }
    if layer.op_type == "Gelu":
        return {"op": "Gelu", "approximate": str(layer.attrs.get("approximate", "none")), "layers": [layer.name]}
    if layer.op_type == "PRelu":
        slope = layer.inputs[1] if len(layer.inputs) > 1 else ""
        if not slope or not graph.is_constant(slope) or per_channel_reason(graph, slope, data) is not None:
            return None  # a run-time or non-per-channel slope: not an epilogue
        return {"op": "PRelu", "slope": slope, "layers": [layer.name]}
    return None


def decomposed_activation(graph: TopologyGraph, data: str) -> Optional[dict[str, Any]]:
    """An activation of ``data`` written out in several ops (see the module doc), whose layers
    are the only readers of ``data`` and of every value between them; None otherwise.
    Returns ``{"op", "layers": [...in graph order], "output": tensor}``."""
    consumers = graph.consumers(data)
    if len(consumers) != 2 or graph.tensor(data).is_output:
        return None
    found = None
    for first in consumers:
        other = next(c for c in consumers if c is not first)
        for matcher in (_silu_or_hardswish_mul, _hardswish_clip_div, _gelu_erf):
            found = matcher(graph, data, first, other)
            if found is not None:
                break
        if found is not None:
            break
    if found is None:
        return None
    op, layers = found
    names = {l.name for l in layers}
    order = graph.order()
    layers = sorted(layers, key=lambda l: order[l.name])
    for l in layers[:-1]:  # every value between them stays inside
        for out in l.outputs:
            if graph.tensor(out).is_output or any(c.name not in names for c in graph.consumers(out)):
                return None
    return {"op": op, "layers": [l.name for l in layers], "output": layers[-1].outputs[0]}


def _const(graph: TopologyGraph, name: str) -> Optional[float]:
    if not name or not graph.is_constant(name):
        return None
    v = graph.tensor(name).value()
    return float(v.reshape(-1)[0]) if v.size == 1 else None


def _is(value: Optional[float], want: float) -> bool:
    return value is not None and abs(value - want) <= _CONST_TOL * max(1.0, abs(want))


def _other_input(layer: Layer, known: str) -> Optional[str]:
    if len(layer.inputs) != 2 or known not in layer.inputs:
        return None
    a, b = layer.inputs
    return b if a == known else a


def _sole(graph: TopologyGraph, tensor: str, op: str) -> Optional[Layer]:
    nxt = graph.sole_consumer(tensor)
    return nxt if nxt is not None and nxt.op_type == op and not nxt.domain else None


def _silu_or_hardswish_mul(graph, data, first, mul):
    """``Mul(x, Sigmoid(x))`` (SiLU) or ``Mul(x, HardSigmoid(x))`` with alpha 1/6, beta 1/2."""
    if mul.op_type != "Mul" or first.op_type not in ("Sigmoid", "HardSigmoid") or first.inputs[:1] != [data]:
        return None
    if sorted(mul.inputs) != sorted([data, first.outputs[0]]):
        return None
    if first.op_type == "Sigmoid":
        return "SiLU", [first, mul]
    if _is(float(first.attrs.get("alpha", 0.2)), 1 / 6) and _is(float(first.attrs.get("beta", 0.5)), 0.5):
        return "HardSwish", [first, mul]
    return None


def _hardswish_clip_div(graph, data, add, mul):
    """``Div(Mul(x, Clip(Add(x, 3), 0, 6)), 6)`` or ``Mul(x, Div(Clip(Add(x, 3), 0, 6), 6))``."""
    if add.op_type != "Add" or mul.op_type != "Mul" or not _is(_const(graph, _other_input(add, data) or ""), 3.0):
        return None
    clip = _sole(graph, add.outputs[0], "Clip")
    if clip is None or clip.inputs[0] != add.outputs[0]:
        return None
    act = activation_of(graph, clip, add.outputs[0])
    if act is None or not _is(act.get("min"), 0.0) or not _is(act.get("max"), 6.0):
        return None
    if sorted(mul.inputs) == sorted([data, clip.outputs[0]]):  # x * clip, then / 6
        div = _sole(graph, mul.outputs[0], "Div")
        if div is None or div.inputs[0] != mul.outputs[0] or not _is(_const(graph, div.inputs[1]), 6.0):
            return None
        return "HardSwish", [add, clip, mul, div]
    div = _sole(graph, clip.outputs[0], "Div")  # x * (clip / 6)
    if div is None or div.inputs[0] != clip.outputs[0] or not _is(_const(graph, div.inputs[1]), 6.0):
        return None
    if sorted(mul.inputs) != sorted([data, div.outputs[0]]):
        return None
    return "HardSwish", [add, clip, div, mul]


def _gelu_erf(graph, data, div, mul):
    """``x * 0.5 * (1 + Erf(x / sqrt(2)))``: Div(x, √2) -> Erf -> Add(1) -> Mul(x, ·) and
    Mul(·, 0.5) before or after."""
    if div.op_type != "Div" or mul.op_type != "Mul" or div.inputs[0] != data:
        return None
    if not _is(_const(graph, div.inputs[1]), 2**0.5):
        return None
    erf = _sole(graph, div.outputs[0], "Erf")
    add = _sole(graph, erf.outputs[0], "Add") if erf is not None else None
    if add is None or not _is(_const(graph, _other_input(add, erf.outputs[0]) or ""), 1.0):
        return None
    if sorted(mul.inputs) == sorted([data, add.outputs[0]]):  # (x * (1 + erf)) * 0.5
        half = _sole(graph, mul.outputs[0], "Mul")
        if half is None or not _is(_const(graph, _other_input(half, mul.outputs[0]) or ""), 0.5):
            return None
        return "Gelu", [div, erf, add, mul, half]
    # (x * 0.5) * (1 + erf): mul is Mul(x, 0.5), then Mul(·, add)
    if not _is(_const(graph, _other_input(mul, data) or ""), 0.5):
        return None
    last = _sole(graph, mul.outputs[0], "Mul")
    if last is None or sorted(last.inputs) != sorted([mul.outputs[0], add.outputs[0]]):
        return None
    return "Gelu", [div, erf, add, mul, last]


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
