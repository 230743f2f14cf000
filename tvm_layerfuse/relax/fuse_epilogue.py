"""FuseConv2DEpilogue: group a conv2d with its epilogue into one function, lowered to ONE kernel.

The group, per output element (NCHW shown; the fusion itself is layout-agnostic)::

    y = act( conv2d(x, W) [+ b]  [+ r | * r] )        residual / multiply
    y = act( conv2d(x, W) [+ b] ) * g                  gate (squeeze-and-excitation)
    y = act( conv2d(x, W) [+ b] ) + r                  post_add (YOLO's bottleneck shortcut)

* ``b``: a compile-time operand (the bias, or the folded BatchNorm shift);
* ``r``: a run-time operand, the *extra input* of the element-wise merge (the ResNet
  residual ``Add``, or a ``Mul`` such as a squeeze-excitation scale); the fused function
  takes it as one more argument;
* ``g``: a gate: the conv output is ``[N, C, 1, 1]`` and is broadcast over the feature
  map ``g: [N, C, H, W]`` it multiplies (the group's result has ``g``'s shape);
* ``act``: ``relu``, ``clip`` (``minimum(maximum(z, lo), hi)``, either half alone, or
  ``R.clip``), ``leakyrelu``, ``silu`` (``z * sigmoid(z)``), ``sigmoid``, ``hardsigmoid``
  (``clip(a*z + b, 0, 1)``), ``hardswish`` (as TVM imports the op: ``z * (clip(z + 3, 0,
  6) / 6)``; ``z * hardsigmoid(z)``; ``z * clip(z + 3, 0, 6) / 6``), ``prelu``, ``gelu``
  (``R.nn.gelu``, ``R.nn.gelu_tanh``, or ``z * (erf(z / √2) + 1) * 0.5``).

Each group becomes a private Relax function with ``{"Composite": <template>,
"Primitive": True}`` named after its template, e.g. ``layerfuse_conv2d_bias_relu`` or
``layerfuse_conv2d_bias_add_relu`` (``_1``, ``_2`` ... for later groups). TVM's normal
pipeline then lowers it: ``LegalizeOps`` turns its body into ``call_tir`` s and ``FuseTIR``
merges them into one PrimFunc of the same name, so the whole group is one kernel launch
and no intermediate tensor is written to memory. (Implementation: ``FuseOpsByPattern``
with ``bind_constants=False, annotate_codegen=False``, then a rename.)

A candidate is refused (left to TVM's own ``FuseOps``, reason logged and kept in
``pass.refused``) when an intermediate value is read outside the group, when an
elementwise step would broadcast the result beyond the conv output's shape, when the
clip bounds are not compile-time values, or when the fusion plan (``plan_spec``) says
otherwise. When both operands of a residual ``Add`` are conv outputs, the plan's conv (or,
without a plan, the later one) absorbs it, so the other operand is ready when the fused
kernel runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_op, wildcard
from tvm.relax.transform import FusionPattern, PatternCheckContext

from ._ir import FunctionFacts, is_primitive, op_name, relax_functions, rewrite_bindings, static_shape

log = logging.getLogger(__name__)

PREFIX = "layerfuse_conv2d"
ACTIVATIONS = ("relu", "clip", "leakyrelu", "silu", "sigmoid", "hardsigmoid", "hardswish", "prelu", "gelu")
RESIDUALS = {"add": "relax.add", "mul": "relax.multiply", "gate": "relax.multiply", "post_add": "relax.add"}
# (plan, group) activations that are the same function once FoldAffineIntoConv2D has run:
# HardSigmoid is clip(a*z + b, 0, 1), and when the conv's chain folds (it has a BatchNorm),
# a*z + b folds into the conv's weight and bias like any per-channel affine op.
SAME_ACTIVATION = {("hardsigmoid", "clip")}
# The residual kinds applied after the activation (the others come before it).
AFTER_ACTIVATION = ("gate", "post_add")


@dataclass(frozen=True)
class EpilogueSpec:
    """What the plan merges into one conv: the element-wise op (None, "add", "mul", "gate") and
    the activation (None or one of ``ACTIVATIONS``)."""

    residual: Optional[str] = None
    activation: Optional[str] = None


def template_name(*, bias: bool, residual: Optional[str], activation: Optional[str]) -> str:
    parts = [PREFIX]
    if bias:
        parts.append("bias")
    if residual and residual not in AFTER_ACTIVATION:
        parts.append(residual)
    if activation:
        parts.append(activation)
    if residual in AFTER_ACTIVATION:
        parts.append(residual)
    return "_".join(parts)


def _activation_patterns(z: DFPattern) -> dict[str, list[tuple[DFPattern, dict[str, DFPattern]]]]:
    """Each activation of ``z`` as alternative patterns with their annotated operands: ``act``
    (the activation's last call) and the constants it reads (``lo``/``hi``: clip bounds;
    ``hs_*``: HardSwish's; ``hsig_*``: HardSigmoid's; ``gelu_*``: the erf form's), so that a
    tactic reading the group (:func:`match_group`) can check their values."""
    sig = is_op("relax.sigmoid")(z)
    div = is_op("relax.divide")

    def mul(a: DFPattern, b: DFPattern) -> DFPattern:  # either operand order (importers differ)
        return is_op("relax.multiply")(a, b) | is_op("relax.multiply")(b, a)

    def add(a: DFPattern, b: DFPattern) -> DFPattern:
        return is_op("relax.add")(a, b) | is_op("relax.add")(b, a)

    def clipped(e: DFPattern, lo: DFPattern, hi: DFPattern) -> DFPattern:  # R.clip, or minimum(maximum())
        return is_op("relax.clip")(e, lo, hi) | is_op("relax.minimum")(is_op("relax.maximum")(e, lo), hi)

    def hardsigmoid(tag: str):  # clip(a*z + b, lo, hi) and its operands
        a, b, lo, hi = wildcard(), wildcard(), wildcard(), wildcard()
        return clipped(add(mul(a, z), b), lo, hi), {f"{tag}_a": a, f"{tag}_b": b, f"{tag}_lo": lo, f"{tag}_hi": hi}

    def relu6_plus3():  # clip(z + 3, 0, 6)
        three, lo, hi = wildcard(), wildcard(), wildcard()
        return clipped(add(z, three), lo, hi), {"hs_add": three, "hs_lo": lo, "hs_hi": hi}

    def erf_half():  # erf(z / √2) + 1
        root2, one = wildcard(), wildcard()
        return add(is_op("relax.erf")(div(z, root2)), one), {"gelu_sqrt2": root2, "gelu_one": one}

    def act(pattern: DFPattern, notes: Optional[dict] = None) -> tuple[DFPattern, dict]:
        return pattern, {**(notes or {}), "act": pattern}

    lo, hi = wildcard(), wildcard()
    lo1, hi1 = wildcard(), wildcard()
    clip_lo, clip_hi = wildcard(), wildcard()
    hsig, hsig_notes = hardsigmoid("hsig")
    hs1, hs1_notes = relu6_plus3()
    hs2, hs2_notes = relu6_plus3()
    hs3, hs3_notes = hardsigmoid("hs")
    six1, six2 = wildcard(), wildcard()
    erf1, erf1_notes = erf_half()
    erf2, erf2_notes = erf_half()
    half1, half2 = wildcard(), wildcard()
    return {
        "relu": [act(is_op("relax.nn.relu")(z))],
        "leakyrelu": [act(is_op("relax.nn.leakyrelu")(z))],
        "silu": [act(is_op("relax.multiply")(z, sig)), act(is_op("relax.nn.silu")(z))],
        "sigmoid": [act(sig)],
        "hardsigmoid": [act(hsig, hsig_notes)],
        "hardswish": [
            act(mul(z, div(hs1, six1)), {**hs1_notes, "hs_div": six1}),  # the HardSwish op as TVM imports it
            act(div(mul(z, hs2), six2), {**hs2_notes, "hs_div": six2}),  # x * Clip(x + 3, 0, 6) / 6
            act(mul(z, hs3), hs3_notes),  # x * HardSigmoid(x)
        ],
        "prelu": [act(is_op("relax.nn.prelu")(z, wildcard()))],
        "gelu": [
            act(is_op("relax.nn.gelu")(z)),
            act(is_op("relax.nn.gelu_tanh")(z)),
            act(mul(mul(z, erf1), half1), {**erf1_notes, "gelu_half": half1}),  # (x * (1 + erf(x/√2))) * 0.5
            act(mul(mul(z, half2), erf2), {**erf2_notes, "gelu_half": half2}),  # (x * 0.5) * (1 + erf(x/√2))
        ],
        "clip": [
            act(is_op("relax.minimum")(is_op("relax.maximum")(z, lo), hi), {"lo": lo, "hi": hi}),
            act(is_op("relax.clip")(z, clip_lo, clip_hi), {"lo": clip_lo, "hi": clip_hi}),
            act(is_op("relax.maximum")(z, lo1), {"lo": lo1}),
            act(is_op("relax.minimum")(z, hi1), {"hi": hi1}),
        ],
    }


def epilogue_patterns(*, check=None) -> list[FusionPattern]:
    """The fusion patterns, longest first (FuseOpsByPattern takes the first that matches)."""
    found: list[tuple[int, int, FusionPattern]] = []
    for bias in (True, False):
        for residual in (None, *RESIDUALS):
            for activation in (None, *ACTIVATIONS):
                if not _is_template(bias, residual, activation):
                    continue
                name = template_name(bias=bias, residual=residual, activation=activation)
                size = int(bias) + int(residual is not None) + int(activation is not None)
                for k, (pattern, notes) in enumerate(_chain_patterns(bias, residual, activation)):
                    checker = None if check is None else _bind_check(check, name, bias, residual, activation)
                    found.append((size, -k, FusionPattern(name, pattern, notes, checker)))
    found.sort(key=lambda item: (-item[0], -item[1]))
    return [p for _, _, p in found]


def _chain_patterns(bias: bool, residual: Optional[str], activation: Optional[str]):
    data, weight = wildcard(), wildcard()
    conv = is_op("relax.nn.conv2d")(data, weight)
    notes: dict[str, DFPattern] = {"conv": conv, "data": data, "weight": weight}
    z = conv
    if bias:
        b = wildcard()
        z = is_op("relax.add")(z, b)
        notes.update(bias=b, bias_add=z)
    if residual and residual not in AFTER_ACTIVATION:
        r = wildcard()
        z = is_op(RESIDUALS[residual])(z, r)
        notes.update(residual=r, residual_op=z)
    if activation is None:
        if residual == "gate":  # a gate without an activation
            r = wildcard()
            z = is_op(RESIDUALS[residual])(z, r)
            notes.update(residual=r, residual_op=z)
        yield z, notes
        return
    for pattern, extra in _activation_patterns(z)[activation]:
        if residual in AFTER_ACTIVATION:
            op = is_op(RESIDUALS[residual])
            for order in (0, 1):  # exporters write either operand order (one pattern each: an
                r = wildcard()  # or-pattern does not annotate the operand it matched)
                gated = op(pattern, r) if order == 0 else op(r, pattern)
                yield gated, {**notes, **extra, "residual": r, "residual_op": gated}
        else:
            yield pattern, {**notes, **extra}


def _is_template(bias: bool, residual: Optional[str], activation: Optional[str]) -> bool:
    """Whether the parts make a group: not a bare conv2d (nothing to fuse), and no
    ``post_add`` without an activation (an add after no activation is the ``add`` template;
    the plan says ``post_add`` only after an activation)."""
    if not bias and residual is None and activation is None:
        return False
    return not (residual == "post_add" and activation is None)


_TEMPLATES = {
    template_name(bias=b, residual=r, activation=a): (b, r, a)
    for b in (True, False)
    for r in (None, *RESIDUALS)
    for a in (None, *ACTIVATIONS)
    if _is_template(b, r, a)
}


@dataclass(frozen=True)
class GroupMatch:
    """What one epilogue group computes, from the pass's own patterns (:func:`match_group`):
    its template's parts and the group's expressions by annotation name (``conv``, ``data``,
    ``weight``, ``bias``, ``residual``, ``act``, and the activation's operands: ``lo``/``hi``,
    ``hs_*``, ``hsig_*``, ``gelu_*``; see :func:`_activation_patterns`)."""

    template: str
    bias: bool
    residual: Optional[str]
    activation: Optional[str]
    notes: Mapping[str, relax.Expr]


def match_group(func: relax.Function, *, template: Optional[str] = None, root: Optional[relax.Expr] = None) -> Optional[GroupMatch]:
    """The match of an epilogue group function (``{"Composite": template}``, made by this pass)
    against this pass's patterns, or None when its body is none of them. Its own template is
    tried first; a group that :class:`.absorb_elementwise.AbsorbElementwiseConsumers` extended
    (element-wise consumers joined it) is then matched against every template, longest first.
    ``root``: the expression to match (default: the function's result); ``template`` defaults
    to the function's ``Composite`` attribute."""
    if template is None:
        template = str((func.attrs or {}).get("Composite", ""))
    var2val = relax.analysis.get_var2val(func)
    if root is None:
        root = func.body.body
    while isinstance(root, relax.Var) and root in var2val:
        root = var2val[root]
    own = [entry for entry in _all_patterns() if entry[0] == template]
    others = [entry for entry in _all_patterns() if entry[0] != template]
    for name, parts, pattern, notes in own + others:
        matched = pattern.extract_matched_expr(root, var2val)
        if matched is None or not _whole(func, root, matched):
            continue
        found = {key: matched[p] for key, p in notes.items() if p in matched}
        return GroupMatch(name, *parts, found)
    return None


_PATTERNS: list = []


def _all_patterns() -> list:
    """(template, (bias, residual, activation), pattern, notes) of every template, longest first
    (built once)."""
    if not _PATTERNS:
        entries = []
        for name, parts in _TEMPLATES.items():
            size = sum(p is not None and p is not False for p in parts)
            for k, (pattern, notes) in enumerate(_chain_patterns(*parts)):
                entries.append((-size, k, name, parts, pattern, notes))
        entries.sort(key=lambda e: (e[0], e[1]))
        _PATTERNS.extend((name, parts, pattern, notes) for _, _, name, parts, pattern, notes in entries)
    return _PATTERNS


def _whole(func: relax.Function, root, matched) -> bool:
    """Every binding of ``func`` (from its conv on) is part of the match: nothing else computed."""
    values = set(matched.values())
    bindings = [b for block in func.body.blocks for b in block.bindings]
    start = next((i for i, b in enumerate(bindings) if op_name(b.value) == "relax.nn.conv2d"), None)
    if start is None:
        return False
    return all(b.value in values for b in bindings[start:] if isinstance(b.value, relax.Call))


def _bind_check(check, name, bias, residual, activation):
    def checker(ctx: PatternCheckContext) -> bool:
        return check(ctx, name=name, bias=bias, residual=residual, activation=activation)

    return checker


@tvm.transform.module_pass(opt_level=0, name="FuseConv2DEpilogue")
class FuseConv2DEpilogue:
    """Group conv2d + [bias] + [residual add/mul] + [activation] into one kernel (see module doc).

    Parameters
    ----------
    plan_spec:
        ``{conv weight parameter name: EpilogueSpec}`` from the fusion plan. When given,
        only those convs are grouped, each with exactly the residual op and activation the
        plan merged (a bias is always allowed). None groups every match.

    After the pass runs, ``pass.groups`` lists ``{"function", "template", "conv_weight",
    "extra_input"}`` per group and ``pass.refused`` lists ``{"template", "var", "reason"}``.
    """

    def __init__(self, *, plan_spec: Optional[Mapping[str, EpilogueSpec]] = None) -> None:
        self.plan_spec = None if plan_spec is None else dict(plan_spec)
        self.groups: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ the pass
    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.groups, self.refused = [], []
        self._refusals: dict[tuple[str, str], dict[str, Any]] = {}
        self._facts: dict[Any, FunctionFacts] = {}
        targets = []
        mod = mod.clone()  # never modify the caller's module in place
        for gv, func in relax_functions(mod):
            if is_primitive(func):
                continue
            func = relax.analysis.remove_all_unused(func)
            func = _order_residual_operands(func, self.plan_spec)
            mod[gv] = func
            facts = FunctionFacts.of(func)
            for var in facts.var2val:
                self._facts[var] = facts
            targets.append(gv.name_hint)
        if not targets:
            return mod
        existing = set(mod.get_global_vars())
        patterns = epilogue_patterns(check=self._check)
        mod = relax.transform.FuseOpsByPattern(
            patterns, bind_constants=False, annotate_codegen=False, entry_functions=targets
        )(mod)
        mod = self._rename_groups(mod, existing)
        self.refused = list(self._refusals.values())
        for r in self.refused:
            log.info("not grouped as %s: %s: %s", r["template"], r["var"], r["reason"])
        log.info("FuseConv2DEpilogue made %d group(s)", len(self.groups))
        return mod

    # ------------------------------------------------------------------ the check
    def _check(self, ctx: PatternCheckContext, *, name: str, bias: bool, residual, activation) -> bool:
        try:
            reason = self._reason(ctx, bias=bias, residual=residual, activation=activation)
        except Exception as e:  # never let a check crash the C++ caller; refuse instead
            reason = f"check failed: {type(e).__name__}: {e}"
        if reason is not None:
            root = ctx.value_to_bound_var.get(ctx.matched_expr) if ctx.value_to_bound_var is not None else None
            var = root.name if root is not None else "?"
            self._refusals.setdefault((var, name), {"template": name, "var": var, "reason": reason})
            return False
        return True

    def _reason(self, ctx: PatternCheckContext, *, bias: bool, residual, activation) -> Optional[str]:
        notes = ctx.annotated_expr
        conv = notes["conv"]
        root_var = ctx.value_to_bound_var.get(ctx.matched_expr)
        facts = self._facts.get(root_var)
        if facts is None:
            return "the matched value is not a binding of the function"
        # 1. nothing computed inside the group may be needed outside it
        inside = set(ctx.matched_bindings.keys())
        for var in inside:
            if var.same_as(root_var):
                continue
            if not isinstance(var, relax.DataflowVar):
                return f"{var.name} is an output of the dataflow block"
            users = ctx.var_usages.get(var, [])
            outside = [u.name for u in users if u not in inside]
            if outside:
                return f"{var.name} is also read by {', '.join(outside)}"
        # 2. the epilogue never broadcasts beyond the conv output (a gate: only its last multiply)
        out_shape = static_shape(conv)
        if out_shape is None:
            return "the conv2d output shape is not static"
        for var in inside:
            shape = static_shape(var)
            if residual == "gate" and var.same_as(root_var):
                gate = static_shape(notes["residual"])
                if not _is_gate(out_shape, gate) or shape != gate:
                    return f"the gate {list(gate) if gate else '?'} is not a [N, C, ...] map of the conv's [N, C, 1, 1]"
                continue
            if shape != out_shape:
                return f"{var.name} has shape {list(shape) if shape else '?'}, the conv output {list(out_shape)}"
        # 3. operands: the bias and clip bounds are compile-time, the extra input is not
        if bias and not facts.is_static(notes["bias"]):
            return "the add after conv2d reads a run-time value (a residual, not a bias)"
        if residual and facts.is_static(notes["residual"]):
            return f"the {residual} operand is a compile-time value, not an extra input"
        for bound in ("lo", "hi"):
            if bound in notes and not facts.is_static(notes[bound]):
                return f"the clip bound {bound!r} is a run-time value"
        # 4. the plan
        if self.plan_spec is not None:
            weights = facts.conv_weight_names(notes["weight"])
            spec = next((self.plan_spec[w] for w in weights if w in self.plan_spec), None)
            if spec is None:
                return f"the fusion plan has no epilogue for the conv with weight {weights}"
            if spec.residual != residual:
                return f"the plan merges element-wise op {spec.residual!r}, this group {residual!r}"
            if spec.activation != activation and (spec.activation, activation) not in SAME_ACTIVATION:
                return f"the plan merges activation {spec.activation!r}, this group {activation!r}"
        return None

    # ------------------------------------------------------------------ names and report
    def _rename_groups(self, mod: tvm.IRModule, existing: set) -> tvm.IRModule:
        new_funcs = [
            (gv, f)
            for gv, f in relax_functions(mod)
            if gv not in existing and f.attrs is not None and str(f.attrs.get("Composite", "")).startswith(PREFIX)
        ]
        if not new_funcs:
            return mod
        taken = {gv.name_hint for gv in mod.get_global_vars()} - {gv.name_hint for gv, _ in new_funcs}
        counters: dict[str, int] = {}
        mapping: dict[Any, relax.GlobalVar] = {}
        fresh = {gv for gv, _ in new_funcs}
        # A builder over the module without the new functions: add_func gives each renamed
        # function a typed GlobalVar (two identical groups share one function).
        builder = relax.BlockBuilder(
            tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv not in fresh}, attrs=mod.attrs)
        )
        # Number the groups in the order their calls appear in the callers (graph order).
        order = _call_order(mod, {gv for gv, _ in new_funcs})
        for gv, func in sorted(new_funcs, key=lambda item: order.get(item[0], 1 << 30)):
            template = str(func.attrs["Composite"])
            k = counters.get(template, 0)
            name = template if k == 0 else f"{template}_{k}"
            while name in taken:
                k += 1
                name = f"{template}_{k}"
            counters[template] = k + 1
            taken.add(name)
            # add_func gives the GlobalVar its type (and reuses an identical function's)
            mapping[gv] = builder.add_func(func, name)
        renamer = _GlobalVarRenamer(mapping)
        for gv, func in relax_functions(mod):
            if gv not in fresh:
                builder.update_func(gv, renamer.visit_expr(func))
        out = builder.get()
        self._record_groups(out, mapping)
        return out

    def _record_groups(self, mod: tvm.IRModule, mapping: dict) -> None:
        renamed = {gv.name_hint: gv for gv in mapping.values()}
        for gv, func in relax_functions(mod):
            if gv.name_hint in renamed:
                continue
            facts = FunctionFacts.of(func)
            for var, value in facts.var2val.items():
                if not isinstance(value, relax.Call) or not isinstance(value.op, relax.GlobalVar):
                    continue
                if value.op.name_hint not in renamed:
                    continue
                callee = mod[value.op]
                conv_arg, extra = _group_arguments(callee, value.args, facts)
                self.groups.append(
                    {
                        "function": value.op.name_hint,
                        "template": str(callee.attrs["Composite"]),
                        "conv_weight": facts.conv_weight_names(conv_arg) if conv_arg is not None else [],
                        "extra_input": extra,
                        "var": var.name,
                    }
                )


def _is_gate(conv_shape, gate_shape) -> bool:
    """``[N, C, 1, 1]`` conv output broadcast over a ``[N, C, H, W]`` map (H, W may be 1 too),
    or an activated conv output multiplied by a map of its own shape (the plan's gate after an
    activation: nothing broadcasts)."""
    if conv_shape is None or gate_shape is None or len(conv_shape) != len(gate_shape) or len(conv_shape) < 3:
        return False
    if tuple(conv_shape) == tuple(gate_shape):
        return True
    return conv_shape[:2] == gate_shape[:2] and all(d == 1 for d in conv_shape[2:])


def _group_arguments(callee: relax.Function, args, facts: FunctionFacts):
    """The caller's weight argument and the name of the extra input (the run-time operand
    of the residual add/mul, which may also be the conv's data, as in ``conv(x) + x``)."""
    arg_of = dict(zip(callee.params, args))
    weight_arg = extra = None
    chain = None  # the variable carrying conv [+ bias] so far
    for binding in callee.body.blocks[0].bindings if callee.body.blocks else []:
        value = binding.value
        if not isinstance(value, relax.Call):
            continue
        op = getattr(value.op, "name", "")
        if op == "relax.nn.conv2d":
            weight_arg = arg_of.get(value.args[1])
            chain = binding.var
        elif chain is not None and any(a.same_as(chain) for a in value.args):
            # the chain goes on (bias, activation steps, the residual op or the gate)
            others = [a for a in value.args if not a.same_as(chain)]
            chain = binding.var
            if op in RESIDUALS.values() and len(others) == 1:
                caller = arg_of.get(others[0])
                if caller is not None and not facts.is_static(caller):
                    extra = caller.name if isinstance(caller, relax.Var) else str(caller)
    return weight_arg, extra


def _call_order(mod: tvm.IRModule, gvs: set) -> dict:
    order: dict = {}
    for _, func in relax_functions(mod):
        if is_primitive(func):
            continue
        for value in FunctionFacts.of(func).var2val.values():
            if isinstance(value, relax.Call) and value.op in gvs and value.op not in order:
                order[value.op] = len(order)
    return order


@relax.expr_functor.mutator
class _GlobalVarRenamer(relax.PyExprMutator):
    def __init__(self, mapping: dict) -> None:
        super().__init__()
        self.mapping = mapping

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        target = self.mapping.get(call.op) if isinstance(call.op, relax.GlobalVar) else None
        if target is None:
            return super().visit_call_(call)
        args = [self.visit_expr(a) for a in call.args]
        return relax.Call(target, args, call.attrs, call.ty_args, call.span)


# ---------------------------------------------------------------------- operand order
def _order_residual_operands(func: relax.Function, plan_spec: Optional[Mapping[str, EpilogueSpec]]) -> relax.Function:
    """Put the conv chain that should absorb a residual ``add``/``multiply`` first.

    dpl matches these commutative ops trying the written order first, so the chain in
    ``args[0]`` gets the group. With a plan that is the conv the plan chose; without one
    the later of two conv chains (its operand is then computed before the fused kernel runs).
    """
    facts = FunctionFacts.of(func)
    position = {var: i for i, var in enumerate(facts.var2val)}
    a, b = wildcard(), wildcard()
    pattern = is_op("relax.add")(a, b) | is_op("relax.multiply")(a, b)

    def conv_chain_weight(expr) -> Optional[list[str]]:
        """The conv weights when ``expr`` is ``conv2d(...)`` or ``conv2d(...) + static``."""
        value = facts.var2val.get(expr) if isinstance(expr, relax.Var) else None
        if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.add":
            inner = [x for x in value.args if not facts.is_static(x)]
            if len(inner) == 1 and len(value.args) == 2:
                value = facts.var2val.get(inner[0]) if isinstance(inner[0], relax.Var) else None
        if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.nn.conv2d":
            return facts.conv_weight_names(value.args[1])
        return None

    def rewrite(orig: relax.Expr, _m: dict) -> relax.Expr:
        if not isinstance(orig, relax.Call):  # a variable aliasing a matching call
            return orig
        if len(orig.args) != 2 or any(facts.is_static(x) for x in orig.args):
            return orig
        first, second = orig.args
        w1, w2 = conv_chain_weight(first), conv_chain_weight(second)
        if w1 is None or w2 is None:
            if w2 is not None:  # only the second operand is a conv chain: it absorbs the op
                return relax.Call(orig.op, [second, first], orig.attrs)
            return orig
        if plan_spec is not None:
            wants = lambda ws: any(w in plan_spec and plan_spec[w].residual for w in ws)
            swap = wants(w2) and not wants(w1)
        else:
            swap = position.get(second, -1) > position.get(first, -1)
        return relax.Call(orig.op, [second, first], orig.attrs) if swap else orig

    return rewrite_bindings(pattern, rewrite, func)
