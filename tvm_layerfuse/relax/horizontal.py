"""Horizontal merge on Relax: parallel ``conv2d`` calls that read one tensor become one conv2d.

Algebra, for branches ``i = 1..n`` reading the same ``x: [N, C_in, H, W]`` with equal
strides, padding, dilation, layouts (NCHW / OIHW), kernel size and ``groups = 1``::

    W   = concat(W_1, ..., W_n, axis=0)   # [sum C_i, C_in, kh, kw]
    b   = concat(b_1, ..., b_n)           # [sum C_i]   (zeros(C_i) for a branch without bias)
    y   = act(conv(x, W) + b)             # [N, sum C_i, H', W']
    y_i = y[:, o_i : o_i + C_i]           # o_i = C_1 + ... + C_{i-1}

Output channels follow the order of the group. In Relax this is::

    w     = R.concat((w_1, ..., w_n), axis=0)                   # [sum C_i, C_in, kh, kw]
    y     = R.nn.conv2d(x, w, <the branches' attributes>)       # [N, sum C_i, H', W']
    b     = R.concat((b_1, R.zeros((C_2,)), ..., b_n), axis=0)  # [sum C_i]
    y     = R.add(y, R.reshape(b, (1, sum C_i, 1, 1)))          # ONNX-style bias
    y     = act(y)                                              # relu, clip, ... (shared)
    parts = R.split(y, [o_2, ..., o_n], axis=1)
    tail_i = parts[i - 1]                                       # the branch's old result variable

A branch is ``conv2d``, optionally followed by the ONNX-style bias ``add(conv,
reshape(b, [1, C_i, 1, 1]))`` and then by an element-wise activation (:data:`ACTIVATIONS`);
each link of that chain must be the only reader of the previous one. Branches whose
activations differ (op, attributes or arguments) are not merged; an activation outside
:data:`ACTIVATIONS` (e.g. the ``call_tir`` or ``maximum``/``minimum`` pair an ONNX Clip may
import as) is not absorbed and stays on each branch, after its slice. The last variable of
each chain keeps its identity and is re-bound to its slice, so the branches' readers are
untouched. The merged bindings take the place of the group's first conv in the dataflow
block (later where a weight they read is defined later); the block is pure, so the order
of independent bindings does not matter. Run the pass before ``FuseOps`` or anything else
that hides conv2d calls inside functions.

Weights (and biases) must be compile-time values: function parameters that are weights
(index >= the function's ``num_input`` attribute when it has one), constants, or dataflow
values computed only from those. The concatenations are ordinary Relax expressions of
them, so after ``BindParams`` + ``FoldConstant`` each is one constant computed once at
compile time, not per inference. Typical use on an ONNX model::

    mod = from_onnx(model, keep_params_in_input=True)
    mod, params = relax.frontend.detach_params(mod)
    mod = MergeParallelConv2D(groups=merge_groups_from_plan(plan, mod))(mod)
    mod = relax.transform.BindParams("main", names_to_tensors)(mod)
    mod = relax.transform.FoldConstant()(mod)

When every slice of a merged output feeds one ``R.concat`` in channel order, the split and
the concat cancel (:mod:`tvm_layerfuse.relax.cancel_split_concat`, applied to the functions
this pass changed unless ``cancel_split_concat=False``).

Anything not understood about a candidate leaves it unmerged; the reason is logged and
recorded in ``pass.report`` (a :class:`MergeReport`).
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

import tvm
import tvm_ffi
from tvm import relax

from ..planner import FusionPlan
from ..report import Report
from ..templates.base import Refusal
from ._ir import FunctionFacts, is_primitive, op_name, param_names, weight_param
from .cancel_split_concat import cancel_split_concat, remove_unused_dataflow_bindings, with_blocks

log = logging.getLogger(__name__)

__all__ = [
    "ACTIVATIONS",
    "MergeParallelConv2D",
    "MergeReport",
    "MergedGroup",
    "Refusal",
    "merge_groups_from_plan",
]

ACTIVATIONS = frozenset(
    {
        "relax.nn.relu",
        "relax.clip",
        "relax.nn.leakyrelu",
        "relax.nn.gelu",
        "relax.nn.gelu_tanh",
        "relax.nn.silu",
        "relax.nn.selu",
        "relax.nn.softplus",
        "relax.sigmoid",
        "relax.tanh",
    }
)
"""Element-wise ops, identical on every channel, that the merged conv may apply once."""

_LAYOUTS = ("NCHW", "OIHW", "NCHW")  # data, kernel, out: the only layouts merged (channel axes 1, 0, 1)


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class MergedGroup:
    """One merge carried out: the branches (conv result variables) in output-channel order."""

    function: str
    convs: tuple[str, ...]
    weights: tuple[str, ...]
    channels: tuple[tuple[int, int], ...]  # [start, end) of each branch in the merged output
    bias: bool
    activation: Optional[str]


@dataclass
class MergeReport(Report):
    """What one run of :class:`MergeParallelConv2D` did."""

    merged: list[MergedGroup] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    concats_cancelled: int = 0

    @property
    def convs_removed(self) -> int:
        return sum(len(g.convs) - 1 for g in self.merged)

    def reasons(self) -> list[str]:
        return [r.reason for r in self.refused]


# --------------------------------------------------------------------------- analysis


def _dims(ty: Any) -> Optional[tuple[Optional[int], ...]]:
    """Static dims of a tensor type (None for a symbolic dim); None when the rank is unknown."""
    shape = getattr(ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr):
        return None
    return tuple(int(d.value) if isinstance(d, tvm.tirx.IntImm) else None for d in shape.values)


def _dtype(ty: Any) -> Optional[str]:
    dtype = getattr(ty, "dtype", None)
    return None if dtype is None else str(dtype)


def _same_ty(a: Any, b: Any) -> bool:
    return bool(tvm_ffi.structural_equal(a, b))


def _ints(values: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclass
class _Branch:
    """A conv2d and the bias add / activation that merge with it."""

    conv: relax.Var  # [N, C_i, H', W']
    call: relax.Call
    data: relax.Expr  # [N, C_in, H, W]
    weight: relax.Expr  # [C_i, C_in, kh, kw]
    weight_dims: tuple[int, ...]
    weight_names: frozenset[str]
    bias: Optional[relax.Expr] = None  # [C_i] or [1, C_i, 1, 1] (see bias_is_4d)
    bias_is_4d: bool = False
    bias_dtype: Optional[str] = None
    activation: Optional[relax.Call] = None
    chain: list[relax.Var] = field(default_factory=list)  # conv, [bias add], [activation]
    stopped: Optional[str] = None  # why the chain ends where it does, when it is not obvious

    @property
    def channels(self) -> int:
        return self.weight_dims[0]

    @property
    def tail(self) -> relax.Var:
        return self.chain[-1]

    @property
    def name(self) -> str:
        return self.conv.name

    @property
    def weight_label(self) -> str:
        if isinstance(self.weight, relax.Var) and self.weight.name in self.weight_names:
            return self.weight.name  # the parameter itself
        return "+".join(sorted(self.weight_names)) or "<constant>"


def _activation_name(call: Optional[relax.Call]) -> str:
    return "no activation" if call is None else call.op.name.removeprefix("relax.")


def _same_activation(a: Optional[relax.Call], b: Optional[relax.Call]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (
        a.op.same_as(b.op)
        and _same_ty(a.attrs, b.attrs)
        and _same_ty(list(a.args[1:]), list(b.args[1:]))
        and _same_ty(list(a.ty_args), list(b.ty_args))
    )


class _BlockIndex:
    """Definitions and readers of the variables of one dataflow block of a function."""

    def __init__(self, facts: FunctionFacts, block: relax.DataflowBlock) -> None:
        self.block = block
        self.bindings = list(block.bindings)
        self.value: dict[relax.Var, relax.Expr] = {}
        self.position: dict[relax.Var, int] = {}
        self.readers: dict[relax.Var, list[int]] = {}
        for i, b in enumerate(self.bindings):
            self.position[b.var] = i
            if isinstance(b, relax.VarBinding):
                self.value[b.var] = b.value
            for v in relax.analysis.free_vars(b.value):
                self.readers.setdefault(v, []).append(i)
        self.facts = facts

    # -- compile-time values

    def is_static(self, expr: relax.Expr) -> bool:
        """True when ``expr`` depends only on weight parameters and constants."""
        return self.facts.is_static(expr)

    def param_names(self, expr: relax.Expr) -> frozenset[str]:
        """Names of the weight parameters ``expr`` is computed from."""
        return frozenset(self.facts.weight_roots(expr))

    # -- chains

    def sole_reader(self, var: relax.Var) -> Optional[relax.VarBinding]:
        """The only binding that reads ``var`` when ``var`` is a dataflow variable read once."""
        if not isinstance(var, relax.DataflowVar):
            return None  # a block output may be read after the block
        readers = self.readers.get(var, [])
        if len(readers) != 1:
            return None
        binding = self.bindings[readers[0]]
        return binding if isinstance(binding, relax.VarBinding) else None

    def branch(self, binding: relax.VarBinding) -> Union[_Branch, str]:
        """The merge-able chain that starts at the conv2d ``binding``, or why it cannot merge."""
        call = binding.value
        attrs = call.attrs
        data, weight = call.args
        if int(attrs.groups) != 1:
            return (
                f"{binding.var.name}: grouped convolution (groups={int(attrs.groups)}) "
                "cannot be concatenated along output channels"
            )
        layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
        if layouts != _LAYOUTS:
            return f"{binding.var.name}: layouts {'/'.join(layouts)} are not supported (only {'/'.join(_LAYOUTS)})"
        wdims = _dims(weight.ty)
        odims = _dims(binding.var.ty)
        if wdims is None or len(wdims) != 4 or None in wdims:
            return f"{binding.var.name}: weight shape {weight.ty} is not static"
        if odims is None or len(odims) != 4 or odims[1] != wdims[0]:
            return f"{binding.var.name}: output {binding.var.ty} does not have {wdims[0]} static channels on axis 1"
        if not self.is_static(weight):
            return f"{binding.var.name}: weight is computed at run time; merging needs parameters or constants"
        b = _Branch(
            conv=binding.var,
            call=call,
            data=data,
            weight=weight,
            weight_dims=wdims,
            weight_names=self.param_names(weight),
            chain=[binding.var],
        )
        self._absorb_bias(b)
        self._absorb_activation(b)
        return b

    def _readers_note(self, var: relax.Var) -> Optional[str]:
        if not isinstance(var, relax.DataflowVar):
            return f"{var.name} is an output of its dataflow block"
        n = len(self.readers.get(var, []))
        return f"{var.name} has {n} readers" if n > 1 else None

    def _absorb_bias(self, b: _Branch) -> None:
        b.stopped = self._readers_note(b.conv)
        reader = self.sole_reader(b.conv)
        if reader is None or op_name(reader.value) != "relax.add":
            return
        lhs, rhs = reader.value.args
        if lhs.same_as(b.conv) and not rhs.same_as(b.conv):
            other = rhs
        elif rhs.same_as(b.conv) and not lhs.same_as(b.conv):
            other = lhs
        else:
            return
        if _dims(other.ty) != (1, b.channels, 1, 1) or not self.is_static(other):
            log.debug("%s: add %s is not a per-channel bias [1, %d, 1, 1]", b.name, reader.var.name, b.channels)
            return
        if not _same_ty(reader.var.ty, b.conv.ty):
            return
        b.bias, b.bias_is_4d, b.bias_dtype = other, True, _dtype(other.ty)
        source = self.value.get(other) if isinstance(other, relax.DataflowVar) else None
        if op_name(source) == "relax.reshape":  # the ONNX importer's reshape(b, [1, C, 1, 1])
            flat = source.args[0]
            if _dims(flat.ty) == (b.channels,) and _dtype(flat.ty) == b.bias_dtype:
                b.bias, b.bias_is_4d = flat, False
        b.chain.append(reader.var)

    def _absorb_activation(self, b: _Branch) -> None:
        if not b.tail.same_as(b.conv):
            b.stopped = self._readers_note(b.tail)
        reader = self.sole_reader(b.tail)
        if reader is None or op_name(reader.value) not in ACTIVATIONS:
            return
        call = reader.value
        if not call.args[0].same_as(b.tail) or any(
            not self.is_static(a) or b.tail in relax.analysis.free_vars(a) for a in call.args[1:]
        ):
            return
        if not _same_ty(reader.var.ty, b.tail.ty):
            return
        b.activation = call
        b.chain.append(reader.var)


def _difference(a: _Branch, b: _Branch) -> Optional[str]:
    """Why branches ``a`` and ``b`` cannot share one conv, or None."""
    if not a.data.same_as(b.data):
        return f"{a.name} and {b.name} read different inputs"
    if a.weight_dims[1:] != b.weight_dims[1:]:
        return (
            f"kernels differ: {a.name} has [C_in, kh, kw] = {list(a.weight_dims[1:])}, "
            f"{b.name} has {list(b.weight_dims[1:])}"
        )
    pa, pb = a.call.attrs, b.call.attrs
    for attr in ("strides", "padding", "dilation"):
        va, vb = _ints(getattr(pa, attr)), _ints(getattr(pb, attr))
        if va != vb:
            return f"{attr} differ: {a.name} has {list(va)}, {b.name} has {list(vb)}"
    if not _same_ty(pa, pb):
        return f"conv2d attributes differ: {a.name} has {pa}, {b.name} has {pb}"
    if _dtype(a.weight.ty) != _dtype(b.weight.ty) or _dtype(a.conv.ty) != _dtype(b.conv.ty):
        return f"dtypes differ: {a.name} and {b.name}"
    if a.bias is not None and b.bias is not None and a.bias_dtype != b.bias_dtype:
        return f"bias dtypes differ: {a.name} has {a.bias_dtype}, {b.name} has {b.bias_dtype}"
    if not _same_activation(a.activation, b.activation):
        notes = [x.stopped for x in (a, b) if x.activation is None and x.stopped]
        return (
            f"activations differ: {a.name} ends with {_activation_name(a.activation)}, "
            f"{b.name} with {_activation_name(b.activation)}" + (f" ({'; '.join(notes)})" if notes else "")
        )
    return None


# --------------------------------------------------------------------------- rewrite


class _Emitter:
    """Collects new dataflow bindings, each normalised (type inferred) on creation."""

    def __init__(self) -> None:
        self.bindings: list[relax.VarBinding] = []
        self._bb = relax.BlockBuilder()

    def __call__(self, name: str, expr: relax.Expr) -> relax.DataflowVar:
        expr = self._bb.normalize(expr)
        var = relax.DataflowVar(name, expr.ty)
        self.bindings.append(relax.VarBinding(var, expr))
        return var


def _merged_bindings(group: Sequence[_Branch]) -> tuple[list[relax.VarBinding], list[relax.VarBinding]]:
    """The bindings computing the merged chain, and the re-bindings of each branch's tail."""
    first = group[0]
    total = sum(b.channels for b in group)
    emit = _Emitter()
    w = emit("hz_weight", relax.op.concat(relax.Tuple([b.weight for b in group]), axis=0))  # [sum C_i, C_in, kh, kw]
    conv = relax.Call(first.call.op, [first.data, w], first.call.attrs, first.call.ty_args)
    y = emit("hz_conv", conv)  # [N, sum C_i, H', W']
    with_bias = [b for b in group if b.bias is not None]
    if with_bias:
        dtype = with_bias[0].bias_dtype
        pieces = []
        for b in group:
            if b.bias is None:
                pieces.append(emit("hz_zero_bias", relax.op.zeros((b.channels,), dtype)))  # [C_i]
            elif b.bias_is_4d:
                pieces.append(emit("hz_flat_bias", relax.op.reshape(b.bias, (b.channels,))))  # [C_i]
            else:
                pieces.append(b.bias)  # [C_i]
        bias = emit("hz_bias", relax.op.concat(relax.Tuple(pieces), axis=0))  # [sum C_i]
        bias = emit("hz_bias_4d", relax.op.reshape(bias, (1, total, 1, 1)))  # [1, sum C_i, 1, 1]
        y = emit("hz_add", relax.op.add(y, bias))  # [N, sum C_i, H', W']
    act = first.activation
    if act is not None:
        y = emit("hz_act", relax.Call(act.op, [y] + list(act.args[1:]), act.attrs, act.ty_args))
    offsets, start = [], 0
    for b in group[:-1]:
        start += b.channels
        offsets.append(start)
    parts = emit("hz_split", relax.op.split(y, offsets, axis=1))  # (N, C_i, H', W') for each i
    bb = relax.BlockBuilder()
    tails = []
    for i, b in enumerate(group):
        item = bb.normalize(relax.TupleGetItem(parts, i))
        if not _same_ty(item.ty, b.tail.ty):
            raise _MergeError(f"slice {i} has type {item.ty}, but {b.tail.name} has {b.tail.ty}")
        tails.append(relax.VarBinding(b.tail, item))
    return emit.bindings, tails


class _MergeError(Exception):
    """The merged chain does not reproduce a branch's type: the group is left unmerged."""


def _rewrite_block(index: _BlockIndex, groups: Sequence[Sequence[_Branch]]) -> relax.DataflowBlock:
    """``index.block`` with each group merged, in a dependency-respecting order.

    Kept bindings retain their order; the merged chain of a group takes the place of its
    first conv (later if a weight it needs is defined later). Dataflow blocks are pure, so
    moving a binding never changes what the block computes.
    """
    removed: set[relax.Var] = set()
    rebound: dict[relax.Var, relax.VarBinding] = {}
    keyed: list[tuple[tuple[int, int], relax.Binding]] = []
    for group in groups:
        new, tails = _merged_bindings(group)
        anchor = min(index.position[b.conv] for b in group)
        keyed += [((anchor, k + 1), binding) for k, binding in enumerate(new)]
        for b in group:
            removed.update(b.chain[:-1])
        rebound.update({t.var: t for t in tails})
    maybe_dead: set[relax.Var] = set()  # what the replaced bindings read, e.g. reshape(b_i)
    for i, binding in enumerate(index.bindings):
        if binding.var in removed or binding.var in rebound:
            maybe_dead.update(relax.analysis.free_vars(binding.value))
        if binding.var not in removed:
            keyed.append(((i, 0), rebound.get(binding.var, binding)))
    ordered = _topological(keyed)
    return remove_unused_dataflow_bindings(relax.DataflowBlock(ordered, index.block.span), candidates=maybe_dead)


def _topological(keyed: list[tuple[tuple[int, int], relax.Binding]]) -> list[relax.Binding]:
    """Bindings ordered so that each follows the bindings it reads; ties broken by key."""
    defined = {b.var: n for n, (_, b) in enumerate(keyed)}
    waiting = [0] * len(keyed)
    dependents: list[list[int]] = [[] for _ in keyed]
    for n, (_, b) in enumerate(keyed):
        for v in set(relax.analysis.free_vars(b.value)):
            if v in defined:
                waiting[n] += 1
                dependents[defined[v]].append(n)
    ready = [(keyed[n][0], n) for n in range(len(keyed)) if waiting[n] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(keyed[n][1])
        for m in dependents[n]:
            waiting[m] -= 1
            if waiting[m] == 0:
                heapq.heappush(ready, (keyed[m][0], m))
    if len(out) != len(keyed):
        raise _MergeError("the merged bindings would form a dependency cycle")
    return out


# --------------------------------------------------------------------------- the pass


@dataclass
class _Candidates:
    """The analysed conv2d bindings of one dataflow block."""

    function: str
    block: int
    index: _BlockIndex
    branches: list[_Branch]  # in binding order
    refused: dict[relax.Var, str]  # conv var -> why it cannot merge at all


def _analyse(mod: tvm.IRModule) -> list[_Candidates]:
    out = []
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or is_primitive(func) or not isinstance(func.body, relax.SeqExpr):
            continue
        facts = None
        for k, block in enumerate(func.body.blocks):
            if not isinstance(block, relax.DataflowBlock):
                continue
            convs = [
                b for b in block.bindings if isinstance(b, relax.VarBinding) and op_name(b.value) == "relax.nn.conv2d"
            ]
            if len(convs) < 1:
                continue
            # a function without num_input (hand-written IR) takes all its parameters as weights
            facts = facts or FunctionFacts.of(func, num_input=0)
            index = _BlockIndex(facts, block)
            cands = _Candidates(gv.name_hint, k, index, [], {})
            if any(isinstance(b, relax.MatchCast) for b in block.bindings):
                for c in convs:
                    cands.refused[c.var] = f"{c.var.name}: its dataflow block has a match_cast (not reordered)"
            else:
                for c in convs:
                    result = index.branch(c)
                    if isinstance(result, str):
                        cands.refused[c.var] = result
                    else:
                        cands.branches.append(result)
            out.append(cands)
    return out


def _auto_groups(cands: _Candidates, report: MergeReport) -> list[list[_Branch]]:
    """Every set of >= 2 compatible branches reading one input, in binding order."""
    inputs: list[relax.Expr] = []  # distinct conv inputs, in order of first use
    branches: dict[int, list[_Branch]] = {}
    unmergeable: dict[int, list[tuple[str, str]]] = {}  # conv name, reason

    def slot(data: relax.Expr) -> int:
        k = next((k for k, d in enumerate(inputs) if d.same_as(data)), None)
        if k is None:
            inputs.append(data)
            k = len(inputs) - 1
        return k

    for b in cands.branches:
        branches.setdefault(slot(b.data), []).append(b)
    for var, reason in cands.refused.items():
        unmergeable.setdefault(slot(cands.index.value[var].args[0]), []).append((var.name, reason))
    groups = []
    for k in range(len(inputs)):
        classes: list[list[_Branch]] = []
        for b in branches.get(k, []):
            home = next((c for c in classes if _difference(c[0], b) is None), None)
            if home is None:
                classes.append([b])
            else:
                home.append(b)
        groups += [c for c in classes if len(c) >= 2]
        if len(branches.get(k, [])) + len(unmergeable.get(k, [])) < 2:
            continue  # a lone conv on this input: nothing was expected to merge
        singles = [c[0] for c in classes if len(c) == 1]
        mergeable = [c for c in classes if len(c) >= 2]
        if mergeable:  # each left-out conv against the first merged group
            for single in singles:
                rep = mergeable[0][0]
                _refuse(report, cands.function, (rep.name, single.name), _difference(rep, single), level=logging.INFO)
        elif len(singles) >= 2:  # nothing merges here: one refusal with the first difference
            names = tuple(b.name for b in singles)
            _refuse(report, cands.function, names, _difference(singles[0], singles[1]), level=logging.INFO)
        for name, reason in unmergeable.get(k, []):
            _refuse(report, cands.function, (name,), reason, level=logging.INFO)
    return groups


def _requested_groups(
    all_cands: list[_Candidates], requested: Sequence[Sequence[str]], report: MergeReport
) -> dict[int, list[list[_Branch]]]:
    """The requested weight-name groups resolved to branches, keyed by candidates index."""
    by_name: dict[str, list[tuple[int, Union[_Branch, str]]]] = {}
    for n, cands in enumerate(all_cands):
        for b in cands.branches:
            for name in b.weight_names:
                by_name.setdefault(name, []).append((n, b))
        for var, reason in cands.refused.items():
            for name in cands.index.param_names(cands.index.value[var].args[1]):
                by_name.setdefault(name, []).append((n, reason))
    out: dict[int, list[list[_Branch]]] = {}
    taken: set[relax.Var] = set()
    for names in requested:
        names = list(names)
        label = tuple(names)
        if len(names) < 2:
            _refuse(report, "", label, f"group {names} has fewer than two weights; nothing to merge")
            continue
        branches: list[_Branch] = []
        where: set[int] = set()
        problem = None
        for name in names:
            found = by_name.get(name, [])
            if not found:
                problem = f"no conv2d reads a weight parameter named {name!r}"
            elif len(found) > 1:
                problem = f"weight {name!r} is read by {len(found)} conv2d calls; the group is ambiguous"
            elif isinstance(found[0][1], str):
                problem = found[0][1]
            elif any(found[0][1] is b for b in branches):
                problem = f"weight {name!r} belongs to conv {found[0][1].name}, already named by the group"
            elif found[0][1].conv in taken:
                problem = f"conv {found[0][1].name} (weight {name!r}) is already in another group"
            if problem is not None:
                break
            where.add(found[0][0])
            branches.append(found[0][1])
        if problem is None and len(where) != 1:
            problem = "the convolutions are in different functions or dataflow blocks"
        if problem is None:
            problem = next((d for d in (_difference(branches[0], b) for b in branches[1:]) if d is not None), None)
        if problem is not None:
            fname = all_cands[next(iter(where))].function if len(where) == 1 else ""
            _refuse(report, fname, label, problem)
            continue
        taken.update(b.conv for b in branches)
        out.setdefault(where.pop(), []).append(branches)
    return out


def _refuse(
    report: MergeReport, function: str, convs: tuple[str, ...], reason: str, *, level: int = logging.WARNING
) -> None:
    report.refused.append(
        Refusal(template="MergeParallelConv2D", kind="horizontal", layers=list(convs), reason=reason, function=function)
    )
    where = f" in {function}" if function else ""
    log.log(level, "MergeParallelConv2D: not merging %s%s: %s", list(convs), where, reason)


@tvm.transform.module_pass(opt_level=0, name="MergeParallelConv2D")
class MergeParallelConv2D:
    """Merge parallel ``conv2d`` calls that read one tensor into one conv2d + split.

    Algebra (see the module docstring for the Relax form and the conditions)::

        W   = concat(W_i, axis=0)   # [sum C_i, C_in, kh, kw]
        b   = concat(b_i)           # [sum C_i], zeros for a branch without bias
        y   = act(conv(x, W) + b)   # [N, sum C_i, H', W']
        y_i = y[:, o_i:o_i+C_i]

    Parameters
    ----------
    groups:
        When given, merge exactly these sets: each inner list holds the weight parameter
        names (``Var.name``) of one group, in output-channel order. A set that cannot be
        merged as a whole is left alone and its reason logged (warning) and reported.
        ``None`` merges every compatible set found.
    cancel_split_concat:
        Afterwards cancel ``concat(split(y))`` pairs in the functions this pass changed.

    After a run, ``self.report`` (a :class:`MergeReport`) lists the merges and refusals.
    """

    def __init__(self, *, groups: Optional[Sequence[Sequence[str]]] = None, cancel_split_concat: bool = True) -> None:
        if groups is not None:
            if isinstance(groups, (str, bytes)) or any(isinstance(g, (str, bytes)) for g in groups):
                raise TypeError(f"groups must be a list of lists of weight names, got {groups!r}")
            groups = [list(g) for g in groups]
        self.groups = groups
        self.cancel_split_concat = cancel_split_concat
        self.report = MergeReport()

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        report = self.report = MergeReport()
        all_cands = _analyse(mod)
        if self.groups is None:
            chosen = {n: _auto_groups(c, report) for n, c in enumerate(all_cands)}
        else:
            chosen = _requested_groups(all_cands, self.groups, report)
        new_blocks: dict[str, dict[int, relax.DataflowBlock]] = {}
        for n, groups in chosen.items():
            if not groups:
                continue
            cands = all_cands[n]
            done = []
            for group in groups:  # each group is checked on its own first: one failure spares the rest
                try:
                    _merged_bindings(group)
                except _MergeError as err:
                    _refuse(report, cands.function, tuple(b.name for b in group), str(err))
                    continue
                done.append(group)
            if not done:
                continue
            try:
                block = _rewrite_block(cands.index, done)
            except _MergeError as err:
                for group in done:
                    _refuse(report, cands.function, tuple(b.name for b in group), str(err))
                continue
            new_blocks.setdefault(cands.function, {})[cands.block] = block
            for group in done:
                merged = _describe(cands.function, group)
                report.merged.append(merged)
                log.info(
                    "MergeParallelConv2D: merged %s in %s (weights %s, channels %s, %s)",
                    list(merged.convs), merged.function, list(merged.weights), list(merged.channels),
                    merged.activation or "no activation",
                )
        if not new_blocks:
            return mod
        mod = mod.clone()
        for fname, blocks in new_blocks.items():
            gv = mod.get_global_var(fname)
            func = mod[gv]
            body = [blocks.get(k, blk) for k, blk in enumerate(func.body.blocks)]
            func = with_blocks(func, body)
            if self.cancel_split_concat:
                func, cancelled = cancel_split_concat(func)
                report.concats_cancelled += cancelled
            if not relax.analysis.check_well_formed(func):
                raise RuntimeError(
                    f"MergeParallelConv2D produced an ill-formed {fname}: this is a bug in tvm_layerfuse; "
                    "run with groups=[] to disable the pass and report the model"
                )
            mod[gv] = func
        return mod


def _describe(function: str, group: Sequence[_Branch]) -> MergedGroup:
    channels, start = [], 0
    for b in group:
        channels.append((start, start + b.channels))
        start += b.channels
    act = group[0].activation
    return MergedGroup(
        function=function,
        convs=tuple(b.name for b in group),
        weights=tuple(b.weight_label for b in group),
        channels=tuple(channels),
        bias=any(b.bias is not None for b in group),
        activation=None if act is None else _activation_name(act),
    )


# --------------------------------------------------------------------------- plan -> groups


def merge_groups_from_plan(plan: FusionPlan, mod: tvm.IRModule) -> list[list[str]]:
    """The plan's horizontal groups as weight parameter names of ``mod``.

    ``plan`` is a :class:`tvm_layerfuse.planner.FusionPlan`; ``mod`` is the Relax module
    imported from the same (materialised) model with ``keep_params_in_input=True``. Each
    group's branches are the convs of the first topology graph (a vertical merge keeps the
    conv's name), so each branch's weight is that conv's second input. The importer names a
    weight parameter after its initializer, minus a leading ``onnx::``.

    Raises ``GraphError`` when a weight has no parameter in ``mod`` (a module imported from
    another model, or without ``keep_params_in_input=True``).
    """
    from ..errors import GraphError

    names = param_names(mod)
    out = []
    for group in plan.groups_of("horizontal"):
        weights = []
        for split in group.details["split"]:
            conv = plan.first.layer(split["branch"])
            if len(conv.inputs) < 2 or not conv.inputs[1]:
                raise GraphError(f"plan group {group.id}: branch {conv.name!r} has no weight input")
            onnx_name = conv.inputs[1]
            found = weight_param(onnx_name, names)
            if found is None:
                raise GraphError(
                    f"plan group {group.id}: weight {onnx_name!r} of conv {conv.name!r} is not a parameter of the "
                    "Relax module; import the materialised model with from_onnx(..., keep_params_in_input=True)"
                )
            weights.append(found)
        out.append(weights)
    return out
