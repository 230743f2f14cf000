"""The layerfuse Relax pipeline: import, merge in plan order, bind weights, build, run, count.

::

    fuse(model)                                   IRModule, weights bound and folded
      import_onnx                                 weights as parameters (relax/importer.py)
      plan (tvm_layerfuse.planner)                which layers merge, decided on the topology graph
      1. FoldAffineIntoConv2D    vertical         BN / per-channel Mul/Add/Sub/Div -> conv weight, bias
      2. MergeParallelConv2D     horizontal       parallel convs -> one conv + split (relax/horizontal.py)
      3. FuseConv2DEpilogue      vertical + eltwise  conv + bias + [residual] + [act] -> one function
      4. FuseConv2DPrologue      vertical (pre-activation)  BatchNorm + Relu -> that conv's prologue
      5. AbsorbElementwiseConsumers                what FuseOps would still fuse after a group joins it
      bind_params                                 W', b' become constants, computed once here
                                                  (LiftTransformParams + one compile, then BindParams)

    build(mod)      TVM's default Relax pipeline for the target (LegalizeOps, FuseOps, FuseTIR, ...)
    run(ex, inputs) numpy in, numpy out
    count_kernels   kernel launches per inference of main after that pipeline

Step 3 comes after the horizontal merge because it hides each conv inside a fused
function; steps 1 and 3 together realise the plan's vertical groups, step 3 its
element-wise ones. ``unfused(model)`` gives the baseline: the same import and weight
binding with none of our passes, so that TVM's own fusion (FuseOps) is what it is compared
with.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import onnx
import tvm
from tvm import relax

from ..errors import UsageError
from ..planner import FusionPlan
from ..report import Report
from ._ir import TargetLike, as_target, default_target, param_names, tvm_compile, weight_param
from .absorb_elementwise import AbsorbElementwiseConsumers
from .fold_affine import FoldAffineIntoConv2D
from .fuse_epilogue import EpilogueSpec, FuseConv2DEpilogue
from .fuse_prologue import FuseConv2DPrologue, plan_prologue_convs
from .horizontal import MergeParallelConv2D, MergeReport, merge_groups_from_plan
from .importer import import_onnx

log = logging.getLogger(__name__)

ModelLike = Union[str, os.PathLike, onnx.ModelProto, tvm.IRModule]

_ACTIVATION_NAMES = {
    "Relu": "relu",
    "Clip": "clip",
    "LeakyRelu": "leakyrelu",
    "SiLU": "silu",
    "Sigmoid": "sigmoid",
    "HardSigmoid": "hardsigmoid",
    "HardSwish": "hardswish",
    "PRelu": "prelu",
    "Gelu": "gelu",
}
_RESIDUAL_NAMES = {"residual": "add", "multiply": "mul", "gate": "gate", "post_add": "post_add"}


@dataclass
class FuseReport(Report):
    """What the Relax passes of :func:`fuse_with_report` did, in their order."""

    folded: list[dict[str, Any]] = field(default_factory=list)  # FoldAffineIntoConv2D: {"op", "conv_weight", "var"}
    fold_refused: list[dict[str, Any]] = field(default_factory=list)
    horizontal: Optional[MergeReport] = None  # MergeParallelConv2D (None: not run)
    groups: list[dict[str, Any]] = field(default_factory=list)  # FuseConv2DEpilogue: one per fused function
    group_refused: list[dict[str, Any]] = field(default_factory=list)
    # FuseConv2DPrologue: {"function", "conv_weight", "input", "absorbs"} per BatchNorm+Relu prologue group
    prologues: list[dict[str, Any]] = field(default_factory=list)
    prologue_refused: list[dict[str, Any]] = field(default_factory=list)
    absorbed: list[dict[str, Any]] = field(default_factory=list)  # AbsorbElementwiseConsumers: {"function", "group", "ops"}
    plan_check: Optional[dict[str, Any]] = None  # the plan's counts next to the passes' (with a plan)


@dataclass
class FuseResult:
    """What :func:`fuse_with_report` did."""

    mod: tvm.IRModule
    plan: Optional[FusionPlan] = None  # when one was used
    report: FuseReport = field(default_factory=FuseReport)
    params: dict[str, Any] = field(default_factory=dict)  # weight values (left unbound when bind=False)


# ---------------------------------------------------------------------- entry points
def fuse(
    mod_or_onnx: ModelLike,
    *,
    plan: Optional[FusionPlan] = None,
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
    params: Optional[Mapping[str, Any]] = None,
    horizontal: bool = True,
) -> tvm.IRModule:
    """Merge the layers of a model and return the Relax module, weights bound and folded.

    ``mod_or_onnx`` is an ONNX path or ``ModelProto`` (imported with :func:`import_onnx`;
    the plan is computed when not given) or a Relax ``IRModule`` (weights as parameters of
    ``main`` after its ``num_input``, or constants; ``params`` gives their values when they
    are not in the function's ``"params"`` attribute). Without a plan every match merges.
    """
    return fuse_with_report(mod_or_onnx, plan=plan, input_shapes=input_shapes, params=params, horizontal=horizontal).mod


def fuse_with_report(
    mod_or_onnx: ModelLike,
    *,
    plan: Optional[FusionPlan] = None,
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
    params: Optional[Mapping[str, Any]] = None,
    horizontal: bool = True,
    bind: bool = True,
) -> FuseResult:
    """:func:`fuse`, also returning the plan used and what each pass did.

    ``bind=False`` leaves the weights as parameters of ``main`` (their values in
    ``result.params``), for a caller that keeps weights beside the compiled library."""
    mod, params, graph = _load(mod_or_onnx, input_shapes=input_shapes, params=params)
    if plan is None and graph is not None:
        from ..planner import plan as make_plan

        plan = make_plan(graph)
    report = FuseReport()
    fold_weights = epilogue_spec = None
    if plan is not None:
        fold_weights, epilogue_spec = plan_to_specs(plan, param_names(mod))

    # 1. vertical: fold BN / per-channel affine ops into the conv weights
    fold = FoldAffineIntoConv2D(only_weights=fold_weights)
    mod = fold(mod)
    report.folded = list(fold.folded)
    report.fold_refused = list(fold.refused)

    # 2. horizontal: merge parallel convs (after the vertical folds, before the epilogue
    #    grouping hides the convs inside fused functions)
    if horizontal:
        merge = MergeParallelConv2D(groups=merge_groups_from_plan(plan, mod) if plan is not None else None)
        mod = merge(mod)
        report.horizontal = merge.report

    # 3. vertical activation + element-wise epilogue: one fused function per group
    epilogue = FuseConv2DEpilogue(plan_spec=epilogue_spec)
    mod = epilogue(mod)
    report.groups = list(epilogue.groups)
    report.group_refused = list(epilogue.refused)

    # 4. pre-activation prologue: BatchNorm + Relu in front of a conv, inside its kernel
    prologue = FuseConv2DPrologue(plan_convs=None if plan is None else plan_prologue_convs(plan, param_names(mod)))
    mod = prologue(mod)
    report.prologues = list(prologue.groups)
    report.prologue_refused = list(prologue.refused)

    # 5. what the plan left after a group that TVM's FuseOps would fuse into it (never more
    #    kernels than the default pipeline)
    absorb = AbsorbElementwiseConsumers()
    mod = absorb(mod)
    report.absorbed = list(absorb.absorbed)
    if plan is not None:
        report.plan_check = _compare_with_plan(plan, report, param_names(mod))

    if bind:
        mod = bind_params(mod, params)
    _check_well_formed(mod)
    return FuseResult(mod=mod, plan=plan, report=report, params=dict(params))


def unfused(
    mod_or_onnx: ModelLike,
    *,
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
    params: Optional[Mapping[str, Any]] = None,
) -> tvm.IRModule:
    """The baseline: the same import with weights bound and folded, none of our passes."""
    mod, params, _ = _load(mod_or_onnx, input_shapes=input_shapes, params=params)
    return bind_params(mod, params)


def bind_params(mod: tvm.IRModule, params: Optional[Mapping[str, Any]]) -> tvm.IRModule:
    """Bind weight values to ``main``'s parameters and compute every weight expression the
    passes built (``W'``, ``b'``, merged weights) into one constant each, once, here.

    ``BindParams`` + ``FoldConstant`` does that too, but FoldConstant compiles every op it
    folds as a separate LLVM module (~480 builds, ~25 s for ResNet-50). Instead the weight
    computation is lifted into one function (``LiftTransformParams``), compiled once, run
    on the values, and its outputs are bound (~2 s); ``FoldConstant`` then folds what is
    left (nothing, usually)."""
    if params:
        main = mod["main"]
        num_input = _num_input(main)
        weights = list(main.params[num_input:]) if num_input is not None else []
        missing = [p.name for p in weights if p.name not in params]
        if weights and not missing:
            mod = _bind_lifted(mod, [params[p.name] for p in weights])
        else:
            values = {k: _as_tensor(v) for k, v in params.items()}
            mod = relax.transform.BindParams("main", values)(mod)
    mod = relax.transform.FoldConstant()(mod)
    return relax.transform.DeadCodeElimination()(mod)


def lift_weights(mod: tvm.IRModule, values: Sequence[Any]) -> tuple[tvm.IRModule, list[tvm.runtime.Tensor]]:
    """Split ``main`` into its weight computation and inference, and compute the weights now.

    ``LiftTransformParams`` moves every expression of the weights alone (``W'``, ``b'``,
    merged weights) into ``main_transform_params``; that function is compiled once for this
    machine's CPU and run on ``values`` (``main``'s weight parameters, in order). Returns the
    module whose ``main`` takes the inputs and the computed weights, and those weights in
    the order of its parameters.
    """
    lifted = relax.transform.LiftTransformParams()(mod)
    transform = lifted.get_global_var("main_transform_params")
    prepare = tvm.IRModule({"main": lifted[transform].with_attr("global_symbol", "main")})
    tgt = default_target()
    ex = tvm_compile(prepare, target=tgt, relax_pipeline=relax.get_default_pipeline(tgt))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    outs = _flatten(vm["main"]([_as_tensor(v) for v in values]))
    inference = tvm.IRModule(
        {gv: f for gv, f in lifted.functions.items() if not gv.same_as(transform)}, attrs=lifted.attrs
    )
    weights = list(inference["main"].params[_num_input(inference["main"]) or 0 :])
    if len(weights) != len(outs):
        raise RuntimeError(
            f"LiftTransformParams gave {len(outs)} weight values for {len(weights)} parameters; "
            "this is a bug in tvm_layerfuse - report the model"
        )
    return inference, outs


def _bind_lifted(mod: tvm.IRModule, values: list) -> tvm.IRModule:
    """Compute ``main``'s weight expressions once on this machine's CPU and bind the results."""
    inference, outs = lift_weights(mod, values)
    weights = inference["main"].params[_num_input(inference["main"]) or 0 :]
    return relax.transform.BindParams("main", dict(zip(weights, outs)))(inference)


def _num_input(func: relax.Function) -> Optional[int]:
    if func.attrs is None or "num_input" not in func.attrs:
        return None
    return int(func.attrs["num_input"])


def _as_tensor(v: Any):
    if isinstance(v, tvm.runtime.Tensor):
        return v
    return tvm.runtime.tensor(np.array(v, order="C", copy=None) if np.ndim(v) else np.asarray(v))


# ---------------------------------------------------------------------- build / run / count
def lower(mod: tvm.IRModule, *, target: TargetLike = "llvm") -> tvm.IRModule:
    """TVM's default Relax pipeline for ``target`` up to fused PrimFuncs (no code generation):
    LegalizeOps, AnnotateTIROpPattern, FoldConstant, FuseOps, FuseTIR, then
    RewriteDataflowReshape (reshapes become views, not kernels)."""
    tgt = as_target(target)
    if tgt.kind.name == "llvm":
        passes = relax.backend.cpu_generic.legalize_passes(tgt)
    else:
        passes = relax.pipeline.legalize_passes(tgt)
    with tgt:
        return tvm.transform.Sequential([*passes, relax.transform.RewriteDataflowReshape()])(mod)


def build(mod: tvm.IRModule, *, target: TargetLike = "llvm") -> relax.VMExecutable:
    """Compile with TVM's default Relax pipeline for ``target`` (the one with FuseOps/FuseTIR;
    ``tvm.compile``'s own default for CPU does not fuse at all)."""
    tgt = as_target(target)
    return tvm_compile(mod, target=tgt, relax_pipeline=relax.get_default_pipeline(tgt))


def run(ex: relax.VMExecutable, inputs: Sequence[np.ndarray], *, device=None) -> list[np.ndarray]:
    """Run ``main`` of a built module on numpy inputs, given in ``main``'s parameter order
    (an ONNX model's graph-input order); returns every output as a numpy array."""
    dev = device or tvm.cpu()
    vm = relax.VirtualMachine(ex, dev)
    if isinstance(inputs, Mapping):
        raise UsageError(
            "run() takes the inputs as a list in main's parameter order; "
            f"got a dict with keys {list(inputs)[:4]} - pass list(inputs.values()) in order"
        )
    args = [tvm.runtime.tensor(np.array(a, order="C", copy=None), dev) for a in inputs]
    out = vm["main"](*args)
    return [np.asarray(o.numpy()) for o in _flatten(out)]


def _flatten(out) -> list:
    if isinstance(out, (list, tuple)) or (hasattr(out, "__len__") and not hasattr(out, "numpy")):
        items = []
        for o in out:
            items.extend(_flatten(o))
        return items
    return [out]


@dataclass(frozen=True)
class KernelCount:
    """Kernels of a compiled model: launches per inference of ``main``, and distinct PrimFuncs."""

    launches: int
    distinct: int
    names: tuple[str, ...] = ()


_VM_CALL = re.compile(r"^\s*call\s+(\S+)\s+in:", re.M)


def kernel_count(mod_or_ex: Union[tvm.IRModule, relax.VMExecutable], *, target: TargetLike = "llvm") -> KernelCount:
    """Count the TIR kernels ``main`` calls after TVM's default pipeline.

    An ``IRModule`` that still holds Relax ops is lowered first with :func:`lower`; an
    executable is read from its VM code (every call that is not a ``vm.*`` builtin).
    Count a module whose weights are bound (:func:`fuse`, :func:`unfused`): with weights
    still parameters, computations on weights alone (a transposed FC weight, a folded
    BatchNorm) run per inference and count as kernels too."""
    if isinstance(mod_or_ex, tvm.IRModule):
        mod = mod_or_ex
        if _has_relax_ops(mod):
            mod = lower(mod, target=target)
        names = []
        prims = {gv for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
        main = mod["main"]

        def visit(e):
            if isinstance(e, relax.Call) and getattr(e.op, "name", "") in ("relax.call_tir", "relax.call_tir_inplace"):
                gv = e.args[0]
                if gv in prims:
                    names.append(gv.name_hint)
            elif isinstance(e, relax.Call) and isinstance(e.op, relax.GlobalVar) and e.op in prims:
                names.append(e.op.name_hint)

        relax.analysis.post_order_visit(main.body, visit)
        return KernelCount(launches=len(names), distinct=len(set(names)), names=tuple(names))
    text = "\n" + mod_or_ex.as_text()
    sections = {part.split(":", 1)[0].strip(): part for part in text.split("\n@")[1:]}
    main = sections.get("main", text)
    names = [n for n in _VM_CALL.findall(main) if not n.startswith("vm.")]
    return KernelCount(launches=len(names), distinct=len(set(names)), names=tuple(names))


def count_kernels(mod_or_ex: Union[tvm.IRModule, relax.VMExecutable], *, target: TargetLike = "llvm") -> int:
    """Kernel launches per inference of ``main`` after TVM's default pipeline (see
    :func:`kernel_count` for the distinct PrimFuncs too)."""
    return kernel_count(mod_or_ex, target=target).launches


_LOWERED_OPS = (
    "relax.call_tir",
    "relax.call_dps",
    "relax.call_pure",
    "relax.builtin",
    "relax.vm",
    "relax.memory",
    "relax.null",
)


def _has_relax_ops(mod: tvm.IRModule) -> bool:
    """Whether ``mod`` still holds high-level Relax ops (so it has not been lowered yet)."""
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            name = e.op.name
            if not name.startswith(_LOWERED_OPS):
                found.append(name)

    for _, func in mod.functions.items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
            if found:
                return True
    return False


# ---------------------------------------------------------------------- plan <-> Relax
def plan_to_specs(plan: FusionPlan, param_names: set[str]) -> tuple[set[str], dict[str, EpilogueSpec]]:
    """From a FusionPlan: the conv weights whose chains fold, and each conv's epilogue spec.

    Every Conv of the second graph gets a spec (a conv the plan left alone may still be
    grouped with its own bias); a horizontally merged conv's spec covers all its branches'
    weights, since the merged weight is computed from all of them."""
    fold: set[str] = set()
    spec: dict[str, EpilogueSpec] = {}
    for layer in plan.second:
        if layer.op_type != "Conv":
            continue
        fused = layer.fused
        if fused.branches:
            weights = [plan.first.layer(b).inputs[1] for b in fused.branches]
            epilogues = [e for b in fused.branches.values() for e in b.epilogue]
        else:
            weights = [layer.inputs[1]] if len(layer.inputs) > 1 else []
            epilogues = list(fused.epilogue)
        weights = [weight_param(w, param_names) or w for w in weights]
        residual = activation = None
        for e in fused.epilogue:
            if e.role in _RESIDUAL_NAMES:
                residual = _RESIDUAL_NAMES[e.role]
            elif e.role == "activation":
                activation = _ACTIVATION_NAMES.get(e.op, e.op.lower())
        for w in weights:
            spec[w] = EpilogueSpec(residual=residual, activation=activation)
            if any(e.folded for e in epilogues):
                fold.add(w)
    return fold, spec


# Set (to anything but "" or "0") to make a plan/Relax mismatch an error (tests/conftest.py sets it).
STRICT_PLAN_ENV = "TVM_LAYERFUSE_STRICT_PLAN"


class PlanMismatchError(RuntimeError):
    """The Relax passes did not carry out a merge the plan decided (a bug in tvm_layerfuse)."""


def _compare_with_plan(plan: FusionPlan, report: FuseReport, params: set[str]) -> dict[str, Any]:
    """Counts the plan promised next to what the Relax passes did.

    A planned element-wise merge that no fused function carries out is a bug (the templates
    refuse what the passes cannot do): with ``TVM_LAYERFUSE_STRICT_PLAN`` set it raises
    :class:`PlanMismatchError`; otherwise the plan is corrected to the program - each such
    group becomes a refusal with the reason - so the report and the manifest describe what
    was compiled."""
    planned_bn = sum(
        1
        for layer in plan.second
        for e in layer.fused.all_epilogue_ops()
        if e.op == "BatchNormalization" and e.folded
    )
    done_bn = sum(1 for f in report.folded if f["op"] == "BatchNormalization")
    done_weights = {w for g in report.groups if g.get("extra_input") for w in g.get("conv_weight") or []}
    dropped = []
    for g in plan.groups_of("eltwise"):
        conv = g.details.get("conv")
        layer = plan.first.layer(conv) if conv else None
        w = layer.inputs[1] if layer is not None and len(layer.inputs) > 1 else None
        if w is None or (weight_param(w, params) or w) not in done_weights:
            dropped.append(g)
    check = {
        "batchnorm_folded": {"plan": planned_bn, "relax": done_bn},
        "eltwise_merged": {"plan": len(plan.groups_of("eltwise")), "relax": len(plan.groups_of("eltwise")) - len(dropped)},
    }
    bad = {what: c for what, c in check.items() if c["plan"] != c["relax"]}
    if not bad:
        return check
    shown = "; ".join(f"{w} planned {c['plan']}, done {c['relax']}" for w, c in bad.items())
    names = ", ".join(f"{g.details.get('op')} into conv {g.details.get('conv')!r}" for g in dropped[:4])
    message = f"plan/Relax mismatch: {shown}" + (f"; not carried out: {names}" if dropped else "")
    if os.environ.get(STRICT_PLAN_ENV, "") not in ("", "0"):
        raise PlanMismatchError(message + " - a bug in tvm_layerfuse: report the model")
    from collections import Counter

    from ..templates.base import Refusal

    for g in dropped:
        kind = _RESIDUAL_NAMES.get(g.details.get("op", ""), str(g.details.get("op", "")).lower())
        seen = Counter(r["reason"] for r in report.group_refused if kind and f"_{kind}_" in r["template"] + "_")
        why = "the Relax pass FuseConv2DEpilogue found no group for it" + (
            f" (it refused {kind} groups: {'; '.join(r for r, _ in seen.most_common(2))})" if seen else ""
        )
        plan.groups.remove(g)
        plan.refusals.append(Refusal(template="relax.FuseConv2DEpilogue", kind="eltwise", layers=list(g.members), reason=why))
    check["eltwise_merged"]["plan_dropped"] = len(dropped)
    log.info("%s; the plan now lists them as refused", message)
    return check


# ---------------------------------------------------------------------- loading
def _load(mod_or_onnx: ModelLike, *, input_shapes, params):
    """(IRModule with weights as parameters, weight values, first topology graph or None)."""
    if isinstance(mod_or_onnx, tvm.IRModule):
        mod = mod_or_onnx
        if input_shapes:
            raise UsageError("input_shapes applies to ONNX models; an IRModule's shapes are fixed - re-import it")
        main = mod["main"]
        if main.attrs is not None and "params" in main.attrs:
            mod, detached = relax.frontend.detach_params(mod)
            main = mod["main"]
            num_input = int(main.attrs["num_input"])
            found = {v.name: t for v, t in zip(main.params[num_input:], detached.get("main", []))}
            params = {**found, **dict(params or {})}
        return mod, dict(params or {}), None
    if isinstance(mod_or_onnx, (str, os.PathLike, onnx.ModelProto)):
        if params:
            raise UsageError("params applies to an IRModule; an ONNX model carries its own weights")
        return import_onnx(mod_or_onnx, input_shapes=input_shapes)
    raise UsageError(
        f"fuse() got a {type(mod_or_onnx).__name__}; expected an ONNX path, an onnx.ModelProto or a tvm.IRModule"
    )


def _check_well_formed(mod: tvm.IRModule) -> None:
    if not relax.analysis.check_well_formed(mod):
        raise RuntimeError(
            "the fused module is not well formed: this is a bug in tvm_layerfuse; "
            "run fuse(..., horizontal=False) or report the model"
        )
