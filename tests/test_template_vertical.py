"""Vertical template: Conv -> [bias] -> [BN] -> [per-channel Mul/Add] -> [activation]."""

import numpy as np
import pytest

from graphs import Net, assert_realizes
from tvm_layerfuse.planner import plan


def _single_group(p, kind="vertical"):
    groups = p.groups_of(kind)
    assert len(groups) == 1, [g.to_dict() for g in p.groups]
    return groups[0]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cout", [4, 7])
def test_conv_bn_relu_folds_and_matches(bias, cout):
    n = Net(seed=cout)
    x = n.input("x", (1, 3, 8, 8))
    y = n.relu(n.bn(n.conv(x, cout, bias=bias, name="c"), name="bn"), name="act")
    model = n.build([y])
    p = assert_realizes(model)
    g = _single_group(p)
    assert g.template == "vertical.conv_chain"
    assert g.details["folded"] == ["BatchNormalization"]
    assert g.details["activation"] == "Relu"
    assert g.members == ["c", "bn", "act"]
    assert len(p.second) == 1


def test_caffe2_style_bn_mul_add_relu():
    n = Net(seed=3, opset=9)
    x = n.input("x", (2, 4, 6, 6))
    c = n.conv(x, 5, name="c")
    y = n.bn(c)
    y = n.node("Mul", [y, n.channel_const(y)])
    y = n.node("Add", [y, n.channel_const(y, low=-0.5, high=0.5)])
    model = n.build([n.relu(y)])
    p = assert_realizes(model)
    g = _single_group(p)
    assert g.details["folded"] == ["BatchNormalization", "Mul", "Add"]


def test_separate_bias_add_and_sub_div_fold():
    n = Net(seed=4)
    x = n.input("x", (1, 3, 8, 8))
    c = n.conv(x, 6, bias=False, name="c")
    y = n.node("Add", [n.channel_const(c), c], shape=n.shape[c])  # constant on the left
    y = n.node("Sub", [y, n.channel_const(y)])
    y = n.node("Div", [y, n.channel_const(y)])
    model = n.build([y])
    p = assert_realizes(model)
    g = _single_group(p)
    assert g.details["folded"] == ["Add", "Sub", "Div"]
    assert g.details["activation"] is None
    epilogue = p.second.layer("c").fused.epilogue
    assert epilogue[0].role == "bias"


@pytest.mark.parametrize(
    "opset,act",
    [(13, "Clip"), (9, "Clip"), (13, "LeakyRelu"), (13, "SiLU"), (13, "Relu")],
)
def test_activations(opset, act):
    n = Net(seed=5, opset=opset)
    x = n.input("x", (1, 3, 8, 8))
    c = n.bn(n.conv(x, 4, name="c"))
    if act == "Clip" and opset >= 11:
        y = n.node("Clip", [c, n.const(np.array(0.0, np.float32)), n.const(np.array(6.0, np.float32))])
    elif act == "Clip":
        y = n.node("Clip", [c], min=0.0, max=6.0)
    elif act == "LeakyRelu":
        y = n.node("LeakyRelu", [c], alpha=0.2)
    elif act == "SiLU":
        y = n.node("Mul", [c, n.node("Sigmoid", [c])])
    else:
        y = n.relu(c)
    model = n.build([y])
    p = assert_realizes(model)
    g = _single_group(p)
    assert g.details["activation"] == act
    if act == "Clip":
        epi = p.second.layer("c").fused.epilogue[-1]
        assert (epi.params["min"], epi.params["max"]) == (0.0, 6.0)
    assert len(p.second) == 1


def test_conv_with_two_consumers_is_refused():
    n = Net(seed=6)
    x = n.input("x", (1, 3, 8, 8))
    c = n.conv(x, 4, name="c")
    a = n.relu(c)
    b = n.node("Sigmoid", [c])
    model = n.build([a, b])
    p = assert_realizes(model)
    assert not p.groups_of("vertical")
    (r,) = p.refusals_of("vertical")
    assert r.layers == ["c"]
    assert "2 consumer(s)" in r.reason and "single consumer" in r.reason


def test_conv_output_that_is_a_graph_output_is_refused():
    n = Net(seed=7)
    x = n.input("x", (1, 3, 8, 8))
    c = n.conv(x, 4, name="c")
    model = n.build([c, n.relu(c)])
    p = plan(model)
    assert not p.groups_of("vertical")
    assert "graph output" in p.refusals_of("vertical")[0].reason


def test_bn_parameters_as_graph_inputs_are_refused():
    n = Net(seed=8)
    x = n.input("x", (1, 3, 8, 8))
    y = n.bn(n.conv(x, 4, name="c"), params_as_inputs=True, name="bn")
    model = n.build([y])
    p = assert_realizes(model)
    assert not p.groups_of("vertical")
    (r,) = p.refusals_of("vertical")
    assert "bn_scale" in r.reason and "run-time input" in r.reason


def test_chain_stops_at_a_branch_and_keeps_the_valid_prefix():
    n = Net(seed=9)
    x = n.input("x", (1, 3, 8, 8))
    b = n.bn(n.conv(x, 4, name="c"))
    model = n.build([n.relu(b), n.node("Sigmoid", [b])])
    p = assert_realizes(model)
    g = _single_group(p)
    assert g.details["folded"] == ["BatchNormalization"]
    assert "2 consumer(s)" in g.details["stopped"]


def test_mul_that_is_not_per_channel_stops_the_chain():
    n = Net(seed=10)
    x = n.input("x", (1, 3, 8, 8))
    c = n.conv(x, 4, name="c")
    spatial = n.const(np.random.default_rng(0).uniform(0.5, 1.5, (1, 1, 8, 8)).astype(np.float32))
    y = n.node("Mul", [c, spatial])
    model = n.build([n.relu(y)])
    p = assert_realizes(model)
    assert not p.groups_of("vertical")
    assert "varies along axis 2" in p.refusals_of("vertical")[0].reason


def test_plain_conv_followed_by_pool_is_no_candidate():
    n = Net(seed=11)
    x = n.input("x", (1, 3, 8, 8))
    model = n.build([n.maxpool(n.conv(x, 4))])
    p = plan(model)
    assert not p.groups and not p.refusals
