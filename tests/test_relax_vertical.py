"""Vertical merges on Relax: FoldAffineIntoConv2D, the import plumbing, and the pipeline.

Structural tests write ``Before`` / ``Expected`` in TVMScript and compare with
``tvm.ir.assert_structural_equal``; a refusal leaves the module unchanged and reports why.
Numeric tests build small ONNX graphs, compile them fused (our passes + TVM's default
pipeline) and unfused (TVM's default pipeline alone) and compare both with onnxruntime
(optimisations off): max |a - b| / max |reference| <= RTOL = 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from graphs import Net, compile_and_compare
from tvm_layerfuse.relax import FoldAffineIntoConv2D, UnsupportedOpError, import_onnx


def _fold(mod: tvm.IRModule, **kw):
    p = FoldAffineIntoConv2D(**kw)
    return p(mod), p


# =========================================================================== structural


def test_batchnorm_folds_into_conv_weight_and_bias():
    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((1, 4, 8, 8), "float32"),
            w: R.Tensor((8, 4, 3, 3), "float32"),
            b: R.Tensor((8,), "float32"),
            gamma: R.Tensor((8,), "float32"),
            beta: R.Tensor((8,), "float32"),
            mean: R.Tensor((8,), "float32"),
            var: R.Tensor((8,), "float32"),
        ) -> R.Tensor((1, 8, 8, 8), "float32"):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                lv0 = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
                lv1 = R.reshape(b, R.shape([1, 8, 1, 1]))
                lv2 = R.add(lv0, lv1)
                lv3 = R.nn.batch_norm(lv2, gamma, beta, mean, var, axis=1, epsilon=1e-5, training=False)
                lv4 = lv3[0]
                gv = R.nn.relu(lv4)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(
            x: R.Tensor((1, 4, 8, 8), "float32"),
            w: R.Tensor((8, 4, 3, 3), "float32"),
            b: R.Tensor((8,), "float32"),
            gamma: R.Tensor((8,), "float32"),
            beta: R.Tensor((8,), "float32"),
            mean: R.Tensor((8,), "float32"),
            var: R.Tensor((8,), "float32"),
        ) -> R.Tensor((1, 8, 8, 8), "float32"):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                std = R.sqrt(R.add(var, R.const(1e-5, "float32")))  # [8]
                s = R.divide(gamma, std)  # [8]
                w_folded = R.multiply(w, R.reshape(s, R.shape([8, 1, 1, 1])))  # [8, 4, 3, 3]
                conv = R.nn.conv2d(x, w_folded, padding=[1, 1, 1, 1])
                b_folded = R.add(R.multiply(R.subtract(b, mean), s), beta)  # [8]
                lv = R.add(conv, R.reshape(b_folded, R.shape([1, 8, 1, 1])))
                gv = R.nn.relu(lv)
                R.output(gv)
            return gv

    after, p = _fold(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert "R.nn.batch_norm" in Before.script()  # the input module is left as it was
    assert [f["op"] for f in p.folded] == ["BatchNormalization"]
    assert p.folded[0]["conv_weight"] == ["w"]
    assert p.refused == []


def test_mul_then_sub_fold_without_a_conv_bias():
    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((2, 4, 8, 8), "float32"),
            w: R.Tensor((8, 4, 1, 1), "float32"),
            k: R.Tensor((8, 1, 1), "float32"),
            t: R.Tensor((1, 8, 1, 1), "float32"),
        ) -> R.Tensor((2, 8, 8, 8), "float32"):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                lv0 = R.nn.conv2d(x, w)
                lv1 = R.multiply(lv0, k)
                lv2 = R.subtract(lv1, t)
                gv = R.nn.relu(lv2)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(
            x: R.Tensor((2, 4, 8, 8), "float32"),
            w: R.Tensor((8, 4, 1, 1), "float32"),
            k: R.Tensor((8, 1, 1), "float32"),
            t: R.Tensor((1, 8, 1, 1), "float32"),
        ) -> R.Tensor((2, 8, 8, 8), "float32"):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                k_vec = R.reshape(k, R.shape([8]))
                w_folded = R.multiply(w, R.reshape(k_vec, R.shape([8, 1, 1, 1])))  # W * k[c]
                conv = R.nn.conv2d(x, w_folded)
                b_folded = R.negative(R.reshape(t, R.shape([8])))  # 0 - t[c]
                lv = R.add(conv, R.reshape(b_folded, R.shape([1, 8, 1, 1])))
                gv = R.nn.relu(lv)
                R.output(gv)
            return gv

    after, p = _fold(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert [f["op"] for f in p.folded] == ["Mul", "Sub"]


def _conv_then(op_builder, *, k_shape=(8,), data_layout="NCHW"):
    """A module: conv2d -> op_builder(conv, k) -> relu, with ``k`` a weight parameter."""
    x_shape = (1, 4, 8, 8) if data_layout == "NCHW" else (1, 8, 8, 4)
    w_shape = (8, 4, 3, 3)
    bb = tvm.relax.BlockBuilder()
    x = tvm.relax.Var("x", tvm.relax.TensorType(x_shape, "float32"))
    w = tvm.relax.Var("w", tvm.relax.TensorType(w_shape, "float32"))
    k = tvm.relax.Var("k", tvm.relax.TensorType(k_shape, "float32"))
    with bb.function("main", [x, w, k], attrs={"num_input": 1}):
        with bb.dataflow():
            conv = bb.emit(
                tvm.relax.op.nn.conv2d(x, w, padding=[1, 1, 1, 1], data_layout=data_layout, out_layout=data_layout)
            )
            y = bb.emit(op_builder(conv, k))
            out = bb.emit_output(tvm.relax.op.nn.relu(y))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(
    "k_shape, data_layout, builder, reason",
    [
        ((8,), "NCHW", tvm.relax.op.multiply, "varies along more than the channel axis"),  # [C] aligns with W
        ((1, 8, 8, 8), "NCHW", tvm.relax.op.subtract, "varies along more than the channel axis"),
        ((8, 1, 1), "NHWC", tvm.relax.op.multiply, "data_layout='NHWC'"),
    ],
)
def test_fold_refuses_what_is_not_per_channel(k_shape, data_layout, builder, reason):
    before = _conv_then(builder, k_shape=k_shape, data_layout=data_layout)
    after, p = _fold(before)
    tvm.ir.assert_structural_equal(after, before)
    assert p.folded == []
    assert len(p.refused) == 1 and reason in p.refused[0]["reason"], p.refused


def test_fold_refuses_when_the_conv_output_has_another_reader():
    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((1, 4, 8, 8), "float32"),
            w: R.Tensor((8, 4, 3, 3), "float32"),
            k: R.Tensor((8, 1, 1), "float32"),
        ) -> R.Tuple(R.Tensor((1, 8, 8, 8), "float32"), R.Tensor((1, 8, 8, 8), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                lv0 = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
                lv1 = R.multiply(lv0, k)
                lv2 = R.nn.relu(lv0)
                gv = (lv1, lv2)
                R.output(gv)
            return gv

    after, p = _fold(Before)
    tvm.ir.assert_structural_equal(after, Before)
    assert "lv0 has 2 readers" in p.refused[0]["reason"]


def test_fold_refuses_run_time_batchnorm_statistics_and_training_mode():
    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((1, 4, 8, 8), "float32"),
            mean: R.Tensor((8,), "float32"),  # a run-time input (before num_input)
            w: R.Tensor((8, 4, 3, 3), "float32"),
            gamma: R.Tensor((8,), "float32"),
            beta: R.Tensor((8,), "float32"),
            var: R.Tensor((8,), "float32"),
        ) -> R.Tuple(R.Tensor((1, 8, 8, 8), "float32"), R.Tensor((1, 8, 8, 8), "float32")):
            R.func_attr({"num_input": 2})
            with R.dataflow():
                a = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
                a1 = R.nn.batch_norm(a, gamma, beta, mean, var, axis=1, training=False)
                a2 = a1[0]
                c = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
                c1 = R.nn.batch_norm(c, gamma, beta, var, var, axis=1, training=True)
                c2 = c1[0]
                gv = (a2, c2)
                R.output(gv)
            return gv

    after, p = _fold(Before)
    tvm.ir.assert_structural_equal(after, Before)
    reasons = sorted(r["reason"] for r in p.refused)
    assert reasons == ["batch_norm is in training mode", "the batch_norm mean is computed at run time"]


def test_fold_only_into_the_convs_the_plan_names():
    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((1, 4, 8, 8), "float32"),
            w1: R.Tensor((8, 4, 3, 3), "float32"),
            w2: R.Tensor((8, 4, 3, 3), "float32"),
            k: R.Tensor((8, 1, 1), "float32"),
        ) -> R.Tuple(R.Tensor((1, 8, 8, 8), "float32"), R.Tensor((1, 8, 8, 8), "float32")):
            R.func_attr({"num_input": 1})
            with R.dataflow():
                a = R.nn.conv2d(x, w1, padding=[1, 1, 1, 1])
                a1 = R.multiply(a, k)
                c = R.nn.conv2d(x, w2, padding=[1, 1, 1, 1])
                c1 = R.multiply(c, k)
                gv = (a1, c1)
                R.output(gv)
            return gv

    after, p = _fold(Before, only_weights={"w2"})
    assert [f["conv_weight"] for f in p.folded] == [["w2"]]
    assert "does not fold into the conv with weight ['w1']" in p.refused[0]["reason"]
    text = after.script()
    assert "R.multiply(a, k)" in text and "R.multiply(c, k)" not in text


# =========================================================================== import


def test_import_names_weights_after_onnx_tensors_and_turns_sum_into_add():
    net = Net(seed=3)
    x = net.input("x", (1, 4, 8, 8))
    a = net.conv(x, 4, name="convA")
    s = net.node("Sum", [a, x])
    model = net.build([s])
    mod, params, graph = import_onnx(model)
    main = mod["main"]
    assert [p.name for p in main.params] == ["x", "convA_w", "convA_b"]
    assert int(main.attrs["num_input"]) == 1
    assert set(params) == {"convA_w", "convA_b"} and params["convA_w"].shape == (4, 4, 3, 3)
    assert graph.layer("convA").op_type == "Conv"
    text = mod.script()
    assert "R.stack" not in text and "R.sum" not in text  # Sum became Add


def test_import_turns_clip_kernels_back_into_relax_ops():
    net = Net(seed=4)
    x = net.input("x", (1, 4, 8, 8))
    c = net.node("Clip", [x, net.const(np.float32(0.0)), net.const(np.float32(6.0))])
    mod, _, _ = import_onnx(net.build([c]))
    text = mod.script()
    assert "R.maximum" in text and "R.minimum" in text and "call_tir" not in text


@pytest.mark.parametrize("bounds", [{"min": -1.0, "max": 1.0}, {"min": 0.0}])
def test_import_turns_attribute_clip_kernels_back_into_relax_ops(bounds):
    """Clip-6 holds its bounds as attributes; TVM imports it as kernels with the bound inside
    (an absent bound as +-inf). They become R.maximum / R.minimum of a scalar constant."""
    net = Net(opset=10, seed=4)
    x = net.input("x", (1, 4, 8, 8))
    c = net.node("Clip", [x], **bounds)
    mod, _, _ = import_onnx(net.build([c]))
    text = mod.script()
    assert "call_tir" not in text
    assert 'R.maximum(x, R.const(%s, "float32"))' % bounds["min"] in text
    assert "R.minimum" in text and ('R.const("inf"' in text) == ("max" not in bounds)


def test_two_convs_of_one_input_and_weight_stay_two_layers(monkeypatch):
    """Two identical convs (one input, one weight), one clipped, one into a BatchNorm: the
    plan folds the BatchNorm into the second, which needs the import to keep them apart (the
    Clip rewrite once merged them into one conv with two readers: "batchnorm_folded planned
    1, done 0"; fuzz.py seeds 686, 1669)."""
    from tvm_layerfuse.relax.pipeline import STRICT_PLAN_ENV

    monkeypatch.setenv(STRICT_PLAN_ENV, "1")
    net = Net(seed=6)
    x = net.input("x", (1, 4, 8, 8))
    w = net.const((net.rng.standard_normal((8, 4, 3, 3)) * 0.3).astype(np.float32), "shared_w")
    attrs = dict(shape=(1, 8, 8, 8), kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    a = net.node("Conv", [x, w], name="convA", **attrs)
    b = net.node("Conv", [x, w], name="convB", **attrs)
    clipped = net.node("Clip", [a, net.const(np.float32(-1.0)), net.const(np.float32(1.0))])
    result, _, _ = compile_and_compare(net.build([clipped, net.bn(b)]))
    assert [f["op"] for f in result.report["folded"]] == ["BatchNormalization"]
    assert result.report["plan_check"]["batchnorm_folded"] == {"plan": 1, "relax": 1}


def test_import_names_the_op_tvm_cannot_convert():
    net = Net(opset=13, seed=5)
    x = net.input("x", (1, 4, 8, 8))
    y = net.node("Celu", [x], alpha=1.0)
    with pytest.raises(UnsupportedOpError) as err:
        import_onnx(net.build([y]))
    message = str(err.value)
    assert "Celu" in message and "\n" not in message


# =========================================================================== numbers


@pytest.mark.parametrize("batch", [1, 2])
def test_conv_bias_batchnorm_relu_matches_onnxruntime(batch):
    net = Net(seed=10 + batch)
    x = net.input("x", (batch, 8, 16, 16))
    y = net.relu(net.bn(net.conv(x, 16)))
    result, kernels, _ = compile_and_compare(net.build([y]))
    assert [f["op"] for f in result.report["folded"]] == ["BatchNormalization"]
    assert [g["template"] for g in result.report["groups"]] == ["layerfuse_conv2d_bias_relu"]
    assert kernels.names == ("layerfuse_conv2d_bias_relu",)  # the whole chain: one kernel launch


@pytest.mark.parametrize("batch", [1, 2])
def test_caffe2_style_conv_bn_mul_add_relu_matches_onnxruntime(batch):
    """Conv (no bias) -> BatchNormalization -> Mul(k) -> Add(t) -> Relu, as Caffe2 exports."""
    net = Net(seed=20 + batch)
    x = net.input("x", (batch, 8, 16, 16))
    y = net.bn(net.conv(x, 8, bias=False))
    y = net.node("Mul", [y, net.channel_const(y)])
    y = net.node("Add", [y, net.channel_const(y, low=-0.5, high=0.5)])
    y = net.relu(y)
    result, kernels, _ = compile_and_compare(net.build([y]))
    assert [f["op"] for f in result.report["folded"]] == ["BatchNormalization", "Mul", "Add"]
    assert kernels.launches == 1 and kernels.names[0] == "layerfuse_conv2d_bias_relu"


def test_sub_div_and_a_depthwise_conv_with_relu6_match_onnxruntime():
    net = Net(seed=30)
    x = net.input("x", (1, 8, 12, 12))
    y = net.conv(x, 8, group=8)  # depthwise: W [8, 1, 3, 3]
    t = net.const(net.rng.uniform(-0.5, 0.5, (1, 8, 1, 1)).astype(np.float32))  # [1, C, 1, 1]
    y = net.node("Sub", [y, t])
    y = net.node("Div", [y, net.channel_const(y)])  # [C, 1, 1]
    y = net.node("Clip", [y, net.const(np.float32(0.0)), net.const(np.float32(6.0))])
    result, kernels, _ = compile_and_compare(net.build([y]))
    assert [f["op"] for f in result.report["folded"]] == ["Sub", "Div"]
    assert kernels.names == ("layerfuse_conv2d_bias_clip",)


def test_a_batchnorm_that_is_the_graph_output_folds_once(monkeypatch):
    """The output is an alias of the BatchNorm's result (``gv = lv2``): the fold rewrites the
    BatchNorm once, not once more through the alias ("batchnorm_folded planned 1, done 2";
    fuzz.py with the exporter blocks, seed 5)."""
    from tvm_layerfuse.relax.pipeline import STRICT_PLAN_ENV

    monkeypatch.setenv(STRICT_PLAN_ENV, "1")
    net = Net(seed=42)
    x = net.input("x", (1, 4, 8, 8))
    y = net.bn(net.conv(x, 4, bias=False))
    result, kernels, _ = compile_and_compare(net.build([y]))
    assert [f["op"] for f in result.report["folded"]] == ["BatchNormalization"]
    assert result.report["plan_check"]["batchnorm_folded"] == {"plan": 1, "relax": 1}
    assert kernels.names == ("layerfuse_conv2d_bias",)


def test_a_refused_fold_still_computes_the_same_numbers():
    """The conv output feeds both the BatchNormalization and a graph output: no fold."""
    net = Net(seed=40)
    x = net.input("x", (1, 4, 8, 8))
    c = net.conv(x, 8)
    y = net.relu(net.bn(c))
    result, _, _ = compile_and_compare(net.build([y, c]))
    assert result.report["folded"] == []


def test_batchnorm_after_a_conv_with_run_time_weights_is_not_folded():
    """W' = W * s would be computed per inference: the pass refuses, says why, and the
    numbers stay right (whatever the plan says)."""
    net = Net(seed=41)
    x = net.input("x", (1, 4, 8, 8))
    y = net.relu(net.bn(net.conv(x, 8, weight_input=True)))
    result, kernels, _ = compile_and_compare(net.build([y]))
    assert result.report["folded"] == []
    assert [r["reason"] for r in result.report["fold_refused"]] == [
        "the conv2d weight is a run-time input, not a parameter or constant"
    ]
