"""A small ONNX graph builder that writes graphs the way ``torch.onnx.export`` does.

Shared by :mod:`.zoo` (fixed architectures) and :mod:`.graphgen` (random graphs). It
tracks every tensor's static shape (NCHW), so builders can size weights and declare the
graph outputs' shapes (``onnx.checker``'s full check compares them with shape inference).

What "the way torch writes it" means here (TorchScript exporter, eval mode, constant
folding on):

* node names ``/layer1/layer1.0/conv1/Conv`` and value names ``<node>_output_0``;
* every Conv attribute explicit (``dilations, group, kernel_shape, pads, strides``);
* BatchNormalization after a Conv either kept (``bn="separate"``: weights
  ``<module>.weight``, ``running_mean``...) or folded into the Conv's weight and bias
  (``bn="folded"``: initializers named ``onnx::Conv_<n>``); a BatchNormalization that
  does not follow a Conv (pre-activation) is never folded, as in torch;
* ``Constant`` nodes for scalar operands (Clip bounds), ``Identity`` nodes on some
  weights (torch's initializer de-duplication leaves them), ``Flatten`` + ``Gemm``
  (``transB=1``) classifiers.

Parameters are drawn from one ``np.random.default_rng(seed)`` in a fixed order, so the
``separate`` and ``folded`` forms of one model compute the same function. BatchNorm
running statistics are calibrated on a seeded batch (see "numpy forward pass" below).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..runtime.vta.host import conv2d, pool2d, pool_out

Shape = tuple[int, ...]

BN_MODES = ("separate", "folded")
CLIP_FORMS = ("inputs", "attributes")
# Default-domain opsets the builders accept: 10 is the first whose MaxPool/AveragePool
# take ceil_mode (torch cannot export ceil_mode=True below it).
MIN_OPSET = 10
MAX_OPSET = 21


def ir_version_for(opset: int) -> int:
    """The IR version torch writes for ``opset`` (what onnxruntime expects with it)."""
    if opset <= 10:
        return 5
    if opset <= 12:
        return 7
    if opset <= 18:
        return 8
    if opset <= 20:
        return 9
    return 10


def check_options(*, opset: int, bn: str, clip: str = "inputs", batch: int = 1, image: int = 32) -> None:
    """Raise ValueError naming the bad option, what was expected and how to fix it."""
    if bn not in BN_MODES:
        raise ValueError(f"bn={bn!r} is not a BatchNormalization mode; expected one of {BN_MODES}")
    if clip not in CLIP_FORMS:
        raise ValueError(f"clip={clip!r} is not a Clip form; expected one of {CLIP_FORMS}")
    if not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset={opset!r} is out of range; expected an int in [{MIN_OPSET}, {MAX_OPSET}]")
    if clip == "inputs" and opset < 11:
        raise ValueError(
            f"clip='inputs' needs opset >= 11 (Clip-11 takes min/max as inputs), got opset={opset}; "
            "pass clip='attributes' for opset <= 10"
        )
    if clip == "attributes" and opset > 10:
        raise ValueError(
            f"clip='attributes' needs opset <= 10 (Clip-6 takes min/max as attributes), got opset={opset}; "
            "pass opset=10 or clip='inputs'"
        )
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}; expected a positive int")
    if not isinstance(image, int) or image < 1:
        raise ValueError(f"image={image!r}; expected a positive int")


def conv_out(size: int, k: int, stride: int, pad_begin: int, pad_end: int, dilation: int = 1) -> int:
    """Output length of a convolution along one axis."""
    return (size + pad_begin + pad_end - dilation * (k - 1) - 1) // stride + 1


def _pair(v: Union[int, Sequence[int]]) -> tuple[int, int]:
    if isinstance(v, (int, np.integer)):
        return int(v), int(v)
    a, b = v
    return int(a), int(b)


# ---------------------------------------------------------------------- numpy forward pass
# The builder runs the graph on a calibration batch while it builds, so that every
# BatchNormalization gets running statistics close to the real ones (its output is then
# ~ gamma * N(0, 1) + beta) and activations stay O(1) however deep the net is. Exactness
# does not matter here (these numbers only choose parameters); onnxruntime is the judge.

CALIBRATION_SAMPLES = 16  # calibration images per declared batch element


def _np_conv(x, w, b, *, strides, dilations, group, pads=(0, 0, 0, 0), auto_pad="NOTSET", **_):
    """:func:`tvm_layerfuse.runtime.vta.host.conv2d` with ONNX's ``auto_pad`` resolved to explicit pads."""
    h, wd = x.shape[2:]
    kh, kw = w.shape[2:]  # [C_out, C_in/g, kh, kw]
    sh, sw = strides
    dh, dw = dilations
    eh, ew = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for size, s, e in ((h, sh, eh), (wd, sw, ew)):
            total = max((-(-size // s) - 1) * s + e - size, 0)
            small = total // 2
            pads.append((total - small, small) if auto_pad == "SAME_LOWER" else (small, total - small))
        (pt, pb), (pl, pr) = pads
    elif auto_pad == "VALID":
        pt = pb = pl = pr = 0
    else:
        pt, pl, pb, pr = pads
    return conv2d(x, w, b, strides=strides, dilations=dilations, group=group, pads=(pt, pl, pb, pr)).astype(np.float32)


def _np_pool(x, **attrs):
    return pool2d(x, **attrs).astype(np.float32)


def _np_eval(op: str, ins: list, attrs: dict):
    """One op on numpy arrays (the subset the builders emit); None when not supported."""
    if op == "Conv":
        return _np_conv(ins[0], ins[1], ins[2] if len(ins) > 2 else None, **attrs)
    if op in ("MaxPool", "AveragePool"):
        return _np_pool(ins[0], op=op, **attrs)
    if op == "BatchNormalization":
        x, g, b, m, v = ins
        shape = (1, -1) + (1,) * (x.ndim - 2)
        eps = attrs.get("epsilon", 1e-5)
        return ((x - m.reshape(shape)) / np.sqrt(v.reshape(shape) + eps) * g.reshape(shape) + b.reshape(shape)).astype(
            np.float32
        )
    if op == "Relu":
        return np.maximum(ins[0], 0)
    if op == "LeakyRelu":
        return np.where(ins[0] >= 0, ins[0], ins[0] * attrs.get("alpha", 0.01)).astype(np.float32)
    if op == "Sigmoid":
        with np.errstate(over="ignore"):
            return (1.0 / (1.0 + np.exp(-ins[0]))).astype(np.float32)
    if op == "Clip":
        lo = ins[1] if len(ins) > 1 and ins[1] is not None else attrs.get("min")
        hi = ins[2] if len(ins) > 2 and ins[2] is not None else attrs.get("max")
        return np.clip(ins[0], lo, hi)
    if op in ("Add", "Mul", "Sub", "Div"):
        fn = {"Add": np.add, "Mul": np.multiply, "Sub": np.subtract, "Div": np.divide}[op]
        return fn(ins[0], ins[1]).astype(np.float32)
    if op == "Sum":
        out = ins[0]
        for v in ins[1:]:
            out = out + v
        return out.astype(np.float32)
    if op == "Concat":
        return np.concatenate(ins, axis=attrs["axis"])
    if op == "GlobalAveragePool":
        return ins[0].mean(axis=tuple(range(2, ins[0].ndim)), keepdims=True)
    if op == "Flatten":
        return ins[0].reshape(ins[0].shape[0], -1)
    if op == "Gemm":
        return (ins[0] @ ins[1].T + ins[2]).astype(np.float32)
    if op in ("Identity", "Dropout"):
        return ins[0]
    if op == "Constant":
        return numpy_helper.to_array(attrs["value"])
    return None


class NetBuilder:
    """Accumulate nodes, initializers and shapes; :meth:`build` returns the ModelProto."""

    def __init__(
        self,
        name: str,
        *,
        seed: int = 0,
        opset: int = 13,
        bn: str = "separate",
        clip: str = "inputs",
        quirks: bool = True,
        identity_every: int = 5,
        calibrate: bool = True,
    ) -> None:
        check_options(opset=opset, bn=bn, clip=clip)
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.opset = opset
        self.bn_mode = bn
        self.clip_form = clip
        self.quirks = quirks
        self.identity_every = identity_every
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.shapes: dict[str, Shape] = {}
        self._scope: list[str] = []
        self._used_node_names: dict[str, int] = {}
        self._used_values: set[str] = set()
        self._onnx_counter = 100  # torch numbers anonymous values from some offset
        self._params = 0
        # Calibration batch values (see "numpy forward pass" above); None: not tracked.
        self.values: Optional[dict[str, np.ndarray]] = {} if calibrate else None
        self._calib_rng = np.random.default_rng([seed, 0xCA11B])

    # ------------------------------------------------------------------ naming
    @contextlib.contextmanager
    def scope(self, *names: Union[str, int]) -> Iterator[None]:
        """Enter module ``names`` (attribute names or Sequential indices), e.g. ``scope("layer1", 0)``."""
        depth = len(self._scope)
        self._scope.extend(str(n) for n in names)
        try:
            yield
        finally:
            del self._scope[depth:]

    def module_path(self) -> str:
        return ".".join(self._scope)

    def _scope_prefix(self) -> str:
        # torch: /layer1/layer1.0/conv1 and /features/features.0/features.0.0
        parts = []
        for i, n in enumerate(self._scope):
            parts.append(".".join(self._scope[: i + 1]) if n.isdigit() else n)
        return "".join("/" + p for p in parts)

    def _node_name(self, op: str) -> str:
        base = f"{self._scope_prefix()}/{op}"
        k = self._used_node_names.get(base, 0)
        self._used_node_names[base] = k + 1
        return base if k == 0 else f"{base}_{k}"

    def _anon(self, kind: str) -> str:
        self._onnx_counter += 1
        return f"onnx::{kind}_{self._onnx_counter}"

    def _unique_value(self, name: str) -> str:
        if name in self._used_values:
            raise ValueError(f"value name {name!r} is used twice in model {self.name!r}")
        self._used_values.add(name)
        return name

    # ------------------------------------------------------------------ low level
    def input(self, name: str, shape: Sequence[int]) -> str:
        shape = tuple(int(d) for d in shape)
        self._unique_value(name)
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))
        self.shapes[name] = shape
        if self.values is not None:
            calib = (shape[0] * CALIBRATION_SAMPLES,) + shape[1:]
            self.values[name] = self._calib_rng.standard_normal(calib).astype(np.float32)
        return name

    def value(self, name: str) -> Optional[np.ndarray]:
        """The calibration-batch value of ``name``, when tracked."""
        return None if self.values is None else self.values.get(name)

    def node(
        self,
        op: str,
        inputs: Sequence[str],
        out_shapes: Sequence[Optional[Shape]],
        **attrs,
    ) -> list[str]:
        """Add one node; returns its output names (torch style: ``<node name>_output_<k>``)."""
        name = self._node_name(op)
        outputs = [self._unique_value(f"{name}_output_{k}") for k in range(len(out_shapes))]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op, list(inputs), outputs, name=name, **attrs))
        for o, s in zip(outputs, out_shapes):
            if s is not None:
                self.shapes[o] = tuple(int(d) for d in s)
        if self.values is not None:
            ins = [self.values.get(i) if i else None for i in inputs]
            if all(v is not None for i, v in zip(inputs, ins) if i):
                result = _np_eval(op, ins, attrs)
                if result is not None and len(outputs) == 1:
                    self.values[outputs[0]] = np.asarray(result, dtype=np.float32)
        return outputs

    def initializer(self, name: str, value: np.ndarray) -> str:
        self._unique_value(name)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name=name))
        self.shapes[name] = tuple(np.asarray(value).shape)
        if self.values is not None:
            self.values[name] = np.asarray(value)
        return name

    def param(self, leaf: str, value: np.ndarray, *, folded_from: Optional[str] = None) -> str:
        """A module parameter: ``<module>.<leaf>``, or ``onnx::<Op>_<n>`` when constant folding made it.

        With quirks on, every ``identity_every``-th parameter reaches its reader through an
        ``Identity`` node, as torch's initializer de-duplication leaves them.
        """
        self._params += 1
        value = np.asarray(value, dtype=np.float32)
        if folded_from is not None:
            name = self._anon(folded_from)
        else:
            path = self.module_path() or "param"
            name, k = f"{path}.{leaf}", 1
            while name in self._used_values:  # several layers in one scope (random graphs)
                name, k = f"{path}_{k}.{leaf}", k + 1
        if self.quirks and self.identity_every and self._params % self.identity_every == 0:
            src = self.initializer(name, value)
            out = self._unique_value(self._anon("Identity"))
            self.nodes.append(helper.make_node("Identity", [src], [out], name=f"Identity_{self._onnx_counter}"))
            self.shapes[out] = tuple(value.shape)
            if self.values is not None:
                self.values[out] = value
            return out
        return self.initializer(name, value)

    def constant(self, value: Union[float, np.ndarray], *, dtype=np.float32, node: Optional[bool] = None) -> str:
        """A constant operand: a ``Constant`` node (torch's way) or an initializer; ``node=None``
        follows the builder's ``quirks``."""
        arr = np.asarray(value, dtype=dtype)
        if self.quirks if node is None else node:
            (out,) = self.node("Constant", [], [arr.shape], value=numpy_helper.from_array(arr))
            return out
        return self.initializer(self._anon("Constant"), arr)

    # ------------------------------------------------------------------ random parameters
    def he_weight(self, cout: int, cin_per_group: int, kh: int, kw: int) -> np.ndarray:
        fan_in = cin_per_group * kh * kw
        return (self.rng.standard_normal((cout, cin_per_group, kh, kw)) * math.sqrt(2.0 / fan_in)).astype(
            np.float32
        )  # [C_out, C_in/g, kh, kw]

    def uniform_bias(self, cout: int, fan_in: int) -> np.ndarray:
        bound = 1.0 / math.sqrt(fan_in)
        return self.rng.uniform(-bound, bound, cout).astype(np.float32)

    def bn_params(
        self, c: int, observed: Optional[np.ndarray] = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """gamma, beta, running mean, running var for ``c`` channels.

        With ``observed`` (the normalised tensor on the calibration batch, ``[N, C, ...]``)
        the running statistics are its per-channel mean and variance, slightly jittered;
        otherwise they are near (0, 1). The same random numbers are drawn either way.
        """
        gamma = self.rng.uniform(0.5, 1.5, c).astype(np.float32)
        beta = self.rng.normal(0.0, 0.1, c).astype(np.float32)
        z_mean = self.rng.standard_normal(c)
        z_var = self.rng.uniform(0.8, 1.25, c)
        if observed is not None:
            axes = (0,) + tuple(range(2, observed.ndim))
            m = observed.mean(axis=axes, dtype=np.float64)
            v = np.maximum(observed.var(axis=axes, dtype=np.float64), 1e-3)
            mean, var = m + 0.1 * np.sqrt(v) * z_mean, v * z_var
        else:
            mean, var = 0.1 * z_mean, z_var
        return gamma, beta, mean.astype(np.float32), var.astype(np.float32)

    # ------------------------------------------------------------------ layers
    def conv_geometry(
        self,
        x: str,
        cout: int,
        kernel: Union[int, Sequence[int]],
        *,
        stride: Union[int, Sequence[int]] = 1,
        pad: Union[int, Sequence[int]] = 0,
        dilation: Union[int, Sequence[int]] = 1,
        groups: int = 1,
        auto_pad: Optional[str] = None,
    ) -> tuple[dict, Shape]:
        """The Conv attributes (torch spells out all of them) and the output shape of a conv
        on ``x``; ValueError when the channels do not split into ``groups`` or the output is empty.
        ``pad`` is an int, (ph, pw), or the ONNX 4-tuple (top, left, bottom, right)."""
        n, cin, h, w = self.shapes[x]
        kh, kw = _pair(kernel)
        sh, sw = _pair(stride)
        dh, dw = _pair(dilation)
        if isinstance(pad, (int, np.integer)) or len(pad) == 2:
            ph, pw = _pair(pad)
            pads = [ph, pw, ph, pw]
        else:
            pads = [int(p) for p in pad]
        if cin % groups or cout % groups:
            raise ValueError(f"conv on {x!r}: channels {cin}->{cout} are not divisible by groups={groups}")
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            oh, ow = -(-h // sh), -(-w // sw)
            attrs: dict = dict(auto_pad=auto_pad)
        elif auto_pad == "VALID":
            oh, ow = conv_out(h, kh, sh, 0, 0, dh), conv_out(w, kw, sw, 0, 0, dw)
            attrs = dict(auto_pad=auto_pad)
        else:
            oh = conv_out(h, kh, sh, pads[0], pads[2], dh)
            ow = conv_out(w, kw, sw, pads[1], pads[3], dw)
            attrs = dict(pads=pads)
        if oh < 1 or ow < 1:
            raise ValueError(f"conv on {x!r} of shape {[n, cin, h, w]} with kernel {kh}x{kw} gives an empty output")
        attrs.update(dilations=[dh, dw], group=groups, kernel_shape=[kh, kw], strides=[sh, sw])
        return dict(sorted(attrs.items())), (n, cout, oh, ow)

    def conv(
        self,
        x: str,
        cout: int,
        kernel: Union[int, Sequence[int]],
        *,
        bias: bool = True,
        weight: Union[np.ndarray, str, None] = None,
        bias_value: Optional[np.ndarray] = None,
        folded: bool = False,
        **geometry,
    ) -> str:
        """Conv2d (geometry keywords: see :meth:`conv_geometry`).

        ``weight`` may name an existing tensor (weights shared with another conv)."""
        attrs, out_shape = self.conv_geometry(x, cout, kernel, **geometry)
        cin_per_group = self.shapes[x][1] // attrs["group"]
        kh, kw = attrs["kernel_shape"]
        if weight is None:
            weight = self.he_weight(cout, cin_per_group, kh, kw)
        if bias and bias_value is None:
            bias_value = self.uniform_bias(cout, cin_per_group * kh * kw)
        if isinstance(weight, str):  # an existing tensor: weights shared with another layer
            w_name = weight
        else:
            w_name = self.param("weight", weight, folded_from="Conv" if folded else None)
        inputs = [x, w_name]
        if bias:
            inputs.append(self.param("bias", bias_value, folded_from="Conv" if folded else None))
        return self.node("Conv", inputs, [out_shape], **attrs)[0]

    def batchnorm(self, x: str, *, eps: float = 1e-5, params=None) -> str:
        c = self.shapes[x][1]
        gamma, beta, mean, var = params if params is not None else self.bn_params(c, self.value(x))
        inputs = [
            x,
            self.param("weight", gamma),
            self.param("bias", beta),
            self.param("running_mean", mean),
            self.param("running_var", var),
        ]
        (out,) = self.node(
            "BatchNormalization", inputs, [self.shapes[x]], epsilon=float(eps), momentum=0.9
        )
        return out

    def conv_bn(
        self,
        x: str,
        cout: int,
        kernel: Union[int, Sequence[int]],
        *,
        conv_scope: Union[str, int, None] = "conv",
        bn_scope: Union[str, int, None] = "bn",
        eps: float = 1e-5,
        **conv_kw,
    ) -> str:
        """Conv2d(bias=False) + BatchNorm2d, kept apart or folded per the builder's ``bn`` mode.

        Both modes draw the same random numbers, so they compute the same function::

            folded:  W' = W * s[c],  b' = beta[c] - mean[c] * s[c],  s = gamma / sqrt(var + eps)
        """
        cin = self.shapes[x][1]
        groups = conv_kw.get("groups", 1)
        kh, kw = _pair(kernel)
        weight = self.he_weight(cout, cin // groups, kh, kw)  # [C_out, C_in/g, kh, kw]
        observed = None
        if self.value(x) is not None:  # the conv's output on the calibration batch
            attrs, _ = self.conv_geometry(x, cout, kernel, **conv_kw)
            observed = _np_conv(self.value(x), weight, None, **attrs)
        gamma, beta, mean, var = self.bn_params(cout, observed)
        conv_ctx = self.scope(conv_scope) if conv_scope is not None else contextlib.nullcontext()
        bn_ctx = self.scope(bn_scope) if bn_scope is not None else contextlib.nullcontext()
        if self.bn_mode == "folded":
            s = gamma / np.sqrt(var + np.float32(eps))  # [C_out]
            with conv_ctx:
                return self.conv(
                    x,
                    cout,
                    kernel,
                    bias=True,
                    weight=(weight * s[:, None, None, None]).astype(np.float32),
                    bias_value=(beta - mean * s).astype(np.float32),
                    folded=True,
                    **conv_kw,
                )
        with conv_ctx:
            y = self.conv(x, cout, kernel, bias=False, weight=weight, **conv_kw)
        with bn_ctx:
            return self.batchnorm(y, eps=eps, params=(gamma, beta, mean, var))

    def relu(self, x: str) -> str:
        return self.node("Relu", [x], [self.shapes[x]])[0]

    def leaky_relu(self, x: str, alpha: float = 0.01) -> str:
        return self.node("LeakyRelu", [x], [self.shapes[x]], alpha=float(alpha))[0]

    def sigmoid(self, x: str) -> str:
        return self.node("Sigmoid", [x], [self.shapes[x]])[0]

    def silu(self, x: str) -> str:
        """torch's SiLU export: ``Mul(x, Sigmoid(x))``."""
        return self.mul(x, self.sigmoid(x))

    def clip(self, x: str, lo: Optional[float] = 0.0, hi: Optional[float] = 6.0) -> str:
        """ReLU6 and friends: Clip-11 with Constant-node bounds, or Clip-6 with attributes."""
        if self.clip_form == "attributes":
            attrs = {}
            if lo is not None:
                attrs["min"] = float(lo)
            if hi is not None:
                attrs["max"] = float(hi)
            return self.node("Clip", [x], [self.shapes[x]], **attrs)[0]
        inputs = [x, self.constant(lo) if lo is not None else ""]
        if hi is not None:
            inputs.append(self.constant(hi))
        while inputs and inputs[-1] == "":
            inputs.pop()
        return self.node("Clip", inputs, [self.shapes[x]])[0]

    def _broadcast(self, *names: str) -> Shape:
        shapes = [self.shapes[n] for n in names]
        return tuple(int(d) for d in np.broadcast_shapes(*shapes))

    def binary(self, op: str, a: str, b: str) -> str:
        """An element-wise binary op (Add, Sub, Mul, Div) with ONNX broadcasting."""
        return self.node(op, [a, b], [self._broadcast(a, b)])[0]

    def add(self, a: str, b: str) -> str:
        return self.binary("Add", a, b)

    def mul(self, a: str, b: str) -> str:
        return self.binary("Mul", a, b)

    def sum(self, *xs: str) -> str:
        return self.node("Sum", list(xs), [self._broadcast(*xs)])[0]

    def concat(self, xs: Sequence[str], axis: int = 1) -> str:
        shapes = [self.shapes[x] for x in xs]
        rank = len(shapes[0])
        ax = axis % rank
        for s in shapes[1:]:
            if len(s) != rank or any(s[i] != shapes[0][i] for i in range(rank) if i != ax):
                raise ValueError(f"concat on axis {axis} of incompatible shapes {shapes}")
        out = list(shapes[0])
        out[ax] = sum(s[ax] for s in shapes)
        return self.node("Concat", list(xs), [tuple(out)], axis=axis)[0]

    def _pool(self, op: str, x: str, k, s, p, ceil: bool, **attrs) -> str:
        n, c, h, w = self.shapes[x]
        kh, kw = _pair(k)
        sh, sw = _pair(s if s is not None else k)
        ph, pw = _pair(p)
        oh = pool_out(h, kh, sh, ph, ph, ceil)
        ow = pool_out(w, kw, sw, pw, pw, ceil)
        if oh < 1 or ow < 1:
            raise ValueError(f"{op} on {x!r} of shape {[n, c, h, w]} with kernel {kh}x{kw} gives an empty output")
        return self.node(
            op,
            [x],
            [(n, c, oh, ow)],
            ceil_mode=int(ceil),
            kernel_shape=[kh, kw],
            pads=[ph, pw, ph, pw],
            strides=[sh, sw],
            **attrs,
        )[0]

    def maxpool(self, x: str, k, s=None, p=0, *, ceil: bool = False) -> str:
        return self._pool("MaxPool", x, k, s, p, ceil)

    def avgpool(self, x: str, k, s=None, p=0, *, ceil: bool = False, count_include_pad: bool = True) -> str:
        return self._pool("AveragePool", x, k, s, p, ceil, count_include_pad=int(count_include_pad))

    def global_avgpool(self, x: str) -> str:
        n, c = self.shapes[x][:2]
        return self.node("GlobalAveragePool", [x], [(n, c, 1, 1)])[0]

    def flatten(self, x: str) -> str:
        shape = self.shapes[x]
        return self.node("Flatten", [x], [(shape[0], int(np.prod(shape[1:])))], axis=1)[0]

    def linear(self, x: str, out_features: int) -> str:
        """torch.nn.Linear as exported: ``Gemm(x, W, b, transB=1)``."""
        n, fin = self.shapes[x]
        w = (self.rng.standard_normal((out_features, fin)) * math.sqrt(1.0 / fin)).astype(np.float32)
        b = self.uniform_bias(out_features, fin)
        inputs = [x, self.param("weight", w), self.param("bias", b)]
        return self.node("Gemm", inputs, [(n, out_features)], alpha=1.0, beta=1.0, transB=1)[0]

    def classifier(self, x: str, num_classes: int, *, fc_scope: str = "fc") -> str:
        """AdaptiveAvgPool2d(1) -> flatten -> Linear, as torchvision's heads export."""
        with self.scope("avgpool"):
            x = self.global_avgpool(x)
        x = self.flatten(x)
        with self.scope(fc_scope):
            return self.linear(x, num_classes)

    def squeeze_excitation(
        self,
        x: str,
        squeeze: int,
        *,
        activation: Callable[[str], str],
        scale_activation: Callable[[str], str],
        activation_scope: str = "activation",
    ) -> str:
        """torchvision's SqueezeExcitation: AdaptiveAvgPool2d(1) -> fc1 1x1 conv (``squeeze``
        channels) -> ``activation`` -> fc2 1x1 conv (back to x's channels) ->
        ``scale_activation`` -> ``Mul(scale, x)``; ``activation_scope`` names the middle module."""
        channels = self.shapes[x][1]
        with self.scope("avgpool"):
            s = self.global_avgpool(x)
        with self.scope("fc1"):
            s = self.conv(s, squeeze, 1)  # [N, squeeze, 1, 1]
        with self.scope(activation_scope):
            s = activation(s)
        with self.scope("fc2"):
            s = self.conv(s, channels, 1)  # [N, C, 1, 1]
        with self.scope("scale_activation"):
            s = scale_activation(s)
        return self.mul(s, x)

    # ------------------------------------------------------------------ finish
    def build(
        self, outputs: Union[Sequence[str], dict[str, str]], *, doc: str = "", node_names: bool = True
    ) -> onnx.ModelProto:
        """The model with ``outputs`` as graph outputs (a dict renames them, torch's ``output_names``).

        ``node_names=False`` leaves every node unnamed, as some converters do."""
        renames = dict(outputs) if isinstance(outputs, dict) else {}
        out_names = list(renames) if renames else list(outputs)
        if renames:
            inverse = {old: new for new, old in renames.items()}
            for node in self.nodes:
                for i, o in enumerate(node.output):
                    if o in inverse:
                        node.output[i] = inverse[o]
                for i, v in enumerate(node.input):
                    if v in inverse:
                        node.input[i] = inverse[v]
            for old, new in inverse.items():
                self.shapes[new] = self.shapes[old]
        if not node_names:
            for node in self.nodes:
                node.name = ""
        graph = helper.make_graph(
            self.nodes,
            self.name,
            self.inputs,
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, list(self.shapes[o])) for o in out_names],
            initializer=self.initializers,
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", self.opset)],
            producer_name="tvm_layerfuse.testing",
            producer_version="1",
            doc_string=doc,
        )
        model.ir_version = ir_version_for(self.opset)
        return model


def model_inputs(model: onnx.ModelProto) -> dict[str, Shape]:
    """Graph inputs that are not initializers, with their static shapes."""
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim)
    return out


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded standard-normal inputs for every graph input of ``model``."""
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in model_inputs(model).items()}
