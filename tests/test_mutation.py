"""The test of the numeric tests: deliberate bugs must be reported.

A ×1.01 scale, a zeroed channel and a zeroed row, each inserted at an early, a middle and a
late activation (:mod:`tvm_layerfuse.testing.mutation`), must each make the comparison every
model test uses (:func:`~tvm_layerfuse.testing.checks.output_mismatches`, logits included)
report a failure, on the live-weight models those tests run. And the liveness check must
refuse the models on which such bugs went unseen: the shipped constant-weight networks.
"""

import numpy as np
import pytest

from tvm_layerfuse.testing import zoo
from tvm_layerfuse.testing.checks import RTOL
from tvm_layerfuse.testing.mutation import KINDS, SITES, mutation_errors
from tvm_layerfuse.testing.weights import liveness_problems
from tvm_layerfuse.topology.materialize import materialize_constants
from tvm_layerfuse.topology.onnx_reader import load_model, read_onnx

MODELS = {
    "light_squeezenet": lambda: zoo.live_light_model("squeezenet"),  # concat of two relu branches, softmax
    "resnet50": lambda: zoo.resnet50(image=32, seed=3),  # residual adds, BatchNorm (torch-style export)
    "googlenet": lambda: zoo.googlenet(image=32, seed=1),  # inception concats
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_inserted_bug_is_reported(name):
    model = MODELS[name]()
    feeds = zoo.random_inputs(model, seed=2)
    rows = mutation_errors(model, feeds)
    assert [(m.site, m.kind) for m, _, _ in rows] == [(s, k) for s in SITES for k in KINDS]
    missed = [f"{m.site} {m.detail}: error {err:.3g}" for m, err, problems in rows if not problems]
    assert not missed, f"bugs the comparison did not report in {name}: {missed}"
    # not by a hair: each error is at least 10x the tolerance
    assert min(err for _, err, _ in rows) > 10 * RTOL, [(m.detail, err) for m, err, _ in rows]


def test_liveness_check_refuses_the_shipped_constant_weights():
    path = zoo.light_models().get("squeezenet")
    if path is None:
        pytest.skip("this onnx installation ships no light_squeezenet")
    shipped = load_model(path)
    problems = liveness_problems(materialize_constants(shipped, read_onnx(shipped)))
    assert problems and all("dead" in p or "saturated" in p for p in problems), problems


def test_liveness_check_refuses_a_saturated_output():
    model = zoo.squeezenet1_1(seed=3)
    assert liveness_problems(model) == []
    # drive the classifier's pre-activation far negative: the Relu leaves all logits 0
    (bias,) = [t for t in model.graph.initializer if t.name == "classifier.1.bias"]
    from onnx import numpy_helper

    bias.CopyFrom(numpy_helper.from_array(np.full(tuple(bias.dims), -1e3, np.float32), bias.name))
    problems = liveness_problems(model)
    assert any("saturated" in p for p in problems) and any("dead" in p for p in problems), problems
