"""Cancel a concat of all the pieces of a split: ``concat(split(y, axis=a)) -> y``.

Algebra, for ``parts = split(y, [o_2, ..., o_n], axis=a)`` (``y`` cut into ``n`` consecutive
slices along ``a``)::

    concat([..., parts[0], parts[1], ..., parts[n-1], ...], axis=a)
        == concat([..., y, ...], axis=a)             # the pieces, in order, are y itself
    concat([parts[0], ..., parts[n-1]], axis=a) == y  # whole concat: no copy at all

It fires only when *every* piece of the split appears, consecutively and in split order, in
the concat's operand list and both ops use the same axis; any other arrangement is left
alone (a partial run would trade one copy for another). The horizontal merge
(:mod:`tvm_layerfuse.relax.horizontal`) produces exactly this shape when the merged
branches feed an Inception-style concat in channel order; this pass is generic and can run
on its own inside a user's pipeline.

After the rewrite the split and its ``TupleGetItem`` bindings are removed when nothing else
reads them (dataflow blocks are pure, so removing unused dataflow bindings changes nothing).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import tvm
from tvm import relax

from ._ir import is_primitive, op_name, with_functions

log = logging.getLogger(__name__)

__all__ = ["CancelSplitConcat", "cancel_split_concat", "remove_unused_dataflow_bindings", "with_blocks"]


def _normal_axis(axis: int, ndim: int) -> Optional[int]:
    if ndim < 0:
        return None
    return axis + ndim if axis < 0 else axis


def remove_unused_dataflow_bindings(
    block: relax.DataflowBlock, *, candidates: Optional[Iterable[relax.Var]] = None
) -> relax.DataflowBlock:
    """``block`` without the dataflow-variable bindings nothing reads (repeated to a fixpoint).

    With ``candidates``, only those variables, and the ones that only they read, may go:
    a rewrite removes what it made dead and leaves the rest of the block alone.
    Non-dataflow variables are the block's outputs and are always kept.
    """
    bindings = list(block.bindings)
    removable = None if candidates is None else set(candidates)
    while True:
        used: set[relax.Var] = set()
        for b in bindings:
            used.update(relax.analysis.free_vars(b.value))
        dead = [
            b
            for b in bindings
            if isinstance(b.var, relax.DataflowVar)
            and not isinstance(b, relax.MatchCast)  # a match_cast is also a run-time check
            and b.var not in used
            and (removable is None or b.var in removable)
        ]
        if not dead:
            break
        gone = {b.var for b in dead}
        if removable is not None:
            for b in dead:
                removable.update(relax.analysis.free_vars(b.value))
        bindings = [b for b in bindings if b.var not in gone]
    if len(bindings) == len(block.bindings):
        return block
    return relax.DataflowBlock(bindings, block.span)


def _split_piece(var: relax.Expr, value: dict[relax.Var, relax.Expr]) -> Optional[tuple[relax.Var, int]]:
    """``(split_var, k)`` when ``var`` is bound to ``split_var[k]`` and ``split_var`` to a split."""
    if not isinstance(var, relax.Var):
        return None
    item = value.get(var)
    if not isinstance(item, relax.TupleGetItem) or not isinstance(item.tuple_value, relax.Var):
        return None
    if op_name(value.get(item.tuple_value)) != "relax.split":
        return None
    return item.tuple_value, int(item.index)


def _cancel_in_block(block: relax.DataflowBlock) -> tuple[relax.DataflowBlock, int]:
    value = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
    bindings = []
    cancelled = 0
    maybe_dead: set[relax.Var] = set()
    for binding in block.bindings:
        new_value = None
        if isinstance(binding, relax.VarBinding) and op_name(binding.value) == "relax.concat":
            new_value, n = _cancel_in_concat(binding, value)
            cancelled += n
        if new_value is None:
            bindings.append(binding)
        else:
            maybe_dead.update(relax.analysis.free_vars(binding.value))  # the pieces (and the split)
            bindings.append(relax.VarBinding(binding.var, new_value, binding.span))
    if not cancelled:
        return block, 0
    new_block = relax.DataflowBlock(bindings, block.span)
    return remove_unused_dataflow_bindings(new_block, candidates=maybe_dead), cancelled


def _cancel_in_concat(
    binding: relax.VarBinding, value: dict[relax.Var, relax.Expr]
) -> tuple[Optional[relax.Expr], int]:
    concat = binding.value
    operands = concat.args[0]
    if isinstance(operands, relax.Var):
        operands = value.get(operands)
    if not isinstance(operands, relax.Tuple) or concat.attrs.axis is None:
        return None, 0
    ndim = getattr(binding.var.ty, "ndim", -1)
    axis = _normal_axis(int(concat.attrs.axis), ndim)
    if axis is None:
        return None, 0
    fields = list(operands.fields)
    out: list[relax.Expr] = []
    cancelled = 0
    j = 0
    while j < len(fields):
        piece = _split_piece(fields[j], value)
        if piece is not None and piece[1] == 0:
            split_var = piece[0]
            split = value[split_var]
            n = len(split_var.ty.fields)
            same_axis = _normal_axis(int(split.attrs.axis), getattr(split.args[0].ty, "ndim", -1)) == axis
            run = [_split_piece(f, value) for f in fields[j : j + n]]
            whole = len(run) == n and all(
                p is not None and p[0].same_as(split_var) and p[1] == k for k, p in enumerate(run)
            )
            if same_axis and whole:
                out.append(split.args[0])  # the split's input: [.., sum of the pieces along axis, ..]
                cancelled += 1
                j += n
                continue
            log.debug("concat %s reads split %s but not all its pieces in order", binding.var.name, split_var.name)
        out.append(fields[j])
        j += 1
    if not cancelled:
        return None, 0
    if len(out) == 1:
        return out[0], cancelled
    new = relax.op.concat(relax.Tuple(out), axis=concat.attrs.axis)
    return relax.BlockBuilder().normalize(new), cancelled


def cancel_split_concat(func: relax.Function) -> tuple[relax.Function, int]:
    """``func`` with every ``concat`` of a whole split replaced (see module doc), and how many."""
    if not isinstance(func.body, relax.SeqExpr):
        return func, 0
    blocks = []
    total = 0
    for block in func.body.blocks:
        if isinstance(block, relax.DataflowBlock):
            block, n = _cancel_in_block(block)
            total += n
        blocks.append(block)
    if not total:
        return func, 0
    return with_blocks(func, blocks), total


def with_blocks(func: relax.Function, blocks: list[relax.BindingBlock]) -> relax.Function:
    """``func`` with its body's binding blocks replaced (the body is re-normalised for its type)."""
    body = relax.BlockBuilder().normalize(relax.SeqExpr(blocks, func.body.body, func.body.span))
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)


@tvm.transform.module_pass(opt_level=0, name="CancelSplitConcat")
class CancelSplitConcat:
    """Replace ``concat`` of all the pieces of one ``split`` (same axis, in order) by the split's
    input; see the module docstring. ``self.cancelled`` counts the cancellations of the last run."""

    def __init__(self) -> None:
        self.cancelled = 0

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.cancelled = 0
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or is_primitive(func):
                continue
            new, n = cancel_split_concat(func)
            if n:
                updates[gv] = new
                self.cancelled += n
                log.info("CancelSplitConcat: %d concat(split) pair(s) cancelled in %s", n, gv.name_hint)
        return with_functions(mod, updates)
