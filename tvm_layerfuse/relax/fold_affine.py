"""FoldAffineIntoConv2D: fold BatchNorm and per-channel Mul/Add/Sub/Div into the conv2d before them.

Algebra, per output channel ``c`` (NCHW data, OIHW weights ``W: [C_out, C_in/g, kh, kw]``,
bias ``b: [C_out]``, ``b = 0`` when the conv has no bias add)::

    batch_norm(conv2d(x, W) + b)[0] -> conv2d(x, W * s[c]) + ((b - mean) * s + beta)[c]
                                       with s = gamma / sqrt(var + eps)
    (conv2d(x, W) + b) * k          -> conv2d(x, W * k[c]) + (b * k)[c]
    (conv2d(x, W) + b) / k          -> conv2d(x, W / k[c]) + (b / k)[c]
    (conv2d(x, W) + b) + t          -> conv2d(x, W)        + (b + t)[c]
    (conv2d(x, W) + b) - t          -> conv2d(x, W)        + (b - t)[c]

(``scale=False`` drops ``gamma``, ``center=False`` drops ``beta``.) The rules apply
repeatedly, so a whole chain ``conv -> bias -> BN -> Mul -> Add`` (the Caffe2 export style)
becomes one ``conv2d(x, W') + b'``, the form the epilogue fusion and TVM's FuseOps expect.

``W'`` and ``b'`` are Relax *expressions of the weight parameters*: after
``BindParams`` + ``FoldConstant`` each becomes a single constant, computed once at compile
time. A fold is refused (left as it is, with the reason logged and kept in
``pass.refused``) unless:

* the conv2d is NCHW/OIHW/NCHW and floating point, without a wider ``out_dtype``;
* the weight and every folded operand are *compile-time* values (constants, or function
  parameters after ``num_input``; see ``relax.analysis.computable_at_compile_time``);
* each Mul/Add/Sub/Div operand broadcasts per channel: right-aligned to rank 4 it is 1 on
  axes 0, 2, 3 and 1 or ``C_out`` on axis 1; the conv output is the left operand of Sub/Div;
* batch_norm is in inference mode (``training=False``) over axis 1;
* every intermediate value (conv output, bias-add output, batch_norm tuple) is read only by
  the next op of the chain (otherwise the conv would be computed twice).

Usage, in any pipeline (weights must still be parameters, as ``from_onnx(...,
keep_params_in_input=True)`` + ``detach_params`` leave them, or constants)::

    mod = FoldAffineIntoConv2D()(mod)
    mod = relax.transform.BindParams("main", params)(mod)
    mod = relax.transform.FoldConstant()(mod)
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any, Optional

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, is_tuple_get_item, wildcard

from ._ir import (
    FunctionFacts,
    conv2d_layout_reason,
    dtype_of,
    is_primitive,
    numel,
    relax_functions,
    rewrite_bindings,
    static_shape,
    with_functions,
)

log = logging.getLogger(__name__)

_MAX_ROUNDS = 32  # each round folds one more op of every chain; real chains have 1-4

# Relax op -> the name used in reports (and the ONNX op the planner calls it).
AFFINE_OPS = {
    "relax.nn.batch_norm": "BatchNormalization",
    "relax.multiply": "Mul",
    "relax.divide": "Div",
    "relax.add": "Add",
    "relax.subtract": "Sub",
}


class _Patterns:
    """``affine(conv2d(x, W) [+ b], operands...)`` for each affine op, sharing the conv part."""

    def __init__(self) -> None:
        self.data = wildcard()
        self.weight = wildcard()
        self.conv = is_op("relax.nn.conv2d")(self.data, self.weight)
        self.bias = wildcard()
        self.conv_bias = is_op("relax.add")(self.conv, self.bias)
        inner = self.conv_bias | self.conv
        self.operand = wildcard()
        self.binary = {
            op: is_op(op)(inner, self.operand)
            for op in ("relax.multiply", "relax.divide", "relax.add", "relax.subtract")
        }
        self.gamma, self.beta, self.mean, self.var = wildcard(), wildcard(), wildcard(), wildcard()
        self.bn_call = is_op("relax.nn.batch_norm")(inner, self.gamma, self.beta, self.mean, self.var)
        self.bn = is_tuple_get_item(self.bn_call, 0)
        root = self.bn
        for pattern in self.binary.values():
            root = root | pattern
        self.root = root


@tvm.transform.module_pass(opt_level=0, name="FoldAffineIntoConv2D")
class FoldAffineIntoConv2D:
    """Fold BatchNorm and per-channel Mul/Add/Sub/Div into the preceding conv2d (see module doc).

    Parameters
    ----------
    only_weights:
        When given, fold only into convs whose weight is computed from one of these
        parameter names (the fusion plan's choice); others are left alone.

    After the pass runs, ``pass.folded`` lists ``{"op", "conv_weight", "var"}`` for every fold
    and ``pass.refused`` lists ``{"op", "var", "reason"}`` for every chain left alone.
    """

    def __init__(self, *, only_weights: Optional[Collection[str]] = None) -> None:
        self.only_weights = None if only_weights is None else set(only_weights)
        self.folded: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.folded, self.refused = [], []
        refusals: dict[tuple[str, str], dict[str, Any]] = {}
        updates = {}
        for gv, func in relax_functions(mod):
            if is_primitive(func):
                continue
            new = _FoldOneFunction(self.only_weights, self.folded, refusals).run(func)
            if new is not None:
                updates[gv] = new
        mod = with_functions(mod, updates)
        self.refused = list(refusals.values())
        for r in self.refused:
            log.info("not folded: %s %s: %s", r["op"], r["var"], r["reason"])
        log.info("FoldAffineIntoConv2D folded %d op(s), refused %d", len(self.folded), len(self.refused))
        return mod


class _FoldOneFunction:
    """Apply the fold rules to one function until nothing changes."""

    def __init__(self, only_weights, folded: list, refusals: dict) -> None:
        self.p = _Patterns()
        self.only_weights = only_weights
        self.folded = folded
        self.refusals = refusals
        self.facts: Optional[FunctionFacts] = None
        self.changed = False
        self.round_refusals: dict = {}

    def run(self, func: relax.Function) -> Optional[relax.Function]:
        func = relax.analysis.remove_all_unused(func)  # e.g. batch_norm's unused mean/var outputs
        folded_before = len(self.folded)
        for _ in range(_MAX_ROUNDS):
            # Facts are taken once per round; a value created during the round is unknown to
            # them and so never folded (the next round sees it). Only the last round, which
            # changes nothing, has accurate refusals.
            self.facts = FunctionFacts.of(func)
            self.changed = False
            self.round_refusals = {}
            func = rewrite_bindings(self.p.root, self._rewrite, func)
            if not self.changed:
                break
            func = relax.analysis.remove_all_unused(func)
        else:
            log.warning("FoldAffineIntoConv2D stopped after %d rounds", _MAX_ROUNDS)
        self.refusals.update(self.round_refusals)
        return func if len(self.folded) > folded_before else None

    # ------------------------------------------------------------------ one match
    def _rewrite(self, orig: relax.Expr, m: dict) -> relax.Expr:
        p, facts = self.p, self.facts
        if p.bn in m:
            op_name = "relax.nn.batch_norm"
        else:
            op_name = next(op for op, pat in p.binary.items() if pat in m)
        conv = m[p.conv]
        has_bias = p.conv_bias in m
        if op_name == "relax.add" and not has_bias:
            return orig  # conv2d + t is already the canonical "conv + bias" form
        var = facts.bound_var(orig)
        if var is None or facts.bound_var(conv) is None:
            return orig  # a value rewritten earlier this round; the next round sees it bound
        if op_name != "relax.nn.batch_norm" and not facts.is_static(m[p.operand]):
            return orig  # an op between two run-time tensors (a residual add): not affine at all
        reason = self._reason(op_name, orig, m)
        if reason is not None:
            key = (var.name, reason)
            self.round_refusals.setdefault(key, {"op": AFFINE_OPS[op_name], "var": var.name, "reason": reason})
            return orig
        new = self._folded(op_name, m)
        self.folded.append(
            {"op": AFFINE_OPS[op_name], "conv_weight": facts.conv_weight_names(m[p.weight]), "var": var.name}
        )
        log.debug("folded %s %s into conv2d %s", AFFINE_OPS[op_name], var.name, self.folded[-1]["conv_weight"])
        self.changed = True
        return new

    def _reason(self, op_name: str, orig: relax.Expr, m: dict) -> Optional[str]:
        """Why the matched chain cannot fold, or None."""
        p, facts = self.p, self.facts
        conv = m[p.conv]
        reason = conv2d_layout_reason(conv)
        if reason:
            return reason
        weight = m[p.weight]
        if not facts.is_static(weight):
            return "the conv2d weight is a run-time input, not a parameter or constant"
        roots = facts.conv_weight_names(weight)
        if self.only_weights is not None and not (set(roots) & self.only_weights):
            return f"the fusion plan does not fold into the conv with weight {roots}"
        out_shape = static_shape(conv)
        if out_shape is None or len(out_shape) != 4:
            return "the conv2d output shape is not static"
        channels = out_shape[1]
        dtype = dtype_of(conv)
        # Each intermediate value must be read by the next op only.
        chain = [conv]
        if p.conv_bias in m:
            chain.append(m[p.conv_bias])
            reason = self._per_channel_reason(m[p.bias], channels, dtype, what="bias")
            if reason:
                return f"the add after conv2d is not a bias: {reason}"
        if op_name == "relax.nn.batch_norm":
            chain.append(m[p.bn_call])
        for value in chain:
            uses = facts.use_count(value)
            if uses != 1:
                var = facts.bound_var(value)
                return f"{var.name if var is not None else 'an intermediate'} has {uses} readers; folding needs one"
        if op_name == "relax.nn.batch_norm":
            attrs = m[p.bn_call].attrs
            if bool(attrs["training"]):
                return "batch_norm is in training mode"
            if int(attrs["axis"]) not in (1, -3):
                return f"batch_norm normalises axis {int(attrs['axis'])}, not the channel axis 1"
            for name, pat in (("gamma", p.gamma), ("beta", p.beta), ("mean", p.mean), ("var", p.var)):
                operand = m[pat]
                if not facts.is_static(operand):
                    return f"the batch_norm {name} is computed at run time"
                if static_shape(operand) != (channels,) or dtype_of(operand) != dtype:
                    return f"the batch_norm {name} is not a [{channels}] {dtype} vector"
            return None
        # dpl matches add/multiply either way round and subtract/divide only as written,
        # so the conv output is the left operand of Sub and Div here.
        return self._per_channel_reason(m[p.operand], channels, dtype, what=f"{AFFINE_OPS[op_name]} operand")

    def _per_channel_reason(self, expr: relax.Expr, channels: int, dtype: Optional[str], *, what: str) -> Optional[str]:
        if not self.facts.is_static(expr):
            return f"the {what} is computed at run time"
        shape = static_shape(expr)
        if shape is None:
            return f"the {what} has no static shape"
        if dtype_of(expr) != dtype:
            return f"the {what} is {dtype_of(expr)}, the conv output {dtype}"
        if len(shape) > 4:
            return f"the {what} of shape {list(shape)} has rank > 4"
        padded = (1,) * (4 - len(shape)) + tuple(shape)
        if padded[0] != 1 or padded[2] != 1 or padded[3] != 1:
            return f"the {what} of shape {list(shape)} varies along more than the channel axis"
        if padded[1] not in (1, channels):
            return f"the {what} of shape {list(shape)} does not match {channels} channels"
        return None

    # ------------------------------------------------------------------ the algebra
    def _folded(self, op_name: str, m: dict) -> relax.Expr:
        p = self.p
        conv = m[p.conv]
        channels = static_shape(conv)[1]
        dtype = dtype_of(conv)
        bn_attrs = m[p.bn_call].attrs if p.bn_call in m else None
        # dpl hands over the matched *values*; refer to their variables so nothing is recomputed
        m = {pat: _var_or_value(self.facts, value) for pat, value in m.items()}
        weight = m[p.weight]
        bias = _channel_vector(m[p.bias], channels, self.facts) if p.conv_bias in m else None  # [C]
        scale = None  # [C], multiplies W along axis 0
        divide = False
        if op_name == "relax.nn.batch_norm":
            attrs = bn_attrs
            eps = relax.const(float(attrs["epsilon"]), dtype)
            std = relax.op.sqrt(relax.op.add(m[p.var], eps))  # [C]
            scale = relax.op.divide(m[p.gamma], std) if bool(attrs["scale"]) else relax.op.divide(
                relax.const(1.0, dtype), std
            )
            shift = relax.op.subtract(bias, m[p.mean]) if bias is not None else relax.op.negative(m[p.mean])
            bias = relax.op.multiply(shift, scale)
            if bool(attrs["center"]):
                bias = relax.op.add(bias, m[p.beta])
        else:
            k = _channel_vector(m[p.operand], channels, self.facts)  # [C]
            if op_name == "relax.multiply":
                scale = k
                bias = relax.op.multiply(bias, k) if bias is not None else None
            elif op_name == "relax.divide":
                scale, divide = k, True
                bias = relax.op.divide(bias, k) if bias is not None else None
            elif op_name == "relax.add":
                bias = relax.op.add(bias, k) if bias is not None else k
            else:  # subtract
                bias = relax.op.subtract(bias, k) if bias is not None else relax.op.negative(k)
        if scale is not None:
            scale4 = relax.op.reshape(scale, [channels, 1, 1, 1])  # [C_out, 1, 1, 1]
            weight = relax.op.divide(weight, scale4) if divide else relax.op.multiply(weight, scale4)
        out = relax.Call(conv.op, [m[p.data], weight], conv.attrs)  # [N, C_out, H, W]
        if bias is None:
            return out
        return relax.op.add(out, relax.op.reshape(bias, [1, channels, 1, 1]))


def _var_or_value(facts: FunctionFacts, value: relax.Expr) -> relax.Expr:
    var = facts.bound_var(value)
    return value if var is None else var


def _channel_vector(expr: relax.Expr, channels: int, facts: FunctionFacts) -> relax.Expr:
    """A per-channel operand as a ``[C]`` vector (its shape was checked to allow it).

    ``reshape(v, [1, C, 1, 1])`` of a ``[C]`` vector ``v`` (ONNX Conv's bias) gives ``v``."""
    value = facts.var2val.get(expr) if isinstance(expr, relax.Var) else expr  # dpl gives values
    if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.reshape":
        if static_shape(value.args[0]) == (channels,):
            return value.args[0]
    shape = static_shape(expr)
    if shape == (channels,):
        return expr
    if numel(shape) == channels:
        return relax.op.reshape(expr, [channels])
    return relax.op.broadcast_to(relax.op.reshape(expr, [1]), [channels])  # a scalar
