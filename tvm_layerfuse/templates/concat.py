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

Prefix concats (DenseNet as torchvision writes it: every dense layer concatenates all
earlier features afresh) share one block too. When the inputs of ``P = Concat(x_1, ..., x_k)``
are the first ``k`` inputs of a larger ``R = Concat(x_1, ..., x_n)`` on the same axis::

    P = R[..., 0 : o_{k+1}, ...]          o_{k+1} = C_1 + ... + C_k

so ``P`` is a *prefix view* of ``R``'s block: each producer writes once, at its offset in
``R``, and every prefix concat of the chain reads its leading slice (no copy, no block of
its own). The pattern proposes the largest concat of a chain first and its prefixes after
it, largest first, so one block serves the whole chain.

A producer cannot write in place when its value comes from outside the graph's layers
(graph input, constant), when its tensor is a graph output (it needs storage of its own),
when it already writes into another Concat (unless this Concat is a prefix view of that
one), when the Concat reads it twice, or when an element-wise epilogue will overwrite it in
place (the block would be corrupted). A prefix view is refused when its own output is a
graph output, is overwritten in place by an epilogue, or already writes into another Concat.
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
        concats = [l for l in graph if l.op_type == "Concat" and not l.domain and not l.fused.in_place]
        for layer in prefix_order(graph, concats):
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
        block = block_of(graph, concat)
        if block is not None:  # a prefix of an in-place concat: its inputs are checked there
            return view_reason(graph, concat, block)
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
            producer = graph.layer(t.producer)
            if producer.fused.concat is not None and producer.fused.concat.view_of is not None:
                block = producer.fused.concat.view_of
                return f"input {name!r} is a prefix view of concat {block!r} and already lives in its block"
            writes = producer.fused.writes_into
            if name in writes:
                return f"input {name!r} already writes into concat {writes[name].concat!r}"
            for reader in graph.consumers(name):
                if reader.fused.overwrite_extra_input and reader.fused.extra_input == name:
                    return f"input {name!r} is overwritten in place by the epilogue of {reader.name!r}"
        return None

    def merge(self, graph: TopologyGraph, match: Match) -> tuple[Layer, dict[str, Any]]:
        concat = graph.layer(match.layers[0])
        block = block_of(graph, concat)
        if block is not None:
            return self._merge_view(graph, concat, block)
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

    def _merge_view(self, graph: TopologyGraph, concat: Layer, block: Layer) -> tuple[Layer, dict[str, Any]]:
        """``concat`` becomes the prefix view ``block[..., 0 : C, ...]`` of ``block``'s storage."""
        own = block.fused.concat
        slots = own.slots[: len(concat.inputs)]  # the block's leading slots, same offsets
        end = slots[-1].range[1]
        concat.template = self.name
        view = ConcatBlock(axis=own.axis, contiguous=own.contiguous, slots=slots, view_of=block.name, range=(0, end))
        concat.fused = dataclasses.replace(concat.fused, concat=view)
        block.fused = dataclasses.replace(block.fused, concat=dataclasses.replace(own, views=own.views + (concat.name,)))
        details = {
            "axis": own.axis,
            "contiguous": own.contiguous,
            "block_bytes": graph.tensor(block.outputs[0]).nbytes,
            "view_of": block.name,
            "range": [0, end],
            "offsets": [
                {"tensor": s.tensor, "producer": s.producer, "range": list(s.range), "byte_offset": s.byte_offset} for s in slots
            ],
        }
        return concat, details


def _axis(graph: TopologyGraph, concat: Layer) -> Optional[int]:
    shape = graph.tensor(concat.outputs[0]).shape
    axis = int(concat.attrs.get("axis", 1))
    if shape is None:
        return axis
    return axis % len(shape) if -len(shape) <= axis < len(shape) else None


def is_prefix(graph: TopologyGraph, small: Layer, big: Layer) -> bool:
    """Whether ``small``'s inputs are the first inputs of ``big``'s, on the same axis (and
    ``small`` is not ``big``)."""
    k = len(small.inputs)
    return (
        small is not big
        and k <= len(big.inputs)
        and list(big.inputs[:k]) == list(small.inputs)
        and (k < len(big.inputs) or small.name != big.name)
        and _axis(graph, small) == _axis(graph, big)
    )


def prefix_order(graph: TopologyGraph, concats: list[Layer]) -> list[Layer]:
    """``concats`` in graph order, except that each concat that is a prefix of a larger one
    comes right after the largest concat of its chain (largest prefixes first): the
    largest concat plans the block, its prefixes become views of it."""
    maximal = [c for c in concats if not any(is_prefix(graph, c, d) and len(d.inputs) > len(c.inputs) for d in concats)]
    order: list[Layer] = []
    taken: set[str] = set()
    for c in concats:
        if c.name in taken or c not in maximal:
            continue
        order.append(c)
        taken.add(c.name)
        chain = [d for d in concats if d.name not in taken and is_prefix(graph, d, c)]
        for d in sorted(chain, key=lambda d: -len(d.inputs)):
            order.append(d)
            taken.add(d.name)
    order += [c for c in concats if c.name not in taken]
    return order


def block_of(graph: TopologyGraph, concat: Layer) -> Optional[Layer]:
    """The in-place concat whose block ``concat``'s inputs already write into, when
    ``concat`` is a prefix of it (``concat`` then merges as a view), else None."""
    if not concat.inputs:
        return None
    t = graph.tensor(concat.inputs[0])
    if t.producer is None:
        return None
    writes = graph.layer(t.producer).fused.writes_into
    if concat.inputs[0] not in writes:
        return None
    block = graph.layer(writes[concat.inputs[0]].concat)
    return block if is_prefix(graph, concat, block) else None


def view_reason(graph: TopologyGraph, concat: Layer, block: Layer) -> Optional[str]:
    """Why ``concat``, a prefix of in-place ``block``, cannot be a view of its block, or None."""
    out = concat.outputs[0]
    t = graph.tensor(out)
    where = f"{concat.name!r} is a prefix of concat {block.name!r}, whose block its inputs already write into"
    if not block.fused.in_place:
        return f"{where}, but that concat is not in place"
    if t.is_output:
        return f"{where}, but its output {out!r} is a graph output and needs storage of its own"
    if concat.fused.writes_into:
        other = next(iter(concat.fused.writes_into.values())).concat
        return f"{where}, but its output {out!r} already writes into concat {other!r}"
    for reader in graph.consumers(out):
        if reader.fused.overwrite_extra_input and reader.fused.extra_input == out:
            return f"{where}, but its output {out!r} is overwritten in place by the epilogue of {reader.name!r}"
    return None
