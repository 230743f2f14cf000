"""The runtime side: everything that runs with the TVM runtime only.

::

    from tvm_layerfuse import runtime
    rt = runtime.load("out/squeezenet", device="cpu")
    outputs = rt.run({"data_0": x})          # {"softmaxout_1": array}

* :mod:`.artifact` - the artifact format (manifest, checksums, atomic write);
* :mod:`.loader` - :func:`load` / :class:`Runtime`: checks, then loads the library and weights;
* :mod:`.io` - input files (.npy/.npz/images) and output files (.npz), shared by ``run`` and ``deploy``;
* :mod:`.tactics` - the CPU-extension check and the tactic libraries an artifact carries (oneDNN).

Importing this package never imports ``tvm.relax``, onnx or the compiler library: a
``bundle`` copies it as it is to a machine that has only the TVM runtime.
"""

from .loader import Inputs, Runtime, check_inputs, check_target, load, parse_device, read_weights, this_machine

__all__ = [
    "Inputs",
    "Runtime",
    "check_inputs",
    "check_target",
    "load",
    "parse_device",
    "read_weights",
    "this_machine",
]
