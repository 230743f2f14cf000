"""Dense / matmul with its fused epilogue (bias, activation): the output row is vectorised
and several vectors wide, so each loaded activation feeds a block of accumulators.

::

    out[i, j] = sum_k a[i, k] * b[k, j]          (weights [K, N] after the import's transpose
                                                  was folded into them)
    -> parallel(i . j/o)
         acc[j/i] = 0                              (vector, up to 4 vectors wide)
         for k: acc[j/i] += a[i, k] (broadcast) * b[k, j/i] (vector loads)
         epilogue(acc) -> out
"""

from __future__ import annotations

from tvm import s_tir

from .base import CPUParams, Rule, RuleRefused, finish_root, iter_kinds, root_blocks, tile_reduction

MATMUL_BLOCKS = ("matmul", "T_matmul", "NT_matmul", "T_dense", "dense", "T_batch_matmul")


class Dense(Rule):
    name = "dense"

    def apply(self, func, params: CPUParams, target) -> s_tir.Schedule:
        sch = s_tir.Schedule(func)
        found = [b for b in root_blocks(sch) if sch.get(b).name_hint.startswith(MATMUL_BLOCKS)]
        if len(found) != 1:
            raise RuleRefused(f"{len(found)} matmul blocks")
        block = found[0]
        kinds = iter_kinds(sch, block)
        if not (kinds.endswith("SR") and set(kinds[:-1]) == {"S"}):
            raise RuleRefused(f"matmul block iterators {kinds}, expected S..SR")
        tile_reduction(sch, block, params, vec_axis=len(kinds) - 2, vectors=4, local=True)
        finish_root(sch, params)
        return sch
