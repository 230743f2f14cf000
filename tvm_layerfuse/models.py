"""Models that ship with the installed packages (no download needed).

The ``onnx`` package carries nine ONNX model-zoo networks (with constant weights) in
``onnx/backend/test/data/light/``. GoogLeNet (``inception_v1``) is the default model of
the command line: it exercises every fusion template.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from .errors import ModelLoadError

LIGHT_MODELS = (
    "bvlc_alexnet",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "resnet50",
    "shufflenet",
    "squeezenet",
    "vgg19",
    "zfnet512",
)
DEFAULT_MODEL = "inception_v1"


def light_dir() -> Path:
    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def light_model(name: str = DEFAULT_MODEL) -> Path:
    """Path of one of the model-zoo networks shipped by the onnx package."""
    if name not in LIGHT_MODELS:
        raise ModelLoadError(f"built-in model {name!r} is unknown; expected one of {', '.join(LIGHT_MODELS)}")
    path = light_dir() / f"light_{name}.onnx"
    if not path.exists():
        raise ModelLoadError(
            f"built-in model {name!r} is missing from the onnx package at {path}; reinstall onnx (pip install onnx)"
        )
    return path


def default_model() -> Path:
    return light_model(DEFAULT_MODEL)
