"""What the merges did to the compiled model: kernels and bytes, TVM's default vs ours.

Both sides go through TVM's default Relax pipeline for the target (LegalizeOps, FuseOps,
FuseTIR ... StaticPlanBlockMemory); "ours" has the layerfuse passes applied first and the
lowering passes after FuseTIR. Counted on ``main``:

* kernel launches per inference (calls of TIR PrimFuncs), and how many are convolutions;
* bytes written per inference: the output tensors of every compute kernel (the
  activations that go through memory) plus what copy kernels (concatenate, split) write;
  with the oneDNN tactic, also what its library calls write: their outputs and the scratch
  their conv prologues normalise the input into (:func:`total_bytes_written`);
* concatenate and split kernels that only copy, and the bytes the concatenates copy;
  concatenates ``FuseOps`` fused into a computing consumer (e.g. BatchNorm + ReLU) are no
  copy but write the joined features again, normalised (counted apart);
* peak activation memory: the storage blocks TVM's memory planner allocates.

The layerfuse side includes the lowering passes (in-place concat, split-output buffers).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

import numpy as np

_MOVEMENT = re.compile(r"(fused|concatenate|split|strided|slice|reshape|squeeze|expand|dims|transpose|take)\d*")


def activation_bytes_written(mod) -> dict[str, int]:
    """Bytes the kernels of a lowered (FuseTIR'd) module write per inference, from the types
    of their outputs: ``{"compute": ..., "split": ..., "library": ..., "scratch": ...}``
    (``library``: what tactic-library calls compute into their outputs, and the residuals
    they copy in first where a residual conv is not in place; ``scratch``: what
    they write into buffers of their own, see :func:`..tactics.use_onednn.library_writes`);
    copies into a concatenate are counted by :func:`tvm_layerfuse.lowering.concat_report`
    instead."""
    import tvm
    from tvm import relax

    from .tactics.use_onednn import library_writes

    prims = {gv for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    out = {"compute": 0, "split": 0, "library": 0, "scratch": 0}

    def nbytes(ty) -> int:
        fields = getattr(ty, "fields", None)
        if fields is not None:
            return sum(nbytes(f) for f in fields)
        dims = getattr(getattr(ty, "shape", None), "values", None)
        if dims is None:
            return 0
        return int(np.prod([int(d) for d in dims], dtype=np.int64)) * np.dtype(str(ty.dtype)).itemsize

    def visit(e):
        writes = library_writes(e)
        if writes is not None:
            out["library"] += writes.computed + writes.residual
            out["scratch"] += writes.scratch
            return
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.call_tir" and e.args[0] in prims:
            tokens = [t for t in e.args[0].name_hint.split("_") if t]
            if all(_MOVEMENT.fullmatch(t) for t in tokens):
                if any(t.startswith("split") for t in tokens) and not any(t.startswith("concatenate") for t in tokens):
                    out["split"] += nbytes(e.ty)
                return
            out["compute"] += nbytes(e.ty)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return out


def total_bytes_written(written: Mapping[str, int], report: Mapping[str, Any]) -> int:
    """Bytes written per inference: :func:`activation_bytes_written`'s ``written`` plus the
    concatenate copies of ``report`` (:func:`tvm_layerfuse.lowering.concat_report`); split
    outputs count where split kernels are left."""
    split = written["split"] if report["split_kernels"] else 0
    return written["compute"] + split + written.get("library", 0) + written.get("scratch", 0) + report["concat_bytes_copied"]


def compare(
    model: Any,
    *,
    target: Any = "llvm",
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
    plan: Any = None,
) -> dict[str, Any]:
    """``{"default": {...}, "layerfuse": {...}, "parallel_conv_groups": n}``: each side planned
    through ``StaticPlanBlockMemory`` (no code generation) and read by
    :func:`tvm_layerfuse.lowering.concat_report`."""
    from ..lowering import concat_report
    from ..relax.pipeline import fuse_with_report, lower, unfused

    plain = unfused(model, input_shapes=input_shapes)
    result = fuse_with_report(model, plan=plan, input_shapes=input_shapes)
    sides = {}
    for name, mod, layerfuse in (("default", plain, False), ("layerfuse", result.mod, True)):
        report = concat_report(mod, target=target, layerfuse=layerfuse)
        report["bytes_written"] = total_bytes_written(activation_bytes_written(lower(mod, target=target)), report)
        sides[name] = report
    baseline, ours = sides["default"], sides["layerfuse"]
    horizontal = result.report.horizontal
    return {
        "default": baseline,
        "layerfuse": ours,
        "parallel_conv_groups": len(horizontal.merged) if horizontal else 0,
        # element-wise ops the plan left after a planned kernel, joined to it as FuseOps would
        "absorbed_elementwise": sum(len(a["ops"]) for a in result.report.absorbed),
    }


def text(report: dict[str, Any]) -> str:
    d, o = report["default"], report["layerfuse"]
    rows = [
        ("kernel launches per inference", "kernels"),
        ("  of which convolutions", "conv_kernels"),
        ("  concatenate copies", "concat_kernels"),
        ("  concatenates fused into a computing kernel", "concat_fused"),
        ("  split copies", "split_kernels"),
        ("bytes written per inference", "bytes_written"),
        ("bytes copied by concatenates", "concat_bytes_copied"),
        ("peak activation memory (bytes)", "activation_bytes"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = ["== compiled (CPU, TVM default pipeline vs layerfuse) ==", f"{'':<{width}}  {'default':>14}  {'layerfuse':>14}  {'ratio':>6}"]
    for label, key in rows:
        a, b = d[key], o[key]
        ratio = f"{b / a:.2f}" if a else "-"
        lines.append(f"{label:<{width}}  {a:>14,}  {b:>14,}  {ratio:>6}")
    lines.append(f"parallel-conv groups merged: {report['parallel_conv_groups']}")
    if report.get("absorbed_elementwise"):
        lines.append(
            f"element-wise ops the plan left, joined to the preceding planned kernel (as TVM's FuseOps would): "
            f"{report['absorbed_elementwise']}"
        )
    return "\n".join(lines)
