"""FuseConv2DPrologue: an inference BatchNorm + ReLU in front of a conv2d becomes its prologue.

The pre-activation form (DenseNet, ResNet-v2; the plan's ``vertical.preactivation``
groups)::

    z = relu(batch_norm(x, gamma, beta, mean, var, eps)[0])      # [N, C, H, W]
    y = conv2d(z, W) [+ b] [+ r] [act]                           # a conv or an epilogue group

is one kernel that reads ``x`` and normalises on the fly::

    y = conv2d(relu(x * s + t), W) ...       s[c] = gamma[c] / sqrt(var[c] + eps)
                                             t[c] = beta[c] - mean[c] * s[c]

``s`` and ``t`` (``[1, C, 1, 1]``) are computed in the caller from the weights alone, so
binding the weights turns each into one constant. The group is a private Relax function
``{"Composite": "layerfuse_bn_relu_conv2d...", "Primitive": True}`` taking ``(x, s, t,
<the conv group's other operands>)``; ``LegalizeOps`` + ``FuseTIR`` make it one PrimFunc,
and :class:`tvm_layerfuse.lowering.InlinePrologue` inlines the normalisation into the
conv's padding stage, so the normalised tensor is never written: a DenseNet dense layer
reads its concatenated features (a view of the block, see
:mod:`tvm_layerfuse.lowering.inplace_concat`) and writes only its own output.

Run after :class:`.fuse_epilogue.FuseConv2DEpilogue` (the conv may already sit inside an
epilogue group, whose body is copied into the new function after the prologue). A
candidate is left to TVM's ``FuseOps`` (reason in ``pass.refused``) when the normalised or
activated value has another reader, the BatchNorm is in training mode, is not on the
channel axis of a 4-D tensor, or has run-time statistics, or the plan (``plan_convs``)
gives that conv no prologue.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import tvm
from tvm import relax

from ._ir import (
    FunctionFacts,
    SubstituteVars,
    is_primitive,
    op_name,
    relax_functions,
    static_shape,
    weight_param,
)
from .fuse_epilogue import PREFIX

log = logging.getLogger(__name__)

PROLOGUE_PREFIX = "layerfuse_bn_relu_"


def _op(value) -> str:
    return op_name(value) or ""




@tvm.transform.module_pass(opt_level=0, name="FuseConv2DPrologue")
class FuseConv2DPrologue:
    """Make BatchNorm + ReLU the prologue of the conv2d it feeds (see the module doc).

    Parameters
    ----------
    plan_convs:
        Conv weight parameter names that the fusion plan gives a BatchNorm + ReLU prologue;
        None merges every match.

    After a run ``pass.groups`` lists ``{"function", "conv_weight", "input", "absorbs"}`` per
    group (``absorbs``: the epilogue group function it took in, or None for a bare conv2d)
    and ``pass.refused`` lists ``{"var", "reason"}``.
    """

    def __init__(self, *, plan_convs: Optional[set[str]] = None) -> None:
        self.plan_convs = None if plan_convs is None else set(plan_convs)
        self.groups: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.groups, self.refused = [], []
        bb = relax.BlockBuilder(mod)
        changed = False
        for gv, func in relax_functions(mod):
            if is_primitive(func) or not isinstance(func.body, relax.SeqExpr):
                continue
            new = self._rewrite(func, mod, bb)
            if new is not None:
                bb.update_func(gv, new)
                changed = True
        if not changed:
            return mod
        out = relax.transform.DeadCodeElimination()(bb.get())
        log.info("FuseConv2DPrologue made %d group(s)", len(self.groups))
        return out

    # ------------------------------------------------------------------ matching
    def _match(self, var, value, facts: FunctionFacts, mod) -> Optional[dict]:
        """The prologue in front of the conv bound to ``var``, or None (refusals recorded)."""
        if _op(value) == "relax.nn.conv2d":
            data, weight, callee = value.args[0], value.args[1], None
        elif isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar):
            callee = mod[value.op]
            composite = str((callee.attrs or {}).get("Composite", "")) if isinstance(callee, relax.Function) else ""
            if not composite.startswith(PREFIX):  # not an epilogue group
                return None
            conv = conv_of(callee)
            if conv is None or not conv.args[0].same_as(callee.params[0]):
                return None
            data = value.args[0]
            k = next((i for i, p in enumerate(callee.params) if p.same_as(conv.args[1])), None)
            weight = value.args[k] if k is not None else None
        else:
            return None
        act = facts.var2val.get(data) if isinstance(data, relax.Var) else None
        if _op(act) != "relax.nn.relu":
            return None
        item = facts.var2val.get(act.args[0]) if isinstance(act.args[0], relax.Var) else None
        if not isinstance(item, relax.TupleGetItem) or int(item.index) != 0:
            return None
        bn = facts.var2val.get(item.tuple_value) if isinstance(item.tuple_value, relax.Var) else None
        if _op(bn) != "relax.nn.batch_norm":
            return None
        weights = facts.conv_weight_names(weight) if weight is not None else []
        reason = self._reason(data, act, item, bn, facts, weights)
        if reason is not None:
            self.refused.append({"var": var.name, "reason": reason})
            log.info("no prologue for %s: %s", var.name, reason)
            return None
        return {"data": data, "bn": bn, "callee": callee, "call": value, "weights": weights}

    def _reason(self, data, act, item, bn, facts: FunctionFacts, weights) -> Optional[str]:
        x = bn.args[0]
        shape = static_shape(x)
        attrs = bn.attrs
        if bool(attrs.training):
            return "the BatchNorm is in training mode"
        if shape is None or len(shape) != 4 or int(attrs.axis) % 4 != 1:
            return f"the BatchNorm is not on the channel axis of a static 4-D tensor (axis {int(attrs.axis)}, shape {shape})"
        if not all(facts.is_static(a) for a in bn.args[1:5]):
            return "the BatchNorm statistics are run-time values"
        for v, what in ((act.args[0], "the normalised value"), (data, "the activation")):
            if facts.uses.get(v, 0) != 1 or not isinstance(v, relax.DataflowVar):
                return f"{what} {v.name} is read elsewhere too"
        if facts.uses.get(item.tuple_value, 0) != 1 or not isinstance(item.tuple_value, relax.DataflowVar):
            return f"the BatchNorm result {item.tuple_value.name} is read elsewhere too"
        if self.plan_convs is not None and not any(w in self.plan_convs for w in weights):
            return f"the fusion plan gives the conv with weight {weights} no BatchNorm+Relu prologue"
        return None

    # ------------------------------------------------------------------ rewriting
    def _rewrite(self, func: relax.Function, mod, bb: relax.BlockBuilder) -> Optional[relax.Function]:
        facts = FunctionFacts.of(func)
        found = {}
        for var, value in facts.var2val.items():
            m = self._match(var, value, facts, mod)
            if m is not None:
                found[var] = m
        if not found:
            return None
        rewriter = _Rewriter(found, bb, self)
        return rewriter.visit_expr(func)

    def make_group(self, m: dict, bb: relax.BlockBuilder) -> tuple[relax.GlobalVar, list]:
        """The prologue function for match ``m``; returns its GlobalVar and the caller-side
        arguments after ``(x, s, t)``."""
        x = m["bn"].args[0]
        operand = relax.TensorType([1, static_shape(x)[1], 1, 1], x.ty.dtype)
        return prologue_group(x.ty, operand, m["callee"], m["call"], bb)


def prologue_group(data_ty, operand_ty, callee, call, bb: relax.BlockBuilder) -> tuple[relax.GlobalVar, list]:
    """A prologue function ``(x, s, t, *rest) -> conv(relu(x * s + t), *rest) [epilogue]``
    added to ``bb``: ``callee`` is the epilogue group ``call`` calls (its data the first
    parameter), or None for a bare conv2d ``call``; ``data_ty`` the type of ``x`` and
    ``operand_ty`` that of ``s`` and ``t`` (``[1, C, 1, 1]``, or ``[1, C/B, 1, 1, B]`` in a
    blocked layout). Returns its GlobalVar and the caller-side arguments after ``(x, s, t)``."""
    xp = relax.Var("x", data_ty)
    sp = relax.Var("s", operand_ty)
    tp = relax.Var("t", operand_ty)
    if callee is None:  # a bare conv2d: the group is (x, s, t, W) around that one call
        head = relax.Var("z", data_ty)
        wp = relax.Var("w", call.args[1].ty)
        rest, rest_args = [wp], [call.args[1]]
        y = relax.DataflowVar("y", call.ty)
        bindings = [(y, relax.Call(call.op, [head, wp], call.attrs, call.ty_args))]
        result = y
        name = f"{PROLOGUE_PREFIX}conv2d"
    else:  # an epilogue group: its body follows the prologue, on fresh variables
        fresh = relax.utils.copy_with_new_vars(callee)
        head, rest, rest_args = fresh.params[0], list(fresh.params[1:]), list(call.args[1:])
        bindings = [(b.var, b.value) for blk in fresh.body.blocks for b in blk.bindings]
        result = fresh.body.body
        name = PROLOGUE_PREFIX + str(callee.attrs["Composite"]).removeprefix("layerfuse_")
    fb = relax.BlockBuilder()
    with fb.function(name, [xp, sp, tp, *rest], {"Composite": name, "Primitive": True}, private=True):
        with fb.dataflow():
            a = fb.emit(relax.op.multiply(xp, sp))  # x * s     [N, C, H, W]
            a = fb.emit(relax.op.add(a, tp))  # + t
            z = fb.emit(relax.op.nn.relu(a))
            mapping = {head: z}
            sub = SubstituteVars(mapping)
            out = None
            for k, (var, value) in enumerate(bindings):
                if k == len(bindings) - 1 and result.same_as(var):  # the group's result
                    out = mapping[var] = fb.emit_output(sub.visit_expr(value))
                else:
                    mapping[var] = fb.emit(sub.visit_expr(value))
            if out is None:
                out = fb.emit_output(sub.visit_expr(result))
        fb.emit_func_output(out)
    group = fb.get()[name]
    gv = bb.add_func(group, name)
    return gv, rest_args


def conv_of(func: relax.Function) -> Optional[relax.Call]:
    """The one conv2d call of a group function, else None."""
    convs = [b.value for blk in func.body.blocks for b in blk.bindings if _op(b.value) == "relax.nn.conv2d"]
    return convs[0] if len(convs) == 1 else None


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Replace each matched conv binding by ``s``, ``t`` and a call of its prologue group."""

    def __init__(self, found: dict, bb: relax.BlockBuilder, owner: FuseConv2DPrologue) -> None:
        super().__init__()
        self.found = found
        self.bb = bb
        self.owner = owner

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        m = self.found.get(binding.var)
        if m is None:
            super().visit_var_binding_(binding)
            return
        bn = m["bn"]
        x, gamma, beta, mean, var = (self.visit_expr(a) for a in bn.args[:5])
        attrs = bn.attrs
        c = static_shape(bn.args[0])[1]
        dtype = bn.args[0].ty.dtype
        eps = relax.const(float(attrs.epsilon), dtype)
        # s = gamma / sqrt(var + eps), t = beta - mean * s: [C] -> [1, C, 1, 1]
        # (without scale gamma is 1, without center beta is 0)
        op = relax.op
        std = op.sqrt(op.add(var, eps))
        s = self.builder_.emit(op.divide(gamma if bool(attrs.scale) else relax.const(1.0, dtype), std))
        shift = op.multiply(mean, s)
        t = self.builder_.emit(op.subtract(beta, shift) if bool(attrs.center) else op.negative(shift))
        s = self.builder_.emit(op.reshape(s, [1, c, 1, 1]))
        t = self.builder_.emit(op.reshape(t, [1, c, 1, 1]))
        gv, rest = self.owner.make_group(m, self.bb)
        call = relax.Call(gv, [x, s, t, *[self.visit_expr(a) for a in rest]])
        if isinstance(binding.var, relax.DataflowVar):
            new_var = self.builder_.emit(call, name_hint=binding.var.name)
        else:  # the conv's output leaves the dataflow block (a graph output)
            new_var = self.builder_.emit_output(call, name_hint=binding.var.name)
        self.set_var_remap(binding.var, new_var)
        self.owner.groups.append(
            {
                "function": gv.name_hint,
                "conv_weight": m["weights"],
                "input": bn.args[0].name if isinstance(bn.args[0], relax.Var) else "?",
                "absorbs": m["call"].op.name_hint if m["callee"] is not None else None,  # the epilogue group it took in
            }
        )


def plan_prologue_convs(plan: Any, param_names: set[str]) -> set[str]:
    """Weight parameter names of the convs the plan gives exactly a BatchNormalization +
    Relu prologue (the form this pass realises; others stay with TVM's FuseOps)."""
    convs: set[str] = set()
    for layer in plan.second:
        if layer.op_type == "Conv" and [e.op for e in layer.fused.prologue] == ["BatchNormalization", "Relu"]:
            if len(layer.inputs) > 1:
                convs.add(weight_param(layer.inputs[1], param_names) or layer.inputs[1])
    return convs
