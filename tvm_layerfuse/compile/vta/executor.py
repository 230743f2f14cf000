"""From a compiled graph to a runnable :class:`~tvm_layerfuse.runtime.vta.runtime.VTAModule`.

:func:`to_module` writes what the runtime needs as data (manifest, DRAM image, encoded
instruction streams, host-step constants); :func:`execute` runs one inference through
exactly that module, so the in-memory path and a loaded artifact are one code path - but
for the host ops, which the in-memory module interprets in numpy (the reference) and an
artifact runs in its TVM-compiled ``host.so`` (:mod:`.host_library`).
"""

from __future__ import annotations

import logging
from typing import Mapping, Union

import numpy as np

from ...runtime.vta.runtime import FORMAT, RunResult, VTADevice, VTAModule
from .codegen import CompiledVTA
from .graph import ConcatOp
from .quantize import host_program

log = logging.getLogger(__name__)


def to_module(model: CompiledVTA, *, device: Union[str, VTADevice] = "sim") -> VTAModule:
    graph = model.graph
    ops, consts, streams = [], {}, {}
    for k, op in enumerate(graph.ops):
        if not op.on_vta:
            steps, c = host_program(graph, op)
            consts.update(c)
            ops.append({"kind": "host", "name": op.name, "reads": op.reads, "writes": op.writes, "steps": steps, "reason": op.reason})
            continue
        program = None
        if not (isinstance(op, ConcatOp) and op.in_place):
            program = f"p{k:04d}"
            streams[program] = model.streams[op.name]
        ops.append({"kind": "vta", "name": op.name, "reads": op.reads, "writes": op.writes, "program": program})
    storage = {
        name: {"channels": s.layout.channels, "blocks": s.layout.blocks,
               "segments": [[seg.logical, seg.count, seg.phys] for seg in s.layout.segments],
               "elem": int(s.elem), "height": s.height, "width": s.width, "root": s.root}
        for name, s in model.storage.items()
    }
    manifest = {
        "format": FORMAT,
        "model": graph.name,
        "fused": graph.fused,
        "config": model.cfg.to_dict(),
        "inputs": {n: list(graph.shapes[n]) for n in graph.inputs},
        "outputs": list(graph.outputs),
        "frac": {n: int(model.q.frac[n]) for n in model.q.frac if n in model.storage or n in graph.inputs or n in graph.outputs},
        "storage": storage,
        "ops": ops,
        "regions": {k: list(v) for k, v in model.regions.items()},
        "instructions": {op["name"]: len(model.programs[op["name"]].insns) for op in ops if op.get("program")},
    }
    return VTAModule(manifest, model.image, streams, consts, device=device)


def execute(model: CompiledVTA, feeds: Mapping[str, np.ndarray], *, trace: bool = False,
            device: Union[str, VTADevice] = "sim") -> RunResult:
    """One inference on the simulator (``device="sim"``: hardware mode; ``"sim-functional"``)."""
    return to_module(model, device=device).run(feeds, trace=trace)
