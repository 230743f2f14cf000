"""Facts about Relax functions that the layerfuse passes (``relax/`` and ``lowering/``) share.

* which values are *compile-time*: computable from the weights alone (constants, and the
  parameters after ``num_input``, see ``relax.analysis.computable_at_compile_time``), so
  that ``BindParams`` + ``FoldConstant`` turn an expression of them into one constant;
* how many bindings read a variable (a merge needs a single consumer);
* which weight parameters an expression derives from (how a conv2d in Relax is matched
  with its layer in the topology graph: ``from_onnx`` names each weight parameter after
  its ONNX tensor, and ONNX Conv's input 1 is that tensor);
* static shapes, op names, fused (primitive) functions;
* the compilation target (:func:`as_target`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import tvm
from tvm import relax

from ..errors import UsageError

TargetLike = Union[str, Mapping[str, Any], tvm.target.Target]

NCHW_CONV_ATTRS = {"data_layout": "NCHW", "kernel_layout": "OIHW", "out_layout": "NCHW"}


def relax_functions(mod: tvm.IRModule) -> list[tuple[tvm.ir.GlobalVar, relax.Function]]:
    """The Relax functions of ``mod`` (PrimFuncs left out), in a stable order."""
    items = [(gv, f) for gv, f in mod.functions.items() if isinstance(f, relax.Function)]
    return sorted(items, key=lambda item: item[0].name_hint)


def with_functions(mod: tvm.IRModule, updates: Mapping[tvm.ir.GlobalVar, Any]) -> tvm.IRModule:
    """``mod`` with the functions in ``updates`` replaced: a copy (a pass never modifies the
    caller's module in place), or ``mod`` itself when there are none."""
    if not updates:
        return mod
    out = mod.clone()
    for gv, func in updates.items():
        out[gv] = func
    return out


def is_primitive(func: relax.Function) -> bool:
    """Whether ``func`` is an already-fused function (its body is one kernel's worth): marked
    ``Primitive`` (by FuseOps or a layerfuse pass), a ``Composite`` pattern, or offloaded
    to an external ``Codegen``. The passes leave such functions alone."""
    attrs = func.attrs
    if attrs is None:
        return False
    keys = set(attrs.keys())
    return ("Primitive" in keys and int(attrs["Primitive"]) != 0) or "Composite" in keys or "Codegen" in keys


def op_name(expr: Optional[relax.Expr]) -> Optional[str]:
    """``"relax.nn.conv2d"`` for a call of a Relax operator, else None."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def default_target() -> tvm.target.Target:
    """This machine's CPU, using all its cores."""
    return tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1})


def as_target(target: TargetLike) -> tvm.target.Target:
    """``target`` as a ``tvm.target.Target``: a Target, a dict, or a kind name (``"llvm"`` is
    :func:`default_target`: this CPU with all its cores)."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, Mapping):
        return tvm.target.Target(dict(target))
    if isinstance(target, str):
        if target == "llvm":
            return default_target()
        if " " not in target:
            return tvm.target.Target({"kind": target})
    raise UsageError(
        f"target {target!r} is not a target; expected a tvm.target.Target, a dict such as "
        '{"kind": "llvm", "num-cores": 2}, or a kind name such as "llvm"'
    )


def param_names(mod: tvm.IRModule) -> set[str]:
    """Names of the parameters of every Relax function of ``mod``."""
    return {p.name for _, func in relax_functions(mod) for p in func.params}


def weight_param(onnx_name: str, names: set[str]) -> Optional[str]:
    """The parameter (among ``names``) that holds the ONNX initializer ``onnx_name``: the
    importer names a weight parameter after its initializer, minus a leading ``onnx::``."""
    return next((c for c in (onnx_name, onnx_name.removeprefix("onnx::")) if c in names), None)


@dataclass
class FunctionFacts:
    """What a pass needs to know about one Relax function before rewriting it."""

    func: relax.Function
    static_vars: set = field(default_factory=set)  # vars computable at compile time
    var2val: dict = field(default_factory=dict)  # bound var -> value
    value2var: dict = field(default_factory=dict)  # bound value -> var (by identity)
    uses: dict = field(default_factory=dict)  # var -> number of bindings (or the return) reading it
    params: dict = field(default_factory=dict)  # param var -> index

    @classmethod
    def of(cls, func: relax.Function, *, num_input: Optional[int] = None) -> "FunctionFacts":
        """The facts of ``func``. Its ``num_input`` attribute says which parameters are weights
        (those after the first ``num_input``); ``num_input`` is the count to use when the
        function has no such attribute (default: TVM's reading, every parameter is an input)."""
        facts = cls(func=func)
        analysed = func
        if num_input is not None and (func.attrs is None or "num_input" not in func.attrs):
            analysed = func.with_attr("num_input", num_input)
        facts.static_vars = set(relax.analysis.computable_at_compile_time(analysed))
        facts.params = {p: i for i, p in enumerate(func.params)}
        readers: list[relax.Expr] = []
        body = func.body
        if isinstance(body, relax.SeqExpr):
            for block in body.blocks:
                for binding in block.bindings:
                    value = binding.value
                    facts.var2val[binding.var] = value
                    facts.value2var[value] = binding.var
                    readers.append(value)
            readers.append(body.body)
        else:
            readers.append(body)
        for expr in readers:
            for v in relax.analysis.free_vars(expr):
                facts.uses[v] = facts.uses.get(v, 0) + 1
        return facts

    def is_static(self, expr: relax.Expr) -> bool:
        """Whether ``expr`` is computable from constants and weights alone."""
        if isinstance(expr, relax.Var):
            return expr in self.static_vars
        return all(v in self.static_vars for v in relax.analysis.free_vars(expr))

    def bound_var(self, value: relax.Expr) -> Optional[relax.Var]:
        """The variable bound to ``value`` (a var itself when given one), or None."""
        if isinstance(value, relax.Var):
            return value
        return self.value2var.get(value)

    def use_count(self, value: relax.Expr) -> Optional[int]:
        """How many bindings read the value's variable (None when the value is unbound)."""
        var = self.bound_var(value)
        if var is None:
            return None
        return self.uses.get(var, 0)

    def weight_roots(self, expr: relax.Expr) -> list[str]:
        """Names of the function parameters ``expr`` is computed from (through bindings)."""
        names: list[str] = []
        seen: set = set()
        stack = [expr]
        while stack:
            e = stack.pop()
            free = [e] if isinstance(e, relax.Var) else list(relax.analysis.free_vars(e))
            for v in free:
                if v in seen:
                    continue
                seen.add(v)
                if v in self.params:
                    names.append(v.name)
                elif v in self.var2val:
                    stack.append(self.var2val[v])
        return sorted(names)

    def conv_weight_names(self, weight: relax.Expr) -> list[str]:
        """The weight parameters behind a conv's weight argument: the roots of shape
        ``[*, C_in/g, kh, kw]`` (so ``W * reshape(s)`` gives ``W``, and a channel-wise
        concat of several weights gives all of them)."""
        shape = static_shape(weight)
        if shape is None:
            return self.weight_roots(weight)
        by_name = {p.name: p for p in self.params}
        names = []
        for n in self.weight_roots(weight):
            s = static_shape(by_name[n])
            if s is not None and len(s) == len(shape) and s[1:] == shape[1:]:
                names.append(n)
        return names


@relax.expr_functor.mutator
class SubstituteVars(relax.PyExprMutator):
    """Replaces each Var (dataflow or not) that is a key of ``mapping`` by its value. The
    dict is read on every visit: entries added between ``visit_expr`` calls apply."""

    def __init__(self, mapping: dict) -> None:
        super().__init__()
        self.mapping = mapping

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self.mapping.get(var, var)

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
        return self.mapping.get(var, var)


def rewrite_bindings(pattern, rewriter, func: relax.Function) -> relax.Function:
    """``tvm.relax.dpl.rewrite_call`` for patterns whose root is a binding's value, without its
    common-subexpression elimination: one pass in binding order, ``rewriter(value, matches)``
    for each value that ``pattern`` matches (looking through ``func``'s bindings); unused
    bindings are removed after a change.

    ``rewrite_call`` also merges every pair of identical bindings once anything changed: two
    convs of one input with one weight become one conv read twice. The topology graph, and
    so the plan, keep them apart (the plan may fold a BatchNorm into one of them, which
    needs a single reader), so a pass that carries out the plan must not merge them."""
    rewritten = _BindingRewriter(pattern, rewriter, relax.analysis.get_var2val(func))
    out = rewritten.visit_expr(func)
    return relax.analysis.remove_all_unused(out) if rewritten.changed else func


@relax.expr_functor.mutator
class _BindingRewriter(relax.PyExprMutator):
    def __init__(self, pattern, rewriter, var2val) -> None:
        super().__init__()
        self.pattern, self.rewriter, self.var2val = pattern, rewriter, var2val
        self.changed = False

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        # an alias (``gv = lv``) matches through the binding it names, which is rewritten itself
        alias = isinstance(binding.value, relax.Var)
        matched = None if alias else self.pattern.extract_matched_expr(binding.value, self.var2val)
        if matched is not None:
            new = self.rewriter(binding.value, matched)
            if not new.same_as(binding.value):
                self.changed = True
                binding = relax.VarBinding(binding.var, self._emit_nested(new, {}, top=True))
        super().visit_var_binding_(binding)

    def _emit_nested(self, expr: relax.Expr, memo: dict, *, top: bool = False) -> relax.Expr:
        """``expr`` with each nested call bound to a variable, one binding per distinct object
        (a rewrite that uses one sub-expression twice, as a BatchNorm fold uses its scale in
        the weight and the bias, computes it once)."""
        if expr in memo:
            return memo[expr]
        if isinstance(expr, relax.Call):
            new = relax.Call(expr.op, [self._emit_nested(a, memo) for a in expr.args], expr.attrs, expr.ty_args)
        elif isinstance(expr, relax.Tuple):
            return relax.Tuple([self._emit_nested(f, memo) for f in expr.fields])
        elif isinstance(expr, relax.TupleGetItem):
            new = relax.TupleGetItem(self._emit_nested(expr.tuple_value, memo), expr.index)
        else:  # a variable (remapped when visited), a constant, a shape ...
            return expr
        if top:
            return new
        memo[expr] = self.builder_.emit(self.visit_expr(new))
        return memo[expr]


def static_shape(expr: relax.Expr) -> Optional[tuple[int, ...]]:
    """The shape of a tensor expression when every dimension is a known integer."""
    ty = getattr(expr, "ty", None)
    shape = getattr(ty, "shape", None)
    if shape is None or not isinstance(shape, relax.ShapeExpr):
        return None
    dims = []
    for d in shape.values:
        if not isinstance(d, tvm.tirx.IntImm):
            return None
        dims.append(int(d.value))
    return tuple(dims)


def dtype_of(expr: relax.Expr) -> Optional[str]:
    ty = getattr(expr, "ty", None)
    dtype = getattr(ty, "dtype", None)
    return None if dtype is None else str(dtype)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def conv2d_layout_reason(call: relax.Call) -> Optional[str]:
    """Why a conv2d call is not a plain NCHW/OIHW float convolution, or None."""
    attrs = call.attrs
    for key, want in NCHW_CONV_ATTRS.items():
        got = str(attrs[key])
        if got != want:
            return f"conv2d has {key}={got!r}; the fold handles {want!r} only"
    out_dtype = str(attrs["out_dtype"]) if attrs["out_dtype"] is not None else ""
    in_dtype = dtype_of(call.args[0])
    if out_dtype not in ("", "void") and out_dtype != in_dtype:
        return f"conv2d accumulates in {out_dtype} from {in_dtype} inputs"
    if in_dtype is None or not in_dtype.startswith(("float", "bfloat")):
        return f"conv2d computes in {in_dtype}; only floating point is folded"
    return None


# ---------------------------------------------------------------------- tvm.compile
LLVM_VERIFY_FAILED = "LLVM module verification failed"
"""How TVM 0.27 reports the invalid LLVM IR that :func:`tvm_compile` works around."""
NO_SLP = "-vectorize-slp=false"


def _without_slp(target: tvm.target.Target) -> Optional[tvm.target.Target]:
    """``target`` with LLVM's SLP vectorizer off for its LLVM part (the target itself or its
    host); None when no LLVM code generation is involved or it is off already."""

    def no_slp(t: tvm.target.Target) -> Optional[dict]:
        config = dict(t.export())
        if t.kind.name != "llvm" or NO_SLP in list(config.get("cl-opt", [])):
            return None
        config["cl-opt"] = [*config.get("cl-opt", []), NO_SLP]
        config.pop("host", None)  # given separately
        return config

    if target.kind.name == "llvm":
        cfg = no_slp(target)
        return tvm.target.Target(cfg) if cfg else None
    host = getattr(target, "host", None)
    cfg = no_slp(host) if host is not None else None
    return tvm.target.Target(target, host=tvm.target.Target(cfg)) if cfg else None


def tvm_compile(mod: tvm.IRModule, *, target: tvm.target.Target, relax_pipeline) -> Any:
    """``tvm.compile(mod, target=target, relax_pipeline=relax_pipeline)``, built again with
    LLVM's SLP vectorizer off when LLVM's verifier rejects the code.

    TVM 0.27 (LLVM 22) on a generic x86-64 target: a kernel that stores ``sigmoid(x)`` (or
    ``tanh(x)``) into a local buffer and then combines it with ``x`` (SiLU written as
    ``Sigmoid`` + ``Mul`` after a conv, on a 4x2x5 tensor) comes out of LLVM's O3 pipeline
    with a ``shufflevector`` that does not dominate its uses, and TVM raises "LLVM module
    verification failed". Disabling the SLP vectorizer (``cl-opt: -vectorize-slp=false``)
    avoids it, at the cost of SLP vectorization for that build only; every other build keeps
    TVM's default code generation. See ``tests/test_llvm_workaround.py`` for the reproducer.
    """
    try:
        return tvm.compile(mod, target=target, relax_pipeline=relax_pipeline)
    except Exception as e:  # tvm.error.InternalError from the LLVM verifier
        retry = _without_slp(target) if LLVM_VERIFY_FAILED in str(e) else None
        if retry is None:
            raise
    logging.getLogger(__name__).warning(
        "LLVM rejected the code TVM generated for %s; building again without LLVM's SLP vectorizer", target.kind.name
    )
    return tvm.compile(mod, target=retry, relax_pipeline=relax_pipeline)
