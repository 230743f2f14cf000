"""UseOneDNNConv: hand each conv layer that oneDNN runs well to the oneDNN tactic library.

The layers are the fused conv functions of :mod:`tvm_layerfuse.relax.fuse_epilogue`
(``layerfuse_conv2d_*``) and the bare ``R.nn.conv2d`` calls left in ``main`` (unfused
models, convs without an epilogue). Per output element, NCHW::

    y = act( conv2d(x, W) + b [+ r] )          W, b: BatchNorm already folded in
      ==  oneDNN convolution_forward(x, W, b)  with post-ops [sum(1) if r] [eltwise act]
          on a destination pre-filled with r

so the call becomes::

    y = R.call_dps_packed("layerfuse.onednn.conv2d[_add]",
                          (x, W, reshape(b, [O]) [, r], attrs, alpha, beta), R.Tensor(y.shape))

with ``attrs = (stride_h, stride_w, pad_t, pad_l, pad_b, pad_r, dil_h, dil_w, groups, act)``
and ``act``: 0 none, 1 relu (``alpha``: LeakyRelu's slope), 2 clip [``alpha``, ``beta``],
3 silu, 4 sigmoid. Other epilogues (gates, adds after the activation, hard-sigmoid/swish,
GELU, PReLU) stay with TVM. A bare conv gets ``b = 0``. ``reshape(b)`` and the weight expressions depend on
weights only, so ``LiftTransformParams`` computes them at compile time.

Layout (``attrs[10:12]``: src / dst blocked): a tensor whose producer and every reader are
oneDNN layers (as input or residual), with ``C % 16 == 0``, holds oneDNN's blocked
``nChw16c`` bytes instead of NCHW (same size and Relax type; no TVM kernel reads it), so
consecutive convs run with no reorder between them. A plain tensor read by several oneDNN
layers is reordered once (``layerfuse.onednn.to_blocked``) for all of them. A residual and the output of the layer
that adds it share a layout (fixed point: a conflict makes both plain). Plain tensors are
reordered in and out of the primitive's layout inside the library.

Concatenations: a channel concat (4-d float32, axis 1) with an input made by a oneDNN
layer cannot be made in place by the lowering (its producers are not TVM kernels), and TVM's
untuned concat kernel copies element by element; it becomes ``layerfuse.onednn.concat``
(one ``memcpy`` per piece and image) instead.

The tactic is chosen per layer by a stated rule, without timing: ``onednn`` when the layer
is float32 NCHW/OIHW with a per-channel bias, no element-wise ``mul`` and no run-time clip
bounds, and when oneDNN on this machine gives it an optimised kernel (``impl_info_str`` not
``ref:``); otherwise ``tvm`` (TVM's own kernel), with the reason. ``pass.layers`` lists
every choice ``{"layer", "tactic", "kernel" | "reason", "shape"}``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

import numpy as np
import tvm
from tvm import relax

from ...relax._ir import (
    conv2d_layout_reason,
    dtype_of,
    is_primitive,
    relax_functions,
    static_shape,
)
from ...relax.fuse_epilogue import PREFIX
from . import onednn

log = logging.getLogger(__name__)

ACT_CODES = {None: 0, "relu": 1, "leakyrelu": 1, "clip": 2, "silu": 3, "sigmoid": 4}


@dataclass
class LayerChoice:
    """The tactic of one conv layer."""

    layer: str  # the fused function (or the bound variable of a bare conv)
    tactic: str  # "onednn" | "tvm"
    kernel: str = ""  # oneDNN's implementation name when "onednn"
    reason: str = ""  # why not oneDNN, when "tvm"
    shape: str = ""  # "x[1,64,56,56] w[64,64,3,3]"
    layout: str = ""  # "nchw>nChw16c": the src and dst bytes in the graph, when "onednn"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Epilogue:
    conv: relax.Call
    data: relax.Expr
    weight: relax.Expr
    bias: Optional[relax.Expr] = None
    residual: Optional[relax.Expr] = None
    act: Optional[str] = None
    alpha: float = 0.0
    beta: float = 0.0


class Refused(Exception):
    """A layer oneDNN does not take; the message is the reason."""


@tvm.transform.module_pass(opt_level=0, name="UseOneDNNConv")
class UseOneDNNConv:
    """Replace conv layers by calls into the oneDNN tactic library (see module doc).

    ``params`` gives the values of ``main``'s weight parameters (clip bounds may be
    parameters of an unbound module); ``only`` restricts the layers that may use oneDNN
    (names as in ``pass.layers``), None allows all.
    """

    def __init__(self, *, params: Optional[Mapping[str, Any]] = None, only: Optional[set] = None) -> None:
        self.params = dict(params or {})
        self.only = only
        self.layers: list[LayerChoice] = []

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        onednn.load()  # the kernel query needs the library in this process
        self.layers = []
        mod = mod.clone()
        for gv, func in relax_functions(mod):
            if is_primitive(func):
                continue
            mod[gv] = _Rewriter(mod, self).visit_expr(func)
        mod = relax.transform.DeadCodeElimination()(mod)
        for gv, func in relax_functions(mod):
            if not is_primitive(func):
                mod[gv] = assign_layouts(copy_concats(func, self.layers), self.layers)
        used = sum(c.tactic == "onednn" for c in self.layers)
        log.info("oneDNN tactic for %d of %d conv layers", used, len(self.layers))
        return mod

    # ------------------------------------------------------------------ one layer
    def choose(self, name: str, ep: _Epilogue, out_shape) -> Optional[tuple[str, list]]:
        """(function name, extra call arguments) when oneDNN takes the layer, else None."""
        x_shape, w_shape = static_shape(ep.data), static_shape(ep.weight)
        shape = f"x{list(x_shape) if x_shape else '?'} w{list(w_shape) if w_shape else '?'}"
        try:
            if self.only is not None and name not in self.only:
                raise Refused("not selected for oneDNN")
            attrs = self._attrs(ep, x_shape, w_shape, out_shape)
            kernel = onednn.implementation(
                x_shape, w_shape, attrs, residual=ep.residual is not None, alpha=ep.alpha, beta=ep.beta
            )
            if kernel.startswith(("ref", "unsupported")):
                raise Refused(f"oneDNN has only a reference kernel for it ({kernel})")
        except Refused as r:
            self.layers.append(LayerChoice(name, "tvm", reason=str(r), shape=shape))
            return None
        self.layers.append(LayerChoice(name, "onednn", kernel=kernel, shape=shape))
        func = onednn.FUNCTIONS["conv2d_add" if ep.residual is not None else "conv2d"]
        return func, attrs

    def _attrs(self, ep: _Epilogue, x_shape, w_shape, out_shape) -> list[int]:
        reason = conv2d_layout_reason(ep.conv)
        if reason:
            raise Refused(reason)
        if dtype_of(ep.data) != "float32" or dtype_of(ep.weight) != "float32":
            raise Refused(f"conv computes in {dtype_of(ep.data)}; the oneDNN tactic takes float32")
        if x_shape is None or w_shape is None or out_shape is None or len(x_shape) != 4:
            raise Refused("shapes are not static 4-d")
        a = ep.conv.attrs
        strides = [int(s) for s in a.strides]
        padding = [int(p) for p in a.padding]  # top, left, bottom, right
        if len(padding) == 2:
            padding = padding * 2
        dilation = [int(d) for d in a.dilation]
        # the output size oneDNN will compute: (in + pad - ((k - 1) * dilation + 1)) // stride + 1
        want = [
            (x_shape[2 + i] + padding[i] + padding[2 + i] - ((w_shape[2 + i] - 1) * dilation[i] + 1)) // strides[i] + 1
            for i in range(2)
        ]
        if list(out_shape[2:]) != want or min(want) < 1 or out_shape[1] != w_shape[0] or out_shape[0] != x_shape[0]:
            raise Refused(f"the conv's output {list(out_shape)} is not the {want} oneDNN computes")
        return [*strides, *padding, *dilation, int(a.groups), ACT_CODES[ep.act], 0, 0]

    def constant(self, expr: relax.Expr, caller_args: Mapping) -> float:
        """The value of a scalar clip bound (a constant, or a weight parameter's value)."""
        expr = caller_args.get(expr, expr)
        if isinstance(expr, tvm.ir.expr.Constant):  # a tensor constant, or a PrimValue
            value = np.asarray(expr.value.numpy() if hasattr(expr.value, "numpy") else float(expr.value))
        elif isinstance(expr, relax.Var) and expr.name in self.params:
            value = np.asarray(self.params[expr.name])
        else:
            raise Refused("a clip bound is not a compile-time value")
        if value.size != 1:
            raise Refused("a clip bound is not a scalar")
        return float(value.reshape(()))


def _op(value) -> str:
    return getattr(getattr(value, "op", None), "name", "") if isinstance(value, relax.Call) else ""


def parse_group(func: relax.Function, args, chooser: UseOneDNNConv) -> _Epilogue:
    """The conv epilogue of a ``layerfuse_conv2d_*`` function, its operands as caller expressions."""
    arg_of = dict(zip(func.params, args))
    bindings = [b for block in func.body.blocks for b in block.bindings]
    ep: Optional[_Epilogue] = None
    chain = None
    for b in bindings:
        v = b.value
        op = _op(v)
        if op == "relax.nn.conv2d":
            ep = _Epilogue(conv=v, data=arg_of.get(v.args[0], v.args[0]), weight=arg_of.get(v.args[1], v.args[1]))
            chain = b.var
            continue
        if ep is None or not isinstance(v, relax.Call) or not any(a.same_as(chain) for a in v.args):
            raise Refused(f"the group computes {op or type(v).__name__} outside the conv chain")
        others = [a for a in v.args if not a.same_as(chain)]
        if op == "relax.add" and ep.bias is None and ep.residual is None and ep.act is None and _is_bias(others[0], ep):
            ep.bias = arg_of.get(others[0], others[0])
        elif op == "relax.add" and ep.residual is None and ep.act is None:
            if static_shape(others[0]) != static_shape(b.var):
                raise Refused("the add after the conv is neither a per-channel bias nor a full-size residual")
            ep.residual = arg_of.get(others[0], others[0])
        elif op == "relax.nn.relu" and ep.act is None:
            ep.act = "relu"
        elif op == "relax.nn.leakyrelu" and ep.act is None:
            ep.act, ep.alpha = "leakyrelu", float(v.attrs.alpha)
        elif op == "relax.nn.silu" and ep.act is None:
            ep.act = "silu"
        elif op == "relax.sigmoid" and ep.act is None:
            if any(_op(later.value) == "relax.multiply" and any(a.same_as(b.var) for a in later.value.args)
                   and any(a.same_as(chain) for a in later.value.args) for later in bindings):
                continue  # sigmoid(z), read by the multiply of silu below; z stays the chain
            ep.act = "sigmoid"
        elif op == "relax.multiply" and ep.act is None and _op(_value(func, others[0])) == "relax.sigmoid":
            ep.act = "silu"
        elif op in ("relax.maximum", "relax.minimum", "relax.clip") and ep.act in (None, "clip"):
            if ep.act is None:
                ep.act, ep.alpha, ep.beta = "clip", float(np.finfo(np.float32).min), float(np.finfo(np.float32).max)
            if op == "relax.clip":
                ep.alpha, ep.beta = chooser.constant(v.args[1], {}), chooser.constant(v.args[2], {})
            elif op == "relax.maximum":
                ep.alpha = chooser.constant(others[0], arg_of)
            else:
                ep.beta = chooser.constant(others[0], arg_of)
        else:
            raise Refused(f"oneDNN has no post-op for {op} here")
        chain = b.var
    if ep is None:
        raise Refused("no conv2d in the group")
    if not isinstance(func.body.body, relax.Var) or not func.body.body.same_as(chain):
        raise Refused("the group's result is not the end of its conv epilogue")
    return ep


def _value(func: relax.Function, var) -> Optional[relax.Expr]:
    for block in func.body.blocks:
        for b in block.bindings:
            if b.var.same_as(var):
                return b.value
    return None


def _is_bias(expr, ep: _Epilogue) -> bool:
    """A per-output-channel operand: shape [1, O, 1, 1] or [O, 1, 1] (compile-time by the fusion)."""
    shape, w = static_shape(expr), static_shape(ep.weight)
    if shape is None or w is None:
        return False
    return tuple(shape) in ((1, w[0], 1, 1), (w[0], 1, 1))


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, chooser: UseOneDNNConv) -> None:
        super().__init__(mod)
        self.mod_ = mod
        self.chooser = chooser
        self.bare = 0  # bare conv2d calls seen, for their names

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new = None
        if isinstance(call.op, relax.GlobalVar):
            callee = self.mod_[call.op]
            attrs = callee.attrs
            if attrs is not None and str(attrs.get("Composite", "")).startswith(PREFIX):
                new = self._replace(call.op.name_hint, call, lambda: parse_group(callee, call.args, self.chooser))
        elif _op(call) == "relax.nn.conv2d":
            self.bare += 1
            name = f"conv2d_{self.bare - 1}" if self.bare > 1 else "conv2d"
            new = self._replace(name, call, lambda: _Epilogue(conv=call, data=call.args[0], weight=call.args[1]))
        return super().visit_call_(call) if new is None else new

    def _replace(self, name: str, call: relax.Call, parse) -> Optional[relax.Expr]:
        out_shape = static_shape(call)
        try:
            ep = parse()
        except Refused as r:
            self.chooser.layers.append(LayerChoice(name, "tvm", reason=str(r)))
            return None
        chosen = self.chooser.choose(name, ep, out_shape)
        if chosen is None:
            return None
        func, attrs = chosen
        o = static_shape(ep.weight)[0]
        if ep.bias is not None:
            bias = relax.op.reshape(self.visit_expr(ep.bias), [o])
        else:
            bias = relax.const(np.zeros([o], "float32"))
        args = [self.visit_expr(ep.data), self.visit_expr(ep.weight), bias]
        if ep.residual is not None:
            args.append(self.visit_expr(ep.residual))
        args += [
            relax.ShapeExpr(attrs),
            relax.prim_value(float(ep.alpha)),
            relax.prim_value(float(ep.beta)),
        ]
        return relax.call_dps_packed(func, args, relax.TensorType(list(out_shape), "float32"))


# ---------------------------------------------------------------------- layouts
_DPS = tvm.ir.Op.get("relax.call_dps_packed")
BLOCK = 16  # nChw16c


def _onednn_call(value) -> Optional[tuple[str, list]]:
    """(function name, argument list) of a call into the oneDNN tactic library."""
    if not isinstance(value, relax.Call) or not value.op.same_as(_DPS):
        return None
    name = str(getattr(value.args[0], "global_symbol", ""))
    if name not in onednn.FUNCTIONS.values():
        return None
    return name, list(value.args[1].fields)


def assign_layouts(func: relax.Function, layers: list) -> relax.Function:
    """Mark the tensors passed only between oneDNN layers as blocked (see module doc)."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    calls = {}  # var -> (name, args)
    readers: dict = {}  # var -> list of (reader var or None for a TVM op / the output, role)
    for b in bindings:
        found = _onednn_call(b.value)
        if found is not None:
            calls[b.var] = found
            name, args = found
            for k, a in enumerate(args):
                if isinstance(a, relax.Var):
                    role = "data" if k == 0 else ("residual" if name.endswith("_add") and k == 3 else "other")
                    readers.setdefault(a, []).append((b.var, role))
            continue
        for v in relax.analysis.free_vars(b.value):
            readers.setdefault(v, []).append((None, "tvm"))
    for v in relax.analysis.free_vars(func.body.body):
        readers.setdefault(v, []).append((None, "output"))

    def can_block(var) -> bool:
        shape = static_shape(var)
        users = readers.get(var, [])
        return (
            isinstance(var, relax.DataflowVar)
            and shape is not None
            and len(shape) == 4
            and shape[1] % BLOCK == 0
            and bool(users)
            and all(r is not None and role in ("data", "residual") for r, role in users)
        )

    blocked = {v for v in calls if can_block(v)}
    changed = True
    while changed:  # a residual and the output it is added to share one layout
        changed = False
        for v, (name, args) in calls.items():
            if name.endswith("_add") and isinstance(args[3], relax.Var):
                r = args[3]
                if (r in blocked) != (v in blocked):
                    blocked.discard(r)
                    blocked.discard(v)
                    changed = True
    # A plain tensor that several oneDNN layers read: reordered once (to_blocked), not in each.
    data_readers: dict = {}
    for v, (name, args) in calls.items():
        x = args[0]
        if isinstance(x, relax.Var) and x not in blocked:
            data_readers.setdefault(x, []).append(v)
    shared = {
        x
        for x, rs in data_readers.items()
        if len(rs) >= 2 and static_shape(x) is not None and len(static_shape(x)) == 4 and static_shape(x)[1] % BLOCK == 0
    }
    by_var = {}
    for v, (name, args) in calls.items():
        src = isinstance(args[0], relax.Var) and (args[0] in blocked or args[0] in shared)
        by_var[v] = (src, v in blocked)
    _record_layouts(layers, calls, by_var)
    by_call = {b.value: by_var[b.var] for b in bindings if b.var in by_var and any(by_var[b.var])}
    return _SetLayouts(by_call, shared).visit_expr(func) if by_call else func


def _record_layouts(layers: list, calls: dict, by_var: dict) -> None:
    """Tell each oneDNN LayerChoice (in call order) which layout its src and dst have."""
    chosen = [c for c in layers if c.tactic == "onednn"]
    for c, (v, (name, args)) in zip(chosen, calls.items()):
        src, dst = by_var.get(v, (False, False))
        c.layout = f"{'nChw16c' if src else 'nchw'}>{'nChw16c' if dst else 'nchw'}"
        if src or dst:  # the kernel oneDNN picks for these layouts
            attrs = [int(x) for x in args[-3].values]
            attrs[10], attrs[11] = int(src), int(dst)
            c.kernel = onednn.implementation(
                static_shape(args[0]),
                static_shape(args[1]),
                attrs,
                residual=name.endswith("_add"),
                alpha=float(args[-2].value),
                beta=float(args[-1].value),
            )


@relax.expr_functor.mutator
class _SetLayouts(relax.PyExprMutator):
    def __init__(self, by_call: dict, shared: set) -> None:
        super().__init__()
        self.by_call = by_call
        self.shared = shared  # plain tensors reordered once for their oneDNN readers
        self.blocked_copy: dict = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        flags = self.by_call.get(call)
        if flags is None:
            return super().visit_call_(call)
        args = list(call.args[1].fields)
        attrs = [int(x) for x in args[-3].values]
        attrs[10], attrs[11] = int(flags[0]), int(flags[1])
        args[-3] = relax.ShapeExpr(attrs)
        x = args[0]
        args = [self.visit_expr(a) for a in args]
        if x in self.shared:
            if x not in self.blocked_copy:
                copy = relax.call_dps_packed(onednn.TO_BLOCKED, [args[0]], relax.TensorType(list(static_shape(x)), "float32"))
                self.blocked_copy[x] = self.builder_.emit(copy, f"{x.name}_nChw16c")
            args[0] = self.blocked_copy[x]
        return relax.Call(call.op, [call.args[0], relax.Tuple(args)], call.attrs, call.ty_args)


# ---------------------------------------------------------------------- concatenations
def copy_concats(func: relax.Function, layers: list) -> relax.Function:
    """Channel concats with an input from a oneDNN layer -> ``layerfuse.onednn.concat``."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    values = {b.var: b.value for b in bindings}
    from_onednn = {b.var for b in bindings if _onednn_call(b.value) is not None}
    chosen = {}
    for b in bindings:
        v = b.value
        if _op(v) != "relax.concat":
            continue
        fields = v.args[0]
        if isinstance(fields, relax.Var):
            fields = values.get(fields, fields)
        if not isinstance(fields, relax.Tuple):
            continue
        items = list(fields.fields)
        shape = static_shape(b.var)
        axis = int(v.attrs.axis) if v.attrs.axis is not None else 0
        if shape is None or len(shape) != 4 or axis not in (1, -3) or dtype_of(b.var) != "float32":
            continue
        if not all(isinstance(x, relax.Var) and static_shape(x) is not None for x in items):
            continue
        if not any(x in from_onednn for x in items):
            continue  # TVM producers only: the lowering's in-place concat takes it
        chosen[v] = items
        layers.append(LayerChoice(f"concat:{b.var.name}", "copy", kernel="memcpy", shape=f"out{list(shape)}"))
    return _CopyConcats(chosen).visit_expr(func) if chosen else func


@relax.expr_functor.mutator
class _CopyConcats(relax.PyExprMutator):
    def __init__(self, chosen: dict) -> None:
        super().__init__()
        self.chosen = chosen

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        items = self.chosen.get(call)
        if items is None:
            return super().visit_call_(call)
        args = [self.visit_expr(x) for x in items]
        return relax.call_dps_packed(onednn.CONCAT, args, relax.TensorType(list(static_shape(call)), "float32"))
