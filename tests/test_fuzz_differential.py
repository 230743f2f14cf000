"""Differential testing of the fusion on generated graphs: the suite's share of ``scripts/fuzz.py``.

Every generated graph (``tvm_layerfuse.testing.graphgen.cnn_graphs``, hypothesis,
derandomized) goes through :func:`tvm_layerfuse.testing.differential.check_case`:

* the plan keeps its invariants, including the in-place ones (no tensor read later, and no
  concat slot, is overwritten by an element-wise epilogue);
* the plan written back as ONNX (``onnx_realize``) agrees with onnxruntime;
* unfused TVM, fused TVM and onnxruntime (optimisations off) agree:
  ``max|a-b| / max(max|a|, M/10) <= 1e-4`` with ``M`` the largest magnitude among the
  output's ancestors (the near-zero rule; see the differential module).

Budget (measured on the 2-core machine, idle): the plan/realisation property runs 300
graphs in ~3 s; the TVM properties compile each graph three times (unfused, fused with
TVM's default pipeline, fused with the lowering that ``compile`` uses; ~0.8 s per graph):
90 general graphs in ~75 s and 50 branchy ones in ~60 s, ~2.3 minutes for the file.
``-m slow`` adds 600 larger graphs (tens of minutes). ``python scripts/fuzz.py`` runs thousands
in parallel workers (~75-90 graphs per minute with two).

At the end: regression tests for the bugs the fuzzing found, each with its reduced
reproducer written out by hand.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from onnx import helper, numpy_helper

from tvm_layerfuse.planner import TVM_UNSUPPORTED_ONNX_OPS, plan
from tvm_layerfuse.testing.checks import plan_violations
from tvm_layerfuse.testing.differential import (
    RTOL,
    CaseResult,
    check_case,
    overwrite_violations,
    reduce_case,
    relative_error,
    run_reference,
)
from tvm_layerfuse.testing.graphgen import CNNCase, cnn_graphs, random_cnn_case

PROPERTY = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def assert_agrees(res: CaseResult) -> None:
    assert res.findings == [], "\n".join(f"{f.kind}: {f.detail}" for f in res.findings)


# ---------------------------------------------------------------------- the properties
@settings(max_examples=300, **PROPERTY)
@given(cnn_graphs(max_layers=12))
def test_plans_keep_invariants_and_their_onnx_realisation_agrees(case: CNNCase):
    assert_agrees(check_case(case.model, case.feeds, stages=("plan", "realize")))


@settings(max_examples=16, **PROPERTY)
@given(cnn_graphs(max_layers=6))
def test_fused_tvm_unfused_tvm_and_onnxruntime_agree(case: CNNCase):
    res = check_case(case.model, case.feeds)
    assert_agrees(res)
    assert res.refused is None, res.refused  # generated graphs hold only ops the fusion handles


@settings(max_examples=10, **PROPERTY)
@given(cnn_graphs(max_layers=8, blocks=("parallel", "concat", "residual")))
def test_agreement_on_branchy_graphs(case: CNNCase):
    """Parallel convs, concats and residuals only: horizontal merges, in-place concats and
    element-wise epilogues are several times more frequent than in the general graphs."""
    res = check_case(case.model, case.feeds)
    assert_agrees(res)
    assert res.refused is None, res.refused


@pytest.mark.slow
@settings(max_examples=600, **PROPERTY)
@given(cnn_graphs(max_layers=12, max_channels=24))
def test_fused_tvm_unfused_tvm_and_onnxruntime_agree_on_larger_graphs(case: CNNCase):
    res = check_case(case.model, case.feeds)
    assert_agrees(res)
    assert res.refused is None, res.refused


# ---------------------------------------------------------------------- the checker itself
def test_tolerance_rule():
    ref = np.array([1.0, -2.0, 0.5], np.float32)
    assert relative_error(ref, ref) == 0.0
    assert relative_error(ref, ref + np.float32(1e-4)) == pytest.approx(5e-5, rel=1e-3)  # / max|ref| = 2
    # a near-zero output is measured against a tenth of the scale it was computed from
    tiny = np.array([1e-7, -3e-7], np.float32)
    off = tiny + np.float32(5e-6)
    assert relative_error(tiny, off) > 1  # relative to its own size: a failure
    assert relative_error(tiny, off, scale=10.0) == pytest.approx(5e-6, rel=1e-2)  # / (10 / 10)
    assert relative_error(tiny, off, scale=10.0) <= RTOL
    # ... but the floor never hides an error of the output's own size
    assert relative_error(tiny * 1e6, tiny * 1e6 * 1.01, scale=10.0) > RTOL
    # shapes and non-finite values must match exactly
    assert relative_error(ref, ref[:2]) == np.inf
    nan = ref.copy()
    nan[1] = np.nan
    assert relative_error(nan, nan) == 0.0
    assert relative_error(ref, nan) == np.inf
    assert relative_error(nan, np.where(np.isnan(nan), np.inf, nan)) == np.inf


def test_reference_scales_cover_every_intermediate_tensor():
    model, feeds = random_cnn_case(5, max_layers=6)
    outputs, values = run_reference(model, feeds)
    produced = [o for n in model.graph.node for o in n.output]
    assert set(produced) <= set(values)
    assert len(outputs) == len(model.graph.output)


def _alias_model() -> onnx.ModelProto:
    """``r = conv_a(x)`` is a Concat slot and the residual of ``z = conv_b(x) + r``."""
    rng = np.random.default_rng(0)
    f = onnx.TensorProto.FLOAT
    init = lambda n, s: numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
    g = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "wa"], ["r"], name="conv_a", kernel_shape=[1, 1]),
            helper.make_node("Relu", ["x"], ["s"], name="relu_s"),
            helper.make_node("Concat", ["r", "s"], ["c"], name="cat", axis=1),
            helper.make_node("Conv", ["x", "wb"], ["b"], name="conv_b", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["b", "r"], ["z"], name="add"),
        ],
        "alias",
        [helper.make_tensor_value_info("x", f, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("c", f, [1, 5, 4, 4]), helper.make_tensor_value_info("z", f, [1, 3, 4, 4])],
        [init("wa", (3, 2, 1, 1)), init("wb", (3, 2, 3, 3))],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def test_overwrite_violations_catches_an_overwritten_concat_slot_and_later_reader():
    p = plan(_alias_model())
    assert plan_violations(p) == [] and overwrite_violations(p) == []
    fused = next(l for l in p.second if l.fused.extra_input == "r")
    assert not fused.fused.overwrite_extra_input  # the planner refuses it: 'r' lives in the concat block
    fused.fused = dataclasses.replace(fused.fused, overwrite_extra_input=True)  # what the planner bug fixed in 968865d did
    assert overwrite_violations(p) == [
        "'conv_b' may overwrite 'r', which lives in the block of in-place concat 'cat'",
        "'conv_b' may overwrite 'c' (an alias of 'r' through an in-place concat), a graph output",
    ]

    # r = Relu(x); z = Conv(x) + r; q = Sigmoid(r) runs after the fused conv
    f = onnx.TensorProto.FLOAT
    w = numpy_helper.from_array(np.ones((2, 2, 1, 1), np.float32), "w")
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Conv", ["x", "w"], ["y"], name="conv"),
            helper.make_node("Add", ["y", "r"], ["z"], name="add"),
            helper.make_node("Sigmoid", ["r"], ["q"], name="late"),
        ],
        [helper.make_tensor_value_info("x", f, [1, 2, 3, 3])],
        [helper.make_tensor_value_info("z", f, [1, 2, 3, 3]), helper.make_tensor_value_info("q", f, [1, 2, 3, 3])],
        [w],
    )
    p = plan(model)
    assert overwrite_violations(p) == []
    conv = p.second.layer("conv")
    conv.fused = dataclasses.replace(conv.fused, overwrite_extra_input=True)
    assert overwrite_violations(p) == ["'conv' may overwrite 'r', which ['late'] read later"]


def test_reduce_case_shrinks_to_the_failing_part():
    """A property that 'fails' on any horizontal merge reduces to two parallel convs."""
    for seed in range(200):
        model, feeds = random_cnn_case(seed, max_layers=16)
        if plan(model).counts()["horizontal"] and len(model.graph.node) > 15:
            break
    else:  # pragma: no cover - the generator guarantees some within 200 seeds
        pytest.fail("no graph with a horizontal merge")

    def still_fails(m, f) -> bool:
        return plan(m).counts()["horizontal"] > 0 and check_case(m, f, stages=("plan", "realize")).ok

    reduced, rfeeds, calls = reduce_case(model, feeds, still_fails, budget_s=60)
    assert calls > 1 and still_fails(reduced, rfeeds)
    convs = [n for n in reduced.graph.node if n.op_type == "Conv"]
    assert len(convs) == 2 and len(reduced.graph.node) < len(model.graph.node) // 2
    assert set(rfeeds) == {vi.name for vi in reduced.graph.input}


def test_tvm_unsupported_op_list_matches_the_installed_tvm():
    """planner.TVM_UNSUPPORTED_ONNX_OPS lets `inspect` warn without importing TVM; it must
    be exactly what this TVM's ONNX importer lacks."""
    from tvm.relax.frontend.onnx import onnx_frontend

    converters = set(onnx_frontend._get_convert_map())
    onnx_ops = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain == ""}
    assert TVM_UNSUPPORTED_ONNX_OPS == onnx_ops - converters


# ---------------------------------------------------------------------- bugs the fuzzing found
def _model(nodes, inputs, outputs, inits=(), *, opset=13) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "repro", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 5 if opset <= 10 else 8
    onnx.checker.check_model(m, full_check=True)
    return m


def test_bug1_realize_folds_batchnorm_into_a_conv_of_unknown_output_shape():
    """fuzz seed 131 (realize-crash): ``onnx_realize.fold_affine`` took the rank from the
    conv output's shape, which shape inference leaves unknown after a Concat-4 with a
    negative axis (opset 10): ``TypeError: object of type 'NoneType' has no len()``.
    Fix: the conv output's rank is the weight's."""
    rng = np.random.default_rng(131)
    f = onnx.TensorProto.FLOAT
    init = lambda n, s, lo=None: numpy_helper.from_array(
        (rng.uniform(0.5, 1.5, s) if lo else rng.standard_normal(s)).astype(np.float32), n
    )
    model = _model(
        [
            helper.make_node("Concat", ["a", "x"], ["c"], name="cat", axis=-3),
            helper.make_node("Conv", ["c", "w", "b"], ["y"], name="conv", kernel_shape=[1, 5], pads=[0, 2, 0, 2]),
            helper.make_node("BatchNormalization", ["y", "g", "beta", "mean", "var"], ["n"], name="bn"),
            helper.make_node("Sum", ["n", "c"], ["z"], name="sum"),
        ],
        [helper.make_tensor_value_info("x", f, [2, 5, 16, 16]), helper.make_tensor_value_info("a", f, [2, 1, 16, 16])],
        [helper.make_tensor_value_info("z", f, [2, 6, 16, 16])],
        [init("w", (6, 6, 1, 5)), init("b", (6,)), init("g", (6,), 1), init("beta", (6,)), init("mean", (6,)),
         init("var", (6,), 1)],
        opset=10,
    )  # fmt: skip
    p = plan(model)
    assert p.first.tensor("y").shape is None  # the condition of the bug
    assert p.groups_of("vertical")  # the BatchNormalization still folds
    feeds = {"x": rng.standard_normal((2, 5, 16, 16)).astype(np.float32), "a": rng.standard_normal((2, 1, 16, 16)).astype(np.float32)}
    assert_agrees(check_case(model, feeds))


def test_bug2_clip6_as_graph_output_imports():
    """fuzz seed 169 (unfused-crash and fused-crash): a Clip-6 (opset 10, bounds as
    attributes) whose result is a graph output. TVM binds the output as an alias
    ``gv = lv1`` of the clip's ``call_tir``; ``rewrite_call`` offers that *variable* to the
    callback of ``importer.te_min_max_to_ops``, which read ``orig.args``:
    ``AttributeError: 'DataflowVar' object has no attribute 'args'`` for every model ending
    in such a Clip. Fix: callbacks (importer and fuse_epilogue) leave non-calls alone."""
    f = onnx.TensorProto.FLOAT
    rng = np.random.default_rng(169)
    for attrs in ({"min": 0.0}, {"min": 0.0, "max": 6.0}, {"max": 1.0}):
        model = _model(
            [helper.make_node("Clip", ["x"], ["y"], name="clip", **attrs)],
            [helper.make_tensor_value_info("x", f, [2, 1, 4, 4])],
            [helper.make_tensor_value_info("y", f, [2, 1, 4, 4])],
            opset=10,
        )
        feeds = {"x": (3 * rng.standard_normal((2, 1, 4, 4))).astype(np.float32)}
        assert_agrees(check_case(model, feeds, stages=("unfused", "fused")))


def test_bug3_integer_initializer_used_as_a_shape_imports():
    """Found probing huge shapes (bad-input sweep): ``Expand(x, s)`` with the shape ``s`` an
    int64 initializer. The import keeps every initializer as a parameter of ``main``
    (``keep_params_in_input``); TVM's Expand converter does not look parameters up and
    builds a data-dependent shape, giving a module that is not well formed (fused:
    "the fused module is not well formed", unfused: "LiftTransformParams gave 5 weight
    values for 2 parameters"). Fix: integer initializers (shapes, axes - never weights)
    are imported as ``Constant`` nodes."""
    rng = np.random.default_rng(3)
    f = onnx.TensorProto.FLOAT
    model = _model(
        [
            helper.make_node("Expand", ["x", "s"], ["y"], name="expand"),
            helper.make_node("Conv", ["y", "w"], ["z"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["z"], ["r"], name="relu"),
        ],
        [helper.make_tensor_value_info("x", f, [1, 3, 1, 4])],
        [helper.make_tensor_value_info("r", f, [2, 4, 4, 4])],
        [
            numpy_helper.from_array(np.array([2, 3, 4, 4], np.int64), "s"),
            numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
        ],
    )
    res = check_case(model, {"x": rng.standard_normal((1, 3, 1, 4)).astype(np.float32)})
    assert_agrees(res)
    assert res.plan_counts["vertical"] == 1  # conv + relu still fuse


def test_fuzz_script_checks_the_stages_it_is_asked_for():
    """``scripts/fuzz.py --stages``: the tactic stage (oneDNN, Winograd on every layer it has)
    is checked when asked for; an unknown stage is refused in one line."""
    import subprocess
    import sys
    from pathlib import Path

    from tvm_layerfuse.compile.tactics import onednn

    script = Path(__file__).resolve().parents[1] / "scripts" / "fuzz.py"
    bad = subprocess.run([sys.executable, str(script), "--stages", "unfused,bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--stages unfused,bogus: unknown ['bogus']" in bad.stderr
    if onednn.availability() is not None:
        pytest.skip(f"oneDNN is not installed here: {onednn.availability()}")
    run = subprocess.run(
        [sys.executable, str(script), "--graphs", "2", "--jobs", "1", "--stages", "unfused,tactics"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "graphs with disagreements: 0" in run.stdout and "tactics " in run.stdout, run.stdout


# ---------------------------------------------------------------------- exporter forms
@settings(max_examples=12, **PROPERTY)
@given(cnn_graphs(max_layers=5, blocks=("conv", "exporter", "residual")))
def test_agreement_on_exporter_graphs(case: CNNCase):
    """Shape arithmetic, Cast chains, sequence transposes, Softmax heads, Resize by computed
    sizes and unknown declared dims: what `compile` builds equals onnxruntime."""
    res = check_case(case.model, case.feeds, stages=("plan", "realize", "lowered"))
    assert_agrees(res)
    assert res.refused is None, res.refused


def test_resize_with_an_empty_scales_tensor_and_sizes_imports():
    """Resize-11 must name a ``scales`` input; exporters pass an empty tensor beside the
    ``sizes``, which TVM's importer took as given ("Only one of scales and sizes can be
    provided"; found by fuzz.py --blocks ...,exporter, seed 10)."""
    from onnx import TensorProto

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 8])
    nodes = [
        helper.make_node("Constant", [], ["empty"], value=numpy_helper.from_array(np.zeros([0], np.float32))),
        helper.make_node("Constant", [], ["sizes"], value=numpy_helper.from_array(np.array([1, 2, 6, 8], np.int64))),
        helper.make_node("Resize", ["x", "empty", "empty", "sizes"], ["y"], mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    ]  # fmt: skip
    model = helper.make_model(helper.make_graph(nodes, "resize11", [x], [y]), opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 7
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 2, 3, 4)).astype(np.float32)}
    assert_agrees(check_case(model, feeds, stages=("unfused",)))


def test_gate_of_an_activated_conv_by_a_map_of_its_shape_is_carried_out():
    """``Mul(act(conv(x)), y)`` with ``y`` of the conv's own shape: the plan merges it as a
    gate, and FuseConv2DEpilogue refused it ("the gate [1, 1, 4, 4] is not a [N, C, ...] map of
    the conv's [N, C, 1, 1]"): a plan/Relax mismatch (found by fuzz.py with the exporter
    blocks, seeds 16, 48, 119, once mismatches became findings)."""
    from onnx import TensorProto

    from tvm_layerfuse.relax.pipeline import fuse_with_report

    rng = np.random.default_rng(7)
    w = numpy_helper.from_array(rng.standard_normal((2, 2, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(2).astype(np.float32), "b")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("LeakyRelu", ["c"], ["a"], name="act", alpha=0.1),
        helper.make_node("Sigmoid", ["x"], ["s"], name="sig"),
        helper.make_node("Mul", ["a", "s"], ["y"], name="mul"),
    ]
    graph = helper.make_graph(
        nodes, "gate_same_shape", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])], [w, b],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    result = fuse_with_report(model)
    assert result.report.plan_check["eltwise_merged"] == {"plan": 1, "relax": 1}
    assert [g.details["op"] for g in result.plan.groups_of("eltwise")] == ["gate"]
    feeds = {"x": rng.standard_normal((1, 2, 4, 4)).astype(np.float32)}
    assert_agrees(check_case(model, feeds, stages=("fused",)))
