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

The conv groups of :mod:`.fuse_epilogue` (one Relax function per conv + epilogue, called
from ``main``) would each get their own transforms at their boundaries, weights included,
run at every inference. So a group whose conv will be blocked (plain conv, channels in whole
blocks, its input a parameter of the group) is first inlined into ``main``; ConvertLayout then
sees the whole graph, and :class:`.fuse_epilogue.FuseConv2DEpilogue` groups each blocked conv
with its epilogue again (the same templates, layout-agnostic). A prologue group of
:mod:`.fuse_prologue` (``conv(relu(x * s + t))``, DenseNet) is inlined the same way, its
``s`` and ``t`` (``[1, C, 1, 1]``) become ``[1, C/B, 1, 1, B]``, and the normalisation goes
back in front of its conv as a prologue group on blocked tensors (:func:`_regroup_prologues`,
for the convs whose weights had one)::

    relu(to_blocked(x) * to_blocked(s) + to_blocked(t))  ==  to_blocked(relu(x * s + t))

The blocked ``conv2d`` is lowered by :class:`..lowering.blocked_conv.LegalizeBlockedConv`
(TOPI's ``conv2d_NCHWc``) and scheduled by ``compile/schedules/conv2d_nchwc.py``.

Usage (weights still parameters)::

    mod = BlockedConvLayout(lanes=8)(mod)      # then lift / bind the weights
"""

from __future__ import annotations

import logging
from typing import Optional

import tvm
from tvm import relax
from tvm.relax.utils import copy_with_new_vars

from ._ir import FunctionFacts, op_name, static_shape
from .fuse_epilogue import PREFIX
from .fuse_prologue import PROLOGUE_PREFIX, conv_of, prologue_group

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
        from .fuse_epilogue import FuseConv2DEpilogue

        data, kernel = blocked_layouts(self.lanes)
        self.blocked, self.convs = count_blocked_convs(mod)
        if not self.convs:
            return mod  # no conv: nothing to block (and ConvertLayout has nothing to do)
        prologue_weights = _prologue_weights(mod, self.lanes)
        inlined, groups = inline_groups(mod, lambda f: _blockable_group(f, self.lanes))
        inlined = _splits_to_slices(inlined)
        try:
            out = relax.transform.ConvertLayout({"relax.nn.conv2d": [data, kernel]})(inlined)
        except tvm.error.TVMError as e:  # an op TVM's layout inference does not take: the convs stay NCHW
            log.info("blocked layout %s not applied (ConvertLayout: %s)", data, str(e).strip().splitlines()[-1][:200])
            self.blocked = 0
            return mod
        # ConvertLayout converts every function; a group left as a function (a prologue group)
        # would transform its weights inside its kernel at every call: it stays as it was
        for gv, func in inlined.functions_items():
            if isinstance(func, relax.Function) and gv.name_hint != "main":
                out[gv] = func
        self.blocked, self.convs = count_blocked_convs(out)
        if not self.blocked:
            return mod  # nothing blocked: no transform enters the graph
        out = relax.transform.EliminateCommonSubexpr()(out)  # one transform per activation, not per use
        out = _sink_to_plain(_blocked_slices(out, self.lanes), self.lanes)
        out = relax.transform.CanonicalizeBindings()(out)
        out = relax.transform.DeadCodeElimination()(out)
        out = relax.transform.EliminateCommonSubexpr()(out)
        out = _slices_to_split(out)
        self.blocked, self.convs = count_blocked_convs(out)
        prologues = 0
        if groups:
            out = FuseConv2DEpilogue()(out)  # the inlined conv groups, blocked now
            out = relax.transform.DeadCodeElimination()(out)
            out, prologues = _regroup_prologues(out, prologue_weights)
        log.info(
            "blocked layout %s: %d of %d convs (%d conv groups regrouped, %d with their prologue)",
            data, self.blocked, self.convs, groups, prologues,
        )  # fmt: skip
        return out


def _blockable_group(func: relax.Function, lanes: int) -> bool:
    """``func`` is a conv group of :mod:`.fuse_epilogue` whose conv will be blocked: a plain
    conv (ConvertLayout) or a depthwise one (:func:`_sink_to_plain`), input and output channels
    multiples of ``lanes``, its data a parameter; or a prologue group of :mod:`.fuse_prologue`
    around a plain conv with such channels (its data ``relu(x * s + t)`` of a parameter ``x``)."""
    attrs = func.attrs or {}
    composite = str(attrs.get("Composite", ""))
    if not func.body.blocks:
        return False
    if composite.startswith(PROLOGUE_PREFIX):
        conv = _prologue_conv(func)
        return conv is not None and _blocked_channels(conv, lanes)
    if not composite.startswith(PREFIX):
        return False
    convs = [b.value for b in func.body.blocks[0].bindings if op_name(b.value) == "relax.nn.conv2d"]
    if len(convs) != 1:
        return False
    (conv,) = convs
    data, weight = (static_shape(a) for a in conv.args[:2])
    groups = int(conv.attrs.groups)
    return (
        any(conv.args[0].same_as(p) for p in func.params)
        and (groups == 1 or (data is not None and weight is not None and groups == data[1] == weight[0] and weight[1] == 1))
        and str(conv.attrs.data_layout) == "NCHW"
        and data is not None
        and weight is not None
        and (data[1] % lanes == 0 or (groups == 1 and data[1] < lanes))  # (an image's 3 channels: one narrow block)
        and weight[0] % lanes == 0
    )


def _blocked_channels(conv: relax.Call, lanes: int) -> bool:
    """A plain NCHW conv whose input and output channels are whole blocks."""
    data, weight = (static_shape(a) for a in conv.args[:2])
    return (
        int(conv.attrs.groups) == 1
        and str(conv.attrs.data_layout) == "NCHW"
        and data is not None
        and weight is not None
        and data[1] % lanes == 0
        and weight[0] % lanes == 0
    )


def _prologue_conv(func: relax.Function) -> Optional[relax.Call]:
    """The conv of a prologue group whose data is ``relu(x * s + t)`` of its parameter ``x``."""
    conv = conv_of(func)
    if conv is None:
        return None
    chain = _prologue_chain(conv.args[0], {b.var: b.value for blk in func.body.blocks for b in blk.bindings})
    return conv if chain is not None and chain[0].same_as(func.params[0]) else None


def _prologue_chain(z, values: dict) -> Optional[tuple]:
    """``(x, s, t)`` where ``z`` is bound to ``relu(x * s + t)`` (the form of
    :func:`.fuse_prologue.prologue_group`), else None."""
    relu = values.get(z)
    if op_name(relu) != "relax.nn.relu":
        return None
    add = values.get(relu.args[0])
    if op_name(add) != "relax.add":
        return None
    mul = values.get(add.args[0])
    if op_name(mul) != "relax.multiply":
        return None
    return mul.args[0], mul.args[1], add.args[1]


def _prologue_weights(mod: tvm.IRModule, lanes: int) -> set[str]:
    """Names of the weight parameters of ``main`` read by the convs of blockable prologue
    groups: after the inlining and ConvertLayout, those convs get their prologue back."""
    names: set[str] = set()
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            callee = b.value.op if isinstance(b.value, relax.Call) else None
            func = mod[callee] if isinstance(callee, tvm.ir.GlobalVar) else None
            if not isinstance(func, relax.Function) or not str((func.attrs or {}).get("Composite", "")).startswith(PROLOGUE_PREFIX):
                continue
            conv = _prologue_conv(func) if func.body.blocks else None
            if conv is None or not _blocked_channels(conv, lanes):
                continue
            k = next((i for i, p in enumerate(func.params) if p.same_as(conv.args[1])), None)
            if k is not None and isinstance(b.value.args[k], relax.Var):
                names.add(b.value.args[k].name)
    return names


def _regroup_prologues(mod: tvm.IRModule, weights: set[str]) -> tuple[tvm.IRModule, int]:
    """Each ``relu(x * s + t)`` read only by a blocked conv (bare, or the data of its epilogue
    group) whose weight is one of ``weights`` becomes that conv's prologue again:
    ``prologue_group(x, s, t, ...)`` of :mod:`.fuse_prologue`, on blocked tensors
    (``s``, ``t``: ``[1, C/B, 1, 1, B]``). Returns (module, groups made)."""
    main = mod["main"]
    facts = FunctionFacts.of(main)
    bb = relax.BlockBuilder(mod)
    made: dict = {}  # the conv's binding var -> the prologue group's call
    for var, value in facts.var2val.items():
        if not isinstance(value, relax.Call):
            continue
        callee = None
        if isinstance(value.op, relax.GlobalVar):
            callee = mod[value.op]
            if not isinstance(callee, relax.Function) or not str((callee.attrs or {}).get("Composite", "")).startswith(PREFIX):
                continue
            conv = conv_of(callee)
            if conv is None or not conv.args[0].same_as(callee.params[0]):
                continue
            k = next((i for i, p in enumerate(callee.params) if p.same_as(conv.args[1])), None)
            if k is None:
                continue
            weight = value.args[k]
        elif op_name(value) == "relax.nn.conv2d":
            weight = value.args[1]
        else:
            continue
        source = facts.var2val.get(weight)
        param = source.args[0] if op_name(source) == "relax.layout_transform" else weight
        if not isinstance(param, relax.Var) or param.name not in weights:
            continue
        z = value.args[0]
        chain = _prologue_chain(z, facts.var2val)
        if chain is None:
            continue
        relu = facts.var2val[z]
        inner = (z, relu.args[0], facts.var2val[relu.args[0]].args[0])  # relu, add, multiply results
        if any(facts.uses.get(v, 0) != 1 or not isinstance(v, relax.DataflowVar) for v in inner):
            continue
        x, s_, t = chain
        gv, rest = prologue_group(x.ty, s_.ty, callee, value, bb)
        made[var] = relax.Call(gv, [x, s_, t, *rest])
    if not made:
        return mod, 0

    def rebind(b, values):
        return [relax.VarBinding(b.var, made[b.var])] if b.var in made else None

    out = _map_main(bb.get(), rebind)
    return relax.transform.DeadCodeElimination()(out), len(made)


def inline_groups(mod: tvm.IRModule, which) -> tuple[tvm.IRModule, int]:
    """``mod`` with every call from ``main`` to a function ``f`` with ``which(f)`` replaced by
    ``f``'s bindings (its parameters bound to the call's arguments); (module, calls inlined)."""
    main_gv = mod.get_global_var("main")
    main = mod[main_gv]
    count = 0
    blocks = []
    for block in main.body.blocks:
        bindings = []
        for b in block.bindings:
            callee = b.value.op if isinstance(b.value, relax.Call) else None
            func = mod[callee] if isinstance(callee, tvm.ir.GlobalVar) else None
            inlinable = isinstance(b, relax.VarBinding) and isinstance(block, relax.DataflowBlock)
            if not inlinable or not isinstance(func, relax.Function) or not which(func):
                bindings.append(b)
                continue
            fresh = copy_with_new_vars(func)
            fresh = fresh.bind_params(dict(zip(fresh.params, b.value.args)))
            inner = list(fresh.body.blocks[0].bindings)
            if inner and inner[-1].var.same_as(fresh.body.body):  # the last binding binds the call's var (no alias)
                inner[-1] = relax.VarBinding(b.var, inner[-1].value)
            else:
                inner.append(relax.VarBinding(b.var, fresh.body.body))
            bindings.extend(inner)
            count += 1
        blocks.append(relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock) else relax.BindingBlock(bindings))
    if not count:
        return mod, 0
    out = mod.clone()
    body = relax.SeqExpr(blocks, main.body.body)
    out[main_gv] = relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs, main.span)
    return relax.transform.DeadCodeElimination()(out), count


# ---------------------------------------------------------------------- channel slices
# TVM 0.27's ConvertLayout divides neither a split's indices nor its sections by the block
# (a split of a blocked tensor at channel 64 of 22 blocks gives an empty piece, and the conv
# reading it fails to type-check). So a channel split (the horizontal merge's pieces) goes in
# as strided slices, which ConvertLayout keeps plain (to_plain -> slice -> to_blocked), and
# comes out as a slice of the blocked tensor where the bounds are whole blocks:
#     to_blocked(strided_slice(to_plain(t), axis 1, [lo, hi)))  ==  strided_slice(t, axis 1, [lo/B, hi/B))


def _map_main(mod: tvm.IRModule, rebind) -> tvm.IRModule:
    """``main`` with each dataflow binding ``b`` replaced by ``rebind(b, values)`` (a list of
    bindings; ``values``: var -> bound value of every binding before)."""
    main_gv = mod.get_global_var("main")
    main = mod[main_gv]
    values: dict = {}
    blocks, changed = [], False
    for block in main.body.blocks:
        bindings = []
        for b in block.bindings:
            new = rebind(b, values) if isinstance(block, relax.DataflowBlock) and isinstance(b, relax.VarBinding) else None
            if new is None:
                new = [b]
            else:
                changed = True
            for nb in new:
                values[nb.var] = nb.value
            bindings.extend(new)
        blocks.append(relax.DataflowBlock(bindings) if isinstance(block, relax.DataflowBlock) else relax.BindingBlock(bindings))
    if not changed:
        return mod
    out = mod.clone()
    out[main_gv] = relax.Function(main.params, relax.SeqExpr(blocks, main.body.body), main.ret_ty, main.is_pure, main.attrs, main.span)
    return out


def _splits_to_slices(mod: tvm.IRModule) -> tvm.IRModule:
    """Every piece ``split(x, ..., axis=1)[k]`` of a 4-d ``x`` as ``strided_slice(x, axis 1)``;
    a split read other than by its pieces stays."""
    main = mod["main"]
    tuple_uses: dict = {}  # split var -> number of uses that are not TupleGetItem bindings

    def visit(e):
        if isinstance(e, relax.Var):
            tuple_uses[e] = tuple_uses.get(e, 0) + 1
        elif isinstance(e, relax.TupleGetItem) and isinstance(e.tuple_value, relax.Var):
            tuple_uses[e.tuple_value] = tuple_uses.get(e.tuple_value, 0) - 1  # its var is visited too

    relax.analysis.post_order_visit(main.body, visit)

    def bounds(split: relax.Call) -> Optional[list[tuple[int, int]]]:
        shape = static_shape(split.args[0])
        if shape is None or len(shape) != 4 or int(split.attrs.axis) % 4 != 1:
            return None
        sections = split.attrs.indices_or_sections
        channels = shape[1]
        if isinstance(sections, (tvm.tirx.IntImm, int)):
            step = channels // int(sections)
            cuts = [step * k for k in range(1, int(sections))]
        else:
            cuts = [int(c) for c in sections]
        edges = [0, *cuts, channels]
        return list(zip(edges[:-1], edges[1:]))

    def rebind(b, values):
        if op_name(b.value) == "relax.split" and tuple_uses.get(b.var, 0) == 0 and bounds(b.value) is not None:
            return []  # its pieces become slices below
        if isinstance(b.value, relax.TupleGetItem) and isinstance(b.value.tuple_value, relax.Var):
            split = values.get(b.value.tuple_value)
            if split is None:  # dropped above: find it in the original bindings
                split = _binding_value(main, b.value.tuple_value)
            if op_name(split) == "relax.split" and tuple_uses.get(b.value.tuple_value, 0) == 0:
                cuts = bounds(split)
                if cuts is not None:
                    lo, hi = cuts[int(b.value.index)]
                    return [relax.VarBinding(b.var, relax.op.strided_slice(split.args[0], axes=[1], begin=[lo], end=[hi]))]
        return None

    return _map_main(mod, rebind)


def _binding_value(func: relax.Function, var: relax.Var):
    for block in func.body.blocks:
        for b in block.bindings:
            if b.var.same_as(var):
                return b.value
    return None


def _is_layout(call, lanes: int, *, blocked: bool) -> bool:
    """``call`` is ``layout_transform`` NCHW -> NCHW[lanes]c (``blocked``) or back."""
    if op_name(call) != "relax.layout_transform":
        return False
    src, dst = static_shape(call.args[0]), static_shape(call)
    plain, block = (src, dst) if blocked else (dst, src)
    if plain is None or block is None or len(plain) != 4 or len(block) != 5 or block[4] != lanes:
        return False
    if blocked:
        probe, want = (0, lanes + 3, 1, 2), (0, 1, 1, 2, 3)
    else:
        probe, want = (0, 1, 1, 2, 3), (0, lanes + 3, 1, 2)
    got = call.attrs.index_map.map_indices([tvm.tirx.IntImm("int64", v) for v in probe])
    try:
        return tuple(int(g) for g in got) == want
    except (TypeError, ValueError):  # not constant: not this map
        return False


def _blocked_slices(mod: tvm.IRModule, lanes: int) -> tvm.IRModule:
    """``to_blocked(strided_slice(to_plain(t), axis 1, [lo, hi)))`` -> a slice of ``t``."""

    def rebind(b, values):
        if not _is_layout(b.value, lanes, blocked=True):
            return None
        sliced = values.get(b.value.args[0])
        if op_name(sliced) != "relax.strided_slice":
            return None
        plain = values.get(sliced.args[0])
        if plain is None or not _is_layout(plain, lanes, blocked=False):
            return None
        axes, begin, end, strides = (_ints(sliced, k) for k in (1, 2, 3, 4))  # (data, axes, begin, end[, strides])
        if axes != [1] or begin is None or end is None or (strides not in (None, [1])):
            return None
        lo, hi = begin[0], end[0]
        if lo % lanes or hi % lanes:
            return None
        t = plain.args[0]
        return [relax.VarBinding(b.var, relax.op.strided_slice(t, axes=[1], begin=[lo // lanes], end=[hi // lanes]))]

    return _map_main(mod, rebind)


def _ints(call, k: int) -> Optional[list[int]]:
    if len(call.args) <= k:
        return None
    arg = call.args[k]
    fields = getattr(arg, "fields", None) or getattr(arg, "values", None)
    if fields is None:
        return None
    try:
        return [int(getattr(f, "value", f)) for f in fields]
    except (TypeError, ValueError):
        return None


# ConvertLayout keeps a concat plain when one of its pieces is (the plain slice of a split
# piece that goes straight into a concat), and the pools after that concat with it. The
# blocked form of those ops, where every channel count is whole blocks:
#     concat(to_plain(a), to_plain(b), axis 1)  == to_plain(concat(a, b, axis 1))
#     strided_slice(to_plain(t), axis 1, [lo, hi)) == to_plain(strided_slice(t, axis 1, [lo/B, hi/B)))
#     pool(to_plain(t))                         == to_plain(pool_NCHWBc(t))
#     f(to_plain(t), u)                         == to_plain(f(t, to_blocked(u)))   (element-wise f, u 4-d or a scalar)
#     depthwise(to_plain(t), W)                 == to_plain(depthwise_NCHWBc(t, W as OIHW1iBo))
#     conv2d(x, W), x with k < B channels       == to_plain(conv2d_NCHWkc(x as NCHWkc, W as OIHWkiBo) -> NCHWBc)
#     to_blocked(to_plain(t))                   == t
UNARY = {
    "relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh", "relax.nn.silu", "relax.nn.gelu",
    "relax.nn.gelu_tanh", "relax.nn.leakyrelu", "relax.erf", "relax.exp",
}  # fmt: skip
BINARY = {"relax.add", "relax.multiply", "relax.subtract", "relax.divide", "relax.maximum", "relax.minimum"}
POOLS = {"relax.nn.max_pool2d": relax.op.nn.max_pool2d, "relax.nn.avg_pool2d": relax.op.nn.avg_pool2d}


def _sink_to_plain(mod: tvm.IRModule, lanes: int) -> tvm.IRModule:
    """Move ``to_plain`` transforms below the ops above (so that one ``to_blocked`` after them
    cancels): each rewritten op is computed on the blocked tensors, and its plain result,
    still bound to the op's variable, becomes dead where nothing plain reads it."""
    bb = relax.BlockBuilder()
    blocked: dict = {}  # plain var -> the blocked var it is to_plain of
    data, _ = blocked_layouts(lanes)

    def fresh(name: str, value) -> relax.VarBinding:
        value = bb.normalize(value)
        return relax.VarBinding(relax.DataflowVar(name, value.ty), value)

    def to_plain(v, b: relax.VarBinding) -> relax.VarBinding:
        blocked[v] = b.var
        return relax.VarBinding(v, relax.op.layout_transform(b.var, lambda n, c, h, w, i: (n, c * lanes + i, h, w)))

    def whole(shape) -> bool:
        return shape is not None and len(shape) == 4 and shape[1] % lanes == 0

    def rebind(b, values):
        v, value = b.var, b.value
        if _is_layout(value, lanes, blocked=False):
            blocked[v] = value.args[0]
            return None
        if _is_layout(value, lanes, blocked=True) and value.args[0] in blocked:
            return [relax.VarBinding(v, blocked[value.args[0]])]  # an alias, canonicalised away
        name = op_name(value)
        if name == "relax.concat" and int(value.attrs.axis) in (1, -3):
            fields = list(value.args[0].fields) if isinstance(value.args[0], relax.Tuple) else None
            if fields and all(f in blocked and whole(static_shape(f)) for f in fields):
                cat = fresh(v.name + "_blocked", relax.op.concat([blocked[f] for f in fields], axis=1))
                return [cat, to_plain(v, cat)]
        if name == "relax.strided_slice" and value.args[0] in blocked:
            axes, begin, end, strides = (_ints(value, k) for k in (1, 2, 3, 4))
            if axes == [1] and begin and end and strides in (None, [1]) and begin[0] % lanes == 0 and end[0] % lanes == 0:
                piece = relax.op.strided_slice(blocked[value.args[0]], axes=[1], begin=[begin[0] // lanes], end=[end[0] // lanes])
                sl = fresh(v.name + "_blocked", piece)
                return [sl, to_plain(v, sl)]
        if name == "relax.nn.conv2d" and value.args[0] in blocked:
            return _depthwise(v, value, blocked[value.args[0]])
        if name == "relax.nn.conv2d":
            return _narrow_input(v, value)
        if name in UNARY and value.args and value.args[0] in blocked:
            rest = list(value.args[1:])
            if all(not isinstance(a.ty, relax.TensorType) for a in rest):
                op = fresh(v.name + "_blocked", relax.Call(value.op, [blocked[value.args[0]], *rest], value.attrs))
                return [op, to_plain(v, op)]
        if name in BINARY and len(value.args) == 2:
            return _binary(v, value)
        if name in POOLS and value.args[0] in blocked and str(value.attrs.layout) == "NCHW" and str(value.attrs.out_layout) == "NCHW":
            a = value.attrs
            pool = POOLS[name](
                blocked[value.args[0]],
                pool_size=[int(k) for k in a.pool_size],
                strides=[int(k) for k in a.strides],
                padding=[int(k) for k in a.padding],
                dilation=[int(k) for k in a.dilation],
                ceil_mode=bool(a.ceil_mode),
                count_include_pad=bool(a.count_include_pad),
                layout=data,
                out_layout=data,
            )
            pb = fresh(v.name + "_blocked", pool)
            return [pb, to_plain(v, pb)]
        return None

    def to_blocked(x, name: str):
        """``x`` (4-d, plain) in the blocked layout: its blocked var, or a new transform."""
        if x in blocked:
            return blocked[x], []
        t = fresh(name, relax.op.layout_transform(x, lambda n, c, h, w: (n, c // lanes, h, w, c % lanes)))
        return t.var, [t]

    def _binary(v, value):
        a, b = value.args
        if a not in blocked and b not in blocked:
            return None
        out = static_shape(v)
        if out is None or len(out) != 4 or out[1] % lanes:
            return None
        new, pre = [], []
        for x in (a, b):
            shape = static_shape(x)
            if shape is not None and len(shape) == 0:  # a scalar: as it is
                new.append(x)
            elif shape is not None and len(shape) == 4 and shape[1] == out[1]:
                xb, made = to_blocked(x, v.name + "_operand")
                new.append(xb)
                pre += made
            else:
                return None
        op = fresh(v.name + "_blocked", relax.Call(value.op, new, value.attrs))
        return [*pre, op, to_plain(v, op)]

    def _narrow_input(v, conv):
        """A plain conv with fewer input channels than a block (an image's 3) and whole output
        blocks: its input as one block of all its channels (``NCHW3c``, ``[N, 1, H, W, 3]``),
        its output blocked, so the conv runs blocked and so does everything after it."""
        a = conv.attrs
        w = static_shape(conv.args[1])
        c = static_shape(conv.args[0])
        if w is None or c is None or len(c) != 4 or int(a.groups) != 1 or not (c[1] < lanes and w[0] % lanes == 0):
            return None
        if str(a.data_layout) != "NCHW" or str(a.kernel_layout) != "OIHW" or str(a.out_layout) not in ("", "NCHW"):
            return None
        k = c[1]
        xb = fresh(v.name + "_input", relax.op.layout_transform(conv.args[0], lambda n, i, h, w: (n, i // k, h, w, i % k)))
        w_map = lambda o, i, h, w: (o // lanes, i // k, h, w, i % k, o % lanes)  # noqa: E731 - OIHW -> OIHWkiBo
        wb = fresh(v.name + "_weight", relax.op.layout_transform(conv.args[1], w_map))
        out = fresh(
            v.name + "_blocked",
            relax.op.nn.conv2d(
                xb.var,
                wb.var,
                strides=[int(s) for s in a.strides],
                padding=[int(p) for p in a.padding],
                dilation=[int(d) for d in a.dilation],
                data_layout=f"NCHW{k}c",
                kernel_layout=f"OIHW{k}i{lanes}o",
                out_layout=data,
                out_dtype=str(v.ty.dtype),
            ),
        )
        return [xb, wb, out, to_plain(v, out)]

    def _depthwise(v, conv, x):
        """A depthwise conv (channel multiplier 1) on a blocked tensor: weights ``[C, 1, kh, kw]``
        as ``OIHW1i{B}o`` ``[C/B, 1, kh, kw, 1, B]``."""
        a = conv.attrs
        w = static_shape(conv.args[1])
        c = static_shape(conv.args[0])
        if w is None or c is None or not (int(a.groups) == c[1] == w[0] and w[1] == 1) or c[1] % lanes:
            return None
        if str(a.data_layout) != "NCHW" or str(a.kernel_layout) != "OIHW" or str(a.out_layout) not in ("", "NCHW"):
            return None
        wb = fresh(v.name + "_weight", relax.op.layout_transform(conv.args[1], lambda o, i, h, w: (o // lanes, i, h, w, i % 1, o % lanes)))
        out = fresh(
            v.name + "_blocked",
            relax.op.nn.conv2d(
                x,
                wb.var,
                strides=[int(k) for k in a.strides],
                padding=[int(k) for k in a.padding],
                dilation=[int(k) for k in a.dilation],
                groups=int(a.groups),
                data_layout=data,
                kernel_layout=f"OIHW1i{lanes}o",
                out_layout=data,
                out_dtype=str(v.ty.dtype),
            ),
        )
        return [wb, out, to_plain(v, out)]

    return _map_main(mod, rebind)


def _slices_to_split(mod: tvm.IRModule) -> tvm.IRModule:
    """Channel slices of one tensor that cover it exactly, each once, as one ``split`` and its
    pieces again: the form the lowering (``SplitOutputBuffers``, ``InPlaceConcat``) turns into
    a producer writing its pieces in place (a slice is a copy kernel, and FuseOps fuses one
    into the concat that reads it, which then stays a copy)."""
    main = mod["main"]
    pieces: dict = {}  # source var -> [(lo, hi, var)]
    for block in main.body.blocks:
        for b in block.bindings:
            if op_name(b.value) != "relax.strided_slice" or not isinstance(b.value.args[0], relax.Var):
                continue
            axes, begin, end, strides = (_ints(b.value, k) for k in (1, 2, 3, 4))
            if axes == [1] and begin and end and strides in (None, [1]):
                pieces.setdefault(b.value.args[0], []).append((begin[0], end[0], b.var))
    splits: dict = {}  # first piece var -> (source, cuts); piece var -> index
    index: dict = {}
    for src, ps in pieces.items():
        shape = static_shape(src)
        ps = sorted(ps, key=lambda p: p[0])
        edges = [p[0] for p in ps] + [ps[-1][1]]
        if shape is None or len(ps) < 2 or edges[0] != 0 or edges[-1] != shape[1]:
            continue
        if any(a[1] != b[0] for a, b in zip(ps, ps[1:])):
            continue
        first = min(ps, key=lambda p: _position(main, p[2]))[2]
        splits[first] = (src, edges[1:-1], [p[2] for p in ps])
        for k, p in enumerate(ps):
            index[p[2]] = k
    if not splits:
        return mod
    made: dict = {}  # source -> split var
    bb = relax.BlockBuilder()

    def rebind(b, values):
        if b.var not in index:
            return None
        out = []
        if b.var in splits:
            src, cuts, _ = splits[b.var]
            value = bb.normalize(relax.op.split(src, indices_or_sections=cuts, axis=1))
            made[src] = relax.VarBinding(relax.DataflowVar(b.var.name + "_split", value.ty), value)
            out.append(made[src])
        src = b.value.args[0]
        return out + [relax.VarBinding(b.var, relax.TupleGetItem(made[src].var, index[b.var]))]

    return _map_main(mod, rebind)


def _position(func: relax.Function, var) -> int:
    k = 0
    for block in func.body.blocks:
        for b in block.bindings:
            if b.var.same_as(var):
                return k
            k += 1
    return k
