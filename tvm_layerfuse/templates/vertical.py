"""Vertical template: Conv -> [bias] -> [BatchNormalization] -> [per-channel Mul/Add] -> [activation].

Algebra (per output channel ``c``; ``W: [C_out, C_in/g, kh, kw]``, ``b: [C_out]``)::

    BatchNormalization ∘ Conv -> Conv     W' = W * s[c],  b' = (b - mean[c]) * s[c] + beta[c]
                                          with s = gamma / sqrt(var + eps)
    Mul(k) ∘ Conv -> Conv                 W' = W * k[c],  b' = b * k[c]
    Div(k) ∘ Conv -> Conv                 W' = W / k[c],  b' = b / k[c]
    Add(k) ∘ Conv -> Conv                 W' = W,         b' = b + k[c]
    Sub(k) ∘ Conv -> Conv                 W' = W,         b' = b - k[c]
    act ∘ Conv -> Conv with epilogue act  act in {Relu, Clip, LeakyRelu, HardSwish, HardSigmoid,
                                          Sigmoid, PRelu (constant slope), Gelu, SiLU = x * Sigmoid(x)},
                                          in op form or written out (templates/ops.py:
                                          decomposed_activation, e.g. x * Clip(x + 3, 0, 6) / 6)

Depthwise and grouped convs take part like any other Conv.

Every link of the chain must be single-input and single-consumer: the tensor between two
merged layers must have exactly one reader and must not be a graph output. The chain is
the longest valid prefix; it is refused only when not even its first link is valid.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from ..topology.facts import EpilogueOp, LayerFacts
from ..topology.graph import Layer, TopologyGraph
from .base import Match, Template, members_of
from .ops import (
    AFFINE_BINARY,
    SINGLE_ACTIVATIONS,
    activation_of,
    affine_reason,
    decomposed_activation,
    epilogue_entry,
    is_conv,
)

CHAIN_OPS = set(AFFINE_BINARY) | {"BatchNormalization"} | set(SINGLE_ACTIVATIONS)


def walk_epilogue(graph: TopologyGraph, start: Layer, *, allow_affine: bool = True) -> dict[str, Any]:
    """Follow ``start``'s output through per-channel affine ops and one activation.

    Returns ``{"layers": [...], "epilogue": [...], "stopped": reason or None, "output": tensor,
    "candidate": bool}``; ``candidate`` says whether the first layer after ``start`` is of
    a kind the template merges (so a refusal is worth reporting).
    """
    layers: list[str] = []
    epilogue: list[EpilogueOp] = []
    cur = start.outputs[0]
    stopped: Optional[str] = None
    candidate = False
    while True:
        consumers = graph.consumers(cur)
        if not consumers:
            stopped = None if graph.tensor(cur).is_output else f"{cur!r} has no reader"
            break
        kinds = {c.op_type for c in consumers}
        if not layers:
            candidate = bool(kinds & CHAIN_OPS)
        act = decomposed_activation(graph, cur) if len(consumers) == 2 else None
        if act is not None:  # written out in several ops, e.g. SiLU x * Sigmoid(x): the only readers of x
            head = graph.layer(act["layers"][0])
            layers += act["layers"]
            epilogue.append(epilogue_entry(head, "activation", op=act["op"], layers=act["layers"]))
            cur = act["output"]
            break
        if graph.readers(cur) != 1:
            who = ", ".join(f"{c.name} ({c.op_type})" for c in consumers)
            extra = " and is a graph output" if graph.tensor(cur).is_output else ""
            stopped = (
                f"output {cur!r} of {graph.layer(layers[-1]).name if layers else start.name!r} has "
                f"{len(consumers)} consumer(s) [{who}]{extra}; a vertical merge needs a single consumer"
            )
            break
        nxt = consumers[0]
        if nxt.op_type in SINGLE_ACTIVATIONS and not nxt.domain:
            act = activation_of(graph, nxt, cur)
            if act is None:
                what = "a run-time or non-per-channel slope" if nxt.op_type == "PRelu" else "run-time bounds"
                stopped = f"{nxt.op_type} {nxt.name!r} has {what}"
                break
            layers.append(nxt.name)
            params = {k: v for k, v in act.items() if k not in ("op", "layers")}
            epilogue.append(epilogue_entry(nxt, "activation", params=params))
            cur = nxt.outputs[0]
            break
        if nxt.op_type in CHAIN_OPS and allow_affine:
            reason = affine_reason(graph, nxt, cur) or _runtime_weights_reason(graph, start)
            if reason is not None:
                stopped = reason
                break
            role = "batchnorm" if nxt.op_type == "BatchNormalization" else "per-channel " + nxt.op_type
            if nxt.op_type == "Add" and not epilogue and not _has_bias(graph, start):
                role = "bias"
            layers.append(nxt.name)
            epilogue.append(epilogue_entry(nxt, role, folded=True))
            cur = nxt.outputs[0]
            continue
        stopped = f"next layer {nxt.name!r} ({nxt.op_type}) is not part of the template" if layers else (
            f"{nxt.op_type} {nxt.name!r} is not a per-channel affine op or an activation"
        )
        break
    return {"layers": layers, "epilogue": epilogue, "stopped": stopped, "output": cur, "candidate": candidate}


def _runtime_weights_reason(graph: TopologyGraph, start: Layer) -> Optional[str]:
    """Folding rewrites W and b at compile time: they must be constants."""
    if start.op_type != "Conv":
        return None
    runtime = [i for i in start.inputs[1:3] if i and not graph.is_constant(i)]
    if runtime:
        return f"conv {start.name!r} reads its weights {runtime[0]!r} at run time; folding needs constants"
    return None


def _has_bias(graph: TopologyGraph, conv: Layer) -> bool:
    return len(conv.inputs) > 2 and bool(conv.inputs[2])


def fused_conv(
    graph: TopologyGraph,
    conv: Layer,
    absorbed: list[str],
    *,
    template: str,
    data_input: Optional[str] = None,
    output: str,
    fused: LayerFacts,
) -> Layer:
    """The layer that replaces ``conv`` and the ``absorbed`` layers around it."""
    names = [conv.name] + absorbed
    inputs = list(conv.inputs)
    if data_input is not None:
        inputs[0] = data_input
    for n in absorbed:
        for i in graph.const_inputs(graph.layer(n)):
            if i not in inputs:
                inputs.append(i)
    return Layer(
        name=conv.name,
        op_type=conv.op_type,
        inputs=inputs,
        outputs=[output],
        attrs=dict(conv.attrs),
        members=members_of(graph, sorted(names, key=graph.order().get)),
        template=template,
        fused=fused,
    )


class ConvChain(Template):
    name = "vertical.conv_chain"
    kind = "vertical"
    description = "Conv -> [bias] -> [BatchNormalization] -> [per-channel Mul/Add] -> [activation]"

    def pattern(self, graph: TopologyGraph) -> Iterator[Match]:
        for layer in graph:
            if not is_conv(layer) or layer.is_fused:
                continue
            walk = walk_epilogue(graph, layer)
            if walk["layers"] or walk["candidate"]:
                yield Match(self.name, [layer.name] + walk["layers"], info=walk)

    def check(self, graph: TopologyGraph, match: Match) -> Optional[str]:
        if len(match.layers) < 2:
            return match.info.get("stopped") or "nothing follows the conv"
        return None

    def merge(self, graph: TopologyGraph, match: Match) -> tuple[Layer, dict[str, Any]]:
        conv = graph.layer(match.layers[0])
        epilogue = match.info["epilogue"]
        fused = LayerFacts(epilogue=tuple(epilogue))
        layer = fused_conv(
            graph, conv, match.layers[1:], template=self.name, output=match.info["output"], fused=fused
        )
        details = {
            "folded": [e.op for e in epilogue if e.folded],
            "activation": next((e.op for e in epilogue if e.role == "activation"), None),
        }
        if match.info.get("stopped"):
            details["stopped"] = match.info["stopped"]
        graph.replace(match.layers, [layer])
        return layer, details
