"""Models as other exporters write them (tvm_layerfuse.testing.exporters): shape arithmetic
folded before import, compiled from the command line with ``--input-shape``, run with the
runtime, equal to onnxruntime (fp32, rel. err <= 1e-4), fused and unfused alike.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from graphs import rel_err, run_ort
from tvm_layerfuse import cli
from tvm_layerfuse.errors import GraphError
from tvm_layerfuse.planner import plan
from tvm_layerfuse.testing import exporters
from tvm_layerfuse.topology import read_onnx
from tvm_layerfuse.topology.shape_folding import fold_static_shapes, has_shape_arithmetic

RTOL = 1e-4
IMAGE = 16


def _fixed(model: onnx.ModelProto, shape) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    dims = out.graph.input[0].type.tensor_type.shape.dim
    for d, v in zip(dims, shape):
        d.ClearField("dim_param")
        d.dim_value = v
    return out


@pytest.mark.parametrize("form", ["gather", "reduceprod"])
def test_flatten_head_shape_arithmetic_is_folded_and_checked(form):
    model = exporters.flatten_head(form=form, seed=3)
    assert has_shape_arithmetic(model)
    graph = read_onnx(model, input_shapes={"input": [2, 3, IMAGE, IMAGE]})
    folding = graph.meta["shape_folding"]
    assert folding["removed"]["Shape"] == 1 and folding["targets"] == ["/Reshape"]
    assert folding["checked"] and folding["max_abs_diff"] == 0.0
    assert not folding["remaining"]
    assert {layer.op_type for layer in graph} >= {"Conv", "Reshape", "Gemm"}
    assert not any(layer.op_type in ("Shape", "Gather", "ReduceProd") for layer in graph)
    # the Reshape's output shape is known now (it was [2, ?] without folding)
    reshape = next(layer for layer in graph if layer.op_type == "Reshape")
    assert graph.tensor(reshape.outputs[0]).shape == (2, 16 * 4 * 4)
    note = plan(graph).graph_notes()[0]
    assert note.startswith("shape arithmetic folded before import:") and "'/Reshape'" in note


def test_model_without_shape_arithmetic_is_not_touched():
    from tvm_layerfuse.testing import zoo

    model = zoo.squeezenet1_1(image=32, seed=1)
    same, report = fold_static_shapes(model, label="squeezenet")
    assert report is None and same is model
    assert "shape_folding" not in read_onnx(model).meta


def test_folding_that_changes_results_is_an_error(monkeypatch):
    """The check against the original is live: a folding that changed a number is refused."""
    from tvm_layerfuse.topology import shape_folding

    model = _fixed(exporters.flatten_head(seed=1), [1, 3, IMAGE, IMAGE])
    real = shape_folding._fold_shape_cone

    def broken(m):
        out = real(m)
        gemm_bias = next(t for t in out.graph.initializer if t.name.endswith("fc.bias"))
        values = onnx.numpy_helper.to_array(gemm_bias).copy()
        values[0] += 1.0
        gemm_bias.CopyFrom(onnx.numpy_helper.from_array(values, gemm_bias.name))
        return out

    monkeypatch.setattr(shape_folding, "_fold_shape_cone", broken)
    with pytest.raises(GraphError, match=r"changed output 'output' by 1 .*report the model"):
        fold_static_shapes(model, label="m")


def test_dynamic_dims_keep_the_clear_error():
    from tvm_layerfuse.errors import ShapeError

    with pytest.raises(ShapeError, match=r"dynamic shape \[\?,3,16,16\].*--input-shape input=1,3,16,16"):
        read_onnx(exporters.shufflenet_v2_block())


# ---------------------------------------------------------------------- from the command line
def _compile_and_run(tmp_path, name: str, model: onnx.ModelProto, shape, *, seed: int = 0):
    """compile (fused and --no-fuse) and run from the CLI; outputs of both, and onnxruntime's."""
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    flag = "input=" + ",".join(map(str, shape))
    outs = {}
    for kind, extra in (("fused", []), ("plain", ["--no-fuse"])):
        art = tmp_path / f"{name}.{kind}"
        assert cli.main(["-q", "compile", str(path), "--input-shape", flag, "-o", str(art), *extra]) == 0
        y = tmp_path / f"{kind}.npz"
        # the runtime only: TVM's runtime library, no compiler
        env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "tvm_layerfuse", "-q", "run", str(art), "--input", str(tmp_path / "x.npy"),
             "--output", str(y)],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        outs[kind] = dict(np.load(y))
    expected = dict(zip([o.name for o in model.graph.output], run_ort(model, {"input": x})))
    return expected, outs


def _assert_equal(expected, outs):
    for name, e in expected.items():
        for kind in ("fused", "plain"):
            got = outs[kind][name]
            assert got.shape == e.shape, (name, kind)
            assert rel_err(e, got) <= RTOL, f"{kind} {name}: {rel_err(e, got):.3g}"
        assert rel_err(outs["plain"][name], outs["fused"][name]) <= RTOL


@pytest.mark.parametrize(
    "name,batch",
    [("flatten_head_reduceprod", 2), pytest.param("shufflenet_v2_block", 1, marks=pytest.mark.slow)],
)
def test_shape_computing_models_compile_from_the_cli(tmp_path, name, batch):
    model = exporters.BUILDERS[name](seed=5)
    expected, outs = _compile_and_run(tmp_path, name, model, (batch, 3, IMAGE, IMAGE))
    # live weights: two different inputs give clearly different outputs
    other = run_ort(model, {"input": np.ones((batch, 3, IMAGE, IMAGE), np.float32)})[0]
    assert rel_err(expected["output"], other) > 0.05
    _assert_equal(expected, outs)


def _kernels(tmp_path, model, shape) -> dict:
    """``inspect --compile --json``'s kernel and byte counts, default vs layerfuse."""
    import json
    from contextlib import redirect_stdout
    from io import StringIO

    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    buf = StringIO()
    with redirect_stdout(buf):
        assert cli.main(["-q", "inspect", str(path), "--input-shape", "input=" + ",".join(map(str, shape)),
                         "--plan-only", "--compile", "--json"]) == 0  # fmt: skip
    return json.loads(buf.getvalue())


@pytest.mark.parametrize(
    "form",
    [pytest.param(f, marks=pytest.mark.slow) for f in ("op", "hardsigmoid_mul", "clip_div")],
)
def test_mobilenet_v3_small_every_conv_chain_is_one_kernel(tmp_path, form):
    """HardSwish (op or written out), HardSigmoid SE gates, depthwise convs: every
    conv + BN + HardSwish/ReLU (+ SE gate) is one kernel, never more kernels than TVM's default."""
    model = exporters.mobilenet_v3_small_like(hardswish_form=form, opset=13 if form == "hardsigmoid_mul" else 14, seed=2)
    shape = (1, 3, 32, 32)
    report = _kernels(tmp_path, model, shape)
    convs = sum(1 for layer in read_onnx(model, input_shapes={"input": list(shape)}) if layer.op_type == "Conv")
    default, ours = report["compiled"]["default"], report["compiled"]["layerfuse"]
    assert ours["conv_kernels"] == convs  # one kernel per conv chain
    # the other kernels: the SE means, the classifier's two Gemms (+ HardSwish), the final pooling
    assert ours["kernels"] <= default["kernels"] and ours["bytes_written"] <= default["bytes_written"]
    gates = [g for g in report["groups"] if g["kind"] == "eltwise" and g["details"]["op"] == "gate"]
    assert len(gates) == 9  # one per squeeze-and-excitation block
    expected, outs = _compile_and_run(tmp_path, "mnv3", model, shape, seed=1)
    _assert_equal(expected, outs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["yolo_like", "fpn_segmentation"])
def test_detection_and_segmentation_heads_compile_from_the_cli(tmp_path, name):
    model = exporters.BUILDERS[name](seed=4)
    image = 64 if name == "yolo_like" else 32
    expected, outs = _compile_and_run(tmp_path, name, model, (1, 3, image, image), seed=2)
    other = run_ort(model, {"input": np.zeros((1, 3, image, image), np.float32)})[0]
    assert rel_err(expected["output"], other) > 0.05
    _assert_equal(expected, outs)


def _constant_fill_classifier() -> onnx.ModelProto:
    """A tiny classifier whose weights are ConstantOfShape fills, like the built-in GoogLeNet."""
    from onnx import TensorProto, helper, numpy_helper

    def fill(name, shape, value):
        return helper.make_node(
            "ConstantOfShape", [f"{name}_shape"], [name], name=f"{name}_fill",
            value=numpy_helper.from_array(np.array([value], np.float32)),
        ), numpy_helper.from_array(np.array(shape, np.int64), f"{name}_shape")  # fmt: skip

    (w, ws), (g, gs) = fill("w", [8, 3, 3, 3], 0.01), fill("g", [10, 8], 0.01)
    nodes = [
        w, g,
        helper.make_node("Conv", ["input", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "g"], ["logits"], name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["output"], name="prob", axis=1),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "filled", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 10])], [ws, gs],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_constant_fill_weights_are_explained_where_the_output_is_printed(tmp_path, capsys):
    """The built-in GoogLeNet prints five classes at 0.0010: its weights are constant fills.
    inspect, compile and run say so; run --compare shows the fused and unfused builds agree."""
    path = tmp_path / "filled.onnx"
    onnx.save(_constant_fill_classifier(), str(path))
    assert plan(read_onnx(path)).graph_notes()[0].startswith("weights are constant fills: all 2 Conv/Gemm weights")
    for out, extra in (("fused", []), ("plain", ["--no-fuse"])):
        assert cli.main(["compile", str(path), "-o", str(tmp_path / out), *extra]) == 0
    assert "note: weights are constant fills" in capsys.readouterr().out
    assert cli.main(["run", str(tmp_path / "fused"), "--compare", str(tmp_path / "plain")]) == 0
    printed = capsys.readouterr().out
    assert "top-5: " in printed and "0.1000" in printed  # ten classes, all at the same probability
    assert "note: weights are constant fills" in printed and "(1/1000 = 0.0010) - this is expected" in printed
    line = next(l for l in printed.splitlines() if "agrees on these inputs" in l)
    assert float(line.rsplit("relative ", 1)[1]) <= RTOL
    # --benchmark with --compare: both artifacts timed in interleaved rounds, and their ratio
    assert cli.main(["run", str(tmp_path / "fused"), "--compare", str(tmp_path / "plain"), "--benchmark", "3"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("latency over"))
    assert line.startswith("latency over 3 interleaved rounds: median ") and f"{tmp_path / 'plain'}: median " in line, line
    medians = [float(part.split(" ms", 1)[0]) for part in line.split("median ")[1:]]
    assert len(medians) == 2 and float(line.rsplit("= ", 1)[1]) > 0, line  # the values are timings: not compared


def test_built_in_googlenet_is_flagged():
    from tvm_layerfuse.models import default_model

    notes = plan(read_onnx(default_model())).graph_notes()
    assert any(n.startswith("weights are constant fills: all 58 Conv/Gemm weights") for n in notes)


# ---------------------------------------------------------------------- Paddle2ONNX style
P2O_SHAPE = (1, 3, IMAGE, 2 * IMAGE)


def test_p2o_classifier_compiles_with_its_output_shape_from_the_program(tmp_path):
    """A Paddle2ONNX classifier whose Reshape target is int32 constants cast to int64: shape
    inference alone leaves the output's dims unknown (compile crashed writing the manifest);
    the target is folded now, and the manifest reads the output from the compiled program."""
    import json

    model = exporters.p2o_text_direction_classifier(image=IMAGE, seed=3)
    shape = {"input": list(P2O_SHAPE)}
    assert has_shape_arithmetic(model)  # a computed shape argument, though no Shape op
    graph = read_onnx(model, input_shapes=shape)
    assert graph.meta["shape_folding"]["targets"] == ["p2o.Reshape.0"]
    assert graph.tensor(graph.outputs[0]).shape == (1, 2)
    expected, outs = _compile_and_run(tmp_path, "p2o_cls", model, P2O_SHAPE, seed=1)
    _assert_equal(expected, outs)
    manifest = json.loads((tmp_path / "p2o_cls.fused" / "manifest.json").read_text())
    assert manifest["outputs"] == [{"name": "output", "shape": [1, 2], "dtype": "float32"}]


def test_manifest_outputs_come_from_the_compiled_program(tmp_path, monkeypatch):
    """Without the folding the graph's output shape is unknown; the manifest still has it."""
    import json

    from tvm_layerfuse.compile.build import compile_model
    from tvm_layerfuse.topology import onnx_reader

    monkeypatch.setattr(onnx_reader, "fold_static_shapes", lambda m, **_: (m, None))
    model = exporters.p2o_text_direction_classifier(image=IMAGE, seed=3)
    shape = {"input": list(P2O_SHAPE)}
    graph = read_onnx(model, input_shapes=shape)
    assert graph.tensor(graph.outputs[0]).shape == (None, None)  # what shape inference gives
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    compile_model(path, tmp_path / "art", input_shapes=shape, progress=False, tactics="tvm")
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["outputs"] == [{"name": "output", "shape": [1, 2], "dtype": "float32"}]
    assert manifest["inputs"] == [{"name": "input", "shape": list(P2O_SHAPE), "dtype": "float32"}]


def test_p2o_recognizer_shape_arithmetic_folds_completely(tmp_path):
    """CRNN/SVTR-style: a ``fill_constant`` cast on its own into a Reshape target, then a
    ``Shape`` of the reshaped sequence; every Shape folds (one stayed at run time, and TVM
    refused the Reshape it fed), names of the layers are kept, and the model compiles."""
    model = exporters.p2o_text_recognizer(image=IMAGE, seed=2)
    graph = read_onnx(model, input_shapes={"input": list(P2O_SHAPE)})
    folding = graph.meta["shape_folding"]
    assert folding["removed"]["Shape"] == 2 and not folding["remaining"]
    assert folding["targets"] == ["p2o.Reshape.0", "p2o.Reshape.1", "p2o.Squeeze.0"]
    assert folding["checked"] and folding["max_abs_diff"] == 0.0
    names = {layer.name for layer in graph}
    assert {"p2o.Conv.0", "p2o.BatchNormalization.0", "p2o.MatMul.0", "p2o.Softmax.0"} <= names
    assert not any(layer.op_type in ("Shape", "Cast", "Slice", "Concat") for layer in graph)
    assert graph.tensor(graph.outputs[0]).shape == (1, 2 * IMAGE // 4, 12)
    expected, outs = _compile_and_run(tmp_path, "p2o_rec", model, P2O_SHAPE, seed=1)
    _assert_equal(expected, outs)


def test_p2o_db_detector_plan_is_carried_out_as_planned():
    """PP-OCRv3's RSEFPN ``x + x * gate``: the gate merges into the SE's conv, and the
    residual add is refused there with its reason (a fused conv takes one extra input); it
    was planned as a second merge that the Relax passes could not carry out ("plan/Relax
    mismatch: eltwise_merged planned 28, done 12"). Plan and program agree now (the compiled
    detector equals onnxruntime: the slow test below)."""
    from tvm_layerfuse.relax.pipeline import fuse_with_report

    model = exporters.p2o_db_detector(image=32, seed=2)
    shape = (1, 3, 32, 32)
    result = fuse_with_report(model, input_shapes={"input": list(shape)})
    check = result.report.plan_check
    assert check["eltwise_merged"] == {"plan": 20, "relax": 20}, check
    assert check["batchnorm_folded"]["plan"] == check["batchnorm_folded"]["relax"] == 29
    refused = [r for r in result.plan.refusals if "already merges an element-wise op" in r.reason]
    assert len(refused) == 8 and all(r.template == "eltwise.conv_epilogue" for r in refused)  # one per RSE layer
    gates = [g for g in result.plan.groups_of("eltwise") if g.details["op"] == "gate"]
    assert len(gates) == 8 + 7  # the RSE layers' and the backbone's SE gates


@pytest.mark.slow
def test_p2o_db_detector_compiles_and_equals_onnxruntime(tmp_path):
    model = exporters.p2o_db_detector(image=32, seed=2)
    expected, outs = _compile_and_run(tmp_path, "p2o_db", model, (1, 3, 32, 32), seed=1)
    _assert_equal(expected, outs)


def test_plan_relax_mismatch_is_an_error_or_a_corrected_plan(monkeypatch):
    """The safety net: when the Relax passes group none of the planned element-wise merges,
    strict mode (the test suite) raises naming them; otherwise they become refusals with the
    reason, so the plan describes the compiled program."""
    import dataclasses

    from tvm_layerfuse.relax import pipeline
    from tvm_layerfuse.relax.pipeline import STRICT_PLAN_ENV, PlanMismatchError, fuse_with_report

    real = pipeline.FuseConv2DEpilogue

    def without_extra_inputs(*, plan_spec):  # the pass told that no conv merges an element-wise op
        return real(plan_spec={w: dataclasses.replace(s, residual=None) for w, s in plan_spec.items()})

    monkeypatch.setattr(pipeline, "FuseConv2DEpilogue", without_extra_inputs)
    monkeypatch.setenv(STRICT_PLAN_ENV, "1")
    model = exporters.p2o_text_direction_classifier(image=IMAGE, seed=3)
    shapes = {"input": list(P2O_SHAPE)}
    with pytest.raises(PlanMismatchError, match=r"eltwise_merged planned 9, done 0; not carried out: .* into conv 'p2o"):
        fuse_with_report(model, input_shapes=shapes)
    monkeypatch.setenv(STRICT_PLAN_ENV, "0")
    result = fuse_with_report(model, input_shapes=shapes)
    assert result.report.plan_check["eltwise_merged"] == {"plan": 9, "relax": 0, "plan_dropped": 9}
    assert not result.plan.groups_of("eltwise")
    dropped = [r for r in result.plan.refusals if r.template == "relax.FuseConv2DEpilogue"]
    assert len(dropped) == 9 and "the plan merges element-wise op None" in dropped[0].reason
