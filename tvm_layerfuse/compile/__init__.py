"""Compile side: target presets, ``tvm.compile`` into an artifact, CUDA device code, and
``inspect --compile``'s kernel/byte comparison.

* :mod:`.presets` - ``targets/*.json`` presets (cpu, aarch64, cuda) and toolchain checks;
* :mod:`.build` - :func:`compile_model`: ONNX -> fused Relax -> ``tvm.compile`` -> artifact;
* :mod:`.cuda` - the CUDA toolkit, nvcc fatbins and the device code of a library;
* :mod:`.report` - TVM's default pipeline vs layerfuse: kernels, convolutions, bytes;
* :mod:`.vta` - the VTA target's compile half (its runtime half: :mod:`tvm_layerfuse.runtime.vta`).
"""

from .build import compile_model

__all__ = ["compile_model"]
