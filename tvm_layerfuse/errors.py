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


class DeployError(LayerfuseError):
    """A deployment over RPC failed: the tracker, the link or the board."""

    exit_code = 1


class DeployTimeoutError(DeployError):
    """A step of a deployment did not finish within its deadline."""


class BoardMismatchError(DeployError):
    """The artifact was compiled for another machine or device than the board offers."""

    exit_code = 2


# Lines of a message that belong to a traceback (TVM's C++ and Python frames) or to a tool's
# banner, never the informative line.
_NOISE = ("File ", "at ", "[bt]", "Traceback", "^", "[ONNXRuntimeError]")


def first_line(e: BaseException, *, last: bool = False, limit: int = 300) -> str:
    """The informative line of ``e``'s message, for a one-line error.

    The first line that is not part of a traceback, or with ``last=True`` the last one (TVM's
    errors carry their traceback and check expression first and the message last), without
    TVM's ``SomeError: `` and ``Check failed: (...) is false: `` prefixes, at most ``limit``
    characters; ``type(e).__name__`` when the message is empty.
    """
    import re

    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(_NOISE)] or lines
    if not lines:
        return type(e).__name__
    best = lines[-1] if last else lines[0]
    best = re.sub(r"^(tvm\.error\.)?\w*Error: ", "", best)
    best = re.sub(r"^(Check failed: )?\(.*?\) is false: ", "", best)
    return best[:limit]
