"""Weights the module owns: every oneDNN conv call gets its weights packed at compile time.

After ``LiftTransformParams`` the weights are final (folded BatchNorm, merged rows) and each
is a parameter of ``main``. A conv call that is the only reader of its weight parameter gets
that parameter replaced by the same weights in the layout its oneDNN primitive picks on this
machine (``OIhw8i8o`` with AVX2, ``OIhw16i16o`` with AVX-512, Winograd's opaque layout where
the layer runs Winograd), asked of the library, which builds the call's primitive exactly as
the call will::

    W [O, C/groups, kh, kw]                         (a weight parameter of main)
    y = conv2d(x, W, b, attrs)
      -> W' [n] = pack(W)                           the bytes of each piece's weights in its
         y = conv2d(x, W', b, attrs')               primitive's layout, one piece after the other
         attrs' = attrs + packed (the layout's identity) + W's dims

(a merged conv's pieces are its output row ranges, each its own primitive). At run time the
library builds the primitive, checks the identity and the size, and uses ``W'`` where it lies:
the module's weights are its only copy. A machine whose oneDNN picks another layout (another
CPU ISA) refuses the call in one line (``onednn_conv.cc``, ``CheckPacked``). oneDNN 2.6 picks
some layouts by the thread count a kernel is made for (AVX-512 Winograd blockings, the loop
order of 1x1 kernels, Winograd 2x3 or 4x3), so a call is packed only where its layout is the
same for every thread count from 1 to 64; the others keep their weights plain, with the
thread count that lays them out otherwise as the reason, and run at any thread count.

Packed: ``conv2d``, ``conv2d_add``, ``conv2d_pre``, the members of ``concat_convs``, the
residual convs in place (``call_tir_inplace`` of a TIR wrapper, which is rebuilt for the new
weight type and attrs) and ``dense`` (the classifier: its matmul's weights layout, the
identity in :class:`.abi.DenseAttrs`). Kept plain, with the reason in the report: a weight
that is no parameter of ``main`` (a constant) or that another expression reads too, or whose
layout depends on the thread count; the
library then keeps one reordered copy of it, as it does for calls made by hand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import tvm
from tvm import relax

from ...relax._ir import op_name, static_shape
from . import abi, onednn
from .onednn_inplace import _call_inplace, _inplace_wrapper
from .onednn_layout import bindings_of, use_counts

log = logging.getLogger(__name__)


@dataclass
class PackReport:
    """What :func:`prepack_weights` did: calls packed, their bytes, and each call kept plain with why."""

    packed: int = 0
    plain_bytes: int = 0  # the packed weights' size as plain tensors
    packed_bytes: int = 0  # and packed (blocked layouts pad channels to the block)
    kept: list = field(default_factory=list)  # (call, reason)
    layouts: list = field(default_factory=list)  # (call, layer id, the layout's identity, packed bytes)

    def to_dict(self) -> dict:
        return {
            "packed_calls": self.packed,
            "plain_bytes": self.plain_bytes,
            "packed_bytes": self.packed_bytes,
            "kept_plain": [{"call": c, "reason": r} for c, r in self.kept],
            "layouts": [{"call": c, "layer": layer, "identity": i, "bytes": n} for c, layer, i, n in self.layouts],
        }


def prepack_weights(mod: tvm.IRModule, weights: Sequence[np.ndarray]) -> tuple[tvm.IRModule, list[np.ndarray], PackReport]:
    """(``mod`` with its oneDNN conv calls reading packed weights, ``main``'s weight values in
    its parameter order - the packed ones in place of theirs -, the report). ``weights``:
    the values of ``main``'s weight parameters (those after ``num_input``), in order."""
    main = mod["main"]
    num_input = int(main.attrs["num_input"])
    params = list(main.params)
    values = dict(zip(params[num_input:], weights))
    if len(values) != len(weights) or len(params) - num_input != len(weights):
        raise ValueError(f"prepack_weights: main has {len(params) - num_input} weight parameters, got {len(weights)} values")
    packer = _Packer(values, use_counts(main))
    chosen: dict = {}  # call -> its rebuilt form (a function of the mutator's visit)
    builder = relax.BlockBuilder(mod)
    old_wrappers = set()
    for b in bindings_of(main):
        v = b.value
        bound = abi.parse_call(v)
        if bound is not None and bound.call in abi.CONVS:
            new = packer.pack(b.var.name, bound, _out_channels(b.var))
            if new is not None:
                chosen[v] = _dps(v, new)
        elif bound is not None and bound.call is abi.CONCAT_CONVS:
            members, changed = [], False
            for m, mb in bound.args.members:
                new = None if m.kind == abi.COPY else packer.pack(b.var.name, mb, [int(static_shape(mb.args.weight)[0])])
                members.append((m, new or mb))
                changed |= new is not None
            if changed:
                args = abi.Args(attrs=bound.args.attrs, members=tuple(members))
                chosen[v] = _dps(v, abi.Bound(bound.call, args, bound.attrs))
        elif bound is not None and bound.call is abi.DENSE:
            new = packer.pack_dense(b.var.name, bound)
            if new is not None:
                chosen[v] = _dps(v, new)
        elif op_name(v) == "relax.call_tir_inplace" and _callee(v).name_hint.startswith(abi.INPLACE_WRAPPER):
            gv, tensors = v.args
            inner = abi.bind(abi.CONV2D_ADD_INPLACE, list(tensors.fields))
            inner = abi.Bound(inner.call, inner.args, inplace_attrs(mod[gv]))
            new = packer.pack(b.var.name, inner, [int(static_shape(inner.args.residual)[1])])
            if new is not None:
                tensors = new.flat()
                wrapper = builder.add_func(_inplace_wrapper(tuple(tuple(static_shape(a)) for a in tensors), new.attrs), abi.INPLACE_WRAPPER)
                chosen[v] = _inplace(wrapper, tensors, b.var.ty)
                old_wrappers.add(gv)
    if not packer.new_params:
        return mod, list(weights), packer.report
    mod = builder.get()
    new_params = [packer.new_params.get(p, (p, None))[0] for p in params]
    body = _Rebuild(chosen).visit_expr(main.body)
    mod["main"] = relax.Function(new_params, body, main.ret_ty, main.is_pure, main.attrs)
    for gv in old_wrappers:  # wrappers no call uses any more
        if not any(_calls(f, gv) for g, f in mod.functions.items() if not g.same_as(gv)):
            del mod[gv]
    out = [packer.new_params[p][1] if p in packer.new_params else values[p] for p in params[num_input:]]
    r = packer.report
    log.info("packed the weights of %d oneDNN conv calls (%d bytes plain, %d packed); %d kept plain",
             r.packed, r.plain_bytes, r.packed_bytes, len(r.kept))
    return mod, out, r


def inplace_attrs(wrapper) -> abi.ConvAttrs:
    """The conv attrs a residual-in-place TIR wrapper (``onednn_inplace._inplace_wrapper``)
    passes: the integer arguments of its one ``call_packed``."""
    found: list = []

    def visit(node) -> None:  # the statements of the wrapper: nested bodies, sequences, Evaluate(call)
        for child in ([node.body] if hasattr(node, "body") else []) + list(getattr(node, "seq", [])):
            visit(child)
        call = getattr(node, "value", None)
        if isinstance(call, tvm.ir.expr.Call) and len(call.args):
            name, *operands = call.args  # call_packed(name, x, w, b, r, attrs...)
            if str(getattr(name, "value", "")) == abi.CONV2D_ADD_INPLACE.name:
                found.append([int(a.value) for a in operands[len(abi.CONV2D_ADD_INPLACE.roles) :]])

    visit(wrapper.body)
    if len(found) != 1:
        raise abi.AbiError(f"a residual-in-place wrapper calls {abi.CONV2D_ADD_INPLACE.name} {len(found)} times, not once")
    return abi.ConvAttrs.from_shape(found[0])


class _Packer:
    def __init__(self, values: dict, uses: dict) -> None:
        self.values = values  # weight parameter -> its value
        self.uses = uses
        self.new_params: dict = {}  # weight parameter -> (packed parameter, packed value)
        self.report = PackReport()

    def _refusal(self, bound: abi.Bound) -> str:
        w = bound.args.weight
        if bound.attrs.packed:
            return "packed already"
        if not isinstance(w, relax.Var) or w not in self.values:
            return "its weight is no weight parameter of main"
        if self.uses.get(w, 0) != 1 or w in self.new_params:
            return f"its weight {w.name} is read by other expressions too"
        return ""

    def _packed(self, name: str, bound: abi.Bound, value: np.ndarray, identity: int, packed: np.ndarray) -> relax.Var:
        w = bound.args.weight
        new = relax.Var(w.name, relax.TensorType([int(packed.size)], "float32"))
        self.new_params[w] = (new, packed)
        self.report.packed += 1
        self.report.plain_bytes += value.nbytes
        self.report.packed_bytes += packed.nbytes
        layer = int(getattr(bound.attrs, "layer", -1))  # dense: -1
        self.report.layouts.append((name, layer, int(identity), int(packed.nbytes)))
        return new

    def pack_dense(self, name: str, bound: abi.Bound) -> Optional[abi.Bound]:
        """A ``dense`` call reading its weights packed, or None (the reason in the report)."""
        why = self._refusal(bound)
        x = static_shape(bound.args.input)
        if not why and (x is None or len(x) != 2):
            why = "its input's shape is not static"
        if why:
            self.report.kept.append((name, why))
            return None
        value = np.asarray(self.values[bound.args.weight], dtype=np.float32)
        try:
            identity, packed = onednn.pack_dense_weights(x[0], value, steady=True)
        except onednn.LayoutVaries as e:
            self.report.kept.append((name, str(e)))
            return None
        new = self._packed(name, bound, value, identity, packed)
        k, m = value.shape
        return bound.replace(weight=new, attrs=abi.DenseAttrs(packed=identity, k=k, m=m))

    def pack(self, name: str, bound: abi.Bound, out_channels: Optional[list]) -> Optional[abi.Bound]:
        """A conv call reading its weights packed, or None (the reason in the report)."""
        w = bound.args.weight
        why = self._refusal(bound)
        if not why and out_channels is None:
            why = "its outputs' shapes are not static"
        if why:
            self.report.kept.append((name, why))
            return None
        value = np.asarray(self.values[w], dtype=np.float32)
        pieces = [static_shape(x) for x in bound.args.inputs]
        x_shape = (pieces[0][0], sum(p[1] for p in pieces), pieces[0][2], pieces[0][3])
        try:
            identity, packed = onednn.pack_weights(
                x_shape, value, bound.attrs, prologue=bound.call is abi.CONV2D_PRE,
                residual=bound.args.residual is not None, out_channels=out_channels, steady=True,
            )
        except onednn.LayoutVaries as e:
            self.report.kept.append((name, str(e)))
            return None
        new = self._packed(name, bound, value, identity, packed)
        return bound.replace(weight=new, attrs=bound.attrs.packed_as(identity, value.shape))


def _out_channels(var: relax.Var) -> Optional[list]:
    """The channels of each output of the call bound to ``var``."""
    ty = var.ty
    types = list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]
    shapes = [static_shape(relax.Var("t", t)) for t in types]
    return None if any(s is None for s in shapes) else [int(s[1]) for s in shapes]


def _callee(call: relax.Call):
    callee, _ = call.args
    return callee


def _dps(call: relax.Call, new: abi.Bound):
    func = _callee(call)
    return lambda visit: relax.Call(call.op, [func, relax.Tuple([visit(a) for a in new.flat()])], call.attrs, call.ty_args)


def _inplace(wrapper, tensors: list, out_ty):
    return lambda visit: _call_inplace(wrapper, [visit(a) for a in tensors], out_ty)


def _calls(func, gv) -> bool:
    if not isinstance(func, relax.Function):
        return False
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(1) if isinstance(e, tvm.ir.GlobalVar) and e.same_as(gv) else None)
    return bool(found)


@relax.expr_functor.mutator
class _Rebuild(relax.PyExprMutator):
    def __init__(self, chosen: dict) -> None:
        super().__init__()
        self.chosen = chosen

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        make = self.chosen.get(call)
        if make is None:
            return super().visit_call_(call)
        return make(self.visit_expr)


__all__ = ["PackReport", "inplace_attrs", "prepack_weights"]
