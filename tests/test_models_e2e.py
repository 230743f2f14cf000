"""Whole networks compiled for CPU: layerfuse and TVM's default pipeline both agree with
onnxruntime (graph optimisations off, fp32, max relative error 1e-4) and with each other.

The architectures users bring from PyTorch (torch.onnx.export's structure, small width and
input size) and the nine ONNX model-zoo networks with seeded random weights (their shipped
weights are constant fills). Whole-size model-zoo networks are marked slow.
"""

import numpy as np
import onnx
import pytest

from graphs import RTOL, feeds_for, rel_err, run_ort
from tvm_layerfuse.planner import plan
from tvm_layerfuse.relax.pipeline import build, count_kernels, fuse_with_report, run, unfused
from tvm_layerfuse.testing import zoo
from tvm_layerfuse.testing.weights import random_weights

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
SLOW_ZOO = ("inception_v3",)  # needs a 75x75 input: ~20 s


def check_model(model: onnx.ModelProto, *, seed: int = 0) -> dict:
    feeds = feeds_for(model, seed=seed)
    expected = run_ort(model, feeds)
    result = fuse_with_report(model)
    fused_ex = build(result.mod)
    plain_ex = build(unfused(model))
    got = run(fused_ex, list(feeds.values()))
    base = run(plain_ex, list(feeds.values()))
    for e, g, b in zip(expected, got, base):
        assert rel_err(e, g) <= RTOL, f"layerfuse vs onnxruntime: {rel_err(e, g):.3g}"
        assert rel_err(e, b) <= RTOL, f"TVM default vs onnxruntime: {rel_err(e, b):.3g}"
        assert rel_err(b, g) <= RTOL, f"layerfuse vs TVM default: {rel_err(b, g):.3g}"
    return {"fused": count_kernels(fused_ex), "default": count_kernels(plain_ex), "report": result.report}


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
def test_model_zoo_networks_with_random_weights(name):
    from tvm_layerfuse.models import light_model

    model = random_weights(onnx.load(str(light_model(name))), seed=13)
    kernels = check_model(model, seed=2)
    assert kernels["fused"] <= kernels["default"]
