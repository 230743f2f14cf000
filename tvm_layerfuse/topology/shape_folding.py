"""Fold static shape arithmetic into constants before import, with onnxscript's optimizer.

Exporters (Paddle2ONNX, tf2onnx, the TorchScript exporter with ``dynamic_axes``, YOLO's
own export) compute Reshape/Resize/Expand/Slice targets at run time even when every input
size is fixed::

    Shape(x) -> Gather(0) -> Unsqueeze -> Concat([n, -1]) -> Reshape(x, ·)

Once the graph inputs have static shapes, ``Shape(x)`` is a constant, and so is everything
computed only from shapes and constants. onnxscript's optimizer
(``onnxscript.optimizer.fold_constants`` with ONNX shape inference, then
``remove_unused_nodes``) replaces those chains by constants; TVM's importer then sees
plain constant targets. Folding is limited to the *shape subgraph*: the nodes that do not
depend on input data (only on input sizes and constants) and that either read a shape
(the ``Shape``/``Size`` nodes and everything computed from their results) or compute a
shape argument of another node (a Reshape/Expand/Tile target, Resize sizes and scales,
Slice bounds, Squeeze/Unsqueeze axes ...), as Paddle2ONNX writes them: int32
``fill_constant`` s cast to int64 one by one. The rest of the graph - conv weights,
BatchNorms, ``Identity`` nodes - is left exactly as exported, so the fusion plan sees
the layers and names the exporter wrote (``optimize``'s rewrite rules would already fold
BatchNorms into convs, under new names). Folding repeats while it makes progress: a
``Shape`` of a tensor whose size only a folded target fixes folds in the next round.

The folded model is checked against the original in onnxruntime (CPU, graph
optimisations off) on seeded inputs; a difference beyond float rounding is an error, never
a silent change. A ``Shape`` that survives (it depends on data, e.g. after ``NonZero``) is
left for the importer, whose error names the node.

Only models that hold ``Shape``/``Size`` ops or computed shape arguments are touched: a
model without shape arithmetic reaches the importer byte for byte as it was.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np
import onnx
from onnx import helper

from ..errors import GraphError, first_line
from . import reference

log = logging.getLogger(__name__)

# Ops whose output is a tensor's shape: the roots of every shape computation.
SHAPE_OPS = ("Shape", "Size")
# Inputs (by position) that are shapes, sizes, axes or bounds rather than data.
_REDUCE_AXES = {op: (1,) for op in (
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
)}  # fmt: skip
SHAPE_ARGUMENTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "Resize": (1, 2, 3),
    "Upsample": (1,),
    "Slice": (1, 2, 3, 4),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "Pad": (1, 2, 3),
    "ConstantOfShape": (0,),
    "Range": (0, 1, 2),
    "TopK": (1,),
    "Split": (1,),
    "OneHot": (1,),
    "CumSum": (1,),
    **_REDUCE_AXES,
}
# Rounds of folding at most (each one can fix the sizes the next one folds).
MAX_ROUNDS = 4
# Relative tolerance between the original and the folded model in onnxruntime: shape
# folding changes no float arithmetic; the optimizer's other rules may reassociate a constant.
CHECK_RTOL = 1e-5


@dataclass
class ShapeFolding:
    """What :func:`fold_static_shapes` did to a model (JSON-ready with :meth:`to_dict`)."""

    nodes_before: int
    nodes_after: int
    removed: dict[str, int] = field(default_factory=dict)  # op type -> nodes folded away
    targets: list[str] = field(default_factory=list)  # nodes whose shape input became a constant
    remaining: list[str] = field(default_factory=list)  # Shape/Size nodes that could not be folded
    checked: bool = False  # compared with the original in onnxruntime
    max_abs_diff: Optional[float] = None
    not_checked_because: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        ops = ", ".join(f"{op} {n}" for op, n in sorted(self.removed.items(), key=lambda kv: (-kv[1], kv[0])))
        folded = sum(self.removed.values())
        text = f"shape arithmetic folded before import: {folded} node(s) ({ops})"
        if self.targets:
            shown = ", ".join(repr(t) for t in self.targets[:4]) + (" ..." if len(self.targets) > 4 else "")
            text += f", constant shape inputs of {shown}"
        if self.checked:
            text += f"; equal to the original in onnxruntime (max |diff| {self.max_abs_diff:.3g})"
        elif self.not_checked_because:
            text += f"; not checked in onnxruntime ({self.not_checked_because})"
        if self.remaining:
            text += f"; still computed at run time: {', '.join(repr(r) for r in self.remaining[:3])}"
        return text


def has_shape_arithmetic(model: onnx.ModelProto) -> bool:
    """Whether the main graph computes shapes: a ``Shape``/``Size`` node, or a shape argument
    (see :data:`SHAPE_ARGUMENTS`) computed by a node from constants."""
    if any(_is_shape_op(n) for n in model.graph.node):
        return True
    data = _data_values(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        for name in _shape_arguments(node):
            src = producer.get(name)
            if src is not None and src.op_type != "Constant" and name not in data:
                return True
    return False


def fold_static_shapes(
    model: onnx.ModelProto, *, label: str, check: bool = True, seed: int = 0
) -> tuple[onnx.ModelProto, Optional[ShapeFolding]]:
    """``(model with shape arithmetic folded, what was folded)``; ``(model, None)`` when it
    has none. Every graph input of ``model`` must already have a static shape.

    Raises :class:`~tvm_layerfuse.errors.GraphError` when the folded model computes a
    different result than the original in onnxruntime."""
    if not has_shape_arithmetic(model):
        return model, None
    try:
        folded = _fold_shape_cone(model)
    except Exception as e:  # the optimizer is a library: a failure there leaves the model as it was
        log.warning("model %s: folding its shape arithmetic failed (%s); importing it unfolded", label, first_line(e))
        return model, None
    report = _describe(model, folded, _shape_cone(model) | _shape_subgraph(model))
    if check:
        _check_against_original(model, folded, report, label=label, seed=seed)
    log.info("model %s: %s", label, report.summary())
    return folded, report


def _fold_shape_cone(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxscript's constant folding (with shape inference), restricted to the shape
    subgraph, repeated while a round folds a ``Shape``/``Size`` node or shape argument."""
    import onnxscript.optimizer
    from onnxscript import ir

    for _ in range(MAX_ROUNDS):
        cone, fold = _shape_cone(model), _shape_subgraph(model)
        model_ir = ir.serde.deserialize_model(model)

        def should_fold(node) -> Optional[bool]:
            outs = [o.name for o in node.outputs]
            if any(o in fold for o in outs):
                return True
            return None if any(o in cone for o in outs) else False

        onnxscript.optimizer.fold_constants(model_ir, onnx_shape_inference=True, should_fold=should_fold)
        onnxscript.optimizer.remove_unused_nodes(model_ir)
        folded = ir.serde.serialize_model(model_ir)
        if _progress(folded) == _progress(model):
            return folded
        model = folded
    return model


def _progress(model: onnx.ModelProto) -> tuple[int, int]:
    """What is left to fold: Shape/Size nodes, and computed shape arguments."""
    producer = {o: n for n in model.graph.node for o in n.output}
    computed = sum(
        1
        for n in model.graph.node
        for a in _shape_arguments(n)
        if a in producer and producer[a].op_type != "Constant"
    )
    return sum(1 for n in model.graph.node if _is_shape_op(n)), computed


def _is_shape_op(node: onnx.NodeProto) -> bool:
    return node.op_type in SHAPE_OPS and node.domain in ("", "ai.onnx")


def _shape_arguments(node: onnx.NodeProto) -> list[str]:
    if node.domain not in ("", "ai.onnx"):
        return []
    slots = SHAPE_ARGUMENTS.get(node.op_type, ())
    return [node.input[k] for k in slots if k < len(node.input) and node.input[k]]


def _data_values(model: onnx.ModelProto) -> set[str]:
    """Values that depend on input data (not only on input sizes and constants)."""
    inits = {t.name for t in model.graph.initializer}
    data = {vi.name for vi in model.graph.input if vi.name not in inits}
    for node in model.graph.node:  # topological order (the reader sorted it)
        if _is_shape_op(node):
            continue
        if node.op_type in _RUNTIME_OPS or any(i in data for i in node.input):
            data.update(o for o in node.output if o)
    return data


# Ops whose result is not a function of its inputs' values alone.
_RUNTIME_OPS = ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli")


def _shape_subgraph(model: onnx.ModelProto) -> set[str]:
    """Output names of the nodes that compute shapes without reading data: those read by
    the shape cone or by a shape argument, transitively upwards, through data-free nodes."""
    data = _data_values(model)
    cone = _shape_cone(model)
    wanted: set[str] = set()
    for node in model.graph.node:
        wanted.update(_shape_arguments(node))
        if any(o in cone for o in node.output):
            wanted.update(i for i in node.input if i)
    fold: set[str] = set()
    for node in reversed(model.graph.node):
        outs = [o for o in node.output if o]
        if node.op_type == "Constant" or any(o in data for o in outs) or not any(o in wanted for o in outs):
            continue
        fold.update(outs)
        wanted.update(i for i in node.input if i)
    return fold


def _shape_cone(model: onnx.ModelProto) -> set[str]:
    """Output names of the Shape/Size nodes and of every node that reads one, transitively."""
    cone: set[str] = set()
    for node in model.graph.node:  # topological order (the reader sorted it)
        if _is_shape_op(node) or any(i in cone for i in node.input):
            cone.update(o for o in node.output if o)
    return cone


def _describe(before: onnx.ModelProto, after: onnx.ModelProto, cone: set[str]) -> ShapeFolding:
    kept = {n.name for n in after.graph.node if n.name}
    kept_outputs = {o for n in after.graph.node for o in n.output}
    # the cone's nodes and the Constant nodes they read (Identity nodes on weights that
    # the folding also drops are no shape arithmetic)
    read_by_cone = {i for n in before.graph.node if set(n.output) & cone for i in n.input}
    removed = Counter(
        n.op_type
        for n in before.graph.node
        if not (n.name and n.name in kept)
        and not set(n.output) & kept_outputs
        and (set(n.output) & cone or (n.op_type == "Constant" and set(n.output) & read_by_cone))
    )
    computed_before = {o for n in before.graph.node for o in n.output}
    constants_after = {t.name for t in after.graph.initializer} | {
        n.output[0] for n in after.graph.node if n.op_type == "Constant"
    }
    targets = []
    for n in after.graph.node:
        # an input that a node computed before and that is a constant now: a folded target
        if any(i in computed_before and i in constants_after for i in n.input[1:]):
            targets.append(n.name or n.output[0])
    remaining = [n.name or n.output[0] for n in after.graph.node if _is_shape_op(n)]
    return ShapeFolding(
        nodes_before=len(before.graph.node),
        nodes_after=len(after.graph.node),
        removed=dict(removed),
        targets=targets,
        remaining=remaining,
    )


def _check_against_original(
    original: onnx.ModelProto, folded: onnx.ModelProto, report: ShapeFolding, *, label: str, seed: int
) -> None:
    if not reference.available():
        report.not_checked_because = "onnxruntime is not installed"
        return
    run_onnxruntime = reference.run_onnxruntime

    feeds = seeded_feeds(original, seed=seed)
    try:
        expected = run_onnxruntime(original, feeds)
    except Exception as e:  # the importer's error will say more if the model is broken
        report.not_checked_because = f"onnxruntime cannot run the original: {first_line(e)}"
        return
    try:
        got = run_onnxruntime(folded, feeds)
    except Exception as e:
        raise GraphError(
            f"folding the shape arithmetic of model {label!r} gave a model onnxruntime cannot run "
            f"({first_line(e)}); expected an equivalent model - report the model"
        ) from None
    worst = 0.0
    for out, a, b in zip(original.graph.output, expected, got):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            raise GraphError(
                f"folding the shape arithmetic of model {label!r} changed the shape of output {out.name!r} "
                f"from {list(a.shape)} to {list(b.shape)}; expected the same outputs - report the model"
            )
        if a.size == 0 or not np.issubdtype(a.dtype, np.number):
            if not np.array_equal(a, b):
                raise GraphError(
                    f"folding the shape arithmetic of model {label!r} changed output {out.name!r}; "
                    "expected the same outputs - report the model"
                )
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        diff = float(np.nanmax(np.abs(a64 - b64))) if a.size else 0.0
        scale = max(1.0, float(np.nanmax(np.abs(a64))))
        if diff > CHECK_RTOL * scale or not np.array_equal(np.isnan(a64), np.isnan(b64)):
            raise GraphError(
                f"folding the shape arithmetic of model {label!r} changed output {out.name!r} by {diff:.3g} "
                f"(onnxruntime, seeded inputs); expected at most {CHECK_RTOL:g} relative - report the model"
            )
        worst = max(worst, diff)
    report.checked = True
    report.max_abs_diff = worst


def seeded_feeds(model: onnx.ModelProto, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input of a model with static input shapes: standard
    normal floats, small non-negative integers, random booleans."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value for d in tt.shape.dim]
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        if np.issubdtype(dtype, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[vi.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[vi.name] = rng.integers(0, 4, shape).astype(dtype)
    return feeds
