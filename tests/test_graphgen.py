"""Random CNN graphs (``tvm_layerfuse.testing.graphgen``) and the planner's invariants on them.

The property test draws graphs with hypothesis (derandomized, so CI is reproducible) and
checks that each one is valid ONNX, runs in onnxruntime, and that ``plan()`` keeps its
invariants. The other tests pin down the generator itself: determinism, options, that it
reaches every block kind and every merge kind, that a failing graph shrinks, and that
its graphs are unambiguous (two ONNX implementations agree on them).

At the end: regression tests for planner bugs found while fuzzing, each with its
hand-written reproducer.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, find, given, settings
from onnx import helper, numpy_helper

from tvm_layerfuse.planner import plan
from tvm_layerfuse.testing import random_inputs
from tvm_layerfuse.testing.checks import plan_violations
from tvm_layerfuse.testing.checks import run_onnxruntime as run_ort
from tvm_layerfuse.testing.graphgen import CNNCase, cnn_graphs, random_cnn, random_cnn_case


def assert_plan_invariants(p) -> None:
    """Every original layer is in exactly one layer of the second graph; outputs are kept."""
    assert plan_violations(p) == []


# ---------------------------------------------------------------------- the property
@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cnn_graphs(max_layers=12))
def test_generated_graphs_are_valid_and_plans_keep_invariants(case: CNNCase):
    model, feeds = case
    onnx.checker.check_model(model, full_check=True)
    outputs = run_ort(model, feeds)
    assert len(outputs) == len(model.graph.output)
    assert all(np.isfinite(o).all() for o in outputs)
    assert_plan_invariants(plan(model))


def test_plan_violations_detects_broken_plans():
    import dataclasses

    from tvm_layerfuse.topology.graph import Layer

    p = plan(random_cnn(3))
    assert plan_violations(p) == []
    victim = p.second.layers[0]
    dropped = p.second.copy()
    dropped.replace([victim.name], [])
    assert any("layers lost" in v for v in plan_violations(dataclasses.replace(p, second=dropped)))
    doubled = p.second.copy()
    twin = Layer(name="twin", op_type="Identity", inputs=[], outputs=[], members=victim.members)
    doubled.replace([doubled.layers[-1].name], [doubled.layers[-1], twin])
    assert any("member of both" in v for v in plan_violations(dataclasses.replace(p, second=doubled)))
    renamed = dataclasses.replace(p, second=p.second.copy())
    renamed.second.outputs = list(reversed(renamed.second.outputs)) + ["nowhere"]
    assert any("outputs changed" in v for v in plan_violations(renamed))


# ---------------------------------------------------------------------- the generator
def test_random_cnn_is_deterministic():
    assert random_cnn(7).SerializeToString() == random_cnn(7).SerializeToString()
    assert random_cnn(7).SerializeToString() != random_cnn(8).SerializeToString()
    a, b = random_cnn_case(7), random_cnn_case(7)
    assert a.feeds.keys() == b.feeds.keys()
    assert all(np.array_equal(a.feeds[k], b.feeds[k]) for k in a.feeds)


@pytest.mark.parametrize("seed", range(6))
def test_random_cnn_options(seed):
    model = random_cnn(seed, batch=2, opset=10, max_layers=6, blocks=("conv", "activation", "residual"))
    onnx.checker.check_model(model, full_check=True)
    assert next(o.version for o in model.opset_import if o.domain == "") == 10
    x = model.graph.input[0]
    assert x.type.tensor_type.shape.dim[0].dim_value == 2
    dims = [d.dim_value for d in x.type.tensor_type.shape.dim]
    assert dims[1] <= 16 and dims[2] <= 16 and dims[3] <= 16
    allowed = {"Conv", "BatchNormalization", "Relu", "Clip", "LeakyRelu", "Sigmoid", "Mul", "Add", "Sub", "Div", "Sum"}
    assert {n.op_type for n in model.graph.node} - {"Constant", "Identity"} <= allowed
    # Opset 10 has Clip-6: bounds are attributes.
    assert all(len(n.input) == 1 for n in model.graph.node if n.op_type == "Clip")
    for out in run_ort(model, random_inputs(model, seed)):
        assert out.shape[0] == 2 or out.ndim < 4


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="blocks="):
        random_cnn(0, blocks=("conv", "lstm"))
    with pytest.raises(ValueError, match="max_layers=0"):
        random_cnn(0, max_layers=0)
    with pytest.raises(ValueError, match="batch=9"):
        cnn_graphs(batch=9)


def test_generator_reaches_every_feature_and_every_merge():
    """Over a fixed range of seeds the generator builds each structure the fuzzing is for,
    and the planner meets each template (so the property test exercises all of them)."""
    seen: collections.Counter = collections.Counter()
    for seed in range(100):
        model = random_cnn(seed, max_layers=20)
        nodes = list(model.graph.node)
        names = {n.output[0]: n for n in nodes}
        shapes = _shapes(model)
        seen.update(n.op_type for n in nodes)
        for n in nodes:
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            if n.op_type == "Conv":
                seen["conv k=%d" % attrs["kernel_shape"][0]] += 1
                seen["conv stride 2"] += attrs["strides"] == [2, 2]
                seen["conv dilation 2"] += attrs["dilations"] == [2, 2]
                seen["conv groups > 1"] += attrs["group"] > 1
                seen["conv auto_pad"] += "auto_pad" in attrs
                seen["conv no bias"] += len(n.input) == 2
            if n.op_type == "Concat":
                seen[f"concat axis {attrs['axis']}"] += 1
                seen["concat same input twice"] += len(set(n.input)) < len(n.input)
            if n.op_type == "Clip":
                seen[f"clip {len(n.input)} inputs"] += 1
            if n.op_type in ("Add", "Mul") and all(i in names for i in n.input):
                seen["broadcast data operand"] += len({shapes[i] for i in n.input}) > 1
        consumers = collections.Counter(i for n in nodes for i in set(n.input))
        outputs = {o.name for o in model.graph.output}
        seen["tensor with several consumers"] += any(consumers[n.output[0]] > 1 for n in nodes)
        seen["output in the middle"] += any(consumers[o] > 0 for o in outputs)
        seen["batch > 1"] += model.graph.input[0].type.tensor_type.shape.dim[0].dim_value > 1
        seen["unnamed nodes"] += all(not n.name for n in nodes)
        p = plan(model)
        for g in p.groups:
            seen["merge " + g.template] += 1
        for r in p.refusals:
            seen["refused " + r.kind] += 1
    expected = [
        "Conv", "BatchNormalization", "Relu", "Clip", "LeakyRelu", "Sigmoid", "Mul", "Add", "Sum", "Concat",
        "MaxPool", "AveragePool", "GlobalAveragePool", "Gemm", "Constant", "Identity",
        "conv k=1", "conv k=3", "conv k=5", "conv stride 2", "conv dilation 2", "conv groups > 1", "conv auto_pad",
        "conv no bias", "concat axis 1", "concat axis 0", "concat axis 2", "concat axis 3", "concat axis -3",
        "concat same input twice", "clip 1 inputs", "clip 2 inputs", "clip 3 inputs", "broadcast data operand",
        "tensor with several consumers", "output in the middle", "batch > 1", "unnamed nodes",
        "merge vertical.conv_chain", "merge vertical.preactivation", "merge horizontal.parallel_conv",
        "merge eltwise.conv_epilogue", "merge concat.in_place",
        "refused vertical", "refused horizontal", "refused eltwise", "refused concat",
    ]  # fmt: skip
    missing = [k for k in expected if seen[k] == 0]
    assert missing == []


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = inferred.graph
    out = {t.name: tuple(t.dims) for t in g.initializer}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        out[vi.name] = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
    return out


def test_failing_graphs_shrink():
    """A property that fails on graphs with a horizontal merge shrinks to a small graph."""

    def has_horizontal_merge(case: CNNCase) -> bool:
        return plan(case.model).counts()["horizontal"] > 0

    smallest = find(
        cnn_graphs(max_layers=10),
        has_horizontal_merge,
        settings=settings(max_examples=300, derandomize=True, database=None, deadline=None),
    )
    convs = [n for n in smallest.model.graph.node if n.op_type == "Conv"]
    # Two convs reading one tensor, joined: hardly anything else is left.
    assert len(convs) == 2
    assert len([n for n in smallest.model.graph.node if n.op_type not in ("Constant", "Identity")]) <= 4


def test_generated_graphs_are_unambiguous():
    """onnxruntime and onnx's reference evaluator agree on generated graphs, so a difference
    found by differential fuzzing is the compiler's, not an ambiguity of the graph.

    Opset 17: onnx.reference's BatchNormalization-9 (opsets 9-13) wrongly switches to
    training statistics when the ``momentum`` attribute is present, as torch writes it."""
    from onnx.reference import ReferenceEvaluator

    for seed in range(25):
        model, feeds = random_cnn_case(seed, opset=17, max_layers=8)
        expected = ReferenceEvaluator(model).run(None, feeds)
        for got, want, out in zip(run_ort(model, feeds), expected, model.graph.output):
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"seed {seed} output {out.name}")


# ---------------------------------------------------------------------- planner findings
def _model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "repro", inputs, outputs, initializer=initializers)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _init(rng, name, shape) -> onnx.TensorProto:
    return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)


def alias_reproducer() -> onnx.ModelProto:
    """``r = conv_a(x)`` goes into ``c = Concat(r, s)`` and is the residual of ``z = conv_b(x) + r``."""
    rng = np.random.default_rng(0)
    f = onnx.TensorProto.FLOAT
    return _model(
        [
            helper.make_node("Conv", ["x", "wa"], ["r"], name="conv_a", kernel_shape=[1, 1]),
            helper.make_node("Relu", ["x"], ["s"], name="relu_s"),
            helper.make_node("Concat", ["r", "s"], ["c"], name="cat", axis=1),
            helper.make_node("Conv", ["x", "wb"], ["b"], name="conv_b", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["b", "r"], ["z"], name="add"),
        ],
        [helper.make_tensor_value_info("x", f, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("c", f, [1, 5, 4, 4]), helper.make_tensor_value_info("z", f, [1, 3, 4, 4])],
        [_init(rng, "wa", (3, 2, 1, 1)), _init(rng, "wb", (3, 2, 3, 3))],
    )


def test_overwritten_residual_never_lives_in_a_concat_block():
    p = plan(alias_reproducer())
    assert_plan_invariants(p)  # the stated invariants hold ...
    slots = {t for layer in p.second for t in layer.fused.writes_into}
    overwritten = {layer.fused.extra_input for layer in p.second if layer.fused.overwrite_extra_input}
    assert not slots & overwritten  # ... but 'r' is both a concat slot and overwritten


def runtime_weight_reproducer() -> onnx.ModelProto:
    """``Relu(BatchNormalization(Conv(x, w)))`` where ``w`` is a graph input (run-time weights)."""
    f = onnx.TensorProto.FLOAT
    ones = [numpy_helper.from_array(np.full(3, v, np.float32), n) for n, v in zip("sbmv", (2.0, 0.5, 0.1, 4.0))]
    return _model(
        [
            helper.make_node("Conv", ["x", "w"], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["y", "s", "b", "m", "v"], ["n"], name="bn"),
            helper.make_node("Relu", ["n"], ["out"], name="relu"),
        ],
        [helper.make_tensor_value_info("x", f, [1, 2, 4, 4]), helper.make_tensor_value_info("w", f, [3, 2, 3, 3])],
        [helper.make_tensor_value_info("out", f, [1, 3, 4, 4])],
        ones,
    )


def test_batchnorm_is_never_folded_into_run_time_weights():
    p = plan(runtime_weight_reproducer())
    assert_plan_invariants(p)
    for layer in p.second:
        if layer.op_type == "Conv" and not p.second.is_constant(layer.inputs[1]):
            assert not any(e.folded for e in layer.fused.epilogue)


def self_overwrite_reproducer() -> onnx.ModelProto:
    """A one-conv residual: ``z = Conv3x3(r) + r`` with ``r = Relu(x)``."""
    rng = np.random.default_rng(0)
    f = onnx.TensorProto.FLOAT
    return _model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Conv", ["r", "w"], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["y", "r"], ["z"], name="add"),
        ],
        [helper.make_tensor_value_info("x", f, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("z", f, [1, 2, 4, 4])],
        [_init(rng, "w", (2, 2, 3, 3))],
    )


def test_fused_conv_never_overwrites_its_own_data_input():
    p = plan(self_overwrite_reproducer())
    assert_plan_invariants(p)
    for layer in p.second:
        if layer.fused.overwrite_extra_input:
            assert layer.fused.extra_input != layer.inputs[0]  # inputs[0]: the data the conv reads


def name_collision_reproducer() -> onnx.ModelProto:
    """Two parallel 1x1 convs named ``a`` and ``b`` feeding a Concat named ``a+b``."""
    rng = np.random.default_rng(0)
    f = onnx.TensorProto.FLOAT
    return _model(
        [
            helper.make_node("Conv", ["x", "wa"], ["ya"], name="a", kernel_shape=[1, 1]),
            helper.make_node("Conv", ["x", "wb"], ["yb"], name="b", kernel_shape=[1, 1]),
            helper.make_node("Concat", ["ya", "yb"], ["c"], name="a+b", axis=1),
        ],
        [helper.make_tensor_value_info("x", f, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("c", f, [1, 6, 4, 4])],
        [_init(rng, "wa", (3, 2, 1, 1)), _init(rng, "wb", (3, 2, 1, 1))],
    )


def test_merged_layer_names_never_collide():
    p = plan(name_collision_reproducer())
    assert_plan_invariants(p)
    assert p.counts()["horizontal"] == 1


def test_exporter_block_writes_the_exporters_forms():
    """The opt-in ``exporter`` block: every form appears over a few seeds, the graphs are
    valid and run in onnxruntime; the default block list (and so every existing seed's
    graph) does not draw it."""
    from tvm_layerfuse.testing.graphgen import ALL_BLOCKS, BLOCKS

    assert "exporter" in ALL_BLOCKS and "exporter" not in BLOCKS
    ops: collections.Counter = collections.Counter()
    symbolic = 0
    for seed in range(40):
        model, feeds = random_cnn_case(seed, max_layers=6, blocks=("conv", "exporter"))
        onnx.checker.check_model(model, full_check=True)
        run_ort(model, feeds)
        ops.update(n.op_type for n in model.graph.node)
        dims = [d for vi in model.graph.output for d in vi.type.tensor_type.shape.dim]
        symbolic += any(d.dim_param.startswith("p2o.DynamicDimension") for d in dims)
    for op in ("Shape", "Cast", "Slice", "Concat", "Reshape", "Transpose", "Softmax", "Resize", "Unsqueeze", "MatMul"):
        assert ops[op] > 0, op
    assert 0 < symbolic < 40
    assert not any(n.op_type == "Shape" for n in random_cnn(3, max_layers=12).graph.node)
