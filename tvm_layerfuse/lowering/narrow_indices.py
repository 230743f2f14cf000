"""NarrowBlockedIndices: the blocked conv kernels in int32 loops and indices, before any
schedule (a tuning database's or the rules').

Relax legalizes with int64 loops. TVM 0.27's ``LoopPartition`` ignores the partition hint of
the ``conv2d NCHWc`` rule (``compile/schedules/conv2d_nchwc.py``) on a loop whose int64
variable ``NarrowDataType`` later replaced by an int32 one (the hint still names the old
variable), and the partial tiles then keep their predicates. So every kernel with a blocked
conv block (``conv2d_NCHWc``, ``depthwise_conv2d_NCHWc``) whose buffers all have fewer than
2**31 elements is narrowed here with TVM's ``ForceNarrowIndexToInt32``::

    for i: T.int64 in range(T.int64(n))   ->   for i in range(n)        (same iterations)

As a pass of the lowering, before ``MetaScheduleApplyDatabase``, the narrowed kernel is also
the workload ``tune`` extracts: the rule's schedule of it is a trace that replays there, so
it can be a tuning record. A kernel TVM cannot narrow keeps its int64 indices (logged).
"""

from __future__ import annotations

import logging

import tvm
from tvm import tirx
from tvm.s_tir import SBlock

from ..relax._ir import with_functions
from . import _tir

log = logging.getLogger(__name__)

BLOCKED_CONV_BLOCKS = ("conv2d_NCHWc", "depthwise_conv2d_NCHWc")  # lowering/blocked_conv.py


def int32_indices(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with int32 loops and indices where every buffer has fewer than 2**31
    elements (else, or where TVM refuses, ``func`` as it is)."""
    for buf in func.params:
        n = 1
        for d in getattr(buf, "shape", None) or ():
            if not isinstance(d, tirx.IntImm):
                return func
            n *= int(d)
        if n >= 1 << 31:
            return func
    try:
        return tirx.transform.ForceNarrowIndexToInt32()(tvm.IRModule({"main": func}))["main"]
    except Exception as e:  # noqa: BLE001 - TVM's error (an int64 buffer): kept as it is
        log.debug("int64 indices kept: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return func


def _has_blocked_conv(func: tirx.PrimFunc) -> bool:
    return any(b.name_hint.startswith(BLOCKED_CONV_BLOCKS) for b in _tir._collect(func.body, SBlock))


@tvm.transform.module_pass(opt_level=0, name="NarrowBlockedIndices")
class NarrowBlockedIndices:
    """Every PrimFunc with a blocked conv block in int32 indices (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and _has_blocked_conv(func):
                new = int32_indices(func)
                if not new.same_as(func):
                    updates[gv] = new
        return with_functions(mod, updates)
