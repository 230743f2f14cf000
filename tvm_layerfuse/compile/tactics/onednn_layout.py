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
kernel, as in TVM's default pipeline. (A pool call stands for the pool while the layouts are
assigned; :mod:`.tvm_pools` then makes each one TVM's kernel in the layout it got.) A pool
whose input a TVM kernel also reads (the squeeze of a squeeze-excite block whose gate
multiply stays TVM's, see :mod:`.onednn_scale`) stays TVM's where oneDNN
has only its scalar plain-layout kernel for it (``simple_nchw``): that input stays plain, and
TVM's scheduled reduction is vector code.

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
24 channels with B = 16) that convs with one output, pools, gates and shuffles make and only they read is kept in
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
from tvm import relax

from ...relax._ir import dtype_of, op_name, static_shape
from . import abi
from .choice import LayerChoice
from .oracle import current_oracle

log = logging.getLogger(__name__)


def onednn_call(value) -> Optional[tuple[str, list]]:
    """(function name, argument list) of a call into the oneDNN tactic library."""
    bound = abi.parse_call(value)
    return None if bound is None else (bound.call.name, bound.flat())


def bindings_of(func: relax.Function) -> list:
    return [b for block in func.body.blocks for b in block.bindings]


def library_calls(func: relax.Function) -> dict:
    """var -> :class:`.abi.Bound` of every library call bound in ``func``."""
    out = {}
    for b in bindings_of(func):
        bound = abi.parse_call(b.value)
        if bound is not None:
            out[b.var] = bound
    return out


def library_made(func: relax.Function) -> set:
    """The tensors (and pieces of tuples) that library calls make in ``func``."""
    made: set = set()
    for b in bindings_of(func):
        if abi.parse_call(b.value) is not None:
            made.add(b.var)
        elif isinstance(b.value, relax.TupleGetItem) and b.value.tuple_value in made:
            made.add(b.var)
    return made


def use_counts(func: relax.Function) -> dict:
    """var -> how many times the bindings and the result of ``func`` read it."""
    count: dict = {}
    for b in bindings_of(func):
        for v in relax.analysis.free_vars(b.value):
            count[v] = count.get(v, 0) + 1
    for v in relax.analysis.free_vars(func.body.body):
        count[v] = count.get(v, 0) + 1
    return count


def _kernel_refused(kernel: str) -> bool:
    return kernel.startswith(("ref", "unsupported"))


def merge_splits(func: relax.Function) -> relax.Function:
    """``split(conv(x), axis=1)`` of a horizontally merged oneDNN conv -> one call whose
    outputs are the pieces (``layerfuse.onednn.conv2d`` with k outputs: piece j is the conv
    with weight and bias rows of that piece): no split kernel, no copy."""
    calls = library_calls(func)
    uses = use_counts(func)
    chosen = {}
    for b in bindings_of(func):
        v = b.value
        if op_name(v) != "relax.split" or int(v.attrs.axis) not in (1, -3):
            continue
        (x,) = v.args
        bound = calls.get(x) if isinstance(x, relax.Var) else None
        if bound is None or not bound.call.pieces or uses.get(x) != 1:
            continue
        if bound.attrs.groups != 1 or static_shape(x) is None or len(static_shape(x)) != 4:
            continue  # grouped convs keep the split
        chosen[v] = (bound.call.name, bound.flat(), list(b.var.ty.fields))
    return ReplaceCalls(chosen).visit_expr(func) if chosen else func


def _pool_attrs(value, x_shape, y_shape) -> Optional[abi.PoolAttrs]:
    """``layerfuse.onednn.pool2d``'s attrs for a pooling op that oneDNN computes alike, else None."""
    op = op_name(value)
    avg = abi.POOL_ALGORITHMS["avg"]
    if op == "relax.mean":
        axes = sorted(int(a) % 4 for a in (value.attrs.axis or []))
        if axes != [2, 3] or not value.attrs.keepdims:
            return None
        return abi.PoolAttrs(avg, x_shape[2], x_shape[3], 1, 1, 0, 0, 0, 0)
    if op == "relax.nn.adaptive_avg_pool2d":
        if str(value.attrs.layout) != "NCHW" or str(value.attrs.out_layout) != "NCHW" or tuple(y_shape[2:]) != (1, 1):
            return None
        return abi.PoolAttrs(avg, x_shape[2], x_shape[3], 1, 1, 0, 0, 0, 0)
    if op not in ("relax.nn.max_pool2d", "relax.nn.avg_pool2d"):
        return None
    a = value.attrs
    if str(a.layout) != "NCHW" or str(a.out_layout) != "NCHW" or any(int(d) != 1 for d in a.dilation):
        return None
    kh, kw = (int(k) for k in a.pool_size)
    sh, sw = (int(s) for s in a.strides)
    if min(kh, kw, sh, sw) < 1:
        return None
    pad = [int(p) for p in a.padding]
    top, left, bottom, right = pad * 2 if len(pad) == 2 else pad
    # the bottom/right padding that gives the output size: the stated one, or more (ceil_mode)
    need = [(y_shape[2] - 1) * sh + kh - x_shape[2] - top, (y_shape[3] - 1) * sw + kw - x_shape[3] - left]
    end = [max(bottom, need[0]), max(right, need[1])]
    if any((x_shape[2 + i] + (top, left)[i] + end[i] - (kh, kw)[i]) // (sh, sw)[i] + 1 != y_shape[2 + i] for i in range(2)):
        return None
    if max(top, left, bottom, right) >= min(kh, kw):
        return None
    if op == "relax.nn.max_pool2d":
        alg = "max"
    elif a.count_include_pad:
        if end != [bottom, right]:
            return None  # ceil_mode's extra cells are not counted in ONNX, oneDNN would count them
        alg = "avg_include_pad"
    else:
        alg = "avg"
    return abi.PoolAttrs(abi.POOL_ALGORITHMS[alg], kh, kw, sh, sw, top, left, bottom, right)


# Producers TVM's FuseOps fuses into the concatenate that reads them (an upsample + concat
# is one kernel that writes the upsampled piece into the block): such a concat stays TVM's.
_FOLDED_INTO_CONCAT = ("relax.image.resize2d",)


def pools_and_concats(func: relax.Function, layers: list) -> relax.Function:
    """Pools and channel concats that read oneDNN tensors -> ``layerfuse.onednn.pool2d`` /
    ``layerfuse.onednn.concat`` (so the tensors around them can stay blocked)."""
    values: dict = {}
    readers: dict = {}  # var -> the values that read it
    for b in bindings_of(func):
        values[b.var] = b.value
        for v in relax.analysis.free_vars(b.value):
            readers.setdefault(v, []).append(b.value)
    made = set()  # tensors (or tuples of pieces) a oneDNN call makes
    chosen = {}
    for b in bindings_of(func):
        v = b.value
        if abi.parse_call(v) is not None:
            made.add(b.var)
            continue
        if isinstance(v, relax.TupleGetItem) and v.tuple_value in made:
            made.add(b.var)
            continue
        y_shape = static_shape(b.var)
        if op_name(v) == "relax.concat":
            (fields,) = v.args
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
            chosen[v] = (abi.CONCAT.name, items, relax.TensorType(list(y_shape), "float32"))
            made.add(b.var)
            layers.append(LayerChoice(f"concat:{b.var.name}", "copy", kernel="memcpy", shape=f"out{list(y_shape)}"))
            continue
        if not isinstance(v, relax.Call) or not v.args or dtype_of(b.var) != "float32":
            continue
        x, *_ = v.args
        if x not in made:
            continue
        x_shape = static_shape(x)
        if x_shape is None or y_shape is None or len(x_shape) != 4 or len(y_shape) != 4:
            continue
        attrs = _pool_attrs(v, x_shape, y_shape)
        if attrs is None:
            continue
        kernel = current_oracle().pool_kernel(x_shape, y_shape, attrs)
        if _kernel_refused(kernel):
            continue
        if not kernel.startswith("jit") and _read_by_tvm(x, readers.get(x, ())):
            # x stays plain (a TVM kernel reads it: the gate of a squeeze-excite block), and on
            # plain tensors oneDNN pools with a scalar loop: TVM's scheduled reduction is vector code
            continue
        args = abi.POOL2D.flatten(abi.Args(inputs=(x,), attrs=attrs.to_shape()))
        chosen[v] = (abi.POOL2D.name, args, relax.TensorType(list(y_shape), "float32"))
        made.add(b.var)
        layers.append(LayerChoice(f"pool:{b.var.name}", "onednn", kernel=kernel, shape=f"x{list(x_shape)} out{list(y_shape)}"))
    return ReplaceCalls(chosen).visit_expr(func) if chosen else func


def _read_by_tvm(x, readers) -> bool:
    """Whether a TVM kernel reads ``x``: a reader that is neither a library call nor a pool
    or concat this pass may hand to the library."""
    library_ops = ("relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d", "relax.mean", "relax.concat")
    return any(abi.parse_call(r) is None and op_name(r) not in library_ops for r in readers)


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
    width = current_oracle().block_width()
    bindings = bindings_of(func)
    calls = {}  # var -> abi.Bound
    pieces: dict = {}  # tuple var -> {index: [piece vars]}
    producer: dict = {}  # tensor var -> "onednn"
    tvm_read: set = set()  # tensors a TVM kernel (or the caller) reads
    classes = _Classes()
    for b in bindings:
        v = b.value
        bound = abi.parse_call(v)
        if bound is not None:
            calls[b.var] = bound
            if bound.call is abi.CONCAT:
                for a in bound.args.inputs:
                    classes.union(a, b.var)
            elif bound.call in (abi.POOL2D, abi.SCALE_CHANNELS):
                classes.union(bound.args.input, b.var)
            elif bound.call is abi.CONV2D_ADD and isinstance(bound.args.residual, relax.Var):
                classes.union(bound.args.residual, b.var)
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
    for v, bound in calls.items():
        x = bound.args.input if bound.call.conv else None
        if isinstance(x, relax.Var) and x not in blocked:
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

    def conv_flags(v, bound, padded: set) -> tuple[int, int]:
        x = bound.args.input
        src = isinstance(x, relax.Var) and (x in blocked or x in shared or x in padded)
        if isinstance(v.ty, relax.TupleType):
            parts = pieces.get(v, {})
            n = len(v.ty.fields)
            return width * src, abi.dst_block([width * (j in parts and parts[j][0] in blocked) for j in range(n)])
        return width * src, width * (v in blocked or v in padded)

    padded = _padded(members, calls, tvm_read, conv_flags, width)
    notes: dict = {}  # call var -> why its tensors stay plain
    flags = _refuse_reference_kernels(calls, pieces, members, blocked, shared, padded, conv_flags, width, notes)
    _record_layouts(layers, calls, flags, notes)
    by_call = {b.value: flags[b.var] for b in bindings if b.var in flags and flags[b.var] != calls[b.var].attrs}
    resize = {b.value: _padded_type(b.var, width) for b in bindings if b.var in padded}
    return _SetLayouts(by_call, shared, resize, width).visit_expr(func) if by_call else func


def _with_layout(bound: abi.Bound, flags: tuple[int, int]):
    """The attrs of the conv, pool or scale call ``bound`` with the block widths ``flags`` (src, dst;
    a shuffle's: its two inputs', then its output's)."""
    if bound.call in (abi.POOL2D, abi.SCALE_CHANNELS):
        return bound.attrs.replace(block=flags[0])
    if bound.call is abi.SHUFFLE:
        return bound.attrs.replace(left_block=flags[0], right_block=flags[1], dst_block=flags[2])
    return bound.attrs.replace(src_block=flags[0], dst_block=flags[1])


def _kernel(v, bound: abi.Bound, attrs) -> str:
    """The kernel oneDNN picks for the conv or pool call ``v = bound`` under ``attrs``."""
    oracle = current_oracle()
    if bound.call is abi.POOL2D:
        return oracle.pool_kernel(static_shape(bound.args.input), static_shape(v), attrs)
    return oracle.conv_kernel(
        static_shape(bound.args.input), static_shape(bound.args.weight), attrs, residual=bound.call is abi.CONV2D_ADD
    )


def _refuse_reference_kernels(calls, pieces, members, blocked, shared, padded, conv_flags, width, notes) -> dict:
    """Every conv and pool call's attrs with its block widths set, after making plain the
    layout classes of any call that oneDNN would run with a reference (``ref:``) or no kernel
    in its blocked layout (a plain src or dst is reordered inside the call to the layout of an
    optimised kernel, which :class:`.use_onednn.UseOneDNNConv` checked). Changes ``blocked``,
    ``shared`` and ``padded`` in place and notes each refused call's reason in ``notes``;
    repeats until no call is refused."""
    checked: dict = {}  # (call var, flags) -> kernel
    while True:
        flags = {}  # call var -> (src width, dst widths)
        for v, bound in calls.items():
            if bound.call.conv:
                flags[v] = conv_flags(v, bound, padded)
            elif bound.call in (abi.POOL2D, abi.SCALE_CHANNELS):
                inside = v in blocked or v in padded
                flags[v] = (width * inside, width * inside)
            elif bound.call is abi.SHUFFLE:  # (a, b, out), each in its own layout
                flags[v] = tuple(width * (t in blocked or t in padded) for t in (*bound.args.inputs, v))
        refused = []
        for v, f in flags.items():
            if not any(f) or calls[v].call in (abi.SCALE_CHANNELS, abi.SHUFFLE):  # the library's own loops: any layout
                continue
            if (v, f) not in checked:
                checked[(v, f)] = _kernel(v, calls[v], _with_layout(calls[v], f))
            if _kernel_refused(checked[(v, f)]):
                refused.append((v, checked[(v, f)]))
        if not refused:
            return {v: _with_layout(calls[v], f) for v, f in flags.items()}
        for v, kernel in refused:
            x = calls[v].args.input
            notes[v] = f"plain layout: oneDNN has only {kernel} for it in {abi.layout_name(width)}"
            log.info("%s: %s", v.name, notes[v])
            touched = {v, x} | {vs[0] for vs in pieces.get(v, {}).values()}
            for vs in members.values():
                if vs & touched:
                    blocked.difference_update(vs)
                    padded.difference_update(vs)
            shared.discard(x)


def _padded(members: dict, calls: dict, tvm_read: set, conv_flags, width: int) -> set:
    """Tensors kept in nChwBc with their channels padded to a multiple of B (MobileNet-V2's
    24-channel stage with B = 16): B < C, C % B != 0, made by a conv with one output, a pool,
    a gate (``scale_channels``) or a channel shuffle and read only by those (a conv as its src,
    or conv2d_add's residual; a gate as the tensor it scales; a shuffle as either half, each
    of its inputs and its output in a layout of its own), never by TVM, the caller, a concat or a
    prologue -- all their class alike (a pool's or gate's src and dst are one class: the
    stem's max pool in ShuffleNet, the squeeze-and-excitation blocks of MobileNetV3's 72- and
    120-channel stages), 1x1 only as a pool's result -- and every conv that touches one keeps an
    optimised kernel in that layout (``conv_flags(var, bound, padded)``: the flags it gets; a
    class whose conv would get ``ref:`` stays plain). Their Relax type becomes [N, ceilB(C),
    H, W] (the bytes of oneDNN's padded nChwBc; the library takes C from the weights), so no
    conv reorders them to and from NCHW inside its call. (C < B is left plain: padding would
    multiply the reading conv's work more than the reorders cost.)"""
    simple = (abi.CONV2D, abi.CONV2D_ADD)
    # what else may make or read a padded tensor (its src and dst in one class): a pool (TVM's
    # blocked kernel pools the pad channels too, zeros into zeros) and a gate (the library's
    # loop scales them by 0); the gate factor itself stays plain (role "scale")
    layout_bound = (abi.POOL2D, abi.SCALE_CHANNELS)
    gathers = (abi.SHUFFLE,)  # reads each input and writes its output in its own layout
    readers: dict = {}  # var -> [(library call, role)]
    for bound in calls.values():
        for role in ("inputs", "scale", "shift", "weight", "bias", "residual"):
            value = getattr(bound.args, role)
            for a in value if role == "inputs" else (value,):
                if isinstance(a, relax.Var):
                    readers.setdefault(a, []).append((bound.call, role))
        for _, member in bound.args.members:
            for a in member.flat():
                if isinstance(a, relax.Var):
                    readers.setdefault(a, []).append((abi.CONCAT_CONVS, "member"))

    def can_pad(var) -> bool:
        shape = static_shape(var)
        if not width or shape is None or len(shape) != 4 or shape[1] % width == 0 or shape[1] < width:
            return False
        if var not in calls or not isinstance(var, relax.DataflowVar) or var in tvm_read:
            return False
        made_by = calls[var].call
        if made_by not in simple + layout_bound + gathers or (shape[2] * shape[3] == 1 and made_by is not abi.POOL2D):
            return False  # a 1x1 tensor only as a pool's result (the squeeze of a padded tensor)
        return all(
            (call in simple and role in ("inputs", "residual")) or (call in layout_bound + gathers and role == "inputs")
            for call, role in readers.get(var, [])
        )

    classes = [vs for vs in members.values() if all(can_pad(m) for m in vs)]
    padded = {v for vs in classes for v in vs}
    checked: dict = {}  # (conv var, flags) -> kernel
    changed = bool(padded)
    while changed:  # drop the classes of a conv whose kernel in the padded layout is a reference one
        changed = False
        for v, bound in calls.items():
            x = bound.args.input if bound.call in simple else None
            if x is None or not (v in padded or x in padded):
                continue
            src, dst = conv_flags(v, bound, padded)
            attrs = bound.attrs.replace(src_block=src, dst_block=dst)
            key = (v, src, dst)
            if key not in checked:
                checked[key] = current_oracle().conv_kernel(
                    static_shape(x), static_shape(bound.args.weight), attrs, residual=bound.call is abi.CONV2D_ADD
                )
            if _kernel_refused(checked[key]):
                padded -= {m for vs in classes if v in vs or x in vs for m in vs}
                changed = True
    return padded


def _padded_type(var, width: int) -> relax.TensorType:
    n, c, h, w = static_shape(var)
    return relax.TensorType([n, -(-c // width) * width, h, w], "float32")


def _record_layouts(layers: list, calls: dict, flags: dict, notes: dict) -> None:
    """Tell each oneDNN LayerChoice which layout its src and dst have (and, where a call's
    blocked kernel would be a reference one, why they are plain): a pool's by its bound
    variable (``pool:<var>``), a conv's by the layer id its call's attrs carry."""
    by_name = {c.layer: c for c in layers}
    for v, bound in calls.items():
        attrs = flags.get(v)
        if attrs is None:
            continue
        if bound.call is abi.SCALE_CHANNELS:
            c = by_name.get(f"scale:{v.name}")
            if c is not None:
                c.layout = abi.layout_name(attrs.block)
            continue
        if bound.call is abi.SHUFFLE:
            c = by_name.get(f"shuffle:{v.name}")
            if c is not None:
                c.layout = f"{abi.layout_name(attrs.left_block)},{abi.layout_name(attrs.right_block)}>{abi.layout_name(attrs.dst_block)}"
            continue
        if bound.call is abi.POOL2D:
            c = by_name.get(f"pool:{v.name}")
            if c is None:
                continue
            c.layout = abi.layout_name(attrs.block)
            c.reason = notes.get(v, c.reason)
            if attrs.block:  # the kernel oneDNN picks in that layout
                c.kernel = _kernel(v, bound, attrs)
            continue
        c = _conv_choices(layers).get(attrs.layer)
        if c is None:
            continue
        n = len(v.ty.fields) if isinstance(v.ty, relax.TupleType) else 1
        outs = ",".join(abi.layout_name(attrs.dst_block_of(j)) for j in range(n))
        c.layout = f"{abi.layout_name(attrs.src_block)}>{outs}"
        c.reason = notes.get(v, c.reason)
        if attrs.src_block or attrs.dst_block:  # the kernel oneDNN picks for these layouts
            c.kernel = _kernel(v, bound, attrs)


def _conv_choices(layers: list) -> dict:
    """layer id -> the LayerChoice of that conv layer (the id its calls' attrs carry)."""
    return {c.id: c for c in layers if c.tactic == "onednn" and c.id >= 0}


@relax.expr_functor.mutator
class _SetLayouts(relax.PyExprMutator):
    def __init__(self, by_call: dict, shared: set, resize: dict, width: int) -> None:
        super().__init__()
        self.width = width  # the block width of the blocked layout
        self.by_call = by_call  # call -> its attrs with the layout's block widths
        self.shared = shared  # plain tensors reordered once for their oneDNN readers
        self.resize = resize  # call -> its result's type with padded channels
        self.blocked_copy: dict = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        attrs = self.by_call.get(call)
        if attrs is None:
            return super().visit_call_(call)
        bound = abi.parse_call(call).replace(attrs=attrs)
        x = bound.args.input
        args = bound.args
        visited = dict(inputs=tuple(self.visit_expr(a) for a in args.inputs))
        for role in ("scale", "shift", "weight", "bias", "residual"):
            if getattr(args, role) is not None:
                visited[role] = self.visit_expr(getattr(args, role))
        if bound.call.conv and x in self.shared:
            if x not in self.blocked_copy:
                copy = abi.make(abi.TO_BLOCKED, input=visited["inputs"][0], attrs=abi.ToBlockedAttrs(self.width)).expr(
                    relax.TensorType(list(static_shape(x)), "float32")
                )
                self.blocked_copy[x] = self.builder_.emit(copy, f"{x.name}_{abi.layout_name(self.width)}")
            visited["inputs"] = (self.blocked_copy[x], *visited["inputs"][1:])
        bound = bound.replace(**visited)
        new = abi.rebuild(call, bound)
        if call in self.resize:
            new = relax.Call(new.op, new.args, new.attrs, [self.resize[call]])
        return new


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
        if op_name(v) != "relax.add":
            continue
        product, bias = v.args
        if not isinstance(product, relax.Var) or op_name(values.get(product)) != "relax.matmul":
            continue
        m_shape = static_shape(product)
        if uses.get(product) != 1 or m_shape is None or static_shape(bias) not in ((m_shape[-1],), (1, m_shape[-1])):
            continue
        plan = _dense(values[product], b.var, bias, layers)
        if plan is not None:
            chosen[v] = plan
            taken.add(product)
    for b in bindings:
        if op_name(b.value) == "relax.matmul" and b.var not in taken:
            shape = static_shape(b.var)
            if shape is not None and len(shape) == 2:
                plan = _dense(b.value, b.var, relax.const(np.zeros([shape[1]], "float32")), layers)
                if plan is not None:
                    chosen[b.value] = plan
    return ReplaceCalls(chosen).visit_expr(func) if chosen else func


def _dense(mm: relax.Call, out, bias, layers: list) -> Optional[tuple]:
    x, w = mm.args
    xs, ws, ys = static_shape(x), static_shape(w), static_shape(out)
    if xs is None or ws is None or ys is None or len(xs) != 2 or len(ws) != 2 or xs[1] != ws[0] or ys != (xs[0], ws[1]):
        return None
    if any(dtype_of(e) != "float32" for e in (x, w, bias, out)):
        return None
    n, k = xs
    _, m = ws
    kernel = current_oracle().dense_kernel(n, k, m)
    if _kernel_refused(kernel):
        return None
    layers.append(LayerChoice(f"dense:{out.name}", "onednn", kernel=kernel, shape=f"x{list(xs)} w{list(ws)}"))
    args = abi.DENSE.flatten(abi.Args(inputs=(x,), weight=w, bias=relax.op.reshape(bias, [m]), attrs=abi.DenseAttrs().to_shape()))
    return abi.DENSE.name, args, relax.TensorType(list(ys), "float32")
