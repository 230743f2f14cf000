"""VTA target, runtime side (numpy and TVM's runtime; never the compiler).

:mod:`.loader` (``VTARuntime``: a VTA artifact behind :func:`tvm_layerfuse.runtime.load`),
:mod:`.runtime` (``load_vta``, the device interface, the host library through
``tvm.runtime``), :mod:`.sim` (the simulator: hardware mode by default, functional mode for
comparison), :mod:`.isa` / :mod:`.encoding` (instruction encoding), :mod:`.config`,
:mod:`.layout`, :mod:`.host` (the host steps in numpy), :mod:`.numerics`, :mod:`.rpc_server`
(the board's server). The compile side is :mod:`tvm_layerfuse.compile.vta`. See docs/vta.md.
"""
