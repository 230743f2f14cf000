"""What a template leaves on a layer: the typed contract between the planner and what follows.

A merged :class:`~tvm_layerfuse.topology.graph.Layer` carries one :class:`LayerFacts` in
``layer.fused``. Templates write it (building a new value with ``dataclasses.replace``; the
values are frozen), and everything after the planner reads it: the report, the DOT drawing,
the ONNX realisation, the plan-to-Relax translation and the plan invariants of the testing
tools. ``to_dict`` gives the JSON form that ``inspect --json`` prints.

========================  =========================================================
fact                      written by
========================  =========================================================
``epilogue``              vertical (folded affine ops, activation), eltwise (the
                          residual/multiply op and its activation), horizontal (the
                          branches' shared activation)
``prologue``              preactivation (BatchNormalization, affine ops, activation)
``extra_input``,          eltwise (the other operand of the absorbed op, and whether
``overwrite_extra_input``  the fused layer may write its result over it)
``split``, ``branches``   horizontal (each branch's output channels, each branch's facts)
``concat``                concat (the in-place block: axis, layout, slots)
``writes_into``           concat, on each producer (where its output lives in the block)
========================  =========================================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class EpilogueOp:
    """One op of an epilogue or a prologue.

    ``role``: ``"bias"``, ``"batchnorm"``, ``"per-channel Mul"`` (``Add``, ``Sub``, ``Div``),
    ``"activation"``, ``"residual"`` (an absorbed ``Add``) or ``"multiply"`` (an absorbed
    ``Mul``). ``layer`` is the first-graph layer it stands for (None in a horizontal merge's
    shared epilogue), ``layers`` every layer when it spans several (SiLU: Sigmoid and Mul).
    ``params`` holds an activation's parameters (``alpha``; ``min``/``max``). ``folded``: the
    op is folded into the conv's weight and bias. ``extra_input``: the other operand of a
    residual or multiply."""

    op: str
    role: str
    layer: Optional[str] = None
    params: Mapping[str, Any] = field(default_factory=dict)
    layers: tuple[str, ...] = ()
    folded: bool = False
    extra_input: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op, "role": self.role}
        if self.layer is not None:
            out["layer"] = self.layer
        out.update(self.params)
        if self.layers:
            out["layers"] = list(self.layers)
        if self.folded:
            out["folded"] = True
        if self.extra_input is not None:
            out["extra_input"] = self.extra_input
        return out


@dataclass(frozen=True)
class SplitPart:
    """One branch of a horizontal merge: output channels ``[channels[0], channels[1])`` of
    the merged conv are the branch conv's output tensor ``output``."""

    branch: str
    output: str
    channels: tuple[int, int]

    def to_dict(self) -> dict[str, Any]:
        return {"branch": self.branch, "output": self.output, "channels": list(self.channels)}


@dataclass(frozen=True)
class ConcatSlot:
    """One input of an in-place concat: ``tensor`` (made by ``producer``) fills positions
    ``[range[0], range[1])`` of the concat axis; ``byte_offset`` into the block when the
    slot is contiguous (None: strided), ``bytes`` its size."""

    tensor: str
    producer: str
    range: tuple[int, int]
    byte_offset: Optional[int]
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "producer": self.producer,
            "range": list(self.range),
            "byte_offset": self.byte_offset,
            "bytes": self.bytes,
        }


@dataclass(frozen=True)
class ConcatWrite:
    """Where a producer's output lives: positions ``[range[0], range[1])`` along ``axis`` of
    in-place concat ``concat``'s block (``byte_offset`` None: strided)."""

    concat: str
    axis: int
    range: tuple[int, int]
    byte_offset: Optional[int]

    def to_dict(self) -> dict[str, Any]:
        return {"concat": self.concat, "axis": self.axis, "range": list(self.range), "byte_offset": self.byte_offset}


@dataclass(frozen=True)
class ConcatBlock:
    """A concat whose inputs are written straight into its output block."""

    axis: int
    contiguous: bool
    slots: tuple[ConcatSlot, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "in_place": True,
            "axis": self.axis,
            "contiguous": self.contiguous,
            "slots": [s.to_dict() for s in self.slots],
        }


@dataclass(frozen=True)
class LayerFacts:
    """Everything the templates decided about one layer (empty for a layer left alone)."""

    prologue: tuple[EpilogueOp, ...] = ()
    epilogue: tuple[EpilogueOp, ...] = ()
    extra_input: Optional[str] = None
    overwrite_extra_input: bool = False
    split: tuple[SplitPart, ...] = ()
    branches: Mapping[str, "LayerFacts"] = field(default_factory=dict)
    concat: Optional[ConcatBlock] = None
    writes_into: Mapping[str, ConcatWrite] = field(default_factory=dict)

    @property
    def in_place(self) -> bool:
        """Whether this layer is a concat computed in place."""
        return self.concat is not None

    def all_epilogue_ops(self) -> list[EpilogueOp]:
        """The epilogue, then every branch's epilogue (a horizontal merge folds each branch)."""
        return list(self.epilogue) + [e for b in self.branches.values() for e in b.epilogue]

    def writing_into(self, tensor: str, write: ConcatWrite) -> "LayerFacts":
        """These facts with ``tensor`` written into an in-place concat."""
        return dataclasses.replace(self, writes_into={**self.writes_into, tensor: write})

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``inspect --json``): a conv merge lists its prologue and epilogue,
        other facts appear only when set."""
        out: dict[str, Any] = {}
        if self.prologue or self.epilogue or self.split:
            out["prologue"] = [e.to_dict() for e in self.prologue]
            out["epilogue"] = [e.to_dict() for e in self.epilogue]
        if self.extra_input is not None:
            out["extra_input"] = self.extra_input
            out["overwrite_extra_input"] = self.overwrite_extra_input
        if self.split:
            out["split"] = [s.to_dict() for s in self.split]
            out["branches"] = {name: b.to_dict() for name, b in self.branches.items()}
        if self.concat is not None:
            out.update(self.concat.to_dict())
        if self.writes_into:
            out["writes_into"] = {t: w.to_dict() for t, w in self.writes_into.items()}
        return out
