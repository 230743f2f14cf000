"""Element-wise template: a residual Add/Sum/Mul moves into a Conv epilogue."""

import dataclasses

import pytest

from graphs import Net, assert_realizes
from tvm_layerfuse.planner import plan


def _residual(n, x, *, op="Add", act=True):
    y = n.relu(n.bn(n.conv(x, n.shape[x][1], name="c1")))
    y = n.bn(n.conv(y, n.shape[x][1], name="c2"), name="bnb")
    s = n.node(op, [y, x], name="res")
    return n.relu(s, name="out") if act else s


def test_resnet_basic_block_moves_add_and_relu_into_conv():
    n = Net(seed=1)
    x = n.input("x", (2, 4, 6, 6))
    x1 = n.relu(n.conv(x, 4, name="stem"))
    model = n.build([_residual(n, x1)])
    p = assert_realizes(model)
    (g,) = p.groups_of("eltwise")
    assert g.details == {
        "conv": "c2",
        "op": "Add",
        "extra_input": x1,
        "activation": "Relu",
        "overwrite_extra_input": True,
    }
    layer = p.second.layer("c2")
    assert layer.inputs[-1] == x1
    assert [e.op for e in layer.fused.epilogue] == ["BatchNormalization", "Add", "Relu"]
    assert len(p.second) == 3  # stem, c1, c2 (+bn2 + res + relu)


def test_facts_are_frozen_and_keep_their_json_form():
    n = Net(seed=1)
    x = n.input("x", (2, 4, 6, 6))
    x1 = n.relu(n.conv(x, 4, name="stem"))
    p = plan(n.build([_residual(n, x1)]))
    before = p.intermediate.layer("c2").fused  # after the vertical merge, before the element-wise one
    after = p.second.layer("c2").fused
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.extra_input = "y"
    assert before.extra_input is None and [e.op for e in before.epilogue] == ["BatchNormalization"]
    bn, add, relu = (e.layer for e in after.epilogue)
    assert after.to_dict() == {
        "prologue": [],
        "epilogue": [
            {"op": "BatchNormalization", "role": "batchnorm", "layer": bn, "folded": True},
            {"op": "Add", "role": "residual", "layer": add, "extra_input": x1},
            {"op": "Relu", "role": "activation", "layer": relu},
        ],
        "extra_input": x1,
        "overwrite_extra_input": True,
    }


def test_sum_and_mul_variants():
    for op in ("Sum", "Mul"):
        n = Net(seed=2)
        x = n.input("x", (1, 4, 6, 6))
        x1 = n.relu(n.conv(x, 4, name="stem"))
        model = n.build([_residual(n, x1, op=op, act=False)])
        p = assert_realizes(model)
        (g,) = p.groups_of("eltwise")
        assert g.details["op"] == op and g.details["activation"] is None


def test_projection_shortcut_later_conv_absorbs():
    n = Net(seed=3)
    x = n.input("x", (1, 4, 6, 6))
    short = n.bn(n.conv(x, 8, k=1, name="proj"))
    y = n.relu(n.bn(n.conv(x, 4, k=1, name="a")))
    y = n.bn(n.conv(y, 8, name="b"))
    model = n.build([n.relu(n.node("Add", [short, y]))])
    p = assert_realizes(model)
    (g,) = p.groups_of("eltwise")
    assert g.details["conv"] == "b"  # the later of the two candidate convs
    assert g.details["extra_input"] == short  # the projection's (folded) output feeds the epilogue


def test_extra_input_read_later_is_not_overwritten():
    n = Net(seed=4)
    x = n.input("x", (1, 4, 6, 6))
    x1 = n.relu(n.conv(x, 4, name="stem"))
    r = n.node("Add", [n.conv(x1, 4, name="c"), x1], name="res")
    tail = n.node("Mul", [r, x1], name="later")  # reads x1 after the residual
    model = n.build([tail])
    p = assert_realizes(model)
    g = p.groups_of("eltwise")[0]
    assert g.details["conv"] == "c" and g.details["overwrite_extra_input"] is False


def test_conv_with_other_reader_is_refused():
    n = Net(seed=5)
    x = n.input("x", (1, 4, 6, 6))
    x1 = n.relu(n.conv(x, 4, name="stem"))
    c = n.conv(x1, 4, name="c")
    model = n.build([n.node("Add", [c, x1], name="res"), n.node("Sigmoid", [c])])
    p = assert_realizes(model)
    assert not p.groups_of("eltwise")
    (r,) = p.refusals_of("eltwise")
    assert "has 2 readers" in r.reason


def test_broadcast_that_enlarges_the_result_is_refused():
    n = Net(seed=6)
    x = n.input("x", (1, 4, 1, 1))
    big = n.input("big", (1, 4, 5, 5))
    c = n.conv(x, 4, k=1, name="c")
    model = n.build([n.node("Add", [c, big], shape=(1, 4, 5, 5), name="res")])
    p = assert_realizes(model)
    (r,) = p.refusals_of("eltwise")
    assert "broadcasts the result beyond the conv output" in r.reason


def test_sum_of_three_is_refused():
    n = Net(seed=7)
    x = n.input("x", (1, 4, 6, 6))
    c = n.conv(x, 4, name="c")
    model = n.build([n.node("Sum", [c, x, x], name="s3")])
    p = plan(model)
    (r,) = p.refusals_of("eltwise")
    assert "has 3 inputs" in r.reason
