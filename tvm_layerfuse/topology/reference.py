"""The reference runs: onnxruntime on CPU with graph optimisations off (as onnx-simplifier's
model checking does), so the numbers are the model's own.

Used to check a rewritten model against the original (shape folding), to tell whether a
model TVM cannot import is one onnxruntime accepts, and by the tests. onnxruntime is
imported on use: :func:`available` says whether it is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import numpy as np
import onnx


def available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def session(model: Union[onnx.ModelProto, str, Path], *, threads: Optional[int] = None):
    """An ``onnxruntime.InferenceSession`` of ``model`` (a model or its file; CPU,
    optimisations off, quiet). ``threads``: that many intra-op threads, one inter-op, no
    spinning (runs that share the machine); default onnxruntime's own choice."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    data = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def run_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Every graph output of ``model`` on ``feeds``."""
    return session(model).run(None, feeds)
