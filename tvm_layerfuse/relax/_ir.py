"""Facts about Relax functions that the layerfuse passes share.

* which values are *compile-time*: computable from the weights alone (constants, and the
  parameters after ``num_input``, see ``relax.analysis.computable_at_compile_time``), so
  that ``BindParams`` + ``FoldConstant`` turn an expression of them into one constant;
* how many bindings read a variable (a merge needs a single consumer);
* which weight parameters an expression derives from (how a conv2d in Relax is matched
  with its layer in the topology graph: ``from_onnx`` names each weight parameter after
  its ONNX tensor, and ONNX Conv's input 1 is that tensor);
* static shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import tvm
from tvm import relax

NCHW_CONV_ATTRS = {"data_layout": "NCHW", "kernel_layout": "OIHW", "out_layout": "NCHW"}


def relax_functions(mod: tvm.IRModule) -> list[tuple[tvm.ir.GlobalVar, relax.Function]]:
    """The Relax functions of ``mod`` (PrimFuncs left out), in a stable order."""
    items = [(gv, f) for gv, f in mod.functions.items() if isinstance(f, relax.Function)]
    return sorted(items, key=lambda item: item[0].name_hint)


def is_primitive(func: relax.Function) -> bool:
    """Whether ``func`` is an already-fused function (its body is one kernel's worth)."""
    attrs = func.attrs
    if attrs is None:
        return False
    return bool(attrs.get("Primitive", 0)) or "Composite" in attrs or "Codegen" in attrs


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
    def of(cls, func: relax.Function) -> "FunctionFacts":
        facts = cls(func=func)
        facts.static_vars = set(relax.analysis.computable_at_compile_time(func))
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
