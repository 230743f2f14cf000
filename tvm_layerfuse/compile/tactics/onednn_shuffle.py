"""ShuffleNet's channel shuffle on the tactic library, in the layout of the convs around it (a
step of :class:`.use_onednn.UseOneDNNConv`, before the pools, concatenations and layouts).

torchvision writes a unit's end as ``y = shuffle(concat(a, b))`` with two groups, and the next
unit's start as ``x1, x2 = y[:, :C/2], y[:, C/2:]``::

    y = reshape(permute_dims(reshape(concat(a, b), [N, 2, C/2, H, W]), [0, 2, 1, 3, 4]), [N, C, H, W])
    y[:, 2i] == a[:, i],  y[:, 2i + 1] == b[:, i]          (a, b of C/2 channels)
    strided_slice(y, axis 1, [f, f + k))  ==  shuffle(a, b, first=f, count=k)

so each slice that reads ``y`` (and ``y`` itself, where anything else reads it: the last unit's
output, which the final conv reads whole) becomes one ``layerfuse.onednn.shuffle`` call that
gathers its channels from a and b directly: no concatenation is written, and the halves keep
the layout of the convs that read them. As TVM kernels the concatenation, the shuffle and the
slices read and wrote NCHW, and ShuffleNet's halves (58, 116, 232 channels) are not whole blocks:
every conv next to them reordered its input or output, 43 reorders per inference (one thread,
``DNNL_VERBOSE``). The call reads a and b in either layout and writes either, padded where the
channels are not whole blocks (set by ``assign_layouts``). Where neither a nor b is a library
call's tensor, TVM keeps the shuffle.
"""

from __future__ import annotations

from tvm import relax

from ...relax._ir import dtype_of, op_name, static_shape
from . import abi
from .choice import LayerChoice
from .onednn_layout import ReplaceCalls, bindings_of, library_made

TACTIC = "loop"  # the library's own gather, not a oneDNN primitive
KERNEL = "shuffle"


def _shuffle_of(y, values: dict):
    """(a, b) where ``y`` is the two-group channel shuffle of ``concat(a, b)`` (module doc), else None."""
    out = static_shape(y)
    r2 = values.get(y)
    if out is None or len(out) != 4 or op_name(r2) != "relax.reshape" or dtype_of(y) != "float32":
        return None
    p, *_ = r2.args
    pv = values.get(p) if isinstance(p, relax.Var) else None
    if op_name(pv) != "relax.permute_dims" or pv.attrs.axes is None or [int(a) for a in pv.attrs.axes] != [0, 2, 1, 3, 4]:
        return None
    r1, *_ = pv.args
    r1v = values.get(r1) if isinstance(r1, relax.Var) else None
    n, c, h, w = out
    if op_name(r1v) != "relax.reshape" or c % 2 or static_shape(r1) != (n, 2, c // 2, h, w):
        return None
    cat, *_ = r1v.args
    catv = values.get(cat) if isinstance(cat, relax.Var) else None
    if op_name(catv) != "relax.concat" or static_shape(cat) != (n, c, h, w) or int(catv.attrs.axis) not in (1, -3):
        return None
    fields, *_ = catv.args
    fields = values.get(fields, fields) if isinstance(fields, relax.Var) else fields
    if not isinstance(fields, relax.Tuple) or len(fields.fields) != 2:
        return None
    a, b = fields.fields
    if not all(isinstance(x, relax.Var) and static_shape(x) == (n, c // 2, h, w) for x in (a, b)):
        return None
    return a, b


def _constants(expr) -> list[int]:
    """The integers of a Relax tuple of ``PrimValue`` constants (strided_slice's axes, bounds)."""
    return [int(f.value) for f in expr.fields]


def _channel_range(v, y):
    """(first, count) where ``v`` is ``strided_slice(y)`` over channels with step 1, else None."""
    if op_name(v) != "relax.strided_slice" or len(v.args) not in (4, 5):
        return None
    x, *bounds = v.args  # axes, begin, end[, strides]
    if not x.same_as(y):
        return None
    try:
        axes, begins, ends, *steps = (_constants(e) for e in bounds)
    except (TypeError, ValueError, AttributeError):
        return None  # symbolic bounds
    c = static_shape(y)[1]
    if axes not in ([1], [-3]) or steps not in ([], [[1]]) or len(begins) != 1 or len(ends) != 1:
        return None
    first, last = begins[0], min(ends[0], c)
    return (first, last - first) if 0 <= first < last else None


def channel_shuffles(func: relax.Function, layers: list) -> relax.Function:
    """Every two-group channel shuffle of ``func`` over a library-made half -> ``layerfuse.onednn.shuffle``
    calls, one per channel range read (plain until the layouts are assigned); a ``shuffle:<var>``
    choice in ``layers`` for each."""
    made = library_made(func)
    bindings = bindings_of(func)
    values = {b.var: b.value for b in bindings}
    readers: dict = {}
    for b in bindings:
        for v in relax.analysis.free_vars(b.value):
            readers.setdefault(v, []).append(b)
    whole_read = set(relax.analysis.free_vars(func.body.body))
    chosen = {}
    for b in bindings:
        pair = _shuffle_of(b.var, values)
        if pair is None or not any(x in made for x in pair):
            continue
        a, _ = pair
        channels = static_shape(a)[1]
        ranges = {r: _channel_range(r.value, b.var) for r in readers.get(b.var, [])}
        targets = [(r.value, r.var, rng) for r, rng in ranges.items() if rng is not None]
        if b.var in whole_read or any(rng is None for rng in ranges.values()):
            targets.append((b.value, b.var, (0, 2 * channels)))  # read whole as well
        for value, var, (first, count) in targets:
            attrs = abi.ShuffleAttrs(channels=channels, first=first, length=count)
            args = abi.SHUFFLE.flatten(abi.Args(inputs=pair, attrs=attrs.to_shape()))
            chosen[value] = (abi.SHUFFLE.name, args, relax.TensorType(list(static_shape(var)), "float32"))
            layers.append(
                LayerChoice(f"shuffle:{var.name}", TACTIC, kernel=KERNEL, shape=f"channels [{first}, {first + count}) of 2 x {channels}")
            )
    return ReplaceCalls(chosen).visit_expr(func) if chosen else func
