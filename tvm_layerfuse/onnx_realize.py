"""Carry out a fusion plan on the ONNX model itself: the reference for the plan's algebra.

The second topology graph says *what* each fused layer computes; this module writes that
as a plain ONNX model, which onnxruntime can run and compare with the original:

* a vertical group becomes one ``Conv`` with folded weights ``W'``, ``b'`` (see
  :mod:`tvm_layerfuse.templates.vertical` for the algebra), its prologue ops, and its
  activation;
* a horizontal group becomes one ``Conv`` over the channel-concatenated weights, the
  shared activation, and a ``Split`` back into each branch's output tensor;
* an element-wise group adds (or multiplies) its extra input after the conv's folded
  bias, then applies its activation; a squeeze-and-excitation gate multiplies its extra
  input by the activated conv output (broadcast over H×W);
* activations are written as ONNX ops where the opset has them (HardSwish >= 14, Gelu >= 20),
  else as their textbook decompositions (``x * HardSigmoid(x)``, ``x * 0.5 * (1 + Erf(x / √2))``);
* an in-place ``Concat`` stays a ``Concat`` (ONNX has no aliasing; the offsets are the
  TVM lowering's business).

Folding is done in float64 and cast back to the weights' dtype. Nothing here needs TVM.
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .planner import FusionPlan
from .topology.facts import EpilogueOp, LayerFacts, SplitPart
from .topology.graph import Layer, TopologyGraph


def realize(plan: FusionPlan, model: onnx.ModelProto) -> onnx.ModelProto:
    """The fused model of ``plan`` (made from ``model``) as an ONNX ``ModelProto``."""
    return _Writer(plan, model).write()


def channel_vector(value: np.ndarray, data_rank: int, channels: int) -> np.ndarray:
    """A per-channel constant (shape ``[C,1,1]``, ``[1,C,1,1]``, ``[1]``, ...) as ``[C]``."""
    value = np.asarray(value, dtype=np.float64)
    if value.size == 1:
        return np.full(channels, value.reshape(-1)[0])
    padded = value.reshape((1,) * (data_rank - value.ndim) + value.shape)
    return padded.reshape(-1) if padded.shape[1] == channels else np.broadcast_to(padded.reshape(-1), (channels,))


def fold_affine(
    first: TopologyGraph, weight: np.ndarray, bias: np.ndarray, epilogue: Iterable[EpilogueOp]
) -> tuple[np.ndarray, np.ndarray]:
    """Fold the ``folded`` epilogue entries into ``W: [C_out, ...]`` and ``b: [C_out]`` (float64)."""
    w = weight.astype(np.float64)
    b = bias.astype(np.float64)
    c_out = w.shape[0]
    scale_shape = (c_out,) + (1,) * (w.ndim - 1)  # broadcast over [C_out, C_in, kh, kw]
    for entry in epilogue:
        if not entry.folded:
            continue
        layer = first.layer(entry.layer)
        # The conv output's rank is the weight's (N, C, spatial...); shape inference may have
        # left the tensor's shape unknown (e.g. after a Concat-4 with a negative axis).
        shape = first.tensor(layer.outputs[0]).shape
        rank = len(shape) if shape is not None else w.ndim
        if layer.op_type == "BatchNormalization":
            gamma, beta, mean, var = (first.tensor(n).value().astype(np.float64) for n in layer.inputs[1:5])
            eps = float(layer.attrs.get("epsilon", 1e-5))
            s = gamma / np.sqrt(var + eps)  # [C_out]
            w = w * s.reshape(scale_shape)
            b = (b - mean) * s + beta
            continue
        const = next(i for i in layer.inputs if first.is_constant(i))
        k = channel_vector(first.tensor(const).value(), rank, c_out)  # [C_out]
        if layer.op_type == "Mul":
            w, b = w * k.reshape(scale_shape), b * k
        elif layer.op_type == "Div":
            w, b = w / k.reshape(scale_shape), b / k
        elif layer.op_type == "Add":
            b = b + k
        elif layer.op_type == "Sub":
            b = b - k
        else:  # pragma: no cover - the templates only fold the ops above
            raise ValueError(f"cannot fold {layer.op_type}")
    return w, b


class _Writer:
    def __init__(self, plan: FusionPlan, model: onnx.ModelProto) -> None:
        self.plan = plan
        self.first = plan.first
        self.model = model
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}
        self.opset = plan.first.opset

    def write(self) -> onnx.ModelProto:
        for layer in self.plan.second:
            if layer.template and not layer.fused.in_place and layer.op_type == "Conv":
                self._fused_conv(layer)
            else:
                self._plain(self.first.layer(layer.name) if layer.name in self.first else layer)
        for node in self.nodes:
            for name in node.input:
                if name and self.first.tensors.get(name) is not None and self.first.tensor(name).constant:
                    self.inits.setdefault(name, self.first.tensor(name).value())
        g = self.model.graph
        graph = helper.make_graph(
            self.nodes,
            g.name or "fused",
            [vi for vi in g.input if vi.name in self.first.inputs],
            list(g.output),
            [numpy_helper.from_array(np.asarray(v), name=n) for n, v in self.inits.items()],
        )
        out = helper.make_model(graph, opset_imports=list(self.model.opset_import), producer_name="tvm_layerfuse")
        out.ir_version = max(self.model.ir_version, 4)
        return out

    # ------------------------------------------------------------------ emitters
    def _plain(self, layer: Layer) -> None:
        attrs = {k: (numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v) for k, v in layer.attrs.items()}
        attrs = {k: v for k, v in attrs.items() if not k.startswith("_")}
        self.nodes.append(
            helper.make_node(
                layer.op_type, list(layer.inputs), list(layer.outputs), name=layer.name, domain=layer.domain or None, **attrs
            )
        )

    def _fused_conv(self, layer: Layer) -> None:
        fused = layer.fused
        x = layer.inputs[0]
        for entry in fused.prologue:
            for name in entry.layers or (entry.layer,):  # SiLU spans two layers
                original = self.first.layer(name)
                self._plain(original)
                x = original.outputs[0]
        if fused.split:
            weights, biases = [], []
            for s in fused.split:
                w, b = self._branch_weights(s.branch, fused.branches[s.branch])
                weights.append(w)
                biases.append(b)
            w = np.concatenate(weights, axis=0)  # [sum C_i, C_in, kh, kw]
            b = np.concatenate(biases)  # [sum C_i]
        else:
            w, b = self._branch_weights(layer.name, fused)
        y = self._conv(layer, x, w, b)
        tail = [e for e in fused.epilogue if not e.folded]
        if fused.split:
            y = self._epilogue(layer, y, tail, final=None)
            self._split(layer, y, fused.split)
        else:
            self._epilogue(layer, y, tail, final=layer.outputs[0])

    def _branch_weights(self, conv_name: str, fused: LayerFacts) -> tuple[np.ndarray, np.ndarray]:
        conv = self.first.layer(conv_name)
        w = self.first.tensor(conv.inputs[1]).value()  # [C_out, C_in/g, kh, kw]
        dtype = w.dtype
        if len(conv.inputs) > 2 and conv.inputs[2]:
            b = self.first.tensor(conv.inputs[2]).value()
        else:
            b = np.zeros(w.shape[0], dtype=dtype)
        w2, b2 = fold_affine(self.first, w, b, fused.epilogue)
        return w2.astype(dtype), b2.astype(dtype)

    def _conv(self, layer: Layer, x: str, w: np.ndarray, b: np.ndarray) -> str:
        wn, bn, y = f"{layer.name}::W", f"{layer.name}::b", f"{layer.name}::conv"
        self.inits[wn] = w
        self.inits[bn] = b
        attrs = {k: v for k, v in layer.attrs.items() if not k.startswith("_")}
        self.nodes.append(helper.make_node("Conv", [x, wn, bn], [y], name=f"{layer.name}::conv", **attrs))
        return y

    def _epilogue(self, layer: Layer, y: str, entries: list[EpilogueOp], *, final: Optional[str]) -> str:
        for k, e in enumerate(entries):
            out = final if (final is not None and k == len(entries) - 1) else f"{layer.name}::e{k}"
            name = f"{layer.name}::{e.op}{k}"
            op = e.op
            if e.role in ("residual", "multiply", "gate", "post_add"):
                kind = "Add" if e.role in ("residual", "post_add") else "Mul"
                self.nodes.append(helper.make_node(kind, [y, e.extra_input], [out], name=name))
            elif op == "Relu":
                self.nodes.append(helper.make_node("Relu", [y], [out], name=name))
            elif op == "LeakyRelu":
                self.nodes.append(helper.make_node("LeakyRelu", [y], [out], name=name, alpha=e.params["alpha"]))
            elif op == "Clip":
                self.nodes.append(self._clip(name, y, out, e.params.get("min"), e.params.get("max")))
            elif op == "SiLU":
                s = f"{layer.name}::sig{k}"
                self.nodes.append(helper.make_node("Sigmoid", [y], [s], name=name + "_sigmoid"))
                self.nodes.append(helper.make_node("Mul", [y, s], [out], name=name))
            elif op == "Sigmoid":
                self.nodes.append(helper.make_node("Sigmoid", [y], [out], name=name))
            elif op == "HardSigmoid":
                self.nodes.append(helper.make_node("HardSigmoid", [y], [out], name=name, alpha=e.params["alpha"], beta=e.params["beta"]))
            elif op == "HardSwish" and self.opset >= 14:
                self.nodes.append(helper.make_node("HardSwish", [y], [out], name=name))
            elif op == "HardSwish":  # x * HardSigmoid(x) with alpha 1/6, beta 1/2
                s = f"{layer.name}::hsig{k}"
                self.nodes.append(helper.make_node("HardSigmoid", [y], [s], name=name + "_hsig", alpha=1 / 6, beta=0.5))
                self.nodes.append(helper.make_node("Mul", [y, s], [out], name=name))
            elif op == "PRelu":
                self.nodes.append(helper.make_node("PRelu", [y, e.params["slope"]], [out], name=name))
            elif op == "Gelu":
                self._gelu(name, y, out, e.params.get("approximate", "none"))
            else:  # pragma: no cover - templates produce only the ops above
                raise ValueError(f"unknown epilogue op {op}")
            y = out
        if final is not None and not entries:
            self.nodes.append(helper.make_node("Identity", [y], [final], name=f"{layer.name}::out"))
            y = final
        return y

    def _gelu(self, name: str, x: str, out: str, approximate: str) -> None:
        if self.opset >= 20:
            self.nodes.append(helper.make_node("Gelu", [x], [out], name=name, approximate=approximate))
            return
        if approximate != "none":  # pragma: no cover - Gelu with approximate exists only from opset 20
            raise ValueError(f"Gelu approximate={approximate!r} needs opset 20")
        consts = {"sqrt2": 2**0.5, "one": 1.0, "half": 0.5}
        for tag, v in consts.items():
            self.inits[f"{name}::{tag}"] = np.array(v, dtype=np.float32)
        t = [f"{name}::t{i}" for i in range(4)]
        self.nodes += [
            helper.make_node("Div", [x, f"{name}::sqrt2"], [t[0]], name=name + "_div"),
            helper.make_node("Erf", [t[0]], [t[1]], name=name + "_erf"),
            helper.make_node("Add", [t[1], f"{name}::one"], [t[2]], name=name + "_add"),
            helper.make_node("Mul", [x, t[2]], [t[3]], name=name + "_mul"),
            helper.make_node("Mul", [t[3], f"{name}::half"], [out], name=name),
        ]

    def _clip(self, name: str, x: str, out: str, lo: Optional[float], hi: Optional[float]) -> onnx.NodeProto:
        if self.opset < 11:
            attrs = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
            return helper.make_node("Clip", [x], [out], name=name, **attrs)
        dtype = self.first.tensor(x).dtype if x in self.first.tensors else "float32"
        names = []
        for tag, v in (("min", lo), ("max", hi)):
            if v is None:
                names.append("")
                continue
            n = f"{name}::{tag}"
            self.inits[n] = np.array(v, dtype=dtype)
            names.append(n)
        while names and names[-1] == "":
            names.pop()
        return helper.make_node("Clip", [x] + names, [out], name=name)

    def _split(self, layer: Layer, y: str, split: Iterable[SplitPart]) -> None:
        sizes = [s.channels[1] - s.channels[0] for s in split]
        outs = [s.output for s in split]
        name = f"{layer.name}::split"
        if self.opset >= 13:
            sn = f"{name}::sizes"
            self.inits[sn] = np.array(sizes, dtype=np.int64)
            self.nodes.append(helper.make_node("Split", [y, sn], outs, name=name, axis=1))
        else:
            self.nodes.append(helper.make_node("Split", [y], outs, name=name, axis=1, split=sizes))
