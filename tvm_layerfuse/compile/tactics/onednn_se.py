"""Squeeze-and-excitation gates as one library call (a step of :class:`.use_onednn.UseOneDNNConv`,
after ``assign_layouts``).

MobileNetV3's and EfficientNet's blocks gate a tensor ``x`` ``[N, C, H, W]`` by a factor per
image and channel, computed from ``x`` itself::

    s = global_avg_pool(x)                       [N, C, 1, 1]
    h = act1(conv1x1(s, W1) + b1)                [N, S, 1, 1]   (the squeeze, S < C)
    g = act2(conv1x1(h, W2) + b2)                [N, C, 1, 1]   (the excitation)
    y = scale_channels(x, g)                     x * g

After the conv layers and the layouts, that is four library calls (``pool2d``, two ``conv2d`` on
one pixel, ``scale_channels``) whose work is a few thousand multiply-adds: their call overhead
(the VM's call, oneDNN's execution context, an OpenMP region each) is most of their time. Per
output, with ``W1`` ``[S, C, 1, 1]`` and ``W2`` ``[C, S, 1, 1]``::

    g[n, c] = act2( sum_j W2[c, j] * act1( sum_k W1[j, k] * mean_hw(x[n, k]) + b1[j] ) + b2[c] )
            = se_gate(x, W1, b1, W2, b2)[n, c]

so ``layerfuse.onednn.se_gate`` computes ``g`` in one call (:class:`.abi.SeGateAttrs`: ``x``'s
layout, the pool's; ``g``'s, the excitation conv's; the two activations as the convs' attrs
carry them), and ``scale_channels`` stays. Matched only where the pool reads the very ``x``
that the gate scales, the pool is a global average without padding, both convs are plain
library convs on one pixel (one output, groups 1, no residual, their weights not yet packed)
and ``s``, ``h`` and ``g`` have no other reader. The pool and the two convs are then unread and
dropped; their entries in the tactic report name the gate that runs them (``se:<var>``,
tactic ``loop``, kernel ``se_gate``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tvm import relax

from ...relax._ir import static_shape
from . import abi
from .choice import LayerChoice
from .onednn_layout import ReplaceCalls, bindings_of, use_counts

TACTIC = "loop"  # the library's own loops, not a oneDNN primitive
KERNEL = "se_gate"


def _one_pixel_conv(bound: Optional[abi.Bound]) -> bool:
    """A plain library conv of a ``[N, C, 1, 1]`` input by ``[O, C, 1, 1]`` weights."""
    if bound is None or bound.call is not abi.CONV2D or bound.attrs.packed or bound.attrs.groups != 1:
        return False
    a = bound.attrs
    if (a.pad_top, a.pad_left, a.pad_bottom, a.pad_right) != (0, 0, 0, 0) or a.algorithm:
        return False
    xs, ws = static_shape(bound.args.input), static_shape(bound.args.weight)
    return xs is not None and ws is not None and len(xs) == 4 and xs[2] * xs[3] == 1 and len(ws) == 4 and ws[2:] == (1, 1)


def _global_average(bound: Optional[abi.Bound], x) -> bool:
    """``bound`` is an unpadded global average pool of ``x``."""
    if bound is None or bound.call is not abi.POOL2D or not isinstance(bound.args.input, relax.Var):
        return False
    a, xs = bound.attrs, static_shape(x)
    return (
        bound.args.input.same_as(x)
        and xs is not None
        and a.alg in (abi.POOL_ALGORITHMS["avg"], abi.POOL_ALGORITHMS["avg_include_pad"])
        and (a.kernel_h, a.kernel_w) == (xs[2], xs[3])
        and (a.pad_top, a.pad_left, a.pad_bottom, a.pad_right) == (0, 0, 0, 0)
    )


def squeeze_excitations(func: relax.Function, layers: list) -> relax.Function:
    """Every gate ``scale_channels(x, g)`` whose ``g`` is ``conv(conv(global_avg_pool(x)))`` on
    the library -> ``g = layerfuse.onednn.se_gate(x, ...)`` (see module doc); each absorbed
    layer's entry in ``layers`` names it."""
    bindings = bindings_of(func)
    calls = {b.var: abi.parse_call(b.value) for b in bindings}
    values = {b.var: b.value for b in bindings}
    uses = use_counts(func)
    chosen, by_conv, by_pool = {}, {}, {}  # the gate running each absorbed conv (by layer id) and pool (by choice name)
    for b in bindings:
        scale = calls[b.var]
        if scale is None or scale.call is not abi.SCALE_CHANNELS:
            continue
        x, g = scale.args.input, scale.args.scale
        excite = calls.get(g)
        h = excite.args.input if _one_pixel_conv(excite) else None
        squeeze = calls.get(h)
        p = squeeze.args.input if _one_pixel_conv(squeeze) else None
        if p is None or not _global_average(calls.get(p), x) or any(uses.get(v, 0) != 1 for v in (p, h, g)):
            continue
        attrs = abi.SeGateAttrs(
            block=calls[p].attrs.block,
            dst_block=excite.attrs.dst_block_of(0),
            squeeze_act=squeeze.attrs.act,
            squeeze_alpha_bits=squeeze.attrs.alpha_bits,
            squeeze_beta_bits=squeeze.attrs.beta_bits,
            gate_act=excite.attrs.act,
            gate_alpha_bits=excite.attrs.alpha_bits,
            gate_beta_bits=excite.attrs.beta_bits,
        )
        args = abi.Args(
            inputs=(x,),
            weight=squeeze.args.weight,
            bias=squeeze.args.bias,
            gate_weight=excite.args.weight,
            gate_bias=excite.args.bias,
            attrs=attrs.to_shape(),
        )
        chosen[values[g]] = (abi.SE_GATE.name, abi.SE_GATE.flatten(args), g.ty)
        gate = f"se:{g.name}"
        by_conv.update({squeeze.attrs.layer: gate, excite.attrs.layer: gate})
        by_pool[f"pool:{p.name}"] = gate
        s = static_shape(squeeze.args.weight)
        layers.append(LayerChoice(gate, TACTIC, kernel=KERNEL, shape=f"x{list(static_shape(x))} squeeze {s[0]}",
                                  layout=abi.layout_name(attrs.block)))
    if not chosen:
        return func
    for i, c in enumerate(layers):
        by = by_conv.get(c.id) if c.tactic == "onednn" and c.id >= 0 else by_pool.get(c.layer)
        if by is not None:
            layers[i] = dataclasses.replace(c, tactic=TACTIC, kernel=KERNEL, reason=f"in the squeeze-and-excitation gate {by}")
    return relax.analysis.remove_all_unused(ReplaceCalls(chosen).visit_expr(func))
