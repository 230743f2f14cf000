"""Test models: torchvision architectures as ``torch.onnx.export`` writes them, made small.

Each builder returns an ``onnx.ModelProto`` with the graph *structure* of the torchvision
network (same modules, same node order, same attribute spelling, same export quirks) at
a reduced width and depth and a small input, so that TVM compiles it in seconds. No
PyTorch is needed.

Common keyword options (every builder):

``batch=1``, ``image=32``
    input ``[batch, 3, image, image]`` (``inception_v3`` needs ``image >= 75``).
``width``
    channel multiplier applied to every torchvision channel count (rounded, >= 1; the
    MobileNet/EfficientNet builders round to a multiple of 8 as torchvision does).
``seed=0``
    weights from ``np.random.default_rng(seed)``: He-normal convs, BatchNorm statistics
    near identity, so activations stay O(1) through the net.
``bn="separate" | "folded"``
    keep ``BatchNormalization`` nodes after convs, or fold them into the conv's weight and
    bias as torch's eval-mode export does. Both draw the same numbers: same function.
    Pre-activation BatchNorms (DenseNet) are never folded, as in torch.
``opset=13``
    default-domain opset (10..21).
``quirks=True``
    torch export quirks: ``Identity`` nodes on some weights, ``Constant`` nodes for
    scalar constants (Clip bounds). Always: every Conv attribute explicit, bias inside
    Conv, ``GlobalAveragePool`` + ``Flatten`` + ``Gemm(transB=1)`` classifier.
``num_classes=10``

The graph input is named ``input`` and the output ``output`` (torch's ``input_names`` /
``output_names``).

:func:`light_models` and :func:`light_reference` give the nine networks of the ONNX model
zoo that the ``onnx`` package ships as "light" test models (weights are
``ConstantOfShape`` constants, 224x224 inputs).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from ..models import LIGHT_MODELS, light_dir
from ._builder import NetBuilder, check_options, model_inputs, random_inputs

__all__ = [
    "BUILDERS",
    "DENSENET121_FULL",
    "densenet121",
    "efficientnet_like",
    "googlenet",
    "inception_v3",
    "light_models",
    "light_reference",
    "live_light_model",
    "mobilenet_v2",
    "model_inputs",
    "random_inputs",
    "resnet18",
    "resnet50",
    "squeezenet1_1",
]


def _ch(c: int, width: float) -> int:
    """A torchvision channel count scaled by ``width`` (at least 1)."""
    return max(1, int(round(c * width)))


def make_divisible(v: float, divisor: int = 8, min_value: Optional[int] = None) -> int:
    """torchvision's ``_make_divisible``: round to a multiple of ``divisor``, never below 90 %."""
    min_value = min_value or divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def _start(name: str, *, batch: int, image: int, seed: int, opset: int, bn: str, quirks: bool, calibrate: bool = True):
    clip = "attributes" if isinstance(opset, int) and opset <= 10 else "inputs"  # the form the opset has
    check_options(opset=opset, bn=bn, clip=clip, batch=batch, image=image)
    b = NetBuilder(name, seed=seed, opset=opset, bn=bn, clip=clip, quirks=quirks, calibrate=calibrate)
    x = b.input("input", (batch, 3, image, image))
    return b, x


def _basic_conv(b: NetBuilder, x: str, name: str, cout: int, kernel, eps: float = 1e-3, **kw) -> str:
    """torchvision's BasicConv2d (GoogLeNet, Inception v3): Conv(bias=False) -> BN -> ReLU."""
    with b.scope(name):
        return b.relu(b.conv_bn(x, cout, kernel, eps=eps, **kw))


# ---------------------------------------------------------------------- GoogLeNet
_GOOGLENET_BLOCKS = (
    # name, ch1x1, ch3x3red, ch3x3, ch5x5red, ch5x5, pool_proj  (in_channels follow)
    ("inception3a", 64, 96, 128, 16, 32, 32),
    ("inception3b", 128, 128, 192, 32, 96, 64),
    ("maxpool3", 3),
    ("inception4a", 192, 96, 208, 16, 48, 64),
    ("inception4b", 160, 112, 224, 24, 64, 64),
    ("inception4c", 128, 128, 256, 24, 64, 64),
    ("inception4d", 112, 144, 288, 32, 64, 64),
    ("inception4e", 256, 160, 320, 32, 128, 128),
    ("maxpool4", 2),
    ("inception5a", 256, 160, 320, 32, 128, 128),
    ("inception5b", 384, 192, 384, 48, 128, 128),
)


def googlenet(
    *,
    batch: int = 1,
    image: int = 32,
    width: float = 0.125,
    blocks: int = 9,
    seed: int = 0,
    bn: str = "separate",
    opset: int = 13,
    quirks: bool = True,
    num_classes: int = 10,
) -> onnx.ModelProto:
    """torchvision ``googlenet`` (eval: no aux heads, ``transform_input=False``).

    Stem conv1 7x7/2 -> maxpool/2 (ceil) -> conv2 1x1 -> conv3 3x3 -> maxpool/2, then the
    first ``blocks`` (1..9) Inception blocks with the max-pools between them. An Inception
    block: branch1 1x1; branch2 1x1 -> 3x3; branch3 1x1 -> 3x3 (torchvision's 3x3, not
    5x5); branch4 maxpool 3x3/1 (ceil) -> 1x1; Concat of the four on channels. Every conv
    is BasicConv2d (Conv without bias, BN eps=1e-3, ReLU).
    """
    if not 1 <= blocks <= 9:
        raise ValueError(f"blocks={blocks}; GoogLeNet has 9 Inception blocks, expected 1..9")
    b, x = _start("googlenet", batch=batch, image=image, seed=seed, opset=opset, bn=bn, quirks=quirks)
    c = lambda n: _ch(n, width)  # noqa: E731
    x = _basic_conv(b, x, "conv1", c(64), 7, stride=2, pad=3)
    with b.scope("maxpool1"):
        x = b.maxpool(x, 3, 2, ceil=True)
    x = _basic_conv(b, x, "conv2", c(64), 1)
    x = _basic_conv(b, x, "conv3", c(192), 3, pad=1)
    with b.scope("maxpool2"):
        x = b.maxpool(x, 3, 2, ceil=True)
    done = 0
    for spec in _GOOGLENET_BLOCKS:
        if done == blocks:
            break
        if spec[0].startswith("maxpool"):
            with b.scope(spec[0]):
                x = b.maxpool(x, spec[1], 2, ceil=True)
            continue
        name, ch1, ch3r, ch3, ch5r, ch5, pool = spec
        with b.scope(name):
            b1 = _basic_conv(b, x, "branch1", c(ch1), 1)
            with b.scope("branch2"):
                y = _basic_conv(b, x, "0", c(ch3r), 1)
                b2 = _basic_conv(b, y, "1", c(ch3), 3, pad=1)
            with b.scope("branch3"):
                y = _basic_conv(b, x, "0", c(ch5r), 1)
                b3 = _basic_conv(b, y, "1", c(ch5), 3, pad=1)
            with b.scope("branch4"):
                with b.scope("0"):
                    y = b.maxpool(x, 3, 1, 1, ceil=True)
                b4 = _basic_conv(b, y, "1", c(pool), 1)
            x = b.concat([b1, b2, b3, b4], axis=1)
        done += 1
    out = b.classifier(x, num_classes)
    return b.build({"output": out}, doc=f"googlenet blocks={blocks} width={width}")


# ---------------------------------------------------------------------- Inception v3
def inception_v3(
    *,
    batch: int = 1,
    image: int = 75,
    width: float = 0.0625,
    seed: int = 0,
    bn: str = "separate",
    opset: int = 13,
    quirks: bool = True,
    num_classes: int = 10,
) -> onnx.ModelProto:
    """torchvision ``inception_v3`` (eval: no AuxLogits, ``transform_input=False``).

    Stem (1a 3x3/2, 2a 3x3, 2b 3x3 pad 1, maxpool 3/2, 3b 1x1, 4a 3x3, maxpool 3/2), then
    Mixed_5b/5c/5d (InceptionA), 6a (InceptionB), 6b..6e (InceptionC, 1x7/7x1 factorised),
    7a (InceptionD), 7b/7c (InceptionE, with inner 1x3|3x1 Concats). BasicConv2d everywhere.
    ``image`` must be >= 75, the smallest input torchvision's stem accepts.
    """
    if image < 75:
        raise ValueError(f"image={image}; inception_v3's stem needs image >= 75 (torchvision's minimum)")
    b, x = _start("inception_v3", batch=batch, image=image, seed=seed, opset=opset, bn=bn, quirks=quirks)
    c = lambda n: _ch(n, width)  # noqa: E731
    bc = lambda x, name, cout, k, **kw: _basic_conv(b, x, name, c(cout), k, **kw)  # noqa: E731
    x = bc(x, "Conv2d_1a_3x3", 32, 3, stride=2)
    x = bc(x, "Conv2d_2a_3x3", 32, 3)
    x = bc(x, "Conv2d_2b_3x3", 64, 3, pad=1)
    with b.scope("maxpool1"):
        x = b.maxpool(x, 3, 2)
    x = bc(x, "Conv2d_3b_1x1", 80, 1)
    x = bc(x, "Conv2d_4a_3x3", 192, 3)
    with b.scope("maxpool2"):
        x = b.maxpool(x, 3, 2)

    def block_a(x: str, pool_features: int) -> str:
        b1 = bc(x, "branch1x1", 64, 1)
        y = bc(x, "branch5x5_1", 48, 1)
        b5 = bc(y, "branch5x5_2", 64, 5, pad=2)
        y = bc(x, "branch3x3dbl_1", 64, 1)
        y = bc(y, "branch3x3dbl_2", 96, 3, pad=1)
        b3 = bc(y, "branch3x3dbl_3", 96, 3, pad=1)
        bp = bc(b.avgpool(x, 3, 1, 1), "branch_pool", pool_features, 1)
        return b.concat([b1, b5, b3, bp], axis=1)

    def block_b(x: str) -> str:
        b3 = bc(x, "branch3x3", 384, 3, stride=2)
        y = bc(x, "branch3x3dbl_1", 64, 1)
        y = bc(y, "branch3x3dbl_2", 96, 3, pad=1)
        bd = bc(y, "branch3x3dbl_3", 96, 3, stride=2)
        bp = b.maxpool(x, 3, 2)
        return b.concat([b3, bd, bp], axis=1)

    def block_c(x: str, c7: int) -> str:
        b1 = bc(x, "branch1x1", 192, 1)
        y = bc(x, "branch7x7_1", c7, 1)
        y = bc(y, "branch7x7_2", c7, (1, 7), pad=(0, 3))
        b7 = bc(y, "branch7x7_3", 192, (7, 1), pad=(3, 0))
        y = bc(x, "branch7x7dbl_1", c7, 1)
        y = bc(y, "branch7x7dbl_2", c7, (7, 1), pad=(3, 0))
        y = bc(y, "branch7x7dbl_3", c7, (1, 7), pad=(0, 3))
        y = bc(y, "branch7x7dbl_4", c7, (7, 1), pad=(3, 0))
        bd = bc(y, "branch7x7dbl_5", 192, (1, 7), pad=(0, 3))
        bp = bc(b.avgpool(x, 3, 1, 1), "branch_pool", 192, 1)
        return b.concat([b1, b7, bd, bp], axis=1)

    def block_d(x: str) -> str:
        y = bc(x, "branch3x3_1", 192, 1)
        b3 = bc(y, "branch3x3_2", 320, 3, stride=2)
        y = bc(x, "branch7x7x3_1", 192, 1)
        y = bc(y, "branch7x7x3_2", 192, (1, 7), pad=(0, 3))
        y = bc(y, "branch7x7x3_3", 192, (7, 1), pad=(3, 0))
        b7 = bc(y, "branch7x7x3_4", 192, 3, stride=2)
        bp = b.maxpool(x, 3, 2)
        return b.concat([b3, b7, bp], axis=1)

    def block_e(x: str) -> str:
        b1 = bc(x, "branch1x1", 320, 1)
        y = bc(x, "branch3x3_1", 384, 1)
        b3 = b.concat([bc(y, "branch3x3_2a", 384, (1, 3), pad=(0, 1)), bc(y, "branch3x3_2b", 384, (3, 1), pad=(1, 0))])
        y = bc(x, "branch3x3dbl_1", 448, 1)
        y = bc(y, "branch3x3dbl_2", 384, 3, pad=1)
        bd = b.concat(
            [bc(y, "branch3x3dbl_3a", 384, (1, 3), pad=(0, 1)), bc(y, "branch3x3dbl_3b", 384, (3, 1), pad=(1, 0))]
        )
        bp = bc(b.avgpool(x, 3, 1, 1), "branch_pool", 192, 1)
        return b.concat([b1, b3, bd, bp], axis=1)

    for name, fn in (
        ("Mixed_5b", lambda x: block_a(x, 32)),
        ("Mixed_5c", lambda x: block_a(x, 64)),
        ("Mixed_5d", lambda x: block_a(x, 64)),
        ("Mixed_6a", block_b),
        ("Mixed_6b", lambda x: block_c(x, 128)),
        ("Mixed_6c", lambda x: block_c(x, 160)),
        ("Mixed_6d", lambda x: block_c(x, 160)),
        ("Mixed_6e", lambda x: block_c(x, 192)),
        ("Mixed_7a", block_d),
        ("Mixed_7b", block_e),
        ("Mixed_7c", block_e),
    ):
        with b.scope(name):
            x = fn(x)
    out = b.classifier(x, num_classes)
    return b.build({"output": out}, doc=f"inception_v3 width={width}")


# ---------------------------------------------------------------------- ResNet-50
def _resnet_stem(b: NetBuilder, x: str, width: float) -> str:
    """torchvision's ResNet stem: conv1 7x7/2 -> bn1 -> relu -> maxpool 3/2 pad 1."""
    with b.scope():
        x = b.conv_bn(x, _ch(64, width), 7, stride=2, pad=3, conv_scope="conv1", bn_scope="bn1")
        with b.scope("relu"):
            x = b.relu(x)
        with b.scope("maxpool"):
            return b.maxpool(x, 3, 2, 1)


def _bottleneck(b: NetBuilder, x: str, planes: int, stride: int) -> str:
    """Bottleneck's main path (v1.5: the stride on conv2), ``planes * 4`` channels out."""
    y = b.conv_bn(x, planes, 1, conv_scope="conv1", bn_scope="bn1")
    with b.scope("relu"):
        y = b.relu(y)
    y = b.conv_bn(y, planes, 3, stride=stride, pad=1, conv_scope="conv2", bn_scope="bn2")
    with b.scope("relu_1"):
        y = b.relu(y)
    return b.conv_bn(y, planes * 4, 1, conv_scope="conv3", bn_scope="bn3")


def _basic_block(b: NetBuilder, x: str, planes: int, stride: int) -> str:
    """BasicBlock's main path, ``planes`` channels out."""
    y = b.conv_bn(x, planes, 3, stride=stride, pad=1, conv_scope="conv1", bn_scope="bn1")
    with b.scope("relu"):
        y = b.relu(y)
    return b.conv_bn(y, planes, 3, pad=1, conv_scope="conv2", bn_scope="bn2")


def _resnet(
    name: str,
    block: Callable[[NetBuilder, str, int, int], str],
    *,
    last_relu: str,
    layers: Sequence[int],
    example: str,
    width: float,
    num_classes: int,
    **start,
) -> onnx.ModelProto:
    """torchvision's ResNet: stem, four stages of ``layers`` blocks (stride 2 on the first
    block of stages 2-4), classifier. A block is ``block``'s main path, a projection
    shortcut (downsample: conv 1x1 with the block's stride -> bn, exported after the main
    path) when the stride or the width changes, then ``Add(out, identity)`` -> relu
    (module ``last_relu``, torch's export name of the block's last use of its ReLU)."""
    if len(layers) != 4 or any(int(n) < 1 for n in layers):
        raise ValueError(f"layers={tuple(layers)}; expected four positive block counts, e.g. {example}")
    b, x = _start(name, **start)
    x = _resnet_stem(b, x, width)
    for stage, (planes, n) in enumerate(zip((64, 128, 256, 512), layers)):
        for i in range(int(n)):
            stride = 2 if (stage > 0 and i == 0) else 1
            with b.scope(f"layer{stage + 1}", i):
                y = block(b, x, _ch(planes, width), stride)
                cout = b.shapes[y][1]
                identity = x
                if stride != 1 or b.shapes[x][1] != cout:
                    with b.scope("downsample"):
                        identity = b.conv_bn(x, cout, 1, stride=stride, conv_scope="0", bn_scope="1")
                y = b.add(y, identity)
                with b.scope(last_relu):
                    x = b.relu(y)
    out = b.classifier(x, num_classes)
    return b.build({"output": out}, doc=f"{name} layers={tuple(layers)} width={width}")


def resnet50(
    *,
    batch: int = 1,
    image: int = 32,
    width: float = 0.125,
    layers: Sequence[int] = (2, 2, 2, 2),
    seed: int = 0,
    bn: str = "separate",
    opset: int = 13,
    quirks: bool = True,
    num_classes: int = 10,
) -> onnx.ModelProto:
    """torchvision ``resnet50`` (v1.5) with ``layers`` Bottleneck blocks per stage.

    Stem conv1 7x7/2 -> bn1 -> relu -> maxpool 3/2 pad 1. Bottleneck: conv1 1x1 -> bn ->
    relu -> conv2 3x3 (stride here, as torchvision v1.5) -> bn -> relu -> conv3 1x1 -> bn;
    the first block of each stage has a projection shortcut (downsample: conv 1x1 with the
    block's stride -> bn), exported after conv3; then ``Add(out, identity)`` -> relu.
    """
    options = dict(batch=batch, image=image, seed=seed, opset=opset, bn=bn, quirks=quirks, width=width, num_classes=num_classes)
    return _resnet("resnet50", _bottleneck, last_relu="relu_2", layers=layers, example="(3, 4, 6, 3)", **options)


def resnet18(
    *,
    batch: int = 1,
    image: int = 32,
    width: float = 0.125,
    layers: Sequence[int] = (2, 2, 2, 2),
    seed: int = 0,
    bn: str = "separate",
    opset: int = 13,
    quirks: bool = True,
    num_classes: int = 10,
) -> onnx.ModelProto:
    """torchvision ``resnet18`` (``layers=(2, 2, 2, 2)``; ``resnet34`` is ``(3, 4, 6, 3)``).

    Stem as :func:`resnet50`. BasicBlock: conv1 3x3 (stride) -> bn1 -> relu -> conv2 3x3 ->
    bn2; a block that changes stride or width has a projection shortcut (downsample: conv
    1x1 with the block's stride -> bn), exported after conv2; then ``Add(out, identity)`` -> relu.
    """
    options = dict(batch=batch, image=image, seed=seed, opset=opset, bn=bn, quirks=quirks, width=width, num_classes=num_classes)
    return _resnet("resnet18", _basic_block, last_relu="relu_1", layers=layers, example="(2, 2, 2, 2)", **options)


# ---------------------------------------------------------------------- DenseNet-121
DENSENET121_FULL = {"width": 1.0, "block_config": (6, 12, 24, 16), "image": 224}
"""torchvision's ``densenet121`` at full size (for reports; the tests use reduced sizes)."""


def densenet121(
    *,
    batch: int = 1,
    image: int = 32,
    width: float = 0.25,
    block_config: Sequence[int] = (2, 3, 4, 3),
    concat: str = "torch",
    seed: int = 0,
    bn: str = "separate",
    opset: int = 13,
    quirks: bool = True,
    num_classes: int = 10,
    calibrate: bool = True,
) -> onnx.ModelProto:
    """torchvision ``densenet121`` with ``block_config`` dense layers per block.

    The real network: ``densenet121(**DENSENET121_FULL)`` (width 1, blocks (6, 12, 24, 16),
    224x224; 58 dense layers). ``calibrate=False`` skips the numpy calibration pass that
    sets the BatchNorm statistics (seconds instead of ~30 s at full size; the statistics
    stay near identity) - enough for planning and counting, not for numeric checks.

    Stem conv0 7x7/2 -> norm0 -> relu0 -> pool0 maxpool 3/2 pad 1. Dense layer
    (pre-activation): Concat(features) -> norm1 -> relu1 -> conv1 1x1 (bn_size*growth)
    -> norm2 -> relu2 -> conv2 3x3 (growth). Transition: norm -> relu -> conv 1x1 (half the
    channels) -> avgpool 2/2. Head: norm5 -> relu -> avgpool -> flatten -> classifier.
    Growth rate 32 and 64 stem channels are scaled by ``width``.

    ``concat`` chooses how the features are joined:

    * ``"torch"`` (what torchvision exports): dense layer ``i`` reads
      ``Concat(x0, new_1, ..., new_{i-1})`` of the separate feature maps (the first one a
      one-input Concat), and the block ends with ``Concat(x0, new_1, ..., new_n)``.
    * ``"nested"`` (the Caffe DenseNet of the ONNX model zoo): ``c_i = Concat(c_{i-1},
      new_i)``, each dense layer reads the previous Concat; the block output is ``c_n``.

    With ``bn="folded"`` only norm0 and each norm2 (which follow a conv) fold; norm1, the
    transitions' norm and norm5 stay BatchNormalization nodes, as in torch's export.
    """
    if concat not in ("torch", "nested"):
        raise ValueError(f"concat={concat!r}; expected 'torch' or 'nested'")
    if not block_config or any(int(n) < 1 for n in block_config):
        raise ValueError(f"block_config={tuple(block_config)}; expected positive dense-layer counts")
    b, x = _start(
        "densenet121", batch=batch, image=image, seed=seed, opset=opset, bn=bn, quirks=quirks, calibrate=calibrate
    )
    growth = _ch(32, width)
    bn_size = 4
    with b.scope("features"):
        x = b.conv_bn(x, _ch(64, width), 7, stride=2, pad=3, conv_scope="conv0", bn_scope="norm0")
        with b.scope("relu0"):
            x = b.relu(x)
        with b.scope("pool0"):
            x = b.maxpool(x, 3, 2, 1)
        for bi, n_layers in enumerate(block_config):
            with b.scope(f"denseblock{bi + 1}"):
                features = [x]
                for li in range(int(n_layers)):
                    with b.scope(f"denselayer{li + 1}"):
                        if concat == "torch":
                            h = b.concat(features, axis=1)
                        else:
                            h = features[-1]
                        with b.scope("norm1"):
                            h = b.batchnorm(h)
                        with b.scope("relu1"):
                            h = b.relu(h)
                        h = b.conv_bn(h, bn_size * growth, 1, conv_scope="conv1", bn_scope="norm2")
                        with b.scope("relu2"):
                            h = b.relu(h)
                        with b.scope("conv2"):
                            new = b.conv(h, growth, 3, pad=1, bias=False)
                    if concat == "torch":
                        features.append(new)
                    else:
                        features.append(b.concat([features[-1], new], axis=1))
                x = b.concat(features, axis=1) if concat == "torch" else features[-1]
            if bi != len(block_config) - 1:
                with b.scope(f"transition{bi + 1}"):
                    with b.scope("norm"):
                        x = b.batchnorm(x)
                    with b.scope("relu"):
                        x = b.relu(x)
                    with b.scope("conv"):
                        x = b.conv(x, b.shapes[x][1] // 2, 1, bias=False)
                    with b.scope("pool"):
                        x = b.avgpool(x, 2, 2)
        with b.scope("norm5"):
            x = b.batchnorm(x)
    x = b.relu(x)
    out = b.classifier(x, num_classes, fc_scope="classifier")
    return b.build({"output": out}, doc=f"densenet121 blocks={tuple(block_config)} concat={concat} width={width}")


# ---------------------------------------------------------------------- SqueezeNet 1.1
_SQUEEZENET_FIRES = (
    # squeeze, expand1x1, expand3x3; "M" = maxpool 3/2 ceil
    (16, 64, 64), (16, 64, 64), "M", (32, 128, 128), (32, 128, 128), "M",
    (48, 192, 192), (48, 192, 192), (64, 256, 256), (64, 256, 256),
)  # fmt: skip


def squeezenet1_1(
    *,
    batch: int = 1,
    image: int = 32,
    width: float = 0.25,
    seed: int = 0,
    bn: str = "separate",
    opset: int = 13,
    quirks: bool = True,
    num_classes: int = 10,
) -> onnx.ModelProto:
    """torchvision ``squeezenet1_1``: conv 3x3/2 -> relu -> maxpool 3/2 (ceil) -> 8 Fire
    modules with two more max-pools -> classifier (final conv 1x1 -> relu -> avgpool ->
    flatten). A Fire: squeeze 1x1 -> relu -> [expand1x1 -> relu, expand3x3 pad 1 -> relu]
    -> Concat. Convs have biases and there is no BatchNorm (``bn`` has no effect).
    """
    b, x = _start("squeezenet1_1", batch=batch, image=image, seed=seed, opset=opset, bn=bn, quirks=quirks)
    with b.scope("features"):
        with b.scope(0):
            x = b.conv(x, _ch(64, width), 3, stride=2)
        with b.scope(1):
            x = b.relu(x)
        with b.scope(2):
            x = b.maxpool(x, 3, 2, ceil=True)
        for i, spec in enumerate(_SQUEEZENET_FIRES, start=3):
            with b.scope(i):
                if spec == "M":
                    x = b.maxpool(x, 3, 2, ceil=True)
                    continue
                sq, e1, e3 = (_ch(v, width) for v in spec)
                with b.scope("squeeze"):
                    s = b.conv(x, sq, 1)
                with b.scope("squeeze_activation"):
                    s = b.relu(s)
                with b.scope("expand1x1"):
                    y1 = b.conv(s, e1, 1)
                with b.scope("expand1x1_activation"):
                    y1 = b.relu(y1)
                with b.scope("expand3x3"):
                    y3 = b.conv(s, e3, 3, pad=1)
                with b.scope("expand3x3_activation"):
                    y3 = b.relu(y3)
                x = b.concat([y1, y3], axis=1)
    with b.scope("classifier"):
        with b.scope(1):
            x = b.conv(x, num_classes, 1, **_live_relu_head(b, x, num_classes))
        with b.scope(2):
            x = b.relu(x)
        with b.scope(3):
            x = b.global_avgpool(x)
    out = b.flatten(x)
    return b.build({"output": out}, doc=f"squeezenet1_1 width={width}")


def _live_relu_head(b: NetBuilder, x: str, cout: int) -> dict:
    """Weight and bias of a 1x1 conv whose output goes through a Relu to the logits (SqueezeNet's
    classifier): on a small image it sees a few pixels, and a bias drawn at random leaves
    ~half of the logits 0 for every input. The bias is set from the calibration batch so each
    channel's pre-activation has mean = one standard deviation (~84 % of values positive)."""
    w = b.he_weight(cout, b.shapes[x][1], 1, 1)  # [C_out, C_in, 1, 1]
    v = b.value(x)  # [N, C_in, H, W] on the calibration batch
    if v is None:
        return dict(weight=w)
    pre = np.einsum("oi,nihw->nohw", w[:, :, 0, 0], v, dtype=np.float64)  # [N, C_out, H, W]
    mean, std = pre.mean(axis=(0, 2, 3)), pre.std(axis=(0, 2, 3))  # [C_out]
    return dict(weight=w, bias_value=(std - mean).astype(np.float32))


# ---------------------------------------------------------------------- MobileNetV2
_MOBILENET_V2_SETTING = (
    # t (expand ratio), c (channels), n (blocks), s (first stride)
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
MOBILENET_V2_SMALL = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2), (6, 64, 2, 2), (6, 96, 1, 1))


def mobilenet_v2(
    *,
    batch: int = 1,
    image: int = 32,
    width: float = 0.25,
    setting: Sequence[Sequence[int]] = MOBILENET_V2_SMALL,
    last_channel: int = 128,
    clip: str = "inputs",
    seed: int = 0,
    bn: str = "separate",
    opset: Optional[int] = None,
    quirks: bool = True,
    num_classes: int = 10,
) -> onnx.ModelProto:
    """torchvision ``mobilenet_v2`` with an ``inverted_residual_setting`` of ``(t, c, n, s)`` rows.

    features.0: Conv 3x3/2 -> BN -> ReLU6. InvertedResidual: [expand 1x1 -> BN -> ReLU6]
    (when t != 1) -> depthwise 3x3 (group = hidden channels, stride s on the first block of
    a row) -> BN -> ReLU6 -> project 1x1 -> BN; ``Add(x, block(x))`` when stride 1 and
    in == out channels. Last: Conv 1x1 -> BN -> ReLU6 (``last_channel``; torchvision uses
    1280), then avgpool -> flatten -> classifier.1 Linear. Channels are
    ``make_divisible(c * width, 8)``.

    ReLU6 is ``Clip``: ``clip="inputs"`` (opset >= 11: min/max as Constant-node inputs) or
    ``clip="attributes"`` (opset <= 10: Clip-6 ``min``/``max`` attributes). ``opset``
    defaults to 13, or 10 with ``clip="attributes"``.
    """
    if opset is None:
        opset = 10 if clip == "attributes" else 13
    check_options(opset=opset, bn=bn, clip=clip, batch=batch, image=image)
    b = NetBuilder("mobilenet_v2", seed=seed, opset=opset, bn=bn, clip=clip, quirks=quirks)
    x = b.input("input", (batch, 3, image, image))

    def conv_bn_act(x: str, idx, cout: int, k: int, stride: int = 1, groups: int = 1) -> str:
        with b.scope(idx):
            y = b.conv_bn(x, cout, k, stride=stride, pad=(k - 1) // 2, groups=groups, conv_scope=0, bn_scope=1)
            with b.scope(2):
                return b.clip(y, 0.0, 6.0)

    input_channel = make_divisible(32 * width)
    with b.scope("features"):
        x = conv_bn_act(x, 0, input_channel, 3, stride=2)
        idx = 1
        for t, c, n, s in setting:
            cout = make_divisible(c * width)
            for i in range(int(n)):
                stride = int(s) if i == 0 else 1
                hidden = int(round(input_channel * t))
                with b.scope(idx, "conv"):
                    y, k = x, 0
                    if t != 1:
                        y = conv_bn_act(y, k, hidden, 1)
                        k += 1
                    y = conv_bn_act(y, k, hidden, 3, stride=stride, groups=hidden)
                    y = b.conv_bn(y, cout, 1, conv_scope=k + 1, bn_scope=k + 2)
                if stride == 1 and input_channel == cout:
                    with b.scope(idx):
                        y = b.add(x, y)
                x = y
                input_channel = cout
                idx += 1
        x = conv_bn_act(x, idx, last_channel, 1)
    out = b.classifier(x, num_classes, fc_scope="classifier.1")
    return b.build({"output": out}, doc=f"mobilenet_v2 setting={tuple(map(tuple, setting))} width={width}")


# ---------------------------------------------------------------------- EfficientNet-like
EFFICIENTNET_SMALL = (
    # expand ratio, kernel, stride, in channels, out channels, layers  (EfficientNet-B0 rows 1-4)
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 2),
)


def efficientnet_like(
    *,
    batch: int = 1,
    image: int = 32,
    width: float = 0.25,
    setting: Sequence[Sequence[int]] = EFFICIENTNET_SMALL,
    last_channel: int = 128,
    seed: int = 0,
    bn: str = "separate",
    opset: int = 13,
    quirks: bool = True,
    num_classes: int = 10,
) -> onnx.ModelProto:
    """torchvision ``efficientnet_b0``'s structure with MBConv ``setting`` rows.

    Stem Conv 3x3/2 -> BN -> SiLU. MBConv: [expand 1x1 -> BN -> SiLU] (ratio != 1) ->
    depthwise kxk -> BN -> SiLU -> squeeze-excite (GlobalAveragePool -> fc1 1x1 conv with
    bias -> SiLU -> fc2 1x1 conv -> Sigmoid -> ``Mul(scale, x)``) -> project 1x1 -> BN;
    ``Add(block(x), x)`` when stride 1 and in == out. Head Conv 1x1 -> BN -> SiLU ->
    avgpool -> flatten -> Linear. SiLU is exported as ``Mul(x, Sigmoid(x))``.
    """
    b, x = _start("efficientnet_like", batch=batch, image=image, seed=seed, opset=opset, bn=bn, quirks=quirks)
    c = lambda n: make_divisible(n * width)  # noqa: E731
    eps = 1e-5

    def cna(x, idx, cout, k, stride=1, groups=1) -> str:  # Conv2dNormActivation with SiLU
        with b.scope(idx):
            y = b.conv_bn(x, cout, k, stride=stride, pad=(k - 1) // 2, groups=groups, conv_scope=0, bn_scope=1, eps=eps)
            with b.scope(2):
                return b.silu(y)

    with b.scope("features"):
        x = cna(x, 0, c(32), 3, stride=2)
        for stage, (ratio, k, s, cin_row, cout_row, n) in enumerate(setting, start=1):
            for i in range(int(n)):
                cin = c(cin_row) if i == 0 else c(cout_row)
                cout = c(cout_row)
                stride = int(s) if i == 0 else 1
                expanded = make_divisible(cin * ratio)
                with b.scope(stage, i, "block"):
                    y, j = x, 0
                    if ratio != 1:
                        y = cna(y, j, expanded, 1)
                        j += 1
                    y = cna(y, j, expanded, k, stride=stride, groups=expanded)
                    j += 1
                    with b.scope(j):
                        y = b.squeeze_excitation(y, max(1, cin // 4), activation=b.silu, scale_activation=b.sigmoid)
                    j += 1
                    with b.scope(j):
                        y = b.conv_bn(y, cout, 1, conv_scope=0, bn_scope=1, eps=eps)
                if stride == 1 and cin == cout:
                    with b.scope(stage, i):
                        y = b.add(y, x)
                x = y
        x = cna(x, len(setting) + 1, last_channel, 1)
    out = b.classifier(x, num_classes, fc_scope="classifier.1")
    return b.build({"output": out}, doc=f"efficientnet_like setting={tuple(map(tuple, setting))} width={width}")


BUILDERS: dict[str, Callable[..., onnx.ModelProto]] = {
    "googlenet": googlenet,
    "inception_v3": inception_v3,
    "resnet18": resnet18,
    "resnet50": resnet50,
    "densenet121": densenet121,
    "squeezenet1_1": squeezenet1_1,
    "mobilenet_v2": mobilenet_v2,
    "efficientnet_like": efficientnet_like,
}
"""Every builder by name (for scripts that loop over the zoo)."""


# ---------------------------------------------------------------------- ONNX "light" models
LIGHT_NAMES = LIGHT_MODELS


def light_models() -> dict[str, Path]:
    """The ONNX model-zoo networks the ``onnx`` package ships, by name -> path of the .onnx file.

    They are IR 3 / opset 9 models whose weights are ``ConstantOfShape`` constants (so the
    files are tiny) with 224x224 inputs. Names: :data:`LIGHT_NAMES`. A name whose file this
    onnx installation lacks is left out.
    """
    d = light_dir()
    return {n: d / f"light_{n}.onnx" for n in LIGHT_NAMES if (d / f"light_{n}.onnx").is_file()}


def light_reference(name: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Inputs and reference output of a light model: ``(feeds, output_0)``.

    The ``light_<name>_output_0.pb`` file holds only the output tensor. The input it was
    computed from is not stored; onnx's backend test runner regenerates it as
    ``arange(n).reshape(shape) / n`` (float32) for every non-initializer input, and so
    does this function. Raises FileNotFoundError when the model or its output is missing.
    """
    models = light_models()
    if name not in models:
        raise FileNotFoundError(
            f"light model {name!r} is not shipped with onnx {onnx.__version__} at {light_dir()}; "
            f"expected one of {sorted(models)}"
        )
    out_path = light_dir() / f"light_{name}_output_0.pb"
    if not out_path.is_file():
        raise FileNotFoundError(f"light model {name!r} has no reference output {out_path}")
    model = onnx.load(str(models[name]), load_external_data=False)
    feeds = {}
    for n, shape in model_inputs(model).items():
        size = int(math.prod(shape))
        feeds[n] = (np.arange(size).reshape(shape) / size).astype(np.float32)
    output = numpy_helper.to_array(onnx.load_tensor(str(out_path)))
    return feeds, output


@functools.cache
def _live_light_bytes(name: str, seed: int) -> bytes:
    from .weights import live_weights

    models = light_models()
    if name not in models:
        raise FileNotFoundError(f"light model {name!r} is not shipped with onnx {onnx.__version__} at {light_dir()}")
    return live_weights(onnx.load(str(models[name])), seed=seed).SerializeToString()


def live_light_model(name: str, *, seed: int = 13) -> onnx.ModelProto:
    """Light model ``name`` with seeded live weights (:func:`.weights.live_weights`): its
    shipped constant weights give every input the same output. Drawn once per process and
    name; each call returns a fresh copy. FileNotFoundError when onnx ships no such model."""
    return onnx.load_from_string(_live_light_bytes(name, seed))
