"""tune: MetaSchedule for the kernels that stay with TVM, one database per target.

::

    tune MODEL [--target cpu] [--trials N] [--budget SECONDS] [--tactics auto|onednn|tvm]
               [--rpc HOST:PORT --key KEY | --tracker HOST:PORT --key KEY]

1. the model is imported, fused and given its tactics exactly as ``compile`` does, so the
   kernels tuned are the ones ``compile`` will build (layers run by oneDNN are not tasks);
2. TVM's pipeline runs up to ``FuseTIR`` and the layerfuse lowering passes (in-place
   concat, split outputs): each distinct PrimFunc left is a task;
3. ``meta_schedule.tune_tasks`` searches schedules (evolutionary search, XGBoost cost model),
   measured here or - ``--rpc``/``--tracker`` - on the board through TVM's RPC runner (a
   tracker spreads the measurements over its boards); a tqdm bar shows trials, the best
   latency of the last task measured, and the time left;
4. the records go into the JSON database of the target (:func:`database_dir`), appended to
   what earlier runs found: a run can be stopped and resumed, and ``compile`` for the same
   target applies the database (``MetaScheduleApplyDatabase`` after the lowering passes).
"""

from __future__ import annotations

import contextlib
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


@dataclass
class TuneResult:
    database: Path
    tasks: int
    trials: int
    seconds: float


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
    from ..planner import plan as make_plan
    from .build import lift_weights, relax_module, safe_param_names
    from .presets import resolve
    from .tactics import apply_tactics

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
    mod = safe_param_names(mod)
    with tgt:
        lowered = tvm.transform.Sequential(LayerfusePipeline(tgt, stop_after="InPlaceConcat").passes())(mod)
    tasks = ms.relax_integration.extract_tasks(lowered, tgt)
    if not tasks:
        raise UsageError("the model has no kernel left for TVM to tune (every layer runs on a tactic library)")
    work_dir = database_dir(spec.target, spec.host)
    work_dir.mkdir(parents=True, exist_ok=True)
    # generous timeouts: a loaded 2-core build machine needs tens of seconds per popen worker
    builder = ms.builder.LocalBuilder(timeout_sec=180)
    runner: Any = ms.runner.LocalRunner(timeout_sec=60)
    if rpc or tracker:
        if not key:
            raise UsageError("--rpc/--tracker need --key KEY, the device key the boards registered with")
        host, _, port = (tracker or rpc).rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"--{'tracker' if tracker else 'rpc'} {tracker or rpc!r}: expected HOST:PORT")
        config = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port), tracker_key=key, session_timeout_sec=60)
        runner = ms.runner.RPCRunner(rpc_config=config, f_alloc_argument=alloc_random_arguments)
    # MetaSchedule's own lines (its console log handlers, the C++ side's warnings on fd 2) go
    # to this module's debug log; its complete logs stay in the database's logs/ folder. The
    # bar is drawn on a duplicate of the terminal's stderr, which the redirection leaves alone.
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    start = time.monotonic()
    counted = [0]
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
            measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"), _progress_callback(bar, budget, start, counted)],
        )
        done = counted[0]
    seconds = time.monotonic() - start
    log.info("tuned %d tasks, %d trials in %.0f s; database %s", len(tasks), done, seconds, work_dir)
    return TuneResult(database=work_dir, tasks=len(tasks), trials=done, seconds=seconds)
