"""The torchvision-structured test models of ``tvm_layerfuse.testing.zoo``.

For every builder: the model passes ``onnx.checker`` (full check), runs in onnxruntime with
O(1) outputs, computes the same function with BatchNorm kept or folded, and the planner
finds exactly the merges the architecture implies. The expected counts below are derived
by hand from the architecture (the comment above each says how), never read off a plan.

Shared facts of the default templates used in the derivations:

* vertical.conv_chain merges each Conv with the BatchNorm / activation that follows it
  (one group per conv that has something to absorb);
* vertical.preactivation merges BN -> activation into the Conv they feed (DenseNet);
* horizontal.parallel_conv merges >= 2 convs that read one tensor with equal geometry and
  equal activation and whose outputs meet again (Inception blocks' 1x1 convs);
* eltwise.conv_epilogue moves a residual Add (and the activation after it) into the conv
  producing one operand (the later one in graph order when both qualify);
* concat.in_place lets each producer write into the Concat's block.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import onnx
import pytest

from tvm_layerfuse.planner import plan
from tvm_layerfuse.testing import random_inputs, zoo
from tvm_layerfuse.testing.checks import plan_violations
from tvm_layerfuse.testing.checks import run_onnxruntime as run_ort

ORT_RTOL = 1e-4
ORT_ATOL = 1e-4


# ---------------------------------------------------------------------- helpers
@functools.lru_cache(maxsize=None)
def build(name: str, **kw) -> onnx.ModelProto:
    """The builder's model (cached: several tests read the same one; keyword values hashable)."""
    return zoo.BUILDERS[name](**kw)


@functools.lru_cache(maxsize=None)
def plan_of(name: str, **kw):
    return plan(build(name, **kw))


def ops(model: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in model.graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def assert_plan_invariants(p) -> None:
    assert plan_violations(p) == []


def branches(group) -> int:
    """Convs merged by a horizontal group (its members also list their folded BN / activation)."""
    return len(group.details["split"])


NAMES = sorted(zoo.BUILDERS)


# ---------------------------------------------------------------------- validity and numbers
@pytest.mark.parametrize("bn", ["separate", "folded"])
@pytest.mark.parametrize("name", NAMES)
def test_builder_is_valid_and_runs(name, bn):
    model = build(name, bn=bn)
    onnx.checker.check_model(model, full_check=True)
    (out,) = run_ort(model, random_inputs(model, seed=1))
    assert out.shape == (1, 10)
    assert np.isfinite(out).all()
    # He-initialised convs and calibrated BatchNorm statistics keep values O(1).
    assert 1e-3 < float(np.abs(out).max()) < 1e2


@pytest.mark.parametrize("name", NAMES)
def test_folded_and_separate_batchnorm_compute_the_same_function(name):
    feeds = random_inputs(build(name), seed=2)
    (separate,) = run_ort(build(name, bn="separate"), feeds)
    (folded,) = run_ort(build(name, bn="folded"), feeds)
    np.testing.assert_allclose(folded, separate, rtol=ORT_RTOL, atol=ORT_ATOL)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_model_other_seed_other_weights(name):
    a, b, c = build(name, seed=3), zoo.BUILDERS[name](seed=3), build(name, seed=4)
    assert a.SerializeToString() == b.SerializeToString()
    feeds = random_inputs(a, seed=0)
    (ya,), (yc,) = run_ort(a, feeds), run_ort(c, feeds)
    assert not np.allclose(ya, yc)


@pytest.mark.parametrize(
    "name, kw",
    [
        ("googlenet", dict(batch=2, image=64, width=0.0625, opset=17, quirks=False)),
        ("inception_v3", dict(batch=2, image=80, bn="folded", opset=11)),
        ("resnet50", dict(batch=3, image=48, layers=(1, 1, 1, 1), width=0.0625, opset=15)),
        ("densenet121", dict(batch=2, image=64, concat="nested", opset=11, quirks=False)),
        ("squeezenet1_1", dict(batch=2, image=64, width=0.125, opset=10)),
        ("mobilenet_v2", dict(batch=2, image=48, clip="attributes")),
        ("mobilenet_v2", dict(batch=1, image=32, width=0.5, opset=21, bn="folded")),
        ("efficientnet_like", dict(batch=2, image=40, width=0.5, opset=17)),
    ],
)
def test_options(name, kw):
    model = build(name, **kw)
    onnx.checker.check_model(model, full_check=True)
    opset = next(o.version for o in model.opset_import if o.domain == "")
    assert opset == kw.get("opset", 10 if kw.get("clip") == "attributes" else 13)
    (x,) = [vi for vi in model.graph.input]
    assert [d.dim_value for d in x.type.tensor_type.shape.dim] == [kw["batch"], 3, kw["image"], kw["image"]]
    (out,) = run_ort(model, random_inputs(model, seed=0))
    assert out.shape == (kw["batch"], 10) and np.isfinite(out).all()
    assert_plan_invariants(plan(model))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: zoo.resnet50(bn="fused"), "bn='fused'"),
        (lambda: zoo.mobilenet_v2(clip="attributes", opset=13), "clip='attributes' needs opset <= 10"),
        (lambda: zoo.mobilenet_v2(clip="inputs", opset=10), "clip='inputs' needs opset >= 11"),
        (lambda: zoo.inception_v3(image=32), "image >= 75"),
        (lambda: zoo.googlenet(blocks=10), "blocks=10"),
        (lambda: zoo.densenet121(concat="flat"), "concat='flat'"),
        (lambda: zoo.resnet50(layers=(1, 1, 1)), "four positive block counts"),
        (lambda: zoo.squeezenet1_1(batch=0), "batch=0"),
    ],
)
def test_bad_options_are_refused_with_a_message(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


# ---------------------------------------------------------------------- torch.onnx.export look
@pytest.mark.parametrize("name", NAMES)
def test_torch_export_quirks(name):
    model = build(name)
    counts = ops(model)
    assert counts.get("Identity", 0) > 0  # some weights reach their reader through Identity
    assert counts["Flatten"] == 1
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    if name != "squeezenet1_1":  # SqueezeNet classifies with a 1x1 conv
        (gemm,) = gemms
        assert {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute}["transB"] == 1
    for node in model.graph.node:
        assert node.name.startswith("/") or node.op_type == "Identity", node.name
        if node.op_type == "Conv":
            assert {a.name for a in node.attribute} == {"dilations", "group", "kernel_shape", "pads", "strides"}
    plain = build(name, quirks=False)
    assert "Identity" not in ops(plain) and "Constant" not in ops(plain)
    # Folded BatchNorm becomes the conv's bias; only BNs that do not follow a conv remain:
    # DenseNet's (2, 3, 4, 3) config keeps 12 norm1 (pre-activation), 3 transition norms, norm5.
    folded = build(name, bn="folded")
    remaining = ops(folded).get("BatchNormalization", 0)
    assert remaining == (12 + 3 + 1 if name == "densenet121" else 0)
    assert all(len(n.input) == 3 for n in folded.graph.node if n.op_type == "Conv" and name != "densenet121")


def test_mobilenet_clip_forms():
    inputs_form = build("mobilenet_v2")
    clips = [n for n in inputs_form.graph.node if n.op_type == "Clip"]
    assert clips and all(len(n.input) == 3 and not n.attribute for n in clips)
    consts = {n.output[0] for n in inputs_form.graph.node if n.op_type == "Constant"}
    assert all(n.input[1] in consts and n.input[2] in consts for n in clips)  # torch's Constant nodes
    attr_form = build("mobilenet_v2", clip="attributes")
    clips = [n for n in attr_form.graph.node if n.op_type == "Clip"]
    assert clips and all(
        len(n.input) == 1 and {a.name: a.f for a in n.attribute} == {"min": 0.0, "max": 6.0} for n in clips
    )
    feeds = random_inputs(inputs_form, seed=5)
    np.testing.assert_allclose(run_ort(attr_form, feeds)[0], run_ort(inputs_form, feeds)[0], rtol=1e-5, atol=1e-5)


def test_densenet_torch_form_has_one_input_concats():
    model = build("densenet121")
    concats = [n for n in model.graph.node if n.op_type == "Concat"]
    # torch's cat(prev_features) of the first dense layer of each block has one input.
    assert sum(len(n.input) == 1 for n in concats) == 4


# ---------------------------------------------------------------------- expected merges
@pytest.mark.parametrize("bn", ["separate", "folded"])
@pytest.mark.parametrize("blocks", [9, 2])
def test_googlenet_plan(blocks, bn):
    p = plan_of("googlenet", blocks=blocks, bn=bn)
    assert_plan_invariants(p)
    c = p.counts()
    # 3 stem convs + 6 convs per Inception block, each Conv(+BN)+ReLU: one vertical group each.
    assert c["vertical"] == 3 + 6 * blocks
    # Per block, branch1 1x1, branch2 1x1-reduce and branch3 1x1-reduce read the block input
    # with equal geometry and ReLU, and meet at the block's Concat: one horizontal group of 3.
    # (branch4's 1x1 reads the max-pool; the 3x3s read different tensors.)
    assert c["horizontal"] == blocks
    assert all(branches(g) == 3 for g in p.groups_of("horizontal"))
    assert all(
        p.first.layer(m).attrs["kernel_shape"] == [1, 1]
        for g in p.groups_of("horizontal")
        for m in g.members
        if p.first.layer(m).op_type == "Conv"
    )
    # One Concat per block; all four producers are layer outputs read once: in place.
    assert c["concat_in_place"] == blocks
    assert c["eltwise"] == 0
    assert p.refusals == []
    assert p.second.op_counts().get("Relu", 0) == 0 and p.second.op_counts().get("BatchNormalization", 0) == 0


@pytest.mark.parametrize("bn", ["separate", "folded"])
def test_inception_v3_plan(bn):
    p = plan_of("inception_v3", bn=bn)
    assert_plan_invariants(p)
    c = p.counts()
    # Convs: stem 5, InceptionA 7 (x3), B 4, C 10 (x4), D 6, E 9 (x2) = 94, each BasicConv2d.
    assert c["vertical"] == 5 + 7 * 3 + 4 + 10 * 4 + 6 + 9 * 2 == 94
    # 1x1 convs on each block input: A 3, B none (3x3/2 vs 1x1), C 3, D 2, E 3.
    assert [branches(g) for g in p.groups_of("horizontal")] == [3, 3, 3, 3, 3, 3, 3, 2, 3, 3]
    # Concats: A, B, C, D one each; E three (outer + the 1x3|3x1 pairs) - all in place,
    # the inner Concats of E becoming views into the outer block.
    assert c["concat_in_place"] == 3 + 1 + 4 + 1 + 3 * 2 == 15
    # Refused horizontal candidates: 6a's 3x3/2 with its 1x1; each E's two 1x3|3x1 pairs.
    refusals = p.refusals_of("horizontal")
    assert len(refusals) == 1 + 2 * 2
    assert all(r.reason.startswith("kernel_shape differ") for r in refusals)
    assert len(p.refusals) == len(refusals)


@pytest.mark.parametrize("layers", [(2, 2, 2, 2), (1, 1, 1, 1)])
@pytest.mark.parametrize("bn", ["separate", "folded"])
def test_resnet50_plan(bn, layers):
    p = plan_of("resnet50", bn=bn, layers=layers)
    assert_plan_invariants(p)
    c = p.counts()
    blocks, stages = sum(layers), 4
    convs = 1 + 3 * blocks + stages  # stem, 3 per bottleneck, one downsample per stage
    if bn == "separate":
        # Every conv has a BN to fold: stem and conv1/conv2 also take their ReLU, conv3 and
        # downsample stop at the residual Add.
        assert c["vertical"] == convs
        assert p.refusals_of("vertical") == []
        for layer in p.first:
            if layer.op_type == "BatchNormalization":  # every BN folded into a conv's weights
                fused = next(l for l in p.second if layer.name in l.members)
                assert fused.op_type == "Conv"
                (entry,) = [e for e in fused.fused.epilogue if e.layer == layer.name]
                assert entry.folded is True
        assert "BatchNormalization" not in p.second.op_counts()
    else:
        # Folded: stem + conv1 + conv2 take a ReLU; conv3 and downsample have nothing to
        # absorb before the Add, which their check reports.
        assert c["vertical"] == 1 + 2 * blocks
        assert len(p.refusals_of("vertical")) == blocks + stages
    # Every residual Add, with the ReLU after it, is in a conv's epilogue.
    assert c["eltwise"] == blocks
    adds = [l.name for l in p.first if l.op_type == "Add"]
    assert len(adds) == blocks
    for g in p.groups_of("eltwise"):
        assert g.details["op"] == "Add" and g.details["activation"] == "Relu"
        (add,) = [m for m in g.members if m in adds]
        if re.search(r"/layer\d\.0/", add):
            # Projection block: both operands are conv outputs read once; the downsample
            # conv is exported after conv3, so it absorbs the Add and conv3's output is the
            # extra input.
            assert "/downsample/" in g.details["conv"] and "conv3" not in g.details["conv"]
        else:
            assert g.details["conv"].endswith("/conv3/Conv")
    assert {a for g in p.groups_of("eltwise") for a in g.members if a in adds} == set(adds)
    assert "Add" not in p.second.op_counts() and "Relu" not in p.second.op_counts()
    # conv1 and the downsample read the block input but differ (epilogue in stage 1,
    # stride in stages 2-4): one refused horizontal candidate per stage.
    assert c["horizontal"] == 0
    reasons = [r.reason for r in p.refusals_of("horizontal")]
    assert len(reasons) == stages
    assert reasons[0].startswith("epilogues differ") and all(r.startswith("strides differ") for r in reasons[1:])


@pytest.mark.parametrize("bn", ["separate", "folded"])
@pytest.mark.parametrize("concat", ["torch", "nested"])
def test_densenet121_plan(concat, bn):
    config = (2, 3, 4, 3)
    p = plan_of("densenet121", concat=concat, bn=bn)
    assert_plan_invariants(p)
    c = p.counts()
    dense_layers, transitions = sum(config), len(config) - 1
    # conv_chain: conv0+norm0+relu0 and each conv1+norm2+relu2; preactivation: each
    # norm1+relu1 -> conv1 and each transition's norm+relu -> conv.
    assert len(p.groups_of("vertical.conv_chain")) == 1 + dense_layers
    assert len(p.groups_of("vertical.preactivation")) == dense_layers + transitions
    assert c["vertical"] == 1 + 2 * dense_layers + transitions
    # Only norm5 -> relu (feeding the pooling head) stays unfused.
    assert p.second.op_counts()["BatchNormalization"] == 1
    if concat == "nested":
        # c_i = Concat(c_{i-1}, new_i): every Concat in place (nested ones as views).
        assert c["concat_in_place"] == dense_layers == len([l for l in p.first if l.op_type == "Concat"])
        assert p.refusals == []
    else:
        # torch: every Concat of a block reads x0 (the block input) again. x0 can live at one
        # offset only, so the first Concat (the one-input cat of dense layer 1) takes it and
        # the later n-1 dense-layer Concats and the block's final Concat are refused.
        assert c["concat_in_place"] == len(config)
        refusals = p.refusals_of("concat")
        assert len(refusals) == dense_layers
        assert all("already writes into concat" in r.reason for r in refusals)
    assert c["horizontal"] == 0 and c["eltwise"] == 0


def test_squeezenet1_1_plan():
    p = plan_of("squeezenet1_1")
    assert_plan_invariants(p)
    c = p.counts()
    # conv1, 3 per Fire (x8), the classifier conv: each Conv+ReLU.
    assert c["vertical"] == 1 + 3 * 8 + 1
    # A Fire's expand1x1 and expand3x3 share the squeeze output but not the kernel size.
    assert c["horizontal"] == 0
    refusals = p.refusals_of("horizontal")
    assert len(refusals) == 8 and all(r.reason.startswith("kernel_shape differ") for r in refusals)
    assert c["concat_in_place"] == 8
    assert len(p.refusals) == 8


@pytest.mark.parametrize("bn, clip", [("separate", "inputs"), ("folded", "inputs"), ("separate", "attributes")])
def test_mobilenet_v2_plan(bn, clip):
    p = plan_of("mobilenet_v2", bn=bn, clip=clip)
    assert_plan_invariants(p)
    c = p.counts()
    # Default small setting at width 0.25 (channels make_divisible(c * 0.25, 8)):
    #   stem 8 | (1,16,1,1): 8->8 s1 residual | (6,24,2,2): 8->8 s2, 8->8 residual
    #   | (6,32,2,2): 8->8 s2, 8->8 residual | (6,64,2,2): 8->16 s2, 16->16 residual
    #   | (6,96,1,1): 16->24 | last 1x1 -> 128
    blocks, expand_blocks, residual = 8, 7, 4
    convs = 1 + (expand_blocks * 3 + 2) + 1
    depthwise = [l for l in p.first if l.op_type == "Conv" and l.attrs["group"] > 1]
    assert len(depthwise) == blocks
    # ReLU6 is Clip(0, 6): stem, each expand, each depthwise, the last conv.
    clip_groups = [g for g in p.groups_of("vertical") if g.details["activation"] == "Clip"]
    assert len(clip_groups) == 1 + expand_blocks + blocks + 1
    for g in clip_groups:
        (act,) = [e for e in p.intermediate.layer(g.layer).fused.epilogue if e.role == "activation"]
        assert (act.params["min"], act.params["max"]) == (0.0, 6.0)
    if bn == "separate":
        assert c["vertical"] == convs  # the project convs fold their BN too
    else:
        assert c["vertical"] == convs - blocks  # folded project convs have nothing to absorb
    # Inverted residual Add(x, project(x)) goes into the project conv's epilogue.
    assert c["eltwise"] == residual
    for g in p.groups_of("eltwise"):
        assert g.details["activation"] is None
        project = p.first.layer(g.details["conv"])
        assert project.attrs["kernel_shape"] == [1, 1] and project.attrs["group"] == 1
    # No tensor is read by two convs of equal geometry: nothing horizontal, depthwise never.
    assert c["horizontal"] == 0
    merged = {m for g in p.groups_of("horizontal") for m in g.members}
    assert not merged & {l.name for l in depthwise}


@pytest.mark.parametrize("bn", ["separate", "folded"])
def test_efficientnet_like_plan(bn):
    p = plan_of("efficientnet_like", bn=bn)
    assert_plan_invariants(p)
    c = p.counts()
    # Default rows at width 0.25: (1,3,1,8->8,1) residual | (6,3,2,8->8,2): 2nd residual
    # | (6,5,2,8->16,2): 2nd residual | (6,3,2,16->24,2): 2nd residual.
    blocks, expand_blocks, residual = 7, 6, 4
    # SiLU = Sigmoid·Mul after: stem, each expand, each depthwise, each SE fc1, the head.
    silu = [g for g in p.groups_of("vertical") if g.details["activation"] == "SiLU"]
    assert len(silu) == 1 + expand_blocks + blocks + blocks + 1
    sigmoids = [l for l in p.first if l.op_type == "Sigmoid"]
    in_silu = {m for g in silu for m in g.members}
    # Every Sigmoid but the SE gates (fc2 -> Sigmoid -> Mul(scale, x)) is part of a SiLU.
    assert len([s for s in sigmoids if s.name not in in_silu]) == blocks
    # fc2 -> Sigmoid is a conv epilogue of its own; project convs (separate BN) also fold.
    gate_acts = [g for g in p.groups_of("vertical") if g.details["activation"] == "Sigmoid"]
    assert len(gate_acts) == blocks
    assert c["vertical"] == len(silu) + blocks + (blocks if bn == "separate" else 0)
    assert not [r for r in p.refusals_of("vertical") if "Sigmoid" in r.reason]
    # Residual Adds go into the project conv; each SE Mul(scale, x) is a gate: fc2's
    # epilogue multiplies x by its [N, C, 1, 1] output.
    gates = [g for g in p.groups_of("eltwise") if g.details["op"] == "gate"]
    assert len(gates) == blocks and all(g.details["conv"].endswith("fc2/Conv") for g in gates)
    assert c["eltwise"] == residual + blocks
    assert c["horizontal"] == 0 and c["concat_in_place"] == 0


# ---------------------------------------------------------------------- ONNX model-zoo light models
def test_light_models_are_listed():
    models = zoo.light_models()
    assert sorted(models) == sorted(zoo.LIGHT_NAMES)
    assert all(p.is_file() and p.suffix == ".onnx" for p in models.values())


@pytest.mark.parametrize("name", ["squeezenet", "inception_v1", "resnet50"])
def test_light_reference_reproduces(name):
    feeds, expected = zoo.light_reference(name)
    (x,) = feeds.values()
    assert x.shape == (1, 3, 224, 224) and x.dtype == np.float32
    (out,) = run_ort(onnx.load(str(zoo.light_models()[name])), feeds)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_light_reference_unknown_name():
    with pytest.raises(FileNotFoundError, match="light model 'mobilenet'"):
        zoo.light_reference("mobilenet")


# Same architecture, two encodings: the Caffe-converted ONNX model-zoo network and the
# torchvision-structured builder at full depth give the same merge counts. Counts derived
# from the architecture: GoogLeNet 57 convs / 9 Inception blocks; ResNet-50 53 convs,
# 16 residual Adds; DenseNet-121 (nested concats) 1 + 2*58 + 3 = 120 vertical groups and
# 58 Concats; SqueezeNet 26 convs, 8 Fire Concats, 8 refused expand pairs.
@pytest.mark.parametrize(
    "light, builder, kw, expected",
    [
        ("inception_v1", "googlenet", dict(blocks=9), dict(vertical=57, horizontal=9, concat_in_place=9, eltwise=0)),
        ("resnet50", "resnet50", dict(layers=(3, 4, 6, 3)), dict(vertical=53, horizontal=0, concat_in_place=0, eltwise=16)),
        (
            "densenet121",
            "densenet121",
            dict(block_config=(6, 12, 24, 16), concat="nested"),
            dict(vertical=120, horizontal=0, concat_in_place=58, eltwise=0),
        ),
        ("squeezenet", "squeezenet1_1", dict(), dict(vertical=26, horizontal=0, concat_in_place=8, eltwise=0)),
    ],
)
def test_builders_agree_with_model_zoo(light, builder, kw, expected):
    zoo_plan = plan(str(zoo.light_models()[light]))
    ours = plan_of(builder, **kw)
    for p in (zoo_plan, ours):
        assert_plan_invariants(p)
        assert {k: p.counts()[k] for k in expected} == expected
    assert len(zoo_plan.refusals) == len(ours.refusals)
