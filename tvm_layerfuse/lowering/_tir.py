"""TIR helpers shared by the lowering passes: read a fused PrimFunc, move its buffers.

Two rewrites of a PrimFunc produced by ``FuseTIR`` (unscheduled S-TIR: a root block whose
body is a sequence of perfect loop nests, one leaf block each):

*Retarget* a buffer parameter ``X: [d_0, ..., d_{r-1}]`` to a region of a larger buffer
``B: [D_0, ..., D_{r-1}]`` at per-axis offsets ``off``::

    X[i_0, ..., i_{r-1}]  ->  B[i_0 + off_0, ..., i_{r-1} + off_{r-1}]      (loads, stores,
                                                                              read/write regions)

``X`` must be used only through loads, stores and block regions; ``B`` replaces it in the
parameter list. With ``B`` row-major, element ``(i)`` of ``X`` lands at flat position
``sum_k (i_k + off_k) * stride_k(B)``: for a channel concat at batch 1 that is the
contiguous run starting at ``off_1 * H * W``; otherwise a strided view, written in place
by the same index arithmetic (no extra copy either way).

*Partition* an output ``Y`` along an axis ``a`` into ranges ``[lo_j, hi_j)`` each written
to its own destination (a buffer of its own, or a region of a block): the loop nest that
writes ``Y`` is duplicated once per range, the copy iterating ``v_a' in [0, hi_j - lo_j)``
with ``v_a = v_a' + lo_j`` substituted in its body, and its stores retargeted as above
with ``off_a = dst_off_a - lo_j``.

Recognisers: :func:`match_concat` (TOPI's concatenate, also a fused tree of them, checked
index by index: each input read once at ``v_a - o_j`` under ``o_j <= v_a``, offsets the
running sums) and :func:`match_split` (one slice-copy nest per output).

Anything not understood is refused with a reason (a string), never rewritten.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import tvm
import tvm_ffi
from tvm import ir, tirx
from tvm.s_tir import SBlock, SBlockRealize

log = logging.getLogger(__name__)

_IF_THEN_ELSE = "prim.if_then_else"


# ----------------------------------------------------------------------------- small utils
def const_shape(shape) -> Optional[list[int]]:
    """``[int]`` when every dimension is a constant, else None."""
    out = []
    for d in shape:
        if not isinstance(d, tirx.IntImm):
            return None
        out.append(int(d.value))
    return out


def buffer_shape(buf) -> Optional[list[int]]:
    return const_shape(buf.ty.shape)


def buffer_dtype(buf) -> str:
    return str(buf.ty.dtype)


def new_buffer(shape: Sequence[int], dtype: str, name: str):
    """A compact, offset-0 global buffer variable (a PrimFunc parameter) of ``shape``."""
    return tirx.decl_buffer([tirx.IntImm("int64", int(d)) for d in shape], dtype, name, layout=None)


def _plain_buffer(buf) -> Optional[str]:
    """Reason why ``buf`` is not a plain compact global buffer, or None."""
    t = buf.ty
    if list(t.strides):
        return f"buffer {buf.name} has explicit strides"
    if t.elem_offset is not None and not (isinstance(t.elem_offset, tirx.IntImm) and int(t.elem_offset.value) == 0):
        return f"buffer {buf.name} has an element offset"
    if t.layout is not None:
        return f"buffer {buf.name} has a layout"
    if str(t.storage_scope) not in ("global", ""):
        return f"buffer {buf.name} lives in scope {t.storage_scope}"
    if buffer_shape(buf) is None:
        return f"buffer {buf.name} has a symbolic shape"
    return None


def _int(value: int, like) -> tirx.IntImm:
    return tirx.IntImm(str(like.ty), int(value))


def _shift(indices, offsets: Sequence[int]) -> list:
    return [i if not o else i + _int(o, i) for i, o in zip(indices, offsets)]


def references(node, variables: Sequence) -> bool:
    """Whether any of ``variables`` (Var nodes) occurs anywhere inside ``node``."""
    wanted = list(variables)

    def on_var(v):
        if any(v.same_as(w) for w in wanted):
            return tvm_ffi.VisitInterrupt(v)
        return None

    return tvm_ffi.structural_walk(node, [(ir.Var, on_var)]) is not None


def _collect(node, kind) -> list:
    """Every node of type ``kind`` inside ``node`` (pre-order)."""
    found: list = []
    if node is None:
        return found
    tvm_ffi.structural_walk(node, [(kind, found.append)], order="pre")
    return found


_MISSING = object()


def _get(pairs, key, default=_MISSING):
    """``pairs`` (``(node, value)`` pairs, e.g. ``mapping.items()``) looked up by object
    identity, never by ``==`` (which builds an expression for TIR variables); ``default``
    when absent, else ``KeyError``."""
    for k, v in pairs:
        if k.same_as(key):
            return v
    if default is _MISSING:
        raise KeyError(key)
    return default


def _iter_var_index(expr, iter_vars) -> Optional[int]:
    """Position of the iter var that ``expr`` is (the same node), or None."""
    return next((k for k, iv in enumerate(iter_vars) if expr.same_as(iv.var)), None)


def _plain_params(func) -> Union[list, str]:
    """The parameters of ``func`` when it is a PrimFunc of at least two plain buffer
    parameters (the recognisers' common premise), else a reason."""
    if not isinstance(func, tirx.PrimFunc):
        return "not a PrimFunc"
    params = list(func.params)
    if len(params) < 2 or not all(tirx.is_buffer_var(p) for p in params):
        return "parameters are not all buffers"
    for p in params:
        reason = _plain_buffer(p)
        if reason:
            return reason
    return params


# ----------------------------------------------------------------------------- loop nests
@dataclass
class Nest:
    """One top-level statement of the root block: a perfect loop nest around one leaf block."""

    stmt: object  # the outermost For (or the SBlockRealize itself when there is no loop)
    loops: list  # For nodes, outermost first
    realize: SBlockRealize
    block: SBlock


def root_block(func) -> Optional[SBlock]:
    body = func.body
    if isinstance(body, SBlockRealize) and isinstance(body.block, SBlock):
        return body.block
    return None


def top_level_stmts(block: SBlock) -> list:
    body = block.body
    if isinstance(body, tirx.SeqStmt):
        return list(body.seq)
    return [body]


def as_nest(stmt) -> Union[Nest, str]:
    """``stmt`` as a perfect nest ``for ... for: block`` (serial loops from 0, no nested block)."""
    loops = []
    cur = stmt
    while isinstance(cur, tirx.For):
        if not (isinstance(cur.min, tirx.IntImm) and int(cur.min.value) == 0):
            return "a loop does not start at 0"
        if cur.step is not None and not (isinstance(cur.step, tirx.IntImm) and int(cur.step.value) == 1):
            return "a loop has a step"
        if int(cur.kind) != int(tirx.ForKind.SERIAL) or cur.thread_binding is not None or dict(cur.annotations):
            return "a loop is already scheduled (not serial, bound or annotated)"
        loops.append(cur)
        cur = cur.body
    if not isinstance(cur, SBlockRealize):
        return f"expected a block under the loops, found {type(cur).__name__}"
    block = cur.block
    if _collect(block.body, SBlock):
        return f"block {block.name_hint} has nested blocks"
    if list(block.match_buffers) or list(block.alloc_buffers):
        return f"block {block.name_hint} matches or allocates buffers"
    return Nest(stmt=stmt, loops=loops, realize=cur, block=block)


def _bindings_are_loops(nest: Nest) -> Optional[str]:
    """Reason unless each block iter var is bound to its own loop var over its whole domain."""
    if not (isinstance(nest.realize.predicate, tirx.IntImm) and int(nest.realize.predicate.value) == 1):
        return f"block {nest.block.name_hint} has a predicate"
    seen = []
    for iv, value in zip(nest.block.iter_vars, nest.realize.iter_values):
        loop = next((l for l in nest.loops if l.loop_var.same_as(value)), None)
        if loop is None:
            return f"block {nest.block.name_hint}: iter var {iv.var.name} is not bound to a loop variable"
        if any(loop is s for s in seen):
            return f"block {nest.block.name_hint}: one loop binds two iter vars"
        seen.append(loop)
        if not (isinstance(iv.dom.min, tirx.IntImm) and int(iv.dom.min.value) == 0):
            return f"block {nest.block.name_hint}: iter var {iv.var.name} does not start at 0"
        if not (isinstance(loop.extent, tirx.IntImm) and isinstance(iv.dom.extent, tirx.IntImm)):
            return f"block {nest.block.name_hint}: symbolic extents"
        if int(loop.extent.value) != int(iv.dom.extent.value):
            return f"block {nest.block.name_hint}: loop and iter var {iv.var.name} extents differ"
    if len(seen) != len(nest.loops):
        return f"block {nest.block.name_hint}: a loop binds no iter var"
    return None


def _stores(node) -> list:
    return _collect(node, tirx.BufferStore)


def _loads(node) -> list:
    return _collect(node, ir.TensorLoad)


def _same_vars(indices, iter_vars) -> bool:
    return len(indices) == len(iter_vars) and all(i.same_as(iv.var) for i, iv in zip(indices, iter_vars))


# ----------------------------------------------------------------------------- retarget
@dataclass(frozen=True)
class Region:
    """Where a tensor lives inside a larger buffer: ``buffer[off_0 + i_0, off_1 + i_1, ...]``."""

    buffer: object  # tirx buffer Var of the new (larger) parameter
    offsets: tuple[int, ...]


def check_retargetable(func, buf) -> Optional[str]:
    """Reason why parameter ``buf`` of ``func`` cannot be moved into a region, or None."""
    reason = _plain_buffer(buf)
    if reason:
        return reason
    root = root_block(func)
    if root is None:
        return "the function has no root block (already lowered?)"
    if any(b.same_as(buf) for b in root.alloc_buffers):
        return f"{buf.name} is allocated inside the function"
    # every occurrence must be a load, a store or a block region: replace those and look again
    shape = buffer_shape(buf)
    probe = retarget_body(func.body, {buf: Region(new_buffer(shape, buffer_dtype(buf), "probe"), (0,) * len(shape))})
    if references(probe, [buf]):
        return f"{buf.name} is used other than through loads, stores and block regions (e.g. an address or an intrinsic)"
    return None


def retarget_body(body, remap: Mapping[object, Region]):
    """``body`` with every load/store/region of a key of ``remap`` moved to its region."""
    items = list(remap.items())

    def on_load(node):
        r = _get(items, node.source, None)
        if r is None:
            return node
        return tirx.BufferLoad(r.buffer, _shift(list(node.indices), r.offsets))

    def on_store(node):
        r = _get(items, node.buffer, None)
        if r is None:
            return node
        return tirx.BufferStore(r.buffer, node.value, _shift(list(node.indices), r.offsets))

    def on_region(node):
        r = _get(items, node.source, None)
        if r is None:
            return node
        ranges = [
            ir.Range.from_min_extent(rng.min if not o else rng.min + _int(o, rng.min), rng.extent)
            for rng, o in zip(node.region, r.offsets)
        ]
        return tirx.BufferRegion(r.buffer, ranges)

    return tvm_ffi.structural_map(
        body, [(ir.TensorLoad, on_load), (tirx.BufferStore, on_store), (ir.TensorRegion, on_region)]
    )


def retarget(func, remap: Mapping[object, Region], params: Sequence) -> "tirx.PrimFunc":
    """``func`` with each buffer parameter in ``remap`` moved into its region, new ``params``.

    ``params`` is the complete new parameter list (each region buffer once). Raises
    ``ValueError`` when an old buffer is still referenced afterwards (callers check
    :func:`check_retargetable` first)."""
    body = retarget_body(func.body, remap)
    stale = [b for b in remap if references(body, [b])]
    if stale:
        raise ValueError(f"buffers {[b.name for b in stale]} are still referenced after the retarget")
    return tirx.PrimFunc(list(params), body, func.ret_type, func.attrs)


# ----------------------------------------------------------------------------- partition
@dataclass(frozen=True)
class Piece:
    """Range ``[lo, hi)`` of an output along the partition axis, and where it goes."""

    lo: int
    hi: int
    target: Region  # region.offsets: where element (.., lo, ..) of the range lands


def check_partitionable(func, out, axis: int) -> Union[Nest, str]:
    """The single nest writing ``out`` when it can be split along ``axis``, else a reason."""
    reason = _plain_buffer(out)
    if reason:
        return reason
    root = root_block(func)
    if root is None:
        return "the function has no root block"
    users = [s for s in top_level_stmts(root) if references(s, [out])]
    if len(users) != 1:
        return f"{out.name} is accessed by {len(users)} loop nests (expected exactly the one writing it)"
    nest = as_nest(users[0])
    if isinstance(nest, str):
        return nest
    reason = _bindings_are_loops(nest)
    if reason:
        return reason
    block = nest.block
    shape = buffer_shape(out)
    ivs = list(block.iter_vars)
    stores = _stores(block.body) + (_stores(block.init) if block.init is not None else [])
    if not stores or any(not s.buffer.same_as(out) for s in stores):
        return f"block {block.name_hint} stores into other buffers than {out.name}"
    # out[v_0, ..., v_{r-1}]: the block's first r iter vars (spatial); any further ones are
    # reduction vars (a conv writing its output directly: init + update)
    if any(int(iv.iter_type) != 0 for iv in ivs[: len(shape)]) or any(int(iv.iter_type) == 0 for iv in ivs[len(shape) :]):
        return f"block {block.name_hint}: the iter vars are not the output's spatial axes then reduction axes"
    for acc in stores + [l for l in _loads(block.body) if l.source.same_as(out)]:
        if not _same_vars(list(acc.indices), ivs[: len(shape)]):
            return f"block {block.name_hint} accesses {out.name} at indices other than its iter vars"
    if [int(iv.dom.extent.value) for iv in ivs[: len(shape)]] != shape:
        return f"block {block.name_hint} does not cover {out.name}"
    writes = [w for w in block.writes if w.source.same_as(out)]
    if len(list(block.writes)) != 1 or len(writes) != 1:
        return f"block {block.name_hint} writes more than {out.name}"
    return nest


def _rename(node, mapping: Mapping[object, object]):
    items = list(mapping.items())
    return tvm_ffi.structural_map(node, [(ir.Var, lambda v: _get(items, v, v))])


def partition(func, out, axis: int, pieces: Sequence[Piece], params: Sequence, *, nest: Nest) -> "tirx.PrimFunc":
    """``func`` with the nest that writes ``out`` duplicated once per piece (see the module
    doc): copy ``k`` iterates only its range and stores into its own target, no branch.

    The result has several epilogue blocks; TVM 0.27's dlight GPU Matmul rule schedules
    only one (it miscompiles or asserts otherwise), so GPU pipelines do not use this."""
    copies = [_copy_nest(out, axis, piece, k, nest) for k, piece in enumerate(pieces)]
    root = root_block(func)
    seq = []
    for s in top_level_stmts(root):
        if s.same_as(nest.stmt):
            seq.extend(copies)
        else:
            seq.append(s)
    new_root = SBlock(
        list(root.iter_vars),
        list(root.reads),
        list(root.writes),
        root.name_hint,
        tirx.SeqStmt(seq) if len(seq) > 1 else seq[0],
        root.init,
        list(root.alloc_buffers),
        list(root.match_buffers),
        dict(root.annotations),
    )
    body = SBlockRealize(list(func.body.iter_values), func.body.predicate, new_root)
    if references(body, [out]):
        raise ValueError(f"{out.name} is still referenced after the partition")
    return tirx.PrimFunc(list(params), body, func.ret_type, func.attrs)


def _copy_nest(out, axis: int, piece: Piece, k: int, nest: Nest):
    """Copy ``k`` of the nest: iterates ``v_a' in [0, hi - lo)`` with ``v_a = v_a' + lo``."""
    analyzer = tvm.sym.Analyzer()
    block = nest.block
    axis_loop = next(l for l in nest.loops if l.loop_var.same_as(nest.realize.iter_values[axis]))
    extent = piece.hi - piece.lo
    loop_map = [(l.loop_var, tirx.Var(f"{l.loop_var.name}_{k}", str(l.loop_var.ty))) for l in nest.loops]
    iv_map = [(iv.var, tirx.Var(f"{iv.var.name}_{k}", str(iv.var.ty))) for iv in block.iter_vars]
    v_axis = block.iter_vars[axis].var
    shifted = {old: (new + _int(piece.lo, new) if old.same_as(v_axis) else new) for old, new in iv_map}
    offsets = list(piece.target.offsets)
    offsets[axis] -= piece.lo  # element lo of the range lands at target offset
    region = Region(piece.target.buffer, tuple(offsets))

    def move(node):
        return retarget_body(_rename(node, shifted), {out: region})

    body = _simplify_indices(move(block.body), analyzer)
    init = _simplify_indices(move(block.init), analyzer) if block.init is not None else None
    reads = [_simplify_region(r, analyzer) for r in move(list(block.reads))]
    writes = [_simplify_region(r, analyzer) for r in move(list(block.writes))]
    iter_vars = []
    for j, iv in enumerate(block.iter_vars):
        dom = iv.dom if j != axis else ir.Range.from_min_extent(iv.dom.min, _int(extent, iv.dom.extent))
        iter_vars.append(tirx.IterVar(dom, _get(iv_map, iv.var), int(iv.iter_type), iv.thread_tag))
    new_block = SBlock(
        iter_vars, reads, writes, f"{block.name_hint}_part{k}", body, init, [], [], dict(block.annotations)
    )
    values = [_get(loop_map, v) for v in nest.realize.iter_values]
    stmt = SBlockRealize(values, nest.realize.predicate, new_block)
    for loop in reversed(nest.loops):
        ext = loop.extent if loop is not axis_loop else _int(extent, loop.extent)
        stmt = tirx.For(_get(loop_map, loop.loop_var), loop.min, ext, loop.kind, stmt, None, dict(loop.annotations))
    return stmt


def _simplify_indices(node, analyzer):
    def on_load(n):
        return tirx.BufferLoad(n.source, [analyzer.simplify(i) for i in n.indices])

    def on_store(n):
        return tirx.BufferStore(n.buffer, n.value, [analyzer.simplify(i) for i in n.indices])

    return tvm_ffi.structural_map(node, [(ir.TensorLoad, on_load), (tirx.BufferStore, on_store)])


def _simplify_region(region, analyzer):
    return tirx.BufferRegion(
        region.source, [ir.Range.from_min_extent(analyzer.simplify(r.min), r.extent) for r in region.region]
    )


# ----------------------------------------------------------------------------- recognisers
@dataclass(frozen=True)
class ConcatKernel:
    """A PrimFunc that is exactly a concatenation of its inputs (possibly a fused tree of them).

    ``starts[j]`` is where input ``j`` lands in the output, one offset per axis: for
    ``concat(in_0, ..., in_{n-1}, axis=a)`` it is ``o_j`` on axis ``a`` (``o_j = sum_{k<j}
    C_k``) and 0 elsewhere; a nested concat (``FuseOps`` fuses ``concat(x, concat(a, b))``
    into one kernel) adds the inner offsets. ``axis`` is the outermost concat's axis."""

    axis: int
    starts: tuple[tuple[int, ...], ...]
    in_shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...]
    dtype: str

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each input's offset along :attr:`axis`."""
        return tuple(s[self.axis] for s in self.starts)


def _axis_var_offset(expr, iter_vars) -> Optional[tuple[int, int]]:
    """``(axis, o)`` when ``expr`` is ``v_axis - o`` / ``v_axis + (-o)`` / ``v_axis``."""
    k = _iter_var_index(expr, iter_vars)
    if k is not None:
        return k, 0
    for kind, sign in ((tirx.Sub, 1), (tirx.Add, -1)):
        if isinstance(expr, kind) and isinstance(expr.b, tirx.IntImm):
            k = _iter_var_index(expr.a, iter_vars)
            if k is not None:
                return k, sign * int(expr.b.value)
    return None


def _cond_offset(cond, iter_vars) -> Optional[tuple[int, int]]:
    """``(axis, o)`` for ``o <= v_axis`` or ``v_axis >= o``."""
    if isinstance(cond, tirx.LE) and isinstance(cond.a, tirx.IntImm):
        var, const = cond.b, cond.a
    elif isinstance(cond, tirx.GE) and isinstance(cond.b, tirx.IntImm):
        var, const = cond.a, cond.b
    else:
        return None
    k = _iter_var_index(var, iter_vars)
    return None if k is None else (k, int(const.value))


def _concat_block(nest: Nest, shapes: Mapping) -> Union[tuple, str]:
    """``(dest, axis, [(source, o), ...])`` for one concat block, sources in order.

    Accepted form: ``dest[v] = if_then_else(o_{n-1} <= v_a, src_{n-1}[.., v_a - o_{n-1}, ..],
    if_then_else(..., src_0[v]))`` over the whole of ``dest``; each load reads its source at
    the block vars except ``v_a - o_j`` on the axis; offsets are the running sums of the
    source extents and the destination extent their total. ``shapes`` maps every buffer
    (parameter or intermediate) to its shape."""
    reason = _bindings_are_loops(nest)
    if reason:
        return reason
    block = nest.block
    if block.init is not None:
        return "the block has an init"
    store = block.body
    if not isinstance(store, tirx.BufferStore):
        return "the block is not one store"
    dest = store.buffer
    ivs = list(block.iter_vars)
    if not _same_vars(list(store.indices), ivs) or any(int(iv.iter_type) != 0 for iv in ivs):
        return "the store is not at the block's spatial iter vars"
    out_shape = _get(shapes.items(), dest, None)
    if out_shape is None or [int(iv.dom.extent.value) for iv in ivs] != list(out_shape):
        return "the nest does not cover its destination"
    pieces = []  # (axis or None, o, load), from the last source to the first
    value = store.value
    while isinstance(value, ir.Call) and isinstance(value.op, ir.Op) and value.op.name == _IF_THEN_ELSE:
        cond, then, other = value.args
        c = _cond_offset(cond, ivs)
        if c is None:
            return "an if_then_else condition is not `offset <= v_axis`"
        pieces.append((c[0], c[1], then))
        value = other
    pieces.append((None, 0, value))
    axes = {a for a, _, _ in pieces if a is not None}
    if len(axes) > 1:
        return "conditions on more than one axis"
    axis = axes.pop() if axes else 0
    sources = []
    for _, o, load in reversed(pieces):
        if not isinstance(load, ir.TensorLoad):
            return "a branch is not a plain load"
        for d, i in enumerate(load.indices):
            if d == axis:
                if _axis_var_offset(i, ivs) != (axis, o):
                    return "a load's axis index does not match its condition"
            elif not i.same_as(ivs[d].var):
                return "a load reads off the block vars"
        sources.append((load.source, o))
    start = 0
    for src, o in sources:
        shape = _get(shapes.items(), src, None)
        if shape is None or o != start or len(shape) != len(out_shape):
            return "offsets are not the running sum of the source extents"
        if any(shape[d] != out_shape[d] for d in range(len(shape)) if d != axis):
            return "a source differs from the destination off the axis"
        start += shape[axis]
    if start != out_shape[axis]:
        return "source extents do not add up to the destination"
    return dest, axis, sources


def match_concat(func) -> Union[ConcatKernel, str]:
    """Recognise TOPI's concatenate after FuseTIR (``concatenate``, ``fused_concatenate``),
    including a fused tree of concatenations (``fused_concatenate5_concatenate5_concatenate6``:
    inner concats written to intermediate buffers that only the outer one reads).

    Every top-level loop nest must be a concat block (:func:`_concat_block`); expanding the
    intermediates from the output must reach every input parameter exactly once and use
    every intermediate exactly once."""
    params = _plain_params(func)
    if isinstance(params, str):
        return params
    out, inputs = params[-1], params[:-1]
    root = root_block(func)
    if root is None:
        return "no root block"
    inter = list(root.alloc_buffers)
    for b in inter:
        reason = _plain_buffer(b)
        if reason:
            return f"intermediate {reason}"
    shapes = {b: buffer_shape(b) for b in params + inter}
    writers = {}  # dest buffer -> (axis, sources)
    for stmt in top_level_stmts(root):
        nest = as_nest(stmt)
        if isinstance(nest, str):
            return nest
        parsed = _concat_block(nest, shapes)
        if isinstance(parsed, str):
            return parsed
        dest, axis, sources = parsed
        if any(dest.same_as(d) for d in writers):
            return f"{dest.name} is written twice"
        writers[dest] = (axis, sources)

    def writer(buf):
        return _get(writers.items(), buf, None)

    top = writer(out)
    if top is None:
        return "the output is not written by a concat block"
    starts: dict = {}
    used: list = []

    def expand(buf, base: tuple) -> Optional[str]:
        axis, sources = writer(buf)
        for src, o in sources:
            at = list(base)
            at[axis] += o
            if any(src.same_as(u) for u in used):
                return f"{src.name} is read twice"
            used.append(src)
            if writer(src) is not None:
                why = expand(src, tuple(at))
                if why:
                    return why
            else:
                j = next((k for k, p in enumerate(inputs) if src.same_as(p)), None)
                if j is None:
                    return f"{src.name} is neither an input nor written by a concat block"
                starts[j] = tuple(at)
        return None

    why = expand(out, (0,) * len(shapes[out]))
    if why:
        return why
    if sorted(starts) != list(range(len(inputs))):
        return "not every input is read"
    if len(used) != len(inputs) + len(writers) - 1:
        return "an intermediate is written but not read"
    if any(buffer_dtype(p) != buffer_dtype(out) for p in inputs):
        return "dtypes differ"
    return ConcatKernel(
        axis=top[0],
        starts=tuple(starts[j] for j in range(len(inputs))),
        in_shapes=tuple(tuple(shapes[p]) for p in inputs),
        out_shape=tuple(shapes[out]),
        dtype=buffer_dtype(out),
    )


def stored_bytes(func) -> int:
    """Bytes ``func`` stores into its parameters per call: for each loop nest, the product of
    its loop extents times the item size of each parameter it stores into (nests that are not
    perfect count the whole parameter)."""
    total = 0
    params = list(func.params)
    root = root_block(func)
    for stmt in top_level_stmts(root) if root is not None else []:
        targets = [s.buffer for s in _stores(stmt) if any(s.buffer.same_as(p) for p in params)]
        if not targets:
            continue
        nest = as_nest(stmt)
        for buf in targets:
            if isinstance(nest, Nest) and all(isinstance(l.extent, tirx.IntImm) for l in nest.loops):
                count = int(np.prod([int(l.extent.value) for l in nest.loops], dtype=np.int64))
            else:
                count = int(np.prod(buffer_shape(buf), dtype=np.int64))
            total += count * np.dtype(buffer_dtype(buf)).itemsize
    return total


def is_data_movement(func) -> bool:
    """Whether every value ``func`` stores is a load, or a choice (``if_then_else``) between
    loads: a kernel that only moves data (a copy), no arithmetic on what it moves."""

    def movement(value) -> bool:
        if isinstance(value, ir.TensorLoad):
            return True
        if isinstance(value, ir.Call) and isinstance(value.op, ir.Op) and value.op.name == _IF_THEN_ELSE:
            _, then, otherwise = value.args  # if_then_else(cond, then, otherwise)
            return movement(then) and movement(otherwise)
        return False

    stores = _stores(func.body)
    return bool(stores) and all(movement(s.value) for s in stores)


@dataclass(frozen=True)
class SplitKernel:
    """A PrimFunc that is exactly ``out_j = in[..., o_j : o_j + C_j, ...]`` for ``j = 0..n-1``."""

    axis: int
    offsets: tuple[int, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    in_shape: tuple[int, ...]
    dtype: str


def match_split(func) -> Union[SplitKernel, str]:
    """Recognise TOPI's split: one input, ``n`` outputs, one nest per output copying a slice."""
    params = _plain_params(func)
    if isinstance(params, str):
        return params
    src, outs = params[0], params[1:]
    root = root_block(func)
    if root is None or list(root.alloc_buffers):
        return "no plain root block"
    stmts = top_level_stmts(root)
    if len(stmts) != len(outs):
        return "not one loop nest per output"
    in_shape = buffer_shape(src)
    axis = None
    found = {}
    for stmt in stmts:
        nest = as_nest(stmt)
        if isinstance(nest, str):
            return nest
        reason = _bindings_are_loops(nest)
        if reason:
            return reason
        block = nest.block
        store = block.body
        ivs = list(block.iter_vars)
        if block.init is not None or not isinstance(store, tirx.BufferStore):
            return "a block is not one store"
        j = next((k for k, p in enumerate(outs) if store.buffer.same_as(p)), None)
        if j is None or j in found:
            return "a block does not write its own output"
        if not _same_vars(list(store.indices), ivs) or [int(iv.dom.extent.value) for iv in ivs] != buffer_shape(outs[j]):
            return "a block does not cover its output"
        load = store.value
        if not isinstance(load, ir.TensorLoad) or not load.source.same_as(src):
            return "a block does not copy the input"
        offset = 0
        for d, i in enumerate(load.indices):
            if i.same_as(ivs[d].var):
                continue
            ao = _axis_var_offset(i, ivs)
            if ao is None or ao[0] != d or (axis is not None and axis != d):
                return "a load is not a slice along one axis"
            axis, offset = d, -ao[1]
        found[j] = offset
    if axis is None:
        axis = 1 if len(in_shape) > 1 else 0
    out_shapes = [buffer_shape(p) for p in outs]
    start = 0
    for j, shape in enumerate(out_shapes):
        if found[j] != start or any(shape[d] != in_shape[d] for d in range(len(shape)) if d != axis):
            return "slices are not consecutive"
        start += shape[axis]
    if start != in_shape[axis]:
        return "slices do not cover the input"
    return SplitKernel(
        axis=axis,
        offsets=tuple(found[j] for j in range(len(outs))),
        out_shapes=tuple(tuple(s) for s in out_shapes),
        in_shape=tuple(in_shape),
        dtype=buffer_dtype(src),
    )
