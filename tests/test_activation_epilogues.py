"""Mobile-network epilogues: HardSwish, HardSigmoid, Sigmoid, PRelu, GELU - in op form and as
exporters write them out - and the squeeze-and-excitation gate, each one conv epilogue:
in the plan (templates), in the ONNX realisation (checked in onnxruntime) and in the Relax
passes (one kernel named after its template, numbers equal to onnxruntime and to TVM's
default pipeline). Depthwise convs take part.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphs import Net, assert_realizes, compile_and_compare

SCALAR = np.float32


def _scalar(n: Net, v: float) -> str:
    return n.const(np.array(v, SCALAR))


def _act(n: Net, form: str, y: str) -> str:
    """``form`` applied to ``y`` the way an exporter writes it."""
    if form == "HardSwish":
        return n.node("HardSwish", [y])
    if form == "HardSwish=x*HardSigmoid(x)":
        return n.node("Mul", [y, n.node("HardSigmoid", [y], alpha=1 / 6, beta=0.5)])
    if form == "HardSwish=x*Clip(x+3,0,6)/6":
        clip = n.node("Clip", [n.node("Add", [y, _scalar(n, 3.0)]), _scalar(n, 0.0), _scalar(n, 6.0)])
        return n.node("Div", [n.node("Mul", [y, clip]), _scalar(n, 6.0)])
    if form == "HardSwish=x*(Clip(x+3,0,6)/6)":
        clip = n.node("Clip", [n.node("Add", [y, _scalar(n, 3.0)]), _scalar(n, 0.0), _scalar(n, 6.0)])
        return n.node("Mul", [y, n.node("Div", [clip, _scalar(n, 6.0)])])
    if form == "HardSigmoid":
        return n.node("HardSigmoid", [y], alpha=0.2, beta=0.5)
    if form == "Sigmoid":
        return n.node("Sigmoid", [y])
    if form == "PRelu":
        c = n.shape[y][1]
        return n.node("PRelu", [y, n.const(np.linspace(-0.5, 0.5, c).astype(SCALAR).reshape(c, 1, 1))])
    if form == "Gelu":
        return n.node("Gelu", [y])
    if form == "Gelu=x*0.5*(1+erf(x/sqrt2))":
        erf = n.node("Erf", [n.node("Div", [y, _scalar(n, 2**0.5)])])
        one = n.node("Add", [erf, _scalar(n, 1.0)])
        return n.node("Mul", [n.node("Mul", [y, one]), _scalar(n, 0.5)])
    raise AssertionError(form)


FORMS = {  # form -> (planned op, Relax template suffix, opset)
    "HardSwish": ("HardSwish", "hardswish", 14),
    "HardSwish=x*HardSigmoid(x)": ("HardSwish", "hardswish", 13),
    "HardSwish=x*Clip(x+3,0,6)/6": ("HardSwish", "hardswish", 13),
    "HardSwish=x*(Clip(x+3,0,6)/6)": ("HardSwish", "hardswish", 13),
    "HardSigmoid": ("HardSigmoid", "hardsigmoid", 13),
    "Sigmoid": ("Sigmoid", "sigmoid", 13),
    "PRelu": ("PRelu", "prelu", 13),
    "Gelu": ("Gelu", "gelu", 20),
    "Gelu=x*0.5*(1+erf(x/sqrt2))": ("Gelu", "gelu", 13),
}


def _conv_bn_act(form: str, *, depthwise: bool, seed: int):
    op, suffix, opset = FORMS[form]
    n = Net(seed=seed, opset=opset)
    x = n.input("x", (1, 8, 8, 8))
    y = n.conv(x, 8, group=8 if depthwise else 1, name="c", bias=False)
    y = _act(n, form, n.bn(y, name="bn"))
    return n.build([n.conv(y, 6, k=1, name="next")]), op, suffix


# numbers for these in the default suite; the rest (and every depthwise variant) when slow runs too
NUMBERS_FAST = {"HardSwish=x*Clip(x+3,0,6)/6"}
CASES = [
    pytest.param(form, dw, marks=[] if (not dw and form in NUMBERS_FAST) else [pytest.mark.slow], id=f"{form}-{'dw' if dw else 'conv'}")
    for form in FORMS
    for dw in (False, True)
]


@pytest.mark.parametrize("form", list(FORMS))
def test_activation_is_one_conv_epilogue_in_the_plan_and_the_onnx_realisation(form):
    model, op, _ = _conv_bn_act(form, depthwise=True, seed=len(form))
    p = assert_realizes(model)  # the realised plan equals the model in onnxruntime
    group = next(g for g in p.groups if "c" in g.members)
    assert group.details["folded"] == ["BatchNormalization"]
    assert group.details["activation"] == op
    # every layer of the written-out form is a member of the one fused conv
    layers = [l.name for l in p.first]
    assert set(group.members) == set(layers[: layers.index("next")])


@pytest.mark.parametrize("form,depthwise", CASES)
def test_activation_is_one_kernel_and_matches_onnxruntime(form, depthwise):
    model, op, suffix = _conv_bn_act(form, depthwise=depthwise, seed=len(form))
    result, fused, default = compile_and_compare(model)
    # HardSigmoid's a*x + b folds into the weights with the BatchNorm: a clip is left
    names = {f"layerfuse_conv2d_bias_{s}" for s in ((suffix, "clip") if suffix == "hardsigmoid" else (suffix,))}
    assert names & set(fused.names), fused.names
    assert fused.launches == 2 and fused.launches <= default.launches, (fused.names, default.names)
    assert not result.report.absorbed  # the plan expressed it: nothing left for the catch-all pass


def test_decomposed_hardswish_with_other_constants_is_not_called_hardswish():
    """x * Clip(x + 2, 0, 6) / 6 is no HardSwish: the planner must not relabel it."""
    n = Net(seed=4, opset=13)
    x = n.input("x", (1, 4, 8, 8))
    y = n.conv(x, 4, name="c")
    clip = n.node("Clip", [n.node("Add", [y, _scalar(n, 2.0)]), _scalar(n, 0.0), _scalar(n, 6.0)])
    out = n.node("Div", [n.node("Mul", [y, clip]), _scalar(n, 6.0)])
    p = assert_realizes(n.build([out]))
    assert not any(g.details.get("activation") == "HardSwish" for g in p.groups)


def test_prelu_with_a_run_time_slope_is_refused():
    n = Net(seed=5, opset=13)
    x = n.input("x", (1, 4, 8, 8))
    slope = n.input("slope", (4, 1, 1))
    y = n.node("PRelu", [n.conv(x, 4, name="c"), slope], name="act")
    p = assert_realizes(n.build([y]))
    refusal = next(r for r in p.refusals if "c" in r.layers)
    assert "PRelu 'act' has a run-time or non-per-channel slope" in refusal.reason


def _se_block(*, gate_act: str, spatial: int, seed: int):
    """dw conv-BN-HardSwish -> SE (GlobalAveragePool -> fc1 -> ReLU -> fc2 -> act) -> Mul -> project."""
    n = Net(seed=seed, opset=14)
    x = n.input("x", (2, 8, spatial, spatial))
    y = n.node("HardSwish", [n.bn(n.conv(x, 8, group=8, name="dw", bias=False), name="bn")], name="hs")
    s = n.node("GlobalAveragePool", [y], shape=(2, 8, 1, 1), name="pool")
    s = n.relu(n.conv(s, 4, k=1, name="fc1"), name="fc1_relu")
    s = n.conv(s, 8, k=1, name="fc2")
    s = n.node(gate_act, [s], name="gate_act", **({"alpha": 1 / 6, "beta": 0.5} if gate_act == "HardSigmoid" else {}))
    g = n.node("Mul", [s, y], shape=(2, 8, spatial, spatial), name="gate")
    return n.build([n.conv(g, 6, k=1, name="project")])


@pytest.mark.parametrize(
    "gate_act,spatial",
    [("HardSigmoid", 6), pytest.param("Sigmoid", 6, marks=pytest.mark.slow), pytest.param("HardSigmoid", 1, marks=pytest.mark.slow)],
)
def test_squeeze_excitation_gate_is_an_epilogue_input(gate_act, spatial):
    model = _se_block(gate_act=gate_act, spatial=spatial, seed=spatial)
    p = assert_realizes(model)
    gate = next(g for g in p.groups_of("eltwise"))
    assert gate.details["conv"] == "fc2" and gate.details["op"] == "gate"
    assert gate.details["extra_input"] == "hs_out"
    fc2 = p.second.layer("fc2")
    roles = [e.role for e in fc2.fused.epilogue]
    assert roles == ["activation", "gate"]
    result, fused, default = compile_and_compare(model)
    suffix = "hardsigmoid" if gate_act == "HardSigmoid" else "sigmoid"
    assert f"layerfuse_conv2d_bias_{suffix}_gate" in fused.names, fused.names
    # dw+BN+HardSwish, mean, fc1+ReLU, fc2+act+gate, project: five kernels
    assert fused.launches == 5 and fused.launches <= default.launches, (fused.names, default.names)
    check = result.report.plan_check
    assert check["eltwise_merged"]["plan"] == check["eltwise_merged"]["relax"] == 1


def test_add_after_an_activated_conv_is_a_post_activation_add():
    """YOLO's bottleneck: x + SiLU(conv(x)) - the add joins the conv's epilogue after the activation."""
    n = Net(seed=9, opset=13)
    x = n.input("x", (1, 4, 6, 6))
    c = n.conv(x, 4, name="c")
    y = n.node("Add", [x, n.node("Mul", [c, n.node("Sigmoid", [c], name="sig")], name="silu")], name="add")
    model = n.build([n.conv(y, 4, name="next")])
    p = assert_realizes(model)
    group = next(iter(p.groups_of("eltwise")))
    assert group.details["op"] == "post_add" and group.details["extra_input"] == "x"
    assert [e.role for e in p.second.layer("c").fused.epilogue] == ["activation", "post_add"]
    result, fused, default = compile_and_compare(model)
    assert "layerfuse_conv2d_bias_silu_post_add" in fused.names, fused.names
    assert fused.launches == 2 <= default.launches


def test_add_that_broadcasts_an_activated_conv_output_is_refused_with_the_reason():
    n = Net(seed=9, opset=13)
    x = n.input("x", (1, 4, 1, 1))
    r = n.input("r", (1, 4, 6, 6))
    y = n.node("Add", [n.relu(n.conv(x, 4, k=1, name="c"), name="act"), r], shape=(1, 4, 6, 6), name="add")
    p = assert_realizes(n.build([y]))
    refusal = next(r for r in p.refusals_of("eltwise"))
    assert "conv 'c' already ends in an activation; only a multiply (a gate) or an add of the same shape" in refusal.reason


def test_ops_the_plan_cannot_express_still_join_the_conv_kernel():
    """conv -> Tanh -> x*0.5 + r: no template knows Tanh, yet TVM's default pipeline fuses it all
    into the conv's kernel. AbsorbElementwiseConsumers does the same after the conv's group."""
    n = Net(seed=12, opset=13)
    x = n.input("x", (1, 4, 6, 6))
    r = n.input("r", (1, 4, 6, 6))
    y = n.node("Tanh", [n.conv(x, 4, name="c")], name="tanh")
    y = n.node("Add", [n.node("Mul", [y, _scalar(n, 0.5)], name="half"), r], name="add")
    model = n.build([n.conv(y, 4, name="next")])
    result, fused, default = compile_and_compare(model)
    (absorbed,) = result.report.absorbed
    assert absorbed["ops"] == ["relax.tanh", "relax.multiply", "relax.add"]
    assert absorbed["function"].endswith("_ew") and absorbed["function"] in fused.names
    assert fused.launches == default.launches == 2, (fused.names, default.names)
