"""FuseConv2DPrologue on TVMScript: BatchNorm + Relu before a conv2d becomes its prologue."""

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_layerfuse.relax import FuseConv2DPrologue


@I.ir_module
class Before:
    @R.function
    def main(
        x: R.Tensor((1, 4, 6, 6), "float32"),
        g: R.Tensor((4,), "float32"),
        b: R.Tensor((4,), "float32"),
        m: R.Tensor((4,), "float32"),
        v: R.Tensor((4,), "float32"),
        w: R.Tensor((8, 4, 3, 3), "float32"),
    ) -> R.Tensor((1, 8, 6, 6), "float32"):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            bn = R.nn.batch_norm(x, g, b, m, v, axis=1, epsilon=1e-5, training=False)
            z = bn[0]
            a = R.nn.relu(z)
            y = R.nn.conv2d(a, w, padding=[1, 1, 1, 1])
            R.output(y)
        return y


@I.ir_module
class Expected:
    @R.function(private=True)
    def layerfuse_bn_relu_conv2d(
        x: R.Tensor((1, 4, 6, 6), "float32"),
        s: R.Tensor((1, 4, 1, 1), "float32"),
        t: R.Tensor((1, 4, 1, 1), "float32"),
        w: R.Tensor((8, 4, 3, 3), "float32"),
    ) -> R.Tensor((1, 8, 6, 6), "float32"):
        R.func_attr({"Composite": "layerfuse_bn_relu_conv2d", "Primitive": True})
        with R.dataflow():
            lv = R.multiply(x, s)  # x * s + t, then relu: the normalisation, per element
            lv1 = R.add(lv, t)
            lv2 = R.nn.relu(lv1)
            gv = R.nn.conv2d(lv2, w, padding=[1, 1, 1, 1])
            R.output(gv)
        return gv

    @R.function
    def main(
        x: R.Tensor((1, 4, 6, 6), "float32"),
        g: R.Tensor((4,), "float32"),
        b: R.Tensor((4,), "float32"),
        m: R.Tensor((4,), "float32"),
        v: R.Tensor((4,), "float32"),
        w: R.Tensor((8, 4, 3, 3), "float32"),
    ) -> R.Tensor((1, 8, 6, 6), "float32"):
        R.func_attr({"num_input": 1})
        cls = Expected
        with R.dataflow():
            # s = g / sqrt(v + eps), t = b - m * s: weights only, folded once when bound
            lv = R.add(v, R.const(1e-5, "float32"))
            lv1 = R.sqrt(lv)
            s = R.divide(g, lv1)
            lv3 = R.multiply(m, s)
            t = R.subtract(b, lv3)
            s4 = R.reshape(s, R.shape([1, 4, 1, 1]))
            t4 = R.reshape(t, R.shape([1, 4, 1, 1]))
            y = cls.layerfuse_bn_relu_conv2d(x, s4, t4, w)
            R.output(y)
        return y


def test_bare_conv_gets_the_prologue():
    p = FuseConv2DPrologue()
    after = p(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert [g["function"] for g in p.groups] == ["layerfuse_bn_relu_conv2d"] and p.groups[0]["absorbs"] is None
    assert p.refused == []


def test_training_mode_and_plan_refusals():
    text = Before.script().replace("training=False", "training=True")
    training = tvm.script.from_source(text)
    p = FuseConv2DPrologue()
    tvm.ir.assert_structural_equal(p(training), training)
    assert [r["reason"] for r in p.refused] == ["the BatchNorm is in training mode"]
    p = FuseConv2DPrologue(plan_convs={"other_weight"})
    tvm.ir.assert_structural_equal(p(Before), Before)
    assert p.refused[0]["reason"] == "the fusion plan gives the conv with weight ['w'] no BatchNorm+Relu prologue"
