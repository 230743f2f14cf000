"""Test models written the way other exporters write them: shape arithmetic, mobile epilogues.

:mod:`.zoo` writes torchvision networks as the TorchScript exporter writes them with fixed
sizes. Models as users bring them also compute their shapes at run time (Paddle2ONNX,
tf2onnx, the TorchScript exporter with ``dynamic_axes``, YOLO's own export), end their
convs in HardSwish/HardSigmoid written out as ``x * Clip(x + 3, 0, 6) / 6``, and gate
channels with squeeze-and-excitation. The builders here write those forms, small, with
seeded live weights (He-normal convs, BatchNorm statistics calibrated on a seeded batch:
see :mod:`._builder`). No PyTorch is needed.

* :func:`flatten_head` - conv stem + a Flatten computed from shapes
  (``Shape -> Gather -> Unsqueeze -> Concat -> Reshape``, or the tf2onnx form with
  ``Slice -> ReduceProd``);
* :func:`shufflenet_v2_block` - ShuffleNetV2 units: channel ``Split``, depthwise branch,
  ``Concat`` and the TorchScript channel shuffle
  (``Shape -> Gather -> Div -> Reshape -> Transpose -> Reshape``);
* :func:`mobilenet_v3_small_like` - torchvision's MobileNetV3-small: HardSwish (the op,
  ``x * HardSigmoid(x)`` or ``x * Clip(x + 3, 0, 6) / 6``), squeeze-and-excitation gates
  with HardSigmoid, depthwise convs;
* :func:`yolo_like` - a YOLOv8-style detector: C2f split/concat blocks with SiLU, SPPF
  max-pool concat, upsample + concat, a head whose reshapes and anchor points are
  computed from shapes;
* :func:`fpn_segmentation` - an FPN segmentation head: ``Resize`` to sizes computed from
  shapes, ``ConvTranspose`` upsampling, a bilinear ``Resize`` back to the input size;

Every builder takes ``batch``, ``image``, ``seed`` and ``opset`` keywords and declares
the batch dimension dynamic (``"N"``), as ``dynamic_axes`` exports do: compile them with
``--input-shape input=B,3,H,W``. The input is ``input``, the outputs ``output`` (and
more where the network has several).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ._builder import NetBuilder, check_options

__all__ = [
    "BUILDERS",
    "dynamic_batch",
    "flatten_head",
    "fpn_segmentation",
    "mobilenet_v3_small_like",
    "shufflenet_v2_block",
    "yolo_like",
]


def _start(
    name: str, *, batch: int, image: int, seed: int, opset: int, bn: str = "separate"
) -> tuple[NetBuilder, str]:
    check_options(opset=opset, bn=bn, clip="inputs", batch=batch, image=image)
    b = NetBuilder(name, seed=seed, opset=opset, bn=bn, clip="inputs", quirks=True)
    return b, b.input("input", (batch, 3, image, image))


def dynamic_batch(model: onnx.ModelProto, *, dims: Sequence[int] = (0,)) -> onnx.ModelProto:
    """The model with the given dims of every graph input and output declared symbolic
    (``N``, ``d2`` ...), as an export with ``dynamic_axes`` writes it."""
    for vi in list(model.graph.input) + list(model.graph.output):
        shape = vi.type.tensor_type.shape
        for k in dims:
            if k < len(shape.dim):
                shape.dim[k].ClearField("dim_value")
                shape.dim[k].dim_param = "N" if k == 0 else f"d{k}"
    return model


# ---------------------------------------------------------------------- shape arithmetic helpers
class _Shapes:
    """Shape arithmetic as exporters write it, on a :class:`NetBuilder` (int64 tensors)."""

    def __init__(self, b: NetBuilder) -> None:
        self.b = b

    def const(self, value, dtype=np.int64) -> str:
        arr = np.asarray(value, dtype=dtype)
        (out,) = self.b.node("Constant", [], [arr.shape], value=numpy_helper.from_array(arr))
        return out

    def shape(self, x: str) -> str:
        return self.b.node("Shape", [x], [(len(self.b.shapes[x]),)])[0]

    def dim(self, shape: str, k: int) -> str:
        """``Gather(shape, k)``: a scalar."""
        return self.b.node("Gather", [shape, self.const(k)], [()], axis=0)[0]

    def unsqueeze(self, scalar: str) -> str:
        if self.b.opset >= 13:
            return self.b.node("Unsqueeze", [scalar, self.const([0])], [(1,)])[0]
        return self.b.node("Unsqueeze", [scalar], [(1,)], axes=[0])[0]

    def vector(self, parts: Sequence) -> str:
        """``Concat`` of scalars (tensor names, unsqueezed) and ints (constants) into a shape."""
        pieces = [self.unsqueeze(p) if isinstance(p, str) else self.const([int(p)]) for p in parts]
        return self.b.node("Concat", pieces, [(len(pieces),)], axis=0)[0]

    def binary(self, op: str, a: str, b) -> str:
        other = b if isinstance(b, str) else self.const(int(b))
        return self.b.node(op, [a, other], [()])[0]

    def reshape(self, x: str, target: str, out_shape: Sequence[int]) -> str:
        return self.b.node("Reshape", [x, target], [tuple(out_shape)])[0]


# ---------------------------------------------------------------------- flatten head
def flatten_head(
    *,
    batch: int = 1,
    image: int = 16,
    form: str = "gather",
    seed: int = 0,
    opset: int = 13,
    num_classes: int = 10,
) -> onnx.ModelProto:
    """Conv-BN-ReLU x2, MaxPool, then a Flatten computed from shapes, then Linear.

    ``form="gather"`` (TorchScript ``x.view(x.size(0), -1)``):
    ``Shape -> Gather(0) -> Unsqueeze -> Concat([n, -1]) -> Reshape``.
    ``form="reduceprod"`` (tf2onnx / Paddle ``flatten``): ``Shape -> Slice(1:) -> ReduceProd``
    and ``Shape -> Slice(0:1)`` -> ``Concat`` -> ``Cast`` -> ``Reshape``; TVM's importer
    refuses it unless the shapes are folded first.
    """
    if form not in ("gather", "reduceprod"):
        raise ValueError(f"form={form!r}; expected 'gather' or 'reduceprod'")
    b, x = _start(f"flatten_head_{form}", batch=batch, image=image, seed=seed, opset=opset)
    s = _Shapes(b)
    with b.scope("features"):
        with b.scope(0):
            x = b.relu(b.conv_bn(x, 8, 3, pad=1))
        with b.scope(1):
            x = b.relu(b.conv_bn(x, 16, 3, stride=2, pad=1))
        x = b.maxpool(x, 2)
    n, c, h, w = b.shapes[x]
    shp = s.shape(x)
    if form == "gather":
        target = s.vector([s.dim(shp, 0), -1])
    else:
        head = b.node("Slice", [shp, s.const([0]), s.const([1])], [(1,)])[0]
        tail = b.node("Slice", [shp, s.const([1]), s.const([4])], [(3,)])[0]
        prod = b.node("ReduceProd", [tail], [(1,)], keepdims=1)[0]
        cat = b.node("Concat", [head, prod], [(2,)], axis=0)[0]
        target = b.node("Cast", [cat], [(2,)], to=TensorProto.INT64)[0]
    flat = s.reshape(x, target, (n, c * h * w))
    with b.scope("fc"):
        out = b.linear(flat, num_classes)
    return dynamic_batch(b.build({"output": out}, doc=f"flatten_head form={form}"))


# ---------------------------------------------------------------------- ShuffleNetV2
def _channel_shuffle(b: NetBuilder, s: _Shapes, x: str, groups: int = 2) -> str:
    """torchvision's ``channel_shuffle`` as the TorchScript exporter writes it with dynamic
    sizes: the view's sizes come from ``x.size()`` and ``num_channels // groups``."""
    n, c, h, w = b.shapes[x]
    shp = s.shape(x)
    dims = [s.dim(shp, k) for k in range(4)]
    per_group = s.binary("Div", dims[1], groups)
    x5 = s.reshape(x, s.vector([dims[0], groups, per_group, dims[2], dims[3]]), (n, groups, c // groups, h, w))
    t = b.node("Transpose", [x5], [(n, c // groups, groups, h, w)], perm=[0, 2, 1, 3, 4])[0]
    shp2 = s.shape(x)  # torch reads x.size() again for the second view
    return s.reshape(t, s.vector([s.dim(shp2, 0), -1, s.dim(shp2, 2), s.dim(shp2, 3)]), (n, c, h, w))


def shufflenet_v2_block(
    *,
    batch: int = 1,
    image: int = 16,
    channels: int = 16,
    seed: int = 0,
    opset: int = 13,
    num_classes: int = 10,
) -> onnx.ModelProto:
    """Stem Conv-BN-ReLU, one stride-2 and one stride-1 ShuffleNetV2 unit, head.

    Stride 2: ``Concat(branch1(x), branch2(x))``; stride 1: ``Split`` x into halves,
    ``Concat(x1, branch2(x2))``; each followed by the channel shuffle. branch2 =
    1x1 Conv-BN-ReLU -> depthwise 3x3 Conv-BN -> 1x1 Conv-BN-ReLU; branch1 = depthwise 3x3
    Conv-BN -> 1x1 Conv-BN-ReLU.
    """
    b, x = _start("shufflenet_v2_block", batch=batch, image=image, seed=seed, opset=opset)
    s = _Shapes(b)
    half = channels // 2

    def branch2(y: str, stride: int) -> str:
        with b.scope(0):
            y = b.conv(y, half, 1, bias=False)
        with b.scope(1):
            y = b.relu(b.batchnorm(y))
        with b.scope(3):
            y = b.conv(y, half, 3, stride=stride, pad=1, groups=half, bias=False)
        with b.scope(4):
            y = b.batchnorm(y)
        with b.scope(5):
            y = b.conv(y, half, 1, bias=False)
        with b.scope(6):
            y = b.relu(b.batchnorm(y))
        return y

    with b.scope("conv1", 0):
        x = b.relu(b.conv_bn(x, channels // 2, 3, stride=1, pad=1, conv_scope=None, bn_scope=None))
    with b.scope("stage2", 0):
        cin = b.shapes[x][1]
        with b.scope("branch1"):
            with b.scope(0):
                y1 = b.conv(x, cin, 3, stride=2, pad=1, groups=cin, bias=False)
            with b.scope(1):
                y1 = b.batchnorm(y1)
            with b.scope(2):
                y1 = b.conv(y1, half, 1, bias=False)
            with b.scope(3):
                y1 = b.relu(b.batchnorm(y1))
        with b.scope("branch2"):
            y2 = branch2(x, 2)
        x = _channel_shuffle(b, s, b.concat([y1, y2]))
    with b.scope("stage2", 1):
        n, c, h, w = b.shapes[x]
        if opset >= 13:
            sizes = b.initializer(b._anon("Constant"), np.array([c // 2, c // 2], np.int64))
            x1, x2 = b.node("Split", [x, sizes], [(n, c // 2, h, w)] * 2, axis=1)
        else:
            x1, x2 = b.node("Split", [x], [(n, c // 2, h, w)] * 2, axis=1, split=[c // 2, c // 2])
        with b.scope("branch2"):
            y2 = branch2(x2, 1)
        x = _channel_shuffle(b, s, b.concat([x1, y2]))
    out = b.classifier(x, num_classes)
    return dynamic_batch(b.build({"output": out}, doc="shufflenet_v2_block"))


# ---------------------------------------------------------------------- MobileNetV3-small
HARDSWISH_FORMS = ("op", "hardsigmoid_mul", "clip_div")

# torchvision mobilenet_v3_small: (in, kernel, expanded, out, use_se, activation, stride)
MOBILENET_V3_SMALL = (
    (16, 3, 16, 16, True, "RE", 2),
    (16, 3, 72, 24, False, "RE", 2),
    (24, 3, 88, 24, False, "RE", 1),
    (24, 5, 96, 40, True, "HS", 2),
    (40, 5, 240, 40, True, "HS", 1),
    (40, 5, 240, 40, True, "HS", 1),
    (40, 5, 120, 48, True, "HS", 1),
    (48, 5, 144, 48, True, "HS", 1),
    (48, 5, 288, 96, True, "HS", 2),
    (96, 5, 576, 96, True, "HS", 1),
    (96, 5, 576, 96, True, "HS", 1),
)


def hardswish(b: NetBuilder, x: str, form: str = "op") -> str:
    """HardSwish as exporters write it: the op (opset >= 14), ``x * HardSigmoid(x)``
    (torch at opset < 14), or ``x * Clip(x + 3, 0, 6) / 6`` (tf2onnx, Paddle, hand-written)."""
    if form == "op":
        return b.node("HardSwish", [x], [b.shapes[x]])[0]
    if form == "hardsigmoid_mul":
        return b.mul(x, hardsigmoid(b, x))
    if form == "clip_div":
        y = b.clip(b.add(x, b.constant(3.0)), 0.0, 6.0)
        return b.binary("Div", b.mul(x, y), b.constant(6.0))
    raise ValueError(f"hardswish form {form!r}; expected one of {HARDSWISH_FORMS}")


def hardsigmoid(b: NetBuilder, x: str) -> str:
    """torch's Hardsigmoid export: ``HardSigmoid(alpha=1/6, beta=0.5)``."""
    return b.node("HardSigmoid", [x], [b.shapes[x]], alpha=1.0 / 6.0, beta=0.5)[0]


def mobilenet_v3_small_like(
    *,
    batch: int = 1,
    image: int = 32,
    width: float = 0.25,
    setting: Sequence[Sequence] = MOBILENET_V3_SMALL,
    hardswish_form: str = "op",
    bn: str = "folded",
    seed: int = 0,
    opset: int = 14,
    num_classes: int = 10,
) -> onnx.ModelProto:
    """torchvision ``mobilenet_v3_small``'s structure at ``width``.

    Stem Conv 3x3/2-BN-HardSwish; inverted residuals: [expand 1x1-BN-act] -> depthwise
    kxk-BN-act -> [squeeze-excitation: GlobalAveragePool -> fc1 1x1 conv -> ReLU -> fc2 1x1
    conv -> HardSigmoid -> ``Mul(scale, x)``] -> project 1x1-BN -> [``Add`` residual];
    last Conv 1x1-BN-HardSwish, GlobalAveragePool, Linear-HardSwish-Linear.
    ``hardswish_form``: one of :data:`HARDSWISH_FORMS`. ``bn="folded"`` (torch's eval-mode
    export folds every BatchNorm into its conv) or ``"separate"``.
    """
    if hardswish_form not in HARDSWISH_FORMS:
        raise ValueError(f"hardswish_form={hardswish_form!r}; expected one of {HARDSWISH_FORMS}")
    if hardswish_form == "op" and opset < 14:
        raise ValueError(f"HardSwish needs opset >= 14, got opset={opset}; pass hardswish_form='hardsigmoid_mul'")
    b, x = _start(f"mobilenet_v3_small_{hardswish_form}", batch=batch, image=image, seed=seed, opset=opset, bn=bn)
    from .zoo import make_divisible

    c = lambda n: make_divisible(n * width)  # noqa: E731
    act = {"RE": b.relu, "HS": lambda y: hardswish(b, y, hardswish_form)}

    def cna(y: str, idx, cout: int, k: int, stride: int = 1, groups: int = 1, activation: str = "HS") -> str:
        with b.scope(idx):
            y = b.conv_bn(y, cout, k, stride=stride, pad=(k - 1) // 2, groups=groups, conv_scope=0, bn_scope=1, eps=1e-3)
            if activation is None:
                return y
            with b.scope(2):
                return act[activation](y)

    with b.scope("features"):
        x = cna(x, 0, c(16), 3, stride=2)
        for i, (cin, k, exp, cout, se, activation, stride) in enumerate(setting, start=1):
            cin, exp, cout = c(cin), c(exp), c(cout)
            with b.scope(i, "block"):
                y, j = x, 0
                if exp != cin:
                    y = cna(y, j, exp, 1, activation=activation)
                    j += 1
                y = cna(y, j, exp, k, stride=stride, groups=exp, activation=activation)
                j += 1
                if se:
                    with b.scope(j):
                        y = b.squeeze_excitation(
                            y,
                            make_divisible(exp // 4, 8),
                            activation=b.relu,
                            scale_activation=lambda s: hardsigmoid(b, s),
                            activation_scope="relu",
                        )
                    j += 1
                y = cna(y, j, cout, 1, activation=None)
            if stride == 1 and cin == cout:
                with b.scope(i):
                    y = b.add(y, x)
            x = y
        x = cna(x, len(setting) + 1, 6 * b.shapes[x][1], 1)
    with b.scope("avgpool"):
        x = b.global_avgpool(x)
    x = b.flatten(x)
    with b.scope("classifier", 0):
        x = b.linear(x, c(1024))
    with b.scope("classifier", 1):
        x = hardswish(b, x, hardswish_form)
    with b.scope("classifier", 3):
        out = b.linear(x, num_classes)
    return dynamic_batch(b.build({"output": out}, doc=f"mobilenet_v3_small_like width={width} hardswish={hardswish_form}"))


# ---------------------------------------------------------------------- YOLO-style detector
def yolo_like(
    *,
    batch: int = 1,
    image: int = 64,
    width: int = 8,
    num_classes: int = 4,
    seed: int = 0,
    opset: int = 13,
) -> onnx.ModelProto:
    """A YOLOv8-style detector as ``export(format="onnx")`` writes it (BatchNorm fused into the
    convs, SiLU as ``Mul(x, Sigmoid(x))``), at ``width`` base channels.

    Backbone: Conv/2 -> Conv/2 -> C2f -> Conv/2 -> C2f -> Conv/2 -> C2f -> SPPF. C2f: cv1 1x1
    -> ``Split`` into halves -> bottlenecks (3x3, 3x3, + shortcut) on the last piece ->
    ``Concat`` of all pieces -> cv2 1x1. SPPF: cv1 -> three MaxPool 5x5 -> ``Concat`` -> cv2.
    Neck: ``Resize`` x2 (nearest) + ``Concat`` with the backbone feature -> C2f, twice.
    Head (two levels, strides 8 and 16): box and class branches -> ``Concat`` -> a
    ``Reshape`` to ``[N, no, h*w]`` whose target is computed from ``Shape``; anchor points
    computed from the feature map's shape (``Shape -> Gather -> Range -> Expand ...``);
    boxes decoded ``(anchor ± distance) * stride``, classes through ``Sigmoid``. Output
    ``[N, 4 + num_classes, A]``.
    """
    b, x = _start("yolo_like", batch=batch, image=image, seed=seed, opset=opset, bn="folded")
    s = _Shapes(b)
    if image % 16:
        raise ValueError(f"image={image}; expected a multiple of 16 (the detector downsamples 16x)")

    def conv(y: str, cout: int, k: int = 1, stride: int = 1, *, name) -> str:
        with b.scope(name):
            y = b.conv_bn(y, cout, k, stride=stride, pad=k // 2, conv_scope="conv", bn_scope="bn", eps=1e-3)
            with b.scope("act"):
                return b.silu(y)

    def c2f(y: str, cout: int, n: int, shortcut: bool, *, name) -> str:
        with b.scope(name):
            c = cout // 2
            y = conv(y, 2 * c, 1, name="cv1")
            nb, _, h, w = b.shapes[y]
            sizes = b.initializer(b._anon("Constant"), np.array([c, c], np.int64))
            pieces = list(b.node("Split", [y, sizes], [(nb, c, h, w)] * 2, axis=1))
            for i in range(n):
                with b.scope("m", i):
                    z = conv(pieces[-1], c, 3, name="cv1")
                    z = conv(z, c, 3, name="cv2")
                    if shortcut:
                        z = b.add(pieces[-1], z)
                pieces.append(z)
            return conv(b.concat(pieces), cout, 1, name="cv2")

    def sppf(y: str, cout: int, *, name) -> str:
        with b.scope(name):
            c = b.shapes[y][1] // 2
            y = conv(y, c, 1, name="cv1")
            with b.scope("m"):
                p1 = b.maxpool(y, 5, 1, 2)
                p2 = b.maxpool(p1, 5, 1, 2)
                p3 = b.maxpool(p2, 5, 1, 2)
            return conv(b.concat([y, p1, p2, p3]), cout, 1, name="cv2")

    def upsample(y: str, *, name) -> str:
        nb, c, h, w = b.shapes[y]
        with b.scope(name):
            scales = b.constant(np.array([1, 1, 2, 2], np.float32), node=True)
            return b.node("Resize", [y, "", scales], [(nb, c, 2 * h, 2 * w)], mode="nearest",
                          coordinate_transformation_mode="asymmetric", nearest_mode="floor")[0]

    c = width
    with b.scope("model"):
        x = conv(x, c, 3, 2, name=0)
        x = conv(x, 2 * c, 3, 2, name=1)
        x = c2f(x, 2 * c, 1, True, name=2)
        x = conv(x, 4 * c, 3, 2, name=3)
        p3 = c2f(x, 4 * c, 1, True, name=4)
        x = conv(p3, 8 * c, 3, 2, name=5)
        x = c2f(x, 8 * c, 1, True, name=6)
        p4 = sppf(x, 8 * c, name=7)
        x = b.concat([upsample(p4, name=8), p3])
        n3 = c2f(x, 4 * c, 1, False, name=9)
        x = conv(n3, 4 * c, 3, 2, name=10)
        n4 = c2f(b.concat([x, p4]), 8 * c, 1, False, name=11)
        outs = []
        anchors, strides = [], []
        no = 4 + num_classes
        with b.scope(12):
            for i, (feat, stride) in enumerate(((n3, 8), (n4, 16))):
                with b.scope("cv2", i):
                    box = conv(conv(feat, 2 * c, 3, name=0), 2 * c, 3, name=1)
                    with b.scope(2):
                        box = b.conv(box, 4, 1)
                with b.scope("cv3", i):
                    cls = conv(conv(feat, 2 * c, 3, name=0), 2 * c, 3, name=1)
                    with b.scope(2):
                        cls = b.conv(cls, num_classes, 1)
                y = b.concat([box, cls])
                nb, _, h, w = b.shapes[y]
                shp = s.shape(y)
                outs.append(s.reshape(y, s.vector([s.dim(shp, 0), no, -1]), (nb, no, h * w)))
                a, st = _anchor_points(b, s, y, stride)
                anchors.append(a)
                strides.append(st)
            x_cat = b.concat(outs, axis=2)
            total = b.shapes[x_cat][2]
            anchor = b.node("Transpose", [b.concat(anchors, axis=0)], [(2, total)], perm=[1, 0])[0]
            stride_t = b.node("Transpose", [b.concat(strides, axis=0)], [(1, total)], perm=[1, 0])[0]
            sizes = b.initializer(b._anon("Constant"), np.array([4, num_classes], np.int64))
            box, cls = b.node("Split", [x_cat, sizes], [(batch, 4, total), (batch, num_classes, total)], axis=1)
            half = b.initializer(b._anon("Constant"), np.array([2, 2], np.int64))
            lt, rb = b.node("Split", [box, half], [(batch, 2, total)] * 2, axis=1)
            x1y1 = b.binary("Sub", anchor, lt)
            x2y2 = b.add(anchor, rb)
            c_xy = b.binary("Div", b.add(x1y1, x2y2), b.constant(2.0))
            wh = b.binary("Sub", x2y2, x1y1)
            dbox = b.mul(b.concat([c_xy, wh]), stride_t)
            out = b.concat([dbox, b.sigmoid(cls)])
    return dynamic_batch(b.build({"output": out}, doc=f"yolo_like image={image} width={width}"))


def yolov8_like(
    *,
    batch: int = 1,
    image: int = 64,
    width: int = 16,
    depth: int = 1,
    num_classes: int = 4,
    reg_max: int = 16,
    seed: int = 0,
    opset: int = 17,
) -> onnx.ModelProto:
    """YOLOv8n's whole graph as ``export(format="onnx")`` writes it (``width=16``: its
    channels 16-32-64-128-256), three levels (strides 8, 16, 32).

    Backbone Conv/2, Conv/2, C2f, Conv/2, C2f (P3), Conv/2, C2f (P4), Conv/2, C2f, SPPF (P5);
    neck: ``Resize`` x2 + ``Concat`` twice top-down (C2f after each), then Conv/2 +
    ``Concat`` twice bottom-up (C2f after each); Detect head per level: box branch to
    ``4 * reg_max`` channels and class branch, ``Concat``, a ``Reshape`` to ``[N, no, -1]``
    from ``Shape``; the levels' ``Concat``, ``Split`` into box and class, DFL (``Reshape ->
    Transpose -> Softmax -> 1x1 Conv`` with weights ``0..reg_max-1``), anchor points from
    ``Shape``, ``dist2bbox``. Output ``[N, 4 + num_classes, A]``."""
    b, x = _start("yolov8_like", batch=batch, image=image, seed=seed, opset=opset, bn="folded")
    s = _Shapes(b)
    if image % 32:
        raise ValueError(f"image={image}; expected a multiple of 32 (the detector downsamples 32x)")

    def conv(y: str, cout: int, k: int = 1, stride: int = 1, *, name) -> str:
        with b.scope(name):
            y = b.conv_bn(y, cout, k, stride=stride, pad=k // 2, conv_scope="conv", bn_scope="bn", eps=1e-3)
            with b.scope("act"):
                return b.silu(y)

    def c2f(y: str, cout: int, shortcut: bool, *, name) -> str:
        with b.scope(name):
            c = cout // 2
            y = conv(y, 2 * c, 1, name="cv1")
            nb, _, h, w = b.shapes[y]
            sizes = b.initializer(b._anon("Constant"), np.array([c, c], np.int64))
            pieces = list(b.node("Split", [y, sizes], [(nb, c, h, w)] * 2, axis=1))
            for i in range(depth):
                with b.scope("m", i):
                    z = conv(conv(pieces[-1], c, 3, name="cv1"), c, 3, name="cv2")
                    if shortcut:
                        z = b.add(pieces[-1], z)
                pieces.append(z)
            return conv(b.concat(pieces), cout, 1, name="cv2")

    def upsample(y: str, *, name) -> str:
        nb, c, h, w = b.shapes[y]
        with b.scope(name):
            scales = b.constant(np.array([1, 1, 2, 2], np.float32), node=True)
            return b.node("Resize", [y, "", scales], [(nb, c, 2 * h, 2 * w)], mode="nearest",
                          coordinate_transformation_mode="asymmetric", nearest_mode="floor")[0]  # fmt: skip

    c = width
    with b.scope("model"):
        x = conv(conv(x, c, 3, 2, name=0), 2 * c, 3, 2, name=1)
        x = c2f(x, 2 * c, True, name=2)
        p3 = c2f(conv(x, 4 * c, 3, 2, name=3), 4 * c, True, name=4)
        p4 = c2f(conv(p3, 8 * c, 3, 2, name=5), 8 * c, True, name=6)
        x = c2f(conv(p4, 16 * c, 3, 2, name=7), 16 * c, True, name=8)
        with b.scope(9):
            half = b.shapes[x][1] // 2
            y = conv(x, half, 1, name="cv1")
            with b.scope("m"):
                p1 = b.maxpool(y, 5, 1, 2)
                p2 = b.maxpool(p1, 5, 1, 2)
                p3_ = b.maxpool(p2, 5, 1, 2)
            p5 = conv(b.concat([y, p1, p2, p3_]), 16 * c, 1, name="cv2")
        n4 = c2f(b.concat([upsample(p5, name=10), p4]), 8 * c, False, name=12)
        n3 = c2f(b.concat([upsample(n4, name=13), p3]), 4 * c, False, name=15)
        m4 = c2f(b.concat([conv(n3, 4 * c, 3, 2, name=16), n4]), 8 * c, False, name=18)
        m5 = c2f(b.concat([conv(m4, 8 * c, 3, 2, name=19), p5]), 16 * c, False, name=21)
        no = 4 * reg_max + num_classes
        c2, c3 = max(16, 4 * reg_max // 4, 4 * reg_max), max(4 * c, num_classes)
        outs, anchors, strides = [], [], []
        with b.scope(22):
            for i, (feat, stride) in enumerate(((n3, 8), (m4, 16), (m5, 32))):
                with b.scope("cv2", i):
                    box = conv(conv(feat, c2, 3, name=0), c2, 3, name=1)
                    with b.scope(2):
                        box = b.conv(box, 4 * reg_max, 1)
                with b.scope("cv3", i):
                    cls = conv(conv(feat, c3, 3, name=0), c3, 3, name=1)
                    with b.scope(2):
                        cls = b.conv(cls, num_classes, 1)
                y = b.concat([box, cls])
                nb, _, h, w = b.shapes[y]
                shp = s.shape(y)
                outs.append(s.reshape(y, s.vector([s.dim(shp, 0), no, -1]), (nb, no, h * w)))
                a, st = _anchor_points(b, s, y, stride)
                anchors.append(a)
                strides.append(st)
            x_cat = b.concat(outs, axis=2)
            total = b.shapes[x_cat][2]
            anchor = b.node("Transpose", [b.concat(anchors, axis=0)], [(2, total)], perm=[1, 0])[0]
            stride_t = b.node("Transpose", [b.concat(strides, axis=0)], [(1, total)], perm=[1, 0])[0]
            sizes = b.initializer(b._anon("Constant"), np.array([4 * reg_max, num_classes], np.int64))
            box, cls = b.node("Split", [x_cat, sizes], [(batch, 4 * reg_max, total), (batch, num_classes, total)], axis=1)
            with b.scope("dfl"):
                d = s.reshape(box, s.const([batch, 4, reg_max, total]), (batch, 4, reg_max, total))
                d = b.node("Transpose", [d], [(batch, reg_max, 4, total)], perm=[0, 2, 1, 3])[0]
                d = b.node("Softmax", [d], [(batch, reg_max, 4, total)], axis=1)[0]
                with b.scope("conv"):
                    proj = np.arange(reg_max, dtype=np.float32).reshape(1, reg_max, 1, 1)
                    d = b.conv(d, 1, 1, bias=False, weight=proj)
                box = s.reshape(d, s.const([batch, 4, total]), (batch, 4, total))
            half = b.initializer(b._anon("Constant"), np.array([2, 2], np.int64))
            lt, rb = b.node("Split", [box, half], [(batch, 2, total)] * 2, axis=1)
            x1y1 = b.binary("Sub", anchor, lt)
            x2y2 = b.add(anchor, rb)
            c_xy = b.binary("Div", b.add(x1y1, x2y2), b.constant(2.0))
            wh = b.binary("Sub", x2y2, x1y1)
            dbox = b.mul(b.concat([c_xy, wh]), stride_t)
            out = b.concat([dbox, b.sigmoid(cls)])
    return dynamic_batch(b.build({"output": out}, doc=f"yolov8_like image={image} width={width}"))


def _anchor_points(b: NetBuilder, s: _Shapes, feat: str, stride: int) -> tuple[str, str]:
    """``make_anchors`` as traced with dynamic sizes: cell centres ``[h*w, 2]`` (x, y) and
    strides ``[h*w, 1]``, computed from ``Shape(feat)``."""
    _, _, h, w = b.shapes[feat]
    shp = s.shape(feat)
    hh, ww = s.dim(shp, 2), s.dim(shp, 3)
    f = TensorProto.FLOAT

    def centres(n: str, size: int) -> str:
        r = b.node("Range", [s.const(0), n, s.const(1)], [(size,)])[0]
        return b.add(b.node("Cast", [r], [(size,)], to=f)[0], b.constant(0.5, node=True))

    sx = b.node("Unsqueeze", [centres(ww, w), s.const([0])], [(1, w)])[0]
    sy = b.node("Unsqueeze", [centres(hh, h), s.const([1])], [(h, 1)])[0]
    hw = s.vector([hh, ww])
    gx = b.node("Expand", [sx, hw], [(h, w)])[0]
    gy = b.node("Expand", [sy, hw], [(h, w)])[0]
    gx = b.node("Unsqueeze", [gx, s.const([-1])], [(h, w, 1)])[0]
    gy = b.node("Unsqueeze", [gy, s.const([-1])], [(h, w, 1)])[0]
    grid = b.concat([gx, gy], axis=-1)
    points = s.reshape(grid, s.const([-1, 2]), (h * w, 2))
    count = s.vector([s.binary("Mul", hh, ww), 1])
    strides = b.node("ConstantOfShape", [count], [(h * w, 1)],
                     value=numpy_helper.from_array(np.array([float(stride)], np.float32)))[0]
    return points, strides


# ---------------------------------------------------------------------- FPN / segmentation
def fpn_segmentation(
    *,
    batch: int = 1,
    image: int = 32,
    width: int = 8,
    num_classes: int = 5,
    seed: int = 0,
    opset: int = 13,
) -> onnx.ModelProto:
    """An FPN segmentation net as torchvision-style code exports it with dynamic sizes.

    Backbone Conv-BN-ReLU/2 x3 (C2, C3, C4); lateral 1x1 convs; top-down path
    ``P3 = L3 + Resize(P4, sizes=Shape(L3)[2:])`` (``F.interpolate(size=...)``: nearest,
    target computed from shapes) and ``P2 = L2 + ConvTranspose(P3)`` (stride 2); head
    Conv-BN-ReLU -> ConvTranspose x2 -> 1x1 classes -> ``Resize`` bilinear to the input's
    size (computed from ``Shape(input)``).
    """
    b, x = _start("fpn_segmentation", batch=batch, image=image, seed=seed, opset=opset)
    s = _Shapes(b)
    if image % 8:
        raise ValueError(f"image={image}; expected a multiple of 8")

    def cbr(y: str, cout: int, k: int, stride: int, *, name) -> str:
        with b.scope(name):
            return b.relu(b.conv_bn(y, cout, k, stride=stride, pad=k // 2))

    def sizes_of(ref: str) -> str:  # Shape(ref)[2:] as Resize's "sizes" with N, C of the input kept
        shp = s.shape(ref)
        return b.node("Slice", [shp, s.const([2]), s.const([4])], [(2,)])[0]

    def resize(y: str, ref: str, mode: str, out_hw) -> str:
        nb, c = b.shapes[y][:2]
        shp = s.shape(y)
        head = b.node("Slice", [shp, s.const([0]), s.const([2])], [(2,)])[0]
        target = b.node("Concat", [head, sizes_of(ref)], [(4,)], axis=0)[0]
        attrs = {"mode": mode, "coordinate_transformation_mode": "asymmetric" if mode == "nearest" else "half_pixel"}
        if mode == "nearest":
            attrs["nearest_mode"] = "floor"
        return b.node("Resize", [y, "", "", target], [(nb, c, *out_hw)], **attrs)[0]

    def deconv(y: str, cout: int, *, name) -> str:
        nb, cin, h, w = b.shapes[y]
        with b.scope(name):
            wgt = b.param("weight", b.he_weight(cin, cout, 2, 2))  # ConvTranspose: [C_in, C_out, kh, kw]
            bias = b.param("bias", b.uniform_bias(cout, cin * 4))
            return b.node("ConvTranspose", [y, wgt, bias], [(nb, cout, 2 * h, 2 * w)], kernel_shape=[2, 2],
                          strides=[2, 2], pads=[0, 0, 0, 0], dilations=[1, 1], group=1)[0]

    c = width
    with b.scope("backbone"):
        c2 = cbr(x, c, 3, 2, name="layer1")
        c3 = cbr(c2, 2 * c, 3, 2, name="layer2")
        c4 = cbr(c3, 4 * c, 3, 2, name="layer3")
    with b.scope("fpn"):
        with b.scope("inner", 0):
            l2 = b.conv(c2, c, 1)
        with b.scope("inner", 1):
            l3 = b.conv(c3, c, 1)
        with b.scope("inner", 2):
            p4 = b.conv(c4, c, 1)
        p3 = b.add(l3, resize(p4, l3, "nearest", b.shapes[l3][2:]))
        p2 = b.add(l2, deconv(p3, c, name="up"))
    with b.scope("head"):
        y = cbr(p2, c, 3, 1, name=0)
        y = b.relu(deconv(y, c, name=1))
        with b.scope("classifier"):
            y = b.conv(y, num_classes, 1)
        out = resize(y, x, "linear", (image, image))
    return dynamic_batch(b.build({"output": out}, doc=f"fpn_segmentation image={image} width={width}"))


BUILDERS: dict[str, Callable[..., onnx.ModelProto]] = {
    "flatten_head_gather": lambda **kw: flatten_head(form="gather", **kw),
    "flatten_head_reduceprod": lambda **kw: flatten_head(form="reduceprod", **kw),
    "shufflenet_v2_block": shufflenet_v2_block,
    "mobilenet_v3_small_op": lambda **kw: mobilenet_v3_small_like(hardswish_form="op", **kw),
    "mobilenet_v3_small_hardsigmoid_mul": lambda **kw: mobilenet_v3_small_like(
        hardswish_form="hardsigmoid_mul", opset=13, **kw
    ),
    "mobilenet_v3_small_clip_div": lambda **kw: mobilenet_v3_small_like(hardswish_form="clip_div", **kw),
    "yolo_like": yolo_like,
    "fpn_segmentation": fpn_segmentation,
}
"""Every builder by name; each compiles with ``--input-shape input=1,3,IMAGE,IMAGE``."""


# ---------------------------------------------------------------------- Paddle2ONNX style
# Paddle2ONNX writes the shapes Paddle computes as int32 tensors (``paddle.shape`` and
# ``fill_constant`` are int32) and casts them to int64 where an ONNX op reads them; it
# writes Paddle's operand order (``paddle.add(identity, x)``, ``paddle.multiply(x,
# gate)``), keeps BatchNorm apart from bias-free convs, uses Paddle's HardSigmoid (slope
# 0.2), writes Linear as ``MatMul + Add`` and names nodes ``p2o.<Op>.<k>``. Its declared
# output shapes keep symbolic dims (``p2o.DynamicDimension.<k>``) even for fixed inputs.


class _Paddle(_Shapes):
    """Paddle2ONNX's shape arithmetic: int32 shapes, ``Cast`` to int64 where ONNX reads them."""

    def const32(self, value) -> str:
        return self.const(value, np.int32)

    def cast(self, x: str, to: int) -> str:
        return self.b.node("Cast", [x], [self.b.shapes[x]], to=to)[0]

    def shape32(self, x: str) -> str:
        """``paddle.shape(x)``: ``Shape -> Cast(int32)``."""
        return self.cast(self.shape(x), TensorProto.INT32)

    def piece(self, shape32: str, k: int) -> str:
        """``shape[k:k+1]`` (int32, one element)."""
        return self.b.node("Slice", [shape32, self.const32([k]), self.const32([k + 1]), self.const32([0])], [(1,)])[0]

    def target(self, pieces: Sequence, *, cast: str = "after") -> str:
        """A Reshape target from int32 pieces (names) and ints (``fill_constant`` int32
        tensors). ``cast="after"``: ``Concat`` in int32, then one ``Cast`` to int64 (a
        ``reshape2`` with a constant shape list); ``cast="each"``: every piece ``Cast`` to
        int64, then ``Concat`` (a ``reshape2`` with a ``ShapeTensor`` list)."""
        parts = [p if isinstance(p, str) else self.const32([int(p)]) for p in pieces]
        if cast == "each":
            parts = [self.cast(p, TensorProto.INT64) for p in parts]
            return self.b.node("Concat", parts, [(len(parts),)], axis=0)[0]
        cat = self.b.node("Concat", parts, [(len(parts),)], axis=0)[0]
        return self.cast(cat, TensorProto.INT64)

    def linear(self, x: str, cout: int) -> str:
        """``paddle.nn.Linear``: ``MatMul(x, W[in, out]) + b``."""
        b = self.b
        cin = b.shapes[x][-1]
        w = b.param("w_0", (b.rng.standard_normal((cin, cout)) / np.sqrt(cin)).astype(np.float32))
        bias = b.param("b_0", b.uniform_bias(cout, cin))
        y = b.node("MatMul", [x, w], [tuple(b.shapes[x][:-1]) + (cout,)])[0]
        return b.add(y, bias)


def p2o_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """Paddle2ONNX's node names: ``p2o.<Op>.<k>`` numbered per op type, in graph order."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        k = counts.get(node.op_type, 0)
        counts[node.op_type] = k + 1
        node.name = f"p2o.{node.op_type}.{k}"
    return model


def _p2o_declared_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every graph output's dims symbolic, as Paddle2ONNX declares them."""
    k = 0
    for vi in model.graph.output:
        for d in vi.type.tensor_type.shape.dim:
            d.ClearField("dim_value")
            d.dim_param = f"p2o.DynamicDimension.{k}"
            k += 1
    return model


def _p2o_hardswish(b: NetBuilder, x: str) -> str:
    """Paddle2ONNX's hardswish: the op from opset 14, ``x * HardSigmoid(x)`` below."""
    return hardswish(b, x, "op" if b.opset >= 14 else "hardsigmoid_mul")


def _p2o_block(b: NetBuilder, x: str, *, k: int, exp: int, cout: int, stride: int, se: bool, act: str) -> str:
    """PaddleOCR's MobileNetV3 ResidualUnit: [expand 1x1-BN-act] -> depthwise kxk-BN-act ->
    [SE: pool -> 1x1 -> ReLU -> 1x1 -> HardSigmoid(0.2, 0.5) -> ``Mul(x, gate)``] ->
    1x1-BN -> [``Add(identity, x)``]."""
    cin = b.shapes[x][1]
    activation = b.relu if act == "relu" else (lambda y: _p2o_hardswish(b, y))

    def cbn(y, c, kernel, stride=1, groups=1, a=True):
        y = b.conv_bn(y, c, kernel, stride=stride, pad=(kernel - 1) // 2, groups=groups, conv_scope="conv", bn_scope="bn")
        return activation(y) if a else y

    y = cbn(x, exp, 1) if exp != cin else x
    y = cbn(y, exp, k, stride=stride, groups=exp)
    if se:
        with b.scope("mid_se"):
            s = b.global_avgpool(y)
            with b.scope("conv1"):
                s = b.relu(b.conv(s, max(exp // 4, 8), 1))
            with b.scope("conv2"):
                s = b.conv(s, exp, 1)
            s = b.node("HardSigmoid", [s], [b.shapes[s]], alpha=0.2, beta=0.5)[0]
            y = b.mul(y, s)
    y = cbn(y, cout, 1, a=False)
    if stride == 1 and cin == cout:
        y = b.add(x, y)
    return y


# (kernel, expanded, out, se, activation, stride): PaddleOCR's MobileNetV3 "small" at scale 0.35
P2O_BLOCKS = (
    (3, 16, 8, True, "relu", 2),
    (3, 24, 8, False, "relu", 1),
    (3, 32, 16, False, "relu", 2),
    (5, 48, 16, True, "hardswish", 1),
    (5, 48, 16, True, "hardswish", 1),
    (5, 64, 24, True, "hardswish", 2),
    (5, 96, 24, True, "hardswish", 1),
)


def p2o_text_direction_classifier(
    *, batch: int = 1, image: int = 32, seed: int = 0, opset: int = 13, num_classes: int = 2
) -> onnx.ModelProto:
    """A PaddleOCR text-direction classifier (MobileNetV3-small backbone) as Paddle2ONNX
    writes it: bias-free convs + BatchNorm, HardSwish, SE gates with Paddle's HardSigmoid,
    ``Add(identity, x)`` residuals; head ``GlobalAveragePool -> Reshape([0, -1])`` whose
    target is int32 ``fill_constant`` s cast to int64 and concatenated (no ``Shape`` op:
    shape inference leaves its dims unknown), ``MatMul + Add``, ``Softmax``. The output is
    declared ``[p2o.DynamicDimension.0, p2o.DynamicDimension.1]``. Input ``[N, 3, image,
    2*image]`` (a text line)."""
    check_options(opset=opset, bn="separate", batch=batch, image=image)
    b = NetBuilder("p2o_text_direction_classifier", seed=seed, opset=opset, bn="separate", quirks=False)
    x = b.input("input", (batch, 3, image, 2 * image))
    p = _Paddle(b)
    with b.scope("conv1"):
        x = _p2o_hardswish(b, b.conv_bn(x, 8, 3, stride=2, pad=1, conv_scope="conv", bn_scope="bn"))
    for i, (k, exp, cout, se, act, stride) in enumerate(P2O_BLOCKS):
        with b.scope(f"stage{i}"):
            x = _p2o_block(b, x, k=k, exp=exp, cout=cout, stride=stride, se=se, act=act)
    with b.scope("last_conv"):
        x = _p2o_hardswish(b, b.conv_bn(x, 96, 1, conv_scope="conv", bn_scope="bn"))
    x = b.global_avgpool(x)
    n, c = b.shapes[x][:2]
    flat = p.reshape(x, p.target([0, -1]), (n, c))
    with b.scope("fc"):
        logits = p.linear(flat, num_classes)
    out = b.node("Softmax", [logits], [(n, num_classes)], axis=-1)[0]
    model = b.build({"output": out}, doc="p2o_text_direction_classifier")
    return _p2o_declared_outputs(p2o_names(dynamic_batch(model)))


def p2o_text_recognizer(
    *, batch: int = 1, image: int = 32, seed: int = 0, opset: int = 13, num_classes: int = 12, width: int = 16
) -> onnx.ModelProto:
    """A CRNN/SVTR-style text recognizer as Paddle2ONNX writes it. Input ``[N, 3, image,
    2*image]``.

    Conv-BN-HardSwish/2 x2 -> ``flatten(2).transpose([0, 2, 1])`` to a sequence ``[N, HW,
    C]`` (target ``[n, c, -1]`` from ``paddle.shape`` pieces, each cast to int64: the
    ``-1`` is an int32 ``fill_constant`` cast on its own) -> mixer ``x + fc2(hardswish(
    fc1(x)))`` -> back to ``[N, C, H, W]`` (a target from ``paddle.shape`` of the sequence
    and the feature map's ``H``) -> Conv-BN-HardSwish -> ``AveragePool`` over the height ->
    ``Squeeze`` -> ``Transpose`` to ``[N, T, C]`` -> CTC head ``MatMul + Add`` ->
    ``Softmax``. Output ``[N, T, num_classes]``, declared with symbolic dims."""
    check_options(opset=opset, bn="separate", batch=batch, image=image)
    if image % 4:
        raise ValueError(f"image={image}; expected a multiple of 4 (the recognizer downsamples 4x)")
    b = NetBuilder("p2o_text_recognizer", seed=seed, opset=opset, bn="separate", quirks=False)
    x = b.input("input", (batch, 3, image, 2 * image))
    p = _Paddle(b)
    c = width
    with b.scope("conv1"):
        x = _p2o_hardswish(b, b.conv_bn(x, c, 3, stride=2, pad=1, conv_scope="conv", bn_scope="bn"))
    with b.scope("conv2"):
        x = _p2o_hardswish(b, b.conv_bn(x, 2 * c, 3, stride=2, pad=1, conv_scope="conv", bn_scope="bn"))
    n, ch, h, w = b.shapes[x]
    shp = p.shape32(x)
    flat = p.reshape(x, p.target([p.piece(shp, 0), p.piece(shp, 1), -1], cast="each"), (n, ch, h * w))
    seq = b.node("Transpose", [flat], [(n, h * w, ch)], perm=[0, 2, 1])[0]
    with b.scope("mixer"):
        with b.scope("fc1"):
            y = _p2o_hardswish(b, p.linear(seq, 2 * ch))
        with b.scope("fc2"):
            y = p.linear(y, ch)
        seq = b.add(seq, y)
    back = b.node("Transpose", [seq], [(n, ch, h * w)], perm=[0, 2, 1])[0]
    sshp = p.shape32(seq)  # the sequence's shape: known only once the first target is folded
    img = p.reshape(back, p.target([p.piece(sshp, 0), p.piece(sshp, 2), h, -1], cast="each"), (n, ch, h, w))
    with b.scope("conv3"):
        y = _p2o_hardswish(b, b.conv_bn(img, 2 * ch, 1, conv_scope="conv", bn_scope="bn"))
    y = b.node("AveragePool", [y], [(n, 2 * ch, 1, w)], kernel_shape=[h, 1], strides=[h, 1], pads=[0, 0, 0, 0])[0]
    y = b.node("Squeeze", [y, p.const([2])], [(n, 2 * ch, w)])[0]
    y = b.node("Transpose", [y], [(n, w, 2 * ch)], perm=[0, 2, 1])[0]
    with b.scope("head", "fc"):
        logits = p.linear(y, num_classes)
    out = b.node("Softmax", [logits], [(n, w, num_classes)], axis=2)[0]
    model = b.build({"output": out}, doc="p2o_text_recognizer")
    return _p2o_declared_outputs(p2o_names(dynamic_batch(model)))


def p2o_db_detector(
    *,
    batch: int = 1,
    image: int = 64,
    seed: int = 0,
    opset: int = 13,
    inner: int = 16,
    head: int = 4,
    neck: str = "rse",
) -> onnx.ModelProto:
    """A PaddleOCR DB text detector as Paddle2ONNX writes it. Input ``[N, 3, image, image]``.

    Backbone: Conv-BN-HardSwish/2, the :data:`P2O_BLOCKS` residual units (features at
    strides 4, 8, 16) and a last stride-2 unit (stride 32). DBFPN: bias-free 1x1 ``in``
    convs, ``out = in + Resize(up, x2, nearest)`` top-down, bias-free 3x3 ``p`` convs,
    each upsampled to stride 4 (``Resize`` x8/x4/x2) and concatenated. ``neck="rse"``
    (PP-OCRv3's RSEFPN): every ``in``/``p`` conv is a residual squeeze-and-excitation layer,
    ``x + x * hardsigmoid(conv2(relu(conv1(pool(x)))))`` with ``x`` the bias-free conv. DBHead: 3x3
    Conv-BN-ReLU -> ConvTranspose 2x2/2-BN-ReLU -> ConvTranspose 2x2/2 -> Sigmoid.
    Output ``[N, 1, image, image]``, declared with symbolic dims."""
    check_options(opset=opset, bn="separate", batch=batch, image=image)
    if neck not in ("fpn", "rse"):
        raise ValueError(f"neck={neck!r}; expected 'fpn' or 'rse'")
    if image % 32:
        raise ValueError(f"image={image}; expected a multiple of 32 (the detector downsamples 32x)")
    b = NetBuilder("p2o_db_detector", seed=seed, opset=opset, bn="separate", quirks=False)
    x = b.input("input", (batch, 3, image, image))
    with b.scope("conv1"):
        x = _p2o_hardswish(b, b.conv_bn(x, 8, 3, stride=2, pad=1, conv_scope="conv", bn_scope="bn"))
    feats = []
    blocks = list(P2O_BLOCKS) + [(5, 96, 32, True, "hardswish", 2), (5, 128, 32, True, "hardswish", 1)]
    for i, (k, exp, cout, se, act, stride) in enumerate(blocks):
        if stride == 2 and i > 0:
            feats.append(x)
        with b.scope(f"stage{i}"):
            x = _p2o_block(b, x, k=k, exp=exp, cout=cout, stride=stride, se=se, act=act)
    feats.append(x)  # strides 4, 8, 16, 32

    def up(y: str, factor: int) -> str:
        nb, c, h, w = b.shapes[y]
        scales = b.constant(np.array([1, 1, factor, factor], np.float32), node=True)
        return b.node("Resize", [y, "", scales], [(nb, c, factor * h, factor * w)], mode="nearest",
                      coordinate_transformation_mode="asymmetric", nearest_mode="floor")[0]  # fmt: skip

    def rse(y: str, cout: int, k: int) -> str:
        """RSELayer: ``x = in_conv(y); x + x * SE(x)`` (PaddleOCR's SEModule, reduction 4)."""
        with b.scope("in_conv"):
            x = b.conv(y, cout, k, pad=k // 2, bias=False)
        if neck == "fpn":
            return x
        with b.scope("se_block"):
            s = b.global_avgpool(x)
            with b.scope("conv1"):
                s = b.relu(b.conv(s, max(cout // 4, 1), 1))
            with b.scope("conv2"):
                s = b.conv(s, cout, 1)
            s = b.node("HardSigmoid", [s], [b.shapes[s]], alpha=0.2, beta=0.5)[0]
            gated = b.mul(x, s)
        return b.add(x, gated)

    with b.scope("neck"):
        ins = []
        for i, f in enumerate(feats):
            with b.scope("ins_conv", i):
                ins.append(rse(f, inner, 1))
        outs = [ins[3]]
        for lvl in (2, 1, 0):
            outs.insert(0, b.add(ins[lvl], up(outs[0], 2)))
        ps = []
        for i, o in enumerate(outs):
            with b.scope("inp_conv", i):
                ps.append(rse(o, inner // 4, 3))
        fuse = b.concat([up(ps[3], 8), up(ps[2], 4), up(ps[1], 2), ps[0]])

    def deconv(y: str, cout: int) -> str:
        nb, cin, h, w = b.shapes[y]
        wgt = b.param("weight", b.he_weight(cin, cout, 2, 2))  # ConvTranspose: [C_in, C_out, kh, kw]
        bias = b.param("bias", b.uniform_bias(cout, cin * 4))
        return b.node("ConvTranspose", [y, wgt, bias], [(nb, cout, 2 * h, 2 * w)], kernel_shape=[2, 2],
                      strides=[2, 2], pads=[0, 0, 0, 0], dilations=[1, 1], group=1)[0]  # fmt: skip

    with b.scope("head", "binarize"):
        with b.scope("conv1"):
            y = b.relu(b.conv_bn(fuse, head, 3, pad=1, conv_scope="conv", bn_scope="bn"))
        with b.scope("conv2"):
            y = b.relu(b.batchnorm(deconv(y, head)))
        with b.scope("conv3"):
            y = deconv(y, 1)
        out = b.sigmoid(y)
    model = b.build({"output": out}, doc="p2o_db_detector")
    return _p2o_declared_outputs(p2o_names(dynamic_batch(model)))
