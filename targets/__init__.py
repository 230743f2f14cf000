"""Target presets as data: one JSON file per preset (installed as ``tvm_layerfuse.targets``).

Each file gives the TVM target dict, the host target, the cross compiler, the device kind
and the machine architecture of the hosts that run the artifact. See
``tvm_layerfuse/presets.py`` for how a preset and an ``--arch`` become a build target.
"""
