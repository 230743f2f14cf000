"""The schedule part of ``inspect ARTIFACT``: which rule scheduled each TVM kernel, from the
manifest (``manifest["schedules"]``, :meth:`.apply.ScheduleReport.to_dict`), and, where the
library's disassembly could be read (:func:`.disassembly.library_code`), which kernels launch
parallel work and how many vector FMAs each has. Formats plain data only."""

from __future__ import annotations

from typing import Any, Optional

VIEW = "reshape (a view, no kernel)"
CALL = "library call (no loop nest)"  # a TIR wrapper around a packed call (the oneDNN tactic's in-place conv)


def counted(kernels: dict[str, dict[str, Any]]) -> list[str]:
    """The kernels the schedule report counts: all but views and library-call wrappers."""
    return [k for k, v in kernels.items() if v["rule"] not in (VIEW, CALL)]


def format_code(code: dict[str, Any], names: list[str]) -> str:
    """``code (aarch64-linux-gnu-objdump -d): 23 of 23 kernels launch parallel work, 18 of 23
    have vector FMAs (fmla v.4s)`` over the kernels ``names``."""
    if "unavailable" in code:
        return f"code: not read ({code['unavailable']})"
    kernels = code["kernels"]
    missing = [k for k in names if not kernels[k]["found"]]
    line = (
        f"code ({code['tool']} -d): {sum(kernels[k]['parallel_launch'] for k in names)} of {len(names)} kernels launch "
        f"parallel work, {sum(kernels[k]['vector_fmas'] > 0 for k in names)} of {len(names)} have vector FMAs ({code['fma']})"
    )
    return line + (f"; NOT IN THE LIBRARY: {', '.join(missing)}" if missing else "")


def format_schedules(data: Optional[dict[str, Any]], code: Optional[dict[str, Any]] = None) -> str:
    """``schedules: 49 TVM kernels (avx2, 8 lanes): conv2d 37, ...; 8 parallel, 49 vectorised; none unscheduled``,
    the ``code`` line of :func:`format_code` and one line per kernel."""
    if not data:
        return "schedules: not recorded (an artifact from before the schedule rules, or a GPU/VTA target)"
    counts = ", ".join(f"{k} {v}" for k, v in data["counts"].items())
    unscheduled = data.get("unscheduled") or []
    lines = [
        f"schedules: {data['total']} TVM kernels ({data['isa']}, {data['lanes']} lanes): {counts}; "
        f"{data['parallel']} parallel, {data['vectorized']} vectorised; "
        + (f"UNSCHEDULED (plain loops): {', '.join(unscheduled)}" if unscheduled else "none unscheduled")
    ]
    kernels = data.get("kernels", {})
    if code is not None:
        lines.append(format_code(code, counted(kernels)))
    in_library = (code or {}).get("kernels", {})
    width = max((len(k) for k in kernels), default=0)
    for name, k in kernels.items():
        flags = [f for f, on in (("parallel", k["parallel"]), ("vectorised", k["vectorized"])) if on]
        line = f"  {name:<{width}}  {k['rule'] or 'NONE (plain loops)'}" + (f"  [{', '.join(flags)}]" if flags else "")
        found = in_library.get(name)
        if found and found["found"] and k["rule"] not in (VIEW, CALL):
            launch = "parallel launch" if found["parallel_launch"] else "one thread"
            line += f"  code: {launch}, {found['vector_fmas']} vector FMAs"
        lines.append(line)
    return "\n".join(lines)
