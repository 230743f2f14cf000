"""UseOneDNNConv: hand each conv layer that oneDNN runs well to the oneDNN tactic library.

The layers are the fused conv functions of :mod:`tvm_layerfuse.relax.fuse_epilogue`
(``layerfuse_conv2d_*``) and :mod:`tvm_layerfuse.relax.fuse_prologue` (``layerfuse_bn_relu_*``:
the conv reads ``relu(x * s + t)``, s and t per channel, as DenseNet's pre-activation
BatchNorm + ReLU; ``layerfuse.onednn.conv2d_pre`` computes it into a scratch buffer, a
vectorised loop, before the conv, in one call) and the bare ``R.nn.conv2d`` calls left in ``main`` (unfused
models, convs without an epilogue). Per output element, NCHW::

    y = act( conv2d(x, W) + b [+ r] )          W, b: BatchNorm already folded in
      ==  oneDNN convolution_forward(x, W, b)  with post-ops [sum(1) if r] [eltwise act]
          on a destination pre-filled with r

so the call becomes::

    y = R.call_dps_packed("layerfuse.onednn.conv2d[_add]",
                          (x, W, reshape(b, [O]) [, r], attrs), R.Tensor(y.shape))

with ``attrs = (stride_h, stride_w, pad_t, pad_l, pad_b, pad_r, dil_h, dil_w, groups, act,
src_block, dst_block, bits(alpha), bits(beta), algorithm)`` (``src_block`` / ``dst_block``: the
block width of x's / each output's layout, 0 plain, set by ``assign_layouts``) and ``act``: 0 none, 1 relu (``alpha``:
LeakyRelu's slope), 2 clip [``alpha``, ``beta``], 3 silu, 4 sigmoid; ``bits`` is the float32's
bit pattern (integer shape entries cost the VM nothing; a float argument costs a kernel
launch). Other epilogues (gates, adds after the activation, hard-sigmoid/swish, GELU, PReLU)
stay with TVM. A bare conv gets ``b = 0``. ``reshape(b)`` and the weight expressions depend
on weights only, so ``LiftTransformParams`` computes them at compile time.

After the conv layers, the pass moves the data around them (each step a function of its
own, applied per Relax function in this order):

- :mod:`.onednn_layout`: ``merge_splits`` (a merged conv's split pieces as its outputs),
  ``dense_layers`` (the classifier), ``pools_and_concats`` (pools and concats that read oneDNN
  tensors), ``assign_layouts`` (``nChw16c`` / ``nChw8c``, the block width of this CPU's kernels,
  between library calls);
- :mod:`.onednn_inplace`: ``prologues_read_pieces`` (DenseNet's concats never materialised),
  ``concats_in_place`` (convs write their channel ranges of a concat), ``residuals_in_place``
  (a residual conv writes into its residual's buffer).

The tactic is chosen per layer by a stated rule, without timing: ``onednn`` when the layer
is float32 NCHW/OIHW with a per-channel bias, no element-wise ``mul`` and no run-time clip
bounds, and when oneDNN on this machine gives it an optimised kernel (``impl_info_str`` not
``ref:``); otherwise ``tvm`` (TVM's own kernel), with the reason. Within ``onednn`` the conv
algorithm (``algorithm``: 0 direct, 1 Winograd) is chosen by timing, as TensorRT times its
tactics: where oneDNN has a Winograd kernel for the layer (3x3, stride 1, no groups), both
are timed on this machine at compile time (``layerfuse.onednn.time_conv``: the fastest of 7
runs each, the two in turn, on one thread, so that other processes on the machine cannot
decide the choice) and Winograd is kept when it is at least ``WINOGRAD_GAIN`` faster. Winograd computes
the same convolution with fewer multiplies (F(4x4, 3x3): 36 instead of 144 per 4x4 output
tile and channel pair); its rounding differs from the direct sum by about 1e-6 relative.
``UseOneDNNConv(winograd="never")`` keeps every layer direct, ``"always"`` takes Winograd
wherever oneDNN has it (tests) and records, where it has not (oneDNN 2.6 has Winograd
kernels for AVX-512 only), why the layer stays direct (``timing``: ``NO_WINOGRAD``). ``pass.layers`` lists
every choice ``{"layer", "tactic", "kernel" | "reason", "shape", "layout", "timing"}``: conv layers,
pools (``pool:<var>``, tactic ``onednn``), the classifier (``dense:<var>``: ``x @ w + b`` as a
oneDNN matmul) and concats (``concat:<var>``, tactic ``copy``, ``in-place``, or ``read by
prologues``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import tvm
from tvm import relax

from ...relax._ir import (
    conv2d_layout_reason,
    dtype_of,
    is_primitive,
    op_name,
    relax_functions,
    static_shape,
)
from ...relax.fuse_epilogue import PREFIX
from ...relax.fuse_prologue import PROLOGUE_PREFIX
from . import onednn
from .choice import LayerChoice
from .onednn_inplace import concats_in_place, prologues_read_pieces, residuals_in_place
from .onednn_layout import assign_layouts, dense_layers, merge_splits, pools_and_concats

__all__ = ["UseOneDNNConv", "LayerChoice", "Refused", "WINOGRAD_CHOICES", "WINOGRAD_GAIN"]

log = logging.getLogger(__name__)

ACT_CODES = {None: 0, "relu": 1, "leakyrelu": 1, "clip": 2, "silu": 3, "sigmoid": 4}
WINOGRAD_CHOICES = ("timed", "never", "always")
WINOGRAD_GAIN = 1.05  # Winograd is kept when direct takes at least this many times as long
NO_WINOGRAD = "winograd (always): oneDNN has no Winograd kernel for it here, direct"




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
    pre: Optional[tuple] = None  # (s, t): the conv reads relu(data * s + t), s and t per channel


class Refused(Exception):
    """A layer oneDNN does not take; the message is the reason."""


@tvm.transform.module_pass(opt_level=0, name="UseOneDNNConv")
class UseOneDNNConv:
    """Replace conv layers by calls into the oneDNN tactic library (see module doc).

    ``params`` gives the values of ``main``'s weight parameters (clip bounds may be
    parameters of an unbound module); ``only`` restricts the layers that may use oneDNN
    (names as in ``pass.layers``), None allows all; ``pieces=False`` keeps the concats that
    conv prologues read (:func:`prologues_read_pieces` off: the layout before it, to compare).
    """

    def __init__(
        self,
        *,
        params: Optional[Mapping[str, Any]] = None,
        only: Optional[set] = None,
        winograd: str = "timed",
        pieces: bool = True,
    ) -> None:
        if winograd not in WINOGRAD_CHOICES:
            raise ValueError(f"winograd={winograd!r}; expected one of {', '.join(WINOGRAD_CHOICES)}")
        self.params = dict(params or {})
        self.only = only
        self.winograd = winograd
        self.pieces = pieces
        self.timings: dict[tuple, tuple[float, float]] = {}  # (x, w, attrs, residual) -> (direct, winograd) ms
        self.layers: list[LayerChoice] = []
        self.bound: dict = {}  # var -> value in the function being rewritten (clip bounds)
        self.residuals: list[tuple[str, str]] = []  # (conv2d_add's variable, "in-place" | why it copies)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        onednn.load()  # the kernel query needs the library in this process
        self.layers = []
        mod = mod.clone()
        for gv, func in relax_functions(mod):
            if is_primitive(func):
                continue
            self.bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
            mod[gv] = _Rewriter(mod, self).visit_expr(func)
        mod = relax.transform.DeadCodeElimination()(mod)
        for gv, func in relax_functions(mod):
            if not is_primitive(func):
                mod[gv] = merge_splits(func)
        mod = relax.transform.DeadCodeElimination()(mod)
        for gv, func in relax_functions(mod):
            if not is_primitive(func):
                mod[gv] = assign_layouts(pools_and_concats(dense_layers(func, self.layers), self.layers), self.layers)
        for gv, func in relax_functions(mod):
            if not is_primitive(func):
                if self.pieces:
                    func = prologues_read_pieces(func, self.layers)
                mod[gv] = concats_in_place(func, self.layers)
        mod = relax.transform.DeadCodeElimination()(mod)
        self.residuals = []
        mod = residuals_in_place(mod, self.residuals)
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
            if ep.pre is not None and ep.residual is not None:
                raise Refused("a prologue and a residual in one layer")
            attrs = self._attrs(ep, x_shape, w_shape, out_shape)
            kernel = onednn.implementation(x_shape, w_shape, attrs, residual=ep.residual is not None)
            if kernel.startswith(("ref", "unsupported")):
                raise Refused(f"oneDNN has only a reference kernel for it ({kernel})")
        except Refused as r:
            self.layers.append(LayerChoice(name, "tvm", reason=str(r), shape=shape))
            return None
        kernel, timing = self._algorithm(attrs, kernel, x_shape, w_shape, residual=ep.residual is not None)
        self.layers.append(LayerChoice(name, "onednn", kernel=kernel, shape=shape, timing=timing))
        func = onednn.FUNCTIONS["conv2d_pre" if ep.pre is not None else "conv2d_add" if ep.residual is not None else "conv2d"]
        return func, attrs

    def _algorithm(self, attrs: list, kernel: str, x_shape, w_shape, *, residual: bool) -> tuple[str, str]:
        """Set ``attrs[14]`` (the conv algorithm) for this layer; (kernel, timing text)."""
        if self.winograd == "never" or list(w_shape[2:]) != [3, 3] or attrs[:2] != [1, 1] or attrs[6:9] != [1, 1, 1]:
            return kernel, ""
        wino = list(attrs)
        wino[14] = 1
        # timed in the layout the layer will most likely get (blocked where C and O allow it)
        width = onednn.block_width()
        wino[10] = width if width and x_shape[1] % width == 0 else 0
        wino[11] = width if width and w_shape[0] % width == 0 else 0
        wino_kernel = onednn.implementation(x_shape, w_shape, wino, residual=residual)
        if wino_kernel.startswith(("ref", "unsupported")):
            # oneDNN 2.6 has Winograd kernels for AVX-512 only: elsewhere the layer stays direct
            if self.winograd == "always":
                return kernel, f"{NO_WINOGRAD} ({wino_kernel.split(':')[0]})"
            return kernel, ""
        if self.winograd == "always":
            attrs[14] = 1
            return wino_kernel, "winograd (always)"
        key = (tuple(x_shape), tuple(w_shape), tuple(wino), residual)
        if key not in self.timings:
            direct = list(wino)
            direct[14] = 0
            self.timings[key] = onednn.time_conv(x_shape, w_shape, direct, wino, residual=residual)
        t_direct, t_wino = self.timings[key]
        timing = f"direct {t_direct:.3f} ms, winograd {t_wino:.3f} ms"
        if t_wino <= t_direct / WINOGRAD_GAIN:
            attrs[14] = 1
            return wino_kernel, timing
        return kernel, timing

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
        bits = [onednn.float_bits(ep.alpha), onednn.float_bits(ep.beta)]
        return [*strides, *padding, *dilation, int(a.groups), ACT_CODES[ep.act], 0, 0, *bits, 0]

    def constant(self, expr: relax.Expr, caller_args: Mapping) -> float:
        """The value of a scalar clip bound (a constant, a weight parameter's value, or a
        computation on those in the caller, e.g. the importer's ``where(isnan(p), -inf, p)``)."""
        value = self._evaluate(caller_args.get(expr, expr), depth=0)
        if value.size != 1:
            raise Refused("a clip bound is not a scalar")
        return float(value.reshape(()))

    _NUMPY = {"relax.where": np.where, "relax.isnan": np.isnan, "relax.isinf": np.isinf, "relax.logical_not": np.logical_not}

    def _evaluate(self, expr: relax.Expr, *, depth: int) -> np.ndarray:
        if isinstance(expr, tvm.ir.expr.Constant):  # a tensor constant, or a PrimValue
            return np.asarray(expr.value.numpy() if hasattr(expr.value, "numpy") else float(expr.value))
        if isinstance(expr, relax.Var) and expr.name in self.params:
            return np.asarray(self.params[expr.name])
        if isinstance(expr, relax.Var) and expr in self.bound and depth < 8:
            return self._evaluate(self.bound[expr], depth=depth + 1)
        op = op_name(expr)
        if op in self._NUMPY and depth < 8:
            return np.asarray(self._NUMPY[op](*[self._evaluate(a, depth=depth + 1) for a in expr.args]))
        if op in ("relax.astype", "relax.reshape") and depth < 8 and static_shape(expr) is not None:
            value = self._evaluate(expr.args[0], depth=depth + 1)
            return value.astype(dtype_of(expr)).reshape(static_shape(expr))
        raise Refused("a clip bound is not a compile-time value")



def parse_group(func: relax.Function, args, chooser: UseOneDNNConv) -> _Epilogue:
    """The conv epilogue of a ``layerfuse_conv2d_*`` function, its operands as caller expressions."""
    arg_of = dict(zip(func.params, args))
    bindings = [b for block in func.body.blocks for b in block.bindings]
    ep: Optional[_Epilogue] = None
    chain = None
    pre = _prologue(bindings)
    if pre is not None:
        bindings = bindings[3:]
    for b in bindings:
        v = b.value
        op = op_name(v)
        if op == "relax.nn.conv2d" and ep is None:
            if pre is not None and not v.args[0].same_as(pre[3]):
                raise Refused("the conv does not read the prologue's result")
            data = pre[0] if pre is not None else v.args[0]
            ep = _Epilogue(conv=v, data=arg_of.get(data, data), weight=arg_of.get(v.args[1], v.args[1]))
            if pre is not None:
                ep.pre = (arg_of.get(pre[1], pre[1]), arg_of.get(pre[2], pre[2]))
            chain = b.var
            continue
        if ep is None or not isinstance(v, relax.Call) or not any(a.same_as(chain) for a in v.args):
            raise Refused(f"the group computes {op or type(v).__name__} outside the conv chain")
        others = [a for a in v.args if not a.same_as(chain)]
        if not others and op in ("relax.add", "relax.multiply"):  # conv + conv, conv * conv
            raise Refused(f"the group's {op.split('.')[-1]} reads the conv's result twice")
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
            if any(op_name(later.value) == "relax.multiply" and any(a.same_as(b.var) for a in later.value.args)
                   and any(a.same_as(chain) for a in later.value.args) for later in bindings):
                continue  # sigmoid(z), read by the multiply of silu below; z stays the chain
            ep.act = "sigmoid"
        elif op == "relax.multiply" and ep.act is None and op_name(_value(func, others[0])) == "relax.sigmoid":
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


def _prologue(bindings) -> Optional[tuple]:
    """(x, s, t, y) when the group starts ``y = relu(x * s + t)`` with per-channel ``s``, ``t``
    (InlinePrologue's pre-activation BatchNorm + ReLU), else None."""
    if len(bindings) < 4 or [op_name(b.value) for b in bindings[:3]] != ["relax.multiply", "relax.add", "relax.nn.relu"]:
        return None
    mul, add, relu = (b.value for b in bindings[:3])
    x_shape = static_shape(mul.args[0])
    if x_shape is None or len(x_shape) != 4:
        return None
    per_channel = ((1, x_shape[1], 1, 1), (x_shape[1], 1, 1))
    if static_shape(mul.args[1]) not in per_channel or static_shape(mul.args[0]) != static_shape(bindings[0].var):
        return None
    if not add.args[0].same_as(bindings[0].var) or static_shape(add.args[1]) not in per_channel:
        return None
    if not relu.args[0].same_as(bindings[1].var):
        return None
    return mul.args[0], mul.args[1], add.args[1], bindings[2].var


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
            if attrs is not None and str(attrs.get("Composite", "")).startswith((PREFIX, PROLOGUE_PREFIX)):
                new = self._replace(call.op.name_hint, call, lambda: parse_group(callee, call.args, self.chooser))
        elif op_name(call) == "relax.nn.conv2d":
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
        if ep.pre is not None:  # conv2d_pre(x, s, t, W, b, attrs)
            c = static_shape(ep.data)[1]
            args[1:1] = [relax.op.reshape(self.visit_expr(e), [c]) for e in ep.pre]
        if ep.residual is not None:
            args.append(self.visit_expr(ep.residual))
        args.append(relax.ShapeExpr(attrs))
        return relax.call_dps_packed(func, args, relax.TensorType(list(out_shape), "float32"))
