"""Squeeze-and-excitation gates on the tactic library, in the layout of the convs around them
(a step of :class:`.use_onednn.UseOneDNNConv`, before the pools and the layouts).

A gate multiplies a tensor ``x`` that a library call makes (``[N, C, H, W]``, H x W > 1: the
depthwise conv's output in MobileNetV3's, EfficientNet's and MnasNet's blocks) by a factor
per image and channel ``g`` (``[N, C, 1, 1]``: the excitation's sigmoid)::

    multiply(x, g)[n, c, h, w]  ==  x[n, c, h, w] * g[n, c, 0, 0]  ==  scale_channels(x, g)[n, c, h, w]

``layerfuse.onednn.scale_channels`` computes it in either layout of ``x`` and the product
(``ScaleAttrs.block``, set by ``assign_layouts``): in ``nChwBc`` element ``(n, c, h, w)`` lies
at ``[n, c // B, h, w, c % B]``, and ``g``'s bytes are the same in both layouts (1 x 1, and a
blocked class has ``C % B == 0``), so a block of B channels is scaled by ``g[n, cB : cB + B]``.

As a Relax multiply (a TVM kernel) the gate read and wrote NCHW, so both ``x`` and the
product stayed plain: the conv making ``x`` reordered its output to NCHW and the conv reading
the product reordered it back, two passes over the block's largest tensor that the library
call does not make (``DNNL_VERBOSE`` on EfficientNet-B0's artifact, one thread: 1.17 ms of
reorders in an 18 ms inference). The global average of ``x`` (the squeeze) then reads only
library-made tensors too, so :func:`.onednn_layout.pools_and_concats` hands it on as a pool in
the same layout.
"""

from __future__ import annotations

from tvm import relax

from ...relax._ir import dtype_of, op_name, static_shape
from . import abi
from .choice import LayerChoice
from .onednn_layout import ReplaceCalls, bindings_of, library_made

TACTIC = "loop"  # the library's own vectorised loop, not a oneDNN primitive
KERNEL = "scale_channels"


def _gate(x, g, out_shape):
    """Whether ``multiply(x, g)`` is a gate of ``x`` by ``g`` (see module doc)."""
    xs, gs = static_shape(x), static_shape(g)
    if xs is None or gs is None or len(xs) != 4 or tuple(xs) != tuple(out_shape) or xs[2] * xs[3] == 1:
        return False
    return tuple(gs) == (xs[0], xs[1], 1, 1) and dtype_of(g) == "float32"


def channel_scales(func: relax.Function, layers: list) -> relax.Function:
    """Every ``multiply(x, g)`` of ``func`` that gates a library-made ``x`` by a per-channel
    ``g`` -> ``layerfuse.onednn.scale_channels(x, g)`` (plain until the layouts are assigned);
    its ``scale:<var>`` choice in ``layers``."""
    made = library_made(func)
    chosen = {}
    for b in bindings_of(func):
        v = b.value
        out = static_shape(b.var)
        if op_name(v) != "relax.multiply" or out is None or dtype_of(b.var) != "float32":
            continue
        a, c = v.args
        for x, g in ((a, c), (c, a)):
            if isinstance(x, relax.Var) and x in made and _gate(x, g, out):
                args = abi.SCALE_CHANNELS.flatten(abi.Args(inputs=(x,), scale=g, attrs=abi.ScaleAttrs().to_shape()))
                chosen[v] = (abi.SCALE_CHANNELS.name, args, relax.TensorType(list(out), "float32"))
                made.add(b.var)
                layers.append(LayerChoice(f"scale:{b.var.name}", TACTIC, kernel=KERNEL, shape=f"x{list(out)} g{list(static_shape(g))}"))
                break
    return ReplaceCalls(chosen).visit_expr(func) if chosen else func
