"""Element-wise, broadcast, injective and layout-transform kernels: every block inlined
into the kernel's output blocks, each of them a parallel outer loop over a vectorised
inner loop.

::

    out[i_0 .. i_k] = f(in_j[g_j(i_0 .. i_k)])
    -> t = fuse(i_m .. i_k)     the innermost axes along which every in_j and out are contiguous,
                                 as few as give several whole vectors (a plane H*W, not a row W)
       parallel(fuse(i_0 .. i_m-1)) . serial(t/o) . vectorize(t/i)      (t/i: one vector)
       fewer than 4 x cores outer chunks: parallel(fuse(i_0 .. i_m-1), t/o/o) . serial(t/o/i) . ...
       an innermost axis shorter than half a vector (NCHW tensors of width 1 or 2) that cannot
       be fused so: parallel(fuse(i_0 .. i_k)/o) . vectorize(fuse(i_0 .. i_k)/i)
"""

from __future__ import annotations

from tvm import s_tir

from .base import CPUParams, Rule, RuleRefused, finish_root, iter_kinds, root_blocks


class Injective(Rule):
    name = "injective"

    def apply(self, func, params: CPUParams, target) -> s_tir.Schedule:
        sch = s_tir.Schedule(func)
        blocks = root_blocks(sch)
        if not blocks or any(set(iter_kinds(sch, b)) - {"S"} for b in blocks):
            raise RuleRefused("not every block is data-parallel")
        from tvm.s_tir.dlight.analysis import normalize_prim_func
        from tvm.s_tir.dlight.base.common_schedules import try_inline

        infos = normalize_prim_func(sch)
        if infos is not None:
            try_inline(sch, infos)
        finish_root(sch, params)
        return sch


class Generic(Rule):
    """The last resort: every block at the root scheduled on its own (injective blocks as
    above, reductions as :mod:`.reduction` does), nothing inlined."""

    name = "generic"

    def apply(self, func, params: CPUParams, target) -> s_tir.Schedule:
        sch = s_tir.Schedule(func)
        finish_root(sch, params)
        return sch
