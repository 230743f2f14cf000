"""Run a compiled VTA model: host layers in numpy, VTA programs on the simulator (or a device).

The DRAM image made at compile time (packed weights, biases, micro-op kernels, zeroed
activation buffers) is copied into a fresh device memory per inference. Host-produced
tensors that a VTA program reads are quantized and packed into their buffers as soon as
they exist (a producer of a concat block writes its slice); VTA-produced tensors that the
host reads are unpacked and dequantized on demand. This module needs numpy only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np

from .codegen import Program, Storage
from .config import VTAConfig
from .graph import ConcatOp, VTAGraph
from .layout import pack_activation, unpack_activation
from .quantize import Quantization, dequantize, float_op, quantize
from .sim import DRAM, Counters, Simulator

log = logging.getLogger(__name__)


@dataclass
class CompiledVTA:
    """Everything an inference needs: graph, scales, storage, programs, DRAM image."""

    graph: VTAGraph
    q: Quantization
    storage: dict[str, Storage]
    cfg: VTAConfig
    image: np.ndarray  # uint8 DRAM image
    regions: dict[str, tuple[int, int]]
    programs: dict[str, Program]
    streams: dict[str, np.ndarray] = field(default_factory=dict)  # encoded instructions per program

    def instruction_counts(self) -> dict[str, int]:
        return {name: len(p.insns) for name, p in self.programs.items()}


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    counters: Counters
    per_program: dict[str, Counters]
    ints: dict[str, np.ndarray] = field(default_factory=dict)


def execute(model: CompiledVTA, feeds: Mapping[str, np.ndarray], *, trace: bool = False) -> RunResult:
    """One inference on the simulator."""
    cfg, graph, q = model.cfg, model.graph, model.q
    dram = DRAM()
    dram.data = model.image.copy()
    dram.top = model.image.size
    sim = Simulator(cfg, dram)
    floats: dict[str, np.ndarray] = {k: np.asarray(v, dtype=np.float64) for k, v in feeds.items()}
    resident: set[str] = set()
    eb = cfg.inp_elem_bytes
    ints: dict[str, np.ndarray] = {}

    def region(st: Storage) -> tuple[int, int]:
        return st.elem * eb, st.layout.blocks * st.height * st.width * eb

    def to_dram(name: str) -> None:
        st = model.storage[name]
        x_q = quantize(floats[name], q.frac[name])
        addr, _ = region(st)
        dram.write(addr, pack_activation(x_q, st.layout, cfg.block))
        resident.add(name)

    def from_dram(name: str) -> np.ndarray:
        st = model.storage[name]
        addr, nbytes = region(st)
        blocked = dram.read(addr, nbytes).view(np.int8).reshape(st.layout.blocks, st.height, st.width, cfg.block)
        return unpack_activation(blocked, st.layout)

    def as_float(name: str) -> np.ndarray:
        if name not in floats:
            x_q = from_dram(name)
            if trace:
                ints[name] = x_q
            floats[name] = dequantize(x_q, q.frac[name])
        return floats[name]

    for name in graph.inputs:
        if name in model.storage:
            to_dram(name)
    per: dict[str, Counters] = {}
    for op in graph.ops:
        if not op.on_vta:
            ins = {n: as_float(n) for n in op.reads}
            for name, v in zip(op.writes, float_op(graph, op, ins)):
                floats[name] = v
                if name in model.storage:
                    to_dram(name)
            continue
        missing = [n for n in op.reads if n not in resident]
        for n in missing:  # produced on the host before any VTA op needed it
            to_dram(n)
        if not (isinstance(op, ConcatOp) and op.in_place):
            per[op.name] = sim.run(model.streams.get(op.name, model.programs[op.name].insns))
        for n in op.writes:
            resident.add(n)
            floats.pop(n, None)
    if trace:
        for name in model.storage:
            if name in resident:
                ints.setdefault(name, from_dram(name))
    outputs = {o: as_float(o) for o in graph.outputs}
    total = Counters()
    for c in per.values():
        total.add(c)
    return RunResult(outputs, total, per, ints)
