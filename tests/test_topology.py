"""First topology graph: layers, constants, shapes, edges; and malformed models."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphs import Net, run_ort
from tvm_layerfuse.errors import GraphError, ModelLoadError, ShapeError
from tvm_layerfuse.models import light_model
from tvm_layerfuse.planner import plan
from tvm_layerfuse.topology import read_onnx


def _model(nodes, inputs, outputs, inits=(), opset=13):
    g = helper.make_graph(nodes, "t", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_light_inception_layers_shapes_and_constants():
    g = read_onnx(light_model("inception_v1"))
    assert len(g) == 143
    assert g.op_counts()["Conv"] == 57 and "ConstantOfShape" not in g.op_counts()
    conv = g.layer("n0")
    assert g.data_inputs(conv) == ["data_0"]
    w = g.tensor(conv.inputs[1])
    assert w.constant and w.origin == "ConstantOfShape" and w.shape == (64, 3, 7, 7)
    assert w.value().shape == (64, 3, 7, 7) and np.allclose(w.value(), 0.02)
    assert g.tensor(conv.outputs[0]).shape == (1, 64, 112, 112)
    assert g.tensor(conv.outputs[0]).dtype == "float32"
    assert [c.name for c in g.consumers(conv.outputs[0])] == ["n1"]
    assert g.inputs == ["data_0"] and g.outputs == ["prob_1"]


def test_constant_identity_unsqueeze_chains_fold_and_values_match_onnxruntime():
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w0"], value=numpy_helper.from_array(w)),
        helper.make_node("Identity", ["w0"], ["w"]),
        helper.make_node("Constant", [], ["b0"], value=numpy_helper.from_array(np.arange(4, dtype=np.float32))),
        helper.make_node("Unsqueeze", ["b0", "axes"], ["b1"]),
        helper.make_node("Squeeze", ["b1", "axes"], ["b"]),
        helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1]),
    ]
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    m = _model(nodes, [_vi("x", [1, 3, 5, 5])], [_vi("y", [1, 4, 5, 5])], [axes])
    g = read_onnx(m)
    assert [l.name for l in g] == ["conv"]
    assert g.tensor("w").origin == "Identity(Constant)"
    np.testing.assert_array_equal(g.tensor("w").value(), w)
    np.testing.assert_array_equal(g.tensor("b").value(), np.arange(4, dtype=np.float32))
    assert g.tensor("b").shape == (4,)
    # the folded constants are what onnxruntime computes too
    got = run_ort(m, {"x": np.zeros((1, 3, 5, 5), np.float32)})[0]
    np.testing.assert_allclose(got[0, :, 2, 2], np.arange(4, dtype=np.float32))


def test_to_dict_is_json_and_lists_edges():
    n = Net()
    x = n.input("x", (1, 3, 4, 4))
    model = n.build([n.relu(n.conv(x, 2, name="c"), name="r")])
    d = read_onnx(model).to_dict()
    json.dumps(d)
    assert d["edges"] == [{"tensor": "x", "from": None, "to": "c"}, {"tensor": "c_out", "from": "c", "to": "r"}]
    assert d["layers"][0]["weights"]["c_w"]["shape"] == [2, 3, 3, 3]


def test_unnamed_and_duplicate_node_names_get_unique_layer_names():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"], name="r"),
             helper.make_node("Relu", ["b"], ["c"], name="r")]
    g = read_onnx(_model(nodes, [_vi("x", [1, 2])], [_vi("c", [1, 2])]))
    assert [l.name for l in g] == ["Relu_a", "r", "r#2"]


def test_unsorted_nodes_are_sorted():
    nodes = [helper.make_node("Relu", ["a"], ["b"], name="second"), helper.make_node("Relu", ["x"], ["a"], name="first")]
    g = read_onnx(_model(nodes, [_vi("x", [1, 2])], [_vi("b", [1, 2])]))
    assert [l.name for l in g] == ["first", "second"]


def test_cycle_is_refused():
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="p"), helper.make_node("Relu", ["a"], ["b"], name="q")]
    with pytest.raises(GraphError, match="has a cycle through nodes"):
        read_onnx(_model(nodes, [_vi("x", [1, 2])], [_vi("b", [1, 2])]))


def test_dangling_input_is_refused():
    nodes = [helper.make_node("Add", ["x", "nowhere"], ["y"], name="add")]
    with pytest.raises(GraphError, match="reads tensor 'nowhere', which no node, initializer or graph input defines"):
        read_onnx(_model(nodes, [_vi("x", [1, 2])], [_vi("y", [1, 2])]))


def test_duplicate_tensor_producers_are_refused():
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Sigmoid", ["x"], ["y"])]
    with pytest.raises(GraphError, match="tensor 'y' .* is defined twice"):
        read_onnx(_model(nodes, [_vi("x", [1, 2])], [_vi("y", [1, 2])]))


def test_dynamic_input_needs_input_shape():
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 4])], [_vi("y", ["N", 3, 4, 4])])
    with pytest.raises(ShapeError, match=r"dynamic shape \[\?,3,4,4\].*--input-shape x=1,3,4,4"):
        read_onnx(m)
    g = read_onnx(m, input_shapes={"x": [2, 3, 4, 4]})
    assert g.tensor("y").shape == (2, 3, 4, 4)
    with pytest.raises(ShapeError, match="not an input of model"):
        read_onnx(m, input_shapes={"nope": [1]})
    with pytest.raises(ShapeError, match="has rank 2"):
        read_onnx(m, input_shapes={"x": [1, 3]})


def test_zero_dim_and_huge_shapes_are_refused():
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    m = _model(nodes, [_vi("x", [1, 0, 4])], [_vi("y", None)])
    with pytest.raises(ShapeError, match="zero dimension"):
        read_onnx(m)
    m = _model(nodes, [_vi("x", [100000, 100000, 100000])], [_vi("y", None)])
    with pytest.raises(ShapeError, match="elements"):
        read_onnx(m)


def test_unknown_op_is_kept_unfused_and_reported():
    n = Net()
    x = n.input("x", (1, 3, 4, 4))
    c = n.conv(x, 2, name="c")
    model = n.build([n.relu(c)])
    # put a custom-domain op between conv and relu
    node = helper.make_node("Mystery", [c], ["m"], domain="com.example", name="mystery")
    model.graph.node.insert(1, node)
    model.graph.node[2].input[0] = "m"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    p = plan(model)
    assert p.first.layer("mystery").attrs["_unknown_op"]
    assert p.first.meta["unknown_ops"] == ["com.example::Mystery"]
    assert not p.groups_of("vertical")
    assert "com.example::Mystery" in p.graph_notes()[0]


@pytest.mark.parametrize(
    "content,match",
    [
        (b"", "is empty"),
        (bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)), "not an ONNX model"),
    ],
)
def test_bad_files(tmp_path, content, match):
    f = tmp_path / "bad.onnx"
    f.write_bytes(content)
    with pytest.raises(ModelLoadError, match=match):
        read_onnx(f)


def test_truncated_file(tmp_path):
    data = light_model("squeezenet").read_bytes()
    f = tmp_path / "cut.onnx"
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises((ModelLoadError, GraphError)) as e:
        read_onnx(f)
    assert "\n" not in str(e.value)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_onnx(tmp_path / "nope.onnx")
    with pytest.raises(ModelLoadError, match="is a directory"):
        read_onnx(tmp_path)


def test_opset_too_new_and_too_old():
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    m = _model(nodes, [_vi("x", [1, 2])], [_vi("y", [1, 2])], opset=onnx.defs.onnx_opset_version() + 5)
    with pytest.raises(ModelLoadError, match="newer than"):
        read_onnx(m)
    m = _model(nodes, [_vi("x", [1, 2])], [_vi("y", [1, 2])], opset=5)
    with pytest.raises(ModelLoadError, match="expected opset >= 7"):
        read_onnx(m)


def test_initializer_listed_as_input_is_a_constant():
    w = numpy_helper.from_array(np.ones((2, 2), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    m = _model(nodes, [_vi("x", [1, 2]), _vi("w", [2, 2])], [_vi("y", [1, 2])], [w])
    m.ir_version = 3
    g = read_onnx(m)
    assert g.inputs == ["x"] and g.tensor("w").constant
