"""Test-model sources for tvm_layerfuse (no PyTorch needed).

* :mod:`.zoo` - torchvision architectures (GoogLeNet, Inception v3, ResNet-50, DenseNet-121,
  SqueezeNet 1.1, MobileNetV2, an EfficientNet-like net) built as ``torch.onnx.export``
  writes them, small enough to compile quickly; plus the ONNX "light" model-zoo networks.
* :mod:`.graphgen` - random valid CNN graphs for differential fuzzing: hypothesis
  strategies (:func:`~.graphgen.cnn_graphs`) and a plain seeded :func:`~.graphgen.random_cnn`.
* :mod:`.checks` - the onnxruntime reference run, the output comparison every numeric test
  makes (:func:`~.checks.output_mismatches`), and the fusion plan's invariants.
* :mod:`.weights` - live test weights (:func:`~.weights.live_weights`: He-normal, BatchNorm
  calibrated layer by layer) and the check that a model can show an error at all
  (:func:`~.weights.assert_live`); :func:`~.weights.with_logits` exposes the logits before
  a final Softmax.
* :mod:`.mutation` - deliberate bugs (x1.01, a zeroed channel or row at three depths) that the
  comparison must report: the test of the tests.

``graphgen`` imports hypothesis only when its strategies are used.
"""

from ._builder import NetBuilder, model_inputs, random_inputs
from .checks import plan_violations, run_onnxruntime
from .graphgen import CNNCase, GraphOptions, cnn_graphs, random_cnn, random_cnn_case
from .zoo import (
    BUILDERS,
    densenet121,
    efficientnet_like,
    googlenet,
    inception_v3,
    light_models,
    light_reference,
    mobilenet_v2,
    resnet18,
    resnet50,
    squeezenet1_1,
)

__all__ = [
    "BUILDERS",
    "CNNCase",
    "GraphOptions",
    "NetBuilder",
    "cnn_graphs",
    "densenet121",
    "efficientnet_like",
    "googlenet",
    "inception_v3",
    "light_models",
    "light_reference",
    "mobilenet_v2",
    "model_inputs",
    "plan_violations",
    "random_cnn",
    "random_cnn_case",
    "random_inputs",
    "resnet18",
    "resnet50",
    "run_onnxruntime",
    "squeezenet1_1",
]
