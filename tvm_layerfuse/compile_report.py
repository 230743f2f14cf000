"""What the merges did to the compiled model: kernels and bytes, TVM's default vs ours.

Both sides are lowered with TVM's default Relax pipeline for the target (LegalizeOps,
FuseOps, FuseTIR ...); "ours" has the layerfuse passes applied first. Counted on ``main``:

* kernel launches per inference (calls of TIR PrimFuncs), and how many are convolutions;
* bytes written per inference: the sum of every kernel's output tensors, i.e. the
  intermediate (and final) activations that go through memory;
* concatenate kernels and the bytes they copy.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np


def kernel_calls(mod) -> list[dict[str, Any]]:
    """Every kernel ``main`` calls, in order: ``{"name", "bytes_out"}``."""
    import tvm
    from tvm import relax

    prims = {gv for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    calls: list[dict[str, Any]] = []

    def out_bytes(ty) -> int:
        fields = getattr(ty, "fields", None)
        if fields is not None:
            return sum(out_bytes(f) for f in fields)
        shape = getattr(ty, "shape", None)
        dims = getattr(shape, "values", None)
        if dims is None:
            return 0
        try:
            n = int(np.prod([int(d) for d in dims], dtype=np.int64))
        except (TypeError, ValueError):
            return 0
        return n * np.dtype(str(ty.dtype)).itemsize

    def visit(e):
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") in ("relax.call_tir", "relax.call_tir_inplace"):
            gv = e.args[0]
            if gv in prims:
                calls.append({"name": gv.name_hint, "bytes_out": out_bytes(e.ty)})

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return calls


def summarize(mod) -> dict[str, Any]:
    calls = kernel_calls(mod)
    concat = [c for c in calls if "concat" in c["name"]]
    return {
        "kernel_launches": len(calls),
        "distinct_kernels": len({c["name"] for c in calls}),
        "conv_kernels": sum(1 for c in calls if "conv2d" in c["name"]),
        "bytes_written": sum(c["bytes_out"] for c in calls),
        "concat_kernels": len(concat),
        "concat_bytes_copied": sum(c["bytes_out"] for c in concat),
        "split_kernels": sum(1 for c in calls if "split" in c["name"]),
    }


def compare(
    model: Any,
    *,
    target: Any = "llvm",
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
    plan: Any = None,
) -> dict[str, Any]:
    """``{"default": {...}, "layerfuse": {...}, "plan": counts, "relax": pass report}``."""
    from .relax.pipeline import fuse_with_report, lower, unfused

    baseline = lower(unfused(model, input_shapes=input_shapes), target=target)
    result = fuse_with_report(model, plan=plan, input_shapes=input_shapes)
    ours = lower(result.mod, target=target)
    horizontal = result.report.get("horizontal") or {}
    merged = len(horizontal.get("merged", []) if isinstance(horizontal, dict) else getattr(horizontal, "merged", []))
    return {
        "default": summarize(baseline),
        "layerfuse": summarize(ours),
        "parallel_conv_groups": merged,
        "plan": result.plan.counts() if result.plan is not None else None,
    }


def text(report: dict[str, Any]) -> str:
    d, o = report["default"], report["layerfuse"]
    rows = [
        ("kernel launches per inference", "kernel_launches"),
        ("  of which convolutions", "conv_kernels"),
        ("  concatenate kernels", "concat_kernels"),
        ("  split kernels", "split_kernels"),
        ("distinct kernels", "distinct_kernels"),
        ("bytes written per inference", "bytes_written"),
        ("bytes copied by concatenates", "concat_bytes_copied"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = ["== compiled (CPU, TVM default pipeline vs layerfuse) ==", f"{'':<{width}}  {'default':>14}  {'layerfuse':>14}  {'ratio':>6}"]
    for label, key in rows:
        a, b = d[key], o[key]
        ratio = f"{b / a:.2f}" if a else "-"
        lines.append(f"{label:<{width}}  {a:>14,}  {b:>14,}  {ratio:>6}")
    lines.append(f"parallel-conv groups merged: {report['parallel_conv_groups']}")
    return "\n".join(lines)
