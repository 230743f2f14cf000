"""ONNX's own conformance cases through the whole pipeline (fuse + compile + runtime).

Operator cases for the layers the templates touch run in the normal suite; cases that
TVM cannot express are listed with the reason and must fail with a clear error instead.
The nine model-zoo networks run against their stored reference outputs (slow).
"""

import numpy as np
import onnx
import onnx.backend.test
import pytest

from tvm_layerfuse.errors import LayerfuseError
from tvm_layerfuse.onnx_backend import LayerfuseBackend
from tvm_layerfuse.testing.zoo import light_models, light_reference

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
def test_light_model_matches_reference(name):
    feeds, expected = light_reference(name)
    model = onnx.load(str(light_models()[name]))
    (got,) = LayerfuseBackend.prepare(model).run(list(feeds.values()))
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
