"""Import an ONNX model into a Relax IRModule whose weights are function parameters.

Steps::

    read_onnx                 first topology graph (checks the model, fixes input shapes,
                              folds shape arithmetic: topology/shape_folding.py)
    materialize_constants     ConstantOfShape/Constant weight chains -> initializers
    canonicalize (ONNX)       Sum(a, b, ...) -> Add(Add(a, b), ...)
    from_onnx(keep_params_in_input=True)
    canonicalize (Relax)      call_tir(topi.maximum/minimum) -> R.maximum/R.minimum
                              (tensor or scalar bound)
    detach_params             weights leave the module; their values come back as a dict

After this every weight is a parameter of ``main`` named after its ONNX tensor (input 1
of an ONNX Conv names the conv2d weight), ``main`` has ``num_input`` set, and the values
are in ``params``. The layerfuse passes rewrite weight *expressions*; binding the values
(``relax.transform.BindParams("main", params)``) and ``FoldConstant`` come last.

Why the two canonicalisations (both compute exactly the same function):

* TVM imports ONNX ``Sum`` as ``broadcast_to`` + ``stack`` + a ``sum`` reduction, a kernel
  no elementwise fusion can join; a chain of ``Add`` is what every ResNet residual means.
* TVM imports ``Clip`` as two already-lowered ``call_tir`` kernels: ``topi.maximum`` /
  ``topi.minimum`` against the NaN-sanitised bound tensors (opset >= 11), or against the
  ``min``/``max`` attributes as scalars inside the kernel (opset < 11, bounds -inf/+inf when
  absent). They are turned back into ``R.maximum`` / ``R.minimum`` (which legalise to the
  same ``topi`` functions; a scalar bound becomes a scalar ``R.const``), so that patterns
  can see a clip; the PrimFunc is compared structurally with the ``topi`` one before it is
  replaced.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import onnx
import tvm
from tvm import relax

from .. import native_output
from ..errors import LayerfuseError, first_line
from ..topology.graph import TopologyGraph
from ..topology.materialize import materialize_constants
from ..topology.onnx_reader import ModelSource, load_model, read_onnx
from ._ir import rewrite_bindings, with_functions

log = logging.getLogger(__name__)


class UnsupportedOpError(LayerfuseError):
    """TVM's ONNX importer has no converter for an op the model uses."""


class RelaxImportError(LayerfuseError):
    """TVM's ONNX importer failed on the model for another reason."""


def import_onnx(
    model_or_path: Union[ModelSource, onnx.ModelProto],
    *,
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
    canonicalize: bool = True,
) -> tuple[tvm.IRModule, dict[str, np.ndarray], TopologyGraph]:
    """Import an ONNX model: ``(IRModule with weights as parameters, {name: value}, first graph)``.

    ``input_shapes`` overrides graph input shapes (e.g. the batch size). ``canonicalize``
    applies the two rewrites of the module doc (on by default; off gives TVM's raw import).
    """
    if isinstance(model_or_path, onnx.ModelProto):
        model, label = model_or_path, None
    else:
        model, label = load_model(model_or_path), Path(model_or_path).name
    graph = read_onnx(model, input_shapes=input_shapes, name=label)
    _refuse_training_mode(graph)
    if graph.source is not None:  # input shapes fixed, shape arithmetic folded: what the graph describes
        model = graph.source
    prepared = _integer_initializers_as_constants(materialize_constants(model, graph))
    if canonicalize:
        prepared = _sum_to_add(prepared)
    prepared = _resize_empty_scales(prepared)
    shape_dict = {name: [int(d) for d in graph.tensor(name).shape] for name in graph.inputs}
    dtype_dict = {name: graph.tensor(name).dtype or "float32" for name in graph.inputs}
    mod = _from_onnx(prepared, label=graph.name, shape_dict=shape_dict, dtype_dict=dtype_dict)
    if canonicalize:
        mod = te_min_max_to_ops(mod)
    mod, detached = relax.frontend.detach_params(mod)
    main = mod["main"]
    num_input = int(main.attrs["num_input"])
    values = detached.get("main", [])
    weights = main.params[num_input:]
    if len(weights) != len(values):
        raise RelaxImportError(
            f"TVM's importer gave {len(values)} weight values for {len(weights)} weight parameters of "
            f"model {graph.name!r}; expected one each - report this with the model"
        )
    params = {var.name: value.numpy() for var, value in zip(weights, values)}
    log.info("imported %s: %d weight parameters", graph.name, len(params))
    return mod, params, graph


def _refuse_training_mode(graph: TopologyGraph) -> None:
    """TVM's importer computes a training-mode BatchNormalization with the running statistics,
    not the batch's: a wrong answer. Refuse it instead."""
    for layer in graph:
        if layer.op_type == "BatchNormalization" and (
            layer.attrs.get("training_mode", 0) or len(layer.outputs) > 1
        ):
            raise UnsupportedOpError(
                f"BatchNormalization {layer.name!r} of model {graph.name!r} is in training mode (batch statistics); "
                "expected inference mode - export the model in eval mode (model.eval() before torch.onnx.export)"
            )


def _from_onnx(model: onnx.ModelProto, *, label: str, shape_dict: dict, dtype_dict: dict) -> tvm.IRModule:
    """TVM's ``from_onnx``, with the failing node found when it fails (see :func:`_diagnose`).

    TVM's importer prints its own lines (``Error converting operator ...`` on stdout, the
    C++ ``BlockBuilder destroyed with remaining blocks!`` warning on stderr when the
    half-built function is dropped): they go to this module's debug log (``-v``), never
    straight to the terminal."""
    import tvm.relax.frontend.onnx as frontend

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    failure: Optional[_ImportFailure] = None
    with native_output.to_log("TVM's ONNX importer", log):
        importer = frontend.onnx_frontend.ONNXGraphImporter(
            shape_dict, dtype_dict, keep_params_in_input=True, sanitize=True
        )
        try:
            mod = importer.from_onnx(model.graph, opset)
        except Exception as e:  # the importer raises ValueError, TypeError, TVMError ... for what it lacks
            failure = _ImportFailure.of(e, model, converted=set(importer._nodes))
        del importer  # the half-built BlockBuilder logs its warning now, inside the capture
        gc.collect()
    if failure is not None:
        raise failure.error(model, label=label, opset=opset)
    return mod


@dataclass
class _ImportFailure:
    """Where and why TVM's importer stopped (plain data: the exception and the half-built
    importer are dropped before the error is raised)."""

    kind: str  # "no converter" | "converter"
    detail: str  # TVM's own words (last line), e.g. "Reshape requires the input new shape to be Shape ..."
    exc_type: str
    node: Optional[onnx.NodeProto] = None
    index: int = -1

    @classmethod
    def of(cls, e: BaseException, model: onnx.ModelProto, *, converted: set[str]) -> "_ImportFailure":
        detail = first_line(e, last=True)
        nodes = list(model.graph.node)
        if isinstance(e, tvm.error.OpNotImplemented):
            ops = [op.strip() for op in detail.split(":", 1)[-1].split(",")]
            k = next((i for i, n in enumerate(nodes) if n.op_type in ops), -1)
            return cls("no converter", ", ".join(ops), type(e).__name__, nodes[k] if k >= 0 else None, k)
        # the importer converts nodes in order: the first whose outputs it lacks is the one
        k = next((i for i, n in enumerate(nodes) if any(o and o not in converted for o in n.output)), -1)
        return cls("converter", detail, type(e).__name__, nodes[k] if k >= 0 else None, k)

    def error(self, model: onnx.ModelProto, *, label: str, opset: int) -> LayerfuseError:
        node = self.node
        where = f"node {node.name or node.output[0]!r} ({node.op_type}, opset {opset})" if node is not None else "a node"
        ort_fails = _onnxruntime_refusal(model)
        if ort_fails:
            return RelaxImportError(
                f"TVM's ONNX importer failed at {where} of model {label!r} ({self.exc_type}: {self.detail}), "
                f"and onnxruntime refuses the model too ({ort_fails}); expected a model onnxruntime accepts - "
                "fix the export"
            )
        runs = "onnxruntime accepts the model" if ort_fails is not None else "onnxruntime was not checked"
        if self.kind == "no converter":
            op = node.op_type if node is not None else self.detail
            return UnsupportedOpError(
                f"model {label!r} uses ops TVM's ONNX importer does not support ({self.detail}): {where} has no "
                f"converter in TVM {tvm.__version__.split('.post')[0]}; {runs} - replace {op} (another export, "
                "or onnx's function expansion) or report the op to TVM (github.com/apache/tvm/issues)"
            )
        run_time = _run_time_shape_input(model, node) if node is not None else None
        if run_time is not None:
            return RelaxImportError(
                f"TVM's ONNX importer cannot convert {where} of model {label!r}: its input {run_time!r} is "
                f"a run-time value (it depends on input data, not only on input sizes), and TVM needs a constant ({self.detail}); {runs} - "
                f"make {run_time!r} a constant of the model (every input size fixed with --input-shape folds "
                "shape arithmetic, not data) or report the op to TVM (github.com/apache/tvm/issues)"
            )
        return RelaxImportError(
            f"TVM's ONNX importer cannot convert {where} of model {label!r} ({self.exc_type}: {self.detail}); "
            f"{runs}, so this is a limit of TVM's importer - convert the model to another opset "
            "(onnx.version_converter.convert_version(model, 17)), change that node, or report the op to TVM "
            "(github.com/apache/tvm/issues)"
        )


# Inputs that must be compile-time values for TVM: (op type, input index).
_SHAPE_INPUTS = {
    ("Reshape", 1), ("Expand", 1), ("Tile", 1), ("ConstantOfShape", 0), ("Resize", 1), ("Resize", 2),
    ("Resize", 3), ("Upsample", 1), ("Slice", 1), ("Slice", 2), ("Slice", 3), ("Slice", 4), ("Range", 0),
    ("Range", 1), ("Range", 2), ("Pad", 1), ("Squeeze", 1), ("Unsqueeze", 1), ("TopK", 1), ("Split", 1),
}  # fmt: skip


def _run_time_shape_input(model: onnx.ModelProto, node: onnx.NodeProto) -> Optional[str]:
    """The first shape-like input of ``node`` that is neither an initializer nor a Constant's output."""
    constants = {t.name for t in model.graph.initializer}
    constants |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    for k, name in enumerate(node.input):
        if name and (node.op_type, k) in _SHAPE_INPUTS and name not in constants:
            return name
    return None


def _onnxruntime_refusal(model: onnx.ModelProto) -> Optional[str]:
    """None when onnxruntime is not installed, "" when it accepts ``model`` (builds a session:
    every op known, types consistent), else its first error line. (Running it would need
    inputs that are valid data, which a made-up seeded input need not be.)"""
    from ..topology import reference

    if not reference.available():
        return None
    try:
        with native_output.to_log("onnxruntime", log):
            reference.session(model)
    except Exception as e:
        return first_line(e).removeprefix("[ONNXRuntimeError] : ")[:200]
    return ""


# ---------------------------------------------------------------------- ONNX rewrites
def _integer_initializers_as_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Integer and bool initializers (shapes, axes, indices: never weights) become ``Constant``
    nodes, so that TVM's importer sees constants, not parameters.

    With ``keep_params_in_input=True`` every initializer becomes a parameter of ``main``;
    converters that do not look parameters up (``Expand``'s shape, for one) then build a
    data-dependent shape that is not even well formed. Weights to fold are floats and stay
    initializers."""
    ints = [t for t in model.graph.initializer if t.data_type not in _FLOAT_TENSOR_TYPES]
    if not ints:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [t for t in out.graph.initializer if t.data_type in _FLOAT_TENSOR_TYPES]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    constants = [onnx.helper.make_node("Constant", [], [t.name], name=f"{t.name}__constant", value=t) for t in ints]
    nodes = constants + list(out.graph.node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


_FLOAT_TENSOR_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
}


def _sum_to_add(model: onnx.ModelProto) -> onnx.ModelProto:
    """``Sum(a, b, c)`` -> ``Add(Add(a, b), c)`` (same broadcasting, same order of addition);
    ``Sum(a)`` -> ``Identity(a)``."""
    if not any(n.op_type == "Sum" and n.domain in ("", "ai.onnx") for n in model.graph.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    for node in out.graph.node:
        if node.op_type != "Sum" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        inputs = list(node.input)
        name = node.name or node.output[0]
        if len(inputs) == 1:
            nodes.append(onnx.helper.make_node("Identity", inputs, list(node.output), name=name))
            continue
        acc = inputs[0]
        for k, nxt in enumerate(inputs[1:], start=1):
            last = k == len(inputs) - 1
            result = node.output[0] if last else f"{node.output[0]}__sum{k}"
            nodes.append(onnx.helper.make_node("Add", [acc, nxt], [result], name=name if last else f"{name}__sum{k}"))
            acc = result
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _resize_empty_scales(model: onnx.ModelProto) -> onnx.ModelProto:
    """``Resize(x, roi, scales=[], sizes)`` -> ``Resize(x, roi, "", sizes)``: Resize-11 and -12
    must name a ``scales`` input even when ``sizes`` gives the size, and exporters pass an
    empty tensor; TVM's importer takes any named input as given ("Only one of scales and
    sizes can be provided")."""
    empty = {t.name for t in model.graph.initializer if 0 in t.dims}
    empty |= {
        n.output[0]
        for n in model.graph.node
        if n.op_type == "Constant" and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR
        and 0 in n.attribute[0].t.dims
    }  # fmt: skip
    targets = [
        n for n in model.graph.node
        if n.op_type == "Resize" and n.domain in ("", "ai.onnx") and len(n.input) > 3 and n.input[3]
        and n.input[2] in empty
    ]  # fmt: skip
    if not targets:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.op_type == "Resize" and len(node.input) > 3 and node.input[3] and node.input[2] in empty:
            node.input[2] = ""
    return out


# ---------------------------------------------------------------------- Relax rewrites
def te_min_max_to_ops(mod: tvm.IRModule) -> tvm.IRModule:
    """Replace ``call_tir`` of a PrimFunc that *is* ``topi.maximum``/``topi.minimum`` (checked
    structurally for the call's shapes) by ``R.maximum``/``R.minimum``: ``topi.maximum(A, B)``
    of two tensors, or ``topi.maximum(A, c)`` of one tensor and a scalar ``c`` held in the
    kernel (Clip-1/6's attributes), which becomes ``R.maximum(a, R.const(c))``."""
    from tvm.relax.dpl import GlobalVarPattern, is_op, wildcard

    pattern = is_op("relax.call_tir")(GlobalVarPattern(), wildcard())
    replaced = []

    def rewrite(orig: relax.Expr, _m: Any) -> relax.Expr:
        if not isinstance(orig, relax.Call):
            # The matcher also offers a variable bound to a matching call (an output alias
            # ``gv = lv`` after a call_tir); the call itself is offered separately.
            return orig
        gv, args = orig.args[0], orig.args[1]
        func = mod[gv] if gv in mod.get_global_vars() else None
        if not isinstance(func, tvm.tirx.PrimFunc) or not isinstance(args, relax.Tuple):
            return orig
        for name, op in (("maximum", relax.op.maximum), ("minimum", relax.op.minimum)):
            if len(args.fields) == 2 and _is_topi_binary(func, name, *args.fields):
                replaced.append(gv.name_hint)
                return op(*args.fields)
            if len(args.fields) == 1:
                scalar = _topi_scalar_operand(func, name, args.fields[0])
                if scalar is not None:
                    replaced.append(gv.name_hint)
                    return op(args.fields[0], scalar)
        return orig

    updates = {}
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            before = len(replaced)
            new = rewrite_bindings(pattern, rewrite, func)
            if len(replaced) > before:
                updates[gv] = new
    if not updates:
        return mod
    mod = relax.transform.DeadCodeElimination()(with_functions(mod, updates))
    log.debug("call_tir of topi maximum/minimum turned into Relax ops: %s", sorted(set(replaced)))
    return mod


def _is_topi_binary(func: tvm.tirx.PrimFunc, name: str, a: relax.Expr, b: relax.Expr) -> bool:
    from tvm import te, topi

    shapes = [_static_shape(e) for e in (a, b)]
    if any(s is None for s in shapes):
        return False
    A = te.placeholder(shapes[0], str(a.ty.dtype), name="A")
    B = te.placeholder(shapes[1], str(b.ty.dtype), name="B")
    return _same_prim_func(func, te.create_prim_func([A, B, getattr(topi, name)(A, B)]))


def _topi_scalar_operand(func: tvm.tirx.PrimFunc, name: str, a: relax.Expr) -> Optional[relax.Constant]:
    """The scalar ``c`` when ``func`` is ``topi.<name>(A, c)`` for ``a``'s shape and dtype (a
    one-statement kernel ``out[i] = max(A[i], c)``), as a scalar Relax constant; else None."""
    from tvm import s_tir, te, tirx, topi

    shape = _static_shape(a)
    if shape is None:
        return None
    stmt = func.body  # root block -> loops -> the one block -> its store
    while isinstance(stmt, (s_tir.SBlockRealize, s_tir.SBlock, tirx.For)):
        stmt = stmt.block if isinstance(stmt, s_tir.SBlockRealize) else stmt.body
    value = getattr(stmt, "value", None) if isinstance(stmt, tirx.BufferStore) else None
    c = getattr(value, "b", None)
    if not isinstance(c, (tirx.FloatImm, tirx.IntImm)) or str(c.ty) != str(a.ty.dtype):
        return None
    A = te.placeholder(shape, str(a.ty.dtype), name="A")
    if not _same_prim_func(func, te.create_prim_func([A, getattr(topi, name)(A, tirx.const(c.value, str(c.ty)))])):
        return None
    return relax.const(c.value, str(c.ty))


def _static_shape(e: relax.Expr) -> Optional[list]:
    from tvm import tirx

    shape = getattr(getattr(e, "ty", None), "shape", None)
    if not isinstance(shape, relax.ShapeExpr) or not all(isinstance(d, tirx.IntImm) for d in shape.values):
        return None
    return [tirx.IntImm("int64", int(d.value)) for d in shape.values]


def _same_prim_func(func: tvm.tirx.PrimFunc, ref: tvm.tirx.PrimFunc) -> bool:
    import tvm_ffi

    strip = lambda f: f.without_attr("global_symbol") if f.attrs is not None and "global_symbol" in f.attrs else f
    return bool(tvm_ffi.structural_equal(strip(func), strip(ref), map_free_vars=True))
