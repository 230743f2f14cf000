"""conv2d and depthwise conv2d in the blocked layout NCHW[x]c (TOPI's ``conv2d_NCHWc``, see
``lowering/blocked_conv.py``) with its fused epilogue: the loop nest of TVM's x86 conv
schedule (``topi/x86/conv2d_avx_common.py``, removed with TE schedules) as TIR schedule
primitives.

::

    out[n, O_o, y, x, o_i] = sum_{c, ry, rx} pad[n, c // B, y*s + ry, x*s + rx, c % B] * W[O_o, c // B, ry, rx, c % B, o_i]
    -> parallel(O_o/o . n . y)
         for x/o:
           acc[O_o/i, x/i, o_i] = 0                     (unrolled O_o/i, x/i; vector o_i)
           for C_o, ry, rx:
             for c_i (unrolled):
               for O_o/i (unrolled): w = W[O_o, C_o, ry, rx, c_i, :]          (one vector load)
                 for x/i (unrolled): acc[O_o/i, x/i, :] += pad[.., c_i] (broadcast) * w
           epilogue(acc) -> out                         (bias, BatchNorm, residual, activation)
    padding: its own parallel, vectorised pass before the conv

``o_i`` is the channel block ``B``, one vector register (``CPUParams.lanes``); the register
tile is ``x/i`` output columns by ``O_o/i`` channel blocks (:func:`register_tile`: the most
FMAs per load times the useful fraction, with at most half the vector registers as
accumulators; AVX2: 4 x 2 on 56-, 28- and 27-wide rows, 2 x 4 on 14 and 13, 4 x 2 on 55
and 7; NEON and AVX-512: 4 x 4). Every input value loaded feeds ``O_o/i`` FMAs and every
weight vector ``x/i``.

A tile that does not divide the row (or the channel blocks) leaves a partial last tile::

    for x/o in 0 .. ceil(W / w):                 # pragma_loop_partition_hint
      acc[.., x/i, :] ...  if x/o * w + x/i < W  (every FMA, init and epilogue step)

TVM's ``LoopPartition`` lowering pass (``s_tir/transform/loop_partition.cc``) splits a loop
annotated ``pragma_loop_partition_hint`` where such a condition changes value: the full
tiles ``x/o < W // w`` run without it, and the last tile, ``x/o`` now a constant, keeps
``x/i < W % w``, which folds away once ``x/i`` is unrolled: a smaller unrolled tile. The
channel tail likewise, on the parallel loop ``O_o/o . n . y`` (``O_o/o`` outermost, so the
condition ``(p // (N*H)) * c + O_o/i < chunks`` is one bound on ``p``: two parallel loops).
The kernel is first narrowed to int32 indices (:func:`_int32_indices`: with Relax's int64
loops the hint is lost in the lowering). The depthwise path keeps its predicated last tile
(measured faster).
"""

from __future__ import annotations

import logging
from fractions import Fraction

import tvm
from tvm import s_tir, tirx

from .base import (
    CPUParams,
    Rule,
    RuleRefused,
    _epilogue_per_tile,
    extents,
    finish_root,
    iter_kinds,
    loops_per_iter,
    parallelize,
    root_blocks,
    work,
)

log = logging.getLogger(__name__)

BLOCK = "conv2d_NCHWc"
DEPTHWISE = "depthwise_conv2d_NCHWc"  # lowering/blocked_conv.py
MAX_CHANNEL_BLOCKS = 4  # channel blocks per register tile at most


def register_tile(width: int, chunks: int, params: CPUParams) -> tuple[int, int]:
    """(output columns, channel blocks) per tile, divisors of ``width`` and ``chunks`` or not.

    Each step of the reduction loads one input broadcast per column and one weight vector
    per channel block for ``columns x blocks`` FMAs; the tile with the most FMAs per load
    times the useful fraction wins (then one without a partial tile, then the larger tile,
    then more columns). The useful
    fraction is ``width / (tiles * columns)`` times the same for channel blocks: the part of
    the last, partial tile's slots that hold outputs (it runs as a smaller tile, see the
    module docstring, at a lower FMA rate). Accumulators ``columns x blocks`` stay within
    half the vector registers, with ``blocks + 1`` more for the weights and the broadcast
    (measured on AVX2: 4 x 2 runs a 3x3 conv at 88 GFLOP/s where 14 x 1 ran 68, and a 1x1
    at 85 against 64; 16 accumulators of 16 registers spill; on 13-wide rows 2 x 4 and
    4 x 2 tie within noise and 7 x 1 is 25-45% slower)."""
    cap = params.registers // 2
    best, best_key = (1, 1), None
    for c in range(1, min(chunks, MAX_CHANNEL_BLOCKS) + 1):
        for w in range(1, min(width, cap // c) + 1):
            if w * c + c + 1 > params.registers:
                continue
            useful = Fraction(width, -(-width // w) * w) * Fraction(chunks, -(-chunks // c) * c)
            key = (Fraction(w * c, w + c) * useful, useful == 1, w * c, w)
            if best_key is None or key > best_key:
                best, best_key = (w, c), key
    return best


def _weight_block(sch: s_tir.Schedule, block) -> int:
    """The input-channel block of the 6-d weight ``[O_o, C_o, kh, kw, c_i, o_i]``."""
    for region in sch.get(block).reads:
        buf = region.buffer if hasattr(region, "buffer") else region.source
        if len(buf.shape) == 6:
            return int(buf.shape[4])
    raise RuleRefused("no 6-d weight read by the blocked conv")


class Conv2DNCHWc(Rule):
    name = "conv2d NCHWc"

    def apply(self, func, params: CPUParams, target) -> s_tir.Schedule:
        sch = s_tir.Schedule(_int32_indices(func))
        depthwise = [b for b in root_blocks(sch) if sch.get(b).name_hint.startswith(DEPTHWISE)]
        if len(depthwise) == 1:
            return self._depthwise(sch, depthwise[0], params)
        found = [b for b in root_blocks(sch) if sch.get(b).name_hint.startswith(BLOCK)]
        if len(found) != 1:
            raise RuleRefused(f"{len(found)} blocked conv2d blocks")
        block = found[0]
        kinds = iter_kinds(sch, block)
        if kinds != "SSSSSRRR":
            raise RuleRefused(f"blocked conv2d iterators {kinds}, expected SSSSSRRR")
        icb = _weight_block(sch, block)
        total = work(sch, block)
        sch.cache_write(block, 0, "local")  # the tile accumulates in registers, written once
        n, occ, oh, ow, ocb, ic, kh, kw = loops_per_iter(sch, block)
        _, chunks, _, width, _ = extents(sch, [n, occ, oh, ow, ocb])
        reg_w, reg_c = register_tile(width, chunks, params)
        ico, ici = sch.split(ic, [None, icb])
        owo, owi = sch.split(ow, [None, reg_w])  # a partial last tile where reg_w does not divide
        occo, occi = sch.split(occ, [None, reg_c])
        sch.reorder(occo, n, oh, owo, ico, kh, kw, ici, occi, owi, ocb)
        par = sch.fuse(occo, n, oh)
        epilogue = _epilogue_per_tile(sch, block, owo, params)
        parallelize(sch, par, total)
        sch.unroll(ici)
        sch.unroll(occi)
        sch.unroll(owi)
        sch.vectorize(ocb)
        sch.decompose_reduction(block, ico)  # the init loops copy the tile's unroll and vector
        _vectorize_epilogue(sch, epilogue)
        _partition_tails(sch, (owo, width, reg_w), (par, chunks, reg_c))
        finish_root(sch, params)
        return sch

    def _depthwise(self, sch: s_tir.Schedule, block, params: CPUParams) -> s_tir.Schedule:
        """A depthwise conv: no reduction over channels, so each output vector is its own
        channel block's; the tile is output columns only, each FMA one vector load of input
        (a partial last tile keeps its predicate)::

            parallel(n . C_o . y) / x/o: acc[x/i, :] += pad[.., x*s + rx, :] * W[C_o, ry, rx, :]
        """
        kinds = iter_kinds(sch, block)
        if kinds != "SSSSSRR":
            raise RuleRefused(f"blocked depthwise iterators {kinds}, expected SSSSSRR")
        total = work(sch, block)
        sch.cache_write(block, 0, "local")
        n, c, oh, ow, cb, ry, rx = loops_per_iter(sch, block)
        width = extents(sch, [ow])[0]
        reg_w, _ = register_tile(width, 1, params)
        owo, owi = sch.split(ow, [None, reg_w])
        sch.reorder(n, c, oh, owo, ry, rx, owi, cb)
        par = sch.fuse(n, c, oh)
        epilogue = _epilogue_per_tile(sch, block, owo, params)
        parallelize(sch, par, total)
        sch.unroll(owi)
        sch.vectorize(cb)
        sch.decompose_reduction(block, ry)
        _vectorize_epilogue(sch, epilogue)
        # no partition here: a predicated last tile measured ~10% faster than a partitioned one
        # (AVX2, 13- and 19-wide rows; each FMA loads its own input vector, the loop stays small)
        finish_root(sch, params)
        return sch


PARTITION_HINT = "pragma_loop_partition_hint"  # read by TVM's LoopPartition lowering pass


def _int32_indices(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with int32 loops and indices (Relax legalizes with int64) where every buffer
    has fewer than 2**31 elements. TVM's ``LoopPartition`` ignores the hint on a loop whose
    int64 variable ``NarrowDataType`` replaced by an int32 one earlier in the lowering (the
    hint still names the old variable): seen on TVM 0.27, the partial tiles then kept their
    predicates."""
    for buf in func.params:
        n = 1
        for d in getattr(buf, "shape", None) or ():
            if not isinstance(d, tirx.IntImm):
                return func
            n *= int(d)
        if n >= 1 << 31:
            return func
    try:
        return tirx.transform.ForceNarrowIndexToInt32()(tvm.IRModule({"main": func}))["main"]
    except Exception as e:  # noqa: BLE001 - TVM's error (an int64 buffer): scheduled as it is
        log.debug("int64 indices kept: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return func


def _partition_tails(sch: s_tir.Schedule, *splits) -> None:
    """Each ``(outer loop, extent, tile)`` whose tile does not divide the extent: the outer
    loop is split by ``LoopPartition`` into its full tiles and the partial last one."""
    for loop, extent, tile in splits:
        if extent % tile:
            sch.annotate(loop, PARTITION_HINT, 1)


def _vectorize_epilogue(sch: s_tir.Schedule, epilogue) -> None:
    """Each epilogue block of a tile: its innermost loop (the channel block) in vector code."""
    for b in epilogue:
        lp = sch.get_loops(b)
        if len(lp) > 1 and int(sch.get(lp[-1]).extent) >= 2:
            sch.vectorize(lp[-1])
