"""The oneDNN tactic's data movement around the conv layers: split pieces, pools,
concatenations, the classifier and the layout of every tensor between library calls (steps
of :class:`.use_onednn.UseOneDNNConv`).

Split pieces: a horizontally merged conv read only by ``split(axis=1)`` becomes one call
with one output per piece (``out_sinfo`` a tuple)::

    split(conv(x, W, b), [o_1, ...]) == (conv(x, W[0:o_1], b[0:o_1]), conv(x, W[o_1:o_2], ...), ...)

so no split kernel copies the pieces (the library runs one primitive per row range).

Pools and concatenations that read a oneDNN tensor become library calls too:
``max_pool2d`` / ``avg_pool2d`` (NCHW, no dilation; ``count_include_pad`` only where
ceil_mode adds no cells beyond the stated padding, which ONNX would not count) and the
global average (``mean`` over H, W with keepdims, ``adaptive_avg_pool2d`` to 1x1) ->
``layerfuse.onednn.pool2d``; a channel concat -> ``layerfuse.onednn.concat`` (one ``memcpy``
per piece and image: TVM's in-place concat only moves TVM kernels' outputs), except a concat
with an upsampled piece, which stays TVM's: FuseOps makes the upsample and the concat one
kernel, as in TVM's default pipeline.

Layout (per tensor: plain NCHW or oneDNN's blocked ``nChwBc``, same size and Relax type).
The block width ``B`` is the one oneDNN's optimised kernels take on this CPU
(:func:`.onednn.block_width`: 16 with AVX-512, 8 with AVX2; 0 keeps every tensor plain), and
every blocked call carries it in its attrs. Tensors that must share a layout form classes: a
concat's inputs and output (per image, channels ``[c, c + C)`` of an ``nChwBc`` tensor are
the contiguous range ``[c*H*W, (c+C)*H*W)`` when ``c`` and ``C`` are multiples of B, exactly
as in NCHW, so the concat's copies are the same bytes either way), a pool's src and dst, a
residual and the output it is added to. A class is blocked when every member is 4-d with
``C % B == 0``, made by a library call, and read by library calls only (never by a TVM
kernel or the caller) -- except that a ``C % B == 0`` tensor with 1x1 spatial has the same
bytes in both layouts, so anyone may read it. A conv reads either layout (``src_block``: 0 or
B) and writes either (``dst_block``: B or 0 per output piece); a plain src or dst is
reordered inside the library call, and a plain tensor read by several convs is reordered
once (``layerfuse.onednn.to_blocked``). A tensor with ``B < C``, ``C % B != 0`` (MobileNet-V2's
24 channels with B = 16) that convs with one output make and only convs read is kept in
padded ``nChwBc``: its Relax type becomes ``[N, ceilB(C), H, W]``, the bytes oneDNN's padded
layout takes (see ``_padded``). So reorders happen only where a TVM kernel reads or writes a
tensor next to a oneDNN layer (and at the split pieces of a merged conv with such channel
counts, or C < B). A conv or pool that oneDNN would run with a reference (``ref:``) kernel in
the blocked layout gets its tensors' classes plain instead (``_refuse_reference_kernels``),
so no layer ever records a ``ref:`` kernel as taken.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import tvm
from tvm import relax

from ...relax._ir import dtype_of, op_name, static_shape
from . import onednn
from .choice import LayerChoice

log = logging.getLogger(__name__)


_DPS = tvm.ir.Op.get("relax.call_dps_packed")
_CONVS = tuple(onednn.FUNCTIONS.values())


def onednn_call(value) -> Optional[tuple[str, list]]:
    """(function name, argument list) of a call into the oneDNN tactic library."""
    if not isinstance(value, relax.Call) or not value.op.same_as(_DPS):
        return None
    name = str(getattr(value.args[0], "global_symbol", ""))
    if not name.startswith("layerfuse.onednn."):
        return None
    return name, list(value.args[1].fields)


def bindings_of(func: relax.Function) -> list:
    return [b for block in func.body.blocks for b in block.bindings]


def use_counts(func: relax.Function) -> dict:
    """var -> how many times the bindings and the result of ``func`` read it."""
    count: dict = {}
    for b in bindings_of(func):
        for v in relax.analysis.free_vars(b.value):
            count[v] = count.get(v, 0) + 1
    for v in relax.analysis.free_vars(func.body.body):
        count[v] = count.get(v, 0) + 1
    return count


def merge_splits(func: relax.Function) -> relax.Function:
    """``split(conv(x), axis=1)`` of a horizontally merged oneDNN conv -> one call whose
    outputs are the pieces (``layerfuse.onednn.conv2d`` with k outputs: piece j is the conv
    with weight and bias rows of that piece): no split kernel, no copy."""
    values = {b.var: b.value for b in bindings_of(func)}
    uses = use_counts(func)
    chosen = {}
    for b in bindings_of(func):
        v = b.value
        if op_name(v) != "relax.split" or not isinstance(v.args[0], relax.Var) or int(v.attrs.axis) not in (1, -3):
            continue
        x = v.args[0]
        found = onednn_call(values.get(x))
        if found is None or found[0] not in (onednn.FUNCTIONS["conv2d"], onednn.FUNCTIONS["conv2d_pre"]) or uses.get(x) != 1:
            continue
        name, args = found
        if int(args[-1].values[8]) != 1 or static_shape(x) is None or len(static_shape(x)) != 4:
            continue  # grouped convs keep the split
        chosen[v] = (name, args, list(b.var.ty.fields))
    return ReplaceCalls(chosen).visit_expr(func) if chosen else func


def _pool_attrs(value, x_shape, y_shape) -> Optional[list[int]]:
    """``layerfuse.onednn.pool2d``'s attrs for a pooling op that oneDNN computes alike, else None."""
    op = op_name(value)
    if op == "relax.mean":
        axes = sorted(int(a) % 4 for a in (value.attrs.axis or []))
        if axes != [2, 3] or not value.attrs.keepdims:
            return None
        return [onednn.POOL_ALGORITHMS["avg"], x_shape[2], x_shape[3], 1, 1, 0, 0, 0, 0, 0]
    if op == "relax.nn.adaptive_avg_pool2d":
        if str(value.attrs.layout) != "NCHW" or str(value.attrs.out_layout) != "NCHW" or tuple(y_shape[2:]) != (1, 1):
            return None
        return [onednn.POOL_ALGORITHMS["avg"], x_shape[2], x_shape[3], 1, 1, 0, 0, 0, 0, 0]
    if op not in ("relax.nn.max_pool2d", "relax.nn.avg_pool2d"):
        return None
    a = value.attrs
    if str(a.layout) != "NCHW" or str(a.out_layout) != "NCHW" or any(int(d) != 1 for d in a.dilation):
        return None
    kh, kw = (int(k) for k in a.pool_size)
    sh, sw = (int(s) for s in a.strides)
    pad = [int(p) for p in a.padding]
    pad = pad * 2 if len(pad) == 2 else pad  # top, left, bottom, right
    # the bottom/right padding that gives the output size: the stated one, or more (ceil_mode)
    need = [(y_shape[2] - 1) * sh + kh - x_shape[2] - pad[0], (y_shape[3] - 1) * sw + kw - x_shape[3] - pad[1]]
    end = [max(pad[2], need[0]), max(pad[3], need[1])]
    if any((x_shape[2 + i] + pad[i] + end[i] - (kh, kw)[i]) // (sh, sw)[i] + 1 != y_shape[2 + i] for i in range(2)):
        return None
    if max(pad) >= min(kh, kw):
        return None
    if op == "relax.nn.max_pool2d":
        alg = "max"
    elif a.count_include_pad:
        if end != pad[2:]:
            return None  # ceil_mode's extra cells are not counted in ONNX, oneDNN would count them
        alg = "avg_include_pad"
    else:
        alg = "avg"
    return [onednn.POOL_ALGORITHMS[alg], kh, kw, sh, sw, *pad, 0]


# Producers TVM's FuseOps fuses into the concatenate that reads them (an upsample + concat
# is one kernel that writes the upsampled piece into the block): such a concat stays TVM's.
_FOLDED_INTO_CONCAT = ("relax.image.resize2d",)


def pools_and_concats(func: relax.Function, layers: list) -> relax.Function:
    """Pools and channel concats that read oneDNN tensors -> ``layerfuse.onednn.pool2d`` /
    ``layerfuse.onednn.concat`` (so the tensors around them can stay blocked)."""
    values = {b.var: b.value for b in bindings_of(func)}
    made = set()  # tensors (or tuples of pieces) a oneDNN call makes
    chosen = {}
    for b in bindings_of(func):
        v = b.value
        if onednn_call(v) is not None:
            made.add(b.var)
            continue
        if isinstance(v, relax.TupleGetItem) and v.tuple_value in made:
            made.add(b.var)
            continue
        y_shape = static_shape(b.var)
        if op_name(v) == "relax.concat":
            fields = v.args[0]
            fields = values.get(fields, fields) if isinstance(fields, relax.Var) else fields
            axis = int(v.attrs.axis) if v.attrs.axis is not None else 0
            if not isinstance(fields, relax.Tuple) or y_shape is None or len(y_shape) != 4 or axis not in (1, -3):
                continue
            items = list(fields.fields)
            if dtype_of(b.var) != "float32" or not all(isinstance(x, relax.Var) and static_shape(x) for x in items):
                continue
            if not any(x in made for x in items):
                continue  # TVM producers only: the lowering's in-place concat takes it
            if any(op_name(values.get(x)) in _FOLDED_INTO_CONCAT for x in items):
                continue  # TVM's FuseOps computes that piece inside the concat kernel: no copy of it
            chosen[v] = (onednn.CONCAT, items, relax.TensorType(list(y_shape), "float32"))
            made.add(b.var)
            layers.append(LayerChoice(f"concat:{b.var.name}", "copy", kernel="memcpy", shape=f"out{list(y_shape)}"))
            continue
        if not isinstance(v, relax.Call) or not v.args or v.args[0] not in made or dtype_of(b.var) != "float32":
            continue
        x_shape = static_shape(v.args[0])
        if x_shape is None or y_shape is None or len(x_shape) != 4 or len(y_shape) != 4:
            continue
        attrs = _pool_attrs(v, x_shape, y_shape)
        if attrs is None:
            continue
        kernel = onednn.pool_implementation(x_shape, y_shape, attrs)
        if kernel.startswith(("ref", "unsupported")):
            continue
        chosen[v] = (onednn.POOL, [v.args[0], relax.ShapeExpr(attrs)], relax.TensorType(list(y_shape), "float32"))
        made.add(b.var)
        layers.append(LayerChoice(f"pool:{b.var.name}", "onednn", kernel=kernel, shape=f"x{list(x_shape)} out{list(y_shape)}"))
    return ReplaceCalls(chosen).visit_expr(func) if chosen else func


@relax.expr_functor.mutator
class ReplaceCalls(relax.PyExprMutator):
    """Replace chosen calls (by identity): ``chosen[call] = (callee, args, out)`` becomes
    ``build(callee, args visited, out)``, by default ``call_dps_packed(name, args, out)``."""

    def __init__(self, chosen: dict, build=relax.call_dps_packed) -> None:
        super().__init__()
        self.chosen = chosen
        self.build = build

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        new = self.chosen.get(call)
        if new is None:
            return super().visit_call_(call)
        callee, args, out = new
        return self.build(callee, [self.visit_expr(a) for a in args], out)


class _Classes:
    """Union-find over tensors that must share one layout."""

    def __init__(self) -> None:
        self.parent: dict = {}

    def find(self, v):
        self.parent.setdefault(v, v)
        while self.parent[v] is not v:
            self.parent[v] = self.parent[self.parent[v]]
            v = self.parent[v]
        return v

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[ra] = rb


def assign_layouts(func: relax.Function, layers: list) -> relax.Function:
    """Choose plain or blocked bytes for every tensor that oneDNN calls make (see module doc)."""
    width = onednn.block_width()
    bindings = bindings_of(func)
    calls = {}  # var -> (name, args)
    pieces: dict = {}  # tuple var -> {index: [piece vars]}
    producer: dict = {}  # tensor var -> "onednn"
    tvm_read: set = set()  # tensors a TVM kernel (or the caller) reads
    classes = _Classes()
    for b in bindings:
        v = b.value
        found = onednn_call(v)
        if found is not None:
            calls[b.var] = found
            name, args = found
            if name == onednn.CONCAT:
                for a in args:
                    classes.union(a, b.var)
            elif name == onednn.POOL:
                classes.union(args[0], b.var)
            elif name == onednn.FUNCTIONS["conv2d_add"] and isinstance(args[3], relax.Var):
                classes.union(args[3], b.var)
            if not isinstance(b.var.ty, relax.TupleType):
                producer[b.var] = "onednn"
            continue
        if isinstance(v, relax.TupleGetItem) and v.tuple_value in calls:
            pieces.setdefault(v.tuple_value, {}).setdefault(int(v.index), []).append(b.var)
            producer[b.var] = "onednn"
            continue
        tvm_read.update(relax.analysis.free_vars(v))
    tvm_read.update(relax.analysis.free_vars(func.body.body))
    for parts in pieces.values():
        for same in parts.values():
            for other in same[1:]:
                classes.union(same[0], other)

    def can_block(var) -> bool:
        shape = static_shape(var)
        if not width or shape is None or len(shape) != 4 or shape[1] % width != 0 or producer.get(var) != "onednn":
            return False
        if shape[2] * shape[3] == 1:
            return True  # C % B == 0 and 1x1: nChwBc and NCHW are the same bytes
        return isinstance(var, relax.DataflowVar) and var not in tvm_read

    members: dict = {}
    for v in list(classes.parent) + list(producer):
        members.setdefault(classes.find(v), set()).add(v)
    blocked = {v for root, vs in members.items() if all(can_block(m) for m in vs) for v in vs}
    for vs in members.values():
        plain = [m.name for m in vs if not can_block(m)]
        if plain and len(plain) < len(vs):
            log.debug("plain layout for %d tensors because of %s", len(vs), ", ".join(sorted(plain)[:4]))

    # A plain tensor that several oneDNN convs read: reordered once (to_blocked), not in each.
    data_readers: dict = {}
    for v, (name, args) in calls.items():
        x = args[0]
        if name in _CONVS and isinstance(x, relax.Var) and x not in blocked:
            data_readers.setdefault(x, []).append(v)
    shared = {
        x
        for x, rs in data_readers.items()
        if width
        and len(rs) >= 2
        and static_shape(x) is not None
        and len(static_shape(x)) == 4
        and static_shape(x)[1] % width == 0
    }

    def conv_flags(v, args, padded: set) -> tuple[int, int]:
        src = isinstance(args[0], relax.Var) and (args[0] in blocked or args[0] in shared or args[0] in padded)
        if isinstance(v.ty, relax.TupleType):
            parts = pieces.get(v, {})
            n = len(v.ty.fields)
            return width * src, onednn.dst_block([width * (j in parts and parts[j][0] in blocked) for j in range(n)])
        return width * src, width * (v in blocked or v in padded)

    padded = _padded(members, calls, tvm_read, conv_flags, width)
    notes: dict = {}  # call var -> why its tensors stay plain
    flags = _refuse_reference_kernels(calls, pieces, members, blocked, shared, padded, conv_flags, width, notes)
    _record_layouts(layers, calls, flags, notes)
    by_call = {b.value: flags[b.var] for b in bindings if b.var in flags and any(flags[b.var])}
    resize = {b.value: _padded_type(b.var, width) for b in bindings if b.var in padded}
    return _SetLayouts(by_call, shared, resize, width).visit_expr(func) if by_call else func


def _kernel(name: str, v, args: list, flags: tuple[int, int]) -> str:
    """The kernel oneDNN picks for the conv or pool call ``v = name(args)`` under ``flags``."""
    attrs = [int(x) for x in args[-1].values]
    if name == onednn.POOL:
        attrs[9] = flags[0]
        return onednn.pool_implementation(static_shape(args[0]), static_shape(v), attrs)
    attrs[10], attrs[11] = flags
    weight = args[3] if name == onednn.FUNCTIONS["conv2d_pre"] else args[1]
    return onednn.implementation(
        static_shape(args[0]), static_shape(weight), attrs, residual=name == onednn.FUNCTIONS["conv2d_add"]
    )


def _refuse_reference_kernels(calls, pieces, members, blocked, shared, padded, conv_flags, width, notes) -> dict:
    """Every conv and pool call's (src, dst) flags, after making plain the layout classes of
    any call that oneDNN would run with a reference (``ref:``) or no kernel in its blocked
    layout (a plain src or dst is reordered inside the call to the layout of an optimised
    kernel, which :class:`.use_onednn.UseOneDNNConv` checked). Changes ``blocked``,
    ``shared`` and ``padded`` in place and notes each refused call's reason in ``notes``;
    repeats until no call is refused."""
    checked: dict = {}  # (call var, flags) -> kernel
    while True:
        flags = {}  # call var -> (src flag, dst flag)
        for v, (name, args) in calls.items():
            if name in _CONVS:
                flags[v] = conv_flags(v, args, padded)
            elif name == onednn.POOL:
                flags[v] = (width * (v in blocked), width * (v in blocked))
        refused = []
        for v, f in flags.items():
            if not any(f):
                continue
            if (v, f) not in checked:
                checked[(v, f)] = _kernel(calls[v][0], v, calls[v][1], f)
            if checked[(v, f)].startswith(("ref", "unsupported")):
                refused.append((v, checked[(v, f)]))
        if not refused:
            return flags
        for v, kernel in refused:
            x = calls[v][1][0]
            notes[v] = f"plain layout: oneDNN has only {kernel} for it in {onednn.layout_name(width)}"
            log.info("%s: %s", v.name, notes[v])
            touched = {v, x} | {vs[0] for vs in pieces.get(v, {}).values()}
            for vs in members.values():
                if vs & touched:
                    blocked.difference_update(vs)
                    padded.difference_update(vs)
            shared.discard(x)


def _padded(members: dict, calls: dict, tvm_read: set, conv_flags, width: int) -> set:
    """Tensors kept in nChwBc with their channels padded to a multiple of B (MobileNet-V2's
    24-channel stage with B = 16): B < C, C % B != 0, made by a conv with one output and read only by
    convs (as their src, or conv2d_add's residual), never by TVM, the caller, a pool, a
    concat or a prologue -- all their class alike -- and every conv that touches one keeps an
    optimised kernel in that layout (``conv_flags(var, args, padded)``: the flags it gets; a
    class whose conv would get ``ref:`` stays plain). Their Relax type becomes [N, ceilB(C),
    H, W] (the bytes of oneDNN's padded nChwBc; the library takes C from the weights), so no
    conv reorders them to and from NCHW inside its call. (C < B is left plain: padding would
    multiply the reading conv's work more than the reorders cost.)"""
    simple = (onednn.FUNCTIONS["conv2d"], onednn.FUNCTIONS["conv2d_add"])
    readers: dict = {}  # var -> [(call name, argument position)]
    for name, args in calls.values():
        for k, a in enumerate(args):
            if isinstance(a, relax.Var):
                readers.setdefault(a, []).append((name, k))

    def can_pad(var) -> bool:
        shape = static_shape(var)
        if not width or shape is None or len(shape) != 4 or shape[1] % width == 0 or shape[1] < width:
            return False
        if shape[2] * shape[3] == 1:
            return False
        if var not in calls or calls[var][0] not in simple or not isinstance(var, relax.DataflowVar) or var in tvm_read:
            return False
        return all(name in simple and (k == 0 or (k == 3 and name == simple[1])) for name, k in readers.get(var, []))

    classes = [vs for vs in members.values() if all(can_pad(m) for m in vs)]
    padded = {v for vs in classes for v in vs}
    checked: dict = {}  # (conv var, flags) -> kernel
    changed = bool(padded)
    while changed:  # drop the classes of a conv whose kernel in the padded layout is a reference one
        changed = False
        for v, (name, args) in calls.items():
            if name not in simple or not (v in padded or args[0] in padded):
                continue
            attrs = [int(a) for a in args[-1].values]
            attrs[10], attrs[11] = conv_flags(v, args, padded)
            key = (v, attrs[10], attrs[11])
            if key not in checked:
                checked[key] = onednn.implementation(
                    static_shape(args[0]), static_shape(args[1]), attrs, residual=name == simple[1]
                )
            if checked[key].startswith(("ref", "unsupported")):
                padded -= {m for vs in classes if v in vs or args[0] in vs for m in vs}
                changed = True
    return padded


def _padded_type(var, width: int) -> relax.TensorType:
    n, c, h, w = static_shape(var)
    return relax.TensorType([n, -(-c // width) * width, h, w], "float32")


def _record_layouts(layers: list, calls: dict, flags: dict, notes: dict) -> None:
    """Tell each oneDNN LayerChoice (in call order) which layout its src and dst have."""
    convs = [c for c in layers if c.tactic == "onednn" and not c.layer.startswith(("pool:", "dense:"))]
    pools = [c for c in layers if c.tactic == "onednn" and c.layer.startswith("pool:")]
    conv_calls = [(v, found) for v, found in calls.items() if found[0] in _CONVS]
    pool_calls = [(v, found) for v, found in calls.items() if found[0] == onednn.POOL]
    for c, (v, (name, args)) in zip(pools, pool_calls):
        c.layout = onednn.layout_name(flags[v][0])
        c.reason = notes.get(v, c.reason)
        if flags[v][0]:  # the kernel oneDNN picks in that layout
            c.kernel = _kernel(name, v, args, flags[v])
    for c, (v, (name, args)) in zip(convs, conv_calls):
        src, dst = flags.get(v, (0, 0))
        n = len(v.ty.fields) if isinstance(v.ty, relax.TupleType) else 1
        outs = ",".join(onednn.layout_name(onednn.dst_block_of(dst, j)) for j in range(n))
        c.layout = f"{onednn.layout_name(src)}>{outs}"
        c.reason = notes.get(v, c.reason)
        if src or dst:  # the kernel oneDNN picks for these layouts
            c.kernel = _kernel(name, v, args, (src, dst))


@relax.expr_functor.mutator
class _SetLayouts(relax.PyExprMutator):
    def __init__(self, by_call: dict, shared: set, resize: dict, width: int) -> None:
        super().__init__()
        self.width = width
        self.by_call = by_call
        self.shared = shared  # plain tensors reordered once for their oneDNN readers
        self.resize = resize  # call -> its result's type with padded channels
        self.blocked_copy: dict = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        flags = self.by_call.get(call)
        if flags is None:
            return super().visit_call_(call)
        name = str(call.args[0].global_symbol)
        args = list(call.args[1].fields)
        attrs = [int(x) for x in args[-1].values]
        if name == onednn.POOL:
            attrs[9] = flags[0]
        else:
            attrs[10], attrs[11] = flags
        args[-1] = relax.ShapeExpr(attrs)
        x = args[0]
        args = [self.visit_expr(a) for a in args]
        if name in _CONVS and x in self.shared:
            if x not in self.blocked_copy:
                copy = relax.call_dps_packed(
                    onednn.TO_BLOCKED,
                    [args[0], relax.ShapeExpr([self.width])],
                    relax.TensorType(list(static_shape(x)), "float32"),
                )
                self.blocked_copy[x] = self.builder_.emit(copy, f"{x.name}_{onednn.layout_name(self.width)}")
            args[0] = self.blocked_copy[x]
        ty_args = [self.resize[call]] if call in self.resize else call.ty_args
        return relax.Call(call.op, [call.args[0], relax.Tuple(args)], call.attrs, ty_args)


# ---------------------------------------------------------------------- the classifier
def dense_layers(func: relax.Function, layers: list) -> relax.Function:
    """``add(matmul(x, w), b)`` (x [N, K], w [K, M], b [M] or [1, M], float32; the imported
    Gemm / Linear with its weight transposed) and a bare 2-d ``matmul`` -> ``layerfuse.onednn.dense``
    (a oneDNN matmul primitive; TVM's untuned matmul is a plain loop nest)."""
    bindings = bindings_of(func)
    values = {b.var: b.value for b in bindings}
    uses = use_counts(func)
    chosen = {}
    taken = set()  # matmuls folded into an add
    for b in bindings:
        v = b.value
        if op_name(v) == "relax.add" and isinstance(v.args[0], relax.Var) and op_name(values.get(v.args[0])) == "relax.matmul":
            mm, bias = values[v.args[0]], v.args[1]
            m_shape = static_shape(v.args[0])
            if uses.get(v.args[0]) != 1 or m_shape is None or static_shape(bias) not in ((m_shape[-1],), (1, m_shape[-1])):
                continue
            plan = _dense(mm, b.var, bias, layers)
            if plan is not None:
                chosen[v] = plan
                taken.add(v.args[0])
    for b in bindings:
        if op_name(b.value) == "relax.matmul" and b.var not in taken:
            shape = static_shape(b.var)
            if shape is not None and len(shape) == 2:
                plan = _dense(b.value, b.var, relax.const(np.zeros([shape[1]], "float32")), layers)
                if plan is not None:
                    chosen[b.value] = plan
    return ReplaceCalls(chosen).visit_expr(func) if chosen else func


def _dense(mm: relax.Call, out, bias, layers: list) -> Optional[tuple]:
    x, w = mm.args[0], mm.args[1]
    xs, ws, ys = static_shape(x), static_shape(w), static_shape(out)
    if xs is None or ws is None or ys is None or len(xs) != 2 or len(ws) != 2 or xs[1] != ws[0] or ys != (xs[0], ws[1]):
        return None
    if any(dtype_of(e) != "float32" for e in (x, w, bias, out)):
        return None
    kernel = onednn.dense_implementation(xs[0], xs[1], ws[1])
    if kernel.startswith(("ref", "unsupported")):
        return None
    layers.append(LayerChoice(f"dense:{out.name}", "onednn", kernel=kernel, shape=f"x{list(xs)} w{list(ws)}"))
    return onednn.DENSE, [x, w, relax.op.reshape(bias, [ws[1]])], relax.TensorType(list(ys), "float32")
