"""Horizontal template: parallel Convs on one tensor merge into one Conv + split."""

import pytest

from graphs import Net, assert_realizes, feeds_for, rel_err, run_ort
from tvm_layerfuse.planner import plan


def _inception(n, x, widths=(4, 3, 2), *, bias=(True, True, True), pool=True):
    a = n.relu(n.conv(x, widths[0], k=1, bias=bias[0], name="b1"))
    r3 = n.relu(n.conv(x, widths[1], k=1, bias=bias[1], name="b3r"))
    r5 = n.relu(n.conv(x, widths[2], k=1, bias=bias[2], name="b5r"))
    b = n.relu(n.conv(r3, 5, k=3, name="b3"))
    c = n.relu(n.conv(r5, 3, k=5, name="b5"))
    outs = [a, b, c]
    if pool:
        outs.append(n.relu(n.conv(n.maxpool(x), 2, k=1, name="bp")))
    return n.concat(outs, name="cat"), [a, r3, r5]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("bias", [(True, True, True), (False, True, False)])
def test_inception_block_merges_three_1x1(batch, bias):
    n = Net(seed=batch)
    x = n.input("x", (batch, 6, 7, 7))
    cat, branch_outputs = _inception(n, x, bias=bias)
    model = n.build([cat])
    p = assert_realizes(model)
    (g,) = p.groups_of("horizontal")
    assert g.details["split"] == [
        {"branch": "b1", "channels": [0, 4]},
        {"branch": "b3r", "channels": [4, 7]},
        {"branch": "b5r", "channels": [7, 9]},
    ]
    assert g.details["out_channels"] == 9
    assert g.details["join"] == "cat"
    merged = p.second.layer(g.layer)
    assert merged.outputs == branch_outputs  # each branch keeps its own output tensor
    assert len(g.members) == 6  # three convs and their Relus
    # the pool branch reads another tensor: it is not part of the merge
    assert "bp" not in g.members


def test_split_ranges_address_each_branch_output():
    """Slicing the merged conv's output by the plan's ranges gives each branch's tensor."""
    import numpy as np

    from tvm_layerfuse.onnx_realize import realize

    n = Net(seed=5)
    x = n.input("x", (1, 5, 6, 6))
    model = n.build([_inception(n, x, widths=(3, 5, 2), pool=False)[0]])
    p = plan(model)
    fused = realize(p, model)
    feeds = feeds_for(model)
    (g,) = p.groups_of("horizontal")
    merged_name = f"{g.layer}::e0"  # the merged conv after its shared Relu
    outs = [s.output for s in p.second.layer(g.layer).fused.split]
    got = run_ort(fused, feeds, extra_outputs=[merged_name] + outs)
    whole, parts = got[1], got[2:]
    for s, part in zip(g.details["split"], parts):
        lo, hi = s["channels"]
        np.testing.assert_array_equal(whole[:, lo:hi], part)
    ref = run_ort(model, feeds, extra_outputs=outs)[1:]
    for a, b in zip(ref, parts):
        assert rel_err(a, b) <= 1e-4


def test_different_strides_are_refused_with_reason():
    n = Net(seed=2)
    x = n.input("x", (1, 4, 8, 8))
    a = n.conv(x, 4, k=1, stride=1, name="s1")
    b = n.conv(x, 4, k=1, stride=2, name="s2")
    model = n.build([n.node("Add", [n.maxpool(a, k=1, stride=2, pad=0), b])])
    p = assert_realizes(model)
    assert not p.groups_of("horizontal")
    (r,) = p.refusals_of("horizontal")
    assert r.reason == "strides differ: 's1' has [1, 1], 's2' has [2, 2]"


def test_different_kernel_sizes_are_refused():
    n = Net(seed=3)
    x = n.input("x", (1, 4, 8, 8))
    model = n.build([n.concat([n.relu(n.conv(x, 4, k=1, name="e1")), n.relu(n.conv(x, 4, k=3, name="e3"))])])
    p = plan(model)
    (r,) = p.refusals_of("horizontal")
    assert r.reason.startswith("kernel_shape differ")


def test_grouped_convs_are_refused():
    n = Net(seed=4)
    x = n.input("x", (1, 4, 8, 8))
    model = n.build([n.concat([n.conv(x, 4, group=2, name="g1"), n.conv(x, 4, group=2, name="g2")])])
    p = assert_realizes(model)
    (r,) = p.refusals_of("horizontal")
    assert "group=2" in r.reason


def test_different_activations_are_refused():
    n = Net(seed=5)
    x = n.input("x", (1, 4, 8, 8))
    model = n.build([n.concat([n.relu(n.conv(x, 4, name="a")), n.conv(x, 4, name="b")])])
    p = plan(model)
    (r,) = p.refusals_of("horizontal")
    assert r.reason == "epilogues differ: 'a' ends with Relu, 'b' with no activation"


def test_branches_that_never_meet_are_refused():
    n = Net(seed=6)
    x = n.input("x", (1, 4, 8, 8))
    model = n.build([n.conv(x, 4, name="a"), n.conv(x, 4, name="b")])
    p = plan(model)
    (r,) = p.refusals_of("horizontal")
    assert r.reason == "the branches' outputs never reach a common layer"


def test_compatible_pair_merges_and_odd_one_is_explained():
    n = Net(seed=7)
    x = n.input("x", (1, 4, 8, 8))
    a = n.conv(x, 3, k=1, name="a")
    b = n.conv(x, 5, k=1, name="b")
    c = n.conv(x, 2, k=3, name="c")
    model = n.build([n.concat([a, b, c])])
    p = assert_realizes(model)
    (g,) = p.groups_of("horizontal")
    assert g.members == ["a", "b"]
    (r,) = p.refusals_of("horizontal")
    assert r.layers == ["a+b", "c"] and r.reason.startswith("kernel_shape differ")


def test_weights_computed_at_run_time_are_refused():
    n = Net(seed=8)
    x = n.input("x", (1, 4, 8, 8))
    model = n.build([n.concat([n.conv(x, 4, name="a", weight_input=True), n.conv(x, 4, name="b")])])
    p = assert_realizes(model)
    (r,) = p.refusals_of("horizontal")
    assert "a_w" in r.reason and "run time" in r.reason
