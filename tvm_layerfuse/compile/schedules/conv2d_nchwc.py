"""conv2d and depthwise conv2d in the blocked layout NCHW[x]c (TOPI's ``conv2d_NCHWc``, see
``lowering/blocked_conv.py``) with its fused epilogue: the loop nest of TVM's x86 conv
schedule (``topi/x86/conv2d_avx_common.py``, removed with TE schedules) as TIR schedule
primitives.

::

    out[n, O_o, y, x, o_i] = sum_{c, ry, rx} pad[n, c // B, y*s + ry, x*s + rx, c % B] * W[O_o, c // B, ry, rx, c % B, o_i]
    -> parallel(n . O_o/o . y)
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
FMAs per load with at most half the vector registers as accumulators; AVX2: 4 x 2 on 56- and
28-wide rows, 2 x 4 on 14, 7 x 1 on 7; NEON and AVX-512: 4 x 4). Every input value loaded
feeds ``O_o/i`` FMAs and every weight vector ``x/i``.
"""

from __future__ import annotations

from tvm import s_tir

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

BLOCK = "conv2d_NCHWc"
DEPTHWISE = "depthwise_conv2d_NCHWc"  # lowering/blocked_conv.py
MAX_CHANNEL_BLOCKS = 4  # channel blocks per register tile at most


def register_tile(width: int, chunks: int, params: CPUParams) -> tuple[int, int]:
    """(output columns, channel blocks) per tile. Each step of the reduction loads one input
    broadcast per column and one weight vector per channel block for ``columns x blocks``
    FMAs, so the tile with the most FMAs per load wins (then the larger tile, then more
    columns), among divisors of ``width`` and ``chunks`` with at most half the vector
    registers as accumulators (measured on AVX2: 4 x 2 runs a 3x3 conv at 88 GFLOP/s where
    14 x 1 ran 68, and a 1x1 at 85 against 64; 16 accumulators of 16 registers spill). A
    width whose divisors all give less than a quarter of the registers (a prime 19 or 23 with
    one channel block) gets equal column tiles that do not divide it (the last one predicated)."""
    cap = params.registers // 2
    best, best_key = (1, 1), None
    for c in range(1, min(chunks, MAX_CHANNEL_BLOCKS) + 1):
        if chunks % c:
            continue
        for w in range(min(width, cap // c), 0, -1):
            if width % w == 0 and w * c + c + 1 <= params.registers:
                key = (w * c / (w + c), w * c, w)
                if best_key is None or key > best_key:
                    best, best_key = (w, c), key
                break
    if best[0] * best[1] < cap // 2 and width > best[0]:
        tiles = -(-width // cap)
        return -(-width // tiles), 1
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
        sch = s_tir.Schedule(func)
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
        owo, owi = sch.split(ow, [None, reg_w])  # a predicated last tile where reg_w does not divide
        occo, occi = sch.split(occ, [None, reg_c])
        sch.reorder(n, occo, oh, owo, ico, kh, kw, ici, occi, owi, ocb)
        par = sch.fuse(n, occo, oh)
        epilogue = _epilogue_per_tile(sch, block, owo, params)
        parallelize(sch, par, total)
        sch.unroll(ici)
        sch.unroll(occi)
        sch.unroll(owi)
        sch.vectorize(ocb)
        sch.decompose_reduction(block, ico)  # the init loops copy the tile's unroll and vector
        _vectorize_epilogue(sch, epilogue)
        finish_root(sch, params)
        return sch

    def _depthwise(self, sch: s_tir.Schedule, block, params: CPUParams) -> s_tir.Schedule:
        """A depthwise conv: no reduction over channels, so each output vector is its own
        channel block's; the tile is output columns only, each FMA one vector load of input::

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
        finish_root(sch, params)
        return sch


def _vectorize_epilogue(sch: s_tir.Schedule, epilogue) -> None:
    """Each epilogue block of a tile: its innermost loop (the channel block) in vector code."""
    for b in epilogue:
        lp = sch.get_loops(b)
        if len(lp) > 1 and int(sch.get(lp[-1]).extent) >= 2:
            sch.vectorize(lp[-1])
