"""BlockedConvLayout: TVM's convs in the blocked channel layout NCHW[x]c, ``x`` the target's
fp32 vector lanes (8 AVX2, 16 AVX-512, 4 NEON).

Algebra (``B = x``; ``C`` and ``O`` multiples of ``B``)::

    to_blocked(t)[n, C_o, h, w, c_i]          = t[n, C_o*B + c_i, h, w]            (NCHW -> NCHWBc)
    W_blocked[O_o, C_o, kh, kw, c_i, o_i]     = W[O_o*B + o_i, C_o*B + c_i, kh, kw] (OIHW -> OIHWBiBo)
    conv2d(x, W)  == from_blocked(conv2d_NCHWBc(to_blocked(x), W_blocked))
    to_blocked(from_blocked(t)) == t                                               (cancelled)

The rewrite is TVM's own ``relax.transform.ConvertLayout`` with ``{"relax.nn.conv2d":
["NCHW{B}c", "OIHW{B}i{B}o"]}``: it blocks every conv whose input and output channels are
multiples of ``B`` and carries the layout through the ops between them (bias add, ReLU,
pools, concat along channels, residual adds), so consecutive blocked convs exchange blocked
tensors and transforms appear only at the edges (the graph input and output, a conv it
refuses: grouped and depthwise convs, channel counts that are not multiples of ``B``,
the classifier). ConvertLayout writes one transform per *use*; ``EliminateCommonSubexpr``
then leaves one per *activation*. The weights' transforms are expressions of the weight
parameters: ``LiftTransformParams`` computes them once at compile time.

The blocked ``conv2d`` is lowered by :class:`..lowering.blocked_conv.LegalizeBlockedConv`
(TOPI's ``conv2d_NCHWc``) and scheduled by ``compile/schedules/conv2d_nchwc.py``.

Usage (weights still parameters)::

    mod = BlockedConvLayout(lanes=8)(mod)      # then lift / bind the weights
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax

log = logging.getLogger(__name__)

BLOCKS = (4, 8, 16)  # NEON / AVX2 / AVX-512 fp32 lanes


def blocked_layouts(lanes: int) -> tuple[str, str]:
    """(data layout, kernel layout) of a conv blocked by ``lanes`` channels."""
    return f"NCHW{lanes}c", f"OIHW{lanes}i{lanes}o"


def count_blocked_convs(mod: tvm.IRModule) -> tuple[int, int]:
    """(blocked conv2d calls, all conv2d calls) in the module's Relax functions."""
    found = [0, 0]

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.nn.conv2d":
            found[1] += 1
            found[0] += len(str(e.attrs.data_layout)) > 4

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return found[0], found[1]


@tvm.transform.module_pass(opt_level=0, name="BlockedConvLayout")
class BlockedConvLayout:
    """Every conv2d whose channels fill whole blocks of ``lanes`` in NCHW[lanes]c, one layout
    transform per activation at the edges of the blocked region (see the module docstring).
    ``pass.blocked`` / ``pass.convs`` count the convs of the last run."""

    def __init__(self, lanes: int) -> None:
        if lanes not in BLOCKS:
            raise ValueError(f"channel block {lanes}: expected one of {BLOCKS}")
        self.lanes = lanes
        self.blocked = 0
        self.convs = 0

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        data, kernel = blocked_layouts(self.lanes)
        out = relax.transform.ConvertLayout({"relax.nn.conv2d": [data, kernel]})(mod)
        self.blocked, self.convs = count_blocked_convs(out)
        if not self.blocked:
            return mod  # nothing blocked: no transform enters the graph
        out = relax.transform.EliminateCommonSubexpr()(out)  # one transform per activation, not per use
        log.info("blocked layout %s: %d of %d convs", data, self.blocked, self.convs)
        return out
