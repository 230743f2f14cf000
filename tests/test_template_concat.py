"""Concat template: producers write into one block at offsets; the offsets are checked
against onnxruntime's own concat output."""

import numpy as np
import pytest

from graphs import Net, assert_realizes, feeds_for, run_ort
from tvm_layerfuse.planner import plan
from tvm_layerfuse.report import plan_text


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


def _torchvision_dense_block(n: Net, x0: str, layers: int, *, prefix: str = "") -> tuple[list[str], str]:
    """A dense block as torchvision writes it: layer i reads Concat(x0, new_1, ..., new_{i-1})
    built afresh (BN -> Relu -> conv); the block ends with Concat(x0, new_1, ..., new_n)."""
    features, cats = [x0], []
    for i in range(layers):
        cat = n.concat(list(features), name=f"{prefix}cat{i + 1}")
        cats.append(cat)
        features.append(n.conv(n.relu(n.bn(cat)), 2, name=f"{prefix}d{i + 1}", bias=False))
    return cats, n.concat(features, name=f"{prefix}cat{layers + 1}")


@pytest.mark.parametrize("batch", [1, 2])
def test_prefix_concats_share_one_block(batch):
    n = Net(seed=7)
    x = n.input("x", (batch, 4, 4, 4))
    x0 = n.relu(n.conv(x, 4, name="stem"))
    cats, out = _torchvision_dense_block(n, x0, 3)
    model = n.build([n.conv(n.relu(n.bn(out)), 3, k=1, name="head")])
    p = assert_realizes(model)
    assert p.refusals_of("concat") == [] and len(p.groups_of("concat")) == 4
    block = p.second.layer("cat4")
    assert block.fused.in_place and block.fused.concat.view_of is None
    assert block.fused.concat.views == ("cat3", "cat2", "cat1")  # largest first
    whole, parts = _slot_values(model, p, "cat4")
    for view in ("cat1", "cat2", "cat3"):
        layer = p.second.layer(view)
        assert layer.fused.concat.view_of == "cat4" and layer.fused.concat.contiguous is (batch == 1)
        lo, hi = layer.fused.concat.range
        assert lo == 0 and hi == 4 + 2 * (int(view[-1]) - 1)
        # the view's slots are the block's leading slots, at the same offsets
        assert layer.fused.concat.slots == block.fused.concat.slots[: len(layer.inputs)]
        viewed, _ = _slot_values(model, p, view)
        np.testing.assert_array_equal(whole[:, lo:hi], viewed)
    # every producer writes once, into the one block
    writes = [(t, w.concat) for l in p.second for t, w in l.fused.writes_into.items()]
    assert sorted(writes) == sorted((t, "cat4") for t in block.inputs)
    text = plan_text(p, graphs=True)
    assert "prefix view [0:8] of the block of cat4" in text and "Concat(view of cat4)" in text


def test_prefix_view_that_is_a_graph_output_is_refused_exactly():
    n = Net(seed=8)
    x = n.input("x", (1, 4, 4, 4))
    x0 = n.relu(n.conv(x, 4, name="stem"))
    cats, out = _torchvision_dense_block(n, x0, 2)
    model = n.build([out, cats[1]])  # cat2 is also a graph output: it needs storage of its own
    p = assert_realizes(model)
    (r,) = p.refusals_of("concat")
    assert r.layers[0] == "cat2"
    assert r.reason == (
        "'cat2' is a prefix of concat 'cat3', whose block its inputs already write into, "
        f"but its output {cats[1]!r} is a graph output and needs storage of its own"
    )
    assert p.second.layer("cat1").fused.concat.view_of == "cat3"  # the other prefix is still a view


def test_concat_reading_a_prefix_view_is_refused_exactly():
    n = Net(seed=9)
    x = n.input("x", (1, 4, 4, 4))
    x0 = n.relu(n.conv(x, 4, name="stem"))
    cats, out = _torchvision_dense_block(n, x0, 2)
    other = n.concat([cats[1], n.relu(n.conv(x, 2, name="side"))], name="other")
    p = assert_realizes(n.build([out, other]))
    (r,) = p.refusals_of("concat")
    assert r.layers[0] == "other"
    assert r.reason == f"input {cats[1]!r} is a prefix view of concat 'cat3' and already lives in its block"
