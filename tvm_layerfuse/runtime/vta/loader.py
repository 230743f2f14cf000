"""A VTA artifact behind the runtime's one interface (:func:`tvm_layerfuse.runtime.load`).

The artifact's manifest is every target's (checksums, inputs, outputs); its ``library`` is
``vta.json``, the op sequence that :func:`tvm_layerfuse.runtime.vta.runtime.load_vta` runs: VTA
programs on a device (``sim``: the bit-exact simulator in hardware mode; ``sim-functional``:
in upstream's functional semantics, for comparison; ``board``: a real VTA) and the
host steps in the artifact's ``host.so`` (compiled by TVM for the host CPU, run by TVM's
runtime; the artifact's ``target.machine`` must be this machine's).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from ...errors import ArtifactError
from .. import artifact
from ..loader import Inputs, check_inputs, this_machine

DEVICES = ("sim", "sim-functional", "board")  # sim: hardware mode; sim-functional: sim_driver.cc, for comparison


class VTARuntime:
    """A loaded VTA artifact: ``inputs``/``outputs`` metadata, :meth:`run`, :meth:`benchmark`;
    ``counters`` holds VTA's profiling counters of the last run."""

    def __init__(self, path: Union[str, os.PathLike], *, device: str = "sim", manifest: Optional[dict[str, Any]] = None) -> None:
        from .runtime import load_vta

        self.path = Path(path)
        manifest = manifest or artifact.read_manifest(self.path)
        if device not in DEVICES:
            raise ArtifactError(
                f"artifact {str(self.path)!r} was compiled for vta, but device {device!r} was requested; "
                "run it with --device sim (the simulator), sim-functional (upstream's functional simulator) or board, "
                "or compile with --target cpu"
            )
        machine, here = manifest["target"].get("machine"), this_machine()
        if machine and machine != here:
            raise ArtifactError(
                f"artifact {str(self.path)!r} holds host steps compiled for {machine}, but this machine is {here}; "
                f"compile with a VTA preset for {here}, or deploy the artifact to its {machine} board"
            )
        artifact.verify(self.path, manifest)
        self.manifest = manifest
        self.inputs: list[dict[str, Any]] = manifest["inputs"]
        self.outputs: list[dict[str, Any]] = manifest["outputs"]
        self.module = load_vta(self.path, device=device)
        self.counters: dict[str, int] = {}

    def run(self, inputs: Inputs) -> dict[str, np.ndarray]:
        """One inference; returns ``{output name: array}`` in the manifest's dtypes."""
        values = check_inputs(self.inputs, inputs)
        result = self.module.run({spec["name"]: v for spec, v in zip(self.inputs, values)})
        self.counters = result.counters.to_dict()
        return {o["name"]: result.outputs[o["name"]].astype(o["dtype"]) for o in self.outputs}

    def benchmark(self, inputs: Inputs, *, number: int = 1, repeat: int = 10, min_repeat_ms: int = 0) -> dict[str, float]:
        """Wall-clock latency of :meth:`run` in milliseconds (on the simulator: the simulator's time)."""
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            for _ in range(number):
                self.run(inputs)
            times.append((time.perf_counter() - t) * 1e3 / number)
        return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "repeat": len(times)}
