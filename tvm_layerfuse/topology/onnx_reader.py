"""Read an ONNX model into the first topology graph.

Steps, each with a one-line error on failure:

1. load the file (missing, empty, not protobuf, truncated);
2. check the structure ourselves (duplicate tensor producers, dangling inputs, cycles),
   then with ``onnx.checker``;
3. fix the input shapes (``input_shapes`` overrides; dynamic or zero dims are refused);
4. fold shape arithmetic (``Shape -> Gather -> Concat -> Reshape`` ...) into constants with
   onnxscript's optimizer, checked against the original in onnxruntime
   (:mod:`.shape_folding`); the graph is built from the folded model, kept as
   ``graph.source`` for the importer;
5. run ``onnx.shape_inference`` (strict unless the model holds ops ONNX does not know);
6. fold constant chains (``Constant``, ``ConstantOfShape``, ``Identity``, ``Unsqueeze`` ...
   whose inputs are all constants) into constant tensors, evaluated lazily with
   ``onnx.reference``; every other node becomes a :class:`Layer`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import GraphError, ModelLoadError, ShapeError, first_line
from .graph import Dim, Layer, Tensor, TopologyGraph
from .shape_folding import fold_static_shapes

log = logging.getLogger(__name__)

# The oldest default-domain opset we accept: older models use semantics (e.g. Conv/BN
# "consumed_inputs", "spatial") that today's tools and TVM's importer do not handle.
MIN_OPSET = 7
# Ops that are never folded even when every input is constant.
_NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}
# Suffixes of weight names from which an unnamed node's layer name is derived.
_WEIGHT_SUFFIXES = ("_w_0", "_W_0", ".weight", "/weight", "_weight", "_w", "_scale_0", "_s_0")
# Refuse before allocating anything bigger than this for one tensor (elements).
MAX_TENSOR_ELEMENTS = 1 << 34

ModelSource = Union[str, os.PathLike, onnx.ModelProto]


def load_model(path: Union[str, os.PathLike]) -> onnx.ModelProto:
    """Load and parse an ONNX file with a clear error for every way it can fail."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model file {str(p)!r} does not exist; expected a path to an .onnx file - check the path")
    if p.is_dir():
        raise ModelLoadError(f"model path {str(p)!r} is a directory; expected an .onnx file - give the file inside it")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ModelLoadError(f"model file {str(p)!r} cannot be read ({e.strerror}); check its permissions") from None
    if not data:
        raise ModelLoadError(f"model file {str(p)!r} is empty; expected an ONNX model - re-export or re-download it")
    try:
        model = onnx.load_model_from_string(data)
    except Exception as e:  # protobuf raises DecodeError / RuntimeError variants
        raise ModelLoadError(
            f"model file {str(p)!r} is not an ONNX model (protobuf parse failed: {first_line(e)}); "
            "expected a file written by onnx.save or an exporter - check that the file is complete"
        ) from None
    if not model.graph.node and not model.graph.output:
        raise ModelLoadError(
            f"model file {str(p)!r} parsed to an empty ONNX graph (no nodes, no outputs); "
            "expected an ONNX model - the file is probably not ONNX or is truncated"
        )
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        try:
            onnx.load_external_data_for_model(model, str(p.parent))
        except Exception as e:
            raise ModelLoadError(
                f"model file {str(p)!r} keeps weights in external files that cannot be read ({first_line(e)}); "
                "expected them beside the model - copy them next to it"
            ) from None
    return model


def read_onnx(
    source: ModelSource,
    *,
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
    name: Optional[str] = None,
) -> TopologyGraph:
    """Build the first topology graph of an ONNX model (a path or a ``ModelProto``)."""
    if isinstance(source, onnx.ModelProto):
        model = source
        label = name or model.graph.name or "model"
    else:
        model = load_model(source)
        label = name or Path(source).name
    return _Reader(model, label, dict(input_shapes or {})).build()


class _Reader:
    def __init__(self, model: onnx.ModelProto, label: str, input_shapes: dict[str, Sequence[int]]):
        self.model = model
        self.label = label
        self.input_shapes = input_shapes
        self.opset = _default_opset(model, label)

    # -------------------------------------------------------------- entry point
    def build(self) -> TopologyGraph:
        initializers = {t.name: t for t in self.model.graph.initializer}
        self._check_structure(initializers)  # may replace self.model by a sorted copy
        graph = self.model.graph
        model = self._with_input_shapes(initializers)
        self._check_onnx(model)
        folded, folding = fold_static_shapes(model, label=self.label)
        if folding is not None:  # the graph is built from the folded model
            model = self.model = folded
            graph = model.graph
            initializers = {t.name: t for t in graph.initializer}
        unknown = self._unknown_ops(model)
        inferred = self._infer_shapes(model, strict=not unknown)
        types = _value_types(inferred)

        tensors: dict[str, Tensor] = {}
        for init in graph.initializer:
            shape = tuple(int(d) for d in init.dims)
            _refuse_huge(self.label, init.name, shape)
            tensors[init.name] = Tensor(
                init.name,
                shape=shape,
                dtype=_np_dtype(init.data_type),
                constant=True,
                origin="initializer",
                _value_fn=_init_value(init),
            )
        inputs = []
        for vi in graph.input:
            if vi.name in initializers:
                continue  # IR < 4: weights are listed as inputs too; they are constants
            shape, dtype = types.get(vi.name, (None, None))
            tensors[vi.name] = Tensor(vi.name, shape=shape, dtype=dtype, is_input=True)
            inputs.append(vi.name)

        layers: list[Layer] = []
        used_names: set[str] = set()
        for node in graph.node:
            if self._foldable(node, tensors):
                self._fold(node, tensors, types)
                continue
            for out in node.output:
                if out:
                    shape, dtype = types.get(out, (None, None))
                    if shape is not None:  # refused before anything (TVM's memory plan) is sized by it
                        _refuse_huge(self.label, out, shape)
                    tensors[out] = Tensor(out, shape=shape, dtype=dtype)
            layers.append(
                Layer(
                    name=self._layer_name(node, tensors, used_names),
                    op_type=node.op_type,
                    inputs=list(node.input),
                    outputs=[o for o in node.output if o],
                    attrs=_attrs(node),
                    domain=node.domain if node.domain not in ("", "ai.onnx") else "",
                )
            )
        outputs = [o.name for o in graph.output]
        for o in outputs:
            tensors[o].is_output = True
        for layer in layers:
            if (layer.domain, layer.op_type) in unknown:
                layer.attrs.setdefault("_unknown_op", True)
        meta = {"unknown_ops": sorted(f"{d or 'ai.onnx'}::{op}" for d, op in unknown)}
        if folding is not None:
            meta["shape_folding"] = folding.to_dict()
        filled = _constant_fill_weights(layers, tensors)
        if filled:
            meta["constant_fill_weights"] = filled
        nonfinite = _nonfinite_constants(graph)
        if nonfinite:
            meta["nonfinite_constants"] = nonfinite
        key = (self.label, tuple(e["name"] for e in nonfinite))
        if nonfinite and key not in _WARNED:  # once per model and process (compile reads it twice)
            _WARNED.add(key)
            log.warning(
                "model %s has weights with NaN/Inf values (%s); the outputs they reach are NaN/Inf or clamped - "
                "check the export",
                self.label,
                ", ".join(f"{e['name']!r}: {e['count']} of {e['size']}" for e in nonfinite[:3]),
            )
        if unknown:
            log.warning(
                "model %s uses ops ONNX does not define (%s); they are kept as opaque layers and never fused",
                self.label,
                ", ".join(meta["unknown_ops"]),
            )
        result = TopologyGraph(
            name=self.label, layers=layers, tensors=tensors, inputs=inputs, outputs=outputs, opset=self.opset, meta=meta
        )
        result.source = self.model
        return result

    # -------------------------------------------------------------- structure
    def _check_structure(self, initializers: dict[str, Any]) -> None:
        """Duplicate producers, dangling inputs and cycles, named precisely."""
        graph = self.model.graph
        defined: dict[str, str] = {}
        for name in initializers:
            defined[name] = "initializer"
        for vi in graph.input:
            defined.setdefault(vi.name, "graph input")
        producers: dict[str, int] = {}
        for i, node in enumerate(graph.node):
            for out in node.output:
                if not out:
                    continue
                if out in producers or (out in defined and out not in initializers):
                    raise GraphError(
                        f"tensor {out!r} in model {self.label!r} is defined twice (by node {i} {node.op_type} "
                        "and earlier); expected unique tensor names - rename one of them"
                    )
                producers[out] = i
        for i, node in enumerate(graph.node):
            for inp in node.input:
                if inp and inp not in producers and inp not in defined:
                    raise GraphError(
                        f"node {i} ({node.op_type} {node.name or ''}) of model {self.label!r} reads tensor {inp!r}, "
                        "which no node, initializer or graph input defines; expected every input defined - "
                        "add the missing initializer or graph input"
                    )
        for o in graph.output:
            if o.name not in producers and o.name not in defined:
                raise GraphError(
                    f"graph output {o.name!r} of model {self.label!r} is produced by no node; "
                    "expected each output to be computed - fix the export"
                )
        # Cycle check (Kahn over node indices).
        deps = [{producers[i] for i in node.input if i in producers} for node in graph.node]
        users: dict[int, list[int]] = {}
        for j, d in enumerate(deps):
            for i in d:
                users.setdefault(i, []).append(j)
        indeg = [len(d) for d in deps]
        ready = [j for j, d in enumerate(indeg) if d == 0]
        order: list[int] = []
        while ready:
            j = ready.pop()
            order.append(j)
            for u in users.get(j, []):
                indeg[u] -= 1
                if indeg[u] == 0:
                    ready.append(u)
        if len(order) != len(graph.node):
            stuck = [j for j in range(len(graph.node)) if indeg[j] > 0][:3]
            desc = ", ".join(f"{j} ({graph.node[j].op_type})" for j in stuck)
            raise GraphError(
                f"model {self.label!r} has a cycle through nodes {desc}; expected a directed acyclic graph - "
                "re-export the model"
            )
        if any(i >= j for j, d in enumerate(deps) for i in d):
            # Acyclic but not listed in topological order: sort a copy for the rest.
            sorted_nodes = [graph.node[j] for j in _stable_topo(deps, users)]
            model = onnx.ModelProto()
            model.CopyFrom(self.model)
            del model.graph.node[:]
            model.graph.node.extend(sorted_nodes)
            self.model = model

    def _check_onnx(self, model: onnx.ModelProto) -> None:
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as e:
            raise GraphError(
                f"model {self.label!r} is not valid ONNX: {first_line(e)}; expected a model that passes "
                "onnx.checker - re-export it"
            ) from None

    def _unknown_ops(self, model: onnx.ModelProto) -> set[tuple[str, str]]:
        opsets = {o.domain or "": o.version for o in model.opset_import}
        unknown = set()
        for node in model.graph.node:
            domain = node.domain if node.domain not in ("ai.onnx",) else ""
            version = opsets.get(domain, self.opset)
            try:
                onnx.defs.get_schema(node.op_type, version, domain)
            except onnx.defs.SchemaError:
                unknown.add((domain, node.op_type))
        return unknown

    # -------------------------------------------------------------- shapes
    def _with_input_shapes(self, initializers: dict[str, Any]) -> onnx.ModelProto:
        graph = self.model.graph
        real_inputs = [vi for vi in graph.input if vi.name not in initializers]
        names = {vi.name for vi in real_inputs}
        for name in self.input_shapes:
            if name not in names:
                raise ShapeError(
                    f"--input-shape names {name!r}, which is not an input of model {self.label!r}; "
                    f"expected one of {sorted(names)}"
                )
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        for vi in model.graph.input:
            if vi.name in initializers:
                continue
            if not vi.type.HasField("tensor_type"):
                raise ShapeError(
                    f"input {vi.name!r} of model {self.label!r} is not a tensor; expected tensor inputs only"
                )
            tt = vi.type.tensor_type
            if vi.name in self.input_shapes:
                dims = [int(d) for d in self.input_shapes[vi.name]]
                if tt.HasField("shape") and len(tt.shape.dim) != len(dims):
                    raise ShapeError(
                        f"--input-shape {vi.name}={','.join(map(str, dims))} has rank {len(dims)}, but input "
                        f"{vi.name!r} of model {self.label!r} has rank {len(tt.shape.dim)}; give one size per dimension"
                    )
                if any(d <= 0 for d in dims):
                    raise ShapeError(
                        f"--input-shape {vi.name}={','.join(map(str, dims))} has a dimension <= 0; "
                        "expected positive sizes"
                    )
                tt.ClearField("shape")
                for d in dims:
                    tt.shape.dim.add().dim_value = d
            if not tt.HasField("shape"):
                raise ShapeError(
                    f"input {vi.name!r} of model {self.label!r} has no declared shape; expected a static shape - "
                    f"pass --input-shape {vi.name}=1,3,224,224 (with the real sizes)"
                )
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            if any(d is None for d in dims):
                shown = ",".join("?" if d is None else str(d) for d in dims)
                raise ShapeError(
                    f"input {vi.name!r} of model {self.label!r} has dynamic shape [{shown}]; expected static sizes - "
                    f"pass --input-shape {vi.name}={','.join('1' if d is None else str(d) for d in dims)} "
                    "(with the sizes you will run)"
                )
            if any(d == 0 for d in dims):
                raise ShapeError(
                    f"input {vi.name!r} of model {self.label!r} has a zero dimension {dims}; expected positive sizes - "
                    f"pass --input-shape {vi.name}=... with the real sizes"
                )
            _refuse_huge(self.label, vi.name, dims)
        if self.input_shapes:
            # Shapes recorded for the old input sizes would contradict inference: forget them.
            del model.graph.value_info[:]
            for vi in model.graph.output:
                if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
                    for k, d in enumerate(vi.type.tensor_type.shape.dim):
                        d.dim_param = f"{vi.name}_dim{k}"
        return model

    def _infer_shapes(self, model: onnx.ModelProto, *, strict: bool) -> onnx.ModelProto:
        try:
            return onnx.shape_inference.infer_shapes(model, strict_mode=strict, data_prop=True)
        except Exception as e:
            raise GraphError(
                f"shape inference failed on model {self.label!r}: {first_line(e)}; "
                "expected consistent shapes - check the weights and input shape"
            ) from None

    # -------------------------------------------------------------- constants
    def _foldable(self, node: onnx.NodeProto, tensors: dict[str, Tensor]) -> bool:
        if node.domain not in ("", "ai.onnx") or node.op_type in _NONDETERMINISTIC:
            return False
        if node.op_type == "Constant":
            return True
        inputs = [i for i in node.input if i]
        return bool(inputs) and all(i in tensors and tensors[i].constant for i in inputs)

    def _fold(self, node: onnx.NodeProto, tensors: dict[str, Tensor], types: dict[str, tuple]) -> None:
        feeds = [i for i in node.input if i]
        origin_in = sorted({tensors[i].origin for i in feeds if tensors[i].origin != "initializer"})
        origin = node.op_type + (f"({','.join(origin_in)})" if origin_in else "")
        fn = _node_value_fn(node, self.opset, [tensors[i] for i in feeds])
        for k, out in enumerate(node.output):
            if not out:
                continue
            shape, dtype = types.get(out, (None, None))
            if shape is not None:
                _refuse_huge(self.label, out, shape)
            tensors[out] = Tensor(
                out, shape=shape, dtype=dtype, constant=True, origin=origin, _value_fn=_pick(fn, k)
            )

    def _layer_name(self, node: onnx.NodeProto, tensors: dict[str, Tensor], used: set[str]) -> str:
        base = node.name
        if not base:
            weight = node.input[1] if len(node.input) > 1 else ""
            if weight and weight in tensors and tensors[weight].constant:
                for suffix in _WEIGHT_SUFFIXES:
                    if weight.endswith(suffix) and len(weight) > len(suffix):
                        base = weight[: -len(suffix)]
                        break
            if not base:
                base = f"{node.op_type}_{node.output[0] if node.output else len(used)}"
        name, k = base, 2
        while name in used:
            name, k = f"{base}#{k}", k + 1
        used.add(name)
        return name


# ---------------------------------------------------------------------- helpers
def _default_opset(model: onnx.ModelProto, label: str) -> int:
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not versions:
        raise ModelLoadError(
            f"model {label!r} imports no default-domain opset; expected an ONNX model with an ai.onnx opset"
        )
    opset = max(versions)
    newest = onnx.defs.onnx_opset_version()
    if opset > newest:
        raise ModelLoadError(
            f"model {label!r} uses opset {opset}, newer than the {newest} this onnx {onnx.__version__} knows; "
            "expected opset <= {newest} - upgrade onnx or export with an older opset".replace("{newest}", str(newest))
        )
    if opset < MIN_OPSET:
        raise ModelLoadError(
            f"model {label!r} uses opset {opset}; expected opset >= {MIN_OPSET} - convert it with "
            "onnx.version_converter.convert_version(model, 13)"
        )
    return opset


def _value_types(model: onnx.ModelProto) -> dict[str, tuple[Optional[tuple[Dim, ...]], Optional[str]]]:
    out: dict[str, tuple[Optional[tuple[Dim, ...]], Optional[str]]] = {}
    g = model.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        dtype = _np_dtype(tt.elem_type) if tt.elem_type else None
        shape: Optional[tuple[Dim, ...]] = None
        if tt.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim)
        prev = out.get(vi.name)
        if prev is None or (prev[0] is None and shape is not None):
            out[vi.name] = (shape, dtype)
    return out


def _np_dtype(elem_type: int) -> Optional[str]:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except Exception:
        return None


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, onnx.TensorProto):
            v = numpy_helper.to_array(v)
        elif isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        elif isinstance(v, list):
            v = [x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in v]
        out[a.name] = v
    return out


def _init_value(init: onnx.TensorProto):
    return lambda: numpy_helper.to_array(init)


def _node_value_fn(node: onnx.NodeProto, opset: int, feeds: list[Tensor]):
    cache: list[Any] = []

    def run() -> list[np.ndarray]:
        if not cache:
            from onnx.reference import ReferenceEvaluator

            values = {t.name: t.value() for t in feeds}
            g = helper.make_graph(
                [node],
                "fold",
                [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in values],
                [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o],
            )
            cache.append(ReferenceEvaluator(g, opsets={"": opset}).run(None, values))
        return cache[0]

    return run


def _pick(fn, k: int):
    return lambda: np.asarray(fn()[k])


_WARNED: set[tuple[str, tuple[str, ...]]] = set()
_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
}


def _nonfinite_constants(graph: onnx.GraphProto) -> list[dict[str, Any]]:
    """Float initializers and ``Constant`` values holding NaN or Inf: ``[{name, count, size}]``
    (an infinite *scalar* is not counted: it is a bound, e.g. Clip's max).

    One pass of ``np.isfinite`` over each float constant (the values are read from the
    protobuf without copying where numpy allows); constants computed by folded op chains
    (``ConstantOfShape`` ...) are not evaluated here."""
    tensors = [(t.name, t) for t in graph.initializer]
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    tensors.append((node.output[0], a.t))
    found = []
    for name, t in tensors:
        if t.data_type not in _FLOAT_TYPES or t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        try:
            values = numpy_helper.to_array(t)
        except Exception:  # a malformed tensor is onnx.checker's business, not this note's
            continue
        if values.size == 1:  # a scalar: a bound (Clip max = inf) may legitimately be infinite
            bad = int(np.isnan(values).sum())
        else:
            bad = int(values.size - np.count_nonzero(np.isfinite(values)))
        if bad:
            found.append({"name": name, "count": bad, "size": int(values.size)})
    return found


def _constant_fill_weights(layers: list, tensors: dict) -> Optional[dict[str, int]]:
    """``{"filled": n, "weights": m}`` when every Conv/Gemm weight is a constant fill (one value
    repeated, as the ONNX model-zoo "light" models build them with ``ConstantOfShape``); None
    otherwise. Such a network computes (nearly) the same output for every input.

    Only weights computed by ``ConstantOfShape`` are evaluated (initializers of trained or
    random weights never are all one value), so the check costs nothing on other models."""
    weights = [tensors.get(l.inputs[1]) for l in layers if l.op_type in ("Conv", "Gemm") and len(l.inputs) > 1]
    weights = [w for w in weights if w is not None and w.constant]
    if not weights or not all("ConstantOfShape" in w.origin for w in weights):
        return None
    for w in weights:
        v = w.value()
        if v.size and not np.all(v == v.reshape(-1)[0]):
            return None
    return {"filled": len(weights), "weights": len(weights)}


def _refuse_huge(label: str, name: str, shape: Sequence[Optional[int]]) -> None:
    if any(d is None for d in shape):
        return
    n = int(np.prod([int(d) for d in shape], dtype=np.float64))
    if n > MAX_TENSOR_ELEMENTS:
        raise ShapeError(
            f"tensor {name!r} of model {label!r} declares shape {list(shape)} ({n:.3g} elements); expected at most "
            f"{MAX_TENSOR_ELEMENTS:.3g} elements - check the model's shapes or --input-shape"
        )


def _stable_topo(deps: list[set[int]], users: dict[int, list[int]]) -> list[int]:
    import heapq

    indeg = [len(d) for d in deps]
    ready = [j for j, d in enumerate(indeg) if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        j = heapq.heappop(ready)
        order.append(j)
        for u in users.get(j, []):
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, u)
    return order
