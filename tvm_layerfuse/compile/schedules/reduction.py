"""Pools and other single reductions (max/average pool, global average pool, mean, sum)
with their epilogue (the average's division, a following activation).

::

    out[s..] = reduce_{r..} in[f(s.., r..)]
    -> parallel(s.. . s_vec/o)
         init; for r..: acc[s_vec/i] = reduce(acc, in[..])       (vector s_vec/i)
         epilogue(acc) -> out
    padding: its own parallel, vectorised pass; in a blocked layout (NCHW[x]c, the vector
             a channel block) read through a bounds check instead

``s_vec`` is the innermost output axis with more than one element (a pool's output width;
a global pool's channels).

Kernels with several reductions (softmax: max, exp, sum, divide) go to TVM's own
``dlight.cpu.Reduction`` (:class:`DlightReduction`).
"""

from __future__ import annotations

from tvm import s_tir

from .base import CPUParams, Rule, RuleRefused, extents, finish_root, iter_kinds, root_blocks, tile_reduction


def _inline_padding(sch: s_tir.Schedule, block) -> None:
    """The pool's padding stage read where the pool reads it (a bounds check per load)
    instead of a padded copy of the whole input written first."""
    for producer in sch.get_producers(block):
        if sch.get(producer).name_hint.startswith("pad_temp"):
            try:
                sch.compute_inline(producer)
            except Exception:  # noqa: BLE001 - TVM's ScheduleError: the copy stays
                pass


class Reduction(Rule):
    name = "pool/reduction"

    def apply(self, func, params: CPUParams, target) -> s_tir.Schedule:
        sch = s_tir.Schedule(func)
        found = [b for b in root_blocks(sch) if "R" in iter_kinds(sch, b)]
        if len(found) != 1:
            raise RuleRefused(f"{len(found)} reduction blocks")
        block = found[0]
        kinds = iter_kinds(sch, block)
        ext = extents(sch, sch.get_loops(block))
        spatial = [i for i, k in enumerate(kinds) if k == "S" and ext[i] > 1]
        if not spatial:
            raise RuleRefused("a reduction to a single value")
        if kinds.startswith("SSSSS") and ext[4] == params.lanes:  # a pool in NCHW[x]c
            _inline_padding(sch, block)  # measured 2-3x faster than the padded copy (3x3 / 1 / 1 pools)
        tile_reduction(sch, block, params, vec_axis=spatial[-1])
        finish_root(sch, params)
        return sch


class DlightReduction(Rule):
    """TVM's ``dlight.cpu.Reduction``: softmax and norms (reductions and element-wise blocks
    sharing leading spatial axes)."""

    name = "dlight.cpu.Reduction"

    def apply(self, func, params: CPUParams, target) -> s_tir.Schedule:
        from tvm.s_tir.dlight.cpu import Reduction as TVMReduction

        sch = TVMReduction().apply(func, target, False)
        if sch is None:
            raise RuleRefused("dlight.cpu.Reduction does not apply")
        return sch
