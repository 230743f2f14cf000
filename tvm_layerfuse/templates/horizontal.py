"""Horizontal template: parallel Convs that read one tensor merge into one wider Conv.

Algebra, for branches ``i = 1..n`` reading the same ``x: [N, C_in, H, W]`` with the same
kernel size, stride, padding, dilation and ``group = 1``::

    W  = concat(W_1, ..., W_n, axis=0)        # [sum C_i, C_in, kh, kw]
    b  = concat(b_1, ..., b_n)                # [sum C_i]   (zeros for a branch without bias)
    y  = act(Conv(x, W) + b)                  # [N, sum C_i, H', W']
    y_i = y[:, o_i : o_i + C_i]               # o_i = C_1 + ... + C_{i-1}

Each ``y_i`` is written straight into branch ``i``'s own output storage (the split costs
nothing). The branches must apply the same activation (folded BatchNorm and per-channel
affine ops are already in ``W_i``, ``b_i`` after the vertical phase), and their outputs
must reach a common layer (typically the Concat of an Inception block).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

from ..topology.facts import EpilogueOp, LayerFacts, SplitPart
from ..topology.graph import Layer, TopologyGraph
from .base import Match, Template, members_of
from .ops import conv_params, is_conv

_PARAMS = ("kernel_shape", "strides", "pads", "dilations", "group")


def _activation(layer: Layer) -> list[EpilogueOp]:
    """The non-folded part of a conv's epilogue, without layer names (comparable)."""
    return [dataclasses.replace(e, layer=None, layers=()) for e in layer.fused.epilogue if not e.folded]


def _describe(layer: Layer) -> str:
    """``Relu``, ``Clip(0.0, 6.0)``, ``LeakyRelu(alpha=0.1)``, or ``no activation``."""
    parts = []
    for e in _activation(layer):
        if e.op == "Clip":
            parts.append(f"Clip({e.params.get('min')}, {e.params.get('max')})")
        elif e.params:
            parts.append(e.op + "(" + ", ".join(f"{k}={v}" for k, v in e.params.items()) + ")")
        else:
            parts.append(e.op)
    return "+".join(parts) or "no activation"


def _key(graph: TopologyGraph, layer: Layer) -> tuple:
    p = conv_params(graph, layer)
    return (
        tuple(repr(p[k]) for k in _PARAMS),
        repr(_activation(layer)),
        bool(layer.fused.prologue),
        len(layer.outputs),
        graph.tensor(layer.outputs[0]).dtype,
    )


class HorizontalConv(Template):
    name = "horizontal.parallel_conv"
    kind = "horizontal"
    description = "≥2 Convs reading one tensor with equal kernel/stride/pad/dilation/group -> one Conv + split"

    def pattern(self, graph: TopologyGraph) -> Iterator[Match]:
        for tensor in _shared_tensors(graph):
            convs = [c for c in graph.consumers(tensor) if is_conv(c) and c.inputs[0] == tensor]
            if len(convs) < 2:
                continue
            groups: dict[tuple, list[str]] = {}
            for c in convs:
                groups.setdefault(_key(graph, c), []).append(c.name)
            mergeable = [g for g in groups.values() if len(g) >= 2]
            for g in mergeable:
                yield Match(self.name, g, info={"tensor": tensor})
            singles = [g[0] for g in groups.values() if len(g) == 1]
            if not mergeable:
                # Nothing merges here: one candidate with every conv, refused with the first difference.
                yield Match(self.name, singles, info={"tensor": tensor, "probe": True})
                continue
            for single in singles:
                yield Match(self.name, [mergeable[0][0], single], info={"tensor": tensor, "probe": True})

    def check(self, graph: TopologyGraph, match: Match) -> Optional[str]:
        layers = [graph.layer(n) for n in match.layers]
        first = layers[0]
        p0 = conv_params(graph, first)
        for other in layers[1:]:
            p = conv_params(graph, other)
            for k in _PARAMS:
                if p[k] != p0[k]:
                    return f"{k} differ: {first.name!r} has {p0[k]}, {other.name!r} has {p[k]}"
        if p0["group"] != 1:
            return f"grouped convolutions (group={p0['group']}) cannot be concatenated along output channels"
        for layer in layers:
            if len(layer.outputs) != 1:
                return f"conv {layer.name!r} is already a horizontal merge"
            if layer.fused.prologue:
                return f"conv {layer.name!r} has a pre-activation prologue"
            runtime = [i for i in layer.inputs[1:3] if i and not graph.is_constant(i)]
            if runtime:
                return f"conv {layer.name!r} reads its weights {runtime[0]!r} at run time; merging needs constants"
            if graph.tensor(layer.inputs[1]).dtype != graph.tensor(first.inputs[1]).dtype:
                return f"weights of {first.name!r} and {layer.name!r} have different dtypes"
        for other in layers[1:]:
            if _activation(other) != _activation(first):
                return (
                    f"epilogues differ: {first.name!r} ends with {_describe(first)}, "
                    f"{other.name!r} with {_describe(other)}"
                )
        if _join(graph, layers) is None:
            return "the branches' outputs never reach a common layer"
        return None

    def merge(self, graph: TopologyGraph, match: Match) -> tuple[Layer, dict[str, Any]]:
        branches = [graph.layer(n) for n in match.layers]
        join = _join(graph, branches)
        split = []
        start = 0
        inputs = [match.info["tensor"]]
        for b in branches:
            c_out = graph.tensor(b.inputs[1]).shape[0]  # W: [C_out, C_in, kh, kw]
            split.append(SplitPart(branch=b.name, output=b.outputs[0], channels=(start, start + c_out)))
            start += c_out
            inputs += [i for i in b.inputs[1:] if i and i not in inputs]
        fused = LayerFacts(
            epilogue=tuple(_activation(branches[0])),
            split=tuple(split),
            branches={b.name: b.fused for b in branches},
        )
        name = "+".join(b.name for b in branches)
        base, k = name, 2
        while name in graph:
            name, k = f"{base}#{k}", k + 1
        layer = Layer(
            name=name,
            op_type=branches[0].op_type,
            inputs=inputs,
            outputs=[b.outputs[0] for b in branches],
            attrs=dict(branches[0].attrs),
            members=members_of(graph, [b.name for b in branches]),
            template=self.name,
            fused=fused,
        )
        graph.replace([b.name for b in branches], [layer])
        details = {
            "input": match.info["tensor"],
            "out_channels": start,
            "split": [{"branch": s.branch, "channels": list(s.channels)} for s in split],
            "join": join,
        }
        return layer, details


def _shared_tensors(graph: TopologyGraph) -> list[str]:
    """Data tensors read by two or more layers, in the order they are produced."""
    names = list(graph.inputs) + [o for layer in graph for o in layer.outputs]
    return [t for t in names if len(graph.tensor(t).consumers) >= 2]


def _join(graph: TopologyGraph, branches: list[Layer]) -> Optional[str]:
    """The first layer (in graph order) that every branch reaches, if any."""
    common: Optional[set[str]] = None
    for b in branches:
        d = graph.descendants(b)
        common = d if common is None else common & d
    if not common:
        return None
    order = graph.order()
    return min(common, key=order.__getitem__)
