"""The VTA view of a fusion plan: each second-graph layer as one typed op, and its unfused form.

:func:`lower_plan` turns the planner's second topology graph into a list of ops:

* :class:`ConvOp` - a fused convolution: folded weights ``W' [C_out, C_in, kh, kw]`` and bias
  ``b' [C_out]`` (BatchNorm and per-channel affine ops folded, see
  :func:`tvm_layerfuse.onnx_realize.fold_affine`), then an optional residual add, then
  ReLU/Clip; a horizontal merge has several output segments ``(tensor, [c0, c1))`` of
  the merged output channels. ``on_vta`` says whether VTA runs it, ``reason`` why not.
* :class:`EltwiseOp` - ``acts(sum(inputs))``: a residual add and/or an activation alone
  (only in the unfused form; the fused form carries them in the conv's epilogue).
* :class:`ConcatOp` - channel concatenation; ``in_place`` when the producers store into
  the concat block at offsets (no copy), else a copy program.
* :class:`HostOp` - first-graph layers the host runs in float (pools, classifier, ...).

:func:`unfuse` gives the same network with every runtime op its own program, the
baseline of the fusion gain: a conv stores its pre-activation output, a separate program
adds the residual, another applies the activation, a concat copies its inputs, and
horizontally merged branches run one by one. BatchNorm stays folded into the weights
(a compile-time transform, not a runtime fusion), so both forms share one quantization.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from ...onnx_realize import fold_affine
from ...planner import FusionPlan
from ...templates.ops import conv_params
from ...topology.facts import LayerFacts
from ...topology.graph import Layer, TopologyGraph

log = logging.getLogger(__name__)

RESIDUAL_ROLES = ("residual", "post_add")
"""Epilogue roles of an absorbed Add (``post_add``: after the activation, the order VTA's ALU cannot run)."""

MIN_VTA_IN_CHANNELS = 4
"""Convs with fewer input channels (the RGB stem) stay on the host, as in TVM's VTA flow."""


@dataclass
class Act:
    """An activation applied in the output scale: ``relu`` or ``clip`` to ``[lo, hi]``."""

    kind: str
    lo: Optional[float] = None
    hi: Optional[float] = None


@dataclass
class OutSeg:
    """Output channels ``[c0, c1)`` of a (merged) conv are tensor ``tensor``."""

    tensor: str
    c0: int
    c1: int


@dataclass
class ConvOp:
    name: str
    input: str
    weight: np.ndarray  # [C_out, C_in, kh, kw] float64, affine ops folded
    bias: np.ndarray  # [C_out] float64
    strides: tuple[int, int]
    pads: tuple[int, int, int, int]  # top, left, bottom, right
    outputs: list[OutSeg]
    residual: Optional[str] = None
    acts: list[Act] = field(default_factory=list)
    on_vta: bool = True
    reason: Optional[str] = None
    members: tuple[str, ...] = ()

    @property
    def reads(self) -> list[str]:
        return [self.input] + ([self.residual] if self.residual else [])

    @property
    def writes(self) -> list[str]:
        return [s.tensor for s in self.outputs]


class _ReadsInputs:
    """``reads``/``writes`` of an op with ``inputs`` and one ``output``."""

    inputs: list[str]
    output: str

    @property
    def reads(self) -> list[str]:
        return list(self.inputs)

    @property
    def writes(self) -> list[str]:
        return [self.output]


@dataclass
class EltwiseOp(_ReadsInputs):
    name: str
    inputs: list[str]
    output: str
    acts: list[Act] = field(default_factory=list)
    on_vta: bool = True
    reason: Optional[str] = None


@dataclass
class ConcatOp(_ReadsInputs):
    name: str
    inputs: list[str]
    output: str
    in_place: bool
    on_vta: bool = True
    reason: Optional[str] = None


@dataclass
class HostOp(_ReadsInputs):
    name: str
    layers: list[str]  # first-graph layers, in order
    inputs: list[str]
    outputs: list[str]
    op_type: str = ""
    on_vta: bool = False
    reason: Optional[str] = None

    @property
    def writes(self) -> list[str]:
        return list(self.outputs)


Op = Union[ConvOp, EltwiseOp, ConcatOp, HostOp]


@dataclass
class VTAGraph:
    """Ops in execution order plus the shapes of every tensor they exchange."""

    name: str
    ops: list[Op]
    inputs: list[str]
    outputs: list[str]
    shapes: dict[str, tuple[int, ...]]
    first: TopologyGraph
    fused: bool = True

    def producers(self) -> dict[str, Op]:
        return {t: op for op in self.ops for t in op.writes}


# ---------------------------------------------------------------------- lowering
def lower_plan(plan: FusionPlan) -> VTAGraph:
    """The second graph of ``plan`` as VTA ops (see module doc)."""
    first, second = plan.first, plan.second
    ops: list[Op] = []
    for layer in second:
        if layer.op_type == "Conv" and not layer.domain:
            ops.append(_conv_op(first, second, layer))
        elif layer.op_type == "Concat" and int(layer.attrs.get("axis", 1)) in (1, -3) and _rank(second, layer.outputs[0]) == 4:
            ops.append(ConcatOp(layer.name, list(layer.inputs), layer.outputs[0], in_place=layer.fused.in_place))
        else:
            ops.append(_host(first, layer, f"{layer.op_type} runs on the host"))
    shapes = {name: tuple(int(d) for d in t.shape) for name, t in second.tensors.items() if not t.constant and t.known_shape}
    for name, t in first.tensors.items():
        if not t.constant and t.known_shape:
            shapes.setdefault(name, tuple(int(d) for d in t.shape))
    return VTAGraph(first.name, ops, list(second.inputs), list(second.outputs), shapes, first, fused=True)


def _rank(graph: TopologyGraph, tensor: str) -> int:
    shape = graph.tensor(tensor).shape
    return len(shape) if shape is not None else -1


def _host(first: TopologyGraph, layer: Layer, reason: str) -> HostOp:
    members = [m for m in first.layers if m.name in set(layer.members)] if layer.members else [first.layer(layer.name)]
    data_in = [i for i in layer.inputs if i and not (i in first.tensors and first.tensor(i).constant)]
    # outputs nobody reads (Dropout's mask) are not computed
    outs = [o for k, o in enumerate(layer.outputs) if k == 0 or o and (first.consumers(o) or o in first.outputs)]
    return HostOp(layer.name, [m.name for m in members], data_in, outs, op_type=layer.op_type, reason=reason)


def _conv_op(first: TopologyGraph, second: TopologyGraph, layer: Layer) -> Op:
    fused = layer.fused
    if fused.prologue:
        return _host(first, layer, "a pre-activation prologue (BatchNorm/ReLU before the conv) is not run on VTA")
    params = conv_params(second, layer)
    if len(params["kernel_shape"] or []) != 2 or not isinstance(params["pads"], list):
        return _host(first, layer, "not a 2-D conv with explicit pads")
    if params["group"] != 1 or params["dilations"] != [1, 1]:
        return _host(first, layer, "grouped or dilated conv (VTA's GEMM core runs dense convs)")
    if fused.split:
        ws, bs, outs, c = [], [], [], 0
        for s in fused.split:
            w, b = _weights(first, s.branch, fused.branches[s.branch])
            ws.append(w)
            bs.append(b)
            outs.append(OutSeg(s.output, c, c + w.shape[0]))
            c += w.shape[0]
        weight, bias = np.concatenate(ws, axis=0), np.concatenate(bs)  # [sum C_i, C_in, kh, kw], [sum C_i]
    else:
        weight, bias = _weights(first, layer.name, fused)
        outs = [OutSeg(layer.outputs[0], 0, weight.shape[0])]
    pt, pl, pb, pr = params["pads"]
    op = ConvOp(
        layer.name, layer.inputs[0], weight, bias, tuple(params["strides"]), (pt, pl, pb, pr), outs,
        members=tuple(layer.members),
    )
    reason = None
    seen_act = False
    for e in fused.epilogue:
        if e.folded:
            continue
        if e.role in RESIDUAL_ROLES and e.op == "Add":
            if seen_act or e.role == "post_add":
                reason = "an activation before the residual add"
            op.residual = e.extra_input
        elif e.role == "activation" and e.op == "Relu":
            op.acts.append(Act("relu"))
            seen_act = True
        elif e.role == "activation" and e.op == "Clip":
            op.acts.append(Act("clip", e.params.get("min"), e.params.get("max")))
            seen_act = True
        else:
            reason = f"epilogue {e.op} ({e.role}) has no VTA ALU form"
    if reason is None and weight.shape[1] < MIN_VTA_IN_CHANNELS:
        reason = (
            f"{weight.shape[1]} input channels, fewer than {MIN_VTA_IN_CHANNELS} (like the RGB stem, too little work for the GEMM block)"
        )
    if reason is None and max(op.pads) > 15:
        reason = f"padding {max(op.pads)} exceeds the 4-bit pad field of VTA's LOAD"
    if reason is not None and (seen_act and op.residual and _act_before_residual(fused) or _needs_members(fused)):
        return _host(first, layer, reason)  # the ConvOp's float form (conv, add, acts) would not be this layer
    if reason is not None:
        return _as_host_conv(op, reason)
    return op


def _act_before_residual(fused: LayerFacts) -> bool:
    roles = [e.role for e in fused.epilogue if not e.folded]
    if "post_add" in roles:  # the planner's name for an Add after the activation
        return True
    return "residual" in roles and "activation" in roles and roles.index("activation") < roles.index("residual")


def _needs_members(fused: LayerFacts) -> bool:
    live = [e for e in fused.epilogue if not e.folded]
    return any(e.role not in (*RESIDUAL_ROLES, "activation") or e.role == "activation" and e.op not in ("Relu", "Clip") for e in live)


def _as_host_conv(op: ConvOp, reason: str) -> ConvOp:
    op.on_vta = False
    op.reason = reason
    return op


def _weights(first: TopologyGraph, conv_name: str, fused: LayerFacts) -> tuple[np.ndarray, np.ndarray]:
    conv = first.layer(conv_name)
    w = first.tensor(conv.inputs[1]).value()  # [C_out, C_in, kh, kw]
    b = first.tensor(conv.inputs[2]).value() if len(conv.inputs) > 2 and conv.inputs[2] else np.zeros(w.shape[0])
    return fold_affine(first, w, b, fused.epilogue)  # float64


# ---------------------------------------------------------------------- unfused form
def unfuse(graph: VTAGraph) -> VTAGraph:
    """Every runtime op of ``graph`` as its own op (see module doc); same tensor names."""
    ops: list[Op] = []
    shapes = dict(graph.shapes)
    for op in graph.ops:
        if isinstance(op, ConvOp) and op.on_vta:
            for seg in op.outputs:
                name = op.name if len(op.outputs) == 1 else f"{op.name}::{seg.tensor}"
                tail = op.residual is not None or bool(op.acts)
                conv_out = f"{seg.tensor}::conv" if tail else seg.tensor
                shapes[conv_out] = shapes[seg.tensor]
                ops.append(ConvOp(name, op.input, op.weight[seg.c0 : seg.c1], op.bias[seg.c0 : seg.c1], op.strides, op.pads,
                                  [OutSeg(conv_out, 0, seg.c1 - seg.c0)], members=op.members))
                x = conv_out
                if op.residual is not None:
                    summed = f"{seg.tensor}::add" if op.acts else seg.tensor
                    shapes[summed] = shapes[seg.tensor]
                    ops.append(EltwiseOp(f"{name}::add", [x, op.residual], summed))
                    x = summed
                if op.acts:
                    ops.append(EltwiseOp(f"{name}::act", [x], seg.tensor, acts=list(op.acts)))
        elif isinstance(op, ConcatOp):
            ops.append(ConcatOp(op.name, list(op.inputs), op.output, in_place=False))
        else:
            ops.append(op)
    return VTAGraph(graph.name, ops, graph.inputs, graph.outputs, shapes, graph.first, fused=False)


def placement(graph: VTAGraph) -> list[dict]:
    """Which op runs where, and why not on VTA (for reports)."""
    rows = []
    for op in graph.ops:
        kind = type(op).__name__.replace("Op", "").lower()
        rows.append({"op": op.name, "kind": kind if not isinstance(op, HostOp) else op.op_type,
                     "where": "vta" if op.on_vta else "host", "reason": op.reason})
    return rows
