"""VTA target, compile side (needs onnx, the planner): fused int8 layers as VTA instruction streams.

:mod:`.pipeline` (``build``, ``compile_vta``, ``report``), :mod:`.graph` (plan -> VTA ops),
:mod:`.quantize` (calibration, int8 reference), :mod:`.codegen` (tiling, programs, DRAM
image), :mod:`.executor` (a compiled graph as a runtime module), :mod:`.host_library` (the
host steps compiled by TVM). The runtime side is :mod:`tvm_layerfuse.runtime.vta`. See docs/vta.md.
"""
