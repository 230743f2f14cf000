"""Element-wise template: a residual Add/Sum (or Mul) moves into a Conv's epilogue.

For ``z = Add(Conv(x), r)`` (Sum of two inputs alike, Mul likewise), where the conv's
output has no other reader::

    z = act(Conv(x) + r)        one kernel; r becomes an extra input of the fused layer

``act`` is an activation (one node: Relu, Clip, LeakyRelu, HardSwish, HardSigmoid,
Sigmoid, PRelu, Gelu) that reads only ``z``; it joins the epilogue too. ``r`` must
broadcast to the conv's output shape without enlarging it, except for a gate.

The squeeze-and-excitation *gate* multiplies a feature map ``y: [N, C, H, W]`` by a
per-channel vector the conv computed (``[N, C, 1, 1]``, its activation already applied)::

    z = Mul(act(Conv(s)), y)  ->  z = act(Conv(s) + b) * y      one kernel; y is the extra input

The conv's result is broadcast over H×W inside the kernel, so the gate vector is never
written to memory. A Mul after a conv whose epilogue already ends in an activation is a
gate too (same shapes, e.g. at 1×1 spatial size). An Add of the same shape after an activated
conv is a *post-activation add* (YOLO's bottleneck ``x + cv2(cv1(x))`` with SiLU convs)::

    z = Add(act(Conv(x)), r)  ->  z = act(Conv(x) + b) + r      one kernel; r is the extra input When
``r`` has no reader after the fused layer (and is neither a graph input nor output), the
result may overwrite ``r``'s buffer in place; the plan records whether that is allowed.
When both operands are produced by such convs, the later one (in graph order) absorbs the
op, so the other operand is already computed when the fused kernel runs. A fused conv
takes one extra input: a conv that already merged an element-wise op (e.g. the gate of a
residual squeeze-and-excitation ``x + x * gate``) absorbs no second one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

from ..topology.graph import Layer, TopologyGraph
from .base import Match, Template, members_of
from .ops import SINGLE_ACTIVATIONS, activation_of, epilogue_entry, is_conv

ELTWISE_OPS = ("Add", "Sum", "Mul")


class EltwiseEpilogue(Template):
    name = "eltwise.conv_epilogue"
    kind = "eltwise"
    description = "Add/Sum/Mul of a Conv output and another tensor -> the Conv's epilogue"

    def pattern(self, graph: TopologyGraph) -> Iterator[Match]:
        for layer in graph:
            if layer.op_type not in ELTWISE_OPS or layer.domain:
                continue
            data = graph.data_inputs(layer)
            if len(data) < 2:
                continue  # an op with a constant operand is a vertical (per-channel) matter
            producers = [graph.producer(t) for t in data]
            if not any(p is not None and is_conv(p) for p in producers):
                continue
            yield Match(self.name, [layer.name], info={"operands": data})

    def check(self, graph: TopologyGraph, match: Match) -> Optional[str]:
        op = graph.layer(match.layers[0])
        operands = match.info["operands"]
        if len(op.inputs) != 2 or len(operands) != 2:
            return f"{op.op_type} {op.name!r} has {len(op.inputs)} inputs; the epilogue takes exactly one extra input"
        choice = self._choose(graph, op)
        if isinstance(choice, str):
            return choice
        return None

    def _choose(self, graph: TopologyGraph, op: Layer):
        """The (conv, other operand) pair to fuse, or the reason none fits."""
        reasons = []
        order = graph.order()
        options = []
        for k, t in enumerate(op.inputs):
            other = op.inputs[1 - k]
            conv = graph.producer(t)
            if conv is None or not is_conv(conv):
                reasons.append(f"{t!r} is not produced by a conv")
                continue
            if len(conv.outputs) != 1:
                reasons.append(f"{t!r} comes from the horizontally merged conv {conv.name!r}")
                continue
            if conv.fused.extra_input is not None:
                reasons.append(
                    f"conv {conv.name!r} already merges an element-wise op with extra input "
                    f"{conv.fused.extra_input!r}; a fused conv takes one extra input"
                )
                continue
            if graph.readers(t) != 1:
                reasons.append(f"{t!r} (from conv {conv.name!r}) has {graph.readers(t)} readers")
                continue
            if other == t:
                reasons.append(f"{op.name!r} reads {t!r} twice")
                continue
            out_shape = graph.tensor(op.outputs[0]).shape
            activated = _has_activation(conv)
            if op.op_type == "Mul" and (activated or is_gate(graph, t, other, out_shape)):
                if activated and not (graph.tensor(t).shape == out_shape or is_gate(graph, t, other, out_shape)):
                    reasons.append(f"the other operand {other!r} broadcasts the result beyond the conv output")
                    continue
                options.append((order[conv.name], conv, other))
                continue
            if activated and (op.op_type != "Add" or graph.tensor(t).shape != out_shape):
                reasons.append(
                    f"conv {conv.name!r} already ends in an activation; only a multiply (a gate) or an add of "
                    "the same shape follows it in the epilogue"
                )
                continue
            if out_shape is None or graph.tensor(t).shape != out_shape:
                reasons.append(
                    f"the other operand {other!r} broadcasts the result beyond the conv output "
                    f"{list(graph.tensor(t).shape or [])}"
                )
                continue
            options.append((order[conv.name], conv, other))
        if not options:
            return f"no operand of {op.op_type} {op.name!r} can absorb it: " + "; ".join(reasons)
        _, conv, other = max(options, key=lambda o: o[0])
        return conv, other

    def merge(self, graph: TopologyGraph, match: Match) -> tuple[Layer, dict[str, Any]]:
        op = graph.layer(match.layers[0])
        conv, other = self._choose(graph, op)
        absorbed = [conv.name, op.name]
        epilogue = list(conv.fused.epilogue)
        conv_out = next(t for t in op.inputs if t != other)
        gate = op.op_type == "Mul" and (
            _has_activation(conv) or is_gate(graph, conv_out, other, graph.tensor(op.outputs[0]).shape)
        )
        post_add = op.op_type == "Add" and _has_activation(conv)
        role = "gate" if gate else "post_add" if post_add else "residual" if op.op_type != "Mul" else "multiply"
        epilogue.append(epilogue_entry(op, role, extra_input=other))
        out = op.outputs[0]
        nxt = graph.sole_consumer(out)
        activation = None
        if nxt is not None and nxt.op_type in SINGLE_ACTIVATIONS and not gate and not post_add:
            act = activation_of(graph, nxt, out)
            if act is not None:
                params = {k: v for k, v in act.items() if k not in ("op", "layers")}
                epilogue.append(epilogue_entry(nxt, "activation", params=params))
                absorbed.append(nxt.name)
                out = nxt.outputs[0]
                activation = nxt.op_type
        overwrite = self._may_overwrite(graph, other, fused=absorbed, op=op.name)
        fused = dataclasses.replace(
            conv.fused, epilogue=tuple(epilogue), extra_input=other, overwrite_extra_input=overwrite
        )
        layer = Layer(
            name=conv.name,
            op_type=conv.op_type,
            inputs=list(conv.inputs) + [other],
            outputs=[out],
            attrs=dict(conv.attrs),
            members=members_of(graph, absorbed),
            template=f"{conv.template}+{self.name}" if conv.template else self.name,
            fused=fused,
        )
        graph.replace(absorbed, [layer])
        details = {
            "conv": conv.name,
            "op": "gate" if gate else "post_add" if post_add else op.op_type,
            "extra_input": other,
            "activation": activation,
            "overwrite_extra_input": overwrite,
        }
        return layer, details

    @staticmethod
    def _may_overwrite(graph: TopologyGraph, tensor: str, *, fused: list[str], op: str) -> bool:
        """Whether the fused layer may write its result over ``tensor``.

        Only when the element-wise op is the sole reader of ``tensor`` inside the fused
        layer (a conv reading it too would read pixels already overwritten), every other
        reader runs before the fused layer, and the tensor is neither a graph input nor
        output, and no Concat reads it (it may be placed in the Concat's block, which an
        overwrite would corrupt; concat.py also refuses such an input).
        """
        t = graph.tensor(tensor)
        if t.is_input or t.is_output or t.constant:
            return False
        if any(tensor in graph.layer(n).inputs for n in fused if n != op):
            return False
        if any(c.op_type == "Concat" for c in graph.consumers(tensor)):
            return False  # it may live inside a concat block: keep the copy-free concat instead
        order = graph.order()
        position = min(order[n] for n in fused)
        others = [c for c in t.consumers if c not in fused]
        return all(order[c] < position for c in others)


def _has_activation(conv: Layer) -> bool:
    return any(e.role == "activation" for e in conv.fused.epilogue)


def is_gate(graph: TopologyGraph, conv_out: str, other: str, out_shape) -> bool:
    """Whether ``Mul(conv_out, other)`` gates ``other`` per channel: the conv output is
    ``[N, C, 1, 1]`` (spatial dims all 1) and ``other`` is ``[N, C, ...]``, the result's shape."""
    a, b = graph.tensor(conv_out).shape, graph.tensor(other).shape
    if a is None or b is None or out_shape is None or len(a) != len(b) or len(a) < 3:
        return False
    if tuple(b) != tuple(out_shape) or tuple(a) == tuple(b):
        return False
    return a[:2] == b[:2] and all(d == 1 for d in a[2:])
