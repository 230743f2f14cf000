"""Default CPU schedules: one TIR schedule rule per kernel kind, applied after FuseTIR.

::

    conv2d_nchwc.py  conv2d in the blocked layout NCHW[x]c + fused epilogue: register tile of
                   output width x channel blocks, vector over the block, parallel outer loop
    conv2d.py      conv2d / grouped / depthwise (NCHW) + fused epilogue: register tile of
                   output channels x output width, vector FMAs, parallel outer loop
    dense.py       matmul + epilogue: vectorised output row, several vectors of accumulators
    reduction.py   pools, global pools, means (one reduction); softmax via dlight.cpu.Reduction
    injective.py   element-wise, broadcast, layout transforms; the generic last resort
    base.py        CPUParams (vector lanes: 16 AVX-512, 8 AVX2, 4 NEON; registers; cores)
                   and the two loop-nest shapes the rules are made of
    apply.py       ApplySchedules (the module pass) and ScheduleReport (rule per kernel)

A kernel a MetaSchedule database covers keeps the tuned schedule (the database is applied
first and marks it ``tirx.is_scheduled``).
"""

from .apply import RULES, ApplySchedules, KernelSchedule, ScheduleReport, schedule_kernel
from .base import CPUParams

__all__ = ["RULES", "ApplySchedules", "CPUParams", "KernelSchedule", "ScheduleReport", "schedule_kernel"]
