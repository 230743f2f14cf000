"""In-place concat: every producer of a Concat writes straight into the concat's block.

After TVM's ``FuseOps``/``FuseTIR`` a Concat is a kernel that copies its inputs::

    x_1 = call_tir(p_1, a_1, out=[N, C_1, H, W])
    ...
    x_n = call_tir(p_n, a_n, out=[N, C_n, H, W])
    y   = call_tir(concatenate, (x_1, ..., x_n), out=[N, C, H, W])      # C = sum C_i

Algebra. Along the concat axis ``a`` (channels: ``a = 1``)::

    y[.., o_i + c, ..] = x_i[.., c, ..]        o_i = C_1 + ... + C_{i-1},  0 <= c < C_i

so producer ``p_i`` can compute ``x_i`` directly into that slice of ``y``: every store
``x_i[n, c, h, w] = v`` of ``p_i`` becomes ``B[n, c + o_i, h, w] = v`` where ``B`` is
``y``'s storage (see :mod:`._tir`). In flat row-major memory the slice starts at::

    byte_offset_i = o_i * H * W * itemsize                (batch 1, NCHW channel concat)

and is one contiguous run; for batch ``N > 1`` or an inner axis it is a strided view
(``N`` runs of ``C_i * H * W`` elements, ``C * H * W`` apart) and the same index
arithmetic writes it with strides. Nothing is ever copied.

Mechanism (Relax, one dataflow block): ``B`` is threaded through the producers in binding
order. The first producer to run allocates it, later ones update it in place::

    b_1 = call_tir(p_1', a_1, out=[N, C, H, W])                                # writes slot 1
    b_2 = call_tir_inplace(p_2', (a_2..., b_1), inplace_indices=[k], out=[N, C, H, W])
    ...
    y   = b_n                                                                   # no kernel

A kernel that also reads a producer's tensor (``x_i`` read by another layer) reads it
from ``B`` (its load indices shifted by ``o_i``) and takes the current ``b`` as argument;
writes never overlap a region once written, so what it reads is exactly ``x_i``.
``StaticPlanBlockMemory`` then plans ``B`` like any other tensor (it follows the in-place
aliases), so the producers' own buffers and the concat's copy both disappear.

Nested concats (DenseNet as in the ONNX zoo: ``c_k = Concat(c_{k-1}, new_k)``) share one
block: an in-place concat that is itself an input of an in-place concat becomes a *view*
``B[.., o : o + C_k, ..]`` of the outer block (offsets add up), and its own producers write
at the summed offsets. Readers of the inner concat read that region of ``B``.

Prefix concats (DenseNet as torchvision writes it: dense layer ``k`` reads
``p_k = Concat(x_0, x_1, ..., x_{k-1})`` built afresh) share one block as well. When the
arguments of ``p`` are exactly the first arguments of a concat ``q`` that already claims
them, on the same axis::

    p = q[.., 0 : C_p, ..]            C_p = C_0 + ... + C_{k-1}

so ``p`` is a *prefix view*: its kernel disappears and its readers read that region of
``q``'s block (for batch ``N > 1`` a strided region, read with the same index arithmetic).
Every producer writes once, into the block of the chain's largest concat.

``FuseOps`` may fuse nested concats into one kernel (Inception-v3's block E:
``Concat(x, Concat(a, b), Concat(c, d), p)``); that kernel is recognised as one concat of
all the leaves (:func:`._tir.match_concat`), each at the sum of the nested offsets.

A concat stays a normal copy (reason recorded in ``pass.report``, logged) when: an input
is a graph input, a parameter or a constant, or comes from outside the dataflow block;
an input is produced by something other than a plain ``call_tir`` kernel (a reshape
view, an in-place call, an extern); an input is used other than as a kernel argument
(e.g. it is a function output); an input appears twice; an input already writes into
another in-place concat; a kernel touching the tensor uses its buffer other than by
loads, stores and block regions; or the concat kernel is not TOPI's concatenate
(e.g. ``FuseOps`` fused it with an element-wise consumer: then there is no copy to
remove, the consumer reads the pieces itself).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import tvm
from tvm import relax

from ..report import Report
from . import _tir
from .split_outputs import plain_call_tir, rewrite_relax_functions

log = logging.getLogger(__name__)

__all__ = ["InPlaceConcat", "InPlaceReport", "region_layout"]


# ----------------------------------------------------------------------------- report
@dataclass
class InPlaceReport(Report):
    """What :class:`InPlaceConcat` decided on its last run.

    ``concats``: one dict per concat kernel found, in binding order, with ``status`` one of
    ``"in_place"`` (the root of a block), ``"view"`` (a region of another concat's block:
    ``view`` says ``"nested"``, an input of an outer in-place concat, or ``"prefix"``, the
    leading slice of a concat with the same first inputs),
    ``"fallback"`` (kept as a copy; ``reason`` says why); ``block`` the root concat whose
    storage it lives in; ``inputs`` the slots (tensor, producer kernel, range along the axis,
    byte offset in the block or None when strided).
    """

    concats: list[dict] = field(default_factory=list)

    @property
    def in_place(self) -> list[dict]:
        return [c for c in self.concats if c["status"] in ("in_place", "view")]

    @property
    def fallback(self) -> list[dict]:
        return [c for c in self.concats if c["status"] == "fallback"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "in_place": len([c for c in self.concats if c["status"] == "in_place"]),
            "nested_views": len([c for c in self.concats if c["status"] == "view" and c.get("view") != "prefix"]),
            "prefix_views": len([c for c in self.concats if c.get("view") == "prefix"]),
            "fallback": len(self.fallback),
            "concats": list(self.concats),
        }


def region_layout(shape, offsets, block_shape, itemsize: int) -> tuple[Optional[int], bool]:
    """``(byte_offset, contiguous)`` of region ``shape`` at ``offsets`` inside a row-major
    ``block_shape``: the byte offset of its first element, and whether its elements form one
    contiguous run (all axes before the first partial axis have extent 1, and all axes after
    it are complete)."""
    strides = [int(np.prod(block_shape[k + 1 :], dtype=np.int64)) for k in range(len(block_shape))]
    start = int(sum(o * s for o, s in zip(offsets, strides))) * itemsize
    partial = [k for k in range(len(shape)) if shape[k] != block_shape[k]]
    if not partial:
        return start, True
    first, last = partial[0], partial[-1]
    contiguous = first == last and int(np.prod(shape[:first], dtype=np.int64)) == 1
    return start, contiguous


# ----------------------------------------------------------------------------- analysis
@dataclass
class _Use:
    index: int  # binding index in the block
    kind: str  # "arg" (argument of a plain call_tir), "item" (tuple of a TupleGetItem), "other"
    pos: int = -1  # argument position or tuple index


@dataclass
class _Site:
    """A concat kernel call."""

    index: int
    var: relax.Var
    gv: tvm.ir.GlobalVar
    args: list
    kernel: _tir.ConcatKernel


@dataclass
class _Leaf:
    """A kernel output that can be written into a block: output ``field`` of the call bound to ``call_var``."""

    var: relax.Var  # the tensor variable (the concat input)
    call_var: relax.Var  # the variable bound to the producing call (== var, or the tuple)
    field: Optional[int]  # None: single-output call; k: output k of a tuple call
    gv: tvm.ir.GlobalVar

    @property
    def key(self) -> tuple:
        return (self.call_var, self.field)


class _Block:
    """Index of one dataflow block: definitions and uses of its variables."""

    def __init__(self, block: relax.DataflowBlock, escaping: set, mod: tvm.IRModule) -> None:
        self.block = block
        self.mod = mod
        self.defs: dict = {}
        self.uses: dict = {}
        self.escaping = escaping
        for i, b in enumerate(block.bindings):
            self.defs[b.var] = (i, b.value if isinstance(b, relax.VarBinding) else None)
            value = b.value
            call = plain_call_tir(value) if isinstance(b, relax.VarBinding) else None
            if call is not None:
                for pos, a in enumerate(call[1]):
                    if isinstance(a, relax.Var):
                        self._use(a, _Use(i, "arg", pos))
                    else:
                        self._other_uses(a, i)
            elif isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
                self._use(value.tuple_value, _Use(i, "item", int(value.index)))
            else:
                self._other_uses(value, i)

    def _use(self, var, use: _Use) -> None:
        self.uses.setdefault(var, []).append(use)

    def _other_uses(self, expr, i: int) -> None:
        def visit(e):
            if isinstance(e, relax.Var):
                self._use(e, _Use(i, "other"))

        relax.analysis.post_order_visit(expr, visit)

    def leaf(self, x) -> Union[_Leaf, str]:
        """``x`` as a kernel output that can move into a block, or the reason it cannot."""
        if isinstance(x, (tvm.ir.Constant, tvm.ir.GenericConst)):
            return "is a constant"
        if not isinstance(x, relax.Var):
            return f"is a {type(x).__name__}, not a variable"
        name = x.name
        if x not in self.defs:
            return (
                f"{name} is a graph input or parameter (or defined outside the dataflow block); "
                "only kernel outputs can be written in place"
            )
        if not isinstance(x, relax.DataflowVar) or x in self.escaping:
            return f"{name} is also an output of the dataflow block and needs storage of its own"
        _, value = self.defs[x]
        call = plain_call_tir(value)
        if call is not None:
            gv, args = call
            func = self.mod[gv]
            if not isinstance(func, tvm.tirx.PrimFunc) or len(func.params) != len(args) + 1:
                return f"{name} comes from {gv.name_hint}, which does not have exactly one output"
            leaf = _Leaf(var=x, call_var=x, field=None, gv=gv)
        elif isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.DataflowVar):
            t = value.tuple_value
            call = plain_call_tir(self.defs.get(t, (None, None))[1])
            if call is None:
                return f"{name} is an item of {t.name}, which is not a kernel call"
            func = self.mod[call[0]]
            n_out = len(t.ty.fields) if isinstance(t.ty, relax.TupleType) else -1
            if not isinstance(func, tvm.tirx.PrimFunc) or len(func.params) != len(call[1]) + n_out:
                return f"{t.name} (the kernel writing {name}) does not have one parameter per output"
            items = self.uses.get(t, [])
            if any(u.kind != "item" for u in items) or len({u.pos for u in items}) != len(items):
                return f"{t.name} (the kernel writing {name}) is used other than by one item access per output"
            leaf = _Leaf(var=x, call_var=t, field=int(value.index), gv=call[0])
        else:
            what = value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else type(value).__name__
            return f"{name} is produced by {what}, not by a TIR kernel"
        bad = [u for u in self.uses.get(x, []) if u.kind != "arg"]
        if bad:
            user = self.block.bindings[bad[0].index].value
            what = user.op.name if isinstance(user, relax.Call) and isinstance(user.op, tvm.ir.Op) else type(user).__name__
            hint = " (a graph output?)" if isinstance(user, relax.Tuple) else ""
            return f"{name} is also used by a {what}{hint} (binding {bad[0].index}), not only as a kernel argument"
        reason = _tir.check_retargetable(self.mod[leaf.gv], self.out_param(leaf))
        if reason:
            return f"producer {leaf.gv.name_hint} of {name}: {reason}"
        for u in self.uses.get(x, []):
            reason = self.reader_reason(u)
            if reason:
                return f"a reader of {name}: {reason}"
        return leaf

    def out_param(self, leaf: _Leaf):
        _, value = self.defs[leaf.call_var]
        gv, args = plain_call_tir(value)
        params = self.mod[gv].params
        return params[len(args) + (leaf.field or 0)]

    def reader_reason(self, use: _Use) -> Optional[str]:
        gv, args = plain_call_tir(self.block.bindings[use.index].value)
        func = self.mod[gv]
        if not isinstance(func, tvm.tirx.PrimFunc):
            return f"{gv.name_hint} is not a PrimFunc"
        return _tir.check_retargetable(func, func.params[use.pos])


# ----------------------------------------------------------------------------- the pass
@tvm.transform.module_pass(opt_level=0, name="InPlaceConcat")
class InPlaceConcat:
    """Make concat kernels disappear: producers write into the concat's block (module doc).

    Parameters
    ----------
    prefix:
        Let a concat whose inputs are the leading inputs of another in-place concat become a
        view of that one's block (torchvision's DenseNet). ``False`` leaves it a copy.
    nested:
        Let an in-place concat that feeds another in-place concat become a view of the
        outer block (DenseNet). ``False`` gives each concat its own block; the inner concat
        then stays a kernel whose output is written into the outer block.

    Run it after ``FuseTIR`` (and after :class:`.split_outputs.SplitOutputBuffers`), before
    any TIR schedule (dlight) and before ``StaticPlanBlockMemory``. After a run,
    ``self.report`` (an :class:`InPlaceReport`) says what happened to every concat.
    """

    def __init__(self, *, nested: bool = True, prefix: bool = True) -> None:
        self.nested = nested
        self.prefix = prefix
        self.report = InPlaceReport()

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = InPlaceReport()
        return rewrite_relax_functions(mod, self._rewrite_function, undo=self._undo)

    def _undo(self, reason: str) -> None:
        for entry in self.report.concats:
            if entry["status"] != "fallback":
                entry.update(status="fallback", reason=reason)
        log.warning("InPlaceConcat: the rewritten module is not well formed; every concat left as a copy")

    # ------------------------------------------------------------------
    def _rewrite_function(self, name, func, mod, bb, replaced) -> Optional[relax.Function]:
        blocks = list(func.body.blocks)
        changed = False
        for k, block in enumerate(blocks):
            if not isinstance(block, relax.DataflowBlock):
                continue
            escaping = _escaping(func, k)
            index = _Block(block, escaping, mod)
            plan = self._decide(name, index, k)
            if plan is None:
                continue
            try:
                new_block = _Rewriter(index, plan, bb, replaced).run()
            except _RewriteError as err:  # keep every concat of this block as it was
                for entry in self.report.concats:
                    if entry["function"] == name and entry["status"] != "fallback" and entry.get("_block") == k:
                        entry.update(status="fallback", reason=f"internal rewrite refused: {err}")
                log.warning("InPlaceConcat: block %d of %s left unchanged: %s", k, name, err)
                continue
            blocks[k] = new_block
            replaced.update(site.gv for site in plan.sites if plan.status[site.var] != "fallback")
            changed = True
        for entry in self.report.concats:
            entry.pop("_block", None)
        if not changed:
            return None
        body = relax.SeqExpr(blocks, func.body.body, func.body.span)
        new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
        return bb.normalize(new)

    @staticmethod
    def _view_reason(site: "_Site", index: "_Block", outer) -> Optional[str]:
        """Why concat ``site`` cannot be read as a region of a block, or None."""
        var = site.var
        if outer is not None:
            return f"its output is also written into concat {outer.name}"
        if not isinstance(var, relax.DataflowVar) or var in index.escaping:
            return f"its output {var.name} is an output of the dataflow block and needs storage of its own"
        for u in index.uses.get(var, []):
            if u.kind != "arg":
                if isinstance(index.block.bindings[u.index].value, relax.Tuple):
                    return f"its output {var.name} is a graph output (binding {u.index}) and needs storage of its own"
                return f"its output {var.name} is used other than as a kernel argument (binding {u.index})"
            reason = index.reader_reason(u)
            if reason:
                return f"a reader of {var.name}: {reason}"
        return None

    def _decide(self, name: str, index: _Block, block_index: int) -> Optional["_Plan"]:
        sites: list[_Site] = []
        for i, b in enumerate(index.block.bindings):
            call = plain_call_tir(b.value) if isinstance(b, relax.VarBinding) else None
            if call is None:
                continue
            gv, args = call
            func = index.mod[gv]
            kernel = _tir.match_concat(func)
            if isinstance(kernel, str):
                if "concat" in gv.name_hint:
                    log.info("InPlaceConcat: %s (%s) is not a plain concatenate: %s", b.var.name, gv.name_hint, kernel)
                continue
            if len(args) != len(kernel.in_shapes) or not isinstance(b.var.ty, relax.TensorType):
                continue
            sites.append(_Site(index=i, var=b.var, gv=gv, args=args, kernel=kernel))
        if not sites:
            return None
        by_var = {s.var: s for s in sites}
        status: dict = {}
        reason: dict = {}
        claimed: dict = {}  # leaf key -> the concat that writes it
        leaves: dict = {}  # site var -> [leaf per input]
        prefix_of: dict = {}  # site var -> the concat whose leading slice it is
        for site in reversed(sites):  # outer (later) concats first: they decide the blocks
            why = None
            found = []
            outer = claimed.get((site.var, None))
            if outer is not None and not self.nested:
                why = f"its output is written into concat {outer.name} (nesting disabled)"
            elif any(a.same_as(b) for j, a in enumerate(site.args) for b in site.args[j + 1 :]):
                why = "an input appears twice; one tensor cannot live at two offsets"
            owner = _prefix_owner(site, index, claimed, by_var) if why is None and self.prefix else None
            if owner is not None:  # a prefix of a concat that already plans the block
                why = self._view_reason(site, index, outer)
                if why is None:
                    prefix_of[site.var] = owner
                    status[site.var] = "view"
                    continue
                why = f"a prefix of concat {owner.name} (whose block its inputs write into), but {why}"
            for a in site.args if why is None else []:
                leaf = index.leaf(a)
                if isinstance(leaf, str):
                    why = f"input {leaf}"
                    break
                if leaf.key in claimed:
                    why = f"input {a.name} already writes into concat {claimed[leaf.key].name}"
                    break
                found.append(leaf)
            if why is not None:
                status[site.var], reason[site.var] = "fallback", why
                continue
            for leaf in found:
                claimed[leaf.key] = site.var
            leaves[site.var] = found
            status[site.var] = "in_place"
        # nesting: an in-place concat whose output an in-place concat claimed is a view
        parent: dict = {}
        if self.nested:
            for site in sites:
                if status[site.var] != "in_place":
                    continue
                for leaf in leaves[site.var]:
                    inner = by_var.get(leaf.var)
                    if inner is not None and status.get(inner.var) == "in_place" and leaf.field is None:
                        parent[inner.var] = site.var
                        status[inner.var] = "view"
        parent.update(prefix_of)  # an owner claimed its leaves, so it is in place (or a nested view)
        plan = _Plan(sites=sites, by_var=by_var, status=status, leaves=leaves, parent=parent, prefix_of=prefix_of)
        plan.place()
        for site in sites:
            entry = {
                "function": name,
                "concat": site.var.name,
                "kernel": site.gv.name_hint,
                "axis": site.kernel.axis,
                "shape": list(site.kernel.out_shape),
                "dtype": site.kernel.dtype,
                "status": status[site.var],
                "view": ("prefix" if site.var in prefix_of else "nested") if status[site.var] == "view" else None,
                "block": plan.root_of(site.var).name if status[site.var] != "fallback" else None,
                "reason": reason.get(site.var),
                "inputs": plan.describe_inputs(site, index),
                "_block": block_index,
            }
            self.report.concats.append(entry)
            if status[site.var] == "fallback":
                log.info("InPlaceConcat: %s stays a copy: %s", site.var.name, reason[site.var])
            else:
                log.info(
                    "InPlaceConcat: %s %s (block %s, axis %d)",
                    site.var.name, "in place" if status[site.var] == "in_place" else "is a view", entry["block"], site.kernel.axis,
                )
        if not any(s != "fallback" for s in status.values()):
            return None
        return plan


def _prefix_owner(site: "_Site", index: "_Block", claimed: dict, by_var: dict):
    """The concat whose leading inputs are exactly ``site``'s and already claim them (so
    ``site`` is its slice ``[0 : C_site)`` along the same axis), or None."""
    owners = set()
    for a in site.args:
        leaf = index.leaf(a) if isinstance(a, relax.Var) else None
        if not isinstance(leaf, _Leaf) or leaf.key not in claimed:
            return None
        owners.add(claimed[leaf.key])
    if len(owners) != 1:
        return None
    owner = by_var[owners.pop()]
    n = len(site.args)
    same = all(a.same_as(b) for a, b in zip(site.args, owner.args[:n]))
    if not same or n > len(owner.args):
        return None
    if n > 1 and owner.kernel.axis != site.kernel.axis:  # a one-input concat is a plain copy: any axis
        return None
    if tuple(site.kernel.starts) != tuple(owner.kernel.starts[:n]):
        return None
    return owner.var


def _escaping(func: relax.Function, k: int) -> set:
    """Variables of block ``k`` used after it (later blocks, the function result)."""
    out: set = set()

    def visit(e):
        if isinstance(e, relax.Var):
            out.add(e)

    for block in list(func.body.blocks)[k + 1 :]:
        for b in block.bindings:
            relax.analysis.post_order_visit(b.value, visit)
    relax.analysis.post_order_visit(func.body.body, visit)
    return out


@dataclass
class _Plan:
    """Which concats are in place, and where every placed tensor lives."""

    sites: list
    by_var: dict
    status: dict
    leaves: dict
    parent: dict
    prefix_of: dict = field(default_factory=dict)  # prefix view var -> the concat it is a slice of
    blocks: dict = field(default_factory=dict)  # root var -> (shape, dtype)
    region_of: dict = field(default_factory=dict)  # placed var (leaf or view) -> (root var, offsets)
    writes: dict = field(default_factory=dict)  # leaf key -> (root var, offsets)

    def root_of(self, var):
        while var in self.parent:
            var = self.parent[var]
        return var

    def place(self) -> None:
        for site in self.sites:
            if self.status[site.var] == "in_place":
                self.blocks[site.var] = (tuple(site.kernel.out_shape), site.kernel.dtype)
                self._place(site, site.var, (0,) * len(site.kernel.out_shape))
        for view, owner in self.prefix_of.items():
            if self.status.get(view) != "view":
                continue
            # the slice [0 : C_view) of the owner: the owner's own region (or its block, at 0)
            self.region_of[view] = self.region_of.get(owner, (owner, (0,) * len(self.blocks[owner][0])))

    def _place(self, site: _Site, root, base: tuple) -> None:
        for leaf, start in zip(self.leaves[site.var], site.kernel.starts):
            off = tuple(b + s for b, s in zip(base, start))  # offsets compose by addition
            self.region_of[leaf.var] = (root, off)
            inner = self.by_var.get(leaf.var)
            if inner is not None and self.parent.get(inner.var) is site.var:
                self._place(inner, root, off)
            else:
                self.writes[leaf.key] = (root, off)

    def describe_inputs(self, site: _Site, index: _Block) -> list[dict]:
        out = []
        itemsize = np.dtype(site.kernel.dtype).itemsize
        for a, o, shape in zip(site.args, site.kernel.offsets, site.kernel.in_shapes):
            entry = {
                "tensor": a.name if isinstance(a, relax.Var) else str(type(a).__name__),
                "producer": _producer_name(a, index),
                "range": [o, o + shape[site.kernel.axis]],
                "shape": list(shape),
                "byte_offset": None,
                "contiguous": None,
            }
            placed = self.region_of.get(a)
            if placed is not None and self.status[site.var] != "fallback":
                root, off = placed
                bshape, _ = self.blocks[root]
                entry["byte_offset"], entry["contiguous"] = region_layout(shape, off, bshape, itemsize)
                entry["offsets"] = list(off)
            out.append(entry)
        return out


def _producer_name(a, index: _Block) -> Optional[str]:
    if not isinstance(a, relax.Var) or a not in index.defs:
        return None
    value = index.defs[a][1]
    if isinstance(value, relax.TupleGetItem) and value.tuple_value in index.defs:
        value = index.defs[value.tuple_value][1]
    call = plain_call_tir(value)
    return call[0].name_hint if call else None


# ----------------------------------------------------------------------------- rewrite
class _RewriteError(Exception):
    """The block cannot be rewritten as planned (nothing is changed)."""


class _Rewriter:
    """Emit the new bindings of one block, threading each block's current value."""

    def __init__(self, index: _Block, plan: _Plan, bb: relax.BlockBuilder, replaced: set) -> None:
        self.index = index
        self.plan = plan
        self.bb = bb
        self.replaced = replaced
        self.cur: dict = {}  # root var -> the variable holding the block now
        self.items: dict = {}  # (old tuple var, k) -> new expression for t[k]
        self.bindings: list = []
        self.placed_calls = {key[0] for key in plan.writes}

    def run(self) -> relax.DataflowBlock:
        for i, b in enumerate(self.index.block.bindings):
            self._binding(i, b)
        missing = [r.name for r in self.plan.blocks if r not in self.cur]
        if missing:
            raise _RewriteError(f"blocks {missing} were never written")
        return relax.DataflowBlock(self.bindings, self.index.block.span)

    def _emit(self, var, value) -> None:
        self.bindings.append(relax.VarBinding(var, value))

    def _binding(self, i: int, b) -> None:
        plan = self.plan
        if not isinstance(b, relax.VarBinding):
            self.bindings.append(b)
            return
        var, value = b.var, b.value
        status = plan.status.get(var)
        if status == "view":
            return  # a region of its root block: readers read that region
        if status == "in_place":
            if var not in self.cur:
                raise _RewriteError(f"concat {var.name} reached before any of its producers")
            self._emit(var, self.cur[var])  # y = b_n (the block itself)
            return
        if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
            key = (value.tuple_value, int(value.index))
            if key in plan.writes:
                return  # now a region of a block
            if key in self.items:
                self._emit(var, self.items[key])
                return
            self.bindings.append(b)
            return
        call = plain_call_tir(value)
        if call is None:
            self._check_untouched(value)
            self.bindings.append(b)
            return
        gv, args = call
        is_tuple = isinstance(var.ty, relax.TupleType)
        n_out = len(var.ty.fields) if is_tuple else 1
        out_keys = [(var, k if is_tuple else None) for k in range(n_out)]
        reads = [k for k, a in enumerate(args) if isinstance(a, relax.Var) and a in plan.region_of]
        writes = [k for k, key in enumerate(out_keys) if key in plan.writes]
        if not reads and not writes:
            self.bindings.append(b)
            return
        self._rewrite_call(var, gv, args, is_tuple, out_keys, reads, writes)

    def _check_untouched(self, value) -> None:
        bad = []

        def visit(e):
            if isinstance(e, relax.Var) and (e in self.plan.region_of or e in self.placed_calls):
                bad.append(e.name)

        relax.analysis.post_order_visit(value, visit)
        if bad:
            raise _RewriteError(f"{bad[0]} is used by an expression that is not a kernel call")

    def _rewrite_call(self, var, gv, args, is_tuple, out_keys, reads, writes) -> None:
        plan = self.plan
        func = self.index.mod[gv]
        params = list(func.params)
        n_in = len(args)
        touched: list = []  # root vars in order of first appearance
        new_param: dict = {}

        def block_param(root):
            if root not in new_param:
                shape, dtype = plan.blocks[root]
                new_param[root] = _tir.new_buffer(shape, dtype, f"{root.name}_block")
                touched.append(root)
            return new_param[root]

        remap = {}
        for k in reads:
            root, off = plan.region_of[args[k]]
            if root not in self.cur:
                raise _RewriteError(f"{args[k].name} is read before its block exists")
            remap[params[k]] = _tir.Region(block_param(root), off)
        written: list = []
        for k in writes:
            root, off = plan.writes[out_keys[k]]
            remap[params[n_in + k]] = _tir.Region(block_param(root), off)
            if root not in written:
                written.append(root)
        existing = [r for r in touched if r in self.cur]
        fresh = [r for r in written if r not in self.cur]
        kept_in = [k for k in range(n_in) if k not in reads]
        kept_out = [k for k in range(len(out_keys)) if k not in writes]
        new_params = (
            [params[k] for k in kept_in]
            + [new_param[r] for r in existing]
            + [new_param[r] for r in fresh]
            + [params[n_in + k] for k in kept_out]
        )
        try:
            new_func = _tir.retarget(func, remap, new_params)
        except ValueError as err:
            raise _RewriteError(f"{gv.name_hint}: {err}") from err
        new_gv = self.bb.add_func(new_func, f"{gv.name_hint}_inplace")
        self.replaced.add(gv)
        new_args = [args[k] for k in kept_in] + [self.cur[r] for r in existing]
        out_roots = written  # written blocks first, then the outputs that stay
        out_types = [relax.TensorType(list(plan.blocks[r][0]), plan.blocks[r][1]) for r in out_roots]
        old_types = list(var.ty.fields) if is_tuple else [var.ty]
        out_types += [old_types[k] for k in kept_out]
        # existing blocks sit after the kept inputs, in `existing` order
        inplace = [len(kept_in) + existing.index(r) if r in self.cur else -1 for r in out_roots] + [-1] * len(kept_out)
        single = len(out_types) == 1
        if any(ix >= 0 for ix in inplace):
            call = relax.op.call_tir_inplace(
                new_gv, relax.Tuple(new_args), inplace if not single else inplace[0], out_types if not single else out_types[0]
            )
        else:
            call = relax.op.call_tir(new_gv, relax.Tuple(new_args), out_types if not single else out_types[0])
        call = self.bb.normalize(call)
        if not writes:
            self._emit(var, call)  # a reader: same outputs, same variable
            return
        result = relax.DataflowVar(f"{var.name}_w", call.ty)
        self._emit(result, call)
        for j, root in enumerate(out_roots):
            if single:
                self.cur[root] = result
            else:
                item = relax.DataflowVar(f"{root.name}_b", out_types[j])
                self._emit(item, self.bb.normalize(relax.TupleGetItem(result, j)))
                self.cur[root] = item
        for j, k in enumerate(kept_out):
            if not is_tuple:
                raise _RewriteError(f"{var.name}: a single output both written and kept")
            self.items[(var, k)] = result if single else self.bb.normalize(relax.TupleGetItem(result, len(out_roots) + j))
