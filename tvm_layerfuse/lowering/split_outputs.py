"""Split-output buffers: a producer followed by a ``split`` kernel writes the pieces itself.

After the horizontal merge (:mod:`tvm_layerfuse.relax.horizontal`) and TVM's
``FuseOps``/``FuseTIR``, a merged convolution is one kernel writing
``y: [N, sum C_i, H, W]`` and a second kernel copies it into the branches' tensors::

    y     = call_tir(f,     args,  out=[N, sum C_i, H, W])
    parts = call_tir(split, (y,),  out=[[N, C_1, H, W], ..., [N, C_n, H, W]])

Algebra: ``parts[i] = y[:, o_i : o_i + C_i]`` with ``o_i = C_1 + ... + C_{i-1}`` (any axis
``a`` in general). This pass partitions the loop nest of ``f`` that writes ``y`` along
``a`` into one copy per range ``[o_i, o_i + C_i)``; copy ``i`` iterates ``c' in [0, C_i)``,
computes exactly what ``f`` computed at ``c = c' + o_i`` and stores it at
``parts_i[.., c', ..]``::

    parts = call_tir(f', args, out=[[N, C_1, H, W], ..., [N, C_n, H, W]])   # no split kernel

Every element is computed once, as before; the copy ``y -> parts`` and the buffer ``y``
disappear. A later pass (:mod:`.inplace_concat`) may then move a piece into a concat's block.

Conditions (each refusal is logged and recorded in ``pass.report``): the split kernel is
TOPI's split (recognised structurally, :func:`._tir.match_split`); ``y`` is a dataflow
variable bound to a ``call_tir`` in the same block and the split is its only reader;
``f``'s output ``y`` is written by exactly one perfect loop nest whose stores are at the
block's iter vars (the form ``FuseTIR`` produces before any schedule). Anything else
keeps its split kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import tvm
from tvm import relax

from ..relax._ir import is_primitive, op_name
from ..report import Report
from . import _tir

log = logging.getLogger(__name__)

__all__ = ["SplitOutputBuffers", "SplitReport"]

_CALL_TIR = "relax.call_tir"


@dataclass
class SplitReport(Report):
    """What :class:`SplitOutputBuffers` did on its last run."""

    rewritten: list[dict] = field(default_factory=list)  # {"function", "producer", "split", "parts"}
    refused: list[dict] = field(default_factory=list)  # {"function", "split", "reason"}


def plain_call_tir(expr) -> Optional[tuple[tvm.ir.GlobalVar, list]]:
    """``(gv, args)`` of ``call_tir(gv, (args...))`` with a literal argument tuple, no TIR vars."""
    if op_name(expr) != _CALL_TIR or len(expr.args) != 2:
        return None
    gv, args = expr.args
    if not isinstance(gv, tvm.ir.GlobalVar) or not isinstance(args, relax.Tuple):
        return None
    return gv, list(args.fields)


def var_uses(func: relax.Function) -> dict:
    """Number of occurrences of each Var in ``func``'s bindings and result (not definitions)."""
    counts: dict = {}

    def visit(e):
        if isinstance(e, relax.Var):
            counts[e] = counts.get(e, 0) + 1

    for block in func.body.blocks:
        for b in block.bindings:
            relax.analysis.post_order_visit(b.value, visit)
    relax.analysis.post_order_visit(func.body.body, visit)
    return counts


def rewrite_relax_functions(mod: tvm.IRModule, rewrite, *, undo: Callable[[str], None]) -> tvm.IRModule:
    """Apply ``rewrite(name, func, mod, bb, replaced)`` to every non-primitive Relax function
    of ``mod``; ``rewrite`` returns the new function or None, and adds to ``replaced`` the
    PrimFuncs it made unused. Returns the new module without those PrimFuncs, or ``mod``
    itself when nothing changed or when the new module is not well formed: a broken module
    is never handed on, everything is undone and ``undo(reason)`` records that in the pass's
    report."""
    bb = relax.BlockBuilder(mod)
    replaced: set = set()
    changed = False
    for gv, func in list(mod.functions_items()):
        if not isinstance(func, relax.Function) or is_primitive(func) or not isinstance(func.body, relax.SeqExpr):
            continue
        new = rewrite(gv.name_hint, func, mod, bb, replaced)
        if new is not None:
            bb.update_func(gv, new)
            changed = True
    if not changed:
        return mod
    out = drop_unused_prim_funcs(bb.get(), replaced)
    if not relax.analysis.check_well_formed(out):
        undo("internal: the rewritten module was not well formed")
        return mod
    return out


@tvm.transform.module_pass(opt_level=0, name="SplitOutputBuffers")
class SplitOutputBuffers:
    """Let the producer of a split write the pieces (see the module docstring).

    Run it after ``FuseTIR`` and before any TIR schedule (dlight) and memory planning.
    ``self.report`` (a :class:`SplitReport`) lists what was rewritten and what was refused.
    """

    def __init__(self) -> None:
        self.report = SplitReport()

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = SplitReport()
        return rewrite_relax_functions(mod, self._rewrite_function, undo=self._undo)

    def _undo(self, reason: str) -> None:
        for entry in self.report.rewritten:
            self.report.refused.append({"function": entry["function"], "split": entry["split"], "reason": reason})
        self.report.rewritten = []
        log.warning("SplitOutputBuffers: the rewritten module is not well formed; every split kept")

    # ------------------------------------------------------------------
    def _rewrite_function(self, name, func, mod, bb, replaced) -> Optional[relax.Function]:
        uses = var_uses(func)
        blocks = []
        changed = False
        for block in func.body.blocks:
            if isinstance(block, relax.DataflowBlock):
                new = self._rewrite_block(name, block, uses, mod, bb, replaced)
                if new is not None:
                    block, changed = new, True
            blocks.append(block)
        if not changed:
            return None
        body = relax.SeqExpr(blocks, func.body.body, func.body.span)
        new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
        return bb.normalize(new)

    def _rewrite_block(self, name, block, uses, mod, bb, replaced) -> Optional[relax.DataflowBlock]:
        bound = {b.var: (i, b.value) for i, b in enumerate(block.bindings) if isinstance(b, relax.VarBinding)}
        drop: set = set()
        new_values: dict = {}
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                continue
            call = plain_call_tir(binding.value)
            if call is None:
                continue
            split_gv, split_args = call
            split = _tir.match_split(mod[split_gv])
            if isinstance(split, str):
                continue  # not a split kernel: nothing to say
            result = self._rewrite_one(name, binding, split_gv, split_args, split, bound, uses, mod, bb)
            if isinstance(result, str):
                self.report.refused.append({"function": name, "split": binding.var.name, "reason": result})
                log.info("SplitOutputBuffers: %s keeps its split kernel: %s", binding.var.name, result)
                continue
            producer_var, new_value, producer_gv = result
            drop.add(producer_var)
            new_values[binding.var] = new_value
            replaced.update({split_gv, producer_gv})
        if not new_values:
            return None
        bindings = []
        for b in block.bindings:
            if b.var in drop:
                continue
            if b.var in new_values:
                b = relax.VarBinding(b.var, new_values[b.var], b.span)
            bindings.append(b)
        return relax.DataflowBlock(bindings, block.span)

    def _rewrite_one(self, name, binding, split_gv, split_args, split, bound, uses, mod, bb):
        (y,) = split_args if len(split_args) == 1 else (None,)
        if not isinstance(y, relax.DataflowVar):
            return "the split does not read one dataflow variable"
        if y not in bound:
            return f"{y.name} is not bound in this dataflow block"
        if uses.get(y, 0) != 1:
            return f"{y.name} is also read elsewhere ({uses.get(y, 0)} uses); its full value must stay"
        call = plain_call_tir(bound[y][1])
        if call is None:
            return f"{y.name} is not produced by a plain call_tir"
        f_gv, f_args = call
        func = mod[f_gv]
        if not isinstance(func, tvm.tirx.PrimFunc) or len(func.params) != len(f_args) + 1:
            return f"producer {f_gv.name_hint} of {y.name} does not have exactly one output"
        out = func.params[-1]
        if _tir.buffer_shape(out) != list(split.in_shape):
            return f"producer {f_gv.name_hint} writes a shape other than the split's input"
        nest = _tir.check_partitionable(func, out, split.axis)
        if isinstance(nest, str):
            return f"producer {f_gv.name_hint}: {nest}"
        parts = [_tir.new_buffer(s, split.dtype, f"{out.name}_part{k}") for k, s in enumerate(split.out_shapes)]
        zero = (0,) * len(split.in_shape)
        pieces = [
            _tir.Piece(o, o + s[split.axis], _tir.Region(p, zero))
            for o, s, p in zip(split.offsets, split.out_shapes, parts)
        ]
        try:
            new_func = _tir.partition(func, out, split.axis, pieces, list(func.params[:-1]) + parts, nest=nest)
        except ValueError as err:
            return f"producer {f_gv.name_hint}: {err}"
        new_gv = bb.add_func(new_func, f"{f_gv.name_hint}_split")
        out_types = [relax.TensorType(list(s), split.dtype) for s in split.out_shapes]
        value = bb.normalize(relax.op.call_tir(new_gv, relax.Tuple(f_args), out_types))
        self.report.rewritten.append(
            {
                "function": name,
                "producer": f_gv.name_hint,
                "split": split_gv.name_hint,
                "kernel": new_gv.name_hint,
                "axis": split.axis,
                "parts": [list(s) for s in split.out_shapes],
            }
        )
        log.info(
            "SplitOutputBuffers: %s now writes the %d pieces of %s (axis %d); split kernel %s removed",
            new_gv.name_hint, len(parts), y.name, split.axis, split_gv.name_hint,
        )
        return y, value, f_gv


def drop_unused_prim_funcs(mod: tvm.IRModule, candidates) -> tvm.IRModule:
    """``mod`` without those ``candidates`` (GlobalVars of PrimFuncs) that nothing calls anymore."""
    called: set = set()

    def visit(e):
        if isinstance(e, tvm.ir.GlobalVar):
            called.add(e.name_hint)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    dead = [
        gv
        for gv in mod.get_global_vars()
        if gv.name_hint not in called and any(gv.same_as(c) or gv.name_hint == c.name_hint for c in candidates)
    ]
    if not dead:
        return mod
    keep = {gv: f for gv, f in mod.functions_items() if not any(gv.same_as(d) for d in dead)}
    return tvm.IRModule(keep, attrs=mod.attrs, global_infos=mod.global_infos)
