"""The layer forms of modern mobile networks, each through the whole product: ONNX model ->
``compile`` (default tactics) -> artifact -> a process with the TVM runtime only, against
onnxruntime, at the full width of their blocks:

* HardSwish (the op, and written out as ``x * Clip(x + 3, 0, 6) / 6``) and HardSigmoid after a
  conv + BatchNorm: one oneDNN conv with the activation as its post-op (HardSigmoid's affine
  part may fold into the conv, leaving a clip to [0, 1]);
* SiLU (``x * Sigmoid(x)``, as torch exports it) after a depthwise conv: oneDNN's depthwise
  kernel with the SiLU post-op;
* the squeeze-and-excitation gate (GlobalAveragePool -> 1x1 conv -> ReLU -> 1x1 conv ->
  HardSigmoid -> Mul): the pool and the gate's two convs one ``se_gate`` call of the library,
  the multiply its ``scale_channels``;
* ShuffleNet's channel split and shuffle (Slice, Concat, Reshape / Transpose / Reshape): each
  channel range read of the shuffle one ``shuffle`` call of the library, between convs that
  read and write the blocked layout (58-channel halves padded to whole blocks).

Each artifact says where every layer runs, and holds no unscheduled TVM kernel."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from test_activation_epilogues import _act

from graphs import Net, rel_err, run_runtime_only
from tvm_layerfuse.compile.build import compile_model
from tvm_layerfuse.compile.tactics import onednn
from tvm_layerfuse.testing import random_inputs, run_onnxruntime

RTOL = 1e-4
MISSING = onednn.availability()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")


def _activation(form: str, opset: int):
    """conv -> BatchNorm -> ``form`` -> 1x1 conv (a MobileNetV3 expansion)."""
    n = Net(seed=7, opset=opset)
    x = n.input("x", (1, 16, 14, 14))
    y = _act(n, form, n.bn(n.conv(x, 48, name="expand", bias=False), name="bn"))
    return n.build([n.conv(y, 24, k=1, pad=0, name="project")])


def _silu_depthwise():
    """1x1 conv -> SiLU -> depthwise 3x3 conv -> BatchNorm -> SiLU -> 1x1 conv (EfficientNet's MBConv)."""
    n = Net(seed=8)
    x = n.input("x", (1, 16, 14, 14))
    y = n.conv(x, 64, k=1, pad=0, name="expand")
    y = n.node("Mul", [y, n.node("Sigmoid", [y])])
    d = n.bn(n.conv(y, 64, k=3, group=64, name="dw", bias=False), name="bn")
    d = n.node("Mul", [d, n.node("Sigmoid", [d])])
    return n.build([n.conv(d, 24, k=1, pad=0, name="project")])


def _squeeze_excitation():
    """x = HardSwish(conv(in)); g = HardSigmoid(fc2(relu(fc1(GlobalAveragePool(x))))); conv(x * g)."""
    n = Net(seed=9, opset=14)
    x = n.node("HardSwish", [n.conv(n.input("x", (1, 16, 14, 14)), 32, name="c")])
    s = n.node("GlobalAveragePool", [x], shape=(1, 32, 1, 1))
    s = n.relu(n.conv(s, 8, k=1, pad=0, name="fc1"))
    s = n.node("HardSigmoid", [n.conv(s, 32, k=1, pad=0, name="fc2")], alpha=1 / 6, beta=0.5, shape=(1, 32, 1, 1))
    y = n.node("Mul", [x, s], shape=(1, 32, 14, 14))
    return n.build([n.conv(y, 16, k=1, pad=0, name="project")])


def _channel_shuffle():
    """Two ShuffleNetV2 units of its second stage (116 channels at 28x28), as torchvision exports
    them: the channels sliced in two (Slice, ``chunk``), one half through 1x1 -> depthwise 3x3 ->
    1x1, concat with the other half, the two groups shuffled (Reshape / Transpose / Reshape);
    the second unit slices the first's shuffle, the last shuffle is read whole by a 1x1 conv."""
    n = Net(seed=10)

    def half(x, lo):
        starts, ends, axes = (n.const(np.array([v], np.int64)) for v in (lo, lo + 58, 1))
        return n.node("Slice", [x, starts, ends, axes], shape=(1, 58, 28, 28))

    def unit(x, i):
        a, b = half(x, 0), half(x, 58)
        b = n.relu(n.conv(b, 58, k=1, pad=0, name=f"pw1_{i}"))
        b = n.conv(b, 58, k=3, group=58, name=f"dw_{i}")
        b = n.relu(n.conv(b, 58, k=1, pad=0, name=f"pw2_{i}"))
        y = n.concat([a, b])
        g = n.node("Reshape", [y, n.const(np.array([1, 2, 58, 28, 28], np.int64))], shape=(1, 2, 58, 28, 28))
        t = n.node("Transpose", [g], perm=[0, 2, 1, 3, 4], shape=(1, 58, 2, 28, 28))
        return n.node("Reshape", [t, n.const(np.array([1, 116, 28, 28], np.int64))], shape=(1, 116, 28, 28))

    x = n.relu(n.conv(n.input("x", (1, 16, 28, 28)), 116, k=1, pad=0, name="stem"))
    return n.build([n.conv(unit(unit(x, 1), 2), 32, k=1, pad=0, name="head")])


FORMS = {  # name -> (model, check of the manifest's layers and kernels)
    "hardswish-op": lambda: _activation("HardSwish", 14),
    "hardswish-written-out": lambda: _activation("HardSwish=x*Clip(x+3,0,6)/6", 13),
    "hardsigmoid": lambda: _activation("HardSigmoid", 13),
    "silu-depthwise": _silu_depthwise,
    "squeeze-excitation": _squeeze_excitation,
    "channel-shuffle": _channel_shuffle,
}


def _convs(layers: list) -> list:
    return [c for c in layers if c["layer"].startswith("layerfuse_conv2d")]


def _check_layers(name: str, layers: list, kernels: dict) -> None:
    convs = [c for c in _convs(layers) if c["kernel"] != "se_gate"]  # a gate's convs: in its se_gate call
    assert convs and all(c["tactic"] == "onednn" and not c["kernel"].startswith("ref") for c in convs), layers
    if name.startswith("hardswish"):
        (act,) = [c for c in convs if "x[1, 16, 14, 14]" in c["shape"]]
        assert act["layer"].startswith("layerfuse_conv2d_bias_hardswish"), act
    elif name == "hardsigmoid":  # the post-op, or its affine part folded into the conv and a clip to [0, 1]
        (act,) = [c for c in convs if "x[1, 16, 14, 14]" in c["shape"]]
        assert act["layer"].startswith(("layerfuse_conv2d_bias_hardsigmoid", "layerfuse_conv2d_bias_clip")), act
    elif name == "silu-depthwise":
        (dw,) = [c for c in convs if "w[64, 1, 3, 3]" in c["shape"]]
        assert dw["layer"].startswith("layerfuse_conv2d_bias_silu") and "dw" in dw["kernel"], dw
        assert sum(c["layer"].startswith("layerfuse_conv2d_bias_silu") for c in convs) == 2, convs
    elif name == "squeeze-excitation":
        (gate,) = [c for c in layers if c["layer"].startswith("se:")]
        assert (gate["tactic"], gate["kernel"]) == ("loop", "se_gate"), gate
        inside = [c for c in layers if c["kernel"] == "se_gate" and c is not gate]  # the pool and both convs
        assert len(inside) == 3 and all(gate["layer"] in c["reason"] for c in inside), layers
        assert any("hardsigmoid" in c["layer"] for c in inside), inside
        (scale,) = [c for c in layers if c["layer"].startswith("scale:")]
        assert (scale["tactic"], scale["kernel"]) == ("loop", "scale_channels"), scale
    elif name == "channel-shuffle":  # the library's gather, between convs that stay blocked
        assert not [k for k in kernels if "transpose" in k or "concat" in k], kernels
        shuffles = sorted(c["shape"] for c in layers if c["layer"].startswith("shuffle:"))
        assert shuffles == ["channels [0, 116) of 2 x 58", "channels [0, 58) of 2 x 58", "channels [58, 116) of 2 x 58"], layers
        blocked = onednn.layout_name(onednn.block_width())
        for c in layers:
            if c["layer"].startswith("shuffle:"):
                assert (c["tactic"], c["kernel"]) == ("loop", "shuffle") and c["layout"].endswith(">" + blocked), c
        halves = [c["layout"] for c in convs if "x[1, 58" in c["shape"]]  # the first reads a TVM slice of the stem
        assert halves == [f"nchw>{blocked}"] + [f"{blocked}>{blocked}"] * 5, halves


@pytest.mark.parametrize("name", list(FORMS))
def test_mobile_layer_form_through_an_artifact_matches_onnxruntime(name, tmp_path):
    model = FORMS[name]()
    onnx.checker.check_model(model)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    out = compile_model(path, tmp_path / "art", target="cpu", progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    schedules = manifest["schedules"]
    assert schedules["unscheduled"] == [], schedules["unscheduled"]
    _check_layers(name, manifest["tactics"]["layers"], schedules["kernels"])
    feeds = random_inputs(model, 4)
    (want,) = run_onnxruntime(model, feeds)
    (other,) = run_onnxruntime(model, random_inputs(model, 5))
    assert rel_err(other, want) > 0.05, "the output hardly depends on the input"
    (got,) = run_runtime_only(out, feeds, tmp_path).values()
    assert rel_err(got, want) <= RTOL, rel_err(got, want)
