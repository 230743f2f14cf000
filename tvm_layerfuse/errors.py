"""Errors a user can cause, each carrying a one-line message.

Every message names the input, what was expected, what was found and what to do.
The CLI prints ``error: <message>`` and exits non-zero; it never shows a traceback
for these.
"""


class LayerfuseError(Exception):
    """Base class of all user-facing errors of tvm_layerfuse."""

    exit_code = 2


class ModelLoadError(LayerfuseError):
    """The model file is missing, unreadable, or not a valid ONNX model."""


class GraphError(LayerfuseError):
    """The graph is malformed: a cycle, a dangling input, duplicate tensor names."""


class ShapeError(LayerfuseError):
    """An input shape is dynamic, zero, or inconsistent and no override was given."""


class UsageError(LayerfuseError):
    """A command-line option or argument is malformed."""


class TemplateError(LayerfuseError):
    """A user-registered fusion template is malformed."""


class ArtifactError(LayerfuseError):
    """A compiled artifact is missing, damaged, tampered with, or for another target."""


class InputError(LayerfuseError):
    """Inference inputs do not match what the artifact expects."""


class DeviceError(LayerfuseError):
    """The requested device is not available here."""


class BuildError(LayerfuseError):
    """Compiling for the requested target failed (toolchain missing, codegen error)."""
