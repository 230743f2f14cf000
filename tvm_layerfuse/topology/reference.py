"""The reference runs: onnxruntime on CPU with graph optimisations off (as onnx-simplifier's
model checking does), so the numbers are the model's own.

Used to check a rewritten model against the original (shape folding), to tell whether a
model TVM cannot import is one onnxruntime accepts, and by the tests. onnxruntime is
imported on use: :func:`available` says whether it is installed.
"""

from __future__ import annotations

import numpy as np
import onnx


def available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def session(model: onnx.ModelProto):
    """An ``onnxruntime.InferenceSession`` of ``model`` (CPU, optimisations off, quiet)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Every graph output of ``model`` on ``feeds``."""
    return session(model).run(None, feeds)
