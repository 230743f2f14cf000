"""ONNX's own conformance cases through the whole pipeline (fuse + compile + runtime).

Operator cases for the layers the templates touch run in the normal suite; cases that
TVM cannot express are listed with the reason and must fail with a clear error instead.
The nine model-zoo networks run with seeded live weights against onnxruntime, logits
included (their shipped weights are constant fills and their stored reference outputs one
repeated value: a comparison with those cannot fail).
"""

import onnx
import onnx.backend.test
import pytest

from tvm_layerfuse.errors import LayerfuseError
from tvm_layerfuse.onnx_backend import LayerfuseBackend
from tvm_layerfuse.testing.checks import output_mismatches, run_onnxruntime
from tvm_layerfuse.testing.weights import assert_live, with_logits
from tvm_layerfuse.testing.zoo import light_models, live_light_model, random_inputs

OPS = r"conv|concat|add|relu|batchnorm|maxpool|averagepool|globalaveragepool|globalmaxpool|sum|clip|leakyrelu|sigmoid|mul"
# Refused on purpose, with a one-line error (see test_refused_cases_fail_clearly).
REFUSED = {
    "test_batchnorm_epsilon_training_mode_cpu": "training-mode BatchNormalization (batch statistics)",
    "test_batchnorm_example_training_mode_cpu": "training-mode BatchNormalization (batch statistics)",
    "test_maxpool_with_argmax_2d_precomputed_pads_cpu": "MaxPool's indices output: TVM's importer has none",
    "test_maxpool_with_argmax_2d_precomputed_strides_cpu": "MaxPool's indices output: TVM's importer has none",
}

backend_test = onnx.backend.test.BackendTest(LayerfuseBackend, __name__)
backend_test.include(rf"^test_({OPS})_.*_cpu$|^test_(relu|sigmoid|sum|mul|add|clip|leakyrelu)_cpu$")
for name in REFUSED:
    backend_test.exclude(name)
globals().update(backend_test.test_cases)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_cases_fail_clearly(case):
    from onnx.backend.test.loader import load_model_tests

    (model,) = [c.model for c in load_model_tests(kind="node") if c.name == case.removesuffix("_cpu")]
    with pytest.raises(LayerfuseError) as e:
        LayerfuseBackend.prepare(model)
    assert "\n" not in str(e.value) and model.graph.name in str(e.value)


FAST_LIGHT = ("squeezenet",)


@pytest.mark.parametrize(
    "name",
    [n if n in FAST_LIGHT else pytest.param(n, marks=pytest.mark.slow) for n in sorted(light_models())],
)
def test_light_model_matches_onnxruntime(name):
    model = with_logits(live_light_model(name))
    assert_live(model)
    feeds = random_inputs(model, seed=3)
    expected = run_onnxruntime(model, feeds)
    got = LayerfuseBackend.prepare(model).run(list(feeds.values()))
    names = [o.name for o in model.graph.output]
    assert not output_mismatches(expected, got, names=names), output_mismatches(expected, got, names=names)
