"""AbsorbElementwiseConsumers: element-wise ops after a layerfuse group join the group.

FuseConv2DEpilogue hides each planned conv chain in a private, ``Primitive`` function, and
TVM's ``FuseOps`` never fuses into such a function. An element-wise op the plan did not
cover (an activation the planner does not know, the multiply of a squeeze-and-excitation
gate, a clamp after a residual) would then be a kernel of its own, where TVM's default
pipeline - which fuses a conv with every element-wise and broadcast op after it - makes it
part of the conv's kernel. So that a plan never costs more kernels than TVM's default,
this pass does what ``FuseOps`` would have done::

    y = group(x, W, b)                      z = group'(x, W, b, r)
    t = op1(y, c)            ==>            with group'(x, W, b, r):
    z = op2(t, r)                               y = <group body>; t = op1(y, c); return op2(t, r)

A binding joins the group when it is an element-wise or broadcast Relax op (the list in
``ELEMENTWISE_OPS``) that reads the group's result (or a value already absorbed), and every
value computed inside the new group - the old result included - is read only inside it
(it is a dataflow variable, not an output of the block). Run-time operands (``r``)
become parameters of the new function; constants stay constants. The call moves to the
position of the last absorbed binding, where every operand is computed. The group keeps
its name with ``_ew`` appended (e.g. ``layerfuse_conv2d_bias_ew``) and FuseTIR still
makes it one kernel. The arithmetic is unchanged: the same ops on the same values.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import tvm
from tvm import relax

from ._ir import SubstituteVars, is_primitive, relax_functions, static_shape

log = logging.getLogger(__name__)

GROUP_PREFIX = "layerfuse_"
ELEMENTWISE_OPS = frozenset(
    f"relax.{n}"
    for n in """add subtract multiply divide maximum minimum power clip sigmoid tanh exp negative abs sqrt rsqrt
    erf floor ceil round astype nn.relu nn.relu6 nn.gelu nn.gelu_tanh nn.silu nn.leakyrelu nn.prelu
    nn.softplus""".split()
)


@tvm.transform.module_pass(opt_level=0, name="AbsorbElementwiseConsumers")
class AbsorbElementwiseConsumers:
    """Pull the element-wise consumers of layerfuse groups into the groups (module doc).

    After the pass, ``pass.absorbed`` lists ``{"function", "ops"}`` per extended call."""

    def __init__(self, *, max_rounds: int = 100_000) -> None:
        self.max_rounds = max_rounds
        self.absorbed: list[dict[str, Any]] = []

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.absorbed = []
        for _ in range(self.max_rounds):  # one rewrite per round, until none applies
            changed = False
            for gv, func in relax_functions(mod):
                if is_primitive(func):
                    continue
                new_mod = self._rewrite(mod, gv, func)
                if new_mod is not None:
                    mod, changed = new_mod, True
                    break  # the module changed: look again from its new state
            if not changed:
                break
        if self.absorbed:
            mod = relax.transform.DeadCodeElimination()(mod)
            log.info("AbsorbElementwiseConsumers extended %d group call(s)", len(self.absorbed))
        return mod

    # ------------------------------------------------------------------ one rewrite
    def _rewrite(self, mod: tvm.IRModule, gv: tvm.ir.GlobalVar, func: relax.Function) -> Optional[tvm.IRModule]:
        body = func.body
        if not isinstance(body, relax.SeqExpr):
            return None
        for b_index, block in enumerate(body.blocks):
            if not isinstance(block, relax.DataflowBlock):
                continue
            bindings = list(block.bindings)
            uses = _uses(body, b_index, bindings)
            for i, binding in enumerate(bindings):
                group = _group_callee(mod, binding)
                if group is None:
                    continue
                region = _region(bindings, i, uses)
                if not region:
                    continue
                return self._apply(mod, gv, func, b_index, bindings, i, region, group)
        return None

    def _apply(self, mod, gv, func, b_index, bindings, i, region, group):
        call = bindings[i].value
        y = bindings[i].var
        absorbed = [bindings[j] for j in region]
        inside = {y} | {b.var for b in absorbed}
        external: list[relax.Var] = []
        for b in absorbed:
            for v in relax.analysis.free_vars(b.value):
                if v not in inside and v not in external:
                    external.append(v)
        group_func = mod[call.op]
        new_func = _extended_function(group_func, y, absorbed, external)
        builder = relax.BlockBuilder(mod)
        name = f"{call.op.name_hint}_ew"
        new_gv = builder.add_func(new_func, name)
        new_call = builder.normalize(relax.Call(new_gv, list(call.args) + external))
        out = absorbed[-1].var
        keep = []
        for k, b in enumerate(bindings):
            if k == i or k in region[:-1]:
                continue
            keep.append(relax.VarBinding(out, new_call) if k == region[-1] else b)
        body = func.body
        blocks = list(body.blocks)
        blocks[b_index] = relax.DataflowBlock(keep)
        new_main = relax.Function(
            func.params, relax.SeqExpr(blocks, body.body), func.ret_ty, func.is_pure, func.attrs
        )
        builder.update_func(gv, new_main)
        self.absorbed.append(
            {"function": new_gv.name_hint, "group": call.op.name_hint, "ops": [b.value.op.name for b in absorbed]}
        )
        return builder.get()


def _group_callee(mod: tvm.IRModule, binding) -> Optional[relax.Function]:
    value = binding.value
    if not isinstance(binding, relax.VarBinding) or not isinstance(value, relax.Call):
        return None
    if not isinstance(value.op, relax.GlobalVar) or not value.op.name_hint.startswith(GROUP_PREFIX):
        return None
    callee = mod[value.op]
    if not isinstance(callee, relax.Function) or not is_primitive(callee):
        return None
    if static_shape(binding.var) is None:
        return None
    return callee


def _uses(body: relax.SeqExpr, b_index: int, bindings: list) -> dict:
    """var -> indices of the bindings of this block reading it; ``-1`` for a read elsewhere
    (a later block, the function's result)."""
    uses: dict = {}
    for k, b in enumerate(bindings):
        for v in relax.analysis.free_vars(b.value):
            uses.setdefault(v, []).append(k)
    later = [b.value for blk in body.blocks[b_index + 1 :] for b in blk.bindings] + [body.body]
    for expr in later:
        for v in relax.analysis.free_vars(expr):
            uses.setdefault(v, []).append(-1)
    return uses


def _region(bindings: list, i: int, uses: dict) -> list[int]:
    """Indices of the bindings after ``i`` to absorb into the group bound at ``i`` (the
    longest valid run; empty when none)."""
    inside = {bindings[i].var}
    candidates: list[int] = []
    for j in range(i + 1, len(bindings)):
        b = bindings[j]
        reads = [v for v in relax.analysis.free_vars(b.value) if v in inside]
        if not reads:
            continue
        if not _elementwise(b):
            break
        candidates.append(j)
        inside.add(b.var)
    for k in range(len(candidates), 0, -1):
        region = candidates[:k]
        out = bindings[region[-1]].var
        members = set(region)
        values = [bindings[i].var] + [bindings[j].var for j in region[:-1]]
        del out  # the last value leaves the group: any reader may read it
        if all(isinstance(v, relax.DataflowVar) and all(u in members for u in uses.get(v, [])) for v in values):
            return region
    return []


def _elementwise(binding) -> bool:
    value = binding.value
    if not isinstance(binding, relax.VarBinding) or not isinstance(value, relax.Call):
        return False
    if not isinstance(value.op, tvm.ir.Op) or value.op.name not in ELEMENTWISE_OPS:
        return False
    return static_shape(binding.var) is not None


def _extended_function(group: relax.Function, y: relax.Var, absorbed: list, external: list) -> relax.Function:
    """``group`` followed by the ``absorbed`` bindings, with ``external`` as new parameters."""
    group = relax.utils.copy_with_new_vars(group)
    inner = group.body
    blocks = list(inner.blocks)
    result = inner.body
    extra_params = [relax.Var(v.name, v.ty) for v in external]
    remap: dict = dict(zip(external, extra_params))
    if isinstance(result, relax.Var):
        remap[y] = result
        tail = []
    else:  # the group returns an expression: bind it first
        res = relax.DataflowVar("lv_group", y.ty)
        tail = [relax.VarBinding(res, result)]
        remap[y] = res
    mutator = SubstituteVars(remap)
    for b in absorbed:
        new_var = relax.DataflowVar(b.var.name, b.var.ty)
        tail.append(relax.VarBinding(new_var, mutator.visit_expr(b.value)))
        remap[b.var] = new_var
    if blocks and isinstance(blocks[-1], relax.DataflowBlock):
        blocks[-1] = relax.DataflowBlock(list(blocks[-1].bindings) + tail)
    else:
        blocks.append(relax.DataflowBlock(tail))
    # the function returns a non-dataflow value: the last absorbed binding's var is output-able
    last = tail[-1]
    out = relax.Var(last.var.name, last.var.ty)
    blocks[-1] = relax.DataflowBlock(list(blocks[-1].bindings)[:-1] + [relax.VarBinding(out, last.value)])
    return relax.Function(
        list(group.params) + extra_params,
        relax.SeqExpr(blocks, out),
        out.ty,
        group.is_pure,
        group.attrs,
    )


