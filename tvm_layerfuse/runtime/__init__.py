"""The runtime side: everything that runs with the TVM runtime only.

::

    from tvm_layerfuse import runtime
    rt = runtime.load("out/squeezenet", device="cpu")
    outputs = rt.run({"data_0": x})          # {"softmaxout_1": array}

* :mod:`.artifact` - the artifact format (manifest, checksums, atomic write);
* :mod:`.loader` - :func:`load` / :class:`Runtime`: checks, then loads the library and weights;
* :mod:`.io` - input files (.npy/.npz/images) and output files (.npz), shared by ``run`` and ``deploy``;
* :mod:`.tactics` - the CPU-extension check and the tactic libraries an artifact carries (oneDNN).
* :mod:`.vta` - the VTA target's runtime half; :class:`.vta.loader.VTARuntime`, a VTA artifact (simulator or
  board) behind the same interface.

:func:`load` reads the manifest and picks the loader by the artifact's target: one call
for every target.

Importing this package never imports ``tvm.relax``, onnx or the compiler library: a
``bundle`` copies it as it is to a machine that has only the TVM runtime.
"""

import os
from pathlib import Path
from typing import Optional, Union

from . import artifact
from .loader import Inputs, Runtime, aligned, check_inputs, check_target, parse_device, read_weights, this_machine
from .loader import load as _load_library


def load(path: Union[str, os.PathLike], *, device: Optional[str] = None):
    """Load the artifact directory ``path``: a TVM library for ``device`` ``cpu`` (default),
    ``cuda`` or ``cuda:N``, or a VTA artifact for ``sim`` (default) or ``board``."""
    manifest = artifact.read_manifest(Path(path))
    if manifest["target"].get("device") == "vta":
        from .vta.loader import VTARuntime

        return VTARuntime(path, device=device or "sim", manifest=manifest)
    return _load_library(path, device=device or "cpu")


__all__ = [
    "Inputs",
    "Runtime",
    "aligned",
    "check_inputs",
    "check_target",
    "load",
    "parse_device",
    "read_weights",
    "this_machine",
]
