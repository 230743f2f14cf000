"""Whole networks compiled for CPU: layerfuse and TVM's default pipeline both agree with
onnxruntime (graph optimisations off, fp32, max relative error 1e-4) and with each other.

The architectures users bring from PyTorch (torch.onnx.export's structure, small width and
input size) and the nine ONNX model-zoo networks with seeded live weights (their shipped
weights are constant fills), logits compared as well as the softmax. Every model must be
live (two inputs give clearly different outputs) or the comparison could not fail.
Whole-size model-zoo networks are marked slow.
"""

import onnx
import pytest

from graphs import compile_and_compare
from tvm_layerfuse.planner import plan
from tvm_layerfuse.testing import zoo
from tvm_layerfuse.testing.weights import assert_live, with_logits
from tvm_layerfuse.testing.zoo import live_light_model

ZOO = {
    "googlenet": lambda: zoo.googlenet(image=32, seed=1),
    "inception_v3": lambda: zoo.inception_v3(seed=2),
    "resnet50": lambda: zoo.resnet50(image=32, seed=3),
    "resnet50_bn_folded": lambda: zoo.resnet50(image=32, seed=3, bn="folded"),
    "densenet121": lambda: zoo.densenet121(image=32, seed=4),
    "squeezenet1_1": lambda: zoo.squeezenet1_1(image=32, seed=5),
    "mobilenet_v2": lambda: zoo.mobilenet_v2(image=32, seed=6),
    "mobilenet_v2_clip_attributes": lambda: zoo.mobilenet_v2(image=32, seed=6, clip="attributes"),
    "efficientnet_like": lambda: zoo.efficientnet_like(image=32, seed=7),
}
LIGHT_FAST = ("squeezenet",)
# inception_v3 needs a 75x75 input (~20 s); the other four are whole networks that the tactic,
# concat and prologue tests compile as well (googlenet, densenet121, resnet50, mobilenet_v2):
# the default run keeps one of each kind of block (squeezenet1_1, the BN-folded ResNet-50, the
# attribute-Clip MobileNetV2, the SE-gated EfficientNet-like)
SLOW_ZOO = ("inception_v3", "googlenet", "densenet121", "resnet50", "mobilenet_v2")


def check_model(model: onnx.ModelProto, *, seed: int = 0) -> dict:
    assert_live(model)
    result, fused, default = compile_and_compare(model, seed=seed)
    return {"fused": fused.launches, "default": default.launches, "report": result.report}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_ZOO else n for n in sorted(ZOO)]
)
def test_torch_style_architectures(name):
    model = ZOO[name]()
    kernels = check_model(model)
    p = plan(model)
    assert kernels["fused"] <= kernels["default"], kernels
    if p.groups_of("horizontal") or any("BatchNormalization" in g.details.get("folded", []) for g in p.groups):
        assert kernels["fused"] < kernels["default"], kernels
    if p.groups_of("eltwise"):
        check = kernels["report"]["plan_check"]
        assert check["eltwise_merged"]["plan"] == check["eltwise_merged"]["relax"]
        assert check["batchnorm_folded"]["plan"] == check["batchnorm_folded"]["relax"]


@pytest.mark.parametrize(
    "name",
    [n if n in LIGHT_FAST else pytest.param(n, marks=pytest.mark.slow) for n in (
        "bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
        "shufflenet", "squeezenet", "vgg19", "zfnet512",
    )],
)  # fmt: skip
def test_model_zoo_networks_with_live_weights(name):
    model = with_logits(live_light_model(name, seed=13))
    kernels = check_model(model, seed=2)
    assert kernels["fused"] <= kernels["default"]
