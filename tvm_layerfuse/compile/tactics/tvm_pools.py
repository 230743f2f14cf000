"""Pools between library tensors run as TVM's pool kernels, in the layout the library's
tensors have (a step of :class:`.use_onednn.UseOneDNNConv`, after the layouts are assigned
and checked: the ``layerfuse.onednn.pool2d`` calls that ``pools_and_concats`` made are what
lets a pool's src and dst join a layout class there).

A pool call whose src and dst are ``nChwBc`` (``attrs.block == B``) reads and writes bytes
laid out as ``[N, C/B, H, W, B]``. Relax types them ``[N, C, H, W]`` (the same size), so a
row-major reshape is exactly that reinterpretation, and::

    pool2d_library(x, block=B)  ==  reshape(pool_NCHWBc(reshape(x, [N, C/B, H, W, B])), [N, C, OH, OW])
    pool2d_library(x, block=0)  ==  pool_NCHW(x)

(bytes for bytes: both reshapes are views, no kernel). ``pool_NCHWBc`` is Relax's
``max_pool2d`` / ``avg_pool2d`` with ``layout = "NCHW{B}c"``, the call's top and left padding
and, bottom and right, the padding that gives the call's output size (the stated one, or
more: ``ceil_mode``'s extra cells, which neither counts in an average: ``_pool_attrs`` keeps
such pools off ``count_include_pad``), which TVM lowers and the blocked pool rule schedules
(:mod:`tvm_layerfuse.compile.schedules.reduction`: vector lanes along the block, a parallel
outer loop, the padding read through a bounds check instead of a padded copy). oneDNN 2.6's
``jit:avx2`` pooling took 2.3-5.5x as long as that kernel on every pool of GoogLeNet (single
thread, ``DNNL_VERBOSE`` against the kernel's own time), and for the plain pools seen here it
picks a scalar loop (``simple_nchw``), so every pool is TVM's.
"""

from __future__ import annotations

from tvm import relax

from ...relax._ir import static_shape
from . import abi
from .choice import LayerChoice
from .onednn_layout import ReplaceCalls, bindings_of

BLOCKED = "a blocked pool: TVM's NCHW{b}c kernel reads the library's nChw{b}c bytes in place"
PLAIN = "a plain pool: TVM's scheduled kernel"


def _pool(x: relax.Expr, attrs: abi.PoolAttrs, out_shape) -> relax.Expr:
    """``attrs``' pool of ``x`` (``[N, C, H, W]``; ``nChwBc`` bytes where ``attrs.block``), on
    its blocked view where blocked."""
    n, c, h, w = static_shape(x)
    oh, ow = out_shape[2:]
    b = attrs.block
    view = relax.op.reshape(x, [n, c // b, h, w, b]) if b else x
    bottom = max(attrs.pad_bottom, (oh - 1) * attrs.stride_h + attrs.kernel_h - h - attrs.pad_top)
    right = max(attrs.pad_right, (ow - 1) * attrs.stride_w + attrs.kernel_w - w - attrs.pad_left)
    kw = dict(
        pool_size=(attrs.kernel_h, attrs.kernel_w),
        strides=(attrs.stride_h, attrs.stride_w),
        padding=(attrs.pad_top, attrs.pad_left, bottom, right),
        layout=f"NCHW{b}c" if b else "NCHW",
    )
    if attrs.alg == abi.POOL_ALGORITHMS["max"]:
        pooled = relax.op.nn.max_pool2d(view, **kw)
    else:
        pooled = relax.op.nn.avg_pool2d(view, count_include_pad=attrs.alg == abi.POOL_ALGORITHMS["avg_include_pad"], **kw)
    return relax.op.reshape(pooled, list(out_shape)) if b else pooled


def pools_on_tvm(func: relax.Function, layers: list[LayerChoice]) -> relax.Function:
    """Every ``layerfuse.onednn.pool2d`` call of ``func`` -> TVM's pool in its layout (on
    views of the same bytes where blocked); its ``pool:<var>`` choice in ``layers`` says so."""
    by_name = {c.layer: c for c in layers}
    chosen = {}
    for b in bindings_of(func):
        bound = abi.parse_call(b.value)
        if bound is None or bound.call is not abi.POOL2D:
            continue
        chosen[b.value] = (bound.attrs, [bound.args.inputs[0]], static_shape(b.var))
        choice = by_name.get(f"pool:{b.var.name}")
        if choice is not None:
            choice.tactic, choice.kernel = "tvm", ""
            choice.reason = BLOCKED.format(b=bound.attrs.block) if bound.attrs.block else PLAIN
    if not chosen:
        return func

    def build(attrs, args, out):
        (x,) = args
        return _pool(x, attrs, out)

    return ReplaceCalls(chosen, build=build).visit_expr(func)
