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
from dataclasses import dataclass
from typing import Optional

import numpy as np
import tvm
from tvm import relax

from ...relax._ir import dtype_of, is_primitive, op_name, relax_functions, static_shape
from . import onednn
from .onednn_layout import ReplaceCalls, bindings_of, onednn_call, use_counts

log = logging.getLogger(__name__)


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
    calls = {b.var: onednn_call(b.value) for b in bindings if onednn_call(b.value) is not None}
    readers: dict = {}  # concat var -> [conv2d_pre calls reading it as their input]
    for v, (name, args) in calls.items():
        if name == onednn.FUNCTIONS["conv2d_pre"] and isinstance(args[0], relax.Var):
            readers.setdefault(args[0], []).append(values[v])
    pieces = {}  # conv2d_pre call -> the pieces it reads
    for b in bindings:
        found = calls.get(b.var)
        if found is None or found[0] != onednn.CONCAT or uses.get(b.var, 0) != len(readers.get(b.var, [])):
            continue  # not a concat, or read by something other than a prologue (or by the caller)
        items = found[1]
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
        args = [self.visit_expr(a) for a in [*items, *list(call.args[1].fields)[1:]]]
        return relax.Call(call.op, [call.args[0], relax.Tuple(args)], call.attrs, call.ty_args)


# ---------------------------------------------------------------------- concatenation in place
_KINDS = {onednn.FUNCTIONS["conv2d"]: 1, onednn.FUNCTIONS["conv2d_pre"]: 2, onednn.FUNCTIONS["conv2d_add"]: 3}


@dataclass(frozen=True)
class LibraryWrites:
    """Bytes one library call writes per inference: into its outputs, computed (``computed``)
    or copied (``copied``: a concat's pieces), and into its own scratch (``scratch``: the
    normalised input of a conv prologue)."""

    computed: int
    copied: int
    scratch: int
    residual: int = 0  # the residual a conv2d_add copies into its output before the conv


def _nbytes(expr) -> int:
    shape = static_shape(expr)
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype_of(expr)).itemsize if shape is not None else 0


def library_writes(call) -> Optional[LibraryWrites]:
    """What a ``call_dps_packed`` into this library (or a residual conv in place, see
    :func:`residuals_in_place`) writes (None for any other expression)."""
    if op_name(call) == "relax.call_tir_inplace" and call.args[0].name_hint.startswith(INPLACE_WRAPPER):
        return LibraryWrites(_nbytes(call), 0, 0)
    found = onednn_call(call)
    if found is None:
        return None
    name, args = found
    out = sum(_nbytes(f) for f in call.ty.fields) if isinstance(call.ty, relax.TupleType) else _nbytes(call)
    if name == onednn.FUNCTIONS["conv2d_add"]:
        return LibraryWrites(out, 0, 0, residual=_nbytes(args[3]))
    if name == onednn.CONCAT:
        return LibraryWrites(0, out, 0)
    if name == onednn.FUNCTIONS["conv2d_pre"]:  # the pieces x_1..x_k, normalised
        return LibraryWrites(out, 0, sum(_nbytes(x) for x in args[:-5]))
    if name != onednn.CONCAT_CONVS:
        return LibraryWrites(out, 0, 0)
    spec, rest = [int(v) for v in args[0].values], args[1:]
    copied = scratch = a = 0
    for kind in spec[1::2]:
        if kind == 0:
            copied += _nbytes(rest[a])
            a += 1
        elif kind == 2:  # up to its attrs, the first shape
            end = next(i for i in range(a, len(rest)) if isinstance(rest[i], relax.ShapeExpr))
            scratch += sum(_nbytes(x) for x in rest[a : end - 4])
            a = end + 1
        else:
            a += 4 if kind == 1 else 5
    return LibraryWrites(out - copied, copied, scratch)


def _weight_at(kind: int, args: list) -> int:
    """Where the weight is among a conv call's arguments: (x, w, b, attrs), (x_1, ..., x_k, s,
    t, w, b, attrs), (x, w, b, r, attrs)."""
    return 1 if kind == 3 else len(args) - 3


def _bound_constant(expr, values: dict) -> Optional[np.ndarray]:
    """The value of a constant, or of a variable bound to ``reshape(constant)`` (a bias)."""
    if isinstance(expr, relax.Var) and expr in values and op_name(values[expr]) == "relax.reshape":
        inner = _bound_constant(values[expr].args[0], values)
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


def concats_in_place(func: relax.Function, layers: list) -> relax.Function:
    """``layerfuse.onednn.concat`` (batch 1) whose pieces oneDNN convs make, read by nothing
    else -> ``layerfuse.onednn.concat_convs``: each conv writes its channel range of the block
    (a contiguous range, see the module doc), other pieces are copied in; a piece of a merged
    conv leaves that call (its weight and bias rows move to the block's call)."""
    bindings = bindings_of(func)
    values = {b.var: b.value for b in bindings}
    uses = use_counts(func)
    calls = {b.var: onednn_call(b.value) for b in bindings if onednn_call(b.value) is not None}
    plans = {}  # concat call -> (spec, member arguments)
    taken: dict = {}  # merged conv var -> {piece index absorbed}
    for b in bindings:
        found = calls.get(b.var)
        shape = static_shape(b.var)
        if found is None or found[0] != onednn.CONCAT or shape is None or shape[0] != 1:
            continue
        members, offset, blocked, pieces = [], 0, set(), []
        for x in found[1]:
            member = _member(x, values, calls, uses)
            if member is None or (member[3] is not None and member[3] in pieces):
                members.append((0, offset, [x]))  # copied (also a piece read twice by this concat)
            else:
                kind, args, dst_blocked, piece = member
                blocked.add(dst_blocked)
                members.append((kind, offset, args))
                if piece is not None:
                    pieces.append(piece)
            offset += static_shape(x)[1]
        if len(blocked) != 1:
            continue  # no conv member (nothing to gain), or (never) mixed layouts
        for v, j in pieces:
            taken.setdefault(v, set()).add(j)
        spec = [blocked.pop()]
        for kind, off, _ in members:
            spec += [kind, off]
        plans[b.value] = (spec, [a for _, _, args in members for a in args])
        convs = sum(kind != 0 for kind, _, _ in members)
        for c in layers:
            if c.layer == f"concat:{b.var.name}":
                c.tactic, c.kernel = "in-place", f"{convs} convs write their channels, {len(members) - convs} copied"
    shrink = {}  # merged conv -> the pieces it keeps (the others are made by a block's call)
    for v, pieces in taken.items():
        name, args = calls[v]
        out_types = list(v.ty.fields)
        keep = [j for j in range(len(out_types)) if j not in pieces]
        shrink[v] = (keep, _merged_rows(name, args, out_types, keep, values))
    if not plans:
        return func
    return _InPlace(plans, shrink, values).visit_expr(func)


def _member(x, values: dict, calls: dict, uses: dict):
    """(kind, call arguments, dst blocked, (merged var, piece) or None) of a concat piece a
    oneDNN conv makes for this concat alone, else None (the piece is copied)."""
    if not isinstance(x, relax.Var) or uses.get(x) != 1:
        return None
    if x in calls:  # a conv with one output
        name, args = calls[x]
        if name not in _KINDS or isinstance(x.ty, relax.TupleType):
            return None
        attrs = [int(a) for a in args[-1].values]
        return _KINDS[name], args, onednn.dst_block_of(attrs[11], 0), None
    value = values.get(x)
    if isinstance(value, relax.TupleGetItem) and value.tuple_value in calls:
        v, j = value.tuple_value, int(value.index)
        name, args = calls[v]
        if name not in _KINDS or name == onednn.FUNCTIONS["conv2d_add"]:
            return None
        kind = _KINDS[name]
        lo = sum(static_shape_of(t)[1] for t in list(v.ty.fields)[:j])
        hi = lo + static_shape_of(v.ty.fields[j])[1]
        attrs = [int(a) for a in args[-1].values]
        blocked = onednn.dst_block_of(attrs[11], j)
        attrs[11] = blocked
        w_at = _weight_at(kind, args)
        member = list(args)
        member[w_at] = _rows(args[w_at], [(lo, hi)], values)
        member[w_at + 1] = _rows(args[w_at + 1], [(lo, hi)], values)
        member[-1] = relax.ShapeExpr(attrs)
        return kind, member, blocked, (v, j)
    return None


def static_shape_of(ty) -> tuple[int, ...]:
    return tuple(int(d) for d in ty.shape.values)


def _merged_rows(name: str, args: list, out_types: list, keep: list, values: dict):
    """(function name, arguments, output types) of a merged conv left with pieces ``keep``, or None."""
    if not keep:
        return None
    bounds, lo = [], 0
    for t in out_types:
        bounds.append((lo, lo + static_shape_of(t)[1]))
        lo += static_shape_of(t)[1]
    ranges = [bounds[j] for j in keep]
    w_at = _weight_at(_KINDS[name], args)
    new = list(args)
    new[w_at] = _rows(args[w_at], ranges, values)
    new[w_at + 1] = _rows(args[w_at + 1], ranges, values)
    attrs = [int(a) for a in args[-1].values]
    attrs[11] = onednn.dst_block([onednn.dst_block_of(attrs[11], j) for j in keep])
    new[-1] = relax.ShapeExpr(attrs)
    return name, new, [out_types[j] for j in keep]


@relax.expr_functor.mutator
class _InPlace(relax.PyExprMutator):
    def __init__(self, plans: dict, shrink: dict, values: dict) -> None:
        super().__init__()
        self.plans = plans
        self.shrink = shrink  # merged conv var -> (kept pieces, new call parts or None)
        self.calls = {values[v]: v for v in shrink}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        plan = self.plans.get(call)
        if plan is not None:
            spec, args = plan
            args = [relax.ShapeExpr(spec)] + [self.visit_expr(a) for a in args]
            return relax.call_dps_packed(onednn.CONCAT_CONVS, args, relax.TensorType(list(static_shape(call)), "float32"))
        v = self.calls.get(call)
        if v is not None and self.shrink[v][1] is not None:
            name, args, out_types = self.shrink[v][1]
            out = out_types if len(out_types) > 1 else out_types[0]  # one piece left: a plain tensor
            return relax.call_dps_packed(name, [self.visit_expr(a) for a in args], out)
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
INPLACE_WRAPPER = "layerfuse_onednn_conv2d_add_inplace"  # the TIR wrappers' names (a number may follow)


def residuals_in_place(mod: tvm.IRModule, choices: list) -> tvm.IRModule:
    """``conv2d_add(x, W, b, r)`` whose residual ``r`` has no other reader -> the result is
    written into ``r``'s own buffer (the ``sum`` post-op reads each element where it writes
    it: no copy of ``r`` into a fresh destination)::

        y = call_dps_packed("layerfuse.onednn.conv2d_add", (x, W, b, r, attrs), out)
          -> y = call_tir_inplace(wrap, (x, W, b, r), inplace_indices=[3], out)
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
        made = {b.var for b in bindings if onednn_call(b.value) is not None and not isinstance(b.var.ty, relax.TupleType)}
        readers: dict = {}  # var -> [(binding index, read by a tactic-library call)]
        for i, b in enumerate(bindings):
            for v in relax.analysis.free_vars(b.value):
                readers.setdefault(v, []).append((i, onednn_call(b.value) is not None))
        for v in relax.analysis.free_vars(func.body.body):
            readers.setdefault(v, []).append((len(bindings), False))
        chosen = {}
        for i, b in enumerate(bindings):
            found = onednn_call(b.value)
            if found is None or found[0] != onednn.FUNCTIONS["conv2d_add"]:
                continue
            args = found[1]
            r = args[3]
            others = [(j, lib) for j, lib in readers.get(r, []) if j != i]
            if not isinstance(r, relax.DataflowVar) or r not in made:
                why = "the residual is not a tensor a tactic-library call makes in this block"
            elif any(a.same_as(r) for a in args[:3]):
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
            shapes = tuple(tuple(static_shape(a)) for a in args[:4])
            attrs = tuple(int(a) for a in args[4].values)
            key = (shapes, attrs)
            if key not in wrappers:
                wrappers[key] = builder.add_func(_inplace_wrapper(shapes, attrs), INPLACE_WRAPPER)
            chosen[b.value] = (wrappers[key], args[:4], relax.TensorType(list(static_shape(b.var)), "float32"))
        if chosen:
            rewrites[gv] = chosen
    mod = builder.get()
    for gv, chosen in rewrites.items():
        mod[gv] = ReplaceCalls(chosen, _call_inplace).visit_expr(mod[gv])
    n = sum(c == "in-place" for _, c in choices)
    if choices:
        log.info("residual in place for %d of %d conv+add layers", n, len(choices))
    return mod


def _inplace_wrapper(shapes: tuple, attrs: tuple):
    """The TIR function ``(x, W, b, r)`` that calls the library's in-place conv2d_add (see
    :func:`residuals_in_place`); attrs as integer arguments, fixed per wrapper. Any operand
    may sit at an offset in its storage (``offset_factor=1``: the call passes it on). Parsed
    from text (a decorated function would make TVMScript read this module's source file);
    ``op_pattern`` 8 (opaque): FuseOps never fuses the library call with a neighbour."""
    params = ", ".join(f'{n}: T.Buffer({tuple(s)}, "float32", offset_factor=1)' for n, s in zip("xwbr", shapes))
    ints = ", ".join(f"T.int64({int(a)})" for a in attrs)
    source = (
        "@T.prim_func(private=True)\n"
        f"def main({params}):\n"
        '    T.func_attr({"tir.noalias": True, "op_pattern": 8})\n'
        f'    T.call_packed("{onednn.CONV2D_ADD_INPLACE}", x, w, b, r, {ints})\n'
    )
    return tvm.script.from_source(source)


def _call_inplace(gv, args: list, out) -> relax.Expr:
    """``call_tir_inplace`` of a residual wrapper: the result is its argument 3, r."""
    return relax.op.call_tir_inplace(gv, relax.Tuple(args), inplace_indices=[3], out_ty=out)
