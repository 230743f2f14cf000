"""tune: MetaSchedule for the kernels that stay with TVM, one database per target, starting
from the schedule rules.

::

    tune MODEL [--target cpu] [--trials N] [--budget SECONDS] [--tactics auto|onednn|tvm]
               [--rpc HOST:PORT --key KEY | --tracker HOST:PORT --key KEY]

1. the model is imported, fused and given its tactics exactly as ``compile`` does, so the
   kernels tuned are the ones ``compile`` will build (layers run by oneDNN are not tasks);
2. TVM's pipeline runs up to ``FuseTIR`` and the layerfuse lowering passes (in-place
   concat, split outputs): each distinct PrimFunc left is a task;
3. the rules first (:func:`seed_rule_records`): each task's PrimFunc is scheduled by the CPU
   schedule rules (:func:`.schedules.apply.rule_schedule`, a traced ``s_tir.Schedule``, its
   root block annotated ``layerfuse.rule = <rule>``), the trace is checked to replay on the
   task's workload from its JSON form (as the database stores it and MetaSchedule re-applies
   it), the kernel is built and measured with the builder and runner the search uses (here or
   on the board), and committed as a ``TuningRecord`` (trace, workload, run_secs, target,
   args_info). A task with no rule, or whose rule schedule failed to build or run, is logged
   and left to the search; a task whose rule trace does not replay (a rule step outside the
   schedule primitives, e.g. a transformation of the PrimFunc before ``s_tir.Schedule``) is
   logged and left out of the search, so that ``compile`` keeps the rule's schedule rather
   than a searched one never measured against it; a record already in the database (same
   trace) is not measured again;
4. ``meta_schedule.tune_tasks`` searches schedules in TVM's default design space (evolutionary
   search, XGBoost cost model), measured here or - ``--rpc``/``--tracker`` - on the board
   through TVM's RPC runner (a tracker spreads the measurements over its boards); a tqdm bar
   shows trials, the best latency of the last task measured, and the time left;
5. the records go into the JSON database of the target (:func:`database_dir`), appended to
   what earlier runs found: a run can be stopped and resumed, and ``compile`` for the same
   target applies the database (``MetaScheduleApplyDatabase`` after the lowering passes).

Why a record, and what it guarantees. The database answers a query with the record of least
mean ``run_secs`` for the workload (by structural equality), so with the rule's record in it a
searched schedule is applied only when it measured faster than the rule's: tuning never makes
a kernel slower than the untuned build, up to measurement noise. MetaSchedule's evolutionary
search also seeds a fifth of its population with the database's best records of the task
(its log says ``Picked top 1 candidate(s) from database``), so the rule's schedule takes part
in the search from the first round. (A rule's trace has no sampling decisions, so the
mutators cannot vary it: it is the yardstick and a member of the population, not a family of
candidates.) The alternative, the rule as a design space (``ScheduleFn`` beside TVM's
``PostOrderApply`` in a ``SpaceGeneratorUnion``), was measured and left out: a 64->64 3x3
conv at 56x56 tuned with 16 trials never had the rule's schedule measured (the cost model
and the random picks drew only from TVM's space), so nothing guaranteed the result; with the
record, a tune of 8 trials on the same conv kept the rule's schedule (4.5 ms measured against
17.7 ms for the best searched one, on a loaded machine): the tuned artifact computes what
the untuned one does with the same kernel, at its speed.

``compile`` reports a kernel whose applied record is a rule's own as ``<rule> (tuning
database)`` and one the search found as ``metaschedule`` (:mod:`.schedules.apply`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from .. import native_output
from ..errors import UsageError
from .tune_database import database_dir

log = logging.getLogger(__name__)


NOT_REPLAYED = "its trace does not replay on the workload"


@dataclass
class RuleRecord:
    """A task's schedule from the rules, as measured before the search (``seconds`` None:
    it could not be measured, ``note`` says why; ``stored`` False: the database had it already)."""

    task: str
    rule: Optional[str]
    seconds: Optional[float] = None
    stored: bool = False
    note: str = ""


@dataclass
class TuneResult:
    database: Path
    tasks: int
    trials: int
    seconds: float
    rule_records: list[RuleRecord] = dataclasses.field(default_factory=list)  # the rules' schedules, measured first


def _progress_callback(bar, budget: Optional[float], start: float, counted: list[int]):
    import tvm.s_tir.meta_schedule as ms
    from tvm.ir.utils import derived_object

    @derived_object
    class _Progress(ms.measure_callback.PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
            best = None
            for r in runner_results:
                if r.error_msg is None and r.run_secs:
                    t = sum(float(x) for x in r.run_secs) / len(r.run_secs)
                    best = t if best is None else min(best, t)
            counted[0] += len(runner_results)  # a disabled bar (progress=False) counts nothing
            bar.update(len(runner_results))
            if best is not None:
                bar.set_postfix_str(f"task {task_id}: best {best * 1e3:.3f} ms")
            if budget is not None and time.monotonic() - start > budget:
                for k, record in enumerate(task_scheduler.tasks_):
                    if not record.is_terminated:  # terminating a task twice is a fatal check in TVM
                        task_scheduler.terminate_task(k)

    return _Progress()


def _replays(sch, workload) -> bool:
    """The schedule's trace, replayed on the workload as MetaSchedule does (from its JSON
    form, as the database stores it), gives the same kernel."""
    import tvm
    from tvm import s_tir

    replay = s_tir.Schedule(workload)
    try:
        s_tir.Trace.apply_json_to_schedule(sch.trace.as_json(), replay)
        tvm.ir.assert_structural_equal(replay.mod, sch.mod)
    except Exception as e:  # noqa: BLE001 - a step the trace cannot replay, or a different kernel
        log.debug("the trace does not replay: %s", str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return False
    return True


def _holds_trace(database, workload, sch) -> bool:
    """The database has a measured record of ``workload`` with the same trace already."""
    text = str(sch.trace)
    return any(str(r.trace) == text for r in database.get_top_k(workload, 1 << 16))


def seed_rule_records(tasks: Sequence[Any], database, *, target, builder, runner) -> list[RuleRecord]:
    """Measure every task's schedule from the rules with the tune's builder and runner and
    commit it to ``database`` as a tuning record (see the module docstring); returns what
    happened per task. A schedule that cannot become a record (no rule, a trace that does
    not replay, a failed build or run) is logged and left out."""
    import tvm.s_tir.meta_schedule as ms

    from .schedules.apply import RULE_MARK, rule_schedule
    from .schedules.base import CPUParams

    out: list[RuleRecord] = []
    if target.kind.name != "llvm":  # the rules are CPU rules (GPU targets: dlight's, applied by TVM)
        return out
    params = CPUParams.of(target)
    pending = []  # (RuleRecord, workload module, schedule)
    for task in tasks:
        workload = task.dispatched[0]  # the module MetaSchedule tunes and ``compile`` queries
        sch, rule = rule_schedule(workload["main"], params, target)
        rec = RuleRecord(task.task_name, rule)
        out.append(rec)
        if sch is None:
            rec.note = "no rule applies"
        else:
            sch.annotate(sch.get_sblock("root", func_name="main"), RULE_MARK, rule)
            if not _replays(sch, workload):
                rec.note = NOT_REPLAYED
            elif database.has_workload(workload) and _holds_trace(database, database.commit_workload(workload), sch):
                rec.note = "already in the database"
            else:
                pending.append((rec, workload, sch))
        if rec.note:
            log.info("task %s (%s): the rule's schedule is not measured: %s", rec.task, rule or "-", rec.note)
    if not pending:
        return out
    log.debug("building the rules' schedules of %d tasks", len(pending))
    built = builder.build([ms.builder.BuilderInput(sch.mod, target) for _, _, sch in pending])
    runs: list[Any] = []
    for (rec, workload, sch), b in zip(pending, built):
        if b.error_msg is not None:
            rec.note = f"build failed: {b.error_msg.strip().splitlines()[-1] if b.error_msg.strip() else '?'}"
            continue
        args = ms.arg_info.ArgInfo.from_prim_func(workload["main"])
        runs.append((rec, workload, sch, b, args))
    log.debug("measuring the rules' schedules of %d tasks", len(runs))
    futures = runner.run([ms.runner.RunnerInput(b.artifact_path, "cpu", args) for *_, b, args in runs]) if runs else []
    for (rec, workload, sch, b, args), future in zip(runs, futures):
        result = future.result()
        ms.utils.remove_build_dir(b.artifact_path)
        secs = [float(x) for x in (result.run_secs or [])]
        if result.error_msg is not None or not secs or max(secs) >= 1e9:
            error = (result.error_msg or "no time").strip().splitlines()
            rec.note = f"run failed: {error[-1] if error else '?'}"
            continue
        database.commit_tuning_record(
            ms.database.TuningRecord(sch.trace, database.commit_workload(workload), run_secs=result.run_secs, target=target, args_info=args)
        )
        rec.seconds, rec.stored = sum(secs) / len(secs), True
    for rec in out:
        if rec.stored:
            log.info("task %s: the rule %s measured %.3f ms, stored as the first record", rec.task, rec.rule, rec.seconds * 1e3)
        elif rec.note.startswith(("build failed", "run failed")):
            log.warning("task %s: the rule's schedule (%s) is not a record: %s", rec.task, rec.rule, rec.note)
    return out


def build_kernel(mod, target, _params):
    """MetaSchedule's default build (``default_build`` of its ``LocalBuilder``) without the
    import of every tensor intrinsic it starts with (``tvm.s_tir.tensor_intrin``): a fresh
    builder pool, that is every batch of candidates, paid 50 s of CPU for it on a loaded
    2-core machine, more than the builds themselves. Building a scheduled kernel does not
    look intrinsics up (a tensorized block already holds the intrinsic's body). Runs in
    MetaSchedule's builder worker process."""
    from tvm.driver import build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    return build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


def alloc_random_arguments(session, device, args_info, alloc_repeat: int):
    """MetaSchedule's argument allocation for a board, with the random data made here.

    MetaSchedule fills the measured kernels' arguments with the board's
    ``tvm.contrib.random.random_fill_for_measure``, which a runtime-only TVM (what boards
    run) does not have; every measurement then fails. The values do not matter for timing:
    they are drawn here (seeded) and copied over the RPC session. Runs in MetaSchedule's
    runner worker process."""
    import numpy as np
    from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common

    rng = np.random.default_rng(0)

    def fill(arg) -> None:
        shape, dtype = tuple(int(d) for d in arg.shape), str(arg.dtype)
        if dtype == "bool":
            values = rng.integers(0, 2, shape).astype(bool)
        elif dtype.startswith(("int", "uint")):
            values = rng.integers(0, 8, shape).astype(dtype)
        else:
            values = rng.uniform(-1.0, 1.0, shape).astype(dtype)
        arg.copyfrom(values)

    return alloc_argument_common(fill, device, args_info, alloc_repeat)


@contextlib.contextmanager
def _unnamed_handlers_detached(logger_name: str):
    """MetaSchedule rebuilds its loggers from a dictConfig that names every handler already on
    its logger, and fails on one without a name (an application's, or pytest's capture
    handler after a first run in the same process): such handlers are detached meanwhile."""
    logger = logging.getLogger(logger_name)
    unnamed = [h for h in logger.handlers if h.get_name() is None]
    for h in unnamed:
        logger.removeHandler(h)
    try:
        yield
    finally:
        for h in unnamed:
            logger.addHandler(h)


def measurers(*, rpc: Optional[str] = None, tracker: Optional[str] = None, key: Optional[str] = None):
    """(MetaSchedule builder, runner) of a tune: built here, measured here or on the board."""
    import tvm.s_tir.meta_schedule as ms

    # generous timeouts: a loaded 2-core build machine needs tens of seconds per popen worker
    builder = ms.builder.LocalBuilder(timeout_sec=180, f_build=build_kernel)
    if not (rpc or tracker):
        return builder, ms.runner.LocalRunner(timeout_sec=60)
    if not key:
        raise UsageError("--rpc/--tracker need --key KEY, the device key the boards registered with")
    host, _, port = (tracker or rpc).rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--{'tracker' if tracker else 'rpc'} {tracker or rpc!r}: expected HOST:PORT")
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port), tracker_key=key, session_timeout_sec=60)
    return builder, ms.runner.RPCRunner(rpc_config=config, f_alloc_argument=alloc_random_arguments)


def compile_module(model: Any, spec, *, tactics: str = "auto", input_shapes: Optional[Mapping[str, Sequence[int]]] = None):
    """(the Relax module ``compile`` hands to the pipeline for ``model``, the target MetaSchedule
    tunes it for: the preset's, with ``num-cores``, which MetaSchedule needs)."""
    import tvm

    from ..planner import plan as make_plan
    from .build import lift_weights, relax_module, safe_param_names
    from .tactics import apply_tactics

    tgt = spec.tvm_target()
    if tgt.kind.name == "llvm" and "num-cores" not in spec.target:  # MetaSchedule needs the core count
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        with_cores = {**spec.target, "num-cores": cores}
        tgt = tvm.target.Target(with_cores, host=spec.host) if spec.host else tvm.target.Target(with_cores)
    p = make_plan(model, input_shapes=input_shapes)
    mod, params, _ = relax_module(model, plan=p, fuse=True, input_shapes=input_shapes)
    mod, _ = apply_tactics(mod, params, spec, tactics=tactics)
    mod, _ = lift_weights(mod, params)
    return safe_param_names(mod), tgt


def tune_model(
    model: Any,
    *,
    target: str = "cpu",
    arch: Optional[str] = None,
    trials: int = 256,
    budget: Optional[float] = None,
    tactics: str = "auto",
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
    rpc: Optional[str] = None,
    tracker: Optional[str] = None,
    key: Optional[str] = None,
    progress: bool = True,
) -> TuneResult:
    """Tune the TVM kernels of ``model`` for ``target``; returns where the records went."""
    import tvm
    import tvm.s_tir.meta_schedule as ms
    from tqdm import tqdm

    from ..lowering import LayerfusePipeline
    from .presets import resolve

    if trials < 1:
        raise UsageError(f"--trials {trials}: expected a positive number of measurements")
    if budget is not None and budget <= 0:
        raise UsageError(f"--budget {budget}: expected a positive number of seconds")
    try:
        import xgboost  # noqa: F401 (MetaSchedule's cost model; imported by it only after the first measurements)
    except ImportError:
        raise UsageError(
            "tune needs the xgboost package (MetaSchedule's cost model) and it is not installed; "
            "install it with `pip install xgboost-cpu`"
        ) from None
    spec = resolve(target, arch=arch)
    mod, tgt = compile_module(model, spec, tactics=tactics, input_shapes=input_shapes)
    with tgt:
        lowered = tvm.transform.Sequential(LayerfusePipeline(tgt, stop_after="NarrowBlockedIndices").passes())(mod)
    tasks = ms.relax_integration.extract_tasks(lowered, tgt)
    if not tasks:
        raise UsageError("the model has no kernel left for TVM to tune (every layer runs on a tactic library)")
    work_dir = database_dir(spec.target, spec.host)
    work_dir.mkdir(parents=True, exist_ok=True)
    builder, runner = measurers(rpc=rpc, tracker=tracker, key=key)
    # MetaSchedule's own lines (its console log handlers, the C++ side's warnings on fd 2) go
    # to this module's debug log; its complete logs stay in the database's logs/ folder. The
    # bar is drawn on a duplicate of the terminal's stderr, which the redirection leaves alone.
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    start = time.monotonic()
    counted = [0]
    with native_output.to_log("MetaSchedule", log):
        database = ms.database.JSONDatabase(work_dir=str(work_dir), allow_missing=True)
        seeded = seed_rule_records(tasks, database, target=tgt, builder=builder, runner=runner)
        untraceable = {r.task for r in seeded if r.note == NOT_REPLAYED}
        for name in sorted(untraceable):
            log.warning(
                "kernel %s is not tuned: its rule's schedule cannot be stored as a record (a step that is not a "
                "traced schedule primitive), so a searched schedule could not be measured against it",
                name,
            )
        tasks = [t for t in tasks if t.task_name not in untraceable]
    if not tasks:
        terminal.close()
        seconds = time.monotonic() - start
        return TuneResult(database=work_dir, tasks=0, trials=0, seconds=seconds, rule_records=seeded)
    with (
        terminal,
        tqdm(total=trials, disable=not progress, unit="trial", desc=f"tune {len(tasks)} tasks", file=terminal) as bar,
        native_output.to_log("MetaSchedule", log),
    ):
        with _unnamed_handlers_detached("tvm.s_tir.meta_schedule"):
            contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(tasks, work_dir=str(work_dir))
        ms.tune_tasks(
            tasks=contexts,
            task_weights=weights,
            work_dir=str(work_dir),
            max_trials_global=trials,
            # every task gets a first batch within the budget (the scheduler visits each task once
            # before it spends trials where the gradient points)
            num_trials_per_iter=max(8, min(64, trials // len(contexts))),
            builder=builder,
            runner=runner,
            database=database,
            measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"), _progress_callback(bar, budget, start, counted)],
        )
        done = counted[0]
    seconds = time.monotonic() - start
    log.info("tuned %d tasks, %d trials in %.0f s; database %s", len(tasks), done, seconds, work_dir)
    return TuneResult(database=work_dir, tasks=len(tasks), trials=done, seconds=seconds, rule_records=seeded)
