"""TVM's default Relax pipeline with the layerfuse lowering passes, and the concat report.

::

    layerfuse_pipeline(target)       == TVM's get_default_pipeline(target), plus two passes:
      library dispatch                 (DispatchSampling, DispatchSortScan)
      [LegalizeBlockedConv]            CPU: NCHW[x]c convs -> topi.nn.conv2d_NCHWc (blocked_conv.py)
      LegalizeOps ... FuseOps, FuseTIR
      -> InlinePrologue                BatchNorm+Relu prologues computed inside the conv (inline_prologue.py)
      -> SplitOutputBuffers            producers write their split pieces (split_outputs.py)
      -> InPlaceConcat                 producers write into the concat block (inplace_concat.py)
      -> NarrowBlockedIndices          CPU: blocked conv kernels in int32 indices (narrow_indices.py)
      [MetaScheduleApplyDatabase]      a `tune` database, where one exists
      -> LayerfuseSchedules            CPU: a schedule rule for every other kernel (compile/schedules/)
      [dlight default GPU schedules]   CUDA / ROCm / Metal: still applied, to the new kernels too
      RewriteDataflowReshape ... CallTIRRewrite
      StaticPlanBlockMemory ...        plans the concat block like any tensor
      (rest of the finalisation, unchanged)

Usage::

    tgt = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    ex = tvm.compile(mod, target=tgt, relax_pipeline=layerfuse_pipeline(tgt))

    tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    with tgt:
        ex = tvm.compile(mod, target=tgt, relax_pipeline=layerfuse_pipeline(tgt))

The passes go right after ``FuseTIR``: that is the first point where each producer is one
PrimFunc whose output buffer can be moved, and it is before any schedule (a scheduled
kernel is not rewritten) and before memory planning (which must see the block as one
tensor). ``pass.split_report`` / ``pass.inplace_report`` hold what the two passes did in
the last run.

:func:`concat_report` reads a compiled model (an executable, or a module planned by
``StaticPlanBlockMemory``; a high-level Relax module is planned first, without code
generation) and counts what concatenation still costs per inference.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import tvm
from tvm import relax

from ..errors import UsageError
from ..relax._ir import as_target, default_target
from . import _tir
from .inline_prologue import InlinePrologue
from .inplace_concat import InPlaceConcat, InPlaceReport
from .split_outputs import SplitOutputBuffers, SplitReport

if TYPE_CHECKING:
    from ..planner import FusionPlan

log = logging.getLogger(__name__)

__all__ = [
    "LayerfusePipeline",
    "concat_report",
    "default_passes",
    "format_concat_report",
    "layerfuse_passes",
    "layerfuse_pipeline",
    "plan_check",
    "plan_memory",
]

_BACKENDS = {"llvm": "cpu_generic", "cuda": "cuda", "rocm": "rocm", "metal": "gpu_generic"}


def _backend(target: tvm.target.Target):
    """TVM's backend pipeline module for ``target`` (what ``get_default_pipeline`` uses).

    The stage lists are read from ``tvm.relax.backend.<backend>.pipeline`` directly:
    ``tvm.relax.pipeline.dataflow_lower_passes`` fails for llvm and cuda in 0.27 (their
    package ``__init__`` does not export it)."""
    kind = target.kind.name
    name = _BACKENDS.get(kind)
    if kind == "opencl" and "adreno" in list(target.keys):
        name = "adreno"
    if name is None:
        from tvm.relax.backend.utils import BackendDispatcher

        if BackendDispatcher.is_gpu_target(target):
            name = "gpu_generic"
    if name is None:
        raise UsageError(
            f"target kind {kind!r} has no TVM default Relax pipeline; expected llvm, cuda, rocm, metal or "
            "another GPU kind - compile with a pipeline of your own and add the layerfuse passes after FuseTIR"
        )
    return importlib.import_module(f"tvm.relax.backend.{name}.pipeline")


def _stages(target: tvm.target.Target):
    backend = _backend(target)
    try:
        return (
            list(backend.library_dispatch_passes(target)),
            list(backend.legalize_passes(target)),
            list(backend.dataflow_lower_passes(target)),
            list(backend.finalize_passes(target)),
        )
    except AttributeError as err:  # a backend without one of the four stages
        raise UsageError(f"TVM's {backend.__name__} does not define the four pipeline stages ({err})") from err


def _insert_after_fuse_tir(legalize: list, ours: list) -> list:
    names = [p.info.name for p in legalize]
    if "FuseTIR" not in names:
        raise UsageError(
            f"TVM's legalize stage for this target has no FuseTIR pass ({names}); the layerfuse lowering "
            "passes need fused PrimFuncs - this TVM version is not supported"
        )
    k = names.index("FuseTIR") + 1
    return legalize[:k] + ours + legalize[k:]


def layerfuse_passes(
    *, split_outputs: bool = True, inplace_concat: bool = True, nested: bool = True, prologue: bool = True
) -> list:
    """The lowering passes, in order, for a pipeline of one's own: put them right after
    FuseTIR. For a GPU target keep ``split_outputs=False`` (see :class:`LayerfusePipeline`)."""
    passes = [InlinePrologue()] if prologue else []
    if split_outputs:
        passes.append(SplitOutputBuffers())
    if inplace_concat:
        passes.append(InPlaceConcat(nested=nested))
    return passes


@tvm.transform.module_pass(opt_level=0, name="LayerfusePipeline")
class LayerfusePipeline:
    """TVM's default Relax pipeline for ``target`` with the layerfuse lowering passes after FuseTIR.

    Options (keywords): ``split_outputs`` (remove split kernels; ``None``: on for CPU, off
    for GPU targets, see below), ``inplace_concat`` (remove concat kernels), ``nested``
    (nested concats share one block), ``prologue`` (inline BatchNorm+Relu prologue groups
    into their conv, :class:`.inline_prologue.InlinePrologue`), ``database`` (a MetaSchedule
    database folder written by ``tune``: its schedules are applied right after the lowering
    passes), ``schedules`` (CPU targets: the schedule rules of :mod:`..compile.schedules` for
    every kernel the database does not cover, ``schedule_report`` says which rule scheduled
    each), ``stop_after`` (``"StaticPlanBlockMemory"`` ends the
    pipeline right after memory planning, for :func:`concat_report`; None runs it all). With
    the three passes off this is TVM's default pipeline. ``split_report`` and ``inplace_report``
    describe the last run; ``notes`` says what was left out for this target and why.

    GPU targets: dlight's Matmul rule (which schedules every conv on CUDA) handles exactly
    one epilogue block after the reduction; a producer whose output is partitioned into
    several buffers has one per piece, and TVM 0.27 then miscompiles it (a buffer used
    after its scope) or asserts. So on GPU the split kernels stay (in-place concat still
    makes the split write its concat-bound pieces straight into the concat block), and
    ``split_outputs=True`` is refused.
    """

    def __init__(
        self,
        target,
        *,
        split_outputs: Optional[bool] = None,
        inplace_concat: bool = True,
        nested: bool = True,
        prologue: bool = True,
        stop_after: Optional[str] = None,
        database: Optional[str] = None,
        schedules: bool = True,
    ) -> None:
        self.target = as_target(target)
        self.database = database  # a MetaSchedule database folder, applied after the lowering passes
        gpu = self.target.kind.name != "llvm"
        self.notes: list[str] = []
        if split_outputs and gpu:
            raise UsageError(
                f"split_outputs=True for a {self.target.kind.name} target: TVM 0.27's dlight GPU Matmul rule "
                "schedules one epilogue block only and miscompiles a conv that writes several split pieces; "
                "leave split_outputs unset (off on GPU)"
            )
        if split_outputs is None:
            split_outputs = not gpu
            if gpu:
                self.notes.append(
                    "split kernels kept on GPU: dlight's Matmul rule schedules a single epilogue block "
                    "(the split pieces that feed an in-place concat are still written straight into its block)"
                )
        self._split = SplitOutputBuffers() if split_outputs else None
        self._concat = InPlaceConcat(nested=nested) if inplace_concat else None
        self._prologue = InlinePrologue() if prologue else None
        self.stop_after = stop_after
        self._schedules = None
        if schedules and not gpu:  # CPU schedule rules for every kernel not tuned (compile/schedules/)
            from ..compile.schedules import ApplySchedules

            self._schedules = ApplySchedules(self.target)
        _stages(self.target)  # fail now, not inside tvm.compile, for an unsupported target

    @property
    def split_report(self) -> SplitReport:
        return self._split.report if self._split is not None else SplitReport()

    @property
    def inplace_report(self) -> InPlaceReport:
        return self._concat.report if self._concat is not None else InPlaceReport()

    @property
    def prologue_report(self):
        """The element-wise blocks each prologue kernel inlined (:class:`.inline_prologue.PrologueReport`)."""
        return self._prologue.report if self._prologue is not None else None

    @property
    def schedule_report(self):
        """The rule that scheduled each kernel (:class:`..compile.schedules.ScheduleReport`), or None."""
        return self._schedules.report if self._schedules is not None else None

    def passes(self) -> list:
        dispatch, legalize, lower, finalize = _stages(self.target)
        if self.target.kind.name == "llvm":  # blocked convs (BlockedConvLayout) need their own legalization
            from .blocked_conv import LegalizeBlockedConv

            legalize = [LegalizeBlockedConv(), *legalize]
        ours = [p for p in (self._prologue, self._split, self._concat) if p is not None]
        if self.target.kind.name == "llvm":  # before any schedule: the workload tune extracts
            from .narrow_indices import NarrowBlockedIndices

            ours.append(NarrowBlockedIndices())
        if self.database is not None:  # tuned schedules for the kernels as the lowering left them
            ours.append(relax.transform.MetaScheduleApplyDatabase(self.database))
        if self._schedules is not None:  # after the database: a tuned kernel keeps its schedule
            ours.append(self._schedules)
        seq = dispatch + _insert_after_fuse_tir(legalize, ours) + lower + finalize
        if self.stop_after is not None:
            names = [p.info.name for p in seq]
            if self.stop_after not in names:
                raise UsageError(f"stop_after={self.stop_after!r} is not a pass of the pipeline ({names})")
            seq = seq[: names.index(self.stop_after) + 1]
        return seq

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with contextlib.ExitStack() as scope:
            scope.enter_context(self.target)
            if self.database is not None:  # opened here: the pass would open it itself with a C++ warning line
                import tvm.s_tir.meta_schedule as ms

                scope.enter_context(ms.database.JSONDatabase(work_dir=self.database, allow_missing=True))
            return tvm.transform.Sequential(self.passes())(mod)


def layerfuse_pipeline(target, **options) -> tvm.transform.Pass:
    """TVM's default Relax pipeline for ``target`` with in-place concat and split-output
    buffers inserted after FuseTIR (see :class:`LayerfusePipeline` for the options)."""
    return LayerfusePipeline(target, **options)


def default_passes(target, **options) -> tvm.transform.Pass:
    """TVM's default pipeline, built the same way (the baseline of :func:`concat_report`);
    ``schedules=True`` adds the CPU schedule rules."""
    options.setdefault("schedules", False)
    return LayerfusePipeline(target, split_outputs=False, inplace_concat=False, prologue=False, **options)


def plan_memory(mod: tvm.IRModule, target, *, layerfuse: bool = True, **options) -> tvm.IRModule:
    """``mod`` through the pipeline up to and including ``StaticPlanBlockMemory`` (no code
    generation): what :func:`concat_report` reads."""
    tgt = as_target(target)
    make = layerfuse_pipeline if layerfuse else default_passes
    return make(tgt, stop_after="StaticPlanBlockMemory", **options)(mod)


# ----------------------------------------------------------------------------- the report
_ALLOC_STORAGE = "relax.memory.alloc_storage"
_ALLOC_TENSOR = "relax.builtin.alloc_tensor"


_MOVEMENT = r"(concatenate|split|strided|slice|reshape|squeeze|expand|dims|transpose|inplace|take)\d*"


def _is_copy_concat_name(name: str) -> bool:
    """A kernel name made only of data-movement ops, one of them a concatenate
    (``concatenate``, ``fused_concatenate``, ``fused_split_concatenate``, ``concatenate1_inplace``):
    a kernel that copies. ``fused_concatenate_batch_norm_relu`` computes: not a copy."""
    tokens = [t for t in name.split("_") if t and t != "fused"]
    return any(t.startswith("concatenate") for t in tokens) and all(re.fullmatch(_MOVEMENT, t) for t in tokens)


def concat_report(mod_or_ex, *, target=None, layerfuse: bool = True) -> dict[str, Any]:
    """What concatenation still costs in a compiled model, per inference of ``main``.

    Returns ``concat_kernels`` (kernels that only copy their inputs into a concatenation,
    also with a split or slice fused in), ``concat_bytes_copied`` (bytes those kernels
    write), ``concat_fused`` (kernels where ``FuseOps`` fused a concat into a computing
    consumer such as BatchNorm + ReLU: no separate copy),
    ``split_kernels``, ``kernels`` (all kernel launches), ``activation_bytes`` (sum of the
    storage blocks ``StaticPlanBlockMemory`` planned, plus unplanned allocations: the peak
    activation memory of the plan), ``storage_blocks`` and ``source``.

    ``mod_or_ex`` is a ``relax.VMExecutable`` (kernels recognised by name), a module already
    planned by ``StaticPlanBlockMemory``, or a high-level Relax module, which is planned
    first with :func:`layerfuse_pipeline` (``layerfuse=False``: TVM's default pipeline) for
    ``target`` (default: this machine's CPU); in both module cases kernels are recognised
    by their TIR (:func:`._tir.match_concat`)."""
    if isinstance(mod_or_ex, relax.VMExecutable):
        return _report_executable(mod_or_ex)
    if not isinstance(mod_or_ex, tvm.IRModule):
        raise UsageError(f"concat_report() takes an IRModule or a relax.VMExecutable, not {type(mod_or_ex).__name__}")
    mod = mod_or_ex
    if not _is_planned(mod):
        if target is None:
            target = default_target()
        mod = plan_memory(mod, target, layerfuse=layerfuse)
    return _report_module(mod)


def _is_planned(mod: tvm.IRModule) -> bool:
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == _ALLOC_STORAGE:
            found.append(e)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return bool(found)


def _shape_bytes(shape, dtype) -> int:
    return int(np.prod([int(d) for d in shape], dtype=np.int64)) * np.dtype(str(dtype)).itemsize


def _report_module(mod: tvm.IRModule) -> dict[str, Any]:
    main = mod["main"]
    calls: list = []  # (gv, args)
    storage: list[int] = []
    unplanned: list[int] = []

    def visit(e):
        if not isinstance(e, relax.Call):
            return
        if isinstance(e.op, tvm.ir.GlobalVar) and isinstance(mod[e.op], tvm.tirx.PrimFunc):
            calls.append((e.op, list(e.args)))
        elif isinstance(e.op, tvm.ir.Op) and e.op.name == _ALLOC_STORAGE:
            size, *_ = e.args
            storage.append(int(np.prod([int(v) for v in size.values], dtype=np.int64)))
        elif isinstance(e.op, tvm.ir.Op) and e.op.name == _ALLOC_TENSOR:
            ty = e.ty
            unplanned.append(_shape_bytes(ty.shape, ty.dtype))
        elif isinstance(e.op, tvm.ir.Op) and e.op.name in ("relax.call_tir", "relax.call_tir_inplace"):
            callee, call_args, *_ = e.args
            calls.append((callee, list(call_args.fields)))

    relax.analysis.post_order_visit(main.body, visit)
    concat = fused = split = copied = convs = 0
    for gv, _ in calls:
        func = mod[gv]
        convs += "conv2d" in gv.name_hint
        kernel = _tir.match_concat(func)
        if not isinstance(kernel, str) or ("concatenate" in gv.name_hint and _tir.is_data_movement(func)):
            concat += 1  # a concat, or e.g. a split fused into a concat: a copy either way
            copied += _tir.stored_bytes(func)
        elif "concatenate" in gv.name_hint:
            fused += 1
        if not isinstance(_tir.match_split(func), str):
            split += 1
    return {
        "source": "module",
        "kernels": len(calls),
        "concat_kernels": concat,
        "concat_bytes_copied": copied,
        "concat_fused": fused,
        "split_kernels": split,
        "conv_kernels": convs,
        "activation_bytes": int(sum(storage) + sum(unplanned)),
        "storage_blocks": len(storage),
        "unplanned_bytes": int(sum(unplanned)),
    }


_CALL = re.compile(r"^\s*call\s+(\S+)\s+in:\s*(.*?)\s+dst:\s*(\S+)\s*$")


def _constant_pool(ex) -> list[str]:
    """The executable's constant pool, one string per entry (from ``ex.stats()``)."""
    text = ex.stats()
    m = re.search(r"Constant pool \(# (\d+)\): \[", text)
    if m is None:
        raise ValueError("no constant pool in the executable's statistics")
    entries, depth, quoted, cur = [], 0, False, []
    i = m.end()
    while i < len(text):
        ch = text[i]
        if quoted:
            cur.append(ch)
            if ch == "\\":
                cur.append(text[i + 1])
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
            cur.append(ch)
        elif ch in "[(":
            depth += 1
            cur.append(ch)
        elif ch in "])":
            if depth == 0:
                entries.append("".join(cur).strip())
                break
            depth -= 1
            cur.append(ch)
        elif ch == "," and depth == 0:
            entries.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    if len(entries) != int(m.group(1)):
        raise ValueError(f"read {len(entries)} constants, the executable says {m.group(1)}")
    return entries


def _ints(entry: str) -> Optional[list[int]]:
    m = re.fullmatch(r"shapetuple\[([\d,\s]*)\]", entry)
    if m is None:
        return None
    return [int(v) for v in m.group(1).replace(" ", "").split(",") if v]


def _concat_convs_copies(spec: list[int], args: list[str], tensor_bytes: dict) -> int:
    """Bytes the copy members of a ``concat_convs`` call copy (``spec``: its
    :class:`..compile.tactics.abi.ConcatSpec` values; ``args``: the members' arguments)."""
    from ..compile.tactics import abi  # (here: compile imports lowering)

    copied, a = 0, 0
    for member in abi.ConcatSpec.from_shape(spec).members:
        if member.kind == abi.COPY:
            copied += sum(tensor_bytes.get(x, 0) for x in args[a : a + member.nargs])
        a += member.nargs
    return copied


def _report_executable(ex) -> dict[str, Any]:
    from ..compile.tactics import abi  # the tactic library's calls (here: compile imports lowering)

    library_copy_concats = (abi.CONCAT.name,)  # calls that copy their inputs into a concatenation
    pool = _constant_pool(ex)
    text = ex.as_text()
    main = text.split("\n\n", 1)[0] if text.startswith("@main") else text
    tensor_bytes: dict = {}  # register -> bytes of the tensor allocated into it
    storage: list[int] = []
    kernels = concat = fused = split = copied = 0

    def const(arg: str) -> Optional[str]:
        m = re.fullmatch(r"c\[(\d+)\]", arg)
        return pool[int(m.group(1))] if m else None

    for line in main.splitlines():
        m = _CALL.match(line)
        if m is None:
            continue
        name, args, dst = m.group(1), [a.strip() for a in m.group(2).split(",") if a.strip()], m.group(3)
        if name == "vm.builtin.alloc_storage":
            _, size_arg, *_ = args
            size = _ints(const(size_arg) or "")
            storage.append(int(np.prod(size)) if size else 0)
        elif name == "vm.builtin.alloc_tensor" and len(args) == 4:
            # alloc_tensor(storage, offset, shape, dtype): every tensor lives in a planned storage
            _, _, shape_arg, dtype_arg = args
            shape = _ints(const(shape_arg) or "")
            if shape is not None:
                tensor_bytes[dst] = _shape_bytes(shape, const(dtype_arg) or "float32")
        elif not name.startswith("vm."):
            kernels += 1
            if _is_copy_concat_name(name) or name in library_copy_concats:
                concat += 1
                copied += tensor_bytes.get(args[-1], 0)
            elif name == abi.CONCAT_CONVS.name:  # convs write in place; its copy members copy
                spec_arg, *members, _out = args
                spec = _ints(const(spec_arg) or "") or []
                copied += _concat_convs_copies(spec, members, tensor_bytes)
            elif "concatenate" in name:
                fused += 1
            elif re.fullmatch(r"(fused_)?split\d*(_inplace\d*)?", name):
                split += 1
    return {
        "source": "executable (kernels recognised by name)",
        "kernels": kernels,
        "concat_kernels": concat,
        "concat_bytes_copied": copied,
        "concat_fused": fused,
        "split_kernels": split,
        "activation_bytes": int(sum(storage)),
        "storage_blocks": len(storage),
        "unplanned_bytes": 0,
    }


def format_concat_report(ours: dict, default: Optional[dict] = None) -> str:
    """``bytes copied by concat: 0; peak activation memory X vs TVM default Y`` (+ kernel counts)."""
    line = f"bytes copied by concat: {ours['concat_bytes_copied']}; peak activation memory {ours['activation_bytes']}"
    if default is not None:
        line += f" vs TVM default {default['activation_bytes']}"
    line += f" (concat kernels {ours['concat_kernels']}"
    if default is not None:
        line += f"; TVM default copies {default['concat_bytes_copied']} bytes in {default['concat_kernels']}"
    return line + ")"


def plan_check(plan: Optional[FusionPlan], report: InPlaceReport) -> dict[str, Any]:
    """The plan's in-place concats next to what the lowering did (counts; a mismatch is logged).

    The lowering also finds concats the plan did not mark (it checks the same conditions on
    the Relax module) and concats ``FuseOps`` already fused into a consumer disappear
    before it runs, so the numbers may differ for good reasons; the report says which."""
    planned = len(plan.groups_of("concat")) if plan is not None else None
    done = len(report.in_place)  # block roots and the views (nested or prefix) in them
    out = {"plan_in_place": planned, "lowering_in_place": done, "lowering_fallback": len(report.fallback)}
    if planned is not None and planned != done:
        log.info("concat: the plan marks %d concat(s) in place, the lowering made %d free", planned, done)
    return out
