"""Checks shared by the tests and the fuzzing scripts.

* :func:`run_onnxruntime` - the reference run (home: :mod:`tvm_layerfuse.topology.reference`).
* :func:`output_mismatches` / :func:`worst_error` - the numeric comparison every model test
  makes: each output ``max|ref - got| / max|ref| <= RTOL`` (1e-4, fp32), shapes equal,
  non-finite values at the same places (:func:`.differential.relative_error`).
* :func:`plan_violations` - the invariants every fusion plan must keep, checked from the
  plan's graphs alone (independently of ``planner.validate``), as a list of problems.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from ..topology.reference import run_onnxruntime

__all__ = ["RTOL", "gpu_present", "output_mismatches", "plan_violations", "run_onnxruntime", "worst_error"]

if TYPE_CHECKING:
    from ..planner import FusionPlan


RTOL = 1e-4
"""fp32: max |ref - got| / max |ref| against onnxruntime with optimisations off."""


SCALE_FLOOR = 0.1
"""Near-zero outputs are measured against ``SCALE_FLOOR * M`` (M: their ancestors' largest magnitude)."""


def relative_error(ref: np.ndarray, got: np.ndarray, *, scale: float = 0.0) -> float:
    """``max|ref - got| / max(max|ref|, SCALE_FLOOR * scale)``; inf on a shape or NaN/Inf mismatch."""
    ref = np.asarray(ref)
    got = np.asarray(got)
    if ref.shape != got.shape:
        return float("inf")
    a = ref.astype(np.float64)
    b = got.astype(np.float64)
    fa, fb = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(fa, fb):
        return float("inf")
    if not fa.all():
        same = np.array_equal(a[~fa], b[~fb], equal_nan=True)
        if not same:
            return float("inf")
        a, b = a[fa], b[fb]
    if a.size == 0:
        return 0.0
    denom = max(float(np.abs(a).max()), SCALE_FLOOR * float(scale), 1e-30)
    return float(np.abs(a - b).max() / denom)


def worst_error(expected: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> float:
    """The largest relative error over the outputs (inf when the output counts differ)."""
    if len(expected) != len(got):
        return float("inf")
    return max((relative_error(e, g) for e, g in zip(expected, got)), default=0.0)


def output_mismatches(
    expected: Sequence[np.ndarray],
    got: Sequence[np.ndarray],
    *,
    names: Optional[Sequence[str]] = None,
    rtol: float = RTOL,
) -> list[str]:
    """One line per output whose relative error exceeds ``rtol`` (empty when all agree)."""
    names = list(names) if names is not None else [f"output {k}" for k in range(len(expected))]
    if len(expected) != len(got):
        return [f"{len(got)} outputs where {len(expected)} were expected"]
    problems = []
    for name, e, g in zip(names, expected, got):
        err = relative_error(e, g)
        if not err <= rtol:
            problems.append(f"{name}: relative error {err:.3g} > {rtol:g} (shapes {np.shape(e)} / {np.shape(g)})")
    return problems


def gpu_present() -> bool:
    """Whether the TVM runtime can open a CUDA device here (a driver and a GPU); tests that
    compare CUDA numbers skip, with that reason, when it cannot."""
    import tvm

    from ..errors import DeviceError
    from ..runtime.loader import _load_cuda_runtime

    try:
        _load_cuda_runtime(tvm)
    except DeviceError:
        return False
    return bool(tvm.cuda(0).exist)


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
