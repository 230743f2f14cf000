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
The kernel is in int32 indices (``lowering/narrow_indices.py``, a lowering pass before any
schedule; the rule narrows a kernel that did not go through it): with Relax's int64 loops the
hint is lost in the lowering. The depthwise path keeps its predicated last tile
(measured faster).

A 1x1 conv with stride 1 and no padding on a small plane (7 x 7, 13 x 13, 14 x 14: the late
layers of ResNet, GoogLeNet, DenseNet, SqueezeNet) is tiled over the whole plane instead
(:meth:`Conv2DNCHWc._flat`): in NCHW[x]c a channel block's rows follow each other, so the
``H*W`` positions are one axis ``p = y*W + x`` of plain addresses::

    parallel(O_o/o . n)
      for p/o in 0 .. ceil(H*W / w):              # pragma_loop_partition_hint
        acc[O_o/i, p/i, :] += in[n, C_o, p, c_i] (broadcast) * W[O_o, C_o, 0, 0, c_i, :]
        epilogue(acc) -> out[n, O_o, p, :]

7 x 7 = 49 positions run as 12 tiles of 4 and one of 1, where rows run 7 x (4 + 3). The
rows stay where they tile as well (:func:`_flat_plane`).
"""

from __future__ import annotations

import logging
from fractions import Fraction

from tvm import s_tir

from ...lowering.narrow_indices import int32_indices
from .base import (
    CPUParams,
    Rule,
    RuleRefused,
    _epilogue_per_tile,
    _inline_epilogue,
    _last_blocks,
    _move_epilogue,
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


def register_tile(width: int, chunks: int, params: CPUParams, *, flat: bool = False) -> tuple[int, int]:
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
    4 x 2 tie within noise and 7 x 1 is 25-45% slower).

    ``flat``: ``width`` is a whole plane of positions (:meth:`Conv2DNCHWc._flat`); the tile
    has at least as many positions as channel blocks (AVX2, 7 x 7 planes: 4 x 2 runs
    2048->512 in 1460 us where 2 x 4 takes 1690, 512->2048 in 1480 against 1550: half the
    weight panel per tile)."""
    cap = params.registers // 2
    best, best_key = (1, 1), None
    for c in range(1, min(chunks, MAX_CHANNEL_BLOCKS) + 1):
        for w in range(1, min(width, cap // c) + 1):
            if w * c + c + 1 > params.registers or (flat and w < c):
                continue
            useful = Fraction(width, -(-width // w) * w) * Fraction(chunks, -(-chunks // c) * c)
            key = (Fraction(w * c, w + c) * useful, useful == 1, w * c, w)
            if best_key is None or key > best_key:
                best, best_key = (w, c), key
    return best


def _weight_block(sch: s_tir.Schedule, block) -> int:
    """The input-channel block of the 6-d weight ``[O_o, C_o, kh, kw, c_i, o_i]``."""
    for region in sch.get(block).reads:
        buf = region.source
        if len(buf.shape) == 6:
            return int(buf.shape[4])
    raise RuleRefused("no 6-d weight read by the blocked conv")


class Conv2DNCHWc(Rule):
    name = "conv2d NCHWc"

    def apply(self, func, params: CPUParams, target) -> s_tir.Schedule:
        sch = s_tir.Schedule(int32_indices(func))
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
        if _flat_plane(sch, block, params):  # reads ``sch`` only: the rows' schedule below starts from it as it is
            try:
                return self._flat(func, params)
            except RuleRefused as e:
                log.debug("1x1 conv tiled along rows: %s", e)
        total = work(sch, block)
        sch.cache_write(block, 0, "local")  # the tile accumulates in registers, written once
        _inline_epilogue(sch, block)
        n, occ, oh, ow, ocb, ic, kh, kw = loops_per_iter(sch, block)
        return _register_tiles(sch, block, params, total=total, rows=[oh], loops=(n, occ, ow, ocb, ic, kh, kw))

    def _flat(self, func, params: CPUParams) -> s_tir.Schedule:
        """A 1x1 conv with stride 1 and no padding: rows of input and output are contiguous
        in NCHW[x]c, so the plane is one axis of ``H*W`` positions and the tile runs along it
        (7 x 7 = 49 positions: 12 tiles of 4 and one of 1, where rows leave 7 partial tiles).
        The local accumulator and the blocks of the epilogue are re-indexed over the flat
        plane first (``transform_layout``, ``transform_block_layout``) so that the epilogue
        computed per tile covers exactly the tile's positions::

            parallel(O_o/o . n) / p/o: acc[O_o/i, p/i, :] += in[.., p, c_i] * W[O_o, C_o, 0, 0, c_i, :]
        """
        sch = s_tir.Schedule(int32_indices(func))
        (block,) = [b for b in root_blocks(sch) if sch.get(b).name_hint.startswith(BLOCK)]
        total = work(sch, block)
        _, _, height, width, _ = (int(iv.dom.extent) for iv in sch.get(block).iter_vars[:5])
        sch.cache_write(block, 0, "local")
        _inline_epilogue(sch, block)
        plane = (height, width)
        try:
            sch.transform_layout(block, ("write", 0), lambda n, c, h, w, ci: (n, c, h * width + w, ci))
            sch.transform_block_layout(block, lambda n, c, h, w, ci, ic, kh, kw: (n, c, h * width + w, ci, ic, kh, kw))
            for b in _last_blocks(sch, block):
                ivs = sch.get(b).iter_vars
                if iter_kinds(sch, b) != "SSSSS" or tuple(int(iv.dom.extent) for iv in ivs[2:4]) != plane:
                    raise RuleRefused(f"epilogue block {sch.get(b).name_hint} does not iterate over the plane")
                sch.transform_block_layout(b, lambda n, c, h, w, ci: (n, c, h * width + w, ci))
        except RuleRefused:
            raise
        except Exception as e:  # noqa: BLE001 - TVM's ScheduleError: the rows' schedule instead
            raise RuleRefused(f"the plane cannot be flattened: {str(e).splitlines()[0] if str(e) else e}") from e
        n, occ, hw, ocb, ic, kh, kw = loops_per_iter(sch, block)
        return _register_tiles(sch, block, params, total=total, rows=[], loops=(n, occ, hw, ocb, ic, kh, kw), flat=True)

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


def _register_tiles(sch: s_tir.Schedule, block, params: CPUParams, *, total: int, rows: list, loops, flat: bool = False):
    """The tile loop nest of the module docstring for a conv whose local accumulator and
    inlined epilogue are in place: ``loops`` are ``(n, O_o, x, o_i, c, ry, rx)`` (``x`` the
    output columns of a row, or the positions of a flat plane), ``rows`` the row loop (``[y]``)
    or none. Parallel ``O_o/o . n . rows``, tiles of ``x/i`` by ``O_o/i`` (:func:`register_tile`),
    each partial last tile split off (:func:`_partition_tails`)."""
    n, occ, x, ocb, ic, kh, kw = loops
    _, chunks, width, _ = extents(sch, [n, occ, x, ocb])
    reg_w, reg_c = register_tile(width, chunks, params, flat=flat)
    ico, ici = sch.split(ic, [None, _weight_block(sch, block)])
    xo, xi = sch.split(x, [None, reg_w])  # a partial last tile where reg_w does not divide
    occo, occi = sch.split(occ, [None, reg_c])
    sch.reorder(occo, n, *rows, xo, ico, kh, kw, ici, occi, xi, ocb)
    par = sch.fuse(occo, n, *rows)
    epilogue = _move_epilogue(sch, block, xo)
    parallelize(sch, par, total)
    sch.unroll(ici)
    sch.unroll(occi)
    sch.unroll(xi)
    sch.vectorize(ocb)
    sch.decompose_reduction(block, ico)  # the init loops copy the tile's unroll and vector
    _vectorize_epilogue(sch, epilogue)
    _partition_tails(sch, (xo, width, reg_w), (par, chunks, reg_c))
    finish_root(sch, params)
    return sch


PARTITION_HINT = "pragma_loop_partition_hint"  # read by TVM's LoopPartition lowering pass


def _flat_plane(sch: s_tir.Schedule, block, params: CPUParams) -> bool:
    """A 1x1 conv with stride 1 and no padding (it reads a 5-d input of its output's height
    and width) whose rows tile worse than its plane: the row tile leaves a partial tile or
    differs from the plane's, and its channel tiles keep every core busy. Where both are the
    same whole tiles (4 x 2 on 56- and 28-wide rows on AVX2) the rows stay: the same inner
    loop, and the flat form measured no better."""
    ivs = sch.get(block).iter_vars
    if len(ivs) != 8 or int(ivs[6].dom.extent) != 1 or int(ivs[7].dom.extent) != 1:
        return False
    chunks, height, width = (int(iv.dom.extent) for iv in ivs[1:4])
    for region in sch.get(block).reads:
        buf = region.source
        if len(buf.shape) == 5 and tuple(int(d) for d in buf.shape[2:4]) != (height, width):
            return False
    rows = register_tile(width, chunks, params)
    flat = register_tile(height * width, chunks, params, flat=True)
    batch = int(ivs[0].dom.extent)
    if -(-chunks // flat[1]) * batch < FLAT_PARALLEL * params.cores:
        return False  # the flat form's parallel loop (channel tiles x batch) would be short
    return bool(width % rows[0]) or rows != flat


FLAT_PARALLEL = 4  # the flat form's parallel iterations per core at least


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
