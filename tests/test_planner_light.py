"""Plans for the nine ONNX model-zoo networks the onnx package ships.

Counts are derived from the architectures: e.g. GoogLeNet has 9 Inception blocks, each
with three 1x1 convs reading the block input and one Concat; ResNet-50 has 53 conv+BN
pairs and 16 residual Sums; DenseNet-121 has 58 dense layers (each ending in a Concat)
and 3 transitions. Every fused model is run against the original in onnxruntime.
"""

import json

import pytest

from graphs import assert_realizes
from tvm_layerfuse.models import LIGHT_MODELS, light_model
from tvm_layerfuse.planner import plan
from tvm_layerfuse.topology.onnx_reader import load_model


def _templates(p):
    out = {}
    for g in p.groups:
        out[g.template] = out.get(g.template, 0) + 1
    return out


EXPECTED = {
    # model: (groups per template, layers in the second graph)
    "bvlc_alexnet": ({"vertical.conv_chain": 5}, 19),
    "zfnet512": ({"vertical.conv_chain": 5}, 17),
    "vgg19": ({"vertical.conv_chain": 16}, 30),
    "inception_v1": ({"vertical.conv_chain": 57, "horizontal.parallel_conv": 9, "concat.in_place": 9}, 68),
    "inception_v2": ({"vertical.conv_chain": 69, "horizontal.parallel_conv": 10, "concat.in_place": 10}, 77),
    "resnet50": ({"vertical.conv_chain": 53, "eltwise.conv_epilogue": 16}, 58),
    "squeezenet": ({"vertical.conv_chain": 26, "concat.in_place": 8}, 40),
    "densenet121": ({"vertical.conv_chain": 59, "vertical.preactivation": 61, "concat.in_place": 58}, 188),
    "shufflenet": ({"vertical.conv_chain": 49, "eltwise.conv_epilogue": 13, "concat.in_place": 3}, 111),
}


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_plan_counts_and_numbers(name):
    path = light_model(name)
    p = plan(path)
    templates, layers = EXPECTED[name]
    assert _templates(p) == templates
    assert len(p.second) == layers
    assert_realizes(load_model(path), p)


def test_inception_v1_every_block_merges_its_1x1_convs_and_every_concat_is_in_place():
    p = plan(light_model("inception_v1"))
    concats = [l.name for l in p.first if l.op_type == "Concat"]
    assert len(concats) == 9
    assert sorted(g.layer for g in p.groups_of("concat")) == sorted(concats)
    joins = sorted(g.details["join"] for g in p.groups_of("horizontal"))
    assert joins == sorted(concats)  # one merge per Inception block, meeting at its Concat
    for g in p.groups_of("horizontal"):
        assert len(g.details["split"]) == 3
        for s in g.details["split"]:
            assert p.first.layer(s["branch"]).attrs["kernel_shape"] == [1, 1]
    assert not p.refusals


def test_resnet50_folds_every_bn_and_moves_every_sum():
    p = plan(light_model("resnet50"))
    folded = sum(g.details["folded"].count("BatchNormalization") for g in p.groups_of("vertical"))
    assert folded == p.first.op_counts()["BatchNormalization"] == 53
    sums = [l.name for l in p.first if l.op_type == "Sum"]
    assert sorted(m for g in p.groups_of("eltwise") for m in g.members if m in sums) == sorted(sums)
    assert all(g.details["activation"] == "Relu" for g in p.groups_of("eltwise"))
    # projection shortcuts: stride 2 on branch1 vs stride 1 on branch2a (3 stages), and
    # res2's branch1 (no activation) vs branch2a (Relu)
    reasons = sorted(r.reason.split(":")[0] for r in p.refusals)
    assert reasons == ["epilogues differ"] + ["strides differ"] * 3


def test_densenet121_every_concat_in_place_and_nested():
    p = plan(light_model("densenet121"))
    assert len(p.groups_of("concat")) == p.first.op_counts()["Concat"] == 58
    nested = [l for l in p.second if l.op_type == "Concat" and l.fused.writes_into]
    assert len(nested) == 58 - 4  # the last Concat of each of the 4 dense blocks feeds no Concat


def test_vgg19_only_vertical():
    p = plan(light_model("vgg19"))
    assert {g.kind for g in p.groups} == {"vertical"}


def test_plan_is_deterministic():
    a = plan(light_model("inception_v1")).to_dict()
    b = plan(light_model("inception_v1")).to_dict()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_every_original_layer_accounted_once():
    p = plan(light_model("densenet121"))
    members = [m for l in p.second for m in l.members]
    assert sorted(members) == sorted(l.name for l in p.first)
