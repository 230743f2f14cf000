"""Mobile-network epilogues under the oneDNN tactic: the epilogue the fusion pass matched (its
own patterns, not a second matcher) becomes a oneDNN post-op where oneDNN has one -
HardSwish (every form exporters write), HardSigmoid (linear then clip) and GELU (the op, and
the erf form) - and the answers equal onnxruntime's. PReLU and look-alikes with other
constants stay with TVM, with the reason."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_activation_epilogues import FORMS, _act
from tvm import relax

from graphs import Net, rel_err
from tvm_layerfuse.compile.presets import resolve
from tvm_layerfuse.compile.tactics import onednn
from tvm_layerfuse.compile.tactics.use_onednn import UseOneDNNConv
from tvm_layerfuse.lowering import layerfuse_pipeline
from tvm_layerfuse.relax.pipeline import fuse_with_report
from tvm_layerfuse.testing import random_inputs, run_onnxruntime

RTOL = 1e-4
MISSING = onednn.availability()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"oneDNN is not installed here: {MISSING}")


def _model(form: str, *, bn: bool, seed: int):
    _, _, opset = FORMS.get(form, (None, None, 13))
    n = Net(seed=seed, opset=opset)
    x = n.input("x", (1, 16, 10, 10))
    y = n.conv(x, 32, name="c", bias=not bn)
    if bn:
        y = n.bn(y, name="bn")
    y = _act(n, form, y)
    return n.build([n.conv(y, 16, k=1, name="next")])


def _run(model):
    feeds = random_inputs(model, 0)
    (expected,) = run_onnxruntime(model, feeds)
    chooser = UseOneDNNConv(winograd="never")
    mod = chooser(fuse_with_report(model, bind=True).mod)
    tgt = resolve("cpu").tvm_target()
    ex = tvm.compile(mod, target=tgt, relax_pipeline=layerfuse_pipeline(tgt))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(v) for v in feeds.values()])
    assert np.abs(expected).max() > 1e-3, "dead output"
    return rel_err(got.numpy(), expected), chooser.layers


@pytest.mark.parametrize(
    "form, suffix",
    [
        ("HardSwish", "hardswish"),
        ("HardSwish=x*HardSigmoid(x)", "hardswish"),
        ("HardSwish=x*Clip(x+3,0,6)/6", "hardswish"),
        ("HardSwish=x*(Clip(x+3,0,6)/6)", "hardswish"),
        ("Gelu", "gelu"),
        ("Gelu=x*0.5*(1+erf(x/sqrt2))", "gelu"),
        ("HardSigmoid", "hardsigmoid"),
    ],
)
def test_activation_becomes_a_onednn_post_op_and_matches_onnxruntime(form, suffix):
    err, layers = _run(_model(form, bn=False, seed=len(form)))
    assert err <= RTOL, err
    (layer,) = [c for c in layers if c.layer.startswith(f"layerfuse_conv2d_bias_{suffix}")]
    assert layer.tactic == "onednn", layer


def test_hardswish_after_batchnorm_is_taken():
    err, layers = _run(_model("HardSwish", bn=True, seed=3))
    assert err <= RTOL, err
    assert any(c.tactic == "onednn" and "hardswish" in c.layer for c in layers), layers


def test_prelu_and_lookalikes_stay_with_tvm_with_the_reason():
    err, layers = _run(_model("PRelu", bn=False, seed=5))
    assert err <= RTOL
    (layer,) = [c for c in layers if "prelu" in c.layer]
    assert layer.tactic == "tvm" and "prelu" in layer.reason

    n = Net(seed=6)
    x = n.input("x", (1, 16, 10, 10))
    y = n.conv(x, 32, name="c")
    three = n.const(np.array(2.0, np.float32))  # x * Clip(x + 2, 0, 6) / 6: no HardSwish
    clip = n.node("Clip", [n.node("Add", [y, three]), n.const(np.array(0.0, np.float32)), n.const(np.array(6.0, np.float32))])
    y = n.node("Div", [n.node("Mul", [y, clip]), n.const(np.array(6.0, np.float32))])
    err, layers = _run(n.build([n.conv(y, 16, k=1, name="next")]))
    assert err <= RTOL
    odd = [c for c in layers if "hardswish" in c.layer]
    assert all(c.tactic == "tvm" and "other constants" in c.reason for c in odd)


def _gated(*, gate_first: bool, scale: str, seed: int, channels: int = 24, batch: int = 1):
    """A squeeze-and-excitation block as torchvision writes it: x = relu(conv(in));
    s = scale(fc2(relu(fc1(GlobalAveragePool(x))))); Mul(s, x) (or Mul(x, s)); then a 1x1 conv."""
    n = Net(seed=seed)
    x = n.input("x", (batch, 16, 12, 12))
    x = n.relu(n.conv(x, channels, name="c"))
    s = n.node("GlobalAveragePool", [x], shape=(batch, channels, 1, 1))
    s = n.relu(n.conv(s, 8, k=1, pad=0, name="fc1"))
    s = n.node(scale, [n.conv(s, channels, k=1, pad=0, name="fc2")], shape=(batch, channels, 1, 1))
    y = n.node("Mul", [s, x] if gate_first else [x, s], shape=(batch, channels, 12, 12))
    return n.build([n.conv(y, 16, k=1, pad=0, name="project")])


@pytest.mark.parametrize(
    "gate_first, scale, channels, batch",
    [(True, "Sigmoid", 24, 1), (False, "HardSigmoid", 24, 1), (True, "Sigmoid", 20, 1), (False, "Sigmoid", 40, 2)],
)
def test_squeeze_excitation_gate_runs_on_the_library_in_the_convs_layout(gate_first, scale, channels, batch):
    """The gate - the global average of x, the two 1x1 convs and their activations - one
    ``se_gate`` call of the library; ``* x`` after it, as the library's ``scale_channels``
    (either operand order); answers equal onnxruntime's. With C a multiple of the block width
    the gated tensor, the gate that reads it and the product stay in the blocked layout from the
    conv that makes x to the conv that reads the product (no reorder on either side); so they do
    with C above the block width and not a multiple of it, in the padded blocked layout (the
    gate's pad channels scaled by 0); otherwise all of it is plain."""
    width = onednn.block_width()
    err, layers = _run(_gated(gate_first=gate_first, scale=scale, seed=21 + gate_first + channels, channels=channels, batch=batch))
    assert err <= RTOL, err
    (gate,) = [c for c in layers if c.layer.startswith("se:")]
    (scaled,) = [c for c in layers if c.layer.startswith("scale:")]
    inside = [c for c in layers if c.kernel == "se_gate" and c is not gate]  # the pool, fc1 and fc2
    assert len(inside) == 3 and all(c.tactic == "loop" and gate.layer in c.reason for c in inside), layers
    assert any(c.layer.startswith("pool:") for c in inside) and any("_gate" in c.layer for c in inside), inside
    convs = [c for c in layers if " w[" in c.shape and c not in inside]
    (c,) = [c for c in convs if c.shape.startswith(f"x[{batch}, 16, 12, 12]")]
    (project,) = [c for c in convs if c.shape.startswith(f"x[{batch}, {channels}, 12, 12]")]
    blocked = onednn.layout_name(width) if width and (channels % width == 0 or channels > width) else "nchw"
    assert (scaled.tactic, scaled.kernel, scaled.layout) == ("loop", "scale_channels", blocked), scaled
    assert (gate.tactic, gate.kernel, gate.layout) == ("loop", "se_gate", blocked), gate
    assert c.layout.endswith(">" + blocked) and project.layout.startswith(blocked + ">"), (c, project)
    assert all(c.tactic == "onednn" for c in convs), layers


def test_a_residual_computed_from_the_conv_itself_stays_with_tvm():
    """``Sum(conv, x, conv)`` = ``conv + (conv + x)``: the element-wise group's residual reads the
    conv's own result, so it is no input of the layer; the layer stays with TVM (it used to be
    handed to the library with a variable of the group's body: an internal error)."""
    n = Net(seed=41)
    x = n.input("x", (1, 7, 12, 12))
    y = n.conv(n.relu(x), 7, name="c")
    err, layers = _run(n.build([n.node("Sum", [y, x, y], shape=(1, 7, 12, 12))]))
    assert err <= RTOL, err
    (layer,) = [c for c in layers if c.layer.startswith("layerfuse_conv2d")]
    assert layer.tactic == "tvm" and "computed inside the group" in layer.reason, layer
