"""Concat template: producers write into one block at offsets; the offsets are checked
against onnxruntime's own concat output."""

import numpy as np
import pytest

from graphs import Net, assert_realizes, feeds_for, run_ort
from tvm_layerfuse.planner import plan


def _slot_values(model, p, name):
    """Run the model and return (concat output, {tensor: producer output})."""
    concat = p.second.layer(name)
    ins = list(concat.inputs)
    outs = run_ort(model, feeds_for(model), extra_outputs=[concat.outputs[0]] + ins)
    return outs[-len(ins) - 1], dict(zip(ins, outs[-len(ins):]))


@pytest.mark.parametrize("batch", [1, 4])
def test_offsets_address_each_producer(batch):
    n = Net(seed=batch)
    x = n.input("x", (batch, 3, 5, 5))
    a = n.relu(n.conv(x, 2))
    b = n.relu(n.conv(x, 5, k=1))
    c = n.maxpool(x)
    model = n.build([n.concat([a, b, c], name="cat")])
    p = assert_realizes(model)
    (g,) = p.groups_of("concat")
    assert g.details["contiguous"] is (batch == 1)
    whole, parts = _slot_values(model, p, "cat")
    flat = whole.reshape(-1)
    item = whole.dtype.itemsize
    for off in g.details["offsets"]:
        lo, hi = off["range"]
        np.testing.assert_array_equal(whole[:, lo:hi], parts[off["tensor"]])
        if batch == 1:
            start = off["byte_offset"] // item
            np.testing.assert_array_equal(flat[start : start + parts[off["tensor"]].size], parts[off["tensor"]].reshape(-1))
        else:
            assert off["byte_offset"] is None
    assert g.details["block_bytes"] == whole.nbytes


def test_concat_on_another_axis():
    n = Net(seed=2)
    x = n.input("x", (1, 3, 4, 5))
    a = n.relu(n.conv(x, 3))
    b = n.relu(n.conv(x, 3, k=1))
    model = n.build([n.concat([a, b], axis=2, name="cat")])
    p = assert_realizes(model)
    (g,) = p.groups_of("concat")
    assert g.details["axis"] == 2 and g.details["contiguous"] is False
    assert [o["range"] for o in g.details["offsets"]] == [[0, 4], [4, 8]]


def test_graph_input_producer_is_refused():
    n = Net(seed=3)
    x = n.input("x", (1, 3, 4, 4))
    model = n.build([n.concat([x, n.conv(x, 2)], name="cat")])
    p = plan(model)
    (r,) = p.refusals_of("concat")
    assert r.reason == "input 'x' is a graph input; only layer outputs can be written in place"


def test_repeated_input_and_graph_output_are_refused():
    n = Net(seed=4)
    x = n.input("x", (1, 3, 4, 4))
    a = n.conv(x, 2, name="a")
    model = n.build([n.concat([a, a], name="twice")])
    assert "appears twice" in plan(model).refusals_of("concat")[0].reason
    n = Net(seed=4)
    x = n.input("x", (1, 3, 4, 4))
    a = n.conv(x, 2, name="a")
    model = n.build([n.concat([a, n.conv(x, 2, name="b")], name="cat"), a])
    assert "also a graph output" in plan(model).refusals_of("concat")[0].reason


def test_producer_also_read_elsewhere_still_in_place():
    n = Net(seed=5)
    x = n.input("x", (1, 3, 4, 4))
    a = n.relu(n.conv(x, 2, name="a"))
    b = n.relu(n.conv(x, 2, k=1, name="b"))
    cat = n.concat([a, b], name="cat")
    model = n.build([n.node("Add", [n.conv(cat, 2, k=1), a])])
    p = assert_realizes(model)
    assert len(p.groups_of("concat")) == 1


def test_nested_concats_share_one_block():
    n = Net(seed=6)
    x = n.input("x", (1, 4, 4, 4))
    x0 = n.relu(n.conv(x, 4, name="stem"))
    c1 = n.concat([x0, n.relu(n.conv(x0, 2, name="d1"))], name="cat1")
    c2 = n.concat([c1, n.relu(n.conv(c1, 2, name="d2"))], name="cat2")
    model = n.build([c2])
    p = assert_realizes(model)
    assert len(p.groups_of("concat")) == 2
    cat1 = p.second.layer("cat1")
    assert cat1.fused.writes_into[c1].to_dict() == {"concat": "cat2", "axis": 1, "range": [0, 6], "byte_offset": 0}
