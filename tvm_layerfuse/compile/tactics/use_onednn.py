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
src_blocked, dst_blocked, bits(alpha), bits(beta), algorithm)`` and ``act``: 0 none, 1 relu (``alpha``:
LeakyRelu's slope), 2 clip [``alpha``, ``beta``], 3 silu, 4 sigmoid; ``bits`` is the float32's
bit pattern (integer shape entries cost the VM nothing; a float argument costs a kernel
launch). Other epilogues (gates, adds after the activation, hard-sigmoid/swish, GELU, PReLU)
stay with TVM. A bare conv gets ``b = 0``. ``reshape(b)`` and the weight expressions depend
on weights only, so ``LiftTransformParams`` computes them at compile time.

Split pieces: a horizontally merged conv read only by ``split(axis=1)`` becomes one call
with one output per piece (``out_sinfo`` a tuple)::

    split(conv(x, W, b), [o_1, ...]) == (conv(x, W[0:o_1], b[0:o_1]), conv(x, W[o_1:o_2], ...), ...)

so no split kernel copies the pieces (the library runs one primitive per row range).

Pools and concatenations that read a oneDNN tensor become library calls too:
``max_pool2d`` / ``avg_pool2d`` (NCHW, no dilation; ``count_include_pad`` only where
ceil_mode adds no cells beyond the stated padding, which ONNX would not count) and the
global average (``mean`` over H, W with keepdims, ``adaptive_avg_pool2d`` to 1x1) ->
``layerfuse.onednn.pool2d``; a channel concat -> ``layerfuse.onednn.concat`` (one ``memcpy``
per piece and image: TVM's in-place concat only moves TVM kernels' outputs).

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

Layout (per tensor: plain NCHW or oneDNN's blocked ``nChw16c``, same size and Relax type).
Tensors that must share a layout form classes: a concat's inputs and output (per image,
channels ``[c, c + C)`` of an ``nChw16c`` tensor are the contiguous range ``[c*H*W, (c+C)*H*W)``
when ``c`` and ``C`` are multiples of 16, exactly as in NCHW, so the concat's copies are the
same bytes either way), a pool's src and dst, a residual and the output it is added to.
A class is blocked when every member is 4-d with ``C % 16 == 0``, made by a library call,
and read by library calls only (never by a TVM kernel or the caller) -- except that a
``C % 16 == 0`` tensor with 1x1 spatial has the same bytes in both layouts, so anyone may
read it. A conv reads either layout (``src_blocked``) and writes either (``dst_blocked``, a
bit per output piece); a plain src or dst is reordered inside the library call, and a plain
tensor read by several convs is reordered once (``layerfuse.onednn.to_blocked``). A tensor
with ``16 < C``, ``C % 16 != 0`` (MobileNet-V2's 24 channels) that convs with one output make
and only convs read is kept in padded ``nChw16c``: its Relax type becomes ``[N, ceil16(C), H,
W]``, the bytes oneDNN's padded layout takes (see ``_padded``). So reorders happen only where
a TVM kernel reads or writes a tensor next to a oneDNN layer (and at the split pieces of a
merged conv with such channel counts, or C < 16).

Residual in place: a ``conv2d_add`` whose residual nothing reads afterwards writes its result
into the residual's buffer (``call_tir_inplace`` of a TIR wrapper, see
:func:`residuals_in_place`): no copy of r per inference.

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
wherever oneDNN has it (tests). ``pass.layers`` lists
every choice ``{"layer", "tactic", "kernel" | "reason", "shape", "layout", "timing"}``: conv layers,
pools (``pool:<var>``, tactic ``onednn``), the classifier (``dense:<var>``: ``x @ w + b`` as a
oneDNN matmul) and concats (``concat:<var>``, tactic ``copy``, ``in-place``, or ``read by
prologues``).
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
from ...relax.fuse_prologue import PROLOGUE_PREFIX
from . import onednn

log = logging.getLogger(__name__)

ACT_CODES = {None: 0, "relu": 1, "leakyrelu": 1, "clip": 2, "silu": 3, "sigmoid": 4}
WINOGRAD_CHOICES = ("timed", "never", "always")
WINOGRAD_GAIN = 1.05  # Winograd is kept when direct takes at least this many times as long


@dataclass
class LayerChoice:
    """The tactic of one conv layer."""

    layer: str  # the fused function (or the bound variable of a bare conv)
    tactic: str  # "onednn" | "tvm"
    kernel: str = ""  # oneDNN's implementation name when "onednn"
    reason: str = ""  # why not oneDNN, when "tvm"
    shape: str = ""  # "x[1,64,56,56] w[64,64,3,3]"
    layout: str = ""  # "nchw>nChw16c": the src and dst bytes in the graph, when "onednn"
    timing: str = ""  # "direct 5.84 ms, winograd 2.15 ms": the algorithm choice, when timed

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
        wino[10], wino[11] = int(x_shape[1] % BLOCK == 0), int(w_shape[0] % BLOCK == 0)
        wino_kernel = onednn.implementation(x_shape, w_shape, wino, residual=residual)
        if wino_kernel.startswith(("ref", "unsupported")):
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
        op = _op(expr)
        if op in self._NUMPY and depth < 8:
            return np.asarray(self._NUMPY[op](*[self._evaluate(a, depth=depth + 1) for a in expr.args]))
        if op in ("relax.astype", "relax.reshape") and depth < 8 and static_shape(expr) is not None:
            value = self._evaluate(expr.args[0], depth=depth + 1)
            return value.astype(dtype_of(expr)).reshape(static_shape(expr))
        raise Refused("a clip bound is not a compile-time value")


def _op(value) -> str:
    return getattr(getattr(value, "op", None), "name", "") if isinstance(value, relax.Call) else ""


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
        op = _op(v)
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


def _prologue(bindings) -> Optional[tuple]:
    """(x, s, t, y) when the group starts ``y = relu(x * s + t)`` with per-channel ``s``, ``t``
    (InlinePrologue's pre-activation BatchNorm + ReLU), else None."""
    if len(bindings) < 4 or [_op(b.value) for b in bindings[:3]] != ["relax.multiply", "relax.add", "relax.nn.relu"]:
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
        if ep.pre is not None:  # conv2d_pre(x, s, t, W, b, attrs)
            c = static_shape(ep.data)[1]
            args[1:1] = [relax.op.reshape(self.visit_expr(e), [c]) for e in ep.pre]
        if ep.residual is not None:
            args.append(self.visit_expr(ep.residual))
        args.append(relax.ShapeExpr(attrs))
        return relax.call_dps_packed(func, args, relax.TensorType(list(out_shape), "float32"))


# ---------------------------------------------------------------------- data movement and layouts
_DPS = tvm.ir.Op.get("relax.call_dps_packed")
BLOCK = 16  # nChw16c
_CONVS = tuple(onednn.FUNCTIONS.values())


def _onednn_call(value) -> Optional[tuple[str, list]]:
    """(function name, argument list) of a call into the oneDNN tactic library."""
    if not isinstance(value, relax.Call) or not value.op.same_as(_DPS):
        return None
    name = str(getattr(value.args[0], "global_symbol", ""))
    if not name.startswith("layerfuse.onednn."):
        return None
    return name, list(value.args[1].fields)


def _bindings(func: relax.Function) -> list:
    return [b for block in func.body.blocks for b in block.bindings]


def _uses(func: relax.Function) -> dict:
    """var -> how many times the bindings and the result of ``func`` read it."""
    count: dict = {}
    for b in _bindings(func):
        for v in relax.analysis.free_vars(b.value):
            count[v] = count.get(v, 0) + 1
    for v in relax.analysis.free_vars(func.body.body):
        count[v] = count.get(v, 0) + 1
    return count


def merge_splits(func: relax.Function) -> relax.Function:
    """``split(conv(x), axis=1)`` of a horizontally merged oneDNN conv -> one call whose
    outputs are the pieces (``layerfuse.onednn.conv2d`` with k outputs: piece j is the conv
    with weight and bias rows of that piece): no split kernel, no copy."""
    values = {b.var: b.value for b in _bindings(func)}
    uses = _uses(func)
    chosen = {}
    for b in _bindings(func):
        v = b.value
        if _op(v) != "relax.split" or not isinstance(v.args[0], relax.Var) or int(v.attrs.axis) not in (1, -3):
            continue
        x = v.args[0]
        found = _onednn_call(values.get(x))
        if found is None or found[0] not in (onednn.FUNCTIONS["conv2d"], onednn.FUNCTIONS["conv2d_pre"]) or uses.get(x) != 1:
            continue
        name, args = found
        if int(args[-1].values[8]) != 1 or static_shape(x) is None or len(static_shape(x)) != 4:
            continue  # grouped convs keep the split
        chosen[v] = (name, args, list(b.var.ty.fields))
    return _Replace(chosen).visit_expr(func) if chosen else func


def _pool_attrs(value, x_shape, y_shape) -> Optional[list[int]]:
    """``layerfuse.onednn.pool2d``'s attrs for a pooling op that oneDNN computes alike, else None."""
    op = _op(value)
    if op == "relax.mean":
        axes = sorted(int(a) % 4 for a in (value.attrs.axis or []))
        if axes != [2, 3] or not value.attrs.keepdims:
            return None
        return [onednn.POOL_ALGORITHMS["avg"], x_shape[2], x_shape[3], 1, 1, 0, 0, 0, 0, 0]
    if op == "relax.nn.adaptive_avg_pool2d":
        if str(value.attrs.layout) != "NCHW" or str(value.attrs.out_layout) != "NCHW" or tuple(y_shape[2:]) != (1, 1):
            return None
        return [onednn.POOL_ALGORITHMS["avg"], x_shape[2], x_shape[3], 1, 1, 0, 0, 0, 0, 0]
    if op not in ("relax.nn.max_pool2d", "relax.nn.avg_pool2d"):
        return None
    a = value.attrs
    if str(a.layout) != "NCHW" or str(a.out_layout) != "NCHW" or any(int(d) != 1 for d in a.dilation):
        return None
    kh, kw = (int(k) for k in a.pool_size)
    sh, sw = (int(s) for s in a.strides)
    pad = [int(p) for p in a.padding]
    pad = pad * 2 if len(pad) == 2 else pad  # top, left, bottom, right
    # the bottom/right padding that gives the output size: the stated one, or more (ceil_mode)
    need = [(y_shape[2] - 1) * sh + kh - x_shape[2] - pad[0], (y_shape[3] - 1) * sw + kw - x_shape[3] - pad[1]]
    end = [max(pad[2], need[0]), max(pad[3], need[1])]
    if any((x_shape[2 + i] + pad[i] + end[i] - (kh, kw)[i]) // (sh, sw)[i] + 1 != y_shape[2 + i] for i in range(2)):
        return None
    if max(pad) >= min(kh, kw):
        return None
    if op == "relax.nn.max_pool2d":
        alg = "max"
    elif a.count_include_pad:
        if end != pad[2:]:
            return None  # ceil_mode's extra cells are not counted in ONNX, oneDNN would count them
        alg = "avg_include_pad"
    else:
        alg = "avg"
    return [onednn.POOL_ALGORITHMS[alg], kh, kw, sh, sw, *pad, 0]


def pools_and_concats(func: relax.Function, layers: list) -> relax.Function:
    """Pools and channel concats that read oneDNN tensors -> ``layerfuse.onednn.pool2d`` /
    ``layerfuse.onednn.concat`` (so the tensors around them can stay blocked)."""
    values = {b.var: b.value for b in _bindings(func)}
    made = set()  # tensors (or tuples of pieces) a oneDNN call makes
    chosen = {}
    for b in _bindings(func):
        v = b.value
        if _onednn_call(v) is not None:
            made.add(b.var)
            continue
        if isinstance(v, relax.TupleGetItem) and v.tuple_value in made:
            made.add(b.var)
            continue
        y_shape = static_shape(b.var)
        if _op(v) == "relax.concat":
            fields = v.args[0]
            fields = values.get(fields, fields) if isinstance(fields, relax.Var) else fields
            axis = int(v.attrs.axis) if v.attrs.axis is not None else 0
            if not isinstance(fields, relax.Tuple) or y_shape is None or len(y_shape) != 4 or axis not in (1, -3):
                continue
            items = list(fields.fields)
            if dtype_of(b.var) != "float32" or not all(isinstance(x, relax.Var) and static_shape(x) for x in items):
                continue
            if not any(x in made for x in items):
                continue  # TVM producers only: the lowering's in-place concat takes it
            chosen[v] = (onednn.CONCAT, items, relax.TensorType(list(y_shape), "float32"))
            made.add(b.var)
            layers.append(LayerChoice(f"concat:{b.var.name}", "copy", kernel="memcpy", shape=f"out{list(y_shape)}"))
            continue
        if not isinstance(v, relax.Call) or not v.args or v.args[0] not in made or dtype_of(b.var) != "float32":
            continue
        x_shape = static_shape(v.args[0])
        if x_shape is None or y_shape is None or len(x_shape) != 4 or len(y_shape) != 4:
            continue
        attrs = _pool_attrs(v, x_shape, y_shape)
        if attrs is None:
            continue
        kernel = onednn.pool_implementation(x_shape, y_shape, attrs)
        if kernel.startswith(("ref", "unsupported")):
            continue
        chosen[v] = (onednn.POOL, [v.args[0], relax.ShapeExpr(attrs)], relax.TensorType(list(y_shape), "float32"))
        made.add(b.var)
        layers.append(LayerChoice(f"pool:{b.var.name}", "onednn", kernel=kernel, shape=f"x{list(x_shape)} out{list(y_shape)}"))
    return _Replace(chosen).visit_expr(func) if chosen else func


@relax.expr_functor.mutator
class _Replace(relax.PyExprMutator):
    """Replace chosen calls (by identity) with ``call_dps_packed(name, args, out)``, args visited."""

    def __init__(self, chosen: dict) -> None:
        super().__init__()
        self.chosen = chosen

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new = self.chosen.get(call)
        if new is None:
            return super().visit_call_(call)
        name, args, out = new
        return relax.call_dps_packed(name, [self.visit_expr(a) for a in args], out)


class _Classes:
    """Union-find over tensors that must share one layout."""

    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, v):
        self.parent.setdefault(v, v)
        while self.parent[v] is not v:
            self.parent[v] = self.parent[self.parent[v]]
            v = self.parent[v]
        return v

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[ra] = rb


def assign_layouts(func: relax.Function, layers: list) -> relax.Function:
    """Choose plain or blocked bytes for every tensor that oneDNN calls make (see module doc)."""
    bindings = _bindings(func)
    calls = {}  # var -> (name, args)
    pieces: dict = {}  # tuple var -> {index: [piece vars]}
    producer: dict = {}  # tensor var -> "onednn"
    tvm_read: set = set()  # tensors a TVM kernel (or the caller) reads
    classes = _Classes()
    for b in bindings:
        v = b.value
        found = _onednn_call(v)
        if found is not None:
            calls[b.var] = found
            name, args = found
            if name == onednn.CONCAT:
                for a in args:
                    classes.union(a, b.var)
            elif name == onednn.POOL:
                classes.union(args[0], b.var)
            elif name == onednn.FUNCTIONS["conv2d_add"] and isinstance(args[3], relax.Var):
                classes.union(args[3], b.var)
            if not isinstance(b.var.ty, relax.TupleType):
                producer[b.var] = "onednn"
            continue
        if isinstance(v, relax.TupleGetItem) and v.tuple_value in calls:
            pieces.setdefault(v.tuple_value, {}).setdefault(int(v.index), []).append(b.var)
            producer[b.var] = "onednn"
            continue
        tvm_read.update(relax.analysis.free_vars(v))
    tvm_read.update(relax.analysis.free_vars(func.body.body))
    for parts in pieces.values():
        for same in parts.values():
            for other in same[1:]:
                classes.union(same[0], other)

    def can_block(var) -> bool:
        shape = static_shape(var)
        if shape is None or len(shape) != 4 or shape[1] % BLOCK != 0 or producer.get(var) != "onednn":
            return False
        if shape[2] * shape[3] == 1:
            return True  # C % 16 == 0 and 1x1: nChw16c and NCHW are the same bytes
        return isinstance(var, relax.DataflowVar) and var not in tvm_read

    members: dict = {}
    for v in list(classes.parent) + list(producer):
        members.setdefault(classes.find(v), set()).add(v)
    blocked = {v for root, vs in members.items() if all(can_block(m) for m in vs) for v in vs}
    for vs in members.values():
        plain = [m.name for m in vs if not can_block(m)]
        if plain and len(plain) < len(vs):
            log.debug("plain layout for %d tensors because of %s", len(vs), ", ".join(sorted(plain)[:4]))

    # A plain tensor that several oneDNN convs read: reordered once (to_blocked), not in each.
    data_readers: dict = {}
    for v, (name, args) in calls.items():
        x = args[0]
        if name in _CONVS and isinstance(x, relax.Var) and x not in blocked:
            data_readers.setdefault(x, []).append(v)
    shared = {
        x
        for x, rs in data_readers.items()
        if len(rs) >= 2 and static_shape(x) is not None and len(static_shape(x)) == 4 and static_shape(x)[1] % BLOCK == 0
    }
    def conv_flags(v, args, padded: set) -> tuple[int, int]:
        src = isinstance(args[0], relax.Var) and (args[0] in blocked or args[0] in shared or args[0] in padded)
        if isinstance(v.ty, relax.TupleType):
            parts = pieces.get(v, {})
            return int(src), sum(1 << j for j, vs in parts.items() if vs[0] in blocked)
        return int(src), int(v in blocked or v in padded)

    padded = _padded(members, calls, tvm_read, conv_flags)
    flags = {}  # call var -> (src flag, dst flag or mask)
    for v, (name, args) in calls.items():
        if name in _CONVS:
            flags[v] = conv_flags(v, args, padded)
        elif name == onednn.POOL:
            flags[v] = (int(v in blocked), int(v in blocked))
    _record_layouts(layers, calls, flags)
    by_call = {b.value: flags[b.var] for b in bindings if b.var in flags and any(flags[b.var])}
    resize = {b.value: _padded_type(b.var) for b in bindings if b.var in padded}
    return _SetLayouts(by_call, shared, resize).visit_expr(func) if by_call else func


def _padded(members: dict, calls: dict, tvm_read: set, conv_flags) -> set:
    """Tensors kept in nChw16c with their channels padded to a multiple of 16 (MobileNet-V2's
    24-channel stage): 16 < C, C % 16 != 0, made by a conv with one output and read only by
    convs (as their src, or conv2d_add's residual), never by TVM, the caller, a pool, a
    concat or a prologue -- all their class alike -- and every conv that touches one keeps an
    optimised kernel in that layout (``conv_flags(var, args, padded)``: the flags it gets; a
    class whose conv would get ``ref:`` stays plain). Their Relax type becomes [N, ceil16(C),
    H, W] (the bytes of oneDNN's padded nChw16c; the library takes C from the weights), so no
    conv reorders them to and from NCHW inside its call. (C < 16 is left plain: padding would
    multiply the reading conv's work more than the reorders cost.)"""
    simple = (onednn.FUNCTIONS["conv2d"], onednn.FUNCTIONS["conv2d_add"])
    readers: dict = {}  # var -> [(call name, argument position)]
    for name, args in calls.values():
        for k, a in enumerate(args):
            if isinstance(a, relax.Var):
                readers.setdefault(a, []).append((name, k))

    def can_pad(var) -> bool:
        shape = static_shape(var)
        if shape is None or len(shape) != 4 or shape[1] % BLOCK == 0 or shape[1] < BLOCK or shape[2] * shape[3] == 1:
            return False
        if var not in calls or calls[var][0] not in simple or not isinstance(var, relax.DataflowVar) or var in tvm_read:
            return False
        return all(name in simple and (k == 0 or (k == 3 and name == simple[1])) for name, k in readers.get(var, []))

    classes = [vs for vs in members.values() if all(can_pad(m) for m in vs)]
    padded = {v for vs in classes for v in vs}
    checked: dict = {}  # (conv var, flags) -> kernel
    changed = bool(padded)
    while changed:  # drop the classes of a conv whose kernel in the padded layout is a reference one
        changed = False
        for v, (name, args) in calls.items():
            if name not in simple or not (v in padded or args[0] in padded):
                continue
            attrs = [int(a) for a in args[-1].values]
            attrs[10], attrs[11] = conv_flags(v, args, padded)
            key = (v, attrs[10], attrs[11])
            if key not in checked:
                checked[key] = onednn.implementation(
                    static_shape(args[0]), static_shape(args[1]), attrs, residual=name == simple[1]
                )
            if checked[key].startswith(("ref", "unsupported")):
                padded -= {m for vs in classes if v in vs or args[0] in vs for m in vs}
                changed = True
    return padded


def _padded_type(var) -> relax.TensorType:
    n, c, h, w = static_shape(var)
    return relax.TensorType([n, -(-c // BLOCK) * BLOCK, h, w], "float32")


def _record_layouts(layers: list, calls: dict, flags: dict) -> None:
    """Tell each oneDNN LayerChoice (in call order) which layout its src and dst have."""
    convs = [c for c in layers if c.tactic == "onednn" and not c.layer.startswith(("pool:", "dense:"))]
    pools = [c for c in layers if c.tactic == "onednn" and c.layer.startswith("pool:")]
    conv_calls = [(v, found) for v, found in calls.items() if found[0] in _CONVS]
    pool_calls = [(v, found) for v, found in calls.items() if found[0] == onednn.POOL]
    for c, (v, (_, args)) in zip(pools, pool_calls):
        c.layout = "nChw16c" if flags[v][0] else "nchw"
        if flags[v][0]:  # the kernel oneDNN picks in that layout
            attrs = [int(x) for x in args[-1].values]
            attrs[9] = 1
            c.kernel = onednn.pool_implementation(static_shape(args[0]), static_shape(v), attrs)
    for c, (v, (name, args)) in zip(convs, conv_calls):
        src, dst = flags.get(v, (0, 0))
        n = len(v.ty.fields) if isinstance(v.ty, relax.TupleType) else 1
        outs = ",".join("nChw16c" if (dst >> j) & 1 else "nchw" for j in range(n))
        c.layout = f"{'nChw16c' if src else 'nchw'}>{outs}"
        if src or dst:  # the kernel oneDNN picks for these layouts
            attrs = [int(x) for x in args[-1].values]
            attrs[10], attrs[11] = src, dst
            weight = args[3] if name == onednn.FUNCTIONS["conv2d_pre"] else args[1]
            c.kernel = onednn.implementation(
                static_shape(args[0]), static_shape(weight), attrs, residual=name == onednn.FUNCTIONS["conv2d_add"]
            )


@relax.expr_functor.mutator
class _SetLayouts(relax.PyExprMutator):
    def __init__(self, by_call: dict, shared: set, resize: dict) -> None:
        super().__init__()
        self.by_call = by_call
        self.shared = shared  # plain tensors reordered once for their oneDNN readers
        self.resize = resize  # call -> its result's type with padded channels
        self.blocked_copy: dict = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        flags = self.by_call.get(call)
        if flags is None:
            return super().visit_call_(call)
        name = str(call.args[0].global_symbol)
        args = list(call.args[1].fields)
        attrs = [int(x) for x in args[-1].values]
        if name == onednn.POOL:
            attrs[9] = flags[0]
        else:
            attrs[10], attrs[11] = flags
        args[-1] = relax.ShapeExpr(attrs)
        x = args[0]
        args = [self.visit_expr(a) for a in args]
        if name in _CONVS and x in self.shared:
            if x not in self.blocked_copy:
                copy = relax.call_dps_packed(onednn.TO_BLOCKED, [args[0]], relax.TensorType(list(static_shape(x)), "float32"))
                self.blocked_copy[x] = self.builder_.emit(copy, f"{x.name}_nChw16c")
            args[0] = self.blocked_copy[x]
        ty_args = [self.resize[call]] if call in self.resize else call.ty_args
        return relax.Call(call.op, [call.args[0], relax.Tuple(args)], call.attrs, ty_args)


# ---------------------------------------------------------------------- prologues read the pieces
def prologues_read_pieces(func: relax.Function, layers: list) -> relax.Function:
    """``layerfuse.onednn.concat(x_1, ..., x_k)`` read only as the input of ``conv2d_pre``
    calls -> those calls read ``x_1, ..., x_k`` and the concat is dead (see the module doc):
    the prologue writes the normalised concatenation into its scratch, piece by piece.

    Left to :func:`concats_in_place` instead: a batch-1 concat whose every piece a oneDNN conv
    makes for it alone (each conv writes its channel range, no copy and one call for all)."""
    bindings = _bindings(func)
    values = {b.var: b.value for b in bindings}
    uses = _uses(func)
    calls = {b.var: _onednn_call(b.value) for b in bindings if _onednn_call(b.value) is not None}
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
    if _op(call) == "relax.call_tir_inplace" and call.args[0].name_hint.startswith(INPLACE_WRAPPER):
        return LibraryWrites(_nbytes(call), 0, 0)
    found = _onednn_call(call)
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
    if isinstance(expr, relax.Var) and expr in values and _op(values[expr]) == "relax.reshape":
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
    bindings = _bindings(func)
    values = {b.var: b.value for b in bindings}
    uses = _uses(func)
    calls = {b.var: _onednn_call(b.value) for b in bindings if _onednn_call(b.value) is not None}
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
        return _KINDS[name], args, attrs[11] & 1, None
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
        blocked = (attrs[11] >> j) & 1
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
    attrs[11] = sum(((attrs[11] >> j) & 1) << k for k, j in enumerate(keep))
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
        bindings = _bindings(func)
        made = {b.var for b in bindings if _onednn_call(b.value) is not None and not isinstance(b.var.ty, relax.TupleType)}
        readers: dict = {}  # var -> [(binding index, read by a tactic-library call)]
        for i, b in enumerate(bindings):
            for v in relax.analysis.free_vars(b.value):
                readers.setdefault(v, []).append((i, _onednn_call(b.value) is not None))
        for v in relax.analysis.free_vars(func.body.body):
            readers.setdefault(v, []).append((len(bindings), False))
        chosen = {}
        for i, b in enumerate(bindings):
            found = _onednn_call(b.value)
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
        mod[gv] = _ResidualInPlace(chosen).visit_expr(mod[gv])
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


@relax.expr_functor.mutator
class _ResidualInPlace(relax.PyExprMutator):
    def __init__(self, chosen: dict) -> None:
        super().__init__()
        self.chosen = chosen

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new = self.chosen.get(call)
        if new is None:
            return super().visit_call_(call)
        gv, args, out = new
        return relax.op.call_tir_inplace(gv, relax.Tuple([self.visit_expr(a) for a in args]), inplace_indices=[3], out_ty=out)


# ---------------------------------------------------------------------- the classifier
def dense_layers(func: relax.Function, layers: list) -> relax.Function:
    """``add(matmul(x, w), b)`` (x [N, K], w [K, M], b [M] or [1, M], float32; the imported
    Gemm / Linear with its weight transposed) and a bare 2-d ``matmul`` -> ``layerfuse.onednn.dense``
    (a oneDNN matmul primitive; TVM's untuned matmul is a plain loop nest)."""
    bindings = _bindings(func)
    values = {b.var: b.value for b in bindings}
    uses = _uses(func)
    chosen = {}
    taken = set()  # matmuls folded into an add
    for b in bindings:
        v = b.value
        if _op(v) == "relax.add" and isinstance(v.args[0], relax.Var) and _op(values.get(v.args[0])) == "relax.matmul":
            mm, bias = values[v.args[0]], v.args[1]
            m_shape = static_shape(v.args[0])
            if uses.get(v.args[0]) != 1 or m_shape is None or static_shape(bias) not in ((m_shape[-1],), (1, m_shape[-1])):
                continue
            plan = _dense(mm, b.var, bias, layers)
            if plan is not None:
                chosen[v] = plan
                taken.add(v.args[0])
    for b in bindings:
        if _op(b.value) == "relax.matmul" and b.var not in taken:
            shape = static_shape(b.var)
            if shape is not None and len(shape) == 2:
                plan = _dense(b.value, b.var, relax.const(np.zeros([shape[1]], "float32")), layers)
                if plan is not None:
                    chosen[b.value] = plan
    return _Replace(chosen).visit_expr(func) if chosen else func


def _dense(mm: relax.Call, out, bias, layers: list) -> Optional[tuple]:
    x, w = mm.args[0], mm.args[1]
    xs, ws, ys = static_shape(x), static_shape(w), static_shape(out)
    if xs is None or ws is None or ys is None or len(xs) != 2 or len(ws) != 2 or xs[1] != ws[0] or ys != (xs[0], ws[1]):
        return None
    if any(dtype_of(e) != "float32" for e in (x, w, bias, out)):
        return None
    kernel = onednn.dense_implementation(xs[0], xs[1], ws[1])
    if kernel.startswith(("ref", "unsupported")):
        return None
    layers.append(LayerChoice(f"dense:{out.name}", "onednn", kernel=kernel, shape=f"x{list(xs)} w{list(ws)}"))
    return onednn.DENSE, [x, w, relax.op.reshape(bias, [ws[1]])], relax.TensorType(list(ys), "float32")
