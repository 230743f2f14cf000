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

with ``attrs`` an :class:`.abi.ConvAttrs` record (geometry, the activation's code in
:data:`.abi.ACTIVATIONS`, alpha and beta as float32 bit patterns, the layouts' block widths
``src_block`` / ``dst_block``: 0 plain, 8 or 16, set by ``assign_layouts``, and the
algorithm) carried as one ``R.shape``. The epilogue is what the fusion pass itself matched
(:func:`tvm_layerfuse.relax.fuse_epilogue.match_group`, its named patterns): relu,
LeakyRelu, clip, silu, sigmoid, HardSwish, HardSigmoid and GELU (erf or tanh) become
oneDNN post-ops; multiplies before the activation, adds after it and PReLU stay with TVM.
A squeeze-and-excitation gate ``act(conv(x, W) + b) * g`` (``g`` a map of the conv's
``[N, C, 1, 1]``) has no oneDNN post-op, as its output is larger than the conv's: the conv
and its activation become the library call and the multiply stays a Relax op after it (one
launch more than TVM's fused kernel, a conv on the library instead of TVM's loop nest), which
:mod:`.onednn_scale` then gives to the library's ``scale_channels`` where ``g`` is library-made::

    y = act(conv2d(x, W) + b) * g  ==  R.multiply(R.call_dps_packed("layerfuse.onednn.conv2d", ...), g)
A bare conv gets ``b = 0``. ``reshape(b)`` and the weight expressions depend
on weights only, so ``LiftTransformParams`` computes them at compile time.

After the conv layers, the pass moves the data around them (each step a function of its
own, applied per Relax function in this order):

- :mod:`.onednn_layout`: ``merge_splits`` (a merged conv's split pieces as its outputs),
  :func:`.onednn_shuffle.channel_shuffles` (ShuffleNet's channel shuffles of library tensors,
  each channel range read one gather, ``shuffle:<var>``), ``dense_layers`` (the classifier),
  :func:`.onednn_scale.channel_scales` (squeeze-and-excitation gates of library tensors,
  ``scale:<var>``), ``pools_and_concats`` (pools and concats that read oneDNN tensors),
  ``assign_layouts`` (``nChw16c`` / ``nChw8c``, the block width of this CPU's kernels, between
  library calls), :func:`.onednn_se.squeeze_excitations` (a gate's pool and two one-pixel convs
  as one ``se_gate`` call, ``se:<var>``);
- :mod:`.onednn_inplace`: ``prologues_read_pieces`` (DenseNet's concats never materialised),
  ``concats_in_place`` (convs write their channel ranges of a concat), ``residuals_in_place``
  (a residual conv writes into its residual's buffer);
- :mod:`.verify_layouts`: every blocked tensor is read only by calls whose flags say so;
- :mod:`.tvm_pools`: ``pools_on_tvm`` (every pool runs as TVM's kernel in its tensors' layout,
  a blocked one on views of the library's bytes).

The tactic is chosen per layer by a stated rule, without timing: ``onednn`` when the layer
is float32 NCHW/OIHW with a per-channel bias, no element-wise ``mul`` and no run-time clip
bounds, and when oneDNN on this machine gives it an optimised kernel (``impl_info_str`` not
``ref:``); otherwise ``tvm`` (TVM's own kernel), with the reason. Within ``onednn`` the conv
algorithm (``algorithm``: 0 direct, 1 oneDNN's Winograd, 2 / 3 the library's Winograd
kernels, ``abi.CONV_ALGORITHMS``) is chosen by timing, as TensorRT times its tactics: where a
Winograd kernel fits the layer (stride 1, no groups: oneDNN's for 3x3 where it has one, which
oneDNN 2.6 has for AVX-512 only; else each of the library's forms for the kernel shape,
``abi.OWN_WINOGRAD_KERNELS``, that ``implementation`` confirms here), each is timed against
the direct conv on this machine at compile time (``layerfuse.onednn.time_conv``: the fastest
of 7 runs each, the two in turn, so that other processes on the machine cannot decide the
choice; on one thread and on the machine's count, ``timing_threads``, as oneDNN 2.6 makes
other kernels for another count) and the Winograd whose time over the direct conv's, as a
geometric mean over those counts, is least is kept when it is at least ``WINOGRAD_GAIN``
faster by that mean. Winograd computes the same convolution with fewer multiplies (F(4x4, 3x3): 36 instead
of 144 per 4x4 output tile and channel pair); its rounding differs from the direct sum by
about 1e-6 relative. ``UseOneDNNConv(winograd="never")`` keeps every layer direct,
``"always"`` takes the first Winograd kernel that fits (tests) and records, where none does,
why the layer stays direct (``timing``: ``NO_WINOGRAD``). ``pass.layers`` lists
every choice ``{"layer", "tactic", "kernel" | "reason", "shape", "layout", "timing"}``: conv layers,
pools (``pool:<var>``, tactic ``tvm``: :mod:`.tvm_pools`), the classifier (``dense:<var>``: ``x @ w + b`` as a
oneDNN matmul) and concats (``concat:<var>``, tactic ``copy``, ``in-place``, or ``read by
prologues``).
"""

from __future__ import annotations

import logging
import math
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
from ...relax.fuse_epilogue import PREFIX, RESIDUALS, match_group
from ...relax.fuse_prologue import PROLOGUE_PREFIX
from . import abi
from .choice import LayerChoice
from .onednn_inplace import concats_in_place, prologues_read_pieces, residuals_in_place
from .onednn_layout import assign_layouts, dense_layers, merge_splits, pools_and_concats
from .onednn_scale import channel_scales
from .onednn_se import squeeze_excitations
from .onednn_shuffle import channel_shuffles
from .oracle import LibraryOracle, Oracle, current_oracle, use_oracle
from .tvm_pools import pools_on_tvm
from .verify_layouts import check_layouts

__all__ = ["UseOneDNNConv", "LayerChoice", "Refused", "WINOGRAD_CHOICES", "WINOGRAD_GAIN", "Oracle", "LibraryOracle"]

log = logging.getLogger(__name__)

WINOGRAD_CHOICES = ("timed", "never", "always")
WINOGRAD_GAIN = 1.05  # Winograd is kept when direct takes at least this many times as long
NO_WINOGRAD = "winograd (always): neither oneDNN nor the library has a Winograd kernel for it here, direct"


def timing_threads() -> tuple[int, ...]:
    """The thread counts a conv's algorithms are timed at: one, and this machine's OpenMP count
    (``OMP_NUM_THREADS`` where it is a positive integer, else the CPUs this process may run on)
    where that is more: oneDNN 2.6 makes other kernels for another count."""
    import os

    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    count = int(value) if value.isdigit() and int(value) > 0 else len(os.sched_getaffinity(0))
    return (1, count) if count > 1 else (1,)


@dataclass
class _Epilogue:
    conv: relax.Call
    data: relax.Expr
    weight: relax.Expr
    bias: Optional[relax.Expr] = None
    residual: Optional[relax.Expr] = None
    act: str = "none"  # a key of abi.ACTIVATIONS
    alpha: float = 0.0
    beta: float = 0.0
    pre: Optional[tuple] = None  # (s, t): the conv reads relu(data * s + t), s and t per channel
    # (g, conv's first): a squeeze-and-excitation gate after the activation, which oneDNN has no
    # post-op for; the layer's output is the conv's times g, by TVM
    gate: Optional[tuple] = None


class Refused(Exception):
    """A layer oneDNN does not take; the message is the reason."""


def _kernel_refused(kernel: str) -> bool:
    return kernel.startswith(("ref", "unsupported"))


@tvm.transform.module_pass(opt_level=0, name="UseOneDNNConv")
class UseOneDNNConv:
    """Replace conv layers by calls into the oneDNN tactic library (see module doc).

    ``params`` gives the values of ``main``'s weight parameters (clip bounds may be
    parameters of an unbound module); ``only`` restricts the layers that may use oneDNN
    (names as in ``pass.layers``), None allows all; ``pieces=False`` keeps the concats that
    conv prologues read (:func:`prologues_read_pieces` off: the layout before it, to compare).
    ``oracle``: what the pass asks the library (kernel names, timings), by default
    :class:`LibraryOracle` (the library loaded in this process); tests give one of their own
    to run the rewrites where oneDNN is absent.
    """

    def __init__(
        self,
        *,
        params: Optional[Mapping[str, Any]] = None,
        only: Optional[set] = None,
        winograd: str = "timed",
        pieces: bool = True,
        oracle: Optional[Oracle] = None,
    ) -> None:
        if winograd not in WINOGRAD_CHOICES:
            raise ValueError(f"winograd={winograd!r}; expected one of {', '.join(WINOGRAD_CHOICES)}")
        self.params = dict(params or {})
        self.only = only
        self.winograd = winograd
        self.pieces = pieces
        self.oracle = oracle
        self.timings: dict[tuple, tuple[float, float]] = {}  # (x, w, attrs, residual, threads) -> (direct, winograd) ms
        self.layers: list[LayerChoice] = []
        self.bound: dict = {}  # var -> value in the function being rewritten (clip bounds)
        self.residuals: list[tuple[str, str]] = []  # (conv2d_add's variable, "in-place" | why it copies)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        oracle = self.oracle if self.oracle is not None else LibraryOracle()
        with use_oracle(oracle):
            return self._transform(mod)

    def _transform(self, mod: tvm.IRModule) -> tvm.IRModule:
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
                mod[gv] = channel_shuffles(func, self.layers)
        mod = relax.transform.DeadCodeElimination()(mod)  # the shuffles' concatenations, unread now
        for gv, func in relax_functions(mod):
            if not is_primitive(func):
                func = channel_scales(dense_layers(func, self.layers), self.layers)
                func = assign_layouts(pools_and_concats(func, self.layers), self.layers)
                mod[gv] = squeeze_excitations(func, self.layers)
        for gv, func in relax_functions(mod):
            if not is_primitive(func):
                if self.pieces:
                    func = prologues_read_pieces(func, self.layers)
                mod[gv] = concats_in_place(func, self.layers)
        mod = relax.transform.DeadCodeElimination()(mod)
        self.residuals = []
        mod = residuals_in_place(mod, self.residuals)
        check_layouts(mod)  # every blocked tensor read only where the reader's flags say so
        for gv, func in relax_functions(mod):
            if not is_primitive(func):
                mod[gv] = pools_on_tvm(func, self.layers)
        used = sum(c.tactic == "onednn" for c in self.layers)
        log.info("oneDNN tactic for %d of %d conv layers", used, len(self.layers))
        return mod

    # ------------------------------------------------------------------ one layer
    def choose(self, name: str, ep: _Epilogue, out_shape) -> Optional[tuple[abi.LibraryCall, abi.ConvAttrs]]:
        """(library call, attrs) when oneDNN takes the layer, else None."""
        x_shape, w_shape = static_shape(ep.data), static_shape(ep.weight)
        shape = f"x{list(x_shape) if x_shape else '?'} w{list(w_shape) if w_shape else '?'}"
        residual = ep.residual is not None
        try:
            if self.only is not None and name not in self.only:
                raise Refused("not selected for oneDNN")
            if ep.pre is not None and residual:
                raise Refused("a prologue and a residual in one layer")
            attrs = self._attrs(ep, x_shape, w_shape, out_shape)
            kernel = current_oracle().conv_kernel(x_shape, w_shape, attrs, residual=residual)
            if _kernel_refused(kernel):
                raise Refused(f"oneDNN has only a reference kernel for it ({kernel})")
        except Refused as r:
            self.layers.append(LayerChoice(name, "tvm", reason=str(r), shape=shape))
            return None
        attrs, kernel, timing = self._algorithm(attrs, kernel, x_shape, w_shape, residual=residual)
        attrs = attrs.replace(layer=len(self.layers))  # unique in the module: the report's and the library's key
        self.layers.append(LayerChoice(name, "onednn", kernel=kernel, shape=shape, timing=timing, id=attrs.layer))
        call = abi.CONV2D_PRE if ep.pre is not None else abi.CONV2D_ADD if residual else abi.CONV2D
        return call, attrs

    def _algorithm(self, attrs: abi.ConvAttrs, kernel: str, x_shape, w_shape, *, residual: bool):
        """(attrs with the conv algorithm chosen, kernel, timing text) for this layer."""
        shape = tuple(w_shape[2:])
        if self.winograd == "never" or shape not in abi.OWN_WINOGRAD_KERNELS or attrs.strides != (1, 1):
            return attrs, kernel, ""
        if attrs.dilation != (1, 1) or attrs.groups != 1:
            return attrs, kernel, ""
        # timed in the layout the layer will most likely get (blocked where C and O allow it)
        oracle = current_oracle()
        width = oracle.block_width()
        layout = dict(
            src_block=width if width and x_shape[1] % width == 0 else 0,
            dst_block=width if width and w_shape[0] % width == 0 else 0,
        )
        # oneDNN's Winograd (3x3; AVX-512 only in oneDNN 2.6) and the library's forms that fit
        # (AVX2: every shape; AVX-512: nChw16c). Beside oneDNN's 3x3 kernels the library's
        # F(4x4, 3x3) is not timed: it rounds further from the exact sum than oneDNN's
        # (Inception-v3: 1.3e-4 from onnxruntime against 4e-5)
        candidates = []
        if shape == (3, 3):
            wino = attrs.replace(algorithm=abi.CONV_ALGORITHMS["winograd"], **layout)
            wino_kernel = oracle.conv_kernel(x_shape, w_shape, wino, residual=residual)
            if not _kernel_refused(wino_kernel):
                candidates.append((wino, wino_kernel))
        beside_onednn = bool(candidates)
        for algorithm in abi.OWN_WINOGRAD_KERNELS[shape]:
            if beside_onednn and algorithm == abi.CONV_ALGORITHMS["own_winograd_4x4"]:
                continue
            own = attrs.replace(algorithm=algorithm, **layout)
            own_kernel = oracle.conv_kernel(x_shape, w_shape, own, residual=residual)
            if abi.is_own_winograd(own_kernel):
                candidates.append((own, own_kernel))
        if not candidates:
            if self.winograd == "always":  # asked for, not there: direct, and the reason recorded
                return attrs, kernel, NO_WINOGRAD
            return attrs, kernel, ""
        if self.winograd == "always":
            wino, wino_kernel = candidates[0]
            return attrs.replace(algorithm=wino.algorithm), wino_kernel, "winograd (always)"
        best = None  # (Winograd / direct over the thread counts, attrs, kernel, [(threads, direct ms, Winograd ms)])
        counts = timing_threads()
        for wino, wino_kernel in candidates:
            times = []
            for threads in counts:
                key = (tuple(x_shape), tuple(w_shape), tuple(wino.values()), residual, threads)
                if key not in self.timings:
                    direct = wino.replace(algorithm=0)
                    self.timings[key] = oracle.time_conv(x_shape, w_shape, direct, wino, residual=residual, threads=threads)
                times.append((threads, *self.timings[key]))
            ratio = math.prod(t_wino / t_direct for _, t_direct, t_wino in times) ** (1.0 / len(times))
            if best is None or ratio < best[0]:
                best = (ratio, wino, wino_kernel, times)
        ratio, wino, wino_kernel, times = best
        timing = "; ".join(
            f"direct {t_direct:.3f} ms, winograd {t_wino:.3f} ms" + (f" at {threads} threads" if threads > 1 else "")
            for threads, t_direct, t_wino in times
        )
        if ratio <= 1.0 / WINOGRAD_GAIN:
            return attrs.replace(algorithm=wino.algorithm), wino_kernel, timing
        return attrs, kernel, timing

    def _attrs(self, ep: _Epilogue, x_shape, w_shape, out_shape) -> abi.ConvAttrs:
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
        if min(strides + dilation + [int(a.groups)]) < 1:
            raise Refused(f"strides {strides}, dilation {dilation}, groups {int(a.groups)}: each must be >= 1")
        # the output size oneDNN will compute: (in + pad - ((k - 1) * dilation + 1)) // stride + 1
        want = [
            (x_shape[2 + i] + padding[i] + padding[2 + i] - ((w_shape[2 + i] - 1) * dilation[i] + 1)) // strides[i] + 1
            for i in range(2)
        ]
        if list(out_shape[2:]) != want or min(want) < 1 or out_shape[1] != w_shape[0] or out_shape[0] != x_shape[0]:
            raise Refused(f"the conv's output {list(out_shape)} is not the {want} oneDNN computes")
        return abi.ConvAttrs.make(
            strides=strides, padding=padding, dilation=dilation, groups=int(a.groups), act=ep.act, alpha=ep.alpha, beta=ep.beta
        )

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
            inner, *_ = expr.args
            value = self._evaluate(inner, depth=depth + 1)
            return value.astype(dtype_of(expr)).reshape(static_shape(expr))
        raise Refused("a clip bound is not a compile-time value")



F32 = np.finfo(np.float32)


def parse_group(func: relax.Function, args, chooser: UseOneDNNConv) -> _Epilogue:
    """The conv epilogue of a ``layerfuse_conv2d_*`` (or ``layerfuse_bn_relu_*``) function, its
    operands as caller expressions: what :func:`.fuse_epilogue.match_group` (the fusion pass's
    own patterns) matched, each activation turned into the library's post-op
    (:data:`.abi.ACTIVATIONS`) or refused with the reason."""
    arg_of = dict(zip(func.params, args))

    def outer(e):
        return arg_of.get(e, e)

    composite = str(func.attrs["Composite"])
    pre = None
    template = composite
    if composite.startswith(PROLOGUE_PREFIX):
        pre = _prologue(func)
        template = "layerfuse_" + composite.removeprefix(PROLOGUE_PREFIX)
    var2val = relax.analysis.get_var2val(func)
    result = var2val.get(func.body.body)
    if template == PREFIX and op_name(result) == "relax.nn.conv2d":  # a bare conv after a prologue
        data, weight = result.args
        notes = {"conv": result, "data": data, "weight": weight}
        residual_kind, activation = None, None
    else:
        m = match_group(func, template=template)
        if m is None:
            raise Refused(f"the group's body ({template}) is none of the epilogue patterns")
        notes, residual_kind, activation = dict(m.notes), m.residual, m.activation
    conv = notes["conv"]
    data = notes["data"]
    if pre is not None:
        x, s, t, y = pre
        if not (data.same_as(y) or data.same_as(var2val.get(y))):  # (the match may give the bound value)
            raise Refused("the conv does not read the prologue's result")
        data = x
    ep = _Epilogue(conv=conv, data=outer(data), weight=outer(notes["weight"]))
    if pre is not None:
        ep.pre = (outer(s), outer(t))
    chain = [conv, notes.get("bias_add")]
    if "bias" in notes:
        if not _is_bias(notes["bias"], ep):
            raise Refused("the add after the conv is not a per-channel bias")
        ep.bias = outer(notes["bias"])
    if residual_kind is not None:
        r = notes["residual"]
        r_value = var2val.get(r, r) if isinstance(r, relax.Var) else r
        if any(c is not None and r_value.same_as(c) for c in chain):
            raise Refused(f"the group's {RESIDUALS[residual_kind].split('.')[-1]} reads the conv's result twice")
        if r not in arg_of and not isinstance(r, tvm.ir.expr.Constant):  # e.g. Sum(conv, x, conv): conv + (conv + x)
            raise Refused(f"the group's {RESIDUALS[residual_kind].split('.')[-1]} operand is computed inside the group")
        if residual_kind == "gate":
            # after the activation: the conv and its activation on oneDNN, the multiply on TVM's kernel
            _, second = notes["residual_op"].args
            ep.gate = (outer(r), _reads(second, r, var2val))
        elif residual_kind != "add":
            raise Refused(f"oneDNN has no post-op for the {residual_kind} epilogue here")
        else:
            ep.residual = outer(r)
    if activation is not None:
        ep.act, ep.alpha, ep.beta = _post_op(activation, notes, lambda e: chooser.constant(e, arg_of))
    return ep


def _reads(arg, r, var2val) -> bool:
    """``arg`` is the operand ``r`` (as matched: the variable or its bound value)."""
    return arg.same_as(r) or (isinstance(arg, relax.Var) and var2val.get(arg, arg).same_as(r))


def _near(value: float, want: float) -> bool:
    return abs(value - want) <= 1e-6 * max(1.0, abs(want))


def _post_op(activation: str, notes: Mapping, const) -> tuple[str, float, float]:
    """(library activation, alpha, beta) of a matched activation (``const``: a note's value)."""
    act = notes["act"]
    if activation == "relu":
        return "relu", 0.0, 0.0
    if activation == "leakyrelu":
        return "relu", float(act.attrs.alpha), 0.0
    if activation in ("silu", "sigmoid"):
        return activation, 0.0, 0.0
    if activation == "clip":
        lo = const(notes["lo"]) if "lo" in notes else float(F32.min)
        hi = const(notes["hi"]) if "hi" in notes else float(F32.max)
        return "clip", lo, hi
    if activation == "hardsigmoid":  # clip(a*z + b, 0, 1): linear(a, b), then clip [0, 1]
        if not (_near(const(notes["hsig_lo"]), 0.0) and _near(const(notes["hsig_hi"]), 1.0)):
            raise Refused("a HardSigmoid whose clip is not [0, 1]")
        return "hardsigmoid", const(notes["hsig_a"]), const(notes["hsig_b"])
    if activation == "hardswish":  # oneDNN's is x * relu6(x + 3) / 6, constants fixed
        if "hs_a" in notes:
            wanted = {"hs_a": 1 / 6, "hs_b": 0.5, "hs_lo": 0.0, "hs_hi": 1.0}
        else:
            wanted = {"hs_add": 3.0, "hs_lo": 0.0, "hs_hi": 6.0, "hs_div": 6.0}
        if not all(_near(const(notes[k]), v) for k, v in wanted.items()):
            raise Refused("a HardSwish-like epilogue with other constants than HardSwish's")
        return "hardswish", 0.0, 0.0
    if activation == "gelu":
        op = op_name(act)
        if op == "relax.nn.gelu":
            return "gelu_erf", 0.0, 0.0
        if op == "relax.nn.gelu_tanh":
            return "gelu_tanh", 0.0, 0.0
        wanted = {"gelu_sqrt2": 2**0.5, "gelu_one": 1.0, "gelu_half": 0.5}
        if not all(_near(const(notes[k]), v) for k, v in wanted.items()):
            raise Refused("a GELU-like epilogue with other constants than GELU's")
        return "gelu_erf", 0.0, 0.0
    raise Refused(f"oneDNN has no post-op for {activation} here")


def _prologue(func: relax.Function) -> tuple:
    """(x, s, t, y) of the group's leading ``y = relu(x * s + t)`` with per-channel ``s``, ``t``
    (InlinePrologue's pre-activation BatchNorm + ReLU); refused otherwise."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    if len(bindings) < 4:
        raise Refused("the prologue group has no conv after its prologue")
    first, second, third = bindings[:3]
    if [op_name(b.value) for b in (first, second, third)] != ["relax.multiply", "relax.add", "relax.nn.relu"]:
        raise Refused("the group does not start with relu(x * s + t)")
    x, s = first.value.args
    mul, t = second.value.args
    (added,) = third.value.args
    x_shape = static_shape(x)
    if x_shape is None or len(x_shape) != 4:
        raise Refused("the prologue's input is not a static 4-d tensor")
    per_channel = ((1, x_shape[1], 1, 1), (x_shape[1], 1, 1))
    if static_shape(s) not in per_channel or static_shape(first.var) != x_shape:
        raise Refused("the prologue's scale is not per channel")
    if not mul.same_as(first.var) or static_shape(t) not in per_channel or not added.same_as(second.var):
        raise Refused("the prologue is not relu(x * s + t) with a per-channel shift")
    return x, s, t, third.var


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
            data, weight = call.args
            new = self._replace(name, call, lambda: _Epilogue(conv=call, data=data, weight=weight))
        return super().visit_call_(call) if new is None else new

    def _replace(self, name: str, call: relax.Call, parse) -> Optional[relax.Expr]:
        out_shape = static_shape(call)
        try:
            ep = parse()
        except Refused as r:
            self.chooser.layers.append(LayerChoice(name, "tvm", reason=str(r)))
            return None
        if ep.gate is not None:
            out_shape = static_shape(ep.conv)  # the library's output: the gate broadcasts beyond it
        chosen = self.chooser.choose(name, ep, out_shape)
        if chosen is None:
            return None
        library_call, attrs = chosen
        o = static_shape(ep.weight)[0]
        if ep.bias is not None:
            bias = relax.op.reshape(self.visit_expr(ep.bias), [o])
        else:
            bias = relax.const(np.zeros([o], "float32"))
        roles = {"input": self.visit_expr(ep.data), "weight": self.visit_expr(ep.weight), "bias": bias}
        if ep.pre is not None:  # conv2d_pre(x, s, t, W, b, attrs)
            c = static_shape(ep.data)[1]
            roles["scale"], roles["shift"] = (relax.op.reshape(self.visit_expr(e), [c]) for e in ep.pre)
        if ep.residual is not None:
            roles["residual"] = self.visit_expr(ep.residual)
        y = abi.make(library_call, attrs=attrs, **roles).expr(relax.TensorType(list(out_shape), "float32"))
        if ep.gate is None:
            return y
        g, conv_first = ep.gate
        g = self.visit_expr(g)
        return relax.op.multiply(y, g) if conv_first else relax.op.multiply(g, y)
