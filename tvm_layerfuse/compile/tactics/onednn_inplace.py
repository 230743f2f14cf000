"""The oneDNN tactic's in-place writes: conv prologues that read a concat's pieces, convs
that write their channel ranges of a concat, and residual convs that write into their
residual's buffer (steps of :class:`.use_onednn.UseOneDNNConv`, after the layouts).

Prologues read a concat's pieces. A concat read only as the input of pre-activation convs
(DenseNet's dense layers and transitions: ``concat(x_0, y_1, ..., y_k)``, each piece read by
every later layer of the block, so no conv can write it in place) is not materialised: with
``x = concat_i(x_i)`` on channels, ``s = concat_i(s_i)``, ``t = concat_i(t_i)`` (``s_i``, ``t_i``:
the piece's channel range ``[c_i, c_i + C_i)``), per channel::

    conv(relu(concat_i(x_i) * s + t), W)  ==  conv(concat_i(relu(x_i * s_i + t_i)), W)

so ``layerfuse.onednn.conv2d_pre(x_1, ..., x_k, s, t, W, b, attrs)`` normalises each piece
straight into its channel range of the prologue's scratch (which it writes anyway) and runs
the conv on that, as TVM's FuseOps fuses concat + BatchNorm + ReLU into one kernel: the
concat's copies and its buffer are gone (:func:`prologues_read_pieces`). A concat whose
pieces convs make for it alone stays with :func:`concats_in_place` (no copy either, and one
call for all of them); one with any other reader stays a concat.

Concatenation in place (batch 1): a ``layerfuse.onednn.concat`` whose pieces oneDNN convs make
for it alone becomes one ``layerfuse.onednn.concat_convs`` call in which each conv writes its
channel range ``[c, c + C)`` of the block directly (contiguous in NCHW and, with ``c`` and ``C``
multiples of the block width B, in ``nChwBc``); other pieces are copied in (:func:`concats_in_place`).

Residual in place: a ``conv2d_add`` whose residual nothing reads afterwards writes its result
into the residual's buffer (``call_tir_inplace`` of a TIR wrapper, see
:func:`residuals_in_place`): no copy of r per inference.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import tvm
from tvm import relax

from ...relax._ir import is_primitive, op_name, relax_functions, static_shape
from . import abi
from .abi import INPLACE_WRAPPER, LibraryWrites, library_writes
from .onednn_layout import ReplaceCalls, bindings_of, library_calls, use_counts

log = logging.getLogger(__name__)

__all__ = [
    "INPLACE_WRAPPER",
    "LibraryWrites",
    "concats_in_place",
    "library_writes",
    "prologues_read_pieces",
    "residuals_in_place",
]


def _visited(mutator, bound: abi.Bound) -> abi.Bound:
    """``bound`` with every tensor argument visited by ``mutator``."""
    args = bound.args
    roles = {"inputs": tuple(mutator.visit_expr(a) for a in args.inputs)}
    for role in ("scale", "shift", "weight", "bias", "residual"):
        if getattr(args, role) is not None:
            roles[role] = mutator.visit_expr(getattr(args, role))
    if args.members:
        roles["members"] = tuple((m, _visited(mutator, b)) for m, b in args.members)
    return bound.replace(**roles)


# ---------------------------------------------------------------------- prologues read the pieces
def prologues_read_pieces(func: relax.Function, layers: list) -> relax.Function:
    """``layerfuse.onednn.concat(x_1, ..., x_k)`` read only as the input of ``conv2d_pre``
    calls -> those calls read ``x_1, ..., x_k`` and the concat is dead (see the module doc):
    the prologue writes the normalised concatenation into its scratch, piece by piece.

    Left to :func:`concats_in_place` instead: a batch-1 concat whose every piece a oneDNN conv
    makes for it alone (each conv writes its channel range, no copy and one call for all)."""
    bindings = bindings_of(func)
    values = {b.var: b.value for b in bindings}
    uses = use_counts(func)
    calls = library_calls(func)
    readers: dict = {}  # concat var -> [conv2d_pre calls reading it as their input]
    for v, bound in calls.items():
        if bound.call is abi.CONV2D_PRE and len(bound.args.inputs) == 1 and isinstance(bound.args.input, relax.Var):
            readers.setdefault(bound.args.input, []).append(values[v])
    pieces = {}  # conv2d_pre call -> the pieces it reads
    for b in bindings:
        found = calls.get(b.var)
        if found is None or found.call is not abi.CONCAT or uses.get(b.var, 0) != len(readers.get(b.var, [])):
            continue  # not a concat, or read by something other than a prologue (or by the caller)
        items = found.args.inputs
        if static_shape(b.var)[0] == 1 and len(set(items)) == len(items):
            if all(_member(x, values, calls, uses) is not None for x in items):
                continue  # every piece made in place by its conv: concats_in_place's
        for call in readers[b.var]:
            pieces[call] = items
        for c in layers:
            if c.layer == f"concat:{b.var.name}":
                k, n = len(items), len(readers[b.var])
                c.tactic = "read by prologues"
                c.kernel = f"{k} piece{'s' * (k > 1)} normalised into the scratch of {n} conv prologue{'s' * (n > 1)}, no copy"
    return _ReadPieces(pieces).visit_expr(func) if pieces else func


@relax.expr_functor.mutator
class _ReadPieces(relax.PyExprMutator):
    def __init__(self, pieces: dict) -> None:
        super().__init__()
        self.pieces = pieces  # conv2d_pre call -> its input's pieces

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        items = self.pieces.get(call)
        if items is None:
            return super().visit_call_(call)
        bound = abi.parse_call(call).replace(inputs=tuple(items))
        return abi.rebuild(call, _visited(self, bound))


# ---------------------------------------------------------------------- concatenation in place
def _bound_constant(expr, values: dict) -> Optional[np.ndarray]:
    """The value of a constant, or of a variable bound to ``reshape(constant)`` (a bias)."""
    if isinstance(expr, relax.Var) and expr in values and op_name(values[expr]) == "relax.reshape":
        inner, _ = values[expr].args
        inner = _bound_constant(inner, values)
        return None if inner is None else inner.reshape(static_shape(values[expr]))
    if isinstance(expr, tvm.ir.expr.Constant) and hasattr(expr.value, "numpy"):
        return expr.value.numpy()
    return None


def _rows(expr, ranges: list, values: dict) -> relax.Expr:
    """Rows ``ranges`` ([(lo, hi)...], axis 0) of a weight or bias: sliced now when it is a
    constant, else as weight-only Relax ops (computed at compile time by LiftTransformParams)."""
    value = _bound_constant(expr, values)
    if value is not None:
        return relax.const(np.concatenate([value[lo:hi] for lo, hi in ranges]), "float32")
    parts = [relax.op.strided_slice(expr, axes=[0], begin=[lo], end=[hi]) for lo, hi in ranges]
    return parts[0] if len(parts) == 1 else relax.op.concat(parts, axis=0)


def _with_rows(bound: abi.Bound, ranges: list, values: dict, dst_block: int) -> abi.Bound:
    """A conv call restricted to the output rows ``ranges`` (weight and bias rows)."""
    return bound.replace(
        weight=_rows(bound.args.weight, ranges, values),
        bias=_rows(bound.args.bias, ranges, values),
        attrs=bound.attrs.replace(dst_block=dst_block),
    )


def concats_in_place(func: relax.Function, layers: list) -> relax.Function:
    """``layerfuse.onednn.concat`` (batch 1) whose pieces oneDNN convs make, read by nothing
    else -> ``layerfuse.onednn.concat_convs``: each conv writes its channel range of the block
    (a contiguous range, see the module doc), other pieces are copied in; a piece of a merged
    conv leaves that call (its weight and bias rows move to the block's call)."""
    bindings = bindings_of(func)
    values = {b.var: b.value for b in bindings}
    uses = use_counts(func)
    calls = library_calls(func)
    plans = {}  # concat call -> the concat_convs Bound
    taken: dict = {}  # merged conv var -> {piece index absorbed}
    for b in bindings:
        found = calls.get(b.var)
        shape = static_shape(b.var)
        if found is None or found.call is not abi.CONCAT or shape is None or shape[0] != 1:
            continue
        members, offset, blocked, pieces = [], 0, set(), []
        for x in found.args.inputs:
            member = _member(x, values, calls, uses)
            if member is None or (member[2] is not None and member[2] in pieces):
                members.append((offset, abi.copy_member(x)))  # copied (also a piece read twice by this concat)
            else:
                conv, dst_block, piece = member
                blocked.add(dst_block)
                members.append((offset, conv))
                if piece is not None:
                    pieces.append(piece)
            offset += static_shape(x)[1]
        if len(blocked) != 1:
            continue  # no conv member (nothing to gain), or (never) mixed layouts
        for v, j in pieces:
            taken.setdefault(v, set()).add(j)
        plans[b.value] = abi.concat_convs(blocked.pop(), members)
        convs = sum(m.kind != abi.COPY for m in plans[b.value].attrs.members)
        for c in layers:
            if c.layer == f"concat:{b.var.name}":
                c.tactic, c.kernel = "in-place", f"{convs} convs write their channels, {len(members) - convs} copied"
    shrink = {}  # merged conv -> the pieces it keeps (the others are made by a block's call)
    for v, pieces in taken.items():
        out_types = list(v.ty.fields)
        keep = [j for j in range(len(out_types)) if j not in pieces]
        shrink[v] = (keep, _merged_rows(calls[v], out_types, keep, values))
    if not plans:
        return func
    return _InPlace(plans, shrink, values).visit_expr(func)


def _member(x, values: dict, calls: dict, uses: dict):
    """(member call, its output's block width, (merged var, piece) or None) of a concat piece a oneDNN conv
    makes for this concat alone, else None (the piece is copied)."""
    if not isinstance(x, relax.Var) or uses.get(x) != 1:
        return None
    if x in calls:  # a conv with one output
        bound = calls[x]
        if bound.call.member is None or isinstance(x.ty, relax.TupleType):
            return None
        return bound, bound.attrs.dst_block_of(0), None
    value = values.get(x)
    if isinstance(value, relax.TupleGetItem) and value.tuple_value in calls:
        v, j = value.tuple_value, int(value.index)
        bound = calls[v]
        if bound.call.member is None or not bound.call.pieces:
            return None
        lo = sum(static_shape_of(t)[1] for t in list(v.ty.fields)[:j])
        hi = lo + static_shape_of(v.ty.fields[j])[1]
        block = bound.attrs.dst_block_of(j)
        return _with_rows(bound, [(lo, hi)], values, block), block, (v, j)
    return None


def static_shape_of(ty) -> tuple[int, ...]:
    return tuple(int(d) for d in ty.shape.values)


def _merged_rows(bound: abi.Bound, out_types: list, keep: list, values: dict):
    """(the merged conv left with pieces ``keep``, their output types), or None."""
    if not keep:
        return None
    bounds, lo = [], 0
    for t in out_types:
        bounds.append((lo, lo + static_shape_of(t)[1]))
        lo += static_shape_of(t)[1]
    ranges = [bounds[j] for j in keep]
    dst = abi.dst_block([bound.attrs.dst_block_of(j) for j in keep])
    return _with_rows(bound, ranges, values, dst), [out_types[j] for j in keep]


@relax.expr_functor.mutator
class _InPlace(relax.PyExprMutator):
    def __init__(self, plans: dict, shrink: dict, values: dict) -> None:
        super().__init__()
        self.plans = plans
        self.shrink = shrink  # merged conv var -> (kept pieces, (new call, output types) or None)
        self.calls = {values[v]: v for v in shrink}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        plan = self.plans.get(call)
        if plan is not None:
            return _visited(self, plan).expr(relax.TensorType(list(static_shape(call)), "float32"))
        v = self.calls.get(call)
        if v is not None and self.shrink[v][1] is not None:
            bound, out_types = self.shrink[v][1]
            out = out_types if len(out_types) > 1 else out_types[0]  # one piece left: a plain tensor
            return _visited(self, bound).expr(out)
        return super().visit_call_(call)

    def visit_tuple_getitem_(self, op: relax.TupleGetItem) -> relax.Expr:
        old = op.tuple_value
        if old in self.shrink:
            keep, parts = self.shrink[old]
            if parts is not None and len(keep) == 1:
                return self.visit_expr(old)  # the one piece left is the call's result (absorbed ones: dead)
            if int(op.index) in keep:
                return relax.TupleGetItem(self.visit_expr(old), keep.index(int(op.index)))
            return relax.TupleGetItem(self.visit_expr(old), 0)  # an absorbed piece: no reader left (DCE)
        return super().visit_tuple_getitem_(op)


# ---------------------------------------------------------------------- the residual in place
def residuals_in_place(mod: tvm.IRModule, choices: list) -> tvm.IRModule:
    """``conv2d_add(x, W, b, r)`` whose residual ``r`` has no other reader -> the result is
    written into ``r``'s own buffer (the ``sum`` post-op reads each element where it writes
    it: no copy of ``r`` into a fresh destination)::

        y = call_dps_packed("layerfuse.onednn.conv2d_add", (x, W, b, r, attrs), out)
          -> y = call_tir_inplace(wrap, (x, W, b, r), inplace_indices=[r's position], out)
             wrap(x, W, b, r): call_packed("layerfuse.onednn.conv2d_add_inplace", x, W, b, r, *attrs)

    ``call_tir_inplace`` (not ``call_inplace_packed``) because memory planning follows its
    alias: CallTIRRewrite binds ``y = r``, so r's storage stays live while y is, where
    ``StaticPlanBlockMemory`` would free r's storage at a packed call's last use of r and hand
    it to a later tensor while y (the same bytes) is still read.

    Taken when ``r`` is a dataflow tensor that a tactic-library call makes (a fresh buffer,
    never a view of another tensor, a parameter or the result) and this call is its last
    reader: every other reader is a tactic-library call bound before it (those make fresh
    outputs, so no view of ``r`` outlives the call; e.g. a ResNet block's input, read by its
    first conv and then by the residual add). Otherwise the library copies ``r`` into the
    destination first. ``choices`` gets ``(bound variable, "in-place" | why the copy stays)``
    per ``conv2d_add``."""
    wrappers: dict = {}  # (shapes, attrs) -> GlobalVar of the TIR wrapper
    builder = relax.BlockBuilder(mod)  # adds the wrappers (typed GlobalVars) to mod
    rewrites = {}
    for gv, func in relax_functions(mod):
        if is_primitive(func):
            continue
        bindings = bindings_of(func)
        calls = library_calls(func)
        made = {v for v in calls if not isinstance(v.ty, relax.TupleType)}
        readers: dict = {}  # var -> [(binding index, read by a tactic-library call)]
        for i, b in enumerate(bindings):
            for v in relax.analysis.free_vars(b.value):
                readers.setdefault(v, []).append((i, b.var in calls))
        for v in relax.analysis.free_vars(func.body.body):
            readers.setdefault(v, []).append((len(bindings), False))
        chosen = {}
        for i, b in enumerate(bindings):
            bound = calls.get(b.var)
            if bound is None or bound.call is not abi.CONV2D_ADD:
                continue
            args = bound.args
            r = args.residual
            others = [(j, lib) for j, lib in readers.get(r, []) if j != i]
            if not isinstance(r, relax.DataflowVar) or r not in made:
                why = "the residual is not a tensor a tactic-library call makes in this block"
            elif any(a.same_as(r) for a in (args.input, args.weight, args.bias)):
                why = "the conv reads the residual as an operand too"
            elif any(j > i for j, _ in others):
                why = f"the residual {r.name} is read after the conv"
            elif not all(lib for _, lib in others):
                why = f"the residual {r.name} is read by a TVM kernel too"
            else:
                why = ""
            choices.append((b.var.name, why or "in-place"))
            if why:
                continue
            tensors = abi.CONV2D_ADD_INPLACE.flatten(args)
            shapes = tuple(tuple(static_shape(a)) for a in tensors)
            key = (shapes, tuple(bound.attrs.values()))
            if key not in wrappers:
                wrappers[key] = builder.add_func(_inplace_wrapper(shapes, bound.attrs), INPLACE_WRAPPER)
            chosen[b.value] = (wrappers[key], tensors, relax.TensorType(list(static_shape(b.var)), "float32"))
        if chosen:
            rewrites[gv] = chosen
    mod = builder.get()
    for gv, chosen in rewrites.items():
        mod[gv] = ReplaceCalls(chosen, _call_inplace).visit_expr(mod[gv])
    n = sum(c == "in-place" for _, c in choices)
    if choices:
        log.info("residual in place for %d of %d conv+add layers", n, len(choices))
    return mod


_RESIDUAL_AT = abi.CONV2D_ADD_INPLACE.roles.index("residual")  # the argument the result is written into


def _inplace_wrapper(shapes: tuple, attrs: abi.ConvAttrs):
    """The TIR function ``(x, W, b, r)`` that calls the library's in-place conv2d_add (see
    :func:`residuals_in_place`); attrs as integer arguments, fixed per wrapper. Any operand
    may sit at an offset in its storage (``offset_factor=1``: the call passes it on). Parsed
    from text (a decorated function would make TVMScript read this module's source file);
    ``op_pattern`` 8 (opaque): FuseOps never fuses the library call with a neighbour."""
    names = [role[0] for role in abi.CONV2D_ADD_INPLACE.roles]  # i(nput), w(eight), b(ias), r(esidual)
    params = ", ".join(f'{n}: T.Buffer({tuple(s)}, "float32", offset_factor=1)' for n, s in zip(names, shapes))
    ints = ", ".join(f"T.int64({int(a)})" for a in attrs.values())
    source = (
        "@T.prim_func(private=True)\n"
        f"def main({params}):\n"
        '    T.func_attr({"tir.noalias": True, "op_pattern": 8})\n'
        f'    T.call_packed("{abi.CONV2D_ADD_INPLACE.name}", {", ".join(names)}, {ints})\n'
    )
    return tvm.script.from_source(source)


def _call_inplace(gv, args: list, out) -> relax.Expr:
    """``call_tir_inplace`` of a residual wrapper: the result is its residual argument."""
    return relax.op.call_tir_inplace(gv, relax.Tuple(args), inplace_indices=[_RESIDUAL_AT], out_ty=out)
