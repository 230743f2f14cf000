"""Concat template: every producer of a Concat writes straight into one memory block.

For ``y = Concat(x_1, ..., x_n, axis=a)`` with ``x_i: [d_0, ..., d_a = C_i, ...]``::

    y[..., o_i : o_i + C_i, ...] = x_i          o_i = C_1 + ... + C_{i-1}

so producer ``i`` computes ``x_i`` directly into that slice of ``y``'s storage and the
copy disappears. The slice is one contiguous run of bytes, starting at::

    byte_offset_i = o_i * prod(d_{a+1:}) * itemsize

when ``prod(d_0 .. d_{a-1}) == 1`` (batch 1, channel axis, NCHW); otherwise it is a strided
view and the lowering writes with strides. A producer that is itself an in-place Concat
(DenseNet's nested concats) becomes a view of the outer block: its own producers write at
the sum of both offsets.

A producer cannot write in place when its value comes from outside the graph's layers
(graph input, constant), when its tensor is a graph output (it needs storage of its own),
when it already writes into another Concat, when the Concat reads it twice, or when an
element-wise epilogue will overwrite it in place (the block would be corrupted).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import numpy as np

from ..topology.facts import ConcatBlock, ConcatSlot, ConcatWrite
from ..topology.graph import Layer, TopologyGraph
from .base import Match, Template


class InPlaceConcat(Template):
    name = "concat.in_place"
    kind = "concat"
    description = "Concat whose producers write into one block at offsets (no copy)"

    def pattern(self, graph: TopologyGraph) -> Iterator[Match]:
        for layer in graph:
            if layer.op_type == "Concat" and not layer.domain and not layer.fused.in_place:
                producers = [graph.tensor(i).producer for i in layer.inputs]
                yield Match(self.name, [layer.name] + [p for p in producers if p is not None])

    def check(self, graph: TopologyGraph, match: Match) -> Optional[str]:
        concat = graph.layer(match.layers[0])
        out = graph.tensor(concat.outputs[0])
        if not out.known_shape:
            return f"the output shape of {concat.name!r} is unknown"
        axis = int(concat.attrs.get("axis", 1))
        if not -len(out.shape) <= axis < len(out.shape):
            return f"axis {axis} is out of range for rank {len(out.shape)}"
        seen: set[str] = set()
        for name in concat.inputs:
            t = graph.tensor(name)
            if name in seen:
                return f"input {name!r} appears twice; one tensor cannot live at two offsets"
            seen.add(name)
            if t.constant:
                return f"input {name!r} is a constant; only layer outputs can be written in place"
            if t.producer is None:
                return f"input {name!r} is a graph input; only layer outputs can be written in place"
            if t.is_output:
                return f"input {name!r} is also a graph output and needs storage of its own"
            if t.dtype != out.dtype:
                return f"input {name!r} has dtype {t.dtype}, the concat {out.dtype}"
            if not t.known_shape:
                return f"the shape of input {name!r} is unknown"
            writes = graph.layer(t.producer).fused.writes_into
            if name in writes:
                return f"input {name!r} already writes into concat {writes[name].concat!r}"
            for reader in graph.consumers(name):
                if reader.fused.overwrite_extra_input and reader.fused.extra_input == name:
                    return f"input {name!r} is overwritten in place by the epilogue of {reader.name!r}"
        return None

    def merge(self, graph: TopologyGraph, match: Match) -> tuple[Layer, dict[str, Any]]:
        concat = graph.layer(match.layers[0])
        out = graph.tensor(concat.outputs[0])
        shape = [int(d) for d in out.shape]  # [d_0, ..., d_axis, ...]
        axis = int(concat.attrs.get("axis", 1)) % len(shape)
        itemsize = np.dtype(out.dtype).itemsize
        inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
        contiguous = int(np.prod(shape[:axis], dtype=np.int64)) == 1
        slots = []
        start = 0
        for name in concat.inputs:
            size = int(graph.tensor(name).shape[axis])
            slot = ConcatSlot(
                tensor=name,
                producer=graph.tensor(name).producer,
                range=(start, start + size),
                byte_offset=start * inner * itemsize if contiguous else None,
                bytes=size * inner * itemsize * int(np.prod(shape[:axis], dtype=np.int64)),
            )
            slots.append(slot)
            producer = graph.layer(slot.producer)
            write = ConcatWrite(concat=concat.name, axis=axis, range=slot.range, byte_offset=slot.byte_offset)
            producer.fused = producer.fused.writing_into(name, write)
            start += size
        concat.template = self.name
        block = ConcatBlock(axis=axis, contiguous=contiguous, slots=tuple(slots))
        concat.fused = dataclasses.replace(concat.fused, concat=block)
        details = {
            "axis": axis,
            "contiguous": contiguous,
            "block_bytes": out.nbytes,
            "offsets": [
                {"tensor": s.tensor, "producer": s.producer, "range": list(s.range), "byte_offset": s.byte_offset} for s in slots
            ],
        }
        return concat, details
