"""MergeParallelConv2D (tvm_layerfuse.relax.horizontal) and CancelSplitConcat.

Structural tests write ``Before`` / ``Expected`` in TVMScript and compare with
``tvm.ir.assert_structural_equal``; refusals check that the module is unchanged and the
reason reported. Numeric tests build ONNX graphs, compile them with TVM's default pipeline
with and without the pass, and compare with onnxruntime (optimisations off).
"""

from __future__ import annotations

import logging
import os
import warnings

import numpy as np
import onnx
import pytest
import tvm
import tvm.relax.frontend.onnx  # noqa: F401  (registers the importer)
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from graphs import RTOL, Net, feeds_for, rel_err, run_ort
from tvm_layerfuse.planner import FusionPlan, plan
from tvm_layerfuse.relax.cancel_split_concat import CancelSplitConcat
from tvm_layerfuse.relax.horizontal import MergeParallelConv2D, merge_groups_from_plan
from tvm_layerfuse.testing.weights import random_weights
from tvm_layerfuse.topology.materialize import materialize_constants

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})


def _conv_calls(mod: tvm.IRModule) -> int:
    """conv2d calls in the Relax functions of ``mod``."""
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.nn.conv2d":
            found.append(e)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return len(found)


# =========================================================================== structural


# --- two branches, both ONNX-style bias + relu, different channel counts -------------


@I.ir_module
class TwoBranches:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 3, 3), "float32"),
        b1: R.Tensor((4,), "float32"),
        w2: R.Tensor((6, 8, 3, 3), "float32"),
        b2: R.Tensor((6,), "float32"),
    ):
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1, padding=[1, 1, 1, 1])
            r1 = R.reshape(b1, R.shape([1, 4, 1, 1]))
            a1 = R.add(c1, r1)
            y1 = R.nn.relu(a1)
            c2 = R.nn.conv2d(x, w2, padding=[1, 1, 1, 1])
            r2 = R.reshape(b2, R.shape([1, 6, 1, 1]))
            a2 = R.add(c2, r2)
            y2 = R.nn.relu(a2)
            R.output(y1, y2)
        return (y1, y2)


@I.ir_module
class TwoBranchesMerged:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 3, 3), "float32"),
        b1: R.Tensor((4,), "float32"),
        w2: R.Tensor((6, 8, 3, 3), "float32"),
        b2: R.Tensor((6,), "float32"),
    ):
        with R.dataflow():
            w = R.concat((w1, w2), axis=0)  # [10, 8, 3, 3]
            c = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
            b = R.concat((b1, b2), axis=0)
            b4 = R.reshape(b, R.shape([1, 10, 1, 1]))
            a = R.add(c, b4)
            y = R.nn.relu(a)
            parts = R.split(y, [4], axis=1)
            y1 = parts[0]
            y2 = parts[1]
            R.output(y1, y2)
        return (y1, y2)


def test_two_branches_with_bias_and_relu():
    p = MergeParallelConv2D()
    after = p(TwoBranches)
    tvm.ir.assert_structural_equal(after, TwoBranchesMerged)
    assert relax.analysis.check_well_formed(after)
    (g,) = p.report.merged
    assert g.convs == ("c1", "c2") and g.weights == ("w1", "w2")
    assert g.channels == ((0, 4), (4, 10)) and g.bias and g.activation == "nn.relu"
    assert p.report.refused == []


@I.ir_module
class WithDeadBinding:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 1, 1), "float32"),
        w2: R.Tensor((6, 8, 1, 1), "float32"),
    ):
        with R.dataflow():
            unused = R.sigmoid(x)  # noqa: F841 - a dead binding of the IR under test
            c1 = R.nn.conv2d(x, w1)
            c2 = R.nn.conv2d(x, w2)
            R.output(c1, c2)
        return (c1, c2)


def test_bindings_the_merge_did_not_touch_stay():
    after = MergeParallelConv2D()(WithDeadBinding)
    assert _conv_calls(after) == 1 and "R.sigmoid(x)" in after.script()


# --- three branches: one without bias (zeros), no activation, channels 2/3/5 ---------


@I.ir_module
class ThreeBranches:
    @R.function
    def main(
        x: R.Tensor((2, 4, 5, 5), "float32"),
        w1: R.Tensor((2, 4, 1, 1), "float32"),
        b1: R.Tensor((2,), "float32"),
        w2: R.Tensor((3, 4, 1, 1), "float32"),
        w3: R.Tensor((5, 4, 1, 1), "float32"),
        b3: R.Tensor((5,), "float32"),
    ):
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1)
            r1 = R.reshape(b1, R.shape([1, 2, 1, 1]))
            a1 = R.add(c1, r1)
            c2 = R.nn.conv2d(x, w2)
            c3 = R.nn.conv2d(x, w3)
            r3 = R.reshape(b3, R.shape([1, 5, 1, 1]))
            a3 = R.add(r3, c3)  # bias on the left: add is commutative
            s1 = R.sum(a1, axis=[1])
            s2 = R.sum(c2, axis=[1])
            s3 = R.sum(a3, axis=[1])
            R.output(s1, s2, s3)
        return (s1, s2, s3)


@I.ir_module
class ThreeBranchesMerged:
    @R.function
    def main(
        x: R.Tensor((2, 4, 5, 5), "float32"),
        w1: R.Tensor((2, 4, 1, 1), "float32"),
        b1: R.Tensor((2,), "float32"),
        w2: R.Tensor((3, 4, 1, 1), "float32"),
        w3: R.Tensor((5, 4, 1, 1), "float32"),
        b3: R.Tensor((5,), "float32"),
    ):
        with R.dataflow():
            w = R.concat((w1, w2, w3), axis=0)  # [10, 4, 1, 1]
            c = R.nn.conv2d(x, w)
            z2 = R.zeros(R.shape([3]), dtype="float32")
            b = R.concat((b1, z2, b3), axis=0)
            b4 = R.reshape(b, R.shape([1, 10, 1, 1]))
            a = R.add(c, b4)
            parts = R.split(a, [2, 5], axis=1)
            a1 = parts[0]  # each branch's last variable keeps its place, re-bound to its slice
            c2 = parts[1]
            a3 = parts[2]
            s1 = R.sum(a1, axis=[1])
            s2 = R.sum(c2, axis=[1])
            s3 = R.sum(a3, axis=[1])
            R.output(s1, s2, s3)
        return (s1, s2, s3)


def test_three_branches_mixed_bias_no_activation():
    p = MergeParallelConv2D()
    after = p(ThreeBranches)
    tvm.ir.assert_structural_equal(after, ThreeBranchesMerged)
    (g,) = p.report.merged
    assert g.channels == ((0, 2), (2, 5), (5, 10)) and g.bias and g.activation is None


# --- the merged branches feed a concat in channel order: split and concat cancel -----


@I.ir_module
class IntoConcat:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 3, 3), "float32"),
        w2: R.Tensor((6, 8, 3, 3), "float32"),
        w3: R.Tensor((2, 8, 3, 3), "float32"),
    ):
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1, padding=[1, 1, 1, 1])
            y1 = R.nn.relu(c1)
            c2 = R.nn.conv2d(x, w2, padding=[1, 1, 1, 1])
            y2 = R.nn.relu(c2)
            c3 = R.nn.conv2d(x, w3, padding=[1, 1, 1, 1])
            y3 = R.nn.relu(c3)
            p = R.nn.max_pool2d(x, pool_size=[3, 3], padding=[1, 1, 1, 1])
            gv = R.concat((p, y1, y2, y3), axis=1)
            R.output(gv)
        return gv


@I.ir_module
class IntoConcatMerged:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 3, 3), "float32"),
        w2: R.Tensor((6, 8, 3, 3), "float32"),
        w3: R.Tensor((2, 8, 3, 3), "float32"),
    ):
        with R.dataflow():
            w = R.concat((w1, w2, w3), axis=0)
            c = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
            y = R.nn.relu(c)
            p = R.nn.max_pool2d(x, pool_size=[3, 3], padding=[1, 1, 1, 1])
            gv = R.concat((p, y), axis=1)
            R.output(gv)
        return gv


def test_split_concat_cancel():
    p = MergeParallelConv2D()
    after = p(IntoConcat)
    tvm.ir.assert_structural_equal(after, IntoConcatMerged)
    assert p.report.concats_cancelled == 1
    kept = MergeParallelConv2D(cancel_split_concat=False)(IntoConcat)
    assert "R.split" in kept.script() and "R.split" not in after.script()


@I.ir_module
class ConcatOfWholeSplit:
    @R.function
    def main(y: R.Tensor((1, 6, 4, 4), "float32")):
        with R.dataflow():
            parts = R.split(y, [2, 3], axis=1)
            p0 = parts[0]
            p1 = parts[1]
            p2 = parts[2]
            gv = R.concat((p0, p1, p2), axis=1)
            R.output(gv)
        return gv


@I.ir_module
class ConcatOfWholeSplitCancelled:
    @R.function
    def main(y: R.Tensor((1, 6, 4, 4), "float32")):
        with R.dataflow():
            gv: R.Tensor((1, 6, 4, 4), "float32") = y
            R.output(gv)
        return gv


@I.ir_module
class ConcatOutOfOrder:
    @R.function
    def main(y: R.Tensor((1, 6, 4, 4), "float32")):
        with R.dataflow():
            parts = R.split(y, [2, 3], axis=1)
            p0 = parts[0]
            p1 = parts[1]
            p2 = parts[2]
            gv = R.concat((p0, p2, p1), axis=1)
            R.output(gv)
        return gv


def test_cancel_split_concat_pass_on_its_own():
    p = CancelSplitConcat()
    tvm.ir.assert_structural_equal(p(ConcatOfWholeSplit), ConcatOfWholeSplitCancelled)
    assert p.cancelled == 1
    tvm.ir.assert_structural_equal(p(ConcatOutOfOrder), ConcatOutOfOrder)  # pieces out of order: kept
    assert p.cancelled == 0


# --- refusals: the module must stay unchanged --------------------------------------


@I.ir_module
class StridesDiffer:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 1, 1), "float32"),
        w2: R.Tensor((6, 8, 1, 1), "float32"),
    ):
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1)
            c2 = R.nn.conv2d(x, w2, strides=[2, 2])
            R.output(c1, c2)
        return (c1, c2)


@I.ir_module
class Grouped:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 4, 1, 1), "float32"),
        w2: R.Tensor((6, 4, 1, 1), "float32"),
    ):
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1, groups=2)
            c2 = R.nn.conv2d(x, w2, groups=2)
            R.output(c1, c2)
        return (c1, c2)


@I.ir_module
class ActivationsDiffer:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 1, 1), "float32"),
        w2: R.Tensor((6, 8, 1, 1), "float32"),
    ):
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1)
            y1 = R.nn.relu(c1)
            c2 = R.nn.conv2d(x, w2)
            y2 = R.sigmoid(c2)
            R.output(y1, y2)
        return (y1, y2)


@I.ir_module
class KernelsDiffer:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 1, 1), "float32"),
        w2: R.Tensor((6, 8, 3, 3), "float32"),
    ):
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1)
            c2 = R.nn.conv2d(x, w2, padding=[1, 1, 1, 1])
            R.output(c1, c2)
        return (c1, c2)


@I.ir_module
class RuntimeWeight:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 1, 1), "float32"),
        w2: R.Tensor((6, 8, 1, 1), "float32"),
    ):
        R.func_attr({"num_input": 2})  # w1 is a run-time input, not a weight
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1)
            c2 = R.nn.conv2d(x, w2)
            R.output(c1, c2)
        return (c1, c2)


@I.ir_module
class ClipBoundsDiffer:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 1, 1), "float32"),
        w2: R.Tensor((6, 8, 1, 1), "float32"),
    ):
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1)
            y1 = R.clip(c1, 0.0, 6.0)
            c2 = R.nn.conv2d(x, w2)
            y2 = R.clip(c2, 0.0, 4.0)
            R.output(y1, y2)
        return (y1, y2)


@I.ir_module
class SharedConvOutput:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 1, 1), "float32"),
        w2: R.Tensor((6, 8, 1, 1), "float32"),
    ):
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1)
            y1 = R.nn.relu(c1)
            s1 = R.sum(c1, axis=[1])  # a second reader: relu cannot be applied before the split
            c2 = R.nn.conv2d(x, w2)
            y2 = R.nn.relu(c2)
            R.output(y1, s1, y2)
        return (y1, s1, y2)


@pytest.mark.parametrize(
    "before, reason",
    [
        (StridesDiffer, "strides differ: c1 has [1, 1], c2 has [2, 2]"),
        (Grouped, "grouped convolution (groups=2)"),
        (ActivationsDiffer, "activations differ: c1 ends with nn.relu, c2 with sigmoid"),
        (KernelsDiffer, "kernels differ"),
        (ClipBoundsDiffer, "activations differ: c1 ends with clip, c2 with clip"),
        (SharedConvOutput, "activations differ: c1 ends with no activation, c2 with nn.relu (c1 has 2 readers)"),
        (RuntimeWeight, "weight is computed at run time"),
    ],
    ids=["strides", "groups", "activation", "kernel", "clip-bounds", "shared-output", "runtime-weight"],
)
def test_refusal_leaves_module_unchanged(before, reason):
    p = MergeParallelConv2D()
    after = p(before)
    tvm.ir.assert_structural_equal(after, before)
    assert p.report.merged == []
    assert any(reason in r for r in p.report.reasons()), p.report.reasons()


@I.ir_module
class ClipBranches:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 1, 1), "float32"),
        w2: R.Tensor((6, 8, 1, 1), "float32"),
    ):
        with R.dataflow():
            c1 = R.nn.conv2d(x, w1)
            y1 = R.clip(c1, 0.0, 6.0)
            c2 = R.nn.conv2d(x, w2)
            y2 = R.clip(c2, 0.0, 6.0)
            R.output(y1, y2)
        return (y1, y2)


@I.ir_module
class ClipBranchesMerged:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 1, 1), "float32"),
        w2: R.Tensor((6, 8, 1, 1), "float32"),
    ):
        with R.dataflow():
            w = R.concat((w1, w2), axis=0)
            c = R.nn.conv2d(x, w)
            y = R.clip(c, 0.0, 6.0)
            parts = R.split(y, [4], axis=1)
            y1 = parts[0]
            y2 = parts[1]
            R.output(y1, y2)
        return (y1, y2)


def test_shared_clip_is_applied_once():
    p = MergeParallelConv2D()
    tvm.ir.assert_structural_equal(p(ClipBranches), ClipBranchesMerged)
    assert p.report.merged[0].activation == "clip"


# --- groups= restricts the merge to the named weights -------------------------------


@I.ir_module
class ThreeCompatible:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        wa: R.Tensor((4, 8, 1, 1), "float32"),
        wb: R.Tensor((6, 8, 1, 1), "float32"),
        wc: R.Tensor((2, 8, 1, 1), "float32"),
    ):
        with R.dataflow():
            ca = R.nn.conv2d(x, wa)
            cb = R.nn.conv2d(x, wb)
            cc = R.nn.conv2d(x, wc)
            R.output(ca, cb, cc)
        return (ca, cb, cc)


@I.ir_module
class ThreeCompatibleCAMerged:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        wa: R.Tensor((4, 8, 1, 1), "float32"),
        wb: R.Tensor((6, 8, 1, 1), "float32"),
        wc: R.Tensor((2, 8, 1, 1), "float32"),
    ):
        with R.dataflow():
            w = R.concat((wc, wa), axis=0)  # the group's order: wc's channels first
            c = R.nn.conv2d(x, w)
            parts = R.split(c, [2], axis=1)
            ca = parts[1]
            cb = R.nn.conv2d(x, wb)
            cc = parts[0]
            R.output(ca, cb, cc)
        return (ca, cb, cc)


def test_groups_restrict_and_order_the_merge():
    p = MergeParallelConv2D(groups=[["wc", "wa"]])
    after = p(ThreeCompatible)
    tvm.ir.assert_structural_equal(after, ThreeCompatibleCAMerged)
    assert [g.weights for g in p.report.merged] == [("wc", "wa")]
    assert _conv_calls(MergeParallelConv2D()(ThreeCompatible)) == 1  # None: all three merge


def test_groups_that_cannot_merge_are_refused_with_a_warning(caplog):
    for groups, reason in [
        ([["w1", "w2"]], "strides differ"),
        ([["w1", "nope"]], "no conv2d reads a weight parameter named 'nope'"),
        ([["w1"]], "fewer than two weights"),
    ]:
        p = MergeParallelConv2D(groups=groups)
        with caplog.at_level(logging.WARNING, logger="tvm_layerfuse.relax.horizontal"):
            caplog.clear()
            after = p(StridesDiffer)
        tvm.ir.assert_structural_equal(after, StridesDiffer)
        assert any(reason in r for r in p.report.reasons()), p.report.reasons()
        assert any(reason in rec.getMessage() for rec in caplog.records)
    with pytest.raises(TypeError):
        MergeParallelConv2D(groups=["w1", "w2"])  # a flat list is a mistake, not one group


# --- weights computed from parameters (e.g. a folded BatchNorm) still merge ---------


@I.ir_module
class DerivedWeights:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 1, 1), "float32"),
        s1: R.Tensor((4, 1, 1, 1), "float32"),
        w2: R.Tensor((6, 8, 1, 1), "float32"),
    ):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            v1 = R.multiply(w1, s1)
            c1 = R.nn.conv2d(x, v1)
            c2 = R.nn.conv2d(x, w2)
            R.output(c1, c2)
        return (c1, c2)


@I.ir_module
class DerivedWeightsMerged:
    @R.function
    def main(
        x: R.Tensor((1, 8, 6, 6), "float32"),
        w1: R.Tensor((4, 8, 1, 1), "float32"),
        s1: R.Tensor((4, 1, 1, 1), "float32"),
        w2: R.Tensor((6, 8, 1, 1), "float32"),
    ):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            v1 = R.multiply(w1, s1)
            w = R.concat((v1, w2), axis=0)
            c = R.nn.conv2d(x, w)
            parts = R.split(c, [4], axis=1)
            c1 = parts[0]
            c2 = parts[1]
            R.output(c1, c2)
        return (c1, c2)


def test_weights_derived_from_parameters_merge_by_name():
    p = MergeParallelConv2D(groups=[["w1", "w2"]])
    tvm.ir.assert_structural_equal(p(DerivedWeights), DerivedWeightsMerged)
    assert p.report.merged[0].weights == ("s1+w1", "w2")


def test_is_a_module_pass_usable_in_a_pipeline():
    p = MergeParallelConv2D()
    assert isinstance(p, tvm.transform.ModulePass) and p.info.name == "MergeParallelConv2D"
    seq = tvm.transform.Sequential([p, relax.transform.DeadCodeElimination()])
    assert _conv_calls(seq(TwoBranches)) == 1


# =========================================================================== numeric


def _import(model: onnx.ModelProto) -> tuple[tvm.IRModule, dict[str, tvm.runtime.Tensor], FusionPlan]:
    """(module with weights as parameters, {weight name: value}, plan) of ``model``."""
    p = plan(model)
    materialized = materialize_constants(model, p.first)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the importer warns about renamed inputs
        mod = tvm.relax.frontend.onnx.from_onnx(materialized, keep_params_in_input=True)
    mod, detached = relax.frontend.detach_params(mod)
    func = mod["main"]
    weights = func.params[int(func.attrs["num_input"]) :]
    return mod, {v.name: t for v, t in zip(weights, detached["main"])}, p


def _bind(mod: tvm.IRModule, params: dict[str, tvm.runtime.Tensor]) -> tvm.IRModule:
    return relax.transform.FoldConstant()(relax.transform.BindParams("main", params)(mod))


def _run(mod: tvm.IRModule, feeds: dict[str, np.ndarray]) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    names = [p.name for p in mod["main"].params]
    out = vm["main"](*[tvm.runtime.tensor(feeds[n]) for n in names])
    return out.numpy()


def _conv_kernels(mod: tvm.IRModule) -> int:
    """Kernel launches of conv2d PrimFuncs in ``main`` after TVM's default legalize + fuse passes."""
    with TARGET:
        lowered = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
            ]
        )(mod)
    calls = []

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.call_tir":
            if "conv2d" in e.args[0].name_hint:
                calls.append(e)

    relax.analysis.post_order_visit(lowered["main"], visit)
    return len(calls)


def _inception_block(batch: int) -> onnx.ModelProto:
    """1x1 | 1x1 -> 3x3 | 1x1 (no bias) -> 5x5 | pool -> 1x1, concatenated: 16 -> 40 channels."""
    net = Net(seed=7)
    x = net.input("x", (batch, 16, 14, 14))
    b1 = net.relu(net.conv(x, 8, k=1, name="inc/1x1"))
    b2 = net.relu(net.conv(net.relu(net.conv(x, 12, k=1, name="inc/3x3_reduce")), 16, k=3, name="inc/3x3"))
    b3 = net.relu(net.conv(net.relu(net.conv(x, 4, k=1, bias=False, name="inc/5x5_reduce")), 8, k=5, name="inc/5x5"))
    b4 = net.relu(net.conv(net.maxpool(x), 8, k=1, name="inc/pool_proj"))
    return net.build([net.concat([b1, b2, b3, b4], name="inc/output")])


@pytest.mark.parametrize("batch", [1, 2])
def test_inception_block_matches_onnxruntime(batch):
    model = _inception_block(batch)
    mod, params, p = _import(model)
    groups = merge_groups_from_plan(p, mod)
    assert groups == [["inc/1x1_w", "inc/3x3_reduce_w", "inc/5x5_reduce_w"]]
    merge = MergeParallelConv2D(groups=groups)
    merged = merge(mod)
    assert [g.weights for g in merge.report.merged] == [tuple(groups[0])]
    assert merge.report.merged[0].channels == ((0, 8), (8, 20), (20, 24))
    tvm.ir.assert_structural_equal(merged, MergeParallelConv2D()(mod))  # the plan = everything compatible here

    feeds = feeds_for(model, seed=1)
    (expected,) = run_ort(model, feeds)
    plain, fused = _bind(mod, params), _bind(merged, params)
    assert (_conv_calls(plain), _conv_calls(fused)) == (6, 4)
    assert (_conv_kernels(plain), _conv_kernels(fused)) == (6, 4)
    for got in (_run(plain, feeds), _run(fused, feeds)):
        assert got.shape == expected.shape == (batch, 40, 14, 14)
        assert rel_err(expected, got) <= RTOL, rel_err(expected, got)


def test_parallel_convs_into_concat_cancel_numerically():
    net = Net(seed=3)
    x = net.input("x", (1, 16, 14, 14))
    branches = [(8, True), (4, False), (12, True)]  # (C_i, bias)
    ys = [net.relu(net.conv(x, c, k=3, bias=b, name=f"par/{i}")) for i, (c, b) in enumerate(branches)]
    model = net.build([net.concat(ys)])
    mod, params, p = _import(model)
    merge = MergeParallelConv2D(groups=merge_groups_from_plan(p, mod))
    fused = _bind(merge(mod), params)
    assert merge.report.concats_cancelled == 1
    text = fused["main"].script()
    assert _conv_calls(fused) == 1 and "R.split" not in text and "R.concat" not in text
    feeds = feeds_for(model, seed=2)
    (expected,) = run_ort(model, feeds)
    got = _run(fused, feeds)
    assert rel_err(expected, got) <= RTOL, rel_err(expected, got)


def test_two_levels_and_a_branch_that_is_a_graph_output():
    """A merged branch feeds a second merge; another branch is also a graph output."""
    net = Net(seed=9)
    x = net.input("x", (1, 8, 10, 10))
    a = net.relu(net.conv(x, 6, k=3, name="l1/a"))
    b = net.relu(net.conv(x, 5, k=3, name="l1/b"))
    c = net.relu(net.conv(a, 4, k=1, name="l2/c"))
    d = net.relu(net.conv(a, 3, k=1, bias=False, name="l2/d"))
    e = net.relu(net.conv(b, 4, k=1, name="l2/e"))
    model = net.build([net.concat([c, d, e]), b])
    mod, params, p = _import(model)
    groups = merge_groups_from_plan(p, mod)
    assert groups == [["l1/a_w", "l1/b_w"], ["l2/c_w", "l2/d_w"]]
    merge = MergeParallelConv2D(groups=groups)
    fused = _bind(merge(mod), params)
    assert len(merge.report.merged) == 2 and merge.report.concats_cancelled == 1
    assert _conv_calls(fused) == 3
    feeds = feeds_for(model, seed=4)
    expected = run_ort(model, feeds)
    vm = relax.VirtualMachine(tvm.compile(fused, target=TARGET), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(feeds["x"]))
    assert len(got) == len(expected) == 2
    for e_, g in zip(expected, got):
        assert rel_err(e_, g.numpy()) <= RTOL, rel_err(e_, g.numpy())


def test_symbolic_batch():
    """A model with a dynamic batch dimension: the merge only needs static channel counts."""
    net = Net(seed=5)
    x = net.input("x", (None, 16, 7, 7))
    ys = [net.relu(net.conv(x, c, k=1, name=f"dyn/{c}")) for c in (8, 12)]
    model = net.build([net.concat([ys[1], ys[0]])])  # concat in the other order: no cancellation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = tvm.relax.frontend.onnx.from_onnx(model, keep_params_in_input=True)
    mod, detached = relax.frontend.detach_params(mod)
    params = {v.name: t for v, t in zip(mod["main"].params[1:], detached["main"])}
    merge = MergeParallelConv2D()
    fused = _bind(merge(mod), params)
    assert len(merge.report.merged) == 1 and merge.report.concats_cancelled == 0
    assert _conv_calls(fused) == 1
    feeds = {"x": np.random.default_rng(3).standard_normal((3, 16, 7, 7)).astype(np.float32)}
    (expected,) = run_ort(model, feeds)
    got = _run(fused, feeds)
    assert got.shape == (3, 20, 7, 7)
    assert rel_err(expected, got) <= RTOL, rel_err(expected, got)


def test_inception_v1_merges_nine_groups_and_matches_onnxruntime():
    """The plan's 9 groups (1x1, 3x3_reduce, 5x5_reduce of each block); ~15 s on 2 cores."""
    path = os.path.join(os.path.dirname(onnx.__file__), "backend/test/data/light/light_inception_v1.onnx")
    original = onnx.load(path)
    p = plan(original)
    model = random_weights(original, seed=11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = tvm.relax.frontend.onnx.from_onnx(model, keep_params_in_input=True)
    mod, detached = relax.frontend.detach_params(mod)
    func = mod["main"]
    params = {v.name: t for v, t in zip(func.params[int(func.attrs["num_input"]) :], detached["main"])}

    merge = MergeParallelConv2D(groups=merge_groups_from_plan(p, mod))
    merged = merge(mod)
    assert len(merge.report.merged) == 9 and merge.report.refused == []
    assert all(len(g.convs) == 3 for g in merge.report.merged)  # 1x1, 3x3_reduce, 5x5_reduce of each block
    fused = _bind(merged, params)
    assert (_conv_calls(mod), _conv_calls(fused)) == (57, 39)
    assert _conv_kernels(fused) == 39

    feeds = feeds_for(model, seed=5)
    (expected,) = run_ort(model, feeds)
    got = _run(fused, feeds)
    assert got.shape == expected.shape == (1, 1000)
    assert rel_err(expected, got) <= RTOL, rel_err(expected, got)
