"""The tactic chosen for one layer: what :class:`.use_onednn.UseOneDNNConv` and its data
movement steps record for every layer they look at, and what the manifest's ``tactics.layers``
holds (``inspect`` shows it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class LayerChoice:
    """The tactic of one layer (a conv, pool, concat or the classifier)."""

    layer: str  # the fused function (or the bound variable of a bare conv)
    tactic: str  # "onednn" | "tvm"
    kernel: str = ""  # oneDNN's implementation name when "onednn"
    reason: str = ""  # why not oneDNN, when "tvm"; why a plain layout, when "onednn"
    shape: str = ""  # "x[1,64,56,56] w[64,64,3,3]"
    layout: str = ""  # "nchw>nChw16c" (or nChw8c): the src and dst bytes in the graph, when "onednn"
    timing: str = ""  # "direct 5.84 ms, winograd 2.15 ms": the algorithm choice, when timed
    id: int = -1  # the layer id its library calls carry (abi.ConvAttrs.layer), when "onednn"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
