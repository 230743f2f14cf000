"""Checks shared by the tests and the fuzzing scripts.

* :func:`run_onnxruntime` - the reference run (home: :mod:`tvm_layerfuse.topology.reference`).
* :func:`plan_violations` - the invariants every fusion plan must keep, checked from the
  plan's graphs alone (independently of ``planner.validate``), as a list of problems.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["plan_violations", "run_onnxruntime"]

from ..topology.reference import run_onnxruntime

if TYPE_CHECKING:
    from ..planner import FusionPlan


def plan_violations(p: "FusionPlan") -> list[str]:
    """What is wrong with plan ``p`` (empty when nothing is):

    * every layer of the first graph appears exactly once among the second graph's
      ``layer.members`` (none lost, none twice, none invented);
    * the second graph has the first graph's outputs, in order, and each is still produced.
    """
    problems = []
    seen: dict[str, str] = {}
    for layer in p.second:
        for m in layer.members:
            if m in seen:
                problems.append(f"layer {m!r} is a member of both {seen[m]!r} and {layer.name!r}")
            seen[m] = layer.name
    first = [layer.name for layer in p.first]
    lost = [n for n in first if n not in seen]
    invented = sorted(set(seen) - set(first))
    if lost:
        problems.append(f"layers lost by the merges: {lost[:5]}")
    if invented:
        problems.append(f"members that are no layer of the first graph: {invented[:5]}")
    if p.second.outputs != p.first.outputs:
        problems.append(f"outputs changed from {p.first.outputs} to {p.second.outputs}")
    for o in p.second.outputs:
        t = p.second.tensors.get(o)
        if t is None or (t.producer is None and not t.is_input and not t.constant):
            problems.append(f"graph output {o!r} is no longer produced")
    return problems
