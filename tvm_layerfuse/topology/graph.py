"""The topology graph: layers, the tensors that connect them, and queries over both.

A :class:`TopologyGraph` is pure Python. It is built once from an ONNX model (the *first*
topology graph, see :mod:`tvm_layerfuse.topology.onnx_reader`) and rewritten by the planner
into the *second* topology graph, where each layer may stand for several original layers
(``Layer.members``).

Vocabulary
----------
* **layer**: one computation (an ONNX node, or after merging a fused group of them).
* **tensor**: a named value. It is either *data* (produced at run time from the graph
  inputs) or *constant* (an initializer, or produced only from constants: ``Constant``,
  ``ConstantOfShape``, ``Identity``, ``Unsqueeze`` ... chains are folded into constants
  and do not appear as layers).
* **edge**: a data tensor from its producer layer to each consumer layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

from ..errors import GraphError
from .facts import LayerFacts

Dim = Optional[int]
"""A dimension: a positive int when known, ``None`` when unknown or symbolic."""


@dataclass
class Tensor:
    """A named value flowing between layers."""

    name: str
    shape: Optional[tuple[Dim, ...]] = None  # None when the rank itself is unknown
    dtype: Optional[str] = None  # numpy dtype name, e.g. "float32"
    constant: bool = False
    producer: Optional[str] = None  # name of the producing layer (data tensors only)
    consumers: list[str] = field(default_factory=list)  # layer names, in graph order
    is_input: bool = False
    is_output: bool = False
    # How the constant is obtained: "initializer", or the op chain that folds into it,
    # e.g. "ConstantOfShape" or "Unsqueeze(ConstantOfShape)".
    origin: Optional[str] = None
    _value: Optional[np.ndarray] = dataclasses.field(default=None, repr=False)
    _value_fn: Optional[Callable[[], np.ndarray]] = dataclasses.field(default=None, repr=False)

    @property
    def known_shape(self) -> bool:
        return self.shape is not None and all(d is not None for d in self.shape)

    @property
    def nbytes(self) -> Optional[int]:
        """Size in bytes when shape and dtype are known, else None."""
        if not self.known_shape or self.dtype is None:
            return None
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def value(self) -> np.ndarray:
        """The constant's value, computed on first use (weights are folded lazily)."""
        if not self.constant:
            raise GraphError(f"tensor {self.name!r} is computed at run time; it has no constant value")
        if self._value is None:
            if self._value_fn is None:
                raise GraphError(f"constant {self.name!r} has no recorded value")
            self._value = self._value_fn()
        return self._value


@dataclass
class Layer:
    """One computation of the graph.

    ``inputs`` lists every input tensor name in the op's own order (data and constants,
    ``""`` for an omitted optional input). ``members`` lists the original layers this
    layer stands for: just itself in the first graph, the whole group after a merge.
    """

    name: str
    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""
    members: tuple[str, ...] = ()
    template: Optional[str] = None  # the template that formed this layer, if fused
    fused: LayerFacts = field(default_factory=LayerFacts)  # what the templates decided (frozen)

    def __post_init__(self) -> None:
        if not self.members:
            self.members = (self.name,)

    @property
    def is_fused(self) -> bool:
        return self.template is not None


class TopologyGraph:
    """Layers in topological order, tensors by name, and the edges between them."""

    def __init__(
        self,
        *,
        name: str,
        layers: Iterable[Layer],
        tensors: dict[str, Tensor],
        inputs: list[str],
        outputs: list[str],
        opset: int = 0,
        meta: Optional[dict[str, Any]] = None,
    ) -> None:
        self.name = name
        self.tensors = tensors
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.opset = opset
        self.meta = dict(meta or {})
        # The ONNX model the graph was read from (input shapes fixed, shape arithmetic
        # folded), set by the reader: what the importer must import so names agree.
        self.source: Any = None
        self._layers: dict[str, Layer] = {}
        for layer in layers:
            if layer.name in self._layers:
                raise GraphError(
                    f"layer name {layer.name!r} appears twice in model {name!r}; "
                    "expected unique node names - rename one of them"
                )
            self._layers[layer.name] = layer
        self.relink()

    # ------------------------------------------------------------------ structure
    def relink(self) -> None:
        """Recompute producers and consumers from the layers' input/output lists."""
        for t in self.tensors.values():
            t.consumers = []
            if not t.constant:
                t.producer = None
        for layer in self._layers.values():
            for out in layer.outputs:
                t = self.tensors.get(out)
                if t is None:
                    t = self.tensors[out] = Tensor(out)
                if t.producer is not None and t.producer != layer.name:
                    raise GraphError(
                        f"tensor {out!r} is produced by both {t.producer!r} and {layer.name!r}; "
                        "expected each tensor to have one producer - rename one output"
                    )
                t.producer = layer.name
        for layer in self._layers.values():
            for inp in layer.inputs:
                if not inp:
                    continue
                t = self.tensors.get(inp)
                if t is None:
                    raise GraphError(
                        f"layer {layer.name!r} ({layer.op_type}) reads tensor {inp!r}, which no layer, "
                        "initializer or graph input provides; expected every input to be defined - "
                        "add the missing initializer or graph input"
                    )
                if layer.name not in t.consumers:
                    t.consumers.append(layer.name)

    @property
    def layers(self) -> list[Layer]:
        return list(self._layers.values())

    def __iter__(self) -> Iterator[Layer]:
        return iter(list(self._layers.values()))

    def __len__(self) -> int:
        return len(self._layers)

    def __contains__(self, name: str) -> bool:
        return name in self._layers

    def layer(self, name: str) -> Layer:
        return self._layers[name]

    def index(self, name: str) -> int:
        """Position of a layer in topological order."""
        return list(self._layers).index(name)

    def order(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self._layers)}

    # ------------------------------------------------------------------ tensor queries
    def tensor(self, name: str) -> Tensor:
        return self.tensors[name]

    def is_constant(self, name: str) -> bool:
        return bool(name) and self.tensors[name].constant

    def data_inputs(self, layer: Layer) -> list[str]:
        """Input tensors computed at run time (graph inputs or other layers' outputs)."""
        return [i for i in layer.inputs if i and not self.tensors[i].constant]

    def const_inputs(self, layer: Layer) -> list[str]:
        return [i for i in layer.inputs if i and self.tensors[i].constant]

    def producer(self, tensor: str) -> Optional[Layer]:
        p = self.tensors[tensor].producer
        return self._layers[p] if p is not None else None

    def consumers(self, tensor: str) -> list[Layer]:
        return [self._layers[c] for c in self.tensors[tensor].consumers]

    def readers(self, tensor: str) -> int:
        """How many places read the tensor: consumer layers plus one if it is a graph output."""
        t = self.tensors[tensor]
        return len(t.consumers) + (1 if t.is_output else 0)

    def sole_consumer(self, tensor: str) -> Optional[Layer]:
        """The only reader of ``tensor`` when it has exactly one and is not a graph output."""
        t = self.tensors[tensor]
        if t.is_output or len(t.consumers) != 1:
            return None
        return self._layers[t.consumers[0]]

    def successors(self, layer: Layer) -> list[Layer]:
        seen: dict[str, Layer] = {}
        for out in layer.outputs:
            for c in self.consumers(out):
                seen.setdefault(c.name, c)
        return list(seen.values())

    def predecessors(self, layer: Layer) -> list[Layer]:
        seen: dict[str, Layer] = {}
        for inp in self.data_inputs(layer):
            p = self.producer(inp)
            if p is not None:
                seen.setdefault(p.name, p)
        return list(seen.values())

    def descendants(self, layer: Layer) -> set[str]:
        """Names of every layer reachable from ``layer`` (excluding itself)."""
        out: set[str] = set()
        stack = [layer]
        while stack:
            for s in self.successors(stack.pop()):
                if s.name not in out:
                    out.add(s.name)
                    stack.append(s)
        return out

    def output_shape(self, layer: Layer, index: int = 0) -> Optional[tuple[Dim, ...]]:
        return self.tensors[layer.outputs[index]].shape

    # ------------------------------------------------------------------ rewriting
    def replace(self, old: list[str], new: list[Layer]) -> None:
        """Replace the layers named ``old`` by ``new`` (in that order) at the position of the
        last old layer, keeping the topological order valid, then relink."""
        old_set = set(old)
        missing = old_set - set(self._layers)
        if missing:
            raise GraphError(f"cannot replace layers {sorted(missing)}: not in graph {self.name!r}")
        last = max(self.index(n) for n in old)
        last_name = list(self._layers)[last]
        rebuilt: dict[str, Layer] = {}
        for name, layer in self._layers.items():
            if name == last_name:
                for n in new:
                    rebuilt[n.name] = n
            elif name not in old_set:
                rebuilt[name] = layer
        self._layers = rebuilt
        self.relink()
        self.sort()

    def sort(self) -> None:
        """Stable topological sort (Kahn, ties broken by current position)."""
        pos = {n: i for i, n in enumerate(self._layers)}
        indeg = {n: 0 for n in self._layers}
        for layer in self._layers.values():
            indeg[layer.name] = len(self.predecessors(layer))
        import heapq

        ready = [(pos[n], n) for n, d in indeg.items() if d == 0]
        heapq.heapify(ready)
        result: list[str] = []
        while ready:
            _, n = heapq.heappop(ready)
            result.append(n)
            for s in self.successors(self._layers[n]):
                indeg[s.name] -= 1
                if indeg[s.name] == 0:
                    heapq.heappush(ready, (pos[s.name], s.name))
        if len(result) != len(self._layers):
            stuck = sorted(set(self._layers) - set(result), key=pos.get)[:3]
            raise GraphError(
                f"graph {self.name!r} has a cycle through layers {stuck}; "
                "expected a directed acyclic graph - re-export the model"
            )
        self._layers = {n: self._layers[n] for n in result}

    def copy(self) -> "TopologyGraph":
        """A deep copy sharing constant values (which are never mutated)."""
        tensors = {n: dataclasses.replace(t, consumers=list(t.consumers)) for n, t in self.tensors.items()}
        layers = [
            dataclasses.replace(
                layer,
                inputs=list(layer.inputs),
                outputs=list(layer.outputs),
                attrs=dict(layer.attrs),
            )
            for layer in self._layers.values()
        ]
        out = TopologyGraph(
            name=self.name,
            layers=layers,
            tensors=tensors,
            inputs=self.inputs,
            outputs=self.outputs,
            opset=self.opset,
            meta=self.meta,
        )
        out.source = self.source
        return out

    # ------------------------------------------------------------------ summaries
    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for layer in self._layers.values():
            counts[layer.op_type] = counts.get(layer.op_type, 0) + 1
        return counts

    def original_layers(self) -> list[str]:
        """Every original layer name, expanded from ``members``, in graph order."""
        return [m for layer in self._layers.values() for m in layer.members]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description: layers with their information, and the edges."""
        layers = []
        for layer in self._layers.values():
            entry: dict[str, Any] = {
                "name": layer.name,
                "op_type": layer.op_type,
                "inputs": [i for i in self.data_inputs(layer)],
                "outputs": list(layer.outputs),
                "attrs": {k: _jsonable(v) for k, v in layer.attrs.items()},
                "weights": {
                    i: {"shape": _shape_json(self.tensors[i].shape), "dtype": self.tensors[i].dtype}
                    for i in self.const_inputs(layer)
                },
                "output_shapes": [_shape_json(self.tensors[o].shape) for o in layer.outputs],
                "output_dtypes": [self.tensors[o].dtype for o in layer.outputs],
            }
            if layer.domain:
                entry["domain"] = layer.domain
            if layer.is_fused or layer.members != (layer.name,):
                entry["members"] = list(layer.members)
                entry["template"] = layer.template
                entry["fused"] = layer.fused.to_dict()
            layers.append(entry)
        edges = []
        for layer in self._layers.values():
            for inp in self.data_inputs(layer):
                src = self.tensors[inp].producer
                edges.append({"tensor": inp, "from": src, "to": layer.name})
        return {
            "name": self.name,
            "opset": self.opset,
            "inputs": [
                {"name": i, "shape": _shape_json(self.tensors[i].shape), "dtype": self.tensors[i].dtype}
                for i in self.inputs
            ],
            "outputs": [
                {"name": o, "shape": _shape_json(self.tensors[o].shape), "dtype": self.tensors[o].dtype}
                for o in self.outputs
            ],
            "layers": layers,
            "edges": edges,
        }


def _shape_json(shape: Optional[tuple[Dim, ...]]) -> Optional[list[Optional[int]]]:
    return None if shape is None else list(shape)


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v

