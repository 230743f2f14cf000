"""The schedule part of ``inspect ARTIFACT``: which rule scheduled each TVM kernel, from the
manifest (``manifest["schedules"]``, :meth:`.apply.ScheduleReport.to_dict`). Reads plain
data only: no TVM needed."""

from __future__ import annotations

from typing import Any, Optional


def format_schedules(data: Optional[dict[str, Any]]) -> str:
    """``schedules: 49 TVM kernels (avx2, 8 lanes): conv2d 37, ...; 8 parallel, 49 vectorised; none unscheduled``
    and one line per kernel."""
    if not data:
        return "schedules: not recorded (an artifact from before the schedule rules, or a GPU/VTA target)"
    counts = ", ".join(f"{k} {v}" for k, v in data["counts"].items())
    unscheduled = data.get("unscheduled") or []
    lines = [
        f"schedules: {data['total']} TVM kernels ({data['isa']}, {data['lanes']} lanes): {counts}; "
        f"{data['parallel']} parallel, {data['vectorized']} vectorised; "
        + (f"UNSCHEDULED (plain loops): {', '.join(unscheduled)}" if unscheduled else "none unscheduled")
    ]
    width = max((len(k) for k in data.get("kernels", {})), default=0)
    for name, k in data.get("kernels", {}).items():
        flags = [f for f, on in (("parallel", k["parallel"]), ("vectorised", k["vectorized"])) if on]
        lines.append(f"  {name:<{width}}  {k['rule'] or 'NONE (plain loops)'}" + (f"  [{', '.join(flags)}]" if flags else ""))
    return "\n".join(lines)
