"""conv2d (plain, grouped, depthwise; NCHW) with its fused epilogue: a register tile of
output channels x output width, accumulated over the whole reduction in registers.

::

    out[n, f, y, x] = sum_{c, ry, rx} pad[n, c(f), y*s + ry, x*s + rx] * w[f, c, ry, rx]
    -> parallel(n . f/o . y . x/o)
         acc[f/i, x/i] = 0                                  (unrolled f/i, vector x/i)
         for c, ry, rx:
           acc[f/i, x/i] += pad[..] (one vector load) * w[f, c, ry, rx] (broadcast)
         epilogue(acc) -> out                               (bias, BatchNorm, residual,
                                                             activation, split pieces)
    padding: its own parallel, vectorised pass before the conv

``x/i`` is a vector's worth of output columns (``CPUParams.lanes``: 16 AVX-512, 8 AVX2,
4 NEON; a short row is taken whole); ``f/i`` the largest divisor of the output channels
whose accumulators fit the target's vector registers. A row of one column (a 1x1 output)
vectorises over the output channels.

This rule serves the convs left in NCHW: grouped convs, channel counts that are not whole
vector blocks, and the convs oneDNN leaves to TVM. Where TVM runs every conv, the others are
blocked (``relax/blocked_layout.py``) and ``conv2d_nchwc.py`` schedules them.
"""

from __future__ import annotations

from tvm import s_tir

from .base import (
    CPUParams,
    Rule,
    RuleRefused,
    extents,
    finish_root,
    iter_kinds,
    largest_divisor,
    root_blocks,
    tile_reduction,
    vector_factor,
)

CONV_BLOCKS = ("conv2d_nchw", "group_conv2d_nchw", "depthwise_conv2d_nchw")
MAX_REG = 8  # output channels per tile at most (the loop is unrolled)


def conv_block(sch: s_tir.Schedule):
    """The kernel's NCHW conv2d block (``[n, f, y, x]`` data-parallel, then reductions)."""
    found = [b for b in root_blocks(sch) if sch.get(b).name_hint.startswith(CONV_BLOCKS)]
    if len(found) != 1:
        raise RuleRefused(f"{len(found)} conv2d blocks")
    kinds = iter_kinds(sch, found[0])
    if not (kinds.startswith("SSSS") and set(kinds[4:]) == {"R"}):
        raise RuleRefused(f"conv2d block iterators {kinds}, expected SSSS R..")
    return found[0]


def register_tile(channels: int, width_vectors: int, params: CPUParams) -> int:
    """Output channels per tile: accumulators ``reg * width_vectors`` leave four registers free."""
    budget = max((params.registers - 4) // max(width_vectors, 1), 1)
    return largest_divisor(channels, min(budget, MAX_REG))


class Conv2D(Rule):
    name = "conv2d"

    def apply(self, func, params: CPUParams, target) -> s_tir.Schedule:
        sch = s_tir.Schedule(func)
        block = conv_block(sch)
        n, f, h, w = extents(sch, sch.get_loops(block))[:4]
        if w >= 2:
            vf = vector_factor(w, params.lanes)
            reg = register_tile(f, -(-vf // params.lanes), params)
            tile_reduction(sch, block, params, vec_axis=3, reg_axis=1, reg=reg, local=True)
        else:  # one output column: the channels are the only long axis
            tile_reduction(sch, block, params, vec_axis=1, local=True)
        finish_root(sch, params)
        return sch
