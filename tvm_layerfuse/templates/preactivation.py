"""Vertical template: BatchNormalization -> [per-channel Mul/Add] -> activation -> Conv.

The pre-activation form of DenseNet and ResNet-v2. The normalisation cannot fold into
the conv's weights (the activation sits between), so it becomes the conv's *prologue*:
the kernel reads ``x`` and computes on the fly::

    Conv(act(s[c] * x + t[c]))     s = gamma / sqrt(var + eps) (times any Mul), t likewise

which saves writing and re-reading the normalised tensor. Links are single-consumer; the
BatchNormalization's own input may have other readers (in DenseNet it is a Concat output
that the next Concat also reads).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

from ..topology.graph import Layer, TopologyGraph
from .base import Match, Template, members_of
from .ops import affine_reason, epilogue_entry, is_conv
from .vertical import walk_epilogue


class PreActivation(Template):
    name = "vertical.preactivation"
    kind = "vertical"
    description = "BatchNormalization -> [per-channel Mul/Add] -> activation feeding a Conv"

    def pattern(self, graph: TopologyGraph) -> Iterator[Match]:
        for layer in graph:
            if layer.op_type != "BatchNormalization" or layer.is_fused or layer.domain:
                continue
            walk = walk_epilogue(graph, layer)
            acts = [e for e in walk["epilogue"] if e.role == "activation"]
            conv = None
            consumers = graph.consumers(walk["output"]) if acts else []
            if acts and consumers and all(is_conv(c) for c in consumers):
                conv = consumers[0]
            if conv is None:
                continue  # the chain does not end in an activation feeding a conv
            info = dict(walk, conv=conv.name, bn_reason=affine_reason(graph, layer, layer.inputs[0]))
            yield Match(self.name, [layer.name] + walk["layers"] + [conv.name], info=info)

    def check(self, graph: TopologyGraph, match: Match) -> Optional[str]:
        if match.info["bn_reason"]:
            return match.info["bn_reason"]
        out = match.info["output"]
        if graph.readers(out) != 1:
            who = ", ".join(c.name for c in graph.consumers(out))
            return f"activation output {out!r} feeds {graph.readers(out)} readers [{who}]; a prologue needs one conv"
        conv = graph.layer(match.info["conv"])
        if conv.inputs[0] != out:
            return f"{out!r} is not the data input of conv {conv.name!r}"
        if conv.fused.prologue:
            return f"conv {conv.name!r} already has a prologue"
        return None

    def merge(self, graph: TopologyGraph, match: Match) -> tuple[Layer, dict[str, Any]]:
        bn = graph.layer(match.layers[0])
        conv = graph.layer(match.info["conv"])
        after_bn = [dataclasses.replace(e, folded=False) for e in match.info["epilogue"]]
        prologue = (epilogue_entry(bn, "batchnorm"), *after_bn)
        fused = dataclasses.replace(conv.fused, prologue=prologue)
        inputs = [bn.inputs[0]] + conv.inputs[1:]
        for n in match.layers[:-1]:
            for i in graph.const_inputs(graph.layer(n)):
                if i not in inputs:
                    inputs.append(i)
        layer = Layer(
            name=conv.name,
            op_type=conv.op_type,
            inputs=inputs,
            outputs=list(conv.outputs),
            attrs=dict(conv.attrs),
            members=members_of(graph, match.layers),
            template=self.name if not conv.template else f"{conv.template}+{self.name}",
            fused=fused,
        )
        graph.replace(match.layers, [layer])
        return layer, {"prologue": [e.op for e in prologue], "conv": conv.name}
