"""What every CPU schedule rule shares: the target's vector width and core count, and the
two loop-nest shapes all rules are made of.

::

    injective block   loops l_0 .. l_k                 ->  parallel(fuse(outer)) . serial . vectorize(inner)
                      (inner: a split of the innermost loops fused along which every operand
                      is contiguous, or of all loops fused when the innermost one is shorter
                      than half a vector and nothing can be fused so)
    reduction block   spatial s_0 .. s_m, reduce r_0 .. r_n
                      ->  parallel(fuse(s_i except vec/reg, s_reg/o, s_vec/o))
                            init: unroll(s_reg/i) . vectorize(s_vec/i)
                            r_0 .. r_n
                              unroll(s_reg/i) . vectorize(s_vec/i)     (a register tile)
                          the consumers (epilogue) computed per tile under the parallel loop

``s_vec`` is the output axis whose elements are contiguous (the innermost spatial one with
more than one element); ``s_reg`` an axis whose tile of ``reg`` elements shares every input
vector (a conv's output channels, whose weights are broadcast). Splits divide the extent
where a divisor fits a vector, so no vectorised loop carries a predicate.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Optional

import tvm
from tvm import s_tir, tirx

log = logging.getLogger(__name__)

# below this many loop iterations a kernel is not worth a parallel launch (a few microseconds)
PARALLEL_MIN_WORK = 1 << 14


@dataclasses.dataclass(frozen=True)
class CPUParams:
    """The target facts the rules read: ``lanes`` (fp32 lanes of a vector register: 16 for
    AVX-512, 8 for AVX2, 4 for SSE and NEON), ``registers`` (vector registers: 32 for
    AVX-512 and AArch64, 16 otherwise) and ``cores`` (the target's ``num-cores``, else
    this machine's)."""

    lanes: int = 8
    registers: int = 16
    cores: int = 2
    isa: str = "avx2"

    @classmethod
    def of(cls, target: Optional[tvm.target.Target]) -> "CPUParams":
        from tvm.target.codegen import target_has_features

        cores = None
        if target is not None:
            cores = target.attrs.get("num-cores")
        cores = int(cores) if cores else (os.cpu_count() or 1)
        if target is None:
            return cls(cores=cores)

        def has(feature: str) -> bool:
            try:
                return bool(target_has_features(feature, target))
            except Exception:  # a target LLVM does not know: the narrowest vector
                return False

        if has("avx512f"):
            return cls(lanes=16, registers=32, cores=cores, isa="avx512")
        if has("avx2"):
            return cls(lanes=8, registers=16, cores=cores, isa="avx2")
        if has("avx"):
            return cls(lanes=8, registers=16, cores=cores, isa="avx")
        if has("neon") or "aarch64" in str(target.attrs.get("mtriple", "")):
            return cls(lanes=4, registers=32, cores=cores, isa="neon")
        return cls(lanes=4, registers=16, cores=cores, isa="sse")


class RuleRefused(Exception):
    """A rule does not apply to a kernel; the message says why (shown at debug level)."""


class Rule:
    """One kind of kernel. ``apply(func, params, target)`` returns the scheduled kernel's
    :class:`tvm.s_tir.Schedule`, or raises :class:`RuleRefused` (or a TVM ``ScheduleError``)
    when the kernel is not its kind; ``func`` itself is never changed."""

    name = "rule"

    def apply(self, func: tirx.PrimFunc, params: CPUParams, target) -> s_tir.Schedule:  # pragma: no cover
        raise NotImplementedError


# ---------------------------------------------------------------------- helpers
def root_blocks(sch: s_tir.Schedule) -> list:
    """The blocks right under the root block, in program order."""
    return list(sch.get_child_blocks(sch.get_sblock("root", func_name="main")))


def iter_kinds(sch: s_tir.Schedule, block) -> str:
    """``S`` (data-parallel) / ``R`` (reduction) / ``O`` (other) per block iterator."""
    kinds = {tirx.IterVar.DataPar: "S", tirx.IterVar.CommReduce: "R"}
    return "".join(kinds.get(iv.iter_type, "O") for iv in sch.get(block).iter_vars)


def extents(sch: s_tir.Schedule, loops) -> list[int]:
    out = []
    for lp in loops:
        ext = sch.get(lp).extent
        if not isinstance(ext, tirx.IntImm):
            raise RuleRefused("a loop with a symbolic extent")
        out.append(int(ext))
    return out


def loops_per_iter(sch: s_tir.Schedule, block) -> list:
    """The block's loops, one per iterator in iterator order: the plain form FuseTIR leaves
    (``T.grid`` + ``T.axis.remap``). Anything else is refused."""
    loops = sch.get_loops(block)
    stmt = sch.get(block)
    if len(loops) != len(stmt.iter_vars):
        raise RuleRefused(f"block {stmt.name_hint!r} has {len(loops)} loops for {len(stmt.iter_vars)} iterators")
    for lp in loops:
        if sch.get(lp).kind != tirx.ForKind.SERIAL:
            raise RuleRefused(f"block {stmt.name_hint!r} is scheduled already")
    return list(loops)


def vector_factor(extent: int, lanes: int, vectors: int = 1) -> int:
    """Elements per vectorised loop for an axis of ``extent``, in this order of preference:
    a multiple of ``lanes`` up to ``lanes * vectors`` that divides it; the whole axis when it
    fits one vector; a divisor between half a vector and a vector (14 -> 7, 28 -> 7 for 8
    lanes: a vector wider than one register but not a multiple of it makes LLVM shuffle lanes
    through the stack, measured 3-4x slower); the whole axis up to two vectors; any divisor up
    to two vectors; else ``lanes * vectors`` with a predicated tail."""
    cap = lanes * vectors
    for f in range(cap - cap % lanes, lanes - 1, -lanes):
        if extent % f == 0:
            return f
    if extent <= lanes:
        return extent
    for f in range(lanes - 1, max(lanes // 2, 2) - 1, -1):
        if extent % f == 0:
            return f
    if extent <= 2 * lanes:
        return extent
    for f in range(2 * lanes, 1, -1):
        if extent % f == 0:
            return f
    return cap


def largest_divisor(n: int, at_most: int) -> int:
    for f in range(min(n, max(at_most, 1)), 0, -1):
        if n % f == 0:
            return f
    return 1


def work(sch: s_tir.Schedule, block) -> int:
    total = 1
    for e in extents(sch, sch.get_loops(block)):
        total *= e
    return total


def parallelize(sch: s_tir.Schedule, loop, total_work: int) -> None:
    if int(sch.get(loop).extent) > 1 and total_work >= PARALLEL_MIN_WORK:
        sch.parallel(loop)


def schedule_injective(sch: s_tir.Schedule, block, params: CPUParams) -> None:
    """Parallel outer loop, vectorised inner loop for a block of data-parallel iterators.

    The innermost loops that address every buffer contiguously (:func:`contiguous_tail`) are
    fused until the inner axis holds several whole vectors (a [C, 28, 28] plane: 784 floats,
    not 28); the parallel loop takes the outer axes, with part of the inner one only where the
    outer ones give fewer than ``4 x cores`` chunks, so each task runs a serial loop of
    vectors: a parallel loop over every vector of the kernel cost a 116 x 28 x 28 channel
    shuffle 5x its time (51 against 10 us, one thread)."""
    kinds = iter_kinds(sch, block)
    if set(kinds) - {"S"}:
        raise RuleRefused(f"block {sch.get(block).name_hint!r} is not injective ({kinds})")
    loops = list(sch.get_loops(block))
    ext = extents(sch, loops)
    total = math.prod(ext)
    if total <= 1:
        return
    tail = contiguous_tail(sch, block, loops)
    fused = 1
    while fused < tail and (math.prod(ext[-fused:]) % params.lanes or math.prod(ext[-fused:]) < 4 * params.lanes):
        fused += 1
    inner_ext = math.prod(ext[-fused:])
    if inner_ext >= max(params.lanes // 2, 2) or len(loops) == fused:
        inner = sch.fuse(*loops[-fused:]) if fused > 1 else loops[-1]
        outer, outer_ext = loops[:-fused], ext[:-fused]
    else:  # innermost axes shorter than half a vector: vectorise across the flattened axes
        inner, inner_ext, outer, outer_ext = sch.fuse(*loops), total, [], []
    vf = vector_factor(inner_ext, params.lanes)
    serial = inner_ext // vf if vf < inner_ext else 1
    if vf < inner_ext:
        vo, vi = sch.split(inner, [None, vf])
    else:
        vo, vi = None, inner
    chunks = math.prod(outer_ext) if outer else 1
    want = 4 * max(params.cores, 1)
    if vo is not None and chunks < want:  # too few outer chunks: part of the vector loop goes parallel
        need = -(-want // chunks)
        split = next((d for d in range(need, min(serial, 8 * need) + 1) if serial % d == 0), serial)
        if split < serial:
            vpo, _ = sch.split(vo, [split, None])
            outer = outer + [vpo]
        else:
            outer = outer + [vo]
    if outer:
        parallelize(sch, sch.fuse(*outer) if len(outer) > 1 else outer[0], total)
    if vf >= 2:
        sch.vectorize(vi)


def contiguous_tail(sch: s_tir.Schedule, block, loops) -> int:
    """How many of ``block``'s innermost loops (at least 1) may be fused into one axis along
    which every buffer it reads or writes is contiguous: for each access, the trailing indices
    are those loops' own iterators, in order, each over its buffer dimension's whole extent,
    or the access names none of them (a broadcast operand)."""
    stmt = sch.get(block)
    from tvm.s_tir.dlight.analysis.common_analysis import get_sblockrealize

    realize = get_sblockrealize(sch, block)
    by_loop = {v: iv for iv, v in zip(stmt.iter_vars, realize.iter_values) if isinstance(v, tirx.Var)}
    ivs = [by_loop.get(sch.get(lp).loop_var) for lp in loops]
    ext = extents(sch, loops)
    regions = list(stmt.reads) + list(stmt.writes)
    n = 1
    while n < len(loops):
        tail = ivs[-(n + 1) :]
        if any(iv is None or not _is_int(iv.dom.extent, e) for iv, e in zip(tail, ext[-(n + 1) :])):
            break
        if not all(_contiguous_along(r, tail) for r in regions):
            break
        n += 1
    return n


def _contiguous_along(region, ivs) -> bool:
    """``region`` (one access of a block) is contiguous along the iterators ``ivs`` fused."""
    names = {iv.var for iv in ivs}

    def uses(expr) -> bool:
        return any(v in names for v in tirx.analysis.undefined_vars(expr))

    dims = list(region.region)
    if not any(uses(r.min) for r in dims):
        return True  # broadcast along them
    k = len(ivs)
    if len(dims) < k or any(uses(r.min) for r in dims[:-k]):
        return False
    shape = list(region.source.shape)[-k:]
    for r, iv, size in zip(dims[-k:], ivs, shape):
        if not (r.min.same_as(iv.var) and _is_int(r.extent, 1) and _is_int(size, int(iv.dom.extent))):
            return False
    return True


def _is_int(expr, value: int) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr) == value


def tile_reduction(
    sch: s_tir.Schedule,
    block,
    params: CPUParams,
    *,
    vec_axis: int,
    reg_axis: Optional[int] = None,
    reg: int = 1,
    vectors: int = 1,
    local: bool = False,
    vf: Optional[int] = None,
):
    """The reduction loop nest of the module docstring for ``block`` (at the root), its
    consumers computed per tile. Returns the parallel (outer) loop. ``vf``: elements per
    vector loop (default :func:`vector_factor`)."""
    kinds = iter_kinds(sch, block)
    if "O" in kinds or "R" not in kinds:
        raise RuleRefused(f"block {sch.get(block).name_hint!r} is not a reduction ({kinds})")
    if kinds[vec_axis] != "S" or (reg_axis is not None and kinds[reg_axis] != "S"):
        raise RuleRefused("the vector and register axes must be data-parallel")
    if local or _writes_param(sch, block):  # accumulate in a tile, write once
        sch.cache_write(block, 0, "local" if local else "global")
    loops = loops_per_iter(sch, block)
    ext = extents(sch, loops)
    total = work(sch, block)
    if vf is None:
        vf = vector_factor(ext[vec_axis], params.lanes, vectors)
    xo, xi = sch.split(loops[vec_axis], [None, vf])
    fi = None
    outer = []
    for i, kind in enumerate(kinds):
        if kind != "S":
            continue
        if i == vec_axis:
            outer.append(xo)
        elif i == reg_axis and reg > 1:
            fo, fi = sch.split(loops[i], [None, reg])
            outer.append(fo)
        else:
            outer.append(loops[i])
    reduce = [loops[i] for i, k in enumerate(kinds) if k == "R"]
    inner = ([fi] if fi is not None else []) + [xi]
    sch.reorder(*outer, *reduce, *inner)
    par = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    epilogue = _epilogue_per_tile(sch, block, par, params)
    parallelize(sch, par, total)
    if fi is not None:
        sch.unroll(fi)
    if vf >= 2:
        sch.vectorize(xi)
    sch.decompose_reduction(block, reduce[0])  # the init loops copy the tile's unroll and vector
    for b in epilogue:
        lp = sch.get_loops(b)
        if len(lp) > 1 and int(sch.get(lp[-1]).extent) >= 2:
            sch.vectorize(lp[-1])
    return par


def _writes_param(sch: s_tir.Schedule, block) -> bool:
    """The block writes a buffer of the function's (not one allocated in the kernel)."""
    region = sch.get(block).writes[0]
    written = region.source
    allocated = sch.get(sch.get_sblock("root", func_name="main")).alloc_buffers
    return not any(b.same_as(written) for b in allocated)


def _epilogue_per_tile(sch: s_tir.Schedule, block, loop, params: CPUParams) -> list:
    """Inline the element-wise chain after ``block`` into its last blocks and compute those
    under ``loop`` (one tile at a time: the reduction's result never leaves the tile).
    Returns the blocks moved; a consumer that cannot move stays at the root (scheduled later)."""
    _inline_epilogue(sch, block)
    return _move_epilogue(sch, block, loop)


def _inline_epilogue(sch: s_tir.Schedule, block) -> None:
    """The first half of :func:`_epilogue_per_tile`: every block after ``block`` that has a
    consumer inlined into it where TVM can."""
    changed = True
    while changed:
        changed = False
        for b in _downstream(sch, block):
            if not sch.get_consumers(b):
                continue
            try:
                sch.compute_inline(b)
                changed = True
                break
            except Exception:  # noqa: BLE001 - TVM's ScheduleError: this one stays
                continue


def _last_blocks(sch: s_tir.Schedule, block) -> list:
    """The blocks after ``block`` that no block reads (the epilogue's outputs)."""
    return [b for b in _downstream(sch, block) if not sch.get_consumers(b)]


def _move_epilogue(sch: s_tir.Schedule, block, loop) -> list:
    """The second half of :func:`_epilogue_per_tile`: the last blocks computed under ``loop``."""
    moved = []
    produced = _written_elements(sch, block)
    for b in _downstream(sch, block):
        if sch.get_consumers(b):
            continue
        if _written_elements(sch, b) > produced:
            # a consumer larger than the tile's producer (a padding after a pool): computed per
            # tile it would only cover what the tiles produce, and its border would never be written
            log.debug("epilogue block %s stays at the root: it writes more than %s", sch.get(b).name_hint, sch.get(block).name_hint)
            continue
        try:
            sch.reverse_compute_at(b, loop, preserve_unit_loops=False)
            moved.append(b)
        except Exception as e:  # noqa: BLE001 - it stays at the root, full-size
            log.debug("epilogue block %s stays at the root: %s", sch.get(b).name_hint, e)
    return moved


def _written_elements(sch: s_tir.Schedule, block) -> int:
    """Elements the block computes: the product of its data-parallel iteration extents (the
    output elements of a reduction; a padding's whole padded output)."""
    n = 1
    for iv, kind in zip(sch.get(block).iter_vars, iter_kinds(sch, block)):
        if kind == "S":
            n *= int(iv.dom.extent)
    return n


def _downstream(sch: s_tir.Schedule, block) -> list:
    seen, out, todo = set(), [], list(sch.get_consumers(block))
    while todo:
        b = todo.pop(0)
        name = sch.get(b).name_hint
        if name in seen:
            continue
        seen.add(name)
        out.append(b)
        todo.extend(sch.get_consumers(b))
    return out


def finish_root(sch: s_tir.Schedule, params: CPUParams) -> None:
    """Schedule every root block a rule left as a plain nest (padding, producers, consumers
    that could not move): injective ones as such, reductions with their innermost axis as vector."""
    for b in root_blocks(sch):
        loops = sch.get_loops(b)
        if not loops or any(sch.get(lp).kind != tirx.ForKind.SERIAL for lp in loops):
            continue
        kinds = iter_kinds(sch, b)
        if set(kinds) <= {"S"}:
            schedule_injective(sch, b, params)
        elif "O" not in kinds and len(loops) == len(kinds):
            spatial = [i for i, k in enumerate(kinds) if k == "S"]
            if spatial:
                ext = extents(sch, loops)
                vec = max(spatial, key=lambda i: (ext[i] > 1, i))
                tile_reduction(sch, b, params, vec_axis=vec)


def loop_kinds(func: tirx.PrimFunc) -> set[str]:
    """The kinds of the loops around the blocks of ``func`` (``parallel``, ``vectorized``,
    ``unrolled``, ``serial``)."""
    names = {
        tirx.ForKind.SERIAL: "serial",
        tirx.ForKind.PARALLEL: "parallel",
        tirx.ForKind.VECTORIZED: "vectorized",
        tirx.ForKind.UNROLLED: "unrolled",
    }
    sch = s_tir.Schedule(func)
    found: set[str] = set()
    todo = root_blocks(sch)
    while todo:
        b = todo.pop()
        found.update(names.get(sch.get(lp).kind, "other") for lp in sch.get_loops(b))
        todo.extend(sch.get_child_blocks(b))
    return found
