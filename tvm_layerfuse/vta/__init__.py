"""VTA target: fused int8 layers as VTA instruction streams, run on a bit-exact simulator.

Compile side (needs onnx, the planner): :mod:`.pipeline` (``build``, ``compile_vta``,
``report``), :mod:`.graph` (plan -> VTA ops), :mod:`.quantize` (calibration, int8 reference),
:mod:`.codegen` (tiling, programs, DRAM image), :mod:`.executor`, :mod:`.host_library` (the
host steps compiled by TVM).

Runtime side (numpy and TVM's runtime): :mod:`.runtime` (``load_vta``, devices, the host
library through ``tvm.runtime``), :mod:`.sim` (the
simulator), :mod:`.isa` / :mod:`.encoding` (instruction encoding), :mod:`.config`,
:mod:`.layout`, :mod:`.host`, :mod:`.numerics`. See docs/vta.md.
"""
