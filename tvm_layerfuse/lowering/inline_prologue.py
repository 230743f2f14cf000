"""InlinePrologue: the normalisation of a prologue group is computed where the conv reads it.

After ``FuseTIR`` a prologue group (:mod:`tvm_layerfuse.relax.fuse_prologue`) is one
PrimFunc whose root block runs, in order::

    T_multiply[v] = x[v] * s[c]            # [N, C, H, W]   written to a local buffer
    T_add[v]      = T_multiply[v] + t[c]   # [N, C, H, W]   again
    relu[v]       = max(T_add[v], 0)       # [N, C, H, W]   again
    pad_temp[n, c, h, w] = if_then_else(inside, relu[n, c, h - p, w - p], 0)
    conv ...

``compute_inline`` of the three element-wise blocks (TVM's own ``s_tir`` schedule
primitive, which substitutes a block's value into its reader) leaves::

    pad_temp[n, c, h, w] = if_then_else(inside, max(x[n, c, h - p, w - p] * s[c] + t[c], 0), 0)

so the kernel reads ``x`` (a region of an in-place concat block) once, normalising on the
fly, and never writes a normalised copy of it; ``pad_temp`` is the conv's own padding
stage, the same as in any conv. A blocked conv (``conv2d_NCHWc``) pads in ``data_pad``,
and has no padding stage where its padding is 0: there the chain is inlined into ``relu``,
which stays a block of its own, a parallel vector pass in the same kernel before the conv
(inlined into the conv it would be recomputed for every multiply-add; computed per register
tile it measured slower than the pass). Only PrimFuncs named after a prologue group are touched;
a block that ``compute_inline`` refuses is left as it was (logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import tvm
from tvm import s_tir

from ..relax._ir import with_functions
from ..relax.fuse_prologue import PROLOGUE_PREFIX
from ..report import Report
from . import _tir

log = logging.getLogger(__name__)


@dataclass
class PrologueReport(Report):
    """Per kernel: the blocks inlined, and those left (with the reason)."""

    inlined: dict = field(default_factory=dict)  # kernel -> [block names]
    kept: dict = field(default_factory=dict)  # kernel -> [(block, reason)]


PADDING = ("pad_temp", "data_pad")  # the padding stage of TOPI's conv2d_nchw / conv2d_NCHWc


def _leading_blocks(func) -> list[str]:
    """Names of the element-wise blocks to inline: the top-level nests before the first one
    that has a reduction iter var, except the conv's own padding stage (``pad_temp``, or
    ``data_pad`` of a blocked conv) and, where there is none, the last of them."""
    root = _tir.root_block(func)
    if root is None:
        return []
    names = []
    for stmt in _tir.top_level_stmts(root):
        nest = _tir.as_nest(stmt)
        if isinstance(nest, str):
            return []
        if any(int(iv.iter_type) != 0 for iv in nest.block.iter_vars):
            break
        names.append(nest.block.name_hint)
    chain = [n for n in names if not n.startswith(PADDING)]
    if len(chain) == len(names) and chain:
        # no padding stage (a blocked conv without padding reads its input directly): the
        # chain is inlined into its last block, which stays a pass before the conv
        return chain[:-1]
    return chain


@tvm.transform.module_pass(opt_level=0, name="InlinePrologue")
class InlinePrologue:
    """Inline the element-wise prologue of every prologue group into its padding stage.

    Run it after ``FuseTIR`` and before any schedule (module doc). ``self.report`` (a
    :class:`PrologueReport`) lists what was inlined.
    """

    def __init__(self) -> None:
        self.report = PrologueReport()

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        self.report = PrologueReport()
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc) or not gv.name_hint.startswith(PROLOGUE_PREFIX):
                continue
            blocks = _leading_blocks(func)
            if not blocks:
                continue
            sch = s_tir.Schedule(tvm.IRModule({"main": func}))
            done = []
            for name in blocks:
                try:
                    sch.compute_inline(sch.get_sblock(name))
                    done.append(name)
                except s_tir.schedule.ScheduleError as err:  # compute_inline refused: keep the block
                    reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                    self.report.kept.setdefault(gv.name_hint, []).append((name, reason))
                    log.info("InlinePrologue: %s keeps block %s: %s", gv.name_hint, name, reason)
            if done:
                updates[gv] = sch.mod["main"]
                self.report.inlined[gv.name_hint] = done
        return with_functions(mod, updates)
