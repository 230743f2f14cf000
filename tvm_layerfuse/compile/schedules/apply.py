"""The schedule pass: every TIR kernel of a CPU module gets a schedule, and a report says
which rule gave it.

::

    for each PrimFunc (after FuseTIR and the layerfuse lowering passes):
      tuned by MetaSchedule (``tirx.is_scheduled``, set by MetaScheduleApplyDatabase)  -> kept
        reported as ``metaschedule``, or as ``<rule> (tuning database)`` when the database's
        fastest record is the rule's own schedule (``tune`` stores it, marked ``layerfuse.rule``)
      a reshape (RewriteDataflowReshape turns it into a view, no kernel)               -> kept
      TIR without blocks (a wrapper around a library call)                             -> kept
      else the first rule that applies, in order:
        conv2d NCHWc -> conv2d -> dense -> pool/reduction -> dlight.cpu.Reduction -> injective -> generic

The pass runs on ``llvm`` targets only (GPU targets have dlight's GPU rules). Usage::

    tgt = tvm.target.Target({"kind": "llvm", "mcpu": "znver3"})
    with tgt:
        mod = ApplySchedules(tgt)(mod)          # after FuseTIR

``pass.report`` (:class:`ScheduleReport`) holds, per kernel, the rule and whether the
kernel has a parallel and a vectorised loop.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

import tvm
from tvm import tirx

from .base import CPUParams, Rule, loop_kinds
from .conv2d import Conv2D
from .conv2d_nchwc import Conv2DNCHWc
from .dense import Dense
from .injective import Generic, Injective
from .reduction import DlightReduction, Reduction
from .report import CALL, VIEW

log = logging.getLogger(__name__)

RULES: tuple[Rule, ...] = (Conv2DNCHWc(), Conv2D(), Dense(), Reduction(), DlightReduction(), Injective(), Generic())
TUNED = "metaschedule"  # the rule name of a kernel a tuning database scheduled
# a kernel whose best record in the tuning database is a rule's own schedule (``tune`` measured
# it beside MetaSchedule's candidates and it was the fastest): the rule's name, and where it came from
FROM_DATABASE = "{rule} (tuning database)"
RULE_MARK = "layerfuse.rule"  # root-block annotation of the records ``tune`` makes from the rules


@dataclasses.dataclass
class KernelSchedule:
    rule: Optional[str]  # None: no rule applied (a plain loop nest)
    parallel: bool = False
    vectorized: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "parallel": self.parallel, "vectorized": self.vectorized}


@dataclasses.dataclass
class ScheduleReport:
    """What the schedule pass did to each kernel of the last module it ran on."""

    isa: Optional[str] = None
    lanes: Optional[int] = None
    kernels: dict[str, KernelSchedule] = dataclasses.field(default_factory=dict)

    def update(self, other: "ScheduleReport") -> None:
        """Take ``other``'s contents (a report filled by a pass that ran elsewhere)."""
        self.isa, self.lanes, self.kernels = other.isa, other.lanes, dict(other.kernels)

    @property
    def unscheduled(self) -> list[str]:
        return sorted(k for k, v in self.kernels.items() if v.rule is None)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.kernels.values():
            out[v.rule or "none"] = out.get(v.rule or "none", 0) + 1
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        kernels = [v for v in self.kernels.values() if v.rule not in (VIEW, CALL)]
        return {
            "isa": self.isa,
            "lanes": self.lanes,
            "counts": self.counts(),
            "parallel": sum(v.parallel for v in kernels),
            "vectorized": sum(v.vectorized for v in kernels),
            "total": len(kernels),
            "unscheduled": self.unscheduled,
            "kernels": {k: v.to_dict() for k, v in sorted(self.kernels.items())},
        }


def _is_view(func: tirx.PrimFunc) -> bool:
    from tvm import relax

    try:
        return bool(relax.analysis.has_reshape_pattern(func))
    except Exception:  # noqa: BLE001 - not a reshape then
        return False


def _has_blocks(func: tirx.PrimFunc) -> bool:
    """The function is a block nest (what schedules work on), not TIR written by hand without
    blocks (a wrapper around a packed call)."""
    from tvm import s_tir

    try:
        s_tir.Schedule(func).get_sblock("root", func_name="main")
    except Exception:  # noqa: BLE001 - TVM's ScheduleError: no root block
        return False
    return True


def rule_schedule(func: tirx.PrimFunc, params: CPUParams, target, rules: Sequence[Rule] = RULES):
    """(the traced :class:`tvm.s_tir.Schedule` of the first rule that applies, its name) - or
    (None, None). The schedule's trace replays on ``func`` (what ``tune`` stores as a record)."""
    for rule in rules:
        try:
            sch = rule.apply(func, params, target)
        except Exception as e:  # noqa: BLE001 - RuleRefused or TVM's ScheduleError: the next rule
            log.debug("%s: %s", rule.name, str(e).splitlines()[0] if str(e) else type(e).__name__)
            continue
        return sch, rule.name
    return None, None


def schedule_kernel(func: tirx.PrimFunc, params: CPUParams, target, rules: Sequence[Rule] = RULES):
    """(scheduled PrimFunc, rule name) - or (``func``, None) when no rule applies."""
    sch, name = rule_schedule(func, params, target, rules)
    if sch is None:
        return func, None
    return sch.mod["main"].with_attr("tirx.is_scheduled", True), name


def database_rule(func: tirx.PrimFunc) -> Optional[str]:
    """The rule whose schedule a tuning database applied to ``func`` (``tune`` marks the
    records it makes from the rules with :data:`RULE_MARK` on the root block), or None: a
    schedule MetaSchedule's search found."""
    from tvm import s_tir

    try:
        sch = s_tir.Schedule(func)
        mark = sch.get(sch.get_sblock("root", func_name="main")).annotations.get(RULE_MARK)
    except Exception:  # noqa: BLE001 - no root block: not one of ours
        return None
    return None if mark is None else str(mark)


@tvm.transform.module_pass(opt_level=0, name="LayerfuseSchedules")
class ApplySchedules:
    """Default CPU schedules for every kernel not tuned (see the module docstring)."""

    def __init__(self, target: Optional[tvm.target.Target] = None, *, rules: Sequence[Rule] = RULES) -> None:
        self.target = target
        self.rules = tuple(rules)
        self.report = ScheduleReport()

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        target = self.target if self.target is not None else tvm.target.Target.current(allow_none=True)
        self.report = ScheduleReport()
        if target is None or target.kind.name != "llvm":
            return mod
        params = CPUParams.of(target)
        self.report.isa, self.report.lanes = params.isa, params.lanes
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            name = gv.name_hint
            if func.attrs is not None and "tirx.is_scheduled" in func.attrs and int(func.attrs["tirx.is_scheduled"]):
                marked = database_rule(func)
                rule, new = (TUNED if marked is None else FROM_DATABASE.format(rule=marked)), func
            elif _is_view(func):
                self.report.kernels[name] = KernelSchedule(VIEW)
                continue
            elif not _has_blocks(func):
                self.report.kernels[name] = KernelSchedule(CALL)
                continue
            else:
                new, rule = schedule_kernel(func, params, target, self.rules)
                if rule is None:
                    log.warning("kernel %s has no schedule rule: it stays a plain loop nest", name)
                else:
                    updates[gv] = new
            kinds = loop_kinds(new)
            self.report.kernels[name] = KernelSchedule(rule, "parallel" in kinds, "vectorized" in kinds)
        for gv, func in updates.items():
            mod.update_func(gv, func)
        return mod
