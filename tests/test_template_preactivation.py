"""Pre-activation template: BatchNormalization -> [Mul/Add] -> activation -> Conv."""

from graphs import Net, assert_realizes
from tvm_layerfuse.planner import plan


def _dense_layer(n, x):
    y = n.bn(x, name="bn")
    y = n.node("Mul", [y, n.channel_const(y)])
    y = n.node("Add", [y, n.channel_const(y, low=-0.2, high=0.2)])
    return n.conv(n.relu(y), 4, bias=False, name="conv")


def test_densenet_style_prologue_merges():
    n = Net(seed=1, opset=9)
    x = n.input("x", (1, 6, 8, 8))
    c = _dense_layer(n, x)
    model = n.build([n.concat([x, c])])
    p = assert_realizes(model)
    (g,) = p.groups_of("vertical.preactivation")
    assert g.details["prologue"] == ["BatchNormalization", "Mul", "Add", "Relu"]
    fused = p.second.layer("conv")
    assert fused.inputs[0] == "x"  # the prologue reads the block input directly
    assert [e.op for e in fused.fused.prologue] == ["BatchNormalization", "Mul", "Add", "Relu"]


def test_prologue_and_epilogue_on_one_conv():
    n = Net(seed=2)
    x = n.input("x", (2, 5, 6, 6))
    y = n.relu(n.bn(x))
    y = n.relu(n.bn(n.conv(y, 7, name="conv")))
    model = n.build([y])
    p = assert_realizes(model)
    assert len(p.second) == 1
    layer = p.second.layer("conv")
    assert layer.template == "vertical.conv_chain+vertical.preactivation"
    assert len(layer.members) == 5


def test_activation_with_two_readers_is_refused():
    n = Net(seed=3)
    x = n.input("x", (1, 4, 6, 6))
    r = n.relu(n.bn(x))
    model = n.build([n.conv(r, 4, name="a"), n.conv(r, 4, k=1, name="b")])
    p = assert_realizes(model)
    assert not p.groups_of("vertical.preactivation")
    (r,) = p.refusals_of("vertical.preactivation")
    assert "2 readers" in r.reason


def test_bn_with_runtime_parameters_is_refused():
    n = Net(seed=4)
    x = n.input("x", (1, 4, 6, 6))
    model = n.build([n.conv(n.relu(n.bn(x, params_as_inputs=True, name="bn")), 4, name="c")])
    p = plan(model)
    (r,) = p.refusals_of("vertical.preactivation")
    assert "run-time input" in r.reason
